"""Where the release-precision decode step's time goes, against bf16, in one process on the GPU; and the routed
experts of one token on the FP4 one-token kernels vs the grouped FP4 kernel they replace.

    PYTHONUNBUFFERED=1 python benchmarks/profile_release_decode.py --out DIR [--model 12L] [--batches 1]
        [--context 4096] [--budget-s 200]
    python benchmarks/profile_release_decode.py --smoke      # CPU: tiny sizes, interpret mode, no timing

Parts (in this order; each guarded, results saved after each):
  ceilings  copy (read + write) and read-only bandwidth of a 4 GiB buffer, device time.
  experts   one token's routed experts at the bench model's widths (top-6 of 2304 x 5120 experts; each call runs
            R = 8 tokens with distinct picks out of 48 experts, > the 50 MB L2): ``routed_fp4_one_token``'s two
            kernels (``fp4_slot_swiglu`` / ``fp4_slot_down``, FP8 rounding of their inputs included) at several
            tilings; the grouped FP4 kernel path it replaces (``ops.moe.routed_ragged``: sort, tile metadata, three
            grouped GEMMs, scatter); the bf16 experts' slot kernels (``inference.moe.routed_slots``). Device µs
            (every kernel of a traced call summed, / R; with each kernel family's share) and wall µs (host clock,
            median of 10 calls / R). Bytes = the picked experts' packed bytes + scales (bf16: the bf16 weights);
            % of 4.8 TB/s and of the read-only bandwidth. Checked: float32 activations against the plain-JAX
            float32 oracle (``backend="reference"``), bf16 against the grouped path.
  decode    the Engine's decode step (``decode_and_sample``, bf16 cache at ``--context``) with bf16 weights, the
            release's weights (FP8 / FP4 / Engram-row bytes on device, GEMM inputs rounded to FP8,
            ``quantized_gemm=pallas_gpu``) on the one-token FP4 kernels (``fp4_one_token=True``), and the same on
            the grouped FP4 kernel (``fp4_one_token=False``) — both with the attention's wo_a dequantised to bf16
            once, at load, as the Engine and the official serving code serve it (``release_weights.dequantize_wo_a``;
            ``--wo-a-fp8``: also the grouped form with wo_a kept FP8 and dequantised inside every step, the form
            measured before); the forms' first calls (trace + compile) run
            concurrently, then each is timed alone: synced step (median of 10, tokens read back),
            queued step (10 dispatched back to back), then 3 steps under ``jax.profiler.trace(...,
            create_perfetto_trace=True)``: device events summed by kernel family (time and launches per step), busy
            (union of device intervals) vs the profiled wall time. XLA runs the step's command buffers as separate
            launches while profiling, so busy and launch counts are those of the ungraphed step. Greedy rows, with
            the sampler ``Engine.generate`` picks for them (``sampling.sampler_for``: the argmax, no vocabulary sort).
            ``--engram-host``: then the release form with the Engram tables in host memory at each batch (item 4).
            ``--device-loop``: each form runs the Engine's device loop instead (``decode_chain``: tokens fed back and
            Engram rows hashed on the device, read back every k of ``--readback`` steps; the step = the largest
            k's; one run of ``--profile-steps`` steps profiled: families, launches per layer, busy %).
            ``--release-cache kernels,unpack``: release-weight forms with the release's packed KV cache (FP8 window,
            FP4 compressed KV and indexer keys), read packed by the attention / indexer kernels
            (``packed_cache_kernels``) or unpacked to bf16 every step. ``--ahead``: every batch's programs compiled
            at once. Every row: its floor (``profile_decode.step_bytes`` of its weights and cache over this
            process's read-only bandwidth) and its speed-up over the bf16 row of its batch.
            For ``--model bench40`` (58.4 GiB of bf16 parameters beside ≈ 21 GB of release weights) set
            ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.92``.
  grouped   (--grouped, first) the grouped FP4 expert GEMM as the batch-32 decode step runs it (192 rows over 16
            experts, w1 / w3 2304 x 5120 and w2 5120 x 2304) at each of GROUPED_TUNINGS (the "tokens" form first:
            the same-run baseline): device µs, % of 4.8 TB/s and of the read-only bandwidth, error against float32.
  dense32   (--dense32, after grouped) the FP8 dense GEMM at M = 32 (the batch-32 step's projections: shared expert
            w1 / w2, wq_b, wo_b) at each of DENSE32_TUNINGS (the default first), as ``grouped``.
  --grouped-tunings '[{...}]': decode forms at batches > 1 whose grouped FP4 kernel takes these tunings
  (``InferenceOptions.fp4_grouped_tuning``), beside the release form on the kernel's defaults; --fp8-tunings the
  same for the FP8 dense kernel (``InferenceOptions.fp8_gemm_tuning``).
Output: DIR/profile_release_decode.json, DIR/log.txt is the caller's tee; the perfetto traces as
DIR/perfetto_<form>_b<batch>.json.gz when under 15 MB.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
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
import bench_quant_gemm as B  # noqa: E402  (random_fp4, device_time, rel_err)
from ceilings import copy_and_read_bandwidth  # noqa: E402
from trace_events import load_trace, newest_trace, union_length  # noqa: E402
from dsv41_jax.kernels import quant_gemm as QG  # noqa: E402
from dsv41_jax.ops.linear import Fp8GemmInput, gemm_input  # noqa: E402

DATASHEET_BW = 4.8e12
BE = "pallas_gpu_interpret" if SMOKE else "pallas_gpu"
E_STACK, TOPK, R = (8, 2, 2) if SMOKE else (48, 6, 8)
F_, D_ = (64, 96) if SMOKE else (2304, 5120)
LIMIT = 10.0
# (swiglu tiling, down tiling): the first is the committed default (the same-run baseline of the others)
TILINGS = [({}, {}),
           (dict(decode="f16"), dict(decode="f16")),  # the kernels' form before the pair decode
           (dict(decode="pair"), dict(decode="pair")),
           (dict(block_k=256, prefetch=8), dict(num_warps=8)),
           (dict(prefetch=2), dict(block_n=8)),
           (dict(block_k=1024, prefetch=2), dict(prefetch=4)),
           (dict(block_k=256, prefetch=4, num_warps=4), dict(block_n=32, num_warps=8)),
           (dict(block_n=16, num_warps=8), dict(block_n=8, num_warps=2))]
if SMOKE:
    TILINGS = [({}, {}), (dict(decode="f16"), dict(decode="f16")),
               (dict(block_n=4, block_k=32, prefetch=1), dict(block_n=4, block_k=32))]
OUT: dict = {"meta": {}, "ceilings": {}, "experts": [], "grouped": [], "dense32": [], "checks": [], "decode": [],
             "errors": []}
T0 = time.time()

# InferenceOptions fields whose forms are the default's program at one token (--release-options skips batch 1)
BATCH1_SAME = {"fp4_every_expert", "fp4_grouped_tuning"}

FAMILIES = [  # (family, pattern on the device event's name), first match wins
    ("Engram rows read from host memory (Pallas)", r"engram_host_rows"),
    ("FP4 experts: one-token gemv kernels", r"fp4_slot_|fp4up_|fp4dn_"),
    ("FP4 experts: grouped GEMM", r"fp4_grouped_gemm"),
    ("FP4 experts: every expert on every token", r"fp4_every_"),
    ("GEMM-input FP8 rounding kernel (Pallas)", r"fp8_round_rows"),
    ("bf16 experts: slot kernels", r"^slot_swiglu|^slot_down"),
    ("FP8 fused gemv (Pallas)", r"fp8_block_gemm_fused"),
    ("FP8 gemv / GEMM (Pallas)", r"fp8_block_gemm"),
    ("sparse attention (Pallas)", r"csa2_"),
    ("indexer + top-k (Pallas)", r"indexer_|topk_select|hier_topk"),
    ("mHC (Pallas)", r"mhc_"),
    ("XLA GEMMs (cuBLAS / Triton gemm fusions)", r"gemm|nvjet|cublas|xmma|cutlass|sm90_"),
    ("sort (cub)", r"cub::|radix_sort|DeviceRadix|DeviceSegmented"),
    ("copies / memset", r"memcpy|memset|Memcpy|Memset"),
    ("XLA fusions (elementwise / reductions)", r"fusion|^loop_|^input_|^wrapped_|^copy|^transpose|^convert|"
                                                r"^reduce|^select|^concatenate|^slice|^dynamic"),
]


def bandwidth_pct(nbytes: float, dev_us: float, bw: dict) -> dict:
    """A kernel's bytes over its device time as % of the H200's 4.8 TB/s datasheet bandwidth and of the read-only
    bandwidth this process measured (``bw["read_bw"]``; the datasheet figure when it was not measured)."""
    rate = nbytes / (dev_us * 1e-6)
    return dict(pct_datasheet=100 * rate / DATASHEET_BW, pct_read=100 * rate / bw.get("read_bw", DATASHEET_BW))


def log(*a):
    print(*a, flush=True)


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name):
            return fam
    return "other"


def device_us(fn, args, r):
    """(device µs / r, {family: µs / r}) of one call, or NaNs on CPU."""
    jax.block_until_ready(fn(*args))
    if SMOKE:
        return float("nan"), {}
    tot, by_name = B.device_time(fn, *args)
    fams = collections.Counter()
    for nm, t in by_name.items():
        fams[family(nm)] += t / r * 1e6
    return tot / r * 1e6, dict(fams)


def wall_us(fn, args, r, n=10):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / r * 1e6


# ----------------------------------------------------------------------------------------------------------------
# experts: one token's routed experts
# ----------------------------------------------------------------------------------------------------------------

def one_token_tuned(x, wts, picks, w1, w2, w3, up, down, tag):
    """``inference.moe.routed_fp4_one_token`` with explicit tilings and tagged kernel names (same ops)."""
    xs, picks = gemm_input(x, w1)[0], picks[0]
    act = QG.fp4_slot_swiglu(xs, picks, wts[0], w1.weight, w3.weight, limit=LIMIT, backend=BE,
                             tuning=dict(up, name=f"fp4up_{tag}"))
    return QG.fp4_slot_down(gemm_input(act, w2), picks, w2.weight, backend=BE,
                            tuning=dict(down, name=f"fp4dn_{tag}"))[None]


def experts_part(bw, n_tilings=len(TILINGS)):
    from dsv41_jax.inference.moe import routed_fp4_one_token, routed_slots
    from dsv41_jax.ops.moe import routed_ragged

    key = jax.random.PRNGKey(7)
    ks = jax.random.split(key, 8)
    w1q, w3q = B.random_fp4(ks[0], E_STACK, F_, D_), B.random_fp4(ks[1], E_STACK, F_, D_)
    w2q = B.random_fp4(ks[2], E_STACK, D_, F_)
    marked = tuple(Fp8GemmInput(w, BE) for w in (w1q, w2q, w3q))
    # R tokens, each with TOPK distinct picks; all R * TOPK picks distinct (no L2 reuse between the tokens)
    perm = np.random.default_rng(3).permutation(E_STACK)[:R * TOPK].reshape(R, TOPK)
    picks = [jnp.asarray(p[None], jnp.int32) for p in perm]
    wts = [jax.random.uniform(jax.random.fold_in(ks[3], i), (1, TOPK), jnp.float32, 0.1, 0.5) for i in range(R)]
    xs = [jax.random.normal(jax.random.fold_in(ks[4], i), (1, D_), jnp.float32).astype(jnp.bfloat16)
          for i in range(R)]
    per_expert = 2 * (F_ * D_ // 2 + F_ * D_ // 32) + D_ * F_ // 2 + D_ * F_ // 32
    nbytes = TOPK * per_expert + D_ * 2 + TOPK * F_ * 4 + D_ * 4  # weights + scales, x, act (write + read), y
    nbytes_bf16 = TOPK * 3 * F_ * D_ * 2 + D_ * 2 + TOPK * F_ * 4 + D_ * 4

    def many(one):
        return jax.jit(lambda xs, wts, picks, ws: [one(x, w, p, *ws) for x, w, p in zip(xs, wts, picks)])

    # checks: float32 activations against the float32 oracle; bf16 against the grouped path
    x32 = xs[0].astype(jnp.float32)
    got32 = routed_fp4_one_token(x32, wts[0], picks[0], *marked, LIMIT, BE)
    ref32 = routed_fp4_one_token(x32, wts[0], picks[0], *(Fp8GemmInput(w, "reference") for w in (w1q, w2q, w3q)),
                                 LIMIT, "reference")
    e32 = B.rel_err(got32, ref32)
    gotb = routed_fp4_one_token(xs[0], wts[0], picks[0], *marked, LIMIT, BE)
    grp = routed_ragged(xs[0], wts[0], picks[0], *marked, LIMIT)
    eb = B.rel_err(gotb, grp)
    OUT["checks"].append(dict(what="one-token kernels, float32 x, vs the float32 oracle", rel_err=e32))
    OUT["checks"].append(dict(what="one-token kernels, bf16 x, vs the grouped-kernel path", rel_err=eb))
    log(f"check: float32 vs oracle rel err {e32:.2e}; bf16 vs grouped path {eb:.2e}")

    variants = []
    for i, (up, down) in enumerate(TILINGS[:n_tilings]):
        variants.append((f"one-token kernels {'default' if i == 0 else f'up {up} / down {down}'}",
                         many(lambda x, w, p, a, b, c, up=up, down=down, i=i: one_token_tuned(x, w, p, a, b, c, up,
                                                                                              down, f"c{i}")),
                         marked, nbytes, dict(up=up, down=down)))
    variants.append(("grouped FP4 kernel path (before)", many(lambda x, w, p, a, b, c: routed_ragged(x, w, p, a, b, c,
                                                                                                    LIMIT)),
                     marked, nbytes, {}))
    bf = [(jax.random.normal(jax.random.fold_in(ks[5], j), (E_STACK,) + s, jnp.float32) * 0.02).astype(jnp.bfloat16)
          for j, s in enumerate(((F_, D_), (D_, F_), (F_, D_)))]
    variants.append(("bf16 experts, slot kernels", many(lambda x, w, p, a, b, c: routed_slots(x, w, p, a, b, c, LIMIT,
                                                                                             BE)),
                     tuple(bf), nbytes_bf16, {}))
    for i, (up, down) in enumerate(TILINGS[:n_tilings]):  # every tiling / decode form against the float32 oracle
        try:
            e = B.rel_err(one_token_tuned(x32, wts[0], picks[0], *marked, up, down, f"chk{i}"), ref32)
        except Exception as ex:  # noqa: BLE001
            e = float("nan")
            OUT["errors"].append(f"check tiling {i}: {type(ex).__name__}: {str(ex)[:300]}")
        OUT["checks"].append(dict(what=f"one-token kernels up {up} / down {down}, float32 x, vs the float32 oracle",
                                  rel_err=e))
        log(f"check tiling {i} ({up} / {down}): float32 vs oracle rel err {e:.2e}")
    base = None
    for name, fn, ws, nb, tiling in variants:
        args = (xs, wts, picks, ws)
        try:
            out = jax.block_until_ready(fn(*args))
            dev, fams = device_us(fn, args, R)
            wall = float("nan") if SMOKE else wall_us(fn, args, R)
            err = B.rel_err(out[0], grp) if "bf16 experts" not in name else float("nan")
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the rest still run
            OUT["errors"].append(f"experts {name}: {type(e).__name__}: {str(e)[:400]}")
            log(f"experts {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            continue
        row = dict(variant=name, tiling=tiling, bytes=nb, dev_us=dev, wall_us=wall, families_us=fams,
                   rel_err_vs_grouped=err, **bandwidth_pct(nb, dev, bw))
        if "before" in name:
            base = row
        OUT["experts"].append(row)
        log(f"| {name} | {dev:.1f} | {wall:.1f} | {row['pct_datasheet']:.0f}% | {row['pct_read']:.0f}% | "
            f"{err:.1e} | " + ", ".join(f"{k}: {v:.1f}" for k, v in sorted(fams.items(), key=lambda kv: -kv[1])))
    if base:
        for row in OUT["experts"]:
            row["speedup_vs_grouped"] = base["dev_us"] / row["dev_us"]


# ----------------------------------------------------------------------------------------------------------------
# grouped: the batch-32 decode step's grouped FP4 expert GEMMs
# ----------------------------------------------------------------------------------------------------------------

# (label, tuning of kernels.quant_gemm_gpu.fp4_grouped_gemm): the first, the kernel's form before the weights-as-rows
# form became its decode default, is the same-run baseline (as measured on 2026-12-02 14:39 UTC, the labels then
# named the tuning given: "tokens form (default)" = {}, "weights form, bf16x2 decode" = the third row's form; at
# 18:39 UTC "weights form, bf16x2 decode (default)" = {} was the third row's form, "block_m 16" = dict(block_m=16))
GROUPED_TUNINGS = [("tokens form (the default before)", dict(mma_rows="tokens")),
                   ("weights form, f32 decode, block_m 32", dict(mma_rows="weights", decode="f32", block_m=32)),
                   ("weights form, bf16x2 decode, block_m 32 (the default before)", dict(block_m=32)),
                   ("weights form, bf16x2, block_m 16 (default)", {}),
                   ("weights form, bf16x2, block_k 128", dict(block_k=128)),
                   ("weights form, bf16x2, 4 stages", dict(num_stages=4)),
                   ("weights form, bf16x2, block_n 128, 8 warps", dict(block_n=128, num_warps=8)),
                   # 512-wide K steps: twice the bytes per step and per stage in flight (219 registers against 119,
                   # 9.8 SASS instructions per weight byte in the K loop against 10.5: kernel_sass.py fp4_grouped)
                   ("weights form, bf16x2, block_k 512", dict(block_k=512))]
GROUPED_QUICK = 5  # --grouped-quick: the first five only


def grouped_part(bw, batch=32, picks=None):
    """One grouped FP4 GEMM as the bench model's batch-``batch`` decode step runs it: ``batch`` tokens x top-6 of
    16 experts (uniform random picks) = 192 rows sorted by expert, w1 / w3 (2304 x 5120) and w2 (5120 x 2304); each
    call runs R distinct weight stacks (> L2). Device µs per GEMM; bytes = the used experts' packed bytes + scales +
    activations read + output written; checked against float32 on the dequantised weights (bf16 inputs)."""
    n_exp = 8 if SMOKE else 16
    r = 2 if SMOKE else 4
    rows = batch * TOPK
    import bench_quant_gemm as BQ

    for shape_name, (n, k) in (("w1 / w3", (F_, D_)), ("w2", (D_, F_))):
        key = jax.random.PRNGKey(11 + n)
        ws = [B.random_fp4(jax.random.fold_in(key, i), n_exp, n, k) for i in range(r)]
        gss = [BQ._routing(jax.random.fold_in(key, 100 + i), batch, n_exp, TOPK) for i in range(r)]
        xs = [jax.random.normal(jax.random.fold_in(key, 200 + i), (rows, k), jnp.float32).astype(jnp.bfloat16)
              for i in range(r)]
        used = float(np.mean([int(jnp.sum(g > 0)) for g in gss]))
        nbytes = used * (n * k // 2 + n * k // 32) + rows * k * 2 + rows * n * 2
        want = jax.lax.ragged_dot(xs[0].astype(jnp.float32), jnp.swapaxes(ws[0].dequantize(jnp.float32), 1, 2),
                                  gss[0], precision=jax.lax.Precision.HIGHEST)
        base = None
        for label, tuning in (GROUPED_TUNINGS if picks is None else [GROUPED_TUNINGS[i] for i in picks]):
            try:
                fn = jax.jit(lambda xs, gss, ws, tuning=tuning: [QG.fp4_grouped(x, g, w, backend=BE, tuning=tuning)
                                                                 for x, g, w in zip(xs, gss, ws)])
                out = jax.block_until_ready(fn(xs, gss, ws))
                err = B.rel_err(out[0], want)
                dev, _ = device_us(fn, (xs, gss, ws), r)
            except Exception as e:  # noqa: BLE001
                OUT["errors"].append(f"grouped {shape_name} {label}: {type(e).__name__}: {str(e)[:400]}")
                log(f"grouped {shape_name} {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            row = dict(shape=shape_name, n=n, k=k, rows=rows, experts=n_exp, used_experts=used, variant=label,
                       tuning=tuning, bytes=nbytes, dev_us=dev, rel_err=err,
                       **bandwidth_pct(nbytes, dev, bw))
            base = base or row
            row["speedup_vs_first"] = base["dev_us"] / dev
            OUT["grouped"].append(row)
            OUT["checks"].append(dict(what=f"grouped {shape_name} {label}, bf16 x, vs float32", rel_err=err))
            log(f"| {shape_name} | {label} | {dev:.1f} | {row['pct_datasheet']:.0f}% | {row['pct_read']:.0f}% | "
                f"{row['speedup_vs_first']:.2f}x | {err:.1e} |")


# (label, tuning of kernels.quant_gemm_gpu.fp8_gemm) for --dense32: the first, the default before 2026-12-02 18:39 UTC,
# is the same-run baseline (in that run's labels "tokens form (default)" = {} then, the second row = mma_rows weights)
DENSE32_TUNINGS = [("tokens form (the default before)", dict(mma_rows="tokens")),
                   ("weights form, bf16x2 e4m3 decode (default)", {}),
                   ("weights form, block_m 16", dict(mma_rows="weights", block_m=16)),
                   ("weights form, block_n 128, 8 warps", dict(mma_rows="weights", block_n=128, num_warps=8)),
                   # K = 2304 (shared w2) has 9 K blocks: the default split_k 2 leaves a ragged split, which takes the
                   # masked gather loads in every K step (196 LDG in the loop vs 8 + async copies at split_k 3,
                   # kernel_sass.py fp8_m32 --nk 5120,2304); for the shapes whose blocks 3 does not divide, the reverse
                   ("weights form, split_k 3", dict(split_k=3)),
                   # the default split before it divided the K blocks (the same as the default where they divide)
                   ("weights form, split_k 2 (the default before for K = 2304)", dict(split_k=2)),
                   # the FP8 tensor-core form (one FP8 wgmma per 32-wide K chunk on the stored bytes, float32
                   # promotion with both scales; the activations rounded to FP8: run with --dense32-fp8-inputs)
                   ("FP8 wgmma, block_n 64", dict(mma="fp8")),
                   ("FP8 wgmma, block_n 128", dict(mma="fp8", block_n=128)),
                   # the FP8 form with the 32 tokens as the product's row side: Triton's synchronous MMA path (on
                   # sm_90 two float16 MMAs per FP8 chunk after F2FP widening), promotion on registers, no wgmma
                   # wait (--dense32-fp8-inputs as above)
                   ("FP8 tokens (sync MMA), block_n 64", dict(mma="fp8", mma_rows="tokens")),
                   ("FP8 tokens (sync MMA), block_n 128", dict(mma="fp8", mma_rows="tokens", block_n=128))]
# the bench model's FP8 projections at decode (N, K): shared expert w1 / w3 and w2, the attention's wq_b and wo_b,
# the Engram layers' 25600 x 6144 (2 launches per step; 400 column blocks of 64 rows and no K split by default:
# 1.5 waves of two programs per multiprocessor), and the fused launches' shapes as one weight
DENSE32_SHAPES = [(2304, 5120), (5120, 2304), (32768, 1280), (5120, 8192), (25600, 6144),
                  (4608, 5120), (1792, 5120)]  # the last two: the fused w1 + w3 and wq_a + wkv's total N


def dense32_part(bw, m=32, picks=None, fp8_inputs=False):
    """The FP8 dense GEMM (32 x 32 block scales) at M = ``m`` (the batch-32 decode step's dense projections) at each
    of DENSE32_TUNINGS: device µs per GEMM (each call runs R distinct weights, > L2), bytes = weight bytes + scales +
    activations + output, % of 4.8 TB/s and of the read-only bandwidth; checked against float32 (bf16 inputs;
    ``fp8_inputs``: FP8-rounded per 32 first, as the release's GEMM inputs, the reference on the same rows)."""
    r = 2 if SMOKE else 8
    shapes = [(64, 96), (96, 64)] if SMOKE else DENSE32_SHAPES
    for n, k in shapes:
        key = jax.random.PRNGKey(n * 7 + k)
        ws = [B.random_fp8(jax.random.fold_in(key, i), n, k) for i in range(r)]
        xs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (m, k), jnp.float32).astype(jnp.bfloat16)
              for i in range(r)]
        if fp8_inputs:
            xs = [QG.fp8_round(x, backend="reference") for x in xs]
        nbytes = n * k + (-(-n // 32)) * (-(-k // 32)) + m * k * 2 + m * n * 2
        want = np.asarray(xs[0], np.float64) @ np.asarray(ws[0].dequantize(jnp.float32), np.float64).T
        base = None
        for label, tuning in (DENSE32_TUNINGS if picks is None else [DENSE32_TUNINGS[i] for i in picks]):
            try:
                fn = jax.jit(lambda xs, ws, tuning=tuning: [QG.fp8_linear(x, w, backend=BE, tuning=tuning)
                                                            for x, w in zip(xs, ws)])
                out = jax.block_until_ready(fn(xs, ws))
                err = B.rel_err(out[0], want)
                dev, _ = device_us(fn, (xs, ws), r)
            except Exception as e:  # noqa: BLE001
                OUT["errors"].append(f"dense32 {n}x{k} {label}: {type(e).__name__}: {str(e)[:400]}")
                log(f"dense32 {n}x{k} {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            row = dict(m=m, n=n, k=k, variant=label, tuning=tuning, bytes=nbytes, dev_us=dev, rel_err=err,
                       **bandwidth_pct(nbytes, dev, bw))
            base = base or row
            row["speedup_vs_first"] = base["dev_us"] / dev
            OUT["dense32"].append(row)
            OUT["checks"].append(dict(what=f"dense32 {n}x{k} {label}, bf16 x, vs float32", rel_err=err))
            log(f"| {n} x {k} | {label} | {dev:.1f} | {row['pct_datasheet']:.0f}% | {row['pct_read']:.0f}% | "
                f"{row['speedup_vs_first']:.2f}x | {err:.1e} |")


# ----------------------------------------------------------------------------------------------------------------
# decode: the step's profile by kernel family
# ----------------------------------------------------------------------------------------------------------------

def families_of_trace(log_dir: str, steps: int) -> dict:
    """Every device event of the newest trace under ``log_dir`` summed by family: ms and launches per step; busy
    (union of the device intervals) and span per step."""
    path = newest_trace(log_dir)
    if path is None:
        return {"error": f"no trace under {log_dir}"}
    events, pname, tname = load_trace(path)
    dev_pids = {p for p, n in pname.items() if re.search(r"/device:(GPU|gpu)|GPU", n) and "host" not in n.lower()}
    fams = collections.defaultdict(lambda: [0, 0.0])
    names = collections.defaultdict(lambda: [0, 0.0])
    intervals = []
    for e in events:
        if e.get("ph") != "X" or e["pid"] not in dev_pids:
            continue
        if not re.search(r"stream", tname.get((e["pid"], e.get("tid")), ""), re.I):
            continue
        dur = float(e.get("dur", 0))
        fam = family(e.get("name", ""))
        fams[fam][0] += 1
        fams[fam][1] += dur
        names[e.get("name", "")][0] += 1
        names[e.get("name", "")][1] += dur
        intervals.append((float(e["ts"]), float(e["ts"]) + dur))
    if not intervals:
        return {"error": "no device events", "processes": sorted(set(pname.values()))[:20]}
    total = sum(v[1] for v in fams.values())
    return dict(busy_ms_per_step=union_length(intervals) / 1e3 / steps,
                span_ms_per_step=(max(e for _, e in intervals) - min(s for s, _ in intervals)) / 1e3 / steps,
                kernel_ms_per_step=total / 1e3 / steps,
                launches_per_step=sum(v[0] for v in fams.values()) / steps,
                families={f: dict(ms_per_step=v[1] / 1e3 / steps, launches_per_step=v[0] / steps)
                          for f, v in sorted(fams.items(), key=lambda kv: -kv[1][1])},
                top=[[n[:90], c / steps, round(t / 1e3 / steps, 4)]
                     for n, (c, t) in sorted(names.items(), key=lambda kv: -kv[1][1])[:40]])


def decode_setup(config, params, opts, batch, context, packed=False):
    """A filled cache (``packed``: the release's packed formats) and the step function of one form; the first call
    (trace + compile + one step) timed."""
    from bench_inference import decode_inputs, fill_cache
    from dsv41_jax.inference.cache import init_cache
    from dsv41_jax.inference.decode import decode_and_sample
    from dsv41_jax.inference.sampling import sampler_for

    cache = init_cache(config, batch, context + 64, jnp.bfloat16, packed=packed)
    cache = jax.jit(fill_cache, static_argnums=(1,), donate_argnums=(0,))(cache, context, jax.random.PRNGKey(1))
    # committed, as every later step's cache is when an input is (host-memory tables are): one compile, not two
    cache = jax.device_put(cache, jax.devices()[0])
    samp, eids, tok, act = decode_inputs(config, batch)
    # the sampler Engine.generate chooses on the host for these rows (greedy: the argmax alone, no vocabulary sort)
    sampler = sampler_for(*(np.asarray(a) for a in samp[:3]))

    def step(cache, i, read_back=True):
        nxt, cache = decode_and_sample(params, cache, tok, eids, act, *samp, jnp.full((batch,), i, jnp.int32),
                                       config=config, opts=opts, sampler=sampler)
        if read_back:
            np.asarray(nxt)
        return cache

    t0 = time.perf_counter()
    cache = step(cache, 0)
    return dict(step=step, cache=cache, first_call_s=time.perf_counter() - t0, sampler=sampler)


def time_and_profile(s, batch, form, out_dir, steps=10, profile_steps=3):
    step, cache = s.pop("step"), s.pop("cache")
    from profile_decode import time_steps

    row = dict(first_call_s=s["first_call_s"], sampler=s.get("sampler"))
    cache, ts, queued_ms = time_steps(step, cache, steps)
    row.update(step_ms=statistics.median(ts) * 1e3, queued_ms=queued_ms)
    if SMOKE:
        return row
    log_dir = tempfile.mkdtemp(prefix="release_trace_")
    try:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for i in range(profile_steps):
                cache = step(cache, 100 + i)
            row["profiled_wall_ms"] = (time.perf_counter() - t0) / profile_steps * 1e3
        row.update(families_of_trace(log_dir, profile_steps))
        perf = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
        if out_dir and perf and os.path.getsize(perf[0]) < 15e6:
            slug = re.sub(r"[^A-Za-z0-9]+", "_", form).strip("_")
            shutil.copy(perf[0], os.path.join(out_dir, f"perfetto_{slug}_b{batch}.json.gz"))
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return row


def loop_setup_form(config, params, opts, batch, context, packed, readback, profile_steps):
    """The Engine's device loop (``decode_chain``: the token fed back and the Engram rows hashed on the device, the
    tokens read back once per run) of one form: a filled cache (``packed``: the release's packed formats), the
    greedy sampler ``Engine.generate`` picks for greedy rows, ``run(n)`` = n steps then one read-back; the first
    call (trace + compile + one step) timed."""
    from profile_decode import loop_setup
    from dsv41_jax.inference.decode import decode_chain
    from dsv41_jax.inference.sampling import sampler_for

    s = loop_setup(config, batch, context, opts, readback, profile_steps, False, packed=packed)
    sampler = sampler_for(*(np.asarray(a) for a in s["samp"][:3]))
    box = dict(cache=s.pop("cache"), state=s.pop("state"))

    def run(n):
        for _ in range(n):
            _tok, box["state"], box["cache"] = decode_chain(params, box["cache"], box["state"], s["tables"],
                                                            *s["samp"], *s["limits"], config=config, opts=opts,
                                                            sampler=sampler)
        return np.asarray(box["state"]["readback"])

    t0 = time.perf_counter()
    run(1)
    return dict(run=run, box=box, first_call_s=time.perf_counter() - t0, sampler=sampler)


def time_and_profile_loop(s, batch, form, out_dir, layers, readback, profile_steps, steps=10, trace_max_mb=15.0,
                          profile=True, repeats=1):
    """The device loop of setup ``s``: per read-back interval k, runs of k steps (at least 2 runs and ``steps``
    steps), wall ms per step; then (``profile``) one run of ``profile_steps`` steps profiled (kernel families,
    launches per layer, busy = union of device intervals against the profiled wall). The step is the largest k's
    (``repeats`` > 1: that k timed again, each time in ``step_ms_runs``, the spread of one form's step).
    The row records the wall seconds of its timing and of its profile (trace + summary)."""
    run = s.pop("run")
    row = dict(first_call_s=s["first_call_s"], sampler=s.get("sampler"), readback_every=max(readback))
    t_start = time.perf_counter()
    run(2)
    for k in readback:
        n = -(-max(2 * k, steps) // k) * k
        t0 = time.perf_counter()
        for _ in range(n // k):
            run(k)
        row[f"device_loop_k{k}_step_ms"] = (time.perf_counter() - t0) / n * 1e3
    row["step_ms"] = row[f"device_loop_k{max(readback)}_step_ms"]
    k = max(readback)
    n = -(-max(2 * k, steps) // k) * k
    row["step_ms_runs"] = [row["step_ms"]]
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        for _ in range(n // k):
            run(k)
        row["step_ms_runs"].append((time.perf_counter() - t0) / n * 1e3)
    row["timing_wall_s"] = time.perf_counter() - t_start
    if not profile:
        row["profile"] = "skipped (past --profile-until-s)"
    if profile and not SMOKE:
        t_start = time.perf_counter()
        log_dir = tempfile.mkdtemp(prefix="release_loop_trace_")
        try:
            with jax.profiler.trace(log_dir, create_perfetto_trace=True):
                t0 = time.perf_counter()
                run(profile_steps)
                row["profiled_wall_ms"] = (time.perf_counter() - t0) / profile_steps * 1e3
            row.update(families_of_trace(log_dir, profile_steps))
            if "launches_per_step" in row:
                row["launches_per_layer"] = row["launches_per_step"] / layers
                row["busy_pct"] = 100 * row["busy_ms_per_step"] / row["profiled_wall_ms"]
            perf = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
            if out_dir and perf and os.path.getsize(perf[0]) < trace_max_mb * 1e6:
                slug = re.sub(r"[^A-Za-z0-9]+", "_", form).strip("_")
                shutil.copy(perf[0], os.path.join(out_dir, f"perfetto_{slug}_b{batch}.json.gz"))
        finally:
            shutil.rmtree(log_dir, ignore_errors=True)
        row["profile_wall_s"] = time.perf_counter() - t_start
    s["box"].clear()  # the cache and state go now (the next form's rows are timed without them)
    return row


def decode_part(model, batches, context, budget_s, out_dir, save, wo_a_fp8=False, no_grouped=False,
                grouped_tunings: tuple = (), no_f16=False, fp8_tunings: tuple = (), combine=False,
                engram_host=False, no_bf16=False, device_loop=False, release_cache: tuple = (), ahead=False,
                readback: tuple = (1, 8, 32), profile_steps: int = 3, trace_max_mb: float = 15.0,
                no_release_bf16_cache=False, profile_until_s: float | None = None,
                engram_host_gathers: tuple = ("kernel",), timing_repeats: int = 1, mhc_projections: tuple = (),
                mhc_partials: tuple = (),
                release_options: tuple = (), bf16_options=False):
    """Per batch: every form's first call (trace + compile + one step) concurrently in threads (XLA compiles
    release the GIL; the forms' first-call times overlap, so each is an upper bound of its compile), then each
    form timed and profiled alone. ``engram_host``: after every batch's rows are saved, the release form with the
    Engram tables in host memory (``inference.host_tables.place_engram_tables``) at each batch — compiled last, on
    its own, so a failure of the host gather's compile cannot take the other rows with it. With ``device_loop``
    the host-table forms (one per ``engram_host_gathers``: ``ops.gather.HOST_GATHERS``) are forms of the loop like
    the others, after the release form with the tables in HBM (their same-run baseline, ``compare_engram_host``).

    ``device_loop``: each form runs the Engine's device loop (``loop_setup_form``) instead of the host-fed step.
    ``release_cache``: release-weight forms with the release's packed cache ("kernels": the attention and indexer
    kernels read it packed, ``packed_cache_kernels``; "unpack": unpacked to bf16 every step, the option's default).
    ``ahead``: every batch's forms set up and first-called at once (all their caches resident), then timed in turn.
    ``release_options``: dicts of ``InferenceOptions`` fields; for each, release-weight forms with those fields set
    beside the ones on the defaults (one per release cache form run: ``release_cache`` and the bf16 cache unless
    ``no_release_bf16_cache``); a dict of options that only act at batches > 1 (``BATCH1_SAME``) skips batch 1.
    ``bf16_options``: a bf16 form with each of them too (its same-run baseline stays the bf16 form on the defaults).
    ``profile_until_s``: device-loop rows timed after this many seconds are not profiled (the profile of a 40-layer
    program costs tens of seconds; the step times still come).
    Each row's floor: ``profile_decode.step_bytes`` of its weights and cache over the read-only bandwidth measured
    in this process."""
    import concurrent.futures

    from bench_fused_fp8 import random_release_params
    from profile_decode import MODELS, step_bytes
    from dsv41_jax.inference.step import InferenceOptions
    from dsv41_jax.model.params import init_params
    from dsv41_jax.model.release_weights import dequantize_wo_a, weight_bytes

    bad = set(release_cache) - {"kernels", "unpack"}
    if bad:
        raise ValueError(f"release_cache: unknown form(s) {sorted(bad)}; choose from 'kernels', 'unpack'")
    config = MODELS[model]()
    # on CPU (smoke) the kernels' interpret mode, so that the packed-cache kernels' path runs too ("auto" is the
    # reference there); on the GPU "auto" is the Pallas GPU backend, as before
    base = dict(quant_sim=False, index_block_elems=1 << 28, **(dict(kernel_backend=BE) if SMOKE else {}))
    log(f"decode: {config.name}: init bf16 params ({time.time() - T0:.0f} s)")
    p16 = jax.block_until_ready(init_params(config, jax.random.PRNGKey(0), jnp.bfloat16))
    # release weights only where a release form runs (every form but bf16 and its options' forms)
    need_release = not (no_release_bf16_cache and no_grouped and no_f16) or bool(
        release_cache or release_options or grouped_tunings or fp8_tunings or combine or engram_host or wo_a_fp8)
    stored = prel = None
    if need_release:
        log(f"decode: random release params ({time.time() - T0:.0f} s)")
        stored = jax.block_until_ready(random_release_params(config, p16, jax.random.PRNGKey(5)))
        # the Engine's serving form (Engine(weights="release")): wo_a dequantised to bf16 once, at load, as the
        # official code serves it; the stored form keeps wo_a FP8 and dequantises it inside every step (--wo-a-fp8)
        prel = jax.block_until_ready(dequantize_wo_a(stored, jnp.bfloat16))
    if not wo_a_fp8:
        del stored  # its FP8 wo_a (the rest is shared with prel)
    rel = dict(base, gemm_input_fp8=True, quantized_gemm=BE)
    # (name, params, options, packed cache)
    forms = [("bf16", p16, InferenceOptions(**base), False)] * (not no_bf16) + [
        ("release, one-token FP4 kernels", prel, InferenceOptions(**rel, fp4_one_token=True), False)
    ] * (not no_release_bf16_cache)
    for how in release_cache:
        forms.append((f"release, one-token FP4 kernels, release cache "
                      f"({'kernels read it packed' if how == 'kernels' else 'unpacked every step'})", prel,
                      InferenceOptions(**rel, fp4_one_token=True, packed_cache_kernels=how == "kernels"), True))
    if engram_host and device_loop:
        from dsv41_jax.inference.host_tables import place_engram_tables

        phost = jax.block_until_ready(place_engram_tables(prel))
        for how in engram_host_gathers:
            forms.append((f"{HOST_FORM} ({'the GPU reads the rows' if how == 'kernel' else 'host gather'})", phost,
                          InferenceOptions(**rel, fp4_one_token=True, engram_host_gather=how), False))
    for extra in release_options:  # release forms with InferenceOptions fields set, beside the defaults
        tag = " [batches > 1]" if set(extra) <= BATCH1_SAME else ""
        caches = [(None, "")] * (not no_release_bf16_cache) + [
            (how, f", release cache ({'kernels read it packed' if how == 'kernels' else 'unpacked every step'})")
            for how in release_cache]
        if bf16_options and not no_bf16:
            forms.append((f"bf16, {extra}{tag}", p16, InferenceOptions(**base, **extra), False))
        for how, cname in caches:
            forms.append((f"release, one-token FP4 kernels{cname}, {extra}{tag}", prel,
                          InferenceOptions(**rel, fp4_one_token=True, **extra,
                                           **(dict(packed_cache_kernels=how == "kernels") if how else {})),
                          how is not None))
    for proj in mhc_projections:  # the mHC projection's forms beside the default (ops.mhc projection)
        forms.append((f"bf16, mHC projection {proj}", p16, InferenceOptions(**base, mhc_projection=proj), False))
        if need_release:
            forms.append((f"release, one-token FP4 kernels, mHC projection {proj}", prel,
                          InferenceOptions(**rel, fp4_one_token=True, mhc_projection=proj), False))
    for parts in mhc_partials:  # the one-pass reduce's partial sums per entry beside the default (ops.mhc partials)
        forms.append((f"bf16, mHC partials {parts}", p16, InferenceOptions(**base, mhc_partials=parts), False))
        if need_release:
            forms.append((f"release, one-token FP4 kernels, mHC partials {parts}", prel,
                          InferenceOptions(**rel, fp4_one_token=True, mhc_partials=parts), False))
    if not no_grouped:
        forms.append(("release, grouped FP4 kernel", prel, InferenceOptions(**rel, fp4_one_token=False), False))
    if combine:  # one form with both kernels' first tunings instead of a form per tuning (fewer concurrent compiles;
        # the profile's kernel families still tell the two kernels' shares apart)
        grouped_tunings, fp8_tunings = grouped_tunings[:1], fp8_tunings[:1]
        forms.append((f"release, grouped FP4 {dict(grouped_tunings[0]) if grouped_tunings else {}} + FP8 GEMM kernel "
                      f"{dict(fp8_tunings[0]) if fp8_tunings else {}}", prel,
                      InferenceOptions(**rel, fp4_one_token=True,
                                       fp4_grouped_tuning=grouped_tunings[0] if grouped_tunings else (),
                                       fp8_gemm_tuning=fp8_tunings[0] if fp8_tunings else ()), False))
        grouped_tunings = fp8_tunings = ()
    for tuning in grouped_tunings:  # batches > 1 only (one token takes the one-token kernels in every release form)
        forms.append((f"release, grouped FP4 kernel {dict(tuning)}", prel,
                      InferenceOptions(**rel, fp4_one_token=True, fp4_grouped_tuning=tuning), False))
    for tuning in fp8_tunings:  # batches > 1 only (the gemv form at one token ignores the tensor-core form's tuning)
        forms.append((f"release, FP8 GEMM kernel {dict(tuning)}", prel,
                      InferenceOptions(**rel, fp4_one_token=True, fp8_gemm_tuning=tuning), False))
    if not no_f16:  # the one-token kernels' form before the pair decode, as its own option (a distinct program)
        forms.append(("release, one-token FP4 kernels, f16 decode (before)", prel,
                      InferenceOptions(**rel, fp4_one_token=True, fp4_slot_decode="f16"), False))
    if wo_a_fp8:  # the form measured before wo_a was served from load
        forms.append(("release, grouped FP4 kernel, wo_a FP8 per step (before)", stored,
                      InferenceOptions(**rel, fp4_one_token=False), False))
    log(f"decode: params ready ({time.time() - T0:.0f} s)")
    read_bw = OUT["ceilings"].get("read_bw")
    OUT["meta"].update(decode_model=config.name, decode_layers=config.num_hidden_layers, decode_context=context,
                       decode_loop="device (decode_chain)" if device_loop else "host-fed step (decode_and_sample)",
                       readback=list(readback) if device_loop else None)
    for group in ([list(batches)] if ahead else [[b] for b in batches]):
        if time.time() - T0 > budget_s:
            OUT["errors"].append(f"decode batches {group}: skipped (budget)")
            log(f"decode batches {group}: skipped ({time.time() - T0:.0f} s > budget {budget_s:.0f} s)")
            continue
        jobs = [(b, f) for b in group for f in forms
                if b > 1 or not re.search(r"(grouped FP4|FP8 GEMM) kernel \{|\[batches > 1\]", f[0])]
        log(f"decode: batches {group}: first calls of {len(jobs)} programs, concurrently ({time.time() - T0:.0f} s)")

        def first(job):
            b, (_, params, opts, packed) = job
            try:
                if device_loop:
                    return loop_setup_form(config, params, opts, b, context, packed, readback, profile_steps)
                return decode_setup(config, params, opts, b, context, packed)
            except Exception as e:  # noqa: BLE001
                return dict(error=f"{type(e).__name__}: {str(e)[:400]}")

        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
            setups = list(ex.map(first, jobs))
        log(f"decode: batches {group}: compiled ({time.time() - T0:.0f} s)")
        for i, ((b, (form, params, _, packed)), s) in enumerate(zip(jobs, setups)):
            row = dict(model=config.name, batch=b, context=context, weights=form,
                       cache="release (packed)" if packed else "bf16", weight_gb=weight_bytes(params) / 1e9)
            parts = step_bytes(config, params, b, context, "release" if packed else "bf16")
            row.update(step_gb=sum(parts.values()) / 1e9, floor_parts_gb={k: v / 1e9 for k, v in parts.items()})
            if read_bw:
                row["floor_ms"] = sum(parts.values()) / read_bw * 1e3
            if "first_call_s" in s:  # recorded even when the row is not timed
                row["first_call_s"] = s["first_call_s"]
            try:
                if "error" in s:
                    raise RuntimeError(s["error"])
                if time.time() - T0 > budget_s:
                    raise RuntimeError(f"not timed: past the budget ({time.time() - T0:.0f} s > {budget_s:.0f} s)")
                if device_loop:
                    profile = profile_until_s is None or time.time() - T0 < profile_until_s
                    row.update(time_and_profile_loop(s, b, form, out_dir, config.num_hidden_layers, readback,
                                                     profile_steps, trace_max_mb=trace_max_mb, profile=profile,
                                                     repeats=timing_repeats))
                else:
                    row.update(time_and_profile(s, b, form, out_dir, profile_steps=profile_steps))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            s.clear()
            setups[i] = None
            if "floor_ms" in row and "step_ms" in row:
                row["x_floor"] = row["step_ms"] / row["floor_ms"]
            OUT["decode"].append(row)
            compare_to_bf16()
            compare_engram_host()
            log(json.dumps({k: v for k, v in row.items() if k not in ("top", "floor_parts_gb")}, default=str))
            save()
        del setups
    if engram_host and not device_loop:
        engram_host_part(config, prel, InferenceOptions(**rel, fp4_one_token=True), batches, context, budget_s,
                         out_dir, save)


HOST_FORM = "release, one-token FP4 kernels, Engram tables in host memory"


def compare_engram_host():
    """Each host-table row's step against the release row (tables in HBM) of its batch and cache: the extra ms and
    % of that step; and its profiled wait (profiled wall - busy) against the HBM row's."""
    base = {(r["batch"], r["cache"]): r for r in OUT["decode"]
            if r["weights"] == "release, one-token FP4 kernels" and "step_ms" in r}
    for r in OUT["decode"]:
        b = base.get((r["batch"], r["cache"]))
        if b and r["weights"].startswith(HOST_FORM) and "step_ms" in r:
            r["host_minus_hbm_ms"] = r["step_ms"] - b["step_ms"]
            r["host_pct_of_step"] = 100 * r["host_minus_hbm_ms"] / b["step_ms"]
            r["hbm_step_ms_runs"] = b.get("step_ms_runs", [])
            if "busy_ms_per_step" in r and "busy_ms_per_step" in b:
                r["wait_ms_per_step"] = r["profiled_wall_ms"] - r["busy_ms_per_step"]
                r["hbm_wait_ms_per_step"] = b["profiled_wall_ms"] - b["busy_ms_per_step"]


def compare_to_bf16():
    """Each decode row's speed-up over the bf16 row of its batch and loop (step time, and kernel time per step)."""
    base = {r["batch"]: r for r in OUT["decode"] if r["weights"] == "bf16" and "step_ms" in r}
    for r in OUT["decode"]:
        b = base.get(r["batch"])
        if b and "step_ms" in r:
            r["x_bf16"] = b["step_ms"] / r["step_ms"]
            if "kernel_ms_per_step" in r and "kernel_ms_per_step" in b:
                r["x_bf16_kernels"] = b["kernel_ms_per_step"] / r["kernel_ms_per_step"]


def engram_host_part(config, prel, opts, batches, context, budget_s, out_dir, save):
    """The release form (one-token FP4 kernels at one token, the grouped kernel above) with every Engram table in
    pinned host memory, at each batch: the step's rows gathered on the host and moved to the device (issue item 4);
    its same-run baseline is the release form with the tables in HBM, timed before."""
    import concurrent.futures

    from dsv41_jax.inference.host_tables import engram_table_bytes, place_engram_tables
    from dsv41_jax.model.release_weights import weight_bytes

    if time.time() - T0 > budget_s:
        OUT["errors"].append("engram host: skipped (budget)")
        log("engram host: skipped (budget)")
        return
    form = "release, one-token FP4 kernels, Engram tables in host memory"
    try:
        phost = place_engram_tables(prel)
        tbytes = {k: v / 1e9 for k, v in engram_table_bytes(phost).items()}
    except Exception as e:  # noqa: BLE001
        OUT["errors"].append(f"engram host: placing the tables: {type(e).__name__}: {str(e)[:400]}")
        log(f"engram host: placing the tables FAILED: {type(e).__name__}: {str(e)[:300]}")
        return
    log(f"engram host: tables {tbytes} GB; first calls at batches {batches}, concurrently ({time.time() - T0:.0f} s)")

    def first(b):
        try:
            return decode_setup(config, phost, opts, b, context)
        except Exception as e:  # noqa: BLE001
            return dict(error=f"{type(e).__name__}: {str(e)[:400]}")

    with concurrent.futures.ThreadPoolExecutor(len(batches)) as ex:
        setups = list(ex.map(first, batches))
    for b, s in zip(batches, setups):
        row = dict(model=config.name, batch=b, context=context, weights=form, weight_gb=weight_bytes(phost) / 1e9,
                   engram_tables_gb=tbytes)
        try:
            if "error" in s:
                raise RuntimeError(s["error"])
            row.update(time_and_profile(s, b, form, out_dir))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        OUT["decode"].append(row)
        log(json.dumps({k: v for k, v in row.items() if k != "top"}, default=str))
        save()


def _hashable_options(opts: dict) -> dict:
    """JSON ``InferenceOptions`` fields as the options hold them: the kernels' tunings as (name, value) pairs."""
    return {k: tuple(sorted(v.items())) if isinstance(v, dict) else v for k, v in opts.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--model", default="12L")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="no further decode batch once this long has passed")
    ap.add_argument("--skip-experts", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--tilings", type=int, default=len(TILINGS), help="experts: the first N of TILINGS")
    ap.add_argument("--decode-first", action="store_true", help="the decode part before the experts part")
    ap.add_argument("--wo-a-fp8", action="store_true",
                    help="decode: also the release weights with wo_a kept FP8 and dequantised inside every step (the "
                         "form before wo_a was served in bf16 from load, now the release forms' default)")
    ap.add_argument("--wo-a-bf16", action="store_true", help="no effect: wo_a in bf16 from load is now the default")
    ap.add_argument("--no-grouped", action="store_true", help="decode: leave out the grouped FP4 kernel form")
    ap.add_argument("--no-f16", action="store_true", help="decode: leave out the one-token kernels' f16 form")
    ap.add_argument("--grouped-tunings", default="",
                    help="decode, batches > 1: a JSON list of tunings; for each, a release form whose grouped FP4 "
                         "kernel takes it")
    ap.add_argument("--fp8-tunings", default="",
                    help="decode, batches > 1: a JSON list of tunings; for each, a release form whose FP8 dense kernel "
                         "takes it (InferenceOptions.fp8_gemm_tuning)")
    ap.add_argument("--grouped", action="store_true",
                    help="the batch-32 grouped FP4 GEMMs at GROUPED_TUNINGS (kernel micro-benchmark) first")
    ap.add_argument("--grouped-quick", action="store_true", help="--grouped: the first GROUPED_QUICK tunings only")
    ap.add_argument("--grouped-pick", default="", help="--grouped: these indices of GROUPED_TUNINGS only (e.g. 2,3)")
    ap.add_argument("--dense32-fp8-inputs", action="store_true", help="--dense32: the rows FP8-rounded first (the "
                    "release's GEMM inputs; needed for a fair error of the FP8 tensor-core form)")
    ap.add_argument("--dense32-pick", default="", help="--dense32: these indices of DENSE32_TUNINGS only (e.g. 0,1)")
    ap.add_argument("--combine", action="store_true",
                    help="decode: one release form with the first of --grouped-tunings and of --fp8-tunings together, "
                         "instead of one form per tuning")
    ap.add_argument("--no-bf16", action="store_true", help="decode: leave out the bf16 form")
    ap.add_argument("--engram-host", action="store_true",
                    help="decode: also the release form with the Engram tables in host memory, after the other rows")
    ap.add_argument("--timing-repeats", type=int, default=1,
                    help="--device-loop: the step (largest read-back interval) timed this many times per form")
    ap.add_argument("--engram-host-gathers", default="kernel",
                    help="--engram-host --device-loop: the host-table forms (ops.gather.HOST_GATHERS), comma-separated")
    ap.add_argument("--device-loop", action="store_true",
                    help="decode: every form runs the Engine's device loop (decode_chain, greedy sampler, tokens read "
                         "back every k of --readback steps) instead of the host-fed step")
    ap.add_argument("--readback", default="1,8,32", help="--device-loop: the read-back intervals k timed (the "
                    "step: the largest)")
    ap.add_argument("--profile-steps", type=int, default=None,
                    help="decode: steps profiled (default 3; 8 with --device-loop, one run)")
    ap.add_argument("--release-cache", default="",
                    help="decode: comma-separated release-weight forms with the release's packed KV cache: 'kernels' "
                         "(the attention and indexer kernels read it packed) and / or 'unpack' (unpacked every step)")
    ap.add_argument("--no-release-bf16-cache", action="store_true",
                    help="decode: leave out the release-weight form with the bf16 cache (with --no-grouped, --no-f16 "
                         "and no other release form: no release weights are built, --mhc-projections' forms bf16 only)")
    ap.add_argument("--ahead", action="store_true",
                    help="decode: every batch's forms set up and compiled at once (their caches resident together), "
                         "then timed in turn (default: batch by batch)")
    ap.add_argument("--profile-until-s", type=float, default=None,
                    help="decode, --device-loop: rows timed after this many seconds are not profiled")
    ap.add_argument("--mhc-projections", default="",
                    help="decode: also a bf16 and a release form per mHC projection form named (reduce / gemm: "
                         "InferenceOptions.mhc_projection), beside the forms on the default")
    ap.add_argument("--mhc-partials", default="",
                    help="decode: also a bf16 and a release form per count of the mHC reduce's partial sums named "
                         "(InferenceOptions.mhc_partials), beside the forms on the default")
    ap.add_argument("--release-options", default="",
                    help="decode: a JSON list of dicts of InferenceOptions fields; for each, release forms with them "
                         "set (e.g. '[{\"fp4_every_expert\": true}]'), beside the forms on the defaults")
    ap.add_argument("--bf16-options", action="store_true",
                    help="decode: a bf16 form with each of --release-options too (e.g. '[{\"attention_split_rule\": "
                         "\"wave\"}]': both caches' attention on another split rule)")
    ap.add_argument("--trace-max-mb", type=float, default=15.0,
                    help="decode: keep a form's perfetto trace in --out when under this size (0: none)")
    ap.add_argument("--dense32", action="store_true",
                    help="the FP8 dense GEMM at M = 32 at DENSE32_TUNINGS (kernel micro-benchmark), after --grouped")
    args = ap.parse_args()
    OUT["meta"] = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), jax=jax.__version__,
                       devices=[d.device_kind for d in jax.devices()],
                       command="python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]))
    log(json.dumps(OUT["meta"]))
    if args.out:
        os.makedirs(args.out, exist_ok=True)

    def save():
        if args.out:
            with open(os.path.join(args.out, "profile_release_decode.json"), "w") as f:
                json.dump(OUT, f, indent=1, default=str)

    try:
        OUT["ceilings"] = copy_and_read_bandwidth(lambda fn, a: device_us(fn, a, 1)[0],
                                                  (1 << 16) if SMOKE else (1 << 30))
        log(f"copy {OUT['ceilings']['copy_bw'] / 1e12:.2f} TB/s, read-only {OUT['ceilings']['read_bw'] / 1e12:.2f} "
            f"TB/s (4 GiB), datasheet 4.8 TB/s")
    except Exception as e:  # noqa: BLE001
        OUT["errors"].append(f"ceilings: {type(e).__name__}: {e}")
    save()
    def experts():
        if not args.skip_experts:
            log("\n| one token's routed experts (top-6 of 2304 x 5120) | dev µs | wall µs | % of 4.8 TB/s | "
                "% of read-only | rel err vs grouped | families (dev µs) |\n|---|---:|---:|---:|---:|---:|---|")
            try:
                experts_part(OUT["ceilings"], args.tilings)
            except Exception as e:  # noqa: BLE001
                OUT["errors"].append(f"experts: {type(e).__name__}: {str(e)[:400]}")
                log(f"experts FAILED: {type(e).__name__}: {str(e)[:300]}")
            save()

    def decode():
        if not args.skip_decode:
            try:
                decode_part("smoke" if SMOKE else args.model, [int(b) for b in args.batches.split(",")], args.context,
                            args.budget_s, args.out, save, args.wo_a_fp8, args.no_grouped,
                            tuple(tuple(sorted(t.items())) for t in json.loads(args.grouped_tunings or "[]")),
                            args.no_f16,
                            tuple(tuple(sorted(t.items())) for t in json.loads(args.fp8_tunings or "[]")),
                            args.combine, args.engram_host, args.no_bf16, args.device_loop,
                            tuple(filter(None, args.release_cache.split(","))), args.ahead,
                            tuple(int(k) for k in args.readback.split(",")),
                            args.profile_steps or (8 if args.device_loop else 3), args.trace_max_mb,
                            args.no_release_bf16_cache, args.profile_until_s,
                            tuple(filter(None, args.engram_host_gathers.split(","))), args.timing_repeats,
                            mhc_projections=tuple(filter(None, args.mhc_projections.split(","))),
                            mhc_partials=tuple(int(p) for p in args.mhc_partials.split(",") if p),
                            release_options=tuple(_hashable_options(o) for o in
                                                  json.loads(args.release_options or "[]")),
                            bf16_options=args.bf16_options)
            except Exception as e:  # noqa: BLE001
                OUT["errors"].append(f"decode: {type(e).__name__}: {str(e)[:400]}")
                log(f"decode FAILED: {type(e).__name__}: {str(e)[:300]}")
            save()

    if args.grouped:
        log("\n| batch-32 grouped FP4 GEMM | variant | dev µs | % of 4.8 TB/s | % of read-only | × tokens form | "
            "rel err vs float32 |\n|---|---|---:|---:|---:|---:|---:|")
        try:
            picks = [int(i) for i in args.grouped_pick.split(",")] if args.grouped_pick else \
                (list(range(GROUPED_QUICK)) if args.grouped_quick else None)
            grouped_part(OUT["ceilings"], picks=picks)
        except Exception as e:  # noqa: BLE001
            OUT["errors"].append(f"grouped: {type(e).__name__}: {str(e)[:400]}")
            log(f"grouped FAILED: {type(e).__name__}: {str(e)[:300]}")
        save()
    if args.dense32:
        log("\n| FP8 GEMM at M = 32, N x K | variant | dev µs | % of 4.8 TB/s | % of read-only | × default | "
            "rel err vs float32 |\n|---|---|---:|---:|---:|---:|---:|")
        try:
            dense32_part(OUT["ceilings"], picks=[int(i) for i in args.dense32_pick.split(",")] if args.dense32_pick
                         else None, fp8_inputs=args.dense32_fp8_inputs)
        except Exception as e:  # noqa: BLE001
            OUT["errors"].append(f"dense32: {type(e).__name__}: {str(e)[:400]}")
            log(f"dense32 FAILED: {type(e).__name__}: {str(e)[:300]}")
        save()
    for part in ((decode, experts) if args.decode_first else (experts, decode)):
        part()
    print_decode_tables()
    bad = [c for c in OUT["checks"] if not c["rel_err"] < 8e-3]
    log(f"\nerrors: {OUT['errors'] or 'none'}; checks over 8e-3: {len(bad)}; elapsed {time.time() - T0:.0f} s")
    return 1 if bad else 0


def print_decode_tables():
    """The decode rows as Markdown: the device loop's rows (step = the largest read-back interval's), then the
    host-fed steps' rows."""
    nan = float("nan")
    device_loop = OUT["meta"].get("decode_loop", "").startswith("device")
    loop = OUT["decode"] if device_loop else []
    if loop:
        ks = OUT["meta"]["readback"]
        log(f"\n{OUT['meta'].get('decode_model')}, context {OUT['meta'].get('decode_context')}, the device loop; "
            f"read-only {OUT['ceilings'].get('read_bw', nan) / 1e12:.2f} TB/s\n"
            "| batch | weights | cache | weight GB | step GB | floor ms | " + " | ".join(f"k={k} ms" for k in ks)
            + " | x floor | **x bf16** | kernel ms | x bf16 (kernels) | busy % | launches / layer | first call s |\n"
            "|---:|---|---|---:|---:|---:|" + "---:|" * len(ks) + "---:|---:|---:|---:|---:|---:|---:|")
        for r in loop:
            log(f"| {r['batch']} | {r['weights']} | {r['cache']} | {r['weight_gb']:.2f} | {r['step_gb']:.2f} | "
                f"{r.get('floor_ms', nan):.2f} | "
                + " | ".join(f"{r.get(f'device_loop_k{k}_step_ms', nan):.2f}" for k in ks)
                + f" | {r.get('x_floor', nan):.2f} | {r.get('x_bf16', nan):.2f} | "
                f"{r.get('kernel_ms_per_step', nan):.2f} | {r.get('x_bf16_kernels', nan):.2f} | "
                f"{r.get('busy_pct', nan):.0f} | {r.get('launches_per_layer', nan):.1f} | "
                f"{r.get('first_call_s', nan):.1f} | {r.get('error', '')}")
        for r in loop:
            fams = "; ".join(f"{k}: {v['ms_per_step']:.3f} / {v['launches_per_step']:.0f}"
                             for k, v in r.get("families", {}).items())
            log(f"  b{r['batch']} {r['weights']} / {r['cache']} cache — families (ms / launches per step): {fams}")
            for name, count, ms in r.get("top", [])[:12]:
                log(f"    {ms:.3f} ms x{count:.0f} {name}")
        hosts = [r for r in loop if "host_pct_of_step" in r]
        if hosts:
            log("\nEngram tables in host memory vs in HBM (same run, same batch and cache; step = k="
                f"{max(ks)}):\n| batch | form | step ms | HBM-table step ms | host - HBM ms | **% of the step** | "
                "busy % | launches / layer | wait ms (profiled wall - busy) | HBM wait ms | runs ms | HBM runs ms |\n"
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
            for r in hosts:
                log(f"| {r['batch']} | {r['weights'][len(HOST_FORM):].strip(' ()')} | {r['step_ms']:.2f} | "
                    f"{r['step_ms'] - r['host_minus_hbm_ms']:.2f} | {r['host_minus_hbm_ms']:+.2f} | "
                    f"{r['host_pct_of_step']:+.1f} % | {r.get('busy_pct', nan):.0f} | "
                    f"{r.get('launches_per_layer', nan):.1f} | {r.get('wait_ms_per_step', nan):.2f} | "
                    f"{r.get('hbm_wait_ms_per_step', nan):.2f} | "
                    f"{' / '.join(f'{v:.2f}' for v in r.get('step_ms_runs', []))} | "
                    f"{' / '.join(f'{v:.2f}' for v in r.get('hbm_step_ms_runs', []))} |")
    log("\n| batch | weights | first call s | synced ms | queued ms | busy ms | kernel ms | launches | families "
        "(ms / launches per step) |\n|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for r in [] if device_loop else OUT["decode"]:
        fams = "; ".join(f"{k}: {v['ms_per_step']:.3f} / {v['launches_per_step']:.0f}"
                         for k, v in r.get("families", {}).items())
        log(f"| {r['batch']} | {r['weights']} | {r.get('first_call_s', float('nan')):.1f} | "
            f"{r.get('step_ms', float('nan')):.2f} | {r.get('queued_ms', float('nan')):.2f} | "
            f"{r.get('busy_ms_per_step', float('nan')):.2f} | {r.get('kernel_ms_per_step', float('nan')):.2f} | "
            f"{r.get('launches_per_step', float('nan')):.0f} | {fams} | {r.get('error', '')}")


if __name__ == "__main__":
    sys.exit(main())
