"""Several FP8 projections of one input in one kernel launch (``kernels.quant_gemm.fp8_linear_fused``) vs the same
projections as separate FP8 kernels vs XLA's dequantise-then-GEMM, at the release's projection sizes and decode
token counts; optionally a decode step with release-precision weights vs bf16 weights. One process on the GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_fused_fp8.py --out DIR [--decode 12L] [--budget-s 150] [--skip-gemm]
        [--sweep [--sweep-budget-s 120]]
    python benchmarks/bench_fused_fp8.py --smoke          # CPU: tiny sizes, interpret mode, no timing

Groups (each projection FP8 e4m3, 32 x 32 blocks, e8m0 scales; K = 5120 = d): the attention's wq_a (1280) + wkv
(512), which read the attention site's normalised input, and the shared expert's w1 + w3 (2304 + 2304), which read
the FFN site's. For M = 1, 8, 64 tokens (bf16 activations):
  fused     one ``fp8_linear_fused`` launch for the group (default tiling; a few other tilings at M = 1 / 8)
  separate  one ``fp8_linear`` kernel per projection (the default tiling of each)
  xla       each weight dequantised to bf16 by XLA, then XLA's GEMM (the ``reference`` backend)
Timing: each jitted call runs the group on R distinct weight sets (together > the 50 MB L2) and is divided by R.
``dev µs``: device time from one ``jax.profiler.trace`` of a call, every kernel on the device's streams summed
(launch gaps not counted); ``wall µs``: host clock, median of 20 calls / R (launch gaps and dispatch included).
% of 4.8 TB/s (datasheet), % of the copy bandwidth and of the read-only bandwidth measured in the same run (4 GiB
buffers), from the bytes that must move: weights + scales, activations, outputs (dev µs). Every row checks its
outputs against float32 on the dequantised weights (rel err).

``--decode 12L|bench40``: the Engine's decode step (``decode_and_sample``) with bf16 weights vs the release's
weights (FP8 / FP4 / Engram-row bytes on device, random, GEMM inputs rounded to FP8, ``quantized_gemm=pallas_gpu``),
bf16 cache filled to ``--context`` tokens, batch ``--batches``: median synced step over 10 steps, and 10 steps queued;
``--engram-host`` adds the release weights with the Engram tables in host memory (``inference.host_tables``).
Skipped when the GEMM part has used ``--budget-s``. Output: DIR/bench_fused_fp8.json (after each part) and tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import bench_quant_gemm as B  # noqa: E402  (random_fp8 / random_fp4, device_time, rel_err)
from ceilings import copy_and_read_bandwidth  # noqa: E402
from dsv41_jax.kernels import quant_gemm as QG  # noqa: E402

DATASHEET_BW = 4.8e12
BE = "pallas_gpu_interpret" if SMOKE else "pallas_gpu"
K = 256 if SMOKE else 5120
GROUPS = ({"attn wq_a+wkv": (80, 32), "shared w1+w3": (64, 64)} if SMOKE else
          {"attn wq_a+wkv": (1280, 512), "shared w1+w3": (2304, 2304)})
MS = (1, 5) if SMOKE else (1, 8, 64)
EXTRA_TILINGS = {1: [dict(block_n=16), dict(prefetch=16), dict(num_warps=8)],
                 8: [dict(block_n=64)], 64: [dict(block_n=64, split_k=2)]}
if SMOKE:
    EXTRA_TILINGS = {1: [dict(block_n=16, block_k=64)], 5: []}
# --sweep: tilings of the fused gemv form at M = 1 (fp8_gemm_fused's arguments; the first row is the committed
# default, the same-run baseline). What they vary: rows per program (block_n: 2-32; the grid is N / block_n
# programs, so smaller blocks mean finer waves and a shorter tail, larger ones fewer re-reads of the activation row),
# bytes per K step and per thread (block_k, num_warps: 16 B per thread is one vector load), how many K steps are
# loaded ahead (prefetch: the bytes each program keeps in flight; = K / block_k loads a program's whole stream at
# once), the group view (the scale bytes as one [block_k / 32] load per step instead of a [block_k] gather) and a K
# split (partial sums added by XLA). Ordered by expected value: the sweep budget cuts the tail.
SWEEP_M1 = [dict(),
            dict(group_view=True, block_n=8, block_k=256, prefetch=8, num_warps=8),
            dict(group_view=True, block_n=8, block_k=512, prefetch=4, num_warps=8),
            dict(group_view=True, block_n=8, block_k=512, prefetch=10, num_warps=8),
            dict(group_view=True, block_n=4, block_k=512, prefetch=10, num_warps=4),
            dict(group_view=True, block_n=16, block_k=256, prefetch=8, num_warps=8),
            dict(group_view=True, block_n=16, block_k=512, prefetch=4, num_warps=8),
            dict(block_n=8, block_k=512, prefetch=4, num_warps=8),
            dict(block_n=8, block_k=512, prefetch=10, num_warps=8),
            dict(block_n=8, block_k=256, prefetch=20, num_warps=8),
            dict(block_n=4, block_k=512, prefetch=8, num_warps=4),
            dict(block_n=4, block_k=1024, prefetch=5, num_warps=8),
            dict(block_n=16, block_k=256, prefetch=8, num_warps=8),
            dict(block_n=8, block_k=256, prefetch=8, num_warps=4),
            dict(group_view=True, block_n=32, block_k=256, prefetch=4, num_warps=16),
            dict(block_n=2, block_k=1024, prefetch=5, num_warps=4),
            dict(group_view=True, block_n=8, block_k=256, prefetch=8, num_warps=8, split_k=2)]
if SMOKE:
    SWEEP_M1 = [dict(), dict(block_n=4, block_k=64, prefetch=4, num_warps=4), dict(group_view=True, block_k=64),
                dict(block_n=2, block_k=128, prefetch=2, num_warps=4), dict(block_n=8, block_k=64, split_k=2)]
OUT: dict = {"meta": {}, "ceilings": {}, "gemm": [], "sweep": [], "decode": [], "errors": []}
T0 = time.time()


def log(*a):
    print(*a, flush=True)


def dev_and_wall_us(fn, args, r):
    out = jax.block_until_ready(fn(*args))
    if SMOKE:
        return float("nan"), float("nan"), out
    tot, _ = B.device_time(fn, *args)
    ts = []
    for _ in range(20):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return tot / r * 1e6, statistics.median(ts) / r * 1e6, out


def ceilings():
    OUT["ceilings"] = copy_and_read_bandwidth(lambda fn, args: dev_and_wall_us(fn, args, 1)[0],
                                              (1 << 16) if SMOKE else (1 << 30))
    log(f"copy {OUT['ceilings']['copy_bw'] / 1e12:.2f} TB/s (read + write of 4 GiB), read-only "
        f"{OUT['ceilings']['read_bw'] / 1e12:.2f} TB/s, datasheet {DATASHEET_BW / 1e12:.1f} TB/s")


def gemm_group(name, ns, m):
    key = jax.random.PRNGKey(m * 131 + ns[0])
    wbytes = sum(n * K + -(-n // 32) * -(-K // 32) for n in ns)
    r = 2 if SMOKE else int(min(16, max(2, -(-(160 << 20) // wbytes))))
    sets = [[B.random_fp8(jax.random.fold_in(key, 16 * i + j), n, K) for j, n in enumerate(ns)] for i in range(r)]
    x = jax.random.normal(key, (m, K), jnp.float32).astype(jnp.bfloat16)
    nbytes = wbytes + m * K * 2 + sum(m * n * 2 for n in ns)
    want = [jnp.einsum("mk,nk->mn", x.astype(jnp.float32), w.dequantize(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST) for w in sets[0]]
    variants = [("fused", lambda x, s: [QG.fp8_linear_fused(x, ws, backend=BE) for ws in s], {}),
                ("separate", lambda x, s: [[QG.fp8_linear(x, w, backend=BE) for w in ws] for ws in s], {}),
                ("xla", lambda x, s: [[QG.fp8_linear(x, w, backend="reference") for w in ws] for ws in s], {})]
    for tiling in EXTRA_TILINGS.get(m, []):
        variants.append((f"fused {tiling}", lambda x, s, t=tiling: [QG.fp8_linear_fused(x, ws, backend=BE, tuning=t)
                                                                   for ws in s], tiling))
    bw = OUT["ceilings"]
    for vname, f, tiling in variants:
        try:
            dev, wall, out = dev_and_wall_us(jax.jit(f), (x, sets), r)
            err = max(B.rel_err(o, w_) for o, w_ in zip(out[0], want))
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the rest still runs
            OUT["errors"].append(f"{name} M={m} {vname}: {type(e).__name__}: {str(e)[:300]}")
            log(f"{name} M={m} {vname}: FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        row = dict(group=name, ns=list(ns), k=K, m=m, variant=vname, tiling=tiling, reps=r, bytes=nbytes,
                   dev_us=dev, wall_us=wall, rel_err=err,
                   pct_datasheet=100 * nbytes / (dev * 1e-6) / DATASHEET_BW,
                   pct_copy=100 * nbytes / (dev * 1e-6) / bw.get("copy_bw", DATASHEET_BW),
                   pct_read=100 * nbytes / (dev * 1e-6) / bw.get("read_bw", DATASHEET_BW))
        OUT["gemm"].append(row)
        log(f"| {name} | {m} | {vname} | {dev:.2f} | {wall:.2f} | {row['pct_datasheet']:.0f}% | "
            f"{row['pct_copy']:.0f}% | {row['pct_read']:.0f}% | {err:.1e} |")


def sweep_m1(name, ns, budget_s):
    """Every SWEEP_M1 tiling of one group at M = 1, all traced in one profile (each with its own kernel name:
    ``sweep_quant_gemm.trace_configs``), plus XLA's read-only row sum over exactly the weights' bytes."""
    from sweep_quant_gemm import trace_configs

    key = jax.random.PRNGKey(977 + ns[0])
    wbytes = sum(n * K + -(-n // 32) * -(-K // 32) for n in ns)
    r = 2 if SMOKE else int(min(16, max(2, -(-(160 << 20) // wbytes))))
    sets = [[B.random_fp8(jax.random.fold_in(key, 16 * i + j), n, K) for j, n in enumerate(ns)] for i in range(r)]
    x = jax.random.normal(key, (1, K), jnp.float32).astype(jnp.bfloat16)
    nbytes = wbytes + K * 2 + sum(n * 2 for n in ns)
    want = [jnp.einsum("mk,nk->mn", x.astype(jnp.float32), w.dequantize(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST) for w in sets[0]]
    from dsv41_jax.kernels import quant_gemm_gpu as G

    calls, meta = [], []
    for i, cfg in enumerate(SWEEP_M1):
        if time.time() - T0 > budget_s:
            log(f"(sweep budget: skipping {name} configurations {i}..)")
            OUT["errors"].append(f"sweep {name}: configurations {i}.. skipped (budget)")
            break
        tag = f"ffs{ns[0]}c{i}z"
        try:
            tiling = G.fp8_default_tiling(1, sum(ns), K, **dict({"num_warps": 8}, **cfg))
            fn = jax.jit(lambda x, s, cfg=cfg, tag=tag: [QG.fp8_linear_fused(x, ws, backend=BE,
                                                                             tuning=dict(cfg, name=tag))
                                                        for ws in s])
            out = jax.block_until_ready(fn(x, sets))
            err = max(B.rel_err(o, w_) for o, w_ in zip(out[0], want))
            calls.append((tag, fn, (x, sets)))
            meta.append((tag, cfg, tiling, err))
        except Exception as e:  # noqa: BLE001 - a configuration that fails is reported, the rest still runs
            OUT["errors"].append(f"sweep {name} {cfg}: {type(e).__name__}: {str(e)[:300]}")
            log(f"sweep {name} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}")
    if not SMOKE:
        arrs = [jnp.full((wbytes // (4 * 1024), 1024), i + 1, jnp.int32) for i in range(r)]
        read_fn = jax.jit(lambda vs: [jnp.sum(v, axis=1) for v in vs])
        read_us = dev_and_wall_us(read_fn, (arrs,), r)[0]
        del arrs
        times = trace_configs(calls)
    else:
        read_us, times = float("nan"), {}
    log(f"{name}: XLA read-only row sum over the same {wbytes / 1e6:.1f} MB: {read_us:.2f} µs "
        f"({100 * wbytes / (read_us * 1e-6) / DATASHEET_BW:.0f}% of 4.8 TB/s)")
    bw = OUT["ceilings"]
    for tag, cfg, t, err in meta:
        tot, kern = times.get(tag, (float("nan"), float("nan")))
        us = tot / r * 1e-3
        row = dict(group=name, ns=list(ns), k=K, m=1, cfg=cfg, tiling=t, reps=r, bytes=nbytes, dev_us=us,
                   kernel_us=kern / r * 1e-3, rel_err=err, xla_read_us=read_us,
                   pct_datasheet=100 * nbytes / (us * 1e-6) / DATASHEET_BW,
                   pct_read=100 * nbytes / (us * 1e-6) / bw.get("read_bw", DATASHEET_BW))
        OUT["sweep"].append(row)
        desc = (f"{'group view ' if t['group_view'] else ''}bn{t['block_n']} bk{t['block_k']} pf{t['prefetch']} "
                f"w{t['num_warps']} sk{t['split_k']}"
                + (" [default]" if not cfg else ""))
        log(f"| {name} | {desc} | {us:.2f} | {row['pct_datasheet']:.0f}% | {row['pct_read']:.0f}% | {err:.1e} |")


def random_release_params(config, params, key):
    """``params`` with every tensor the release stores FP8 / FP4 / Engram-rows replaced by random bytes of that
    format made on device (the layout ``release_weights.quantize_params`` produces; decode time does not depend on
    the values; FP8 codes avoid NaN, scales near 2^-8)."""
    from dsv41_jax.checkpoint import names as N
    from dsv41_jax.checkpoint.quantized import QuantizedTensor
    from dsv41_jax.model import release_weights as RW

    formats = RW.storage_formats(config)
    counter = [0]

    def rand_bytes(shape, lo, hi, fp8):
        counter[0] += 1
        v = jax.random.randint(jax.random.fold_in(key, counter[0]), shape, lo, hi, jnp.int32)
        if fp8:
            v = jnp.where((v & 127) == 127, v - 1, v)
        return v.astype(jnp.uint8)

    def one(path, w):
        fmt = formats.get(path, N.FLOAT)
        if fmt == N.FLOAT:
            return w
        shape = tuple(w.shape)
        lead, (o, i) = shape[:-2], shape[-2:]
        if fmt == N.FP8_BLOCK:
            qt = QuantizedTensor(rand_bytes(shape, 0, 256, True), rand_bytes(lead + (-(-o // 32), -(-i // 32)), 115,
                                                                            122, False), fmt, shape, (32, 32))
        elif fmt == N.FP4_ROWS:
            scales = rand_bytes(lead + (o, i // N.FP4_BLOCK), 118, 124, False)
            # the largest scale byte, read back as a loaded checkpoint records it: the grouped FP4 kernel's decode
            # choice (``quant_gemm_gpu.fp4_grouped_decode``) follows it
            qt = QuantizedTensor(rand_bytes(lead + (o, i // 2), 0, 256, False), scales, fmt, shape,
                                 (1, N.FP4_BLOCK), int(jax.device_get(jnp.max(scales))))
        else:  # ENGRAM_ROWS
            qt = QuantizedTensor(rand_bytes(shape, 0, 256, True),
                                 rand_bytes(lead + (o, i // N.ENGRAM_BLOCK), 115, 122, False), fmt, shape,
                                 (1, N.ENGRAM_BLOCK))
        return qt

    return RW._map_with_path(one, params)


def decode_compare(model, batches, context, save=lambda: None, engram_host=False):
    from bench_inference import decode_inputs, fill_cache
    from profile_decode import MODELS
    from dsv41_jax.inference.cache import init_cache
    from dsv41_jax.inference.decode import decode_and_sample
    from dsv41_jax.inference.host_tables import engram_table_bytes
    from dsv41_jax.inference.step import InferenceOptions
    from dsv41_jax.model.params import init_params
    from dsv41_jax.model.release_weights import dequantize_wo_a, weight_bytes

    config = MODELS[model]()
    base = dict(quant_sim=False, index_block_elems=1 << 28)
    log(f"decode: {config.name}, init bf16 params ({time.time() - T0:.0f} s)")
    params_bf16 = jax.block_until_ready(init_params(config, jax.random.PRNGKey(0), jnp.bfloat16))
    log(f"decode: random release params ({time.time() - T0:.0f} s)")
    forms = {"bf16": (params_bf16, InferenceOptions(**base)),
             # the Engine's serving form: wo_a dequantised to bf16 once, at load (release_weights.dequantize_wo_a)
             "release": (dequantize_wo_a(random_release_params(config, params_bf16, jax.random.PRNGKey(5)),
                                         jnp.bfloat16),
                         InferenceOptions(**base, gemm_input_fp8=True, quantized_gemm=BE))}
    jax.block_until_ready(forms["release"][0])
    if engram_host:  # the same release weights with the Engram tables in host memory (inference.host_tables)
        from dsv41_jax.inference.host_tables import place_engram_tables

        forms["release, Engram in host memory"] = (place_engram_tables(forms["release"][0]), forms["release"][1])
    log(f"decode: params ready ({time.time() - T0:.0f} s)")
    for b in batches:
        for form, (params, opts) in forms.items():
            row = dict(model=config.name, batch=b, context=context, weights=form,
                       weight_gb=weight_bytes(params) / 1e9,
                       engram_tables_gb={k: v / 1e9 for k, v in engram_table_bytes(params).items()})
            try:
                cache = init_cache(config, b, context + 64, jnp.bfloat16)
                cache = jax.jit(fill_cache, static_argnums=(1,), donate_argnums=(0,))(cache, context,
                                                                                     jax.random.PRNGKey(1))
                samp, eids, tok, act = decode_inputs(config, b)

                def step(cache, i, read_back=True):
                    nxt, cache = decode_and_sample(params, cache, tok, eids, act, *samp,
                                                   jnp.full((b,), i, jnp.int32), config=config, opts=opts)
                    if read_back:
                        np.asarray(nxt)
                    return cache

                log(f"decode: batch {b} {form}: compiling the step ({time.time() - T0:.0f} s)")
                t0 = time.perf_counter()
                cache = step(cache, 0)
                row["compile_s"] = time.perf_counter() - t0
                ts = []
                for i in range(10):
                    t0 = time.perf_counter()
                    cache = step(cache, 1 + i)
                    ts.append(time.perf_counter() - t0)
                jax.block_until_ready(cache)
                t0 = time.perf_counter()
                for i in range(10):
                    cache = step(cache, 20 + i, read_back=False)
                jax.block_until_ready(cache)
                row.update(step_ms=statistics.median(ts) * 1e3, queued_ms=(time.perf_counter() - t0) / 10 * 1e3)
                del cache
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            OUT["decode"].append(row)
            log(json.dumps(row))
            save()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--decode", default="", help="model for the decode-step comparison (12L, bench40; '' = none)")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--budget-s", type=float, default=150.0, help="no decode part once the GEMM part took this long")
    ap.add_argument("--skip-gemm", action="store_true", help="only the decode comparison (and the ceilings)")
    ap.add_argument("--engram-host", action="store_true",
                    help="decode: also the release weights with the Engram tables in host memory")
    ap.add_argument("--sweep", action="store_true", help="the fused gemv tilings of SWEEP_M1 at M = 1, both groups")
    ap.add_argument("--sweep-budget-s", type=float, default=120.0,
                    help="no further sweep configuration once this long has passed since the start")
    args = ap.parse_args()
    OUT["meta"] = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), jax=jax.__version__,
                       devices=[d.device_kind for d in jax.devices()],
                       command="python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]))
    log(json.dumps(OUT["meta"]))

    def save():
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_fused_fp8.json"), "w") as f:
                json.dump(OUT, f, indent=1, default=str)

    try:
        ceilings()
    except Exception as e:  # noqa: BLE001
        OUT["errors"].append(f"ceilings: {type(e).__name__}: {e}")
    save()
    log("| group | M | variant | dev µs | wall µs | % of 4.8 TB/s | % of copy BW | % of read-only BW | rel err |\n"
        "|---|---:|---|---:|---:|---:|---:|---:|---:|")
    if args.sweep:
        log("\n| group (M = 1) | tiling | dev µs | % of 4.8 TB/s | % of read-only BW | rel err |\n"
            "|---|---|---:|---:|---:|---:|")
        for gi, (name, ns) in enumerate(GROUPS.items()):  # each group gets its share of the budget
            try:
                sweep_m1(name, ns, args.sweep_budget_s * (gi + 1) / len(GROUPS))
            except Exception as e:  # noqa: BLE001
                OUT["errors"].append(f"sweep {name}: {type(e).__name__}: {str(e)[:400]}")
                log(f"sweep {name} FAILED: {type(e).__name__}: {str(e)[:300]}")
            save()
    for m in () if args.skip_gemm else MS:
        for name, ns in GROUPS.items():
            gemm_group(name, ns, m)
            save()
    if args.decode:
        if time.time() - T0 > args.budget_s:
            log(f"decode comparison skipped: {time.time() - T0:.0f} s used (budget {args.budget_s:.0f} s)")
            OUT["errors"].append("decode comparison skipped: budget")
        else:
            try:
                decode_compare(args.decode, [int(b) for b in args.batches.split(",")], args.context, save,
                               args.engram_host)
            except Exception as e:  # noqa: BLE001
                OUT["errors"].append(f"decode: {type(e).__name__}: {str(e)[:400]}")
                log(f"decode FAILED: {type(e).__name__}: {str(e)[:300]}")
        save()
    bad = [r for r in OUT["gemm"] + OUT["sweep"] if not r["rel_err"] < 8e-3]
    log(f"\nerrors: {OUT['errors'] or 'none'}; rows over 8e-3 rel err: {len(bad)}; elapsed {time.time() - T0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
