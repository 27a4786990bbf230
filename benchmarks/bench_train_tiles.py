#!/usr/bin/env python
"""The attention backward's tiles chosen by a sweep, then the train step with them against the defaults, in one
process on one accelerator; plus the AdamW update alone against the copy bandwidth.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/bench_train_tiles.py --out DIR --deadline-s 200
    python benchmarks/bench_train_tiles.py --smoke --out DIR        # CPU: tiny sizes, interpret mode / tiny preset

1. Ceilings of this process: the bf16 matmul rate (``profile_train.matmul_rate``) and the copy bandwidth (an int32
   ``v + 1`` over 4 GiB, read + write bytes).
2. ``sweep_attention_bwd.sweep`` over ``--configs`` in the ``prefix`` (fullwidth4's two ratio-2 layers) and
   ``sparse`` (its ratio-1 layer) cases at the step's shape; ``pick_best`` takes the fastest dQ tiles and the fastest
   dKV tiles by 2 x prefix + 1 x sparse, each only if faster than the default there and within 1e-2 of its gradients.
3. The train step (``profile_train.run_variant``, ``none:forward+blocked``, fullwidth4): the defaults (the earlier
   tiles, every master cast each step) and the picked tiles (``kernels.GPU_BWD_DEFAULTS`` set before tracing) with
   ``TrainConfig.compute_copy`` at batch 4, then batch 8, then each change alone; a variant is skipped when fewer
   than ``--variant-s`` seconds (x 1.6 at the larger batch) remain of ``--deadline-s``.
4. The AdamW update alone on the fullwidth4 state (bf16 gradients upcast inside, as in the step): time and bytes
   moved (26 B per parameter: p, m, v read and written in float32, g read in bf16) against the copy bandwidth.

Rows go to DIR/bench_train_tiles.jsonl as they are measured; tables are printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sweep_attention_bwd as SW  # noqa: E402
from bench_train import preset  # noqa: E402
from profile_train import matmul_rate, run_variant  # noqa: E402

from dsv41_jax import kernels as KN  # noqa: E402
from dsv41_jax.train.config import TrainConfig  # noqa: E402
from dsv41_jax.train.step import make_train_step  # noqa: E402

DATASHEET_BF16 = 989e12  # H100 / H200 SXM dense bf16, vendor datasheet
_T0 = time.time()


def log(msg: str) -> None:
    print(f"[tiles {time.time() - _T0:6.1f}s] {msg}", flush=True)


def copy_bandwidth(n_int32: int) -> float:
    """Read + write bytes/s of ``v + 1`` over an int32 buffer: best of 10 after a warm-up."""
    a = jnp.full((n_int32 // 1024, 1024), 3, jnp.int32)
    f = jax.jit(lambda v: v + 1)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    del a
    return 2 * 4 * n_int32 / best


def adamw_alone(preset_name: str, batch: int, seq: int) -> dict:
    """The step's optimiser update + apply on the preset's full state, timed alone (median of 5)."""
    config = preset(preset_name)
    tc = TrainConfig(seq_len=seq, batch_size=batch, steps=1000, warmup_steps=10, lr=1e-4, compute_dtype="bfloat16")
    step = make_train_step(config, tc)
    state = step.init_state(seed=0)
    keys = jax.random.split(jax.random.PRNGKey(1), len(jax.tree.leaves(state["params"])))
    leaves, treedef = jax.tree.flatten(state["params"])
    grads = jax.tree.unflatten(treedef, [(1e-3 * jax.random.normal(k, x.shape, jnp.float32)).astype(jnp.bfloat16)
                                         for k, x in zip(keys, leaves)])
    import optax

    def update(params, opt_state, g):
        g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
        u, opt_state = step.optimizer.update(g, opt_state, params)
        u = jax.tree.map(lambda x: (jnp.float32(1e-4) * x).astype(x.dtype), u)
        return optax.apply_updates(params, u), opt_state

    f = jax.jit(update, donate_argnums=(0, 1) if jax.default_backend() != "cpu" else ())
    p, o = f(state["params"], state["opt_state"], grads)
    jax.block_until_ready(p)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        p, o = f(p, o, grads)
        jax.block_until_ready(p)
        times.append(time.perf_counter() - t0)
    n = sum(x.size for x in jax.tree.leaves(p))
    hlo = f.lower(p, o, grads).compile().as_text()
    del p, o, grads, state
    med = statistics.median(times)
    return {"what": "adamw_alone", "params": int(n), "ms_median": med * 1e3, "bytes": 26 * int(n),
            "bytes_per_s": 26 * n / med, "fusions": hlo.count(" fusion(")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--preset", default="fullwidth4")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batches", default="4,8")
    p.add_argument("--configs", default="0,3,5,11,12,13,15,6,7,8,18,10",
                   help="indices into sweep_attention_bwd.CONFIGS (0, the default, first)")
    p.add_argument("--parallel", type=int, default=12, help="sweep configurations compiled at a time")
    p.add_argument("--deadline-s", type=float, default=200.0, help="no new train variant after this many seconds")
    p.add_argument("--variant-s", type=float, default=40.0, help="seconds one train variant needs")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    smoke = SMOKE or args.smoke
    os.makedirs(args.out, exist_ok=True)
    sink = os.path.join(args.out, "bench_train_tiles.jsonl")

    def emit(rec):
        with open(sink, "a") as f:
            f.write(json.dumps(rec) + "\n")

    dev = jax.devices()[0]
    head = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__, "preset": args.preset,
            "seq": args.seq, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "defaults_before": dict(KN.GPU_BWD_DEFAULTS["16bit"])}
    peak = matmul_rate(512 if smoke else 8192)
    head["matmul_bf16_flops_measured"] = peak
    head["copy_bytes_per_s"] = copy_bandwidth(1 << 20 if smoke else 1 << 30)
    log(f"{head['device']}: bf16 matmul {peak / 1e12:.1f} TFLOP/s, copy {head['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    emit(head)

    # 2. sweep -> picked tiles
    configs = [SW.CONFIGS[int(i)] for i in args.configs.split(",") if i != ""]
    rows = SW.sweep(["prefix", "sparse"], configs, batch=4, seq=args.seq, smoke=smoke, parallel=args.parallel,
                    sink_path=os.path.join(args.out, "sweep_attention_bwd.jsonl"), log=log)
    pick = SW.pick_best(rows, {"prefix": 2, "sparse": 1})
    tuned = {k[4:]: v for k, v in pick["tuning"].items()}
    emit({"what": "pick", **pick, "tuned_defaults": tuned})
    log(f"picked: {pick['tuning'] or 'the default'}")

    # 3. train step: the defaults (tiles, casting the masters every step) vs the picked tiles + the compute copy;
    # in order of importance, each skipped when too little of the deadline is left
    default = dict(KN.GPU_BWD_DEFAULTS["16bit"])
    tiles = {**default, **tuned}
    b_small, *b_more = [int(x) for x in args.batches.split(",") if x]
    plan = [("default", b_small, default, ""), ("tuned+copy", b_small, tiles, "+copy")]
    plan += [("tuned+copy", b, tiles, "+copy") for b in b_more]
    if tuned:
        plan.append(("tuned", b_small, tiles, ""))  # the tiles alone
    plan.append(("default+copy", b_small, default, "+copy"))  # the copy alone
    plan += [("default", b, default, "") for b in b_more]
    train_rows = []
    for label, b, tl, flag in plan:
        left = args.deadline_s - (time.time() - _T0)
        if left < args.variant_s * (1.6 if b > b_small else 1.0):
            log(f"skip train {label} batch {b}: {left:.0f} s left of the deadline")
            continue
        KN.GPU_BWD_DEFAULTS["16bit"] = dict(tl)
        jax.clear_caches()  # the step is traced afresh with these tiles (same function, same shapes otherwise)
        ns = types.SimpleNamespace(preset="tiny" if smoke else args.preset, batch=b, seq=64 if smoke else args.seq,
                                   steps=1 if smoke else args.steps, warmup=1 if smoke else args.warmup,
                                   query_chunk=256, profile_steps=0)
        try:
            row = run_variant(ns, "none:forward+blocked" + flag, peak, args.out, profile=False)
        except Exception as e:
            row = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
        finally:
            KN.GPU_BWD_DEFAULTS["16bit"] = dict(default)
        row.update({"what": "train", "label": label, "tiles": tl, "batch": b})
        if "step_ms_median" in row:
            row["mfu_datasheet"] = row["model_flops_per_token"] * row["tokens_per_s"] / DATASHEET_BF16
        emit(row)
        train_rows.append(row)
        log(json.dumps(row))

    # 4. the optimiser alone
    opt = None
    if args.deadline_s - (time.time() - _T0) > 15 or smoke:
        try:
            opt = adamw_alone("tiny" if smoke else args.preset, 4, 64 if smoke else args.seq)
            opt["fraction_of_copy_bw"] = opt["bytes_per_s"] / head["copy_bytes_per_s"]
        except Exception as e:
            opt = {"what": "adamw_alone", "error": f"{type(e).__name__}: {str(e)[:500]}"}
        emit(opt)
        log(json.dumps(opt))

    SW.print_table(rows)
    print(f"\npicked (2 x prefix + 1 x sparse, vs default {default}): {pick['tuning'] or 'the default'}")
    print(f"\n{head['device']}, {args.preset}, seq {args.seq}, bf16; matmul measured {peak / 1e12:.0f} TFLOP/s; "
          f"datasheet {DATASHEET_BF16 / 1e12:.0f}")
    print("| variant (tiles) | batch | step ms | tokens/s | MFU vs measured | MFU vs datasheet | temporaries GiB "
          "| master casts | fusions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in train_rows:
        if "error" in r:
            print(f"| {r['label']} | {r['batch']} | error: {r['error'][:200]} |")
            continue
        print(f"| {r['label']} {json.dumps(r['tiles'])} | {r['batch']} | {r['step_ms_median']:.1f} | "
              f"{r['tokens_per_s']:,.0f} | {r['mfu_measured_matmul']:.1%} | {r['mfu_datasheet']:.1%} | "
              f"{r['temp_size_in_bytes'] / 2 ** 30:.2f} | {r['hlo_master_casts']} | {r['hlo_fusions']} |")
    if opt and "error" not in opt:
        print(f"\nAdamW alone: {opt['params'] / 1e9:.2f} B params, {opt['ms_median']:.2f} ms, "
              f"{opt['bytes_per_s'] / 1e12:.2f} TB/s = {opt['fraction_of_copy_bw']:.0%} of the copy bandwidth "
              f"({head['copy_bytes_per_s'] / 1e12:.2f} TB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
