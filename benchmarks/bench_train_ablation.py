#!/usr/bin/env python
"""The train step's recent changes timed apart, in one process on one accelerator: a 2 x 2 of the attention
backward's tiles (the earlier defaults vs ``kernels.GPU_BWD_DEFAULTS``) and ``TrainConfig.compute_copy``, plus
candidate variants, every row against the bf16 matmul rate measured first in the same process.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/bench_train_ablation.py --out DIR --deadline-s 200
    python benchmarks/bench_train_ablation.py --smoke --out DIR      # CPU: tiny preset, 2 variants

Every variant is traced and lowered first, one after the other (the tiles are read at trace time, so
``kernels.GPU_BWD_DEFAULTS`` is set around each trace), then all are compiled at once in threads (XLA compiles
outside the GIL), then each is run in turn on a fresh state (``profile_train``'s step, ``none:forward`` with the
blocked MoE: ``--warmup`` + ``--steps`` steps, median). A variant not started by ``--deadline-s`` is skipped. Rows go
to DIR/bench_train_ablation.jsonl as they are measured; a table is printed last.

Variants (``--variants``, comma-separated): ``before`` (the tiles before the sweep of 2026-12-02), ``tiles`` (the
current defaults), each with an optional ``+copy`` (``compute_copy``), ``+atomic`` (both dKV kinds by fp32
atomics instead of by key block) and ``+grouped`` (``moe_impl="grouped"``: the Pallas grouped expert GEMM that reads
the weights in place, with the tiles of ``--grouped-tiles`` if given — a file ``bench_grouped_gemm.py`` writes —
instead of the blocked XLA form) or ``+mgpu`` (``moe_impl="grouped_mgpu"``: JAX's Mosaic GPU ragged-dot kernels,
tiles from ``--mgpu-tiles``), optionally ``+gbnB`` (B = 1, 2, 4, 8: the Mosaic kernels' ``grid_block_n`` ceiling for
all three products, lowered per product and shape by ``grouped_gemm_mgpu.product_tiles`` to a band that divides the
output columns; the tiles each product got are in the row), ``+qstages1`` / ``+qstages2`` (the attention backward's
dQ kernel pipelined over 1 or 2 stages; 2 is the default since 2026-12-02 14:29), ``+kstages1`` / ``+kstages2`` (its
dKV kernels over 1 or 2 stages), ``+skloop`` / ``+skpallas`` (``ops.mhc.SINKHORN_FORM``: the mHC Sinkhorn as XLA's
loop or as ``kernels.mhc_gpu.sinkhorn_comb``, one kernel forward and one backward per site), ``+dxterms`` / ``+dxreduce`` / ``+dxminor`` / ``+dxdot`` / ``+dxpallas`` (``ops.linear.NARROW_DX_FORM``:
the form of the narrow float32 projections' input gradient — the mHC coefficients, the router; ``+dxpallas`` is the
``kernels.narrow_dx_gpu`` kernel, in interpret mode on a CPU). Each row also times the same steps dispatched back to
back (``step_ms_pipelined``: how the trainer runs them, reading metrics every few steps). The MFU denominator is
``profile_train.matmul_probe`` (the best of four large bf16 GEMM shapes after 2 s of warm-up each), measured first;
every row is also given against ``--ref-matmul`` (797 TFLOP/s, what earlier calls measured) and the 989 TFLOP/s
datasheet peak. ``--profile VARIANTS`` profiles those variants after it is timed (``--profile-steps``
steps, device time summed by kernel and category as ``profile_train.py`` does), writes their optimised HLO beside the
trace (``hlo_<variant>.txt.gz``: kernel names are fusion names there) and the trace's time by kernel family
(``families_<variant>.txt``, ``trace_families.py``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import glob
import gzip
import json
import os
import shutil
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_train import model_flops_per_token, preset  # noqa: E402
from profile_train import H200_BF16_DATASHEET, hlo_stats, matmul_probe, summarize_trace  # noqa: E402
import trace_families  # noqa: E402

from dsv41_jax import kernels as KN  # noqa: E402
from dsv41_jax.kernels import grouped_gemm_gpu as GG  # noqa: E402
from dsv41_jax.kernels import grouped_gemm_mgpu as GM  # noqa: E402
from dsv41_jax.model.model import default_hasher  # noqa: E402
from dsv41_jax.ops import linear as LIN  # noqa: E402
from dsv41_jax.ops import mhc as MHC  # noqa: E402
from dsv41_jax.train.testing import random_batch  # noqa: E402
from dsv41_jax.train.config import TrainConfig  # noqa: E402
from dsv41_jax.train.step import make_train_step  # noqa: E402

# the 16-bit backward tiles before the sweep (benchmarks/RESULTS.md, 2026-12-02 05:25; key_warps: attention_bwd's 8)
TILES_BEFORE = {"block_h": 32, "block_k": 16, "num_warps": 4}
DEFAULT_VARIANTS = "before,tiles,before+copy,tiles+copy,tiles+copy+atomic"
SMOKE_VARIANTS = "before,tiles+copy+grouped,tiles+copy+mgpu+gbn4"
_T0 = time.time()


def log(msg: str) -> None:
    print(f"[ablation {time.time() - _T0:6.1f}s] {msg}", flush=True)


def parse_variant(name: str) -> dict:
    base, *flags = name.split("+")
    bands = [f for f in flags if f in ("gbn1", "gbn2", "gbn4", "gbn8")]
    dx_forms = {"dxterms": "terms", "dxreduce": "reduce", "dxminor": "minor", "dxdot": "dot",
                "dxpallas": "pallas_gpu" if jax.default_backend() == "gpu" else "pallas_gpu_interpret"}
    sk_forms = {"skloop": "loop", "skpallas": "pallas_gpu" if jax.default_backend() == "gpu" else "pallas_gpu_interpret"}
    known = {"copy", "atomic", "grouped", "mgpu", "qstages1", "qstages2", "kstages1", "kstages2", *dx_forms,
             *sk_forms, *bands}
    if (base not in ("before", "tiles") or set(flags) - known or len(bands) > 1
            or len(set(flags) & set(dx_forms)) > 1 or len(set(flags) & set(sk_forms)) > 1):
        raise ValueError(f"variant {name!r}: want before|tiles, then optional +copy, +atomic, +grouped, +mgpu, "
                         "+gbn1|2|4|8, one of +dxterms|+dxreduce|+dxminor|+dxdot|+dxpallas, +qstages1|2, +kstages1|2, "
                         "+skloop|+skpallas")
    tiles = dict(TILES_BEFORE if base == "before" else KN.GPU_BWD_DEFAULTS["16bit"])
    if "atomic" in flags:
        tiles.update(dkv="atomic", dkv_selected="atomic")
    for stages in (1, 2):
        if f"qstages{stages}" in flags:
            tiles.update(num_stages=stages)
    for stages in (1, 2):
        if f"kstages{stages}" in flags:
            tiles.update(key_stages=stages)
    moe_impl = "grouped" if "grouped" in flags else "grouped_mgpu" if "mgpu" in flags else "blocked"
    dx_form = next((dx_forms[f] for f in flags if f in dx_forms), None)
    sk_form = next((sk_forms[f] for f in flags if f in sk_forms), None)
    return {"name": name, "tiles": tiles, "copy": "copy" in flags, "moe_impl": moe_impl,
            "grid_block_n": int(bands[0][3:]) if bands else None, "narrow_dx_form": dx_form,
            "sinkhorn_form": sk_form}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--preset", default="fullwidth4")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--variants", default=None, help=f"comma-separated (default {DEFAULT_VARIANTS}; with --smoke: "
                   f"{SMOKE_VARIANTS})")
    p.add_argument("--deadline-s", type=float, default=200.0, help="no variant starts running after this")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--grouped-tiles", default=None, help="JSON file of kernels.grouped_gemm_gpu tiles (+grouped)")
    p.add_argument("--mgpu-tiles", default=None, help="JSON file of kernels.grouped_gemm_mgpu tiles (+mgpu)")
    p.add_argument("--profile", default=None, help="variants (comma-separated) to profile after timing them")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--out", default=".")
    p.add_argument("--ref-matmul", type=float, default=797e12,
                   help="a second MFU denominator, FLOP/s (default: the 797 TFLOP/s earlier H200 calls measured)")
    args = p.parse_args(argv)
    smoke = SMOKE or args.smoke
    if smoke:
        args.preset, args.seq, args.steps, args.warmup = "tiny", 64, 1, 1
        args.variants = args.variants or SMOKE_VARIANTS
    args.variants = args.variants or DEFAULT_VARIANTS
    os.makedirs(args.out, exist_ok=True)
    sink = os.path.join(args.out, "bench_train_ablation.jsonl")

    def emit(rec):
        with open(sink, "a") as f:
            f.write(json.dumps(rec) + "\n")

    dev = jax.devices()[0]
    t_probe = time.perf_counter()
    probe = (matmul_probe(((512, 512, 512),), warm_s=0.0) if smoke else matmul_probe())
    peak = probe["best"]
    head = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__, "preset": args.preset,
            "batch": args.batch, "seq": args.seq, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "matmul_bf16_flops_measured": peak,
            "matmul_probe_by_shape": probe["by_shape"], "matmul_probe_s": round(time.perf_counter() - t_probe, 1),
            "matmul_ref_flops": args.ref_matmul, "matmul_datasheet_flops": H200_BF16_DATASHEET,
            "tiles_before": TILES_BEFORE, "tiles_now": dict(KN.GPU_BWD_DEFAULTS["16bit"])}
    emit(head)
    log(f"{head['device']}: bf16 matmul {peak / 1e12:.1f} TFLOP/s (best of "
        + ", ".join(f"{k} {x / 1e12:.1f}" for k, x in probe["by_shape"].items()) + ")")

    config = preset(args.preset)
    variants = [parse_variant(v) for v in args.variants.split(",") if v]
    saved = dict(KN.GPU_BWD_DEFAULTS["16bit"])
    saved_grouped = {k: (dict(v) if isinstance(v, dict) else v) for k, v in GG.GROUPED_TILES.items()}
    saved_mgpu = {k: dict(v) for k, v in GM.MGPU_TILES.items()}
    saved_dx_form = LIN.NARROW_DX_FORM
    saved_sk_form = MHC.SINKHORN_FORM
    grouped_tiles = saved_grouped
    if args.grouped_tiles:
        with open(args.grouped_tiles) as f:
            grouped_tiles = json.load(f)
        head["grouped_tiles"] = grouped_tiles
        emit({"what": "grouped_tiles", "tiles": grouped_tiles})
    if args.mgpu_tiles:
        with open(args.mgpu_tiles) as f:
            GM.MGPU_TILES.update(json.load(f))  # read at trace time; this process traces nothing else with them
        emit({"what": "mgpu_tiles", "tiles": GM.MGPU_TILES})
        saved_mgpu = {k: dict(v) for k, v in GM.MGPU_TILES.items()}
    batch = jax.device_put(random_batch(config, args.batch, args.seq, seed=0, hasher=default_hasher(config)))
    lr = np.float32(1e-4)
    donate = (0,) if jax.default_backend() != "cpu" else ()

    # 1. trace + lower each variant with its tiles (abstract state: no device memory yet)
    for v in variants:
        KN.GPU_BWD_DEFAULTS["16bit"] = dict(v["tiles"])
        GG.GROUPED_TILES.update({k: (dict(x) if isinstance(x, dict) else x) for k, x in grouped_tiles.items()})
        if v["grid_block_n"] is not None:
            for kind in GM.MGPU_TILES:
                GM.MGPU_TILES[kind]["grid_block_n"] = v["grid_block_n"]
        if v["moe_impl"] == "grouped_mgpu":  # the tiles each product gets at the two projection shapes (N, K)
            d, f = config.hidden_size, config.moe_intermediate_size
            v["mgpu_tiles"] = {f"{kind}@w[G,{n},{k}]": GM.product_tiles(kind, k, n)
                               for n, k in ((f, d), (d, f)) for kind in ("fwd", "dx", "dw")}
        if v["narrow_dx_form"] is not None:
            LIN.NARROW_DX_FORM = v["narrow_dx_form"]
        v["narrow_dx_form"] = LIN.NARROW_DX_FORM
        if v["sinkhorn_form"] is not None:
            MHC.SINKHORN_FORM = v["sinkhorn_form"]
        v["sinkhorn_form"] = MHC.SINKHORN_FORM
        jax.clear_caches()
        try:
            tc = TrainConfig(seq_len=args.seq, batch_size=args.batch, steps=1000, warmup_steps=10, lr=1e-4,
                             compute_dtype="bfloat16", remat="none", remat_scope="forward", moe_impl=v["moe_impl"],
                             compute_copy=v["copy"])
            v["step"] = make_train_step(config, tc)
            state_shape = jax.eval_shape(lambda: v["step"].init_state(seed=0))
            t0 = time.perf_counter()
            v["lowered"] = jax.jit(v["step"].step_fn, donate_argnums=donate).lower(state_shape, batch, lr)
            v["lower_s"] = time.perf_counter() - t0
        except Exception as e:
            v["error"] = f"lower: {type(e).__name__}: {str(e)[:1500]}"
        finally:
            KN.GPU_BWD_DEFAULTS["16bit"] = dict(saved)
            GG.GROUPED_TILES.update(saved_grouped)
            GM.MGPU_TILES.update({k: dict(x) for k, x in saved_mgpu.items()})
            LIN.NARROW_DX_FORM = saved_dx_form
            MHC.SINKHORN_FORM = saved_sk_form
        log(f"lowered {v['name']}" + (f": {v['error']}" if "error" in v else f" in {v['lower_s']:.1f} s"))

    # 2. compile them all at once
    def compile_one(v):
        t0 = time.perf_counter()
        v["compiled"] = v["lowered"].compile()
        v["compile_s"] = time.perf_counter() - t0
        return v

    todo = [v for v in variants if "error" not in v]
    with concurrent.futures.ThreadPoolExecutor(max(1, len(todo))) as pool:
        futures = {pool.submit(compile_one, v): v for v in todo}
        for f in concurrent.futures.as_completed(futures):
            v = futures[f]
            try:
                f.result()
                log(f"compiled {v['name']} in {v['compile_s']:.1f} s")
            except Exception as e:
                v["error"] = f"compile: {type(e).__name__}: {str(e)[:1500]}"
                log(f"compile {v['name']} failed: {v['error'][:300]}")

    # 3. run each on a fresh state
    flops = model_flops_per_token(config, args.seq)["total"]
    tokens = args.batch * args.seq
    rows = []
    for v in variants:
        row = {"what": "train", "variant": v["name"], "tiles": v["tiles"], "compute_copy": v["copy"],
               "moe_impl": v["moe_impl"], "mgpu_tiles": v.get("mgpu_tiles"), "narrow_dx_form": v["narrow_dx_form"],
               "sinkhorn_form": v["sinkhorn_form"], "batch": args.batch, "seq": args.seq}
        if "error" in v:
            row["error"] = v["error"]
        elif time.time() - _T0 > args.deadline_s:
            row["error"] = f"skipped: {time.time() - _T0:.0f} s past the start (deadline {args.deadline_s:.0f} s)"
        else:
            compiled = v["compiled"]
            mem = compiled.memory_analysis()
            row.update({"lower_s": round(v["lower_s"], 1), "compile_s": round(v["compile_s"], 1),
                        **hlo_stats(compiled.as_text())})
            for field in ("argument_size_in_bytes", "temp_size_in_bytes"):
                row[field] = int(getattr(mem, field, 0) or 0) if mem is not None else None
            state = v["step"].init_state(seed=0)
            times = []
            for i in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                state, m = compiled(state, batch, lr)
                jax.block_until_ready(state["step"])
                if i == 0:  # the first step from the same fresh state: variants that compute the same agree here
                    row["first_step_metrics"] = {k: float(x) for k, x in m.items() if np.ndim(x) == 0}
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            row["loss"] = float(m["ce"])  # the last timed step's
            # the same number of steps dispatched back to back (no host wait between them, as a training loop that
            # reads its metrics late runs): the host's dispatch overlaps the device's previous step
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, m = compiled(state, batch, lr)
            jax.block_until_ready(state["step"])
            row["step_ms_pipelined"] = (time.perf_counter() - t0) / args.steps * 1e3
            row.update({"step_ms": [round(t * 1e3, 2) for t in times], "step_ms_median": med * 1e3,
                        "tokens_per_s": tokens / med, "model_flops_per_token": flops,
                        "mfu_measured_matmul": flops * tokens / med / peak,
                        "mfu_ref_matmul": flops * tokens / med / args.ref_matmul,
                        "mfu_datasheet": flops * tokens / med / H200_BF16_DATASHEET,
                        "mfu_pipelined_measured_matmul": flops * tokens / (row["step_ms_pipelined"] / 1e3) / peak,
                        "mfu_pipelined_ref_matmul": flops * tokens / (row["step_ms_pipelined"] / 1e3) / args.ref_matmul})
            if v["name"] in (args.profile or "").split(","):
                tag = v["name"].replace("+", "_")
                with gzip.open(os.path.join(args.out, f"hlo_{tag}.txt.gz"), "wt") as f:  # kernels -> HLO -> source
                    f.write(compiled.as_text())
                trace_dir = os.path.join("/tmp", "dsv41_ablation_trace_" + tag)
                t0 = time.perf_counter()
                with jax.profiler.trace(trace_dir):
                    for _ in range(args.profile_steps):
                        state, m = compiled(state, batch, lr)
                    jax.block_until_ready(state["step"])
                summ = summarize_trace(trace_dir)
                summ.update(profiled_steps=args.profile_steps, wall_us=(time.perf_counter() - t0) * 1e6)
                for f in glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz")):
                    if os.path.getsize(f) < 15 * 2 ** 20:  # keep the raw trace next to the results
                        shutil.copy(f, os.path.join(args.out, f"trace_{tag}.json.gz"))
                    families = os.path.join(args.out, f"families_{tag}.txt")
                    try:  # the trace's time by kernel family (trace_families.py, printed and kept)
                        with open(families, "w") as out, contextlib.redirect_stdout(out):
                            trace_families.main(["--hlo", os.path.join(args.out, f"hlo_{tag}.txt.gz"), "--trace", f,
                                                 "--steps", str(args.profile_steps), "--top", "8"])
                        with open(families) as fam:
                            print(fam.read(), flush=True)
                    except Exception as e:  # the timing rows matter more than this summary
                        log(f"trace_families on {f} failed: {type(e).__name__}: {e}")
                row["profile"] = summ
                log(f"profile {v['name']}: busy {summ.get('busy_us', 0) / 1e3:.1f} ms over "
                    f"{args.profile_steps} steps; by category (ms): "
                    + ", ".join(f"{k} {x / 1e3:.1f}" for k, x in summ.get("by_category_us", {}).items()))
                for kk in summ.get("top_kernels", [])[:30]:
                    print(f"  {kk['us'] / 1e3:9.2f} ms  {kk['share']:6.1%}  x{kk['count']:<5d} {kk['name'][:150]}")
            del state, m
        v.pop("compiled", None)
        v.pop("lowered", None)
        emit(row)
        rows.append(row)
        log(json.dumps({k: x for k, x in row.items() if k != "profile"}))

    print(f"\n{head['device']}, {args.preset}, batch {args.batch} x {args.seq}, bf16; matmul measured "
          f"{peak / 1e12:.1f} TFLOP/s (best of {len(probe['by_shape'])} GEMM shapes), ref {args.ref_matmul / 1e12:.0f}, "
          f"datasheet {H200_BF16_DATASHEET / 1e12:.0f}; tiles before {TILES_BEFORE}, now {head['tiles_now']}")
    print("| variant | step ms (median) | tokens/s | MFU vs measured | vs ref | vs datasheet | back-to-back step ms | "
          "b2b MFU vs measured | b2b vs ref | temporaries GiB | fusions |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['error'][:200]} |")
            continue
        print(f"| {r['variant']} | {r['step_ms_median']:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{r['mfu_measured_matmul']:.1%} | {r['mfu_ref_matmul']:.1%} | {r['mfu_datasheet']:.1%} | "
              f"{r['step_ms_pipelined']:.1f} | {r['mfu_pipelined_measured_matmul']:.1%} | "
              f"{r['mfu_pipelined_ref_matmul']:.1%} | {r['temp_size_in_bytes'] / 2 ** 30:.2f} | {r['hlo_fusions']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
