"""Several FP8 projections of one input in one kernel launch (``kernels.quant_gemm.fp8_linear_fused``) vs the same
projections as separate FP8 kernels vs XLA's dequantise-then-GEMM, at the release's projection sizes and decode
token counts; optionally a decode step with release-precision weights vs bf16 weights. One process on the GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_fused_fp8.py --out DIR [--decode 12L] [--budget-s 150] [--skip-gemm]
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
bf16 cache filled to ``--context`` tokens, batch ``--batches``: median synced step over 10 steps, and 10 steps queued.
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
OUT: dict = {"meta": {}, "ceilings": {}, "gemm": [], "decode": [], "errors": []}
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
            qt = QuantizedTensor(rand_bytes(lead + (o, i // 2), 0, 256, False),
                                 rand_bytes(lead + (o, i // N.FP4_BLOCK), 118, 124, False), fmt, shape,
                                 (1, N.FP4_BLOCK))
        else:  # ENGRAM_ROWS
            qt = QuantizedTensor(rand_bytes(shape, 0, 256, True),
                                 rand_bytes(lead + (o, i // N.ENGRAM_BLOCK), 115, 122, False), fmt, shape,
                                 (1, N.ENGRAM_BLOCK))
        return qt

    return RW._map_with_path(one, params)


def decode_compare(model, batches, context):
    from bench_inference import decode_inputs, fill_cache
    from profile_decode import MODELS
    from dsv41_jax.inference.cache import init_cache
    from dsv41_jax.inference.decode import decode_and_sample
    from dsv41_jax.inference.step import InferenceOptions
    from dsv41_jax.model.params import init_params
    from dsv41_jax.model.release_weights import weight_bytes

    config = MODELS[model]()
    base = dict(quant_sim=False, index_block_elems=1 << 28)
    params_bf16 = init_params(config, jax.random.PRNGKey(0), jnp.bfloat16)
    forms = {"bf16": (params_bf16, InferenceOptions(**base)),
             "release": (random_release_params(config, params_bf16, jax.random.PRNGKey(5)),
                         InferenceOptions(**base, gemm_input_fp8=True, quantized_gemm=BE))}
    jax.block_until_ready(forms["release"][0])
    for b in batches:
        for form, (params, opts) in forms.items():
            row = dict(model=config.name, batch=b, context=context, weights=form,
                       weight_gb=weight_bytes(params) / 1e9)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--decode", default="", help="model for the decode-step comparison (12L, bench40; '' = none)")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--budget-s", type=float, default=150.0, help="no decode part once the GEMM part took this long")
    ap.add_argument("--skip-gemm", action="store_true", help="only the decode comparison (and the ceilings)")
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
                decode_compare(args.decode, [int(b) for b in args.batches.split(",")], args.context)
            except Exception as e:  # noqa: BLE001
                OUT["errors"].append(f"decode: {type(e).__name__}: {str(e)[:400]}")
                log(f"decode FAILED: {type(e).__name__}: {str(e)[:300]}")
        save()
    bad = [r for r in OUT["gemm"] if not r["rel_err"] < 8e-3]
    log(f"\nerrors: {OUT['errors'] or 'none'}; rows over 8e-3 rel err: {len(bad)}; elapsed {time.time() - T0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
