#!/usr/bin/env python
"""Where the train step's time goes, and what rematerialisation costs: one process, one accelerator.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/profile_train.py --preset fullwidth4 \\
        --batch 4 --seq 1024 --variants none:forward,full:forward,full:layer --out DIR

1. The bf16 matmul rate of this device, measured first (8192^3 products, median of 10): the MFU ceiling.
2. Per variant (``remat:scope``, e.g. ``none:forward`` = no remat, ``full:layer`` = ``jax.checkpoint`` around every
   decoder layer keeping nothing, ``dots_no_batch:layer``, ``full:forward`` = one checkpoint around the whole
   forward; a ``+noquant`` suffix turns the release fake quantisation off, ``+blocked`` runs the MoE with
   ``moe_impl="blocked"`` instead of ``ragged_dot``): compile time, XLA's memory analysis,
   median step time, tokens/s and MFU (model FLOPs of ``bench_train.model_flops_per_token`` over the measured rate).
3. The first variant is profiled (``jax.profiler.trace`` over ``--profile-steps`` steps): device events summed by
   kernel name and by category (GEMM, fusion, copy, ...), device-busy time (union of the device's event intervals)
   against the wall time of the profiled steps. The optimised HLO of that variant is written too (gzip), so kernel
   names can be traced back to the JAX source through their ``op_name`` metadata.

Everything is appended to ``DIR/profile_train.jsonl`` as it is measured (a time limit still leaves the results so
far); a table is printed last.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_train import model_flops_per_token, preset  # noqa: E402
from trace_events import load_trace, newest_trace, union_length  # noqa: E402

from dsv41_jax.model.model import default_hasher  # noqa: E402
from dsv41_jax.train.testing import random_batch  # noqa: E402
from dsv41_jax.train.config import TrainConfig  # noqa: E402
from dsv41_jax.train.step import make_train_step  # noqa: E402

_T0 = time.time()


def log(msg: str) -> None:
    print(f"[profile {time.time() - _T0:6.1f}s] {msg}", flush=True)


def matmul_rate(n: int = 8192, reps: int = 20, trials: int = 5) -> float:
    """bf16 x bf16 -> bf16 (f32 accumulation) matmul FLOP/s on the default device, random operands: ``reps``
    back-to-back products per timed trial (no host gap between them), after as many warm-up products (clocks
    ramp up); the best of ``trials``."""
    return _gemm_rate((n, n, n), reps, trials, warm_s=0.0)


# The GEMMs of the robust probe (M, N, K): square and wide, all large enough to fill the GPU many times over
PROBE_SHAPES = ((8192, 8192, 8192), (16384, 8192, 8192), (8192, 16384, 8192), (16384, 16384, 16384))
H200_BF16_DATASHEET = 989e12  # dense bf16 tensor-core peak of an H200 (SXM) datasheet, FLOP/s


def _gemm_rate(shape, reps: int, trials: int, warm_s: float) -> float:
    m, n, k = shape
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    b = jax.random.normal(kb, (k, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    t_end = time.perf_counter() + warm_s
    while True:  # warm-up: at least `reps` products, and at least `warm_s` seconds of them
        for _ in range(reps):
            c = f(a, b)
        c.block_until_ready()
        if time.perf_counter() >= t_end:
            break
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            c = f(a, b)
        c.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / reps)
    del a, b, c
    return 2 * m * n * k / best


def matmul_probe(shapes=PROBE_SHAPES, reps: int = 20, trials: int = 5, warm_s: float = 2.0) -> dict:
    """The bf16 matmul rate as a robust MFU denominator: each of ``shapes`` (M, N, K) timed as ``matmul_rate`` does
    (``reps`` products back to back per trial, the best of ``trials``) after ``warm_s`` seconds of warm-up products
    (clocks and power settle), and the best over the shapes. One 8192^3 GEMM after a short warm-up read 752 to 799
    TFLOP/s on machines of one kind while the train step stayed within 0.1 ms (benchmarks/RESULTS.md, 2026-12-02
    15:15): the best of several large GEMMs after warm-up is less sensitive to when and which GEMM was timed.
    Returns ``{"best": FLOP/s, "by_shape": {"MxNxK": FLOP/s}}``."""
    by_shape = {f"{m}x{n}x{k}": _gemm_rate((m, n, k), reps, trials, warm_s) for m, n, k in shapes}
    return {"best": max(by_shape.values()), "by_shape": by_shape}


# ----------------------------------------------------------------------------------------------------------------
# trace summary
# ----------------------------------------------------------------------------------------------------------------

_CATEGORIES = (  # first match wins (kernel names are lower-cased)
    ("gemm", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "matmul", "dot", "wgmma", "sm90_")),
    ("pallas/triton kernel", ("pallas", "triton", "sparse_attention", "attn", "indexer")),
    ("memcpy/memset", ("memcpy", "memset", "copy")),
    ("scatter/gather", ("scatter", "gather", "dynamic-update-slice", "dynamic_update_slice")),
    ("sort/top-k", ("sort", "topk", "top_k", "cub::")),
    ("reduction", ("reduce", "reduction")),
    ("fusion", ("fusion",)),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in _CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def summarize_trace(trace_dir: str, top: int = 40) -> dict:
    """Device events of the newest ``*.trace.json.gz`` under ``trace_dir`` (written by ``jax.profiler.trace``),
    summed by name and category; busy = union of the device events' intervals, span = first start to last end."""
    path = newest_trace(trace_dir)
    if path is None:
        return {"error": f"no trace under {trace_dir}"}
    events, pid_names, tid_names = load_trace(path)
    device_pids = {p for p, n in pid_names.items() if "/device:" in n and "host" not in n.lower()}
    # A GPU device's process has one line per stream (the kernels) plus summary lines ("XLA Modules", "XLA Ops",
    # ...) that repeat the same time at coarser grain: kernels are summed from the stream lines only, HLO ops from
    # the "XLA Ops" line.
    dev_threads = {k: n for k, n in tid_names.items() if k[0] in device_pids}
    stream_tids = {k for k, n in dev_threads.items() if n.lower().startswith("stream")}
    op_tids = {k for k, n in dev_threads.items() if n.lower().startswith("xla ops")}
    by_name = collections.defaultdict(lambda: [0.0, 0])
    by_cat = collections.defaultdict(float)
    by_hlo = collections.defaultdict(float)
    intervals = []
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device_pids:
            continue
        key = (e["pid"], e.get("tid"))
        dur = float(e.get("dur", 0.0))
        name = e.get("name", "?")
        if key in op_tids:
            by_hlo[name] += dur
        if stream_tids and key not in stream_tids:
            continue
        by_name[name][0] += dur
        by_name[name][1] += 1
        by_cat[category(name)] += dur
        intervals.append((float(e["ts"]), float(e["ts"]) + dur))
    total = sum(v[0] for v in by_name.values())
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    return {
        "trace_file": os.path.basename(path), "device_processes": sorted(pid_names[p] for p in device_pids),
        "device_threads": sorted(set(dev_threads.values()))[:50],
        "events": len(intervals), "kernel_time_us": total, "busy_us": union_length(intervals), "span_us": span,
        "by_category_us": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"name": n, "us": v[0], "count": v[1], "share": v[0] / total if total else 0.0}
                        for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
        "top_hlo_ops_us": dict(sorted(by_hlo.items(), key=lambda kv: -kv[1])[:top]),
        "hlo_op_time_us": sum(by_hlo.values()),
    }


