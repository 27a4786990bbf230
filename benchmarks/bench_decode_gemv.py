"""The batch-1 decode step's weight-streaming kernels against HBM bandwidth, old form vs new in one process: the FP4
one-token expert kernels (``fp4_slot_swiglu`` / ``fp4_slot_down``) per decode form and tiling, and the FP8 gemv
(``fp8_gemm`` / ``fp8_gemm_fused`` at M = 1) per tiling, at the 40-layer bench model's shapes (d 5120, experts
2304 x 5120 top-6, attention / shared-expert projections).

    PYTHONUNBUFFERED=1 python benchmarks/bench_decode_gemv.py --out DIR [--budget-s 300]
    python benchmarks/bench_decode_gemv.py --smoke      # CPU: tiny sizes, interpret mode, no timing
    PYTHONUNBUFFERED=1 python benchmarks/bench_decode_gemv.py --m32 --out DIR   # the dense FP8 GEMM at M = 32 only
    PYTHONUNBUFFERED=1 python benchmarks/bench_decode_gemv.py --grouped-bf16x1 --out DIR   # the grouped FP4 decodes

Parts:
  ceilings  copy (read + write) and read-only bandwidth of a 4 GiB int32 buffer, device time (``ceilings.py``).
  fp4       one token's six picked experts, each call R = 8 tokens with distinct picks out of 48 experts (> the
            50 MB L2): gate / up and down kernels timed separately (device time of the named kernels / R, from a
            profile of one call), bytes = the picked experts' packed bytes + scales; every variant also run with
            float32 activations against the plain-JAX float32 oracle (``backend="reference"``): rel err. FP4_VARIANTS
            row 0, the "pair_group" decode (the default before), is the same-run baseline; it runs again last.
  fp8       M = 1, bf16 activations, each projection shape with R distinct weights per call (> 384 MB); FP8_VARIANTS
            (the default first: the baseline); rel err against float32 on the dequantised weights.
Every row: device µs, TB/s, % of this process's read-only bandwidth and of the 4.8 TB/s datasheet figure, × the
baseline. Output: DIR/bench_decode_gemv.json, the table on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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
from profile_release_decode import bandwidth_pct  # noqa: E402
from dsv41_jax.kernels import quant_gemm as QG  # noqa: E402

DATASHEET_BW = 4.8e12
BE = "pallas_gpu_interpret" if SMOKE else "pallas_gpu"
E_STACK, TOPK, R = (8, 2, 2) if SMOKE else (48, 6, 8)
F_, D_ = (64, 96) if SMOKE else (2304, 5120)
LIMIT = 10.0
# (label, gate / up tuning, down tuning); row 0 the same-run baseline
FP4_VARIANTS = [("pair_group (before)", dict(decode="pair_group"), dict(decode="pair_group")),
                ("word", dict(decode="word"), dict(decode="word")),
                ("word, up 4 warps / down 2 warps", dict(decode="word", num_warps=4), dict(decode="word", num_warps=2)),
                ("word, up 4 warps pf 2 / down pf 4", dict(decode="word", num_warps=4, prefetch=2),
                 dict(decode="word", prefetch=4)),
                ("word, up pf 8 / down block_n 32 8 warps", dict(decode="word", prefetch=8),
                 dict(decode="word", block_n=32, num_warps=8)),
                ("word, up block_n 16 / down block_n 8", dict(decode="word", block_n=16),
                 dict(decode="word", block_n=8)),
                ("pair_group (before), again", dict(decode="pair_group"), dict(decode="pair_group"))]
# --set 2: the second pass, around the first pass's best "word" tiling (registers and SASS per byte from
# kernel_sass.py in the comments: gate / up | down)
FP4_VARIANTS_2 = [FP4_VARIANTS[0],
                  ("word, up 4 warps pf 2 / down pf 4", dict(decode="word", num_warps=4, prefetch=2),  # 128 | 100
                   dict(decode="word", prefetch=4)),
                  ("word, up 4 warps pf 1 / down pf 2", dict(decode="word", num_warps=4, prefetch=1),  # 128 | 98
                   dict(decode="word", prefetch=2)),
                  ("word, up 4 warps block_k 256 pf 4 / down 2 warps pf 4",  # 96 regs 9.7 / byte | 168 regs 9.1
                   dict(decode="word", num_warps=4, block_k=256, prefetch=4), dict(decode="word", num_warps=2,
                                                                                   prefetch=4)),
                  ("word, up 2 warps pf 2 / down 2 warps pf 2", dict(decode="word", num_warps=2, prefetch=2),
                   dict(decode="word", num_warps=2, prefetch=2)),  # 168 regs 8.7 / byte
                  ("word, up 4 warps block_n 4 pf 4 / down block_n 8 pf 4",
                   dict(decode="word", num_warps=4, block_n=4, prefetch=4),
                   dict(decode="word", block_n=8, prefetch=4)),
                  ("pair_group (before), again", dict(decode="pair_group"), dict(decode="pair_group"))]
# --set 3: the persistent forms (``programs``: one program per resident slot, each walking a share of the (slot, row
# block) items with the next item's loads in flight) against the default of 2026-12-03 06:52 (word, gate / up 8-row
# blocks 4 warps 2 ahead; down 16-row blocks 2 ahead). P = programs per multiprocessor x 132, from the registers of
# the sm_90 SASS (kernel_sass.py; in comments: gate / up | down) — a P above what fits would leave programs waiting
FP4_VARIANTS_3 = [("word default (06:52)", dict(decode="word"), dict(decode="word")),
                  ("persistent, up pf 1 P 528 ; down pf 1 P 924",  # 128 regs 4 / SM | 72 regs 7 / SM
                   dict(decode="word", prefetch=1, programs=528), dict(decode="word", prefetch=1, programs=924)),
                  ("persistent, up pf 2 P 396 ; down pf 2 P 660",  # 164 regs 3 / SM | 96 regs 5 / SM
                   dict(decode="word", programs=396), dict(decode="word", programs=660)),
                  ("persistent, up block_n 4 pf 1 P 924 ; down block_n 8 pf 1 P 1056",  # 72 regs 7 | 62 regs 8
                   dict(decode="word", block_n=4, prefetch=1, programs=924),
                   dict(decode="word", block_n=8, prefetch=1, programs=1056)),
                  ("persistent, up block_n 4 pf 2 P 660 ; down block_n 8 pf 2 P 924",  # 96 regs 5 | 68 regs 7
                   dict(decode="word", block_n=4, prefetch=2, programs=660),
                   dict(decode="word", block_n=8, prefetch=2, programs=924)),
                  ("persistent, up pf 1 P 396 ; down pf 1 P 660 (fewer programs than fit)",
                   dict(decode="word", prefetch=1, programs=396), dict(decode="word", prefetch=1, programs=660)),
                  ("word default (06:52), again", dict(decode="word"), dict(decode="word"))]
if SMOKE:
    FP4_VARIANTS = [FP4_VARIANTS[0], FP4_VARIANTS[1],
                    ("word small", dict(decode="word", block_n=4, block_k=32, prefetch=1),
                     dict(decode="word", block_n=4, block_k=64))]
# (label, [(N, K), ...] one input's projections (several: the fused kernel))
FP8_SHAPES = ([("wq_b 32768 x 1280", [(32768, 1280)]), ("wo_b 5120 x 8192", [(5120, 8192)]),
               ("shared w2 5120 x 2304", [(5120, 2304)]), ("wq_a + wkv (1280 + 512) x 5120", [(1280, 5120),
                                                                                          (512, 5120)]),
               ("shared w1 + w3 2 x 2304 x 5120", [(2304, 5120), (2304, 5120)])]
              if not SMOKE else [("small", [(64, 256)]), ("small fused", [(64, 256), (32, 256)])])
FP8_VARIANTS = [("default", {}), ("block_n 16", dict(block_n=16)), ("block_k 512 pf 4", dict(block_k=512, prefetch=4)),
                ("block_k 512 pf 8", dict(block_k=512, prefetch=8)), ("2 warps", dict(num_warps=2)),
                ("split_k 2", dict(split_k=2)), ("default, again", {})]
# --set 2: (shape index, variants) around the first pass's best tilings per shape
FP8_PLAN_2 = [(0, [("default", {}), ("block_n 16", dict(block_n=16)), ("block_n 32", dict(block_n=32)),
                   ("block_n 16, 2 warps", dict(block_n=16, num_warps=2)), ("default, again", {})]),
              (1, [("default", {}), ("block_k 512 pf 4", dict(block_k=512, prefetch=4)),
                   ("block_k 512 pf 2", dict(block_k=512, prefetch=2)),
                   ("block_k 1024 pf 2", dict(block_k=1024, prefetch=2)),
                   ("block_k 512 pf 4, 8 warps", dict(block_k=512, prefetch=4, num_warps=8))]),
              (2, [("default", {}), ("block_k 128 pf 8", dict(block_k=128, prefetch=8))])]
# --set 3: the persistent gemv (one weight) against each shape's default; P from the SASS registers as above
FP8_PLAN_3 = [(0, [("default (16-row, 256-wide, 5 ahead)", {}),
                   ("persistent 16-row pf 1 P 528", dict(block_n=16, block_k=256, prefetch=1, programs=528)),  # 112
                   ("persistent 16-row pf 2 P 528", dict(block_n=16, block_k=256, prefetch=2, programs=528)),  # 128
                   ("persistent 8-row pf 2 P 660", dict(block_n=8, block_k=256, prefetch=2, programs=660)),  # 96
                   ("default, again", {})]),
              (1, [("default (512-wide, 2 ahead)", {}),
                   ("persistent pf 2 P 396", dict(block_k=512, prefetch=2, programs=396)),  # 130 regs
                   ("persistent pf 1 P 528", dict(block_k=512, prefetch=1, programs=528)),  # 128 regs
                   ("default, again", {})]),
              (2, [("default (128-wide, 8 ahead)", {}),
                   ("persistent pf 2 P 528", dict(block_k=128, prefetch=2, programs=528)),  # 104 regs
                   ("persistent pf 1 P 396", dict(block_k=128, prefetch=1, programs=396)),  # 134 regs
                   ("default, again", {})])]
# --set 3: the grouped FP4 kernel at the batch-32 decode step's shapes (192 rows = 32 tokens x top-6 of 16 experts),
# (label, tuning); the default (16-row token tiles, 64-row weight blocks, 256-wide K steps, 3 stages) first and last
GROUPED_SHAPES = [("w1 / w3 2304 x 5120", 2304, 5120), ("w2 5120 x 2304", 5120, 2304)] if not SMOKE else \
    [("small", 64, 256)]
GROUPED_VARIANTS = {0: [("default", {}), ("split_k 2", dict(split_k=2)), ("split_k 4", dict(split_k=4)),
                        ("split_k 2, 4 stages", dict(split_k=2, num_stages=4)), ("default, again", {})],
                    1: [("default", {}), ("split_k 3", dict(split_k=3)), ("4 stages", dict(num_stages=4)),
                        ("default, again", {})]}
if SMOKE:
    GROUPED_VARIANTS = {0: [("default", {}), ("split_k 2", dict(split_k=2, block_k=64))]}
# --grouped-fp8: the FP8 tensor-core form (mma="fp8": e2m1 -> e4m3 bytes, one FP8 wgmma per 32-wide K chunk promoted to
# float32 with both scales) against the default, on FP8-rounded rows (the release's GEMM inputs)
GROUPED_FP8_VARIANTS = [("default (bf16 wgmma, bf16x2 decode)", {}), ("fp8 wgmma, block_n 64", dict(mma="fp8")),
                        ("fp8 wgmma, block_n 128", dict(mma="fp8", block_n=128)),
                        ("fp8 wgmma, block_n 256", dict(mma="fp8", block_n=256)),
                        ("fp8 wgmma, block_n 128, 4 stages", dict(mma="fp8", block_n=128, num_stages=4)),
                        ("default, again", {})]
if SMOKE:
    GROUPED_FP8_VARIANTS = [("default", {}), ("fp8 wgmma", dict(mma="fp8", block_k=64))]
# --grouped-fp8-tokens: the FP8 form with the token tile as the product's row side (mma_rows="tokens": 16-row tiles,
# below the 64-row wgmma, so Triton's synchronous MMA path — on sm_90 two float16 MMAs per FP8 chunk, both operands
# widened by F2FP — with the per-chunk promotion on registers and no wgmma wait), against the default
GROUPED_FP8_TOKENS_VARIANTS = [("default (bf16 wgmma, bf16x2 decode)", {}),
                               ("fp8 tokens (sync MMA), block_n 64", dict(mma="fp8", mma_rows="tokens")),
                               ("fp8 tokens (sync MMA), block_n 128", dict(mma="fp8", mma_rows="tokens", block_n=128)),
                               ("fp8 tokens (sync MMA), block_n 256", dict(mma="fp8", mma_rows="tokens", block_n=256)),
                               ("default, again", {})]
if SMOKE:
    GROUPED_FP8_TOKENS_VARIANTS = [("default", {}), ("fp8 tokens", dict(mma="fp8", mma_rows="tokens", block_k=64))]
# --m32 (issue 14, 2026-12-04): the batch-32 decode step's dense FP8 projections at M = 32 (bf16 activations), the
# default before the M = 32 tiling (256-wide K steps, the older K split, the masking e4m3 decode) against the new one
# (128-wide K steps, the one-wave split of ``quant_gemm_gpu._fp8_m32_split``, the "sign" decode) and the two changes
# apart; row 0 is the same-run baseline, run again last. Each row's time: all kernels of the call (the split's
# float32 partial sums included), also the GEMM kernel alone
M32_VARIANTS = [("before (256-wide K, old split, mask decode)", dict(block_k=256, e4m3_decode="mask")),
                ("new default (128-wide K, one-wave split, sign decode)", {}),
                ("new tiling, sign_fold decode (option)", dict(e4m3_decode="sign_fold")),
                ("new tiling, mask decode", dict(e4m3_decode="mask")),
                ("old tiling, sign decode", dict(block_k=256)),
                ("before, again", dict(block_k=256, e4m3_decode="mask"))]
# --grouped-bf16x1: the grouped FP4 kernel's one-multiply decode ("bf16x1": bf16 patterns times 2^(s - 1), exact for
# scale bytes <= 128 — the benchmark's random scales are 118..123) against the "bf16x2" decode, each run twice,
# alternating; GROUPED_DECODE_CHECK first: every packed byte x every scale byte through the kernel on the device
GROUPED_BF16X1_VARIANTS = [("bf16x2 (default before)", dict(decode="bf16x2")), ("bf16x1", dict(decode="bf16x1")),
                           ("bf16x2, again", dict(decode="bf16x2")), ("bf16x1, again", dict(decode="bf16x1"))]
if SMOKE:
    GROUPED_BF16X1_VARIANTS = [(lb, dict(t, block_k=64)) for lb, t in GROUPED_BF16X1_VARIANTS[:2]]
OUT: dict = {"meta": {}, "ceilings": {}, "fp4": [], "fp8": [], "grouped": [], "m32": [], "m32_decode_check": {},
             "decode_check": [], "errors": []}
T0 = time.time()


def log(*a):
    print(*a, flush=True)


def dev_us(fn, args, match=None):
    """Device µs of one call: all kernels, or those whose name contains ``match``; NaN on CPU."""
    jax.block_until_ready(fn(*args))
    if SMOKE:
        return float("nan")
    tot, by_name = B.device_time(fn, *args)
    if match is None:
        return tot * 1e6
    return sum(t for nm, t in by_name.items() if match in nm) * 1e6


def rates(nbytes, us, bw):
    """TB/s and the % of the read-only / datasheet bandwidth (``profile_release_decode.bandwidth_pct``)."""
    return dict(tb_s=nbytes / (us * 1e-6) / 1e12, **bandwidth_pct(nbytes, us, bw))


def fp4_part(bw, budget_s, variants):
    ks = jax.random.split(jax.random.PRNGKey(7), 8)
    w1q, w3q = B.random_fp4(ks[0], E_STACK, F_, D_), B.random_fp4(ks[1], E_STACK, F_, D_)
    w2q = B.random_fp4(ks[2], E_STACK, D_, F_)
    perm = np.random.default_rng(3).permutation(E_STACK)[:R * TOPK].reshape(R, TOPK)
    picks = [jnp.asarray(p, jnp.int32) for p in perm]
    wts = [jax.random.uniform(jax.random.fold_in(ks[3], i), (TOPK,), jnp.float32, 0.1, 0.5) for i in range(R)]
    xs = [jax.random.normal(jax.random.fold_in(ks[4], i), (D_,), jnp.float32).astype(jnp.bfloat16) for i in range(R)]
    acts = [(jax.random.normal(jax.random.fold_in(ks[5], i), (TOPK, F_), jnp.float32) * 0.1).astype(jnp.bfloat16)
            for i in range(R)]
    up_bytes = TOPK * 2 * (F_ * D_ // 2 + F_ * D_ // 32)
    dn_bytes = TOPK * (D_ * F_ // 2 + D_ * F_ // 32)
    x32, a32 = xs[0].astype(jnp.float32), acts[0].astype(jnp.float32)
    ref_up = QG.fp4_slot_swiglu(x32, picks[0], wts[0], w1q, w3q, limit=LIMIT, backend="reference")
    ref_dn = QG.fp4_slot_down(a32, picks[0], w2q, backend="reference")
    base = None
    for i, (label, up, dn) in enumerate(variants):
        if time.time() - T0 > budget_s:
            OUT["errors"].append(f"fp4 {label}: skipped, budget")
            continue
        upn, dnn = dict(up, name=f"fp4up_v{i}"), dict(dn, name=f"fp4dn_v{i}")
        try:
            e_up = B.rel_err(QG.fp4_slot_swiglu(x32, picks[0], wts[0], w1q, w3q, limit=LIMIT, backend=BE,
                                                tuning=upn), ref_up)
            e_dn = B.rel_err(QG.fp4_slot_down(a32, picks[0], w2q, backend=BE, tuning=dnn), ref_dn)
            f_up = jax.jit(lambda xs, wts, picks, a, b, upn=upn: [
                QG.fp4_slot_swiglu(x, p, w, a, b, limit=LIMIT, backend=BE, tuning=upn)
                for x, w, p in zip(xs, wts, picks)])
            f_dn = jax.jit(lambda acts, picks, c, dnn=dnn: [QG.fp4_slot_down(a, p, c, backend=BE, tuning=dnn)
                                                            for a, p in zip(acts, picks)])
            t_up = dev_us(f_up, (xs, wts, picks, w1q, w3q), f"fp4up_v{i}") / R
            t_dn = dev_us(f_dn, (acts, picks, w2q), f"fp4dn_v{i}") / R
        except Exception as ex:  # noqa: BLE001 - a variant that fails is reported, the rest still run
            OUT["errors"].append(f"fp4 {label}: {type(ex).__name__}: {str(ex)[:400]}")
            log(f"fp4 {label}: FAILED {type(ex).__name__}: {str(ex)[:300]}")
            continue
        row = dict(variant=label, up=up, down=dn, up_us=t_up, down_us=t_dn, total_us=t_up + t_dn,
                   up_bytes=up_bytes, down_bytes=dn_bytes, rel_err_up=e_up, rel_err_down=e_dn,
                   up_rates=rates(up_bytes, t_up, bw), down_rates=rates(dn_bytes, t_dn, bw),
                   total_rates=rates(up_bytes + dn_bytes, t_up + t_dn, bw))
        base = base or row
        row["x_before"] = base["total_us"] / row["total_us"]
        OUT["fp4"].append(row)
        log(f"fp4 | {label} | up {t_up:.1f} µs ({row['up_rates']['pct_read']:.0f}%) | down {t_dn:.1f} µs "
            f"({row['down_rates']['pct_read']:.0f}%) | total {row['total_rates']['tb_s']:.2f} TB/s "
            f"{row['total_rates']['pct_read']:.0f}% of read-only | x {row['x_before']:.2f} | err {e_up:.1e} / "
            f"{e_dn:.1e}")


def fp8_inputs(key, shapes, r, m):
    """R distinct random FP8 weight sets (one weight per (n, k) of ``shapes``) and bf16 activations [m, K]."""
    sets = [tuple(B.random_fp8(jax.random.fold_in(key, 100 * j + p), n, k) for p, (n, k) in enumerate(shapes))
            for j in range(r)]
    x = jax.random.normal(jax.random.fold_in(key, 7), (m, shapes[0][1]), jnp.float32).astype(jnp.bfloat16)
    return sets, x


def fp8_call(tuning):
    """x, (weights...) -> (outputs...): ``fp8_linear`` for one weight, ``fp8_linear_fused`` for several."""
    def one(x, ws):
        if len(ws) == 1:
            return (QG.fp8_linear(x, ws[0], backend=BE, tuning=tuning),)
        return QG.fp8_linear_fused(x, ws, backend=BE, tuning=tuning)
    return one


def fp8_part(bw, budget_s, plan=None):
    plan = plan or [(i, FP8_VARIANTS) for i in range(len(FP8_SHAPES))]
    for si, variants in plan:
        label, shapes = FP8_SHAPES[si]
        nbytes = sum(n * k + (-(-n // 32)) * (-(-k // 32)) + 2 * n for n, k in shapes) + 2 * shapes[0][1]
        r = 2 if SMOKE else int(max(2, -(-(384 << 20) // nbytes)))
        sets, x = fp8_inputs(jax.random.fold_in(jax.random.PRNGKey(11), si), shapes, r, 1)
        want = [np.asarray(x, np.float64) @ np.asarray(w.dequantize(jnp.float32), np.float64).T for w in sets[0]]
        base = None
        for vi, (vlabel, tuning) in enumerate(variants):
            if time.time() - T0 > budget_s:
                OUT["errors"].append(f"fp8 {label} {vlabel}: skipped, budget")
                continue
            nm = f"fp8v{si}_{vi}"
            one = fp8_call(dict(tuning, name=nm))

            try:
                got = one(x, sets[0])
                err = max(B.rel_err(np.asarray(g, np.float64), w_) for g, w_ in zip(got, want))
                f = jax.jit(lambda x, sets: [one(x, ws) for ws in sets])
                t = dev_us(f, (x, sets), nm) / r
            except Exception as ex:  # noqa: BLE001
                OUT["errors"].append(f"fp8 {label} {vlabel}: {type(ex).__name__}: {str(ex)[:400]}")
                log(f"fp8 {label} {vlabel}: FAILED {type(ex).__name__}: {str(ex)[:300]}")
                continue
            row = dict(shape=label, variant=vlabel, tuning=tuning, us=t, bytes=nbytes, rel_err=err,
                       **rates(nbytes, t, bw))
            base = base or row
            row["x_default"] = base["us"] / t
            OUT["fp8"].append(row)
            log(f"fp8 | {label} | {vlabel} | {t:.2f} µs | {row['tb_s']:.2f} TB/s | {row['pct_read']:.0f}% of "
                f"read-only | {row['pct_datasheet']:.0f}% of 4.8 | x {row['x_default']:.2f} | err {err:.1e}")


def grouped_part(bw, budget_s, fp8_inputs: bool = False, fp8_variants=None, variants=None):
    """The grouped FP4 kernel (``quant_gemm.fp4_grouped``, bf16 rows) at the batch-32 step's shapes: each call R
    distinct expert stacks (> L2) with their own routings; device µs per GEMM of the whole call (the kernel, the
    XLA ops around it — tile metadata, the even / odd split of x, the split-K sum, the FP8 form's codes and tile
    gather) and of the kernel alone; bytes = the used experts' packed bytes + scales + activations + output; rel err
    of the bf16 output against float32 on the dequantised weights (the first routing's rows). ``fp8_inputs``: the
    rows FP8-rounded per 32 first (the release's GEMM inputs; the reference takes the same rounded rows) and
    ``fp8_variants`` (default ``GROUPED_FP8_VARIANTS``); the max abs error over the output's max abs is recorded
    too. ``variants``: (label, tuning) rows in place of the defaults (row 0 the baseline)."""
    given = variants
    m, e, topk = (8, 4, 2) if SMOKE else (32, 16, 6)
    r = 2 if SMOKE else 4
    for gi, (label, n, k) in enumerate(GROUPED_SHAPES):
        key = jax.random.fold_in(jax.random.PRNGKey(21), gi)
        ws = [B.random_fp4(jax.random.fold_in(key, j), e, n, k) for j in range(r)]
        gss = [B._routing(jax.random.fold_in(key, 100 + j), m, e, topk) for j in range(r)]
        a = m * topk
        x = jax.random.normal(jax.random.fold_in(key, 7), (a, k), jnp.float32).astype(jnp.bfloat16)
        if fp8_inputs:
            x = QG.fp8_round(x, backend="reference")
        used = float(np.mean([int(jnp.sum(g > 0)) for g in gss]))
        nbytes = used * (n * k // 2 + n * k // 32) + a * k * 2 + a * n * 2
        want = jax.lax.ragged_dot(x.astype(jnp.float32), jnp.swapaxes(ws[0].dequantize(jnp.float32), 1, 2), gss[0],
                                  precision=jax.lax.Precision.HIGHEST)
        base = None
        variants = given or ((fp8_variants or GROUPED_FP8_VARIANTS) if fp8_inputs else
                             GROUPED_VARIANTS.get(gi, GROUPED_VARIANTS[0]))
        for vi, (vlabel, tuning) in enumerate(variants):
            if time.time() - T0 > budget_s:
                OUT["errors"].append(f"grouped {label} {vlabel}: skipped, budget")
                continue
            nm = f"fp4grp{gi}_{vi}"
            tn = dict(tuning, name=nm)
            try:
                got = QG.fp4_grouped(x, gss[0], ws[0], backend=BE, tuning=tn)
                err = B.rel_err(got, want)
                max_err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
                f = jax.jit(lambda x, gss, ws, tn=tn: [QG.fp4_grouped(x, g, w, backend=BE, tuning=tn)
                                                       for g, w in zip(gss, ws)])
                jax.block_until_ready(f(x, gss, ws))
                if SMOKE:
                    t_all = t_k = float("nan")
                else:
                    tot, by_name = B.device_time(f, x, gss, ws)
                    t_all, t_k = tot * 1e6 / r, sum(t for nm_, t in by_name.items() if nm in nm_) * 1e6 / r
            except Exception as ex:  # noqa: BLE001
                OUT["errors"].append(f"grouped {label} {vlabel}: {type(ex).__name__}: {str(ex)[:400]}")
                log(f"grouped {label} {vlabel}: FAILED {type(ex).__name__}: {str(ex)[:300]}")
                continue
            row = dict(shape=label, variant=vlabel, tuning=tuning, call_us=t_all, kernel_us=t_k, bytes=nbytes,
                       used_experts=used, rel_err=err, max_abs_err_over_max=max_err,
                       call_rates=rates(nbytes, t_all, bw) if bw else {},
                       kernel_rates=rates(nbytes, t_k, bw) if bw else {})
            base = base or row
            row["x_default_call"] = base["call_us"] / t_all
            row["x_default_kernel"] = base["kernel_us"] / t_k
            OUT["grouped"].append(row)
            log(f"grouped | {label} | {vlabel} | call {t_all:.1f} µs ({row['call_rates'].get('pct_read', 0):.0f}% "
                f"of read-only) | kernel {t_k:.1f} µs ({row['kernel_rates'].get('pct_read', 0):.0f}%, "
                f"{row['kernel_rates'].get('pct_datasheet', 0):.0f}% of 4.8) | x {row['x_default_call']:.2f} "
                f"(kernel x {row['x_default_kernel']:.2f}) | err {err:.1e} | max err {max_err:.1e}")


def grouped_decode_check():
    """The grouped FP4 kernel ("weights" form) on the device with weights of every packed byte (both nibbles) x every
    scale byte: weight row r holds bytes 0..255 with scale byte r in all its 16 groups, the activations the 512 x 512
    identity, so output row k is weight column k (one product by 1, the rest + 0: exact in the float32 accumulator
    and its bf16 rounding — an inf weight makes its whole column NaN through inf x 0). Per decode, against the exact
    dequantisation in numpy (``checkpoint.quantized.dequant_fp4_rows``): the scale bytes whose weights are not all
    equal to the reference (as numbers: the code -0 comes out of the sum as +0), and those whose weights are not all
    inf / NaN."""
    import ml_dtypes

    from dsv41_jax.checkpoint import quantized as QZ
    from dsv41_jax.kernels import quant_gemm_gpu as G

    v = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    s = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    ref = QZ.dequant_fp4_rows(v, s.view(ml_dtypes.float8_e8m0fnu))  # [256 scale bytes, 512] float32, exact
    with np.errstate(over="ignore"):
        ref = ref.astype(ml_dtypes.bfloat16).astype(np.float32)  # the bf16 values (exact where finite)
    x = jnp.eye(512, dtype=jnp.bfloat16)
    for dec in ("bf16x2", "bf16x1"):
        try:
            out = G.fp4_grouped_gemm(x, jnp.array([512], jnp.int32), jnp.asarray(v)[None], jnp.asarray(s)[None],
                                     mma_rows="weights", decode=dec, interpret=SMOKE)
            got = np.asarray(out.astype(jnp.float32)).T  # [256 scale bytes, 512]: weight row r
        except Exception as ex:  # noqa: BLE001
            OUT["errors"].append(f"decode check {dec}: {type(ex).__name__}: {str(ex)[:400]}")
            log(f"decode check {dec}: FAILED {type(ex).__name__}: {str(ex)[:300]}")
            continue
        same = (got == ref) | (np.isnan(got) & np.isnan(ref))
        not_equal = [r for r in range(256) if not same[r].all()]
        finite = [r for r in range(256) if np.isfinite(got[r]).any()]
        row = dict(decode=dec, scale_bytes_not_equal=not_equal, scale_bytes_with_finite_weights=finite,
                   equal_0_128=not any(r <= 128 for r in not_equal),
                   nonfinite_129_255=not any(r > 128 for r in finite))
        OUT["decode_check"].append(row)
        big = [r for r in finite if r > 128]
        log(f"decode check | {dec} | scale bytes 0..128 not equal to the reference: "
            f"{[r for r in not_equal if r <= 128]} | above 128: {len([r for r in not_equal if r > 128])} not equal, "
            f"{len(big)} with finite weights {big[:4]}{'...' if len(big) > 4 else ''}")


# ---- --m32: the dense FP8 GEMM at M = 32 (issue 14, 2026-12-04) ------------------------------------------------

def m32_decode_check():
    """On the device: every e4m3 byte through the PTX decodes (``e4m3_decode`` "sign" / "mask" / "sign_fold") of the
    M = 32 weights form — weights [256, 32] whose row n holds byte n, eight 32-row blocks with scales 2^(-3 i), x
    one-hot on column 0 — against ml_dtypes' e4m3 value x scale (exact in the bf16 output); the NaN bytes 0x7F / 0xFF
    reported apart."""
    import ml_dtypes
    from dsv41_jax.kernels import quant_gemm_gpu as G

    b = np.arange(256)
    v = jnp.asarray(np.repeat(b[:, None], 32, axis=1).astype(np.uint8))
    s_bytes = (127 - 3 * np.arange(8)).astype(np.uint8)[:, None]
    x = jnp.zeros((32, 32), jnp.bfloat16).at[:, 0].set(1)
    want = b.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** (np.repeat(
        s_bytes[:, 0].astype(np.float64), 32) - 127)
    nan = (b & 0x7F) == 0x7F
    res = {}
    for dec in ("sign", "mask", "sign_fold"):
        got = np.asarray(G.fp8_gemm(x, v, jnp.asarray(s_bytes), e4m3_decode=dec, interpret=SMOKE), np.float64)
        rows_equal = all(np.array_equal(g, got[0], equal_nan=True) for g in got)  # the 32 one-hot rows alike
        bad = [int(i) for i in np.nonzero(got[0][~nan] != want[~nan])[0]]
        res[dec] = dict(non_nan_bytes_exact=not bad and rows_equal, mismatching=[int(b[~nan][i]) for i in bad],
                        nan_bytes={hex(int(i)): float(got[0][i]) for i in np.nonzero(nan)[0]})
        log(f"m32 decode check | {dec} | all 254 non-NaN bytes exact: {res[dec]['non_nan_bytes_exact']} | "
            f"NaN bytes give {res[dec]['nan_bytes']}")
    OUT["m32_decode_check"] = res


def m32_part(bw, budget_s):
    """Each bench40 dense projection at M = 32 (``FP8_SHAPES``), R distinct weights per call (> 384 MB, beyond the
    L2), per ``M32_VARIANTS`` row (variants outer, so the baseline and the new default come first): device µs of the
    whole call (GEMM + split sum) and of the GEMM kernel alone, weights + scales bytes over the call time as % of the
    read-only bandwidth measured in this process and of 4.8 TB/s; rel err (norm) and max abs err / max |ref| of the
    bf16 output against float32 on the dequantised weights (precision HIGHEST, on the device); the largest
    difference to row 0's output (over max |ref|). Then the per-layer sums (one of each projection)."""
    from dsv41_jax.kernels import quant_gemm_gpu as G

    m = 32
    data = []
    for si, (label, shapes) in enumerate(FP8_SHAPES):
        nbytes = sum(n * k + (-(-n // 32)) * (-(-k // 32)) for n, k in shapes)
        r = 2 if SMOKE else int(max(2, -(-(384 << 20) // nbytes)))
        sets, x = fp8_inputs(jax.random.fold_in(jax.random.PRNGKey(31), si), shapes, r, m)
        want = [jnp.dot(x.astype(jnp.float32), w.dequantize(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
                for w in sets[0]]
        data.append((label, shapes, nbytes, r, sets, x, want))
    first = {}
    for vi, (vlabel, tuning) in enumerate(M32_VARIANTS):
        for si, (label, shapes, nbytes, r, sets, x, want) in enumerate(data):
            if time.time() - T0 > budget_s:
                OUT["errors"].append(f"m32 {label} {vlabel}: skipped, budget")
                continue
            nm = f"fp8m32_{si}_{vi}"
            one = fp8_call(dict(tuning, name=nm))

            try:
                t = G.fp8_default_tiling(m, sum(n for n, _ in shapes), shapes[0][1], **tuning)
                got = [np.asarray(g.astype(jnp.float32), np.float64) for g in one(x, sets[0])]
                wn = [np.asarray(w_, np.float64) for w_ in want]
                err = max(B.rel_err(g, w_) for g, w_ in zip(got, wn))
                max_err = max(float(np.max(np.abs(g - w_)) / np.max(np.abs(w_))) for g, w_ in zip(got, wn))
                first.setdefault(si, got)
                diff0 = max(float(np.max(np.abs(g - g0)) / np.max(np.abs(w_)))
                            for g, g0, w_ in zip(got, first[si], wn))
                f = jax.jit(lambda x, sets: [one(x, ws) for ws in sets])
                jax.block_until_ready(f(x, sets))
                if SMOKE:
                    t_all = t_k = float("nan")
                else:
                    tot, by_name = B.device_time(f, x, sets)
                    t_all = tot * 1e6 / r
                    t_k = sum(v for k_, v in by_name.items() if nm in k_) * 1e6 / r
            except Exception as ex:  # noqa: BLE001 - a variant that fails is reported, the rest still run
                OUT["errors"].append(f"m32 {label} {vlabel}: {type(ex).__name__}: {str(ex)[:400]}")
                log(f"m32 {label} {vlabel}: FAILED {type(ex).__name__}: {str(ex)[:300]}")
                continue
            row = dict(shape=label, variant=vlabel, tuning=tuning, block_k=t["block_k"], split_k=t["split_k"],
                       e4m3_decode=t["e4m3_decode"], call_us=t_all, kernel_us=t_k, bytes=nbytes, r=r, rel_err=err,
                       max_abs_err_over_max=max_err, max_abs_diff_to_row0_over_max=diff0,
                       **(rates(nbytes, t_all, bw) if not SMOKE else {}))
            base = next((q for q in OUT["m32"] if q["shape"] == label), row)
            row["x_before"] = base["call_us"] / t_all
            OUT["m32"].append(row)
            log(f"m32 | {label} | {vlabel} | block_k {t['block_k']} split {t['split_k']} {t['e4m3_decode']} | call "
                f"{t_all:.2f} µs (kernel {t_k:.2f}) | {row.get('pct_read', float('nan')):.0f}% of read-only | "
                f"{row.get('pct_datasheet', float('nan')):.0f}% of 4.8 | x {row['x_before']:.2f} | err {err:.1e} | "
                f"max err {max_err:.1e} | diff to row 0 {diff0:.1e}")
    layer = {}
    for vlabel, _ in M32_VARIANTS:
        rows = [q for q in OUT["m32"] if q["variant"] == vlabel]
        if len(rows) == len(FP8_SHAPES):
            layer[vlabel] = dict(call_us=sum(q["call_us"] for q in rows), kernel_us=sum(q["kernel_us"] for q in rows),
                                 bytes=sum(q["bytes"] for q in rows))
            layer[vlabel].update(rates(layer[vlabel]["bytes"], layer[vlabel]["call_us"], bw) if not SMOKE else {})
            log(f"m32 | per layer ({len(FP8_SHAPES)} projections) | {vlabel} | call {layer[vlabel]['call_us']:.1f} µs "
                f"| kernel {layer[vlabel]['kernel_us']:.1f} µs | "
                f"{layer[vlabel].get('pct_read', float('nan')):.0f}% of read-only")
    OUT["m32_layer"] = layer
# ------------------------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=300.0, help="variants started after this many seconds skip")
    ap.add_argument("--skip-fp8", action="store_true")
    ap.add_argument("--grouped-fp8", action="store_true", help="only the grouped FP4 kernel's FP8 tensor-core form "
                    "against its default, on FP8-rounded rows (GROUPED_FP8_VARIANTS)")
    ap.add_argument("--grouped-fp8-tokens", action="store_true", help="only the grouped FP4 kernel's FP8 form with "
                    "the token tile as the row side against its default, on FP8-rounded rows "
                    "(GROUPED_FP8_TOKENS_VARIANTS)")
    ap.add_argument("--m32", action="store_true", help="only the dense FP8 GEMM at M = 32 (the batch-32 decode "
                    "step's projections): the default before the M = 32 tiling against the new one (M32_VARIANTS), "
                    "and both e4m3 decodes on every byte")
    ap.add_argument("--grouped-bf16x1", action="store_true", help="only the grouped FP4 kernel: the device decode "
                    "check, then the bf16x1 decode against bf16x2 (GROUPED_BF16X1_VARIANTS)")
    ap.add_argument("--lean", action="store_true", help="--set 3 with fewer rows (a short device call): FP4 rows "
                    "0-3 and the last, grouped split 2 / 3 only, FP8 the first persistent row per shape")
    ap.add_argument("--set", type=int, default=1, choices=(1, 2, 3), help="2: the second pass (FP4_VARIANTS_2, "
                    "FP8_PLAN_2); 3: the persistent forms and the grouped kernel's K split (FP4_VARIANTS_3, "
                    "FP8_PLAN_3, GROUPED_VARIANTS)")
    args = ap.parse_args()
    OUT["meta"] = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       device=str(jax.devices()[0]), jax=jax.__version__, argv=sys.argv[1:])
    log(OUT["meta"])
    bw = {}
    if not SMOKE:
        bw = copy_and_read_bandwidth(lambda fn, a: dev_us(fn, a))
        OUT["ceilings"] = bw
        log(f"ceilings: copy {bw['copy_bw'] / 1e12:.2f} TB/s, read-only {bw['read_bw'] / 1e12:.2f} TB/s")

    def save():
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_decode_gemv.json"), "w") as f:
                json.dump(OUT, f, indent=1, default=str)

    if args.m32:
        m32_decode_check()
        save()
        m32_part(bw, args.budget_s)
        save()
        log(f"done in {time.time() - T0:.0f} s; errors: {OUT['errors']}")
        return
    if args.grouped_bf16x1:
        grouped_decode_check()
        save()
        grouped_part(bw, args.budget_s, variants=GROUPED_BF16X1_VARIANTS)
        save()
        log(f"done in {time.time() - T0:.0f} s; errors: {OUT['errors']}")
        return
    if args.grouped_fp8 or args.grouped_fp8_tokens:
        grouped_part(bw, args.budget_s, fp8_inputs=True,
                     fp8_variants=GROUPED_FP8_TOKENS_VARIANTS if args.grouped_fp8_tokens else None)
        save()
        log(f"done in {time.time() - T0:.0f} s; errors: {OUT['errors']}")
        return
    second, third = args.set == 2, args.set == 3
    if third and args.lean and not SMOKE:
        global FP4_VARIANTS_3, FP8_PLAN_3, GROUPED_VARIANTS
        FP4_VARIANTS_3 = FP4_VARIANTS_3[:4] + FP4_VARIANTS_3[-1:]
        GROUPED_VARIANTS = {0: [GROUPED_VARIANTS[0][i] for i in (0, 1, 4)],
                            1: [GROUPED_VARIANTS[1][i] for i in (0, 1, 3)]}
        FP8_PLAN_3 = [(si, [v[0], v[1], v[-1]]) for si, v in FP8_PLAN_3]
    fp4_part(bw, args.budget_s, FP4_VARIANTS_3 if third and not SMOKE else FP4_VARIANTS_2 if second
             else FP4_VARIANTS)
    save()
    if third:
        grouped_part(bw, args.budget_s)
        save()
    if not args.skip_fp8:
        fp8_part(bw, args.budget_s, FP8_PLAN_3 if third and not SMOKE else FP8_PLAN_2 if second and not SMOKE
                 else None)
    save()
    log(f"done in {time.time() - T0:.0f} s; errors: {OUT['errors']}")


if __name__ == "__main__":
    main()