# ----------------------------------------------------------------------------------------------------------------

def hlo_stats(text: str) -> dict:
    """Counts in a compiled step's optimised HLO: fusions; fusions that cast a float32 master (an operand
    ``state__params__*``) to a bf16 array (the per-step weight casts); the Pallas kernels by name with their grids."""
    fusions = casts = 0
    grids = set()
    for line in text.splitlines():
        if " fusion(" in line:
            fusions += 1
            lhs, _, rhs = line.partition(" fusion(")
            if "= bf16[" in lhs and "%state__params__" in rhs.split(")", 1)[0]:
                casts += 1
        elif "custom-call(" in line and "grid_x = " in line:
            name = re.search(r'name = "([^"]+)"', line)
            g = re.search(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", line)
            if name and g:
                grids.add(f"{name.group(1)}:{'x'.join(g.groups())}")
    return {"hlo_fusions": fusions, "hlo_master_casts": casts, "pallas_grids": sorted(grids)}


def run_variant(args, variant: str, peak: float, out_dir: str, profile: bool) -> dict:
    remat, _, rest = variant.partition(":")
    scope, *flags = rest.split("+")
    unknown = set(flags) - {"noquant", "blocked", "copy"}
    if unknown:
        raise ValueError(f"variant {variant!r}: unknown flags {sorted(unknown)} (noquant, blocked, copy)")
    config = preset(args.preset)
    tc = TrainConfig(seq_len=args.seq, batch_size=args.batch, steps=1000, warmup_steps=10, lr=1e-4,
                     compute_dtype="bfloat16", remat=remat, remat_scope=scope or "forward",
                     quant_sim=False if "noquant" in flags else None, query_chunk=args.query_chunk,
                     moe_impl="blocked" if "blocked" in flags else "ragged", compute_copy="copy" in flags)
    step = make_train_step(config, tc)
    state = step.init_state(seed=0)
    batch = jax.device_put(random_batch(config, args.batch, args.seq, seed=0, hasher=default_hasher(config)))
    lr = np.float32(1e-4)
    t0 = time.perf_counter()
    lowered = jax.jit(step.step_fn, donate_argnums=(0,) if jax.default_backend() != "cpu" else ()).lower(
        state, batch, lr)
    compiled = lowered.compile()
    t_compile = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    row = {"variant": variant, "remat": remat, "remat_scope": scope or "forward",
           "quant_sim": "noquant" not in flags, "moe_impl": tc.moe_impl, "compute_copy": tc.compute_copy,
           "compile_s": round(t_compile, 1), **hlo_stats(compiled.as_text())}
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes"):
        row[field] = int(getattr(mem, field, 0) or 0) if mem is not None else None
    if profile:
        with gzip.open(os.path.join(out_dir, "step_hlo.txt.gz"), "wt") as f:
            f.write(compiled.as_text())
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, m = compiled(state, batch, lr)
        jax.block_until_ready(state["step"])
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tokens = args.batch * args.seq
    flops = model_flops_per_token(config, args.seq)
    row.update({"step_ms_median": med * 1e3, "step_ms_min": min(times) * 1e3, "tokens_per_s": tokens / med,
                "model_flops_per_token": flops["total"], "mfu_measured_matmul": flops["total"] * tokens / med / peak,
                "loss": float(m["ce"])})
    if profile:
        trace_dir = os.path.join("/tmp", "dsv41_profile_trace")
        t0 = time.perf_counter()
        with jax.profiler.trace(trace_dir):
            for _ in range(args.profile_steps):
                state, m = compiled(state, batch, lr)
            jax.block_until_ready(state["step"])
        wall = time.perf_counter() - t0
        summ = summarize_trace(trace_dir)
        for f in glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz")):
            if os.path.getsize(f) < 15 * 2 ** 20:  # keep the raw trace next to the results
                shutil.copy(f, os.path.join(out_dir, "step_trace.json.gz"))
        summ["profiled_steps"] = args.profile_steps
        summ["wall_us"] = wall * 1e6
        row["profile"] = summ
    del state, compiled, lowered, batch
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="fullwidth4")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--query-chunk", type=int, default=256)
    p.add_argument("--variants", default="none:forward,full:forward,full:layer")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--tag", default="", help="a label stored with the results (e.g. the XLA flags of this run)")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    sink = os.path.join(args.out, "profile_train.jsonl")

    def emit(rec):
        with open(sink, "a") as f:
            f.write(json.dumps(rec) + "\n")

    dev = jax.devices()[0]
    head = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__, "preset": args.preset,
            "batch": args.batch, "seq": args.seq, "dtype": "bfloat16", "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "tag": args.tag}
    n = 8192 if dev.platform != "cpu" else 512
    peak = matmul_rate(n)
    head["matmul_bf16_flops_measured"] = peak
    log(f"{head['device']}: bf16 matmul {n}^3 at {peak / 1e12:.1f} TFLOP/s")
    emit(head)
    rows = []
    for i, v in enumerate(x for x in args.variants.split(",") if x):
        log(f"variant {v} ...")
        try:
            row = run_variant(args, v, peak, args.out, profile=(i == 0 and not args.no_profile))
        except Exception as e:  # report and go on with the other variants
            row = {"variant": v, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
        emit(row)
        rows.append(row)
        log(json.dumps({k: row[k] for k in row if k != "profile"}))
        if "profile" in row:
            pr = row["profile"]
            log(f"profile: busy {pr.get('busy_us', 0) / 1e3:.1f} ms of {pr.get('wall_us', 0) / 1e3:.1f} ms wall "
                f"({pr.get('profiled_steps')} steps); by category (ms): "
                + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in pr.get("by_category_us", {}).items()))
            for k in pr.get("top_kernels", [])[:25]:
                print(f"  {k['us'] / 1e3:9.2f} ms  {k['share']:6.1%}  x{k['count']:<5d} {k['name'][:150]}")
    print(f"\n{head['device']}, {args.preset}, batch {args.batch} x {args.seq}, bf16; measured matmul "
          f"{peak / 1e12:.0f} TFLOP/s")
    print("| variant | compile s | step ms | tokens/s | MFU (measured matmul) | temporaries GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | error: {r['error'][:200]} |")
            continue
        print(f"| {r['variant']} | {r['compile_s']} | {r['step_ms_median']:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{r['mfu_measured_matmul']:.1%} | {r['temp_size_in_bytes'] / 2 ** 30:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
