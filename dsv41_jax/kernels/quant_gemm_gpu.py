"""Pallas GPU kernels (Triton lowering) for GEMMs that read the release's quantised weights directly.

* ``fp8_gemm``: ``x [M, K] · w [N, K]ᵀ`` with ``w`` e4m3 bytes and one e8m0 scale per 32 x 32 block. Grid
  (row block, column block, K split). Each program streams its ``block_n`` weight rows through its K range in
  ``block_k``-wide steps (one contiguous run of bytes per row when the shape divides the blocks), one tile per 32
  weight rows (one scale row). Two forms (``fp8_default_tiling`` picks by M):
  - gemv (M = 1): no tensor cores. The step's bytes are converted e4m3 -> float32 and multiplied elementwise with
    the activation row times its block scales (float32: exact), summed into a [block_n, block_k] float32
    accumulator that is reduced once at the end. The K steps are unrolled and the loads of step i + ``prefetch``
    are issued before step i is computed, so each program keeps several KB of weight loads in flight.
  - tensor-core dot (M > 1): the tile's bytes are converted e4m3 -> float32, multiplied by their block scale (a
    [block_k] vector of multipliers, gathered from the few scale bytes), cast to the dot dtype (exact: <= 4
    significant bits times a power of two) and multiplied with the activations, float32 accumulation, in a loop
    left to the compiler's software pipelining. (The unrolled loads and the scale applied to the activation tile
    are options of this form too; both measured far slower on an H200.) ``mma_rows="weights"`` (the default for
    M <= ``FP8_WEIGHT_ROWS_MAX`` = 32): the grouped FP4 kernel's decode form for FP8 — the [block_n, block_k] weight
    tile decoded straight to bf16 by inline PTX (e4m3 bit pattern of value x 2^-120, two packed multiplies for 2^120
    and the block scale; exact) is the row side of Hopper's wgmma as a register operand, the activation rows its
    columns: 6.6 SASS instructions per weight byte in the K loop at M = 32 against 14.3 for the tokens form
    (``benchmarks/kernel_sass.py fp8_m32``); on an H200 1.07-1.48x the tokens form at the batch-32 step's shapes.
    At M = 32 exactly, 128-wide K steps, a K split sized for one wave (``_fp8_m32_split``) and the "sign" decode (one
    byte permute replicates the sign; 6.2 instructions per byte): the bench model's five dense projections 103.7 ->
    80.0 µs a layer on an H200, 1.04-1.44x each (benchmarks/RESULTS.md, 2026-12-04 08:45 UTC).
  Rows past M and K past the end are masked in the kernel (no padded copy of x); without a K split the kernel
  writes the [M, N] output in x.dtype, with one the float32 partial sums are added by one small XLA reduction.
* ``fp8_gemm_fused``: several ``fp8_gemm`` weights of one input in one launch (the attention's wq_a + wkv, the
  shared expert's w1 + w3): the grid's column blocks run over the projections one after another, each program runs
  ``fp8_gemm``'s program on the projection that owns its column block — a weight stream several times longer than
  one projection's, for the same per-launch fixed cost. ``fp8_gemm`` is its one-weight case.
* ``fp4_grouped_gemm``: rows sorted by expert (``group_sizes``), ``w [E, N, K/2]`` two e2m1 codes per byte
  (element 2j in the low nibble, 2j+1 in the high one, as ``checkpoint.quantized``) and one e8m0 scale per 32 along
  K. Grid (row tile, column block): each row tile belongs to one expert (tile metadata from XLA: expert, first row,
  row count; at most ``ceil(rows / block_m) + min(E, rows)`` tiles), so an expert that received no rows is never
  read; the spare tiles write the zeros of the rows past the groups' total. Per K step a program loads
  ``block_k / 2`` contiguous packed bytes and ``block_k / 32`` scale bytes per weight row and decodes them in
  registers: ``sign << 15 | magnitude << 9`` is the float16 bit pattern of ``value * 2^-14`` (the e2m1 exponent
  lands in float16's, magnitude 1 becomes the float16 subnormal 2^-15), widened to float32 and multiplied by the
  scale x 2^14 broadcast over its 16 bytes (a reshape in registers) — exact; the activation tile is split into even
  / odd columns in registers, so each nibble half is one tensor-core dot per K step. That is the "tokens" form
  (``mma_rows="tokens"``: the token tile is the product's row side), kept for calls of more than 1024 rows. Decode-
  sized calls take the "weights" form by default: each tile is W[cols, K step] · x[rows, K step]ᵀ, so the 64
  dequantised weight rows are the row side of Hopper's wgmma as a register operand and the few tokens of an expert
  its columns, with the nibbles decoded straight to bf16 by inline PTX (``decode="bf16x2"``: bit patterns of value x
  2^-126 in 16-bit register halves, two packed bf16 multiplies for 2^126 and the scale; exact; ``"bf16x1"``, one
  multiply by the scale x 2^126, for weights whose scale bytes are known to be <= 128). Measured on an H200
  at the batch-32 decode step's shapes (192 rows, 16 experts of 2304 x 5120): 1.37-1.40x the tokens form, 29-32 % of
  4.8 TB/s with 32-row token tiles; 16-row tiles (the default while experts hold <= 12 rows on average) 30-36 %
  (benchmarks/RESULTS.md, 2026-12-02).

* ``fp4_every_swiglu`` / ``fp4_every_down``: a decode batch's routed experts as every expert on every token (grid
  expert x column block, the token batch as each product's columns; section below) — measured on an H200 at the
  batch-32 step's shapes 0.88x the grouped path (benchmarks/RESULTS.md, 2026-12-03 18:00 UTC): an option.
* ``fp8_round_rows``: the GEMM-input FP8 rounding in one kernel (XLA: two), 1.9-2.6x on an H200; the default.

Scales: e8m0 byte b -> 2^(b - 127) built from the exponent bits, 0xFF -> NaN, as ``checkpoint.quantized``. In the
FP8 kernel the dequantised weight ``value * 2^(b - 127)`` is exact while it is a normal float32, i.e. for scale
bytes >= 10; in the FP4 kernel for bytes 2..240 (bytes 241..254, weights >= 2^113, give NaN, never a wrong
number) — every scale a quantiser writes for real weights is far inside both.

Addressing: the Triton lowering uses 32-bit signed element offsets for arrays of at most 4 GiB, so an operand of
2-4 GiB is addressed wrong past 2 GiB; ``quant_gemm`` refuses such operands (see ``_check_gpu_addressing``).

Fused (``fp8_gemm_fused``) on an H200 (benchmarks/RESULTS.md, 2026-12-02): at M = 1 wq_a + wkv in 4.9-5.8 µs
(33-39 % of 4.8 TB/s; 1.65x the two separate kernels), w1 + w3 in 10.5-11.4 µs (43-47 %; 1.16x) — an XLA
read-only kernel over the same 9.2 / 23.6 MB takes 4.4 / 8.1 µs (43 / 61 %); M = 8 / 64
1.06-1.44x the separate kernels at 11-22 %. Single kernels: at M = 1 the gemv form reaches 37 % of the 4.8 TB/s
datasheet bandwidth on 2304 x 5120 (1.8x the tensor-core form; an XLA read-only kernel over the same 11.8 MB reaches
48 %), M > 1 and the FP4 grouped kernel stay at 12-31 %: far from the >= 70 % goal. At the 40-layer bench model's
decode shapes (benchmarks/RESULTS.md, 2026-12-03, against a read-only bandwidth of 4.45 TB/s measured in the same
process): FP8 gemv wq_b 64 %, wo_b 62 %, shared w2 47 %, fused wq_a + wkv 40 %, w1 + w3 50 %; the one-token FP4
kernels ("word" decode) 51 %.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

SCALE_BLOCK = 32  # e8m0 scale granularity along K (and along N for the FP8 32 x 32 blocks)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _params(num_warps: int, num_stages: int):
    return pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _dot_nt(a, b):
    """a [M, K] · b [N, K]ᵀ -> [M, N] float32 (IEEE float32 for float32 operands)."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def decode_e2m1_scaled(codes):
    """e2m1 codes (int32, 0..15) -> float16 ``value * 2^-14`` (exact), via the bit pattern."""
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)  # < 2^16: exact in uint16
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)


# ----------------------------------------------------------------------------------------------------------------
# Dense FP8 (32 x 32 block scales)
# ----------------------------------------------------------------------------------------------------------------

def _e8m0_mult(s_byte, extra_exp: int = 0):
    """e8m0 bytes -> float32 multipliers 2^(s - 127 + extra_exp) from the exponent bits; 0xFF -> NaN."""
    s = s_byte.astype(jnp.int32)
    m = jax.lax.bitcast_convert_type((s + extra_exp) << 23, jnp.float32)
    return jnp.where(s == 255, jnp.float32(jnp.nan), m)


def fp8_default_tiling(m: int, n: int, k: int, *, block_m: int | None = None, block_n: int | None = None,
                       block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
                       num_stages: int | None = None, prefetch: int | None = None, gemv: bool | None = None,
                       scale_side: str | None = None, group_view: bool | None = None,
                       mma_rows: str | None = None, programs: int | None = None,
                       e4m3_decode: str | None = None) -> dict:
    """The tiling of ``fp8_gemm`` for an [m, k] x [n, k] GEMM; any argument given overrides its default.

    block_m / block_n / block_k: the output tile and the K step; split_k: K ranges given to separate programs (their
    float32 partial sums added by one small XLA reduction); prefetch: K steps whose loads are issued ahead of the
    step being computed (0: a ``fori_loop`` left to the compiler's software pipelining, ``num_stages`` deep);
    gemv (M = 1 only): no tensor-core dot, a [block_n, block_k] float32 accumulator of elementwise products summed
    once at the end; scale_side: which operand takes the e8m0 block scale ("x": the [block_m, block_k] activation
    tile, once per 32 weight rows; "w": every weight element); group_view (gemv form only): weights and activations
    read as [rows, K/32, 32] views, so a K step's scale bytes are one contiguous [block_k / 32] load broadcast over
    each 32-column group in registers (instead of a [block_k] gather of repeated scale bytes); needs K % 32 == 0;
    mma_rows (tensor-core form only): "tokens" (the activation tile is the product's row side, one dot per 32 weight
    rows) or "weights" (the [block_n, block_k] weight tile, decoded to bf16 by inline PTX, is the row side and the
    activation rows its columns — the grouped FP4 kernel's decode form; block_n 64 by default, a multiple of 32).
    None: "weights" for 1 < M <= ``FP8_WEIGHT_ROWS_MAX`` unless a tokens-form option is given, else "tokens".
    programs (gemv form, one weight, no K split, N and K multiples of the blocks; 0 / None: off): the persistent
    form, that many programs each walking a share of the column blocks with the next block's first K steps loaded
    while the current one's last steps are computed (``_persistent_items``).
    e4m3_decode (weights form with bf16 activations only): the inline-PTX e4m3 -> bf16 decode, "sign" (default: the
    sign replicated by a byte permute) or "mask" (the masking decode before it), both exact for every scale byte; or
    "sign_fold" (one multiply fewer; NaN for scale bytes above 134) — ``_E4M3_BF16X2_PTX``.
    At M = 32 exactly (the batch-32 decode step) with the weights form and neither block_k nor split_k given:
    128-wide K steps and the K split sized for one wave (``_fp8_m32_split``)."""
    gemv = (m == 1) if gemv is None else gemv
    if mma_rows is None and not gemv:
        # the weights form for decode-sized M (measured faster at M = 32, alone and in the batch-32 decode step,
        # FP8_WEIGHT_ROWS_MAX); the options only the tokens form has (a column block that is no multiple of 32, the
        # activation-side scale, unrolled loads, the group view) select that form
        tokens_only = (block_n is not None and block_n % SCALE_BLOCK) or scale_side is not None or bool(prefetch) \
            or bool(group_view)
        mma_rows = "weights" if m <= FP8_WEIGHT_ROWS_MAX and not tokens_only else "tokens"
    mma_rows = "tokens" if gemv else mma_rows
    if mma_rows not in ("tokens", "weights"):
        raise ValueError(f"mma_rows must be 'tokens' or 'weights', got {mma_rows!r}")
    if gemv and m != 1:
        raise ValueError(f"the gemv form takes one activation row, got M = {m}")
    # Measured on an H200 (benchmarks/RESULTS.md, sweep of 2026-12-01): at M = 1 the gemv form with 8-row column
    # blocks, no K split and 8 K steps loaded ahead (2304 x 5120: 6.6 µs vs 11.7 for the tensor-core form); for
    # M > 1 the tensor-core form with the scale on the weights and the compiler's pipelined loop (the unrolled
    # loads and the activation-side scale were 4-70x slower there), 32-row column blocks and K split to about two
    # programs per multiprocessor with >= 4 K steps each.
    if gemv and block_k is None and prefetch is None:
        # single-weight gemv shapes of the bench model's decode step (the fused form names its own K step), measured
        # on an H200 against the 8-row / 256-wide / 8-ahead tiling (benchmarks/RESULTS.md, 2026-12-03): wo_b
        # (K = 8192) 512-wide steps 2 ahead 15.3 µs vs 17.4; the shared expert's w2 (K = 2304) 128-wide steps 5.6
        # vs 6.2; wq_b (K = 1280, N = 32768: five K steps, thousands of programs) 16-row blocks 14.8 vs 16.8 (two
        # passes; 16-row blocks were slower at K >= 2304). Other K keep the older tiling (not measured)
        if k >= 8192:
            block_k, prefetch = 512, 2
        elif 2048 < k <= 4096:
            block_k = 128
        elif block_n is None and n >= 8448:
            block_n = 16
            if programs is None and n % 16 == 0 and k % 256 == 0:
                # the persistent form, 1 step ahead, 528 programs (4 per multiprocessor of an H200's 132 at 112
                # registers): wq_b 13.92 µs vs 14.59 / 14.68 for the default before it in the same run
                # (benchmarks/RESULTS.md, 2026-12-03 15:15 UTC; wo_b and the shared w2 were slower persistent)
                prefetch, programs = 1, 528
    if e4m3_decode is not None and (e4m3_decode not in _E4M3_BF16X2_PTX or mma_rows != "weights"):
        raise ValueError(f"e4m3_decode (the weights form's only) must be one of {tuple(_E4M3_BF16X2_PTX)}, got "
                         f"{e4m3_decode!r} with mma_rows {mma_rows!r}")
    e4m3_decode = (e4m3_decode or "sign") if mma_rows == "weights" else None
    m32 = not gemv and mma_rows == "weights" and m == FP8_WEIGHT_ROWS_MAX and block_k is None and split_k is None
    if m32:  # the batch-32 decode step's tiling (``_fp8_m32_split``)
        block_k = FP8_M32_BLOCK_K
    bm = 1 if gemv else (block_m or min(64, max(16, _pow2(m))))
    bk = max(SCALE_BLOCK, min(block_k or 256, _pow2(k)))
    bn = block_n or (8 if gemv else 64 if mma_rows == "weights" else 32)
    n_kb = -(-k // bk)
    nmn = -(-m // bm) * -(-n // bn)
    if m32:
        split_k = _fp8_m32_split(n_kb, nmn)
    if split_k is None:
        split_k = 1 if gemv else max(1, min(n_kb // 4, -(-264 // nmn)))
        if k % bk == 0 and n_kb % split_k:
            # a split that leaves the K ranges unequal sends every K step down the masked path (gather loads through
            # clamped indices): K = 2304 (9 blocks of 256, split 5 + 4) compiled to 14.3 instructions per weight
            # byte against 6.5 at split 3 (3 + 3 + 3, kernel_sass.py fp8_m32 --nk 5120,2304), and took 24.5 µs
            # against 10.8 at M = 32, N = 5120 on an H200 (9.4 µs in the batch-32 decode step, was 23.3;
            # benchmarks/RESULTS.md, 2026-12-02 22:15 UTC). The divisor of the block count nearest the wanted split
            # instead (the larger on a tie: more programs at decode)
            split_k = min((d for d in range(1, n_kb + 1) if n_kb % d == 0), key=lambda d: (abs(d - split_k), -d))
    split_k = max(1, min(split_k, n_kb))
    split_k = -(-n_kb // -(-n_kb // split_k))  # no split without K blocks
    kb_per = -(-n_kb // split_k)
    pf = (min(8, kb_per) if gemv else 0) if prefetch is None else min(prefetch, kb_per)
    scale_side = scale_side or ("x" if gemv else "w")
    group_view = bool(group_view) and gemv and k % SCALE_BLOCK == 0 and _pow2(bk // SCALE_BLOCK) == bk // SCALE_BLOCK
    if programs and not (gemv and split_k == 1 and n % bn == 0 and k % bk == 0 and not group_view):
        raise ValueError(f"programs (the persistent form) needs the gemv form with no K split, N and K multiples of "
                         f"block_n / block_k and no group view; got M {m}, N {n}, K {k}, block_n {bn}, block_k "
                         f"{bk}, split_k {split_k}")
    return dict(block_m=bm, block_n=bn, block_k=bk, split_k=split_k, num_warps=num_warps or 4,
                num_stages=num_stages or 3, prefetch=pf, gemv=gemv, scale_side=scale_side, group_view=group_view,
                mma_rows=mma_rows, programs=int(programs or 0), e4m3_decode=e4m3_decode)


# Measured on an H200 (benchmarks/RESULTS.md, 2026-12-02 18:39 UTC) at M = 32, the batch-32 decode step's dense
# projections: the weights form took 12.1 / 24.4 / 24.0 / 30.9 µs against the tokens form's 16.0 / 26.1 / 35.4 / 40.6
# (shared expert w1, w2, wq_b, wo_b; 1.07-1.48x), and the step's FP8 kernels 1.55 ms against 1.95 (with the grouped
# FP4 kernel's 16-row tiles: the step 7.77 vs 8.38 ms). Not measured above M = 32: larger calls keep the tokens form.
FP8_WEIGHT_ROWS_MAX = 32

# --- the batch-32 decode step's FP8 tiling (M = 32, weights form; issue 14) ---------------------------------------
# 128-wide K steps and a K split sized for one wave of programs, the partial sums added in float32 by XLA afterwards.
FP8_M32_BLOCK_K = 128
FP8_M32_WAVE = 528  # programs in one wave: 4 per multiprocessor (the weights form's occupancy) x an H200's 132


def _fp8_m32_split(n_kb: int, tiles: int) -> int:
    """The K split of the M = 32 tiling: the divisor of the K block count ``n_kb`` nearest min(n_kb / 3,
    round(FP8_M32_WAVE / tiles)) (the larger on a tie) — about one wave of programs over the ``tiles`` output tiles,
    with >= 3 K steps per program, and equal K ranges (an unequal split sends every K step down the masked path,
    see ``fp8_default_tiling``). At the bench model's shapes: wq_b 1, wo_b 8, shared w2 6, wq_a + wkv 10, w1 + w3 8."""
    want = min(n_kb / 3, round(FP8_M32_WAVE / tiles))
    return min((d for d in range(1, n_kb + 1) if n_kb % d == 0), key=lambda d: (abs(d - want), -d))
# ------------------------------------------------------------------------------------------------------------------

_TILING_ARGS = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages", "prefetch", "gemv",
                "scale_side", "group_view", "mma_rows", "programs", "e4m3_decode")


@functools.partial(jax.jit, static_argnames=_TILING_ARGS + ("mma", "name", "interpret"))
def fp8_gemm(x, values, scales, *, block_m: int | None = None, block_n: int | None = None,
             block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
             num_stages: int | None = None, prefetch: int | None = None, gemv: bool | None = None,
             scale_side: str | None = None, group_view: bool | None = None, mma_rows: str | None = None,
             programs: int | None = None, e4m3_decode: str | None = None, mma: str | None = None,
             name: str = "fp8_block_gemm", interpret: bool = False):
    """x [M, K] (bf16 / f32), values uint8 e4m3 bytes [N, K], scales uint8 [ceil(N/32), ceil(K/32)] -> [M, N]
    x.dtype. Tiling: ``fp8_default_tiling``. ``mma="fp8"``: FP8 tensor-core forms (activations rounded to FP8 per
    32 — exact for the release's rounded inputs —, one FP8 product per 32-wide K chunk on the stored bytes, promoted
    to float32 with both scales): ``mma_rows`` None / "weights" one wgmma per chunk (``_fp8_gemm_fp8_mma``),
    "tokens" the synchronous MMA path (``_fp8_gemm_fp8_mma_tokens``); both measured slower than the default on an
    H200. None / "bf16": the forms above."""
    if mma not in (None, "bf16", "fp8"):
        raise ValueError(f"mma must be 'bf16' or 'fp8', got {mma!r}")
    if mma == "fp8":
        if mma_rows not in (None, "weights", "tokens") or (split_k or 1) != 1 or gemv or prefetch or programs or \
                scale_side is not None or group_view is not None or e4m3_decode is not None:
            raise ValueError("mma='fp8' takes mma_rows ('weights' / 'tokens'), block_m / block_n / block_k / "
                             "num_warps / num_stages options only")
        if values.ndim != 2 or values.shape[1] != x.shape[1] or values.dtype != jnp.uint8 or \
                scales.dtype != jnp.uint8 or scales.shape != (-(-values.shape[0] // SCALE_BLOCK),
                                                              -(-x.shape[1] // SCALE_BLOCK)):
            raise ValueError(f"fp8_gemm: values must be uint8 [N, K] and scales uint8 [ceil(N/32), ceil(K/32)], got "
                             f"{values.dtype} {tuple(values.shape)} / {scales.dtype} {tuple(scales.shape)}")
        form = _fp8_gemm_fp8_mma_tokens if mma_rows == "tokens" else _fp8_gemm_fp8_mma
        return form(x, values, scales, block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                    num_stages=num_stages, name=name, interpret=interpret)
    return fp8_gemm_fused(x, ((values, scales),), block_m=block_m, block_n=block_n, block_k=block_k,
                          split_k=split_k, num_warps=num_warps, num_stages=num_stages, prefetch=prefetch, gemv=gemv,
                          scale_side=scale_side, group_view=group_view, mma_rows=mma_rows, programs=programs,
                          e4m3_decode=e4m3_decode, name=name, interpret=interpret)[0]


@functools.partial(jax.jit, static_argnames=_TILING_ARGS + ("name", "interpret"))
def fp8_gemm_fused(x, weights, *, block_m: int | None = None, block_n: int | None = None,
                   block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None, prefetch: int | None = None, gemv: bool | None = None,
                   scale_side: str | None = None, group_view: bool | None = None, mma_rows: str | None = None,
                   programs: int | None = None, e4m3_decode: str | None = None, name: str = "fp8_block_gemm_fused",
                   interpret: bool = False):
    """Several FP8 GEMMs of ONE input in one launch: x [M, K] and weights ((values [N_p, K], scales
    [ceil(N_p/32), ceil(K/32)]), ...) -> (x · w_pᵀ [M, N_p] in x.dtype, ...).

    Why: at decode a single projection's weights (6-12 MB) are streamed in a few µs, of which the launch's fixed
    cost (ramp-up, tail) is about half (benchmarks/RESULTS.md); the projections of a layer that read the same input
    (the attention's wq_a and wkv, the shared expert's w1 and w3) are one weight stream here. The grid's column
    blocks are the projections' column blocks one after another; a program finds its projection from its column
    block index (a static chain of ``pl.when``) and runs the same program as ``fp8_gemm`` on that weight, so each
    output is exact as ``fp8_gemm``'s. Tiling (``fp8_default_tiling``) is chosen for the total N and shared by all
    projections; a projection whose N the column block does not divide is masked at its end."""
    if not weights:
        raise ValueError("fp8_gemm_fused: no weights given")
    m, k = x.shape
    ns_ = []
    for p, (v, s) in enumerate(weights):
        if v.ndim != 2 or v.shape[1] != k:
            raise ValueError(f"fp8_gemm_fused: weight {p} has values {tuple(v.shape)}; every weight must be [N, K] "
                             f"with the input's K = {k}")
        want_s = (-(-v.shape[0] // SCALE_BLOCK), -(-k // SCALE_BLOCK))
        if v.dtype != jnp.uint8 or s.dtype != jnp.uint8 or tuple(s.shape) != want_s:
            raise ValueError(f"fp8_gemm_fused: weight {p} must be uint8 values [N, K] and uint8 scales {want_s}, "
                             f"got {v.dtype} {tuple(v.shape)} / {s.dtype} {tuple(s.shape)}")
        ns_.append(int(v.shape[0]))
    if m == 0 or k == 0 or 0 in ns_:  # empty GEMMs (no rows, an empty contraction or an empty projection): zeros
        if m and k and any(ns_):
            live = [p for p, n in enumerate(ns_) if n]
            ys = fp8_gemm_fused(x, tuple(weights[p] for p in live), block_m=block_m, block_n=block_n,
                                block_k=block_k, split_k=split_k, num_warps=num_warps, num_stages=num_stages,
                                prefetch=prefetch, gemv=gemv, scale_side=scale_side, group_view=group_view,
                                mma_rows=mma_rows, programs=programs, e4m3_decode=e4m3_decode, name=name,
                                interpret=interpret)
            got = dict(zip(live, ys))
            return tuple(got.get(p, jnp.zeros((m, 0), x.dtype)) for p in range(len(ns_)))
        return tuple(jnp.zeros((m, n), x.dtype) for n in ns_)
    if len(weights) > 1 and (m == 1 if gemv is None else gemv):
        # measured on an H200 (benchmarks/RESULTS.md, 2026-12-02): the fused gemv form with 8 warps took 5.27 / 10.86
        # µs for wq_a + wkv / w1 + w3 against 5.83 / 11.44 with fp8_gemm's 4 (one run); in the 16-tiling sweep of a
        # later run 512-byte K steps with 4 loaded ahead (the same 16 KB in flight per program, half the steps) took
        # 4.88 / 10.50 µs against 5.32 / 11.04 for 256-byte steps with 8 ahead, the best of both groups
        num_warps = 8 if num_warps is None else num_warps
        if block_k is None and prefetch is None:
            block_k, prefetch = 512, 4
    t = fp8_default_tiling(m, sum(ns_), k, block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
                           num_warps=num_warps, num_stages=num_stages, prefetch=prefetch, gemv=gemv,
                           scale_side=scale_side, group_view=group_view, mma_rows=mma_rows, programs=programs,
                           e4m3_decode=e4m3_decode)
    bm, bn, bk, split_k, pf, gemv = (t[a] for a in ("block_m", "block_n", "block_k", "split_k", "prefetch", "gemv"))
    if t["programs"] and len(weights) > 1:
        raise ValueError("programs (the persistent gemv form) takes one weight, not a fused list")
    persistent = t["programs"] > 0
    n_programs = min(t["programs"], -(-ns_[0] // bn)) if persistent else 0
    x_side = t["scale_side"] == "x"
    gview = t["group_view"]
    wrows = t["mma_rows"] == "weights"
    if wrows and bn % SCALE_BLOCK:
        raise ValueError(f"the weights-as-rows form needs block_n a multiple of {SCALE_BLOCK}, got {bn}")
    if bk % SCALE_BLOCK or not (bn % SCALE_BLOCK == 0 or SCALE_BLOCK % bn == 0) or bn < (2 if gemv else 16):
        raise ValueError(f"block_k {bk} must be a multiple of {SCALE_BLOCK}; block_n {bn} a multiple or a divisor "
                         f"of it (>= 16; >= 2 for the gemv form)")
    if t["scale_side"] not in ("x", "w"):
        raise ValueError(f"scale_side must be 'x' or 'w', got {t['scale_side']!r}")
    n_kb = -(-k // bk)
    kb_per = -(-n_kb // split_k)
    nm = -(-m // bm)
    nns = [-(-n // bn) for n in ns_]
    starts = [sum(nns[:p]) for p in range(len(nns))]  # first column block of each projection in the grid
    sub = min(bn, SCALE_BLOCK)  # weight rows that share one scale row: the unit of loads and dots
    dot_dtype = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16
    xd = x.astype(dot_dtype)  # no copy for bf16 / float32 activations; rows and K are masked in the kernel
    k_mask = k % bk != 0 or kb_per * split_k != n_kb  # K past the end, or K steps past the last block
    m_tail = m % bm != 0
    ns = -(-k // SCALE_BLOCK)  # scale columns
    kg, gpb = k // SCALE_BLOCK, bk // SCALE_BLOCK  # group view: 32-column groups in K and per K step
    out_dtype = x.dtype if split_k == 1 else jnp.float32
    f32 = jnp.float32
    n_w = len(weights)

    def program_weight_rows(x_ref, v_ref, s_ref, o_ref, n, mi, ni, si):
        """The tensor-core program with the weights as the product's rows: acc [block_n, block_m] += W[cols, K step]
        (e4m3 bytes decoded to bf16 by ``_e4m3_bf16x2_scaled``, each 32 x 32 block times its scale) ·
        x[rows, K step]ᵀ; the tile stored through transposed indices."""
        ks = -(-n // SCALE_BLOCK)
        n_tail = n % bn != 0
        n0 = ni * bn
        rows_m = mi * bm + jnp.arange(bm)
        mmask = rows_m < m
        rows_n = n0 + jnp.arange(bn)
        nb, sg = bn // SCALE_BLOCK, bk // SCALE_BLOCK

        def load(kb):
            k0 = kb * bk
            cols = k0 + jnp.arange(bk)
            kin = cols < k
            if k_mask or n_tail:
                w = pltr.load(v_ref.at[jnp.minimum(rows_n, n - 1)[:, None], jnp.minimum(cols, k - 1)[None, :]],
                              mask=(rows_n < n)[:, None] & kin[None, :], other=0)
            else:
                w = v_ref[pl.ds(n0, bn), pl.ds(k0, bk)]
            srow = jnp.minimum(n0 // SCALE_BLOCK + jnp.arange(nb), ks - 1)
            scol = k0 // SCALE_BLOCK + jnp.arange(sg)
            sc = pltr.load(s_ref.at[srow[:, None], jnp.minimum(scol, ns - 1)[None, :]],
                           mask=jnp.broadcast_to((scol < ns)[None, :], (nb, sg)), other=127)
            if k_mask or m_tail:
                xc = pltr.load(x_ref.at[jnp.minimum(rows_m, m - 1)[:, None], jnp.minimum(cols, k - 1)[None, :]],
                               mask=mmask[:, None] & kin[None, :], other=0)
            else:
                xc = x_ref[pl.ds(mi * bm, bm), pl.ds(k0, bk)]
            return w, sc, xc

        def compute(i, acc):
            w, sc, xc = load(si * kb_per + i)
            if dot_dtype == jnp.bfloat16:
                mult_of = _e4m3_fold_multiplier if t["e4m3_decode"] == "sign_fold" else _fp4_bf16_multiplier
                mult = jnp.broadcast_to(mult_of(sc)[:, None, :, None],
                                        (nb, SCALE_BLOCK, sg, SCALE_BLOCK)).reshape(bn, bk)
                wq = _e4m3_bf16x2_scaled(w, mult, interpret, t["e4m3_decode"])
            else:  # float32 activations: the float32 dequantisation (exact), a float32 dot
                mult = jnp.broadcast_to(_e8m0_mult(sc)[:, None, :, None],
                                        (nb, SCALE_BLOCK, sg, SCALE_BLOCK)).reshape(bn, bk)
                wq = jax.lax.bitcast_convert_type(w, jnp.float8_e4m3fn).astype(f32) * mult
            return acc + _dot_nt(wq, xc)

        acc = jax.lax.fori_loop(0, kb_per, compute, jnp.zeros((bn, bm), f32))
        lead = (si,) if split_k > 1 else ()
        pltr.store(o_ref.at[lead + (rows_m[None, :], rows_n[:, None])], acc.astype(o_ref.dtype),
                   mask=mmask[None, :] & (rows_n < n)[:, None])

    def program(x_ref, v_ref, s_ref, o_ref, n, mi, ni, si):
        """``fp8_gemm``'s program: output tile (row block mi, column block ni) of one weight [n, k], K split si."""
        if wrows and not gemv:
            return program_weight_rows(x_ref, v_ref, s_ref, o_ref, n, mi, ni, si)
        ks = -(-n // SCALE_BLOCK)  # scale rows
        n_tail = n % bn != 0
        n0 = ni * bn
        rows_m = mi * bm + jnp.arange(bm)
        mmask = rows_m < m

        def load_grouped(kb):  # group view: [sub, gpb, 32] weight tiles, [gpb, 32] activations, [gpb] scale bytes
            g0 = kb * gpb
            grp = g0 + jnp.arange(gpb)
            gin = grp < kg
            lane = jnp.arange(SCALE_BLOCK)
            ws, ss = [], []
            for g in range(bn // sub):
                srow = jnp.minimum((n0 + g * sub) // SCALE_BLOCK, ks - 1)
                if k_mask or n_tail:
                    rows = n0 + g * sub + jnp.arange(sub)
                    idx = (jnp.minimum(rows, n - 1)[:, None, None], jnp.minimum(grp, kg - 1)[None, :, None],
                           lane[None, None, :])
                    ws.append(pltr.load(v_ref.at[idx], mask=(rows < n)[:, None, None] & gin[None, :, None],
                                        other=0))
                else:  # one contiguous bk-byte run per weight row
                    ws.append(v_ref[pl.ds(n0 + g * sub, sub), pl.ds(g0, gpb), :])
                if k_mask:
                    ss.append(pltr.load(s_ref.at[srow, jnp.minimum(grp, kg - 1)], mask=gin, other=127))
                else:
                    ss.append(s_ref[srow, pl.ds(g0, gpb)])
            if k_mask:
                xc = pltr.load(x_ref.at[0, jnp.minimum(grp, kg - 1)[:, None], lane[None, :]],
                               mask=gin[:, None], other=0)
            else:
                xc = x_ref[0, pl.ds(g0, gpb), :]
            return ws, xc, ss

        def load(kb):  # the K step's weight tiles (one per scale row), activation tile and scale bytes
            if gview:
                return load_grouped(kb)
            k0 = kb * bk
            cols = k0 + jnp.arange(bk)
            kin = cols < k
            ws = []
            for g in range(bn // sub):
                if k_mask or n_tail:
                    rows = n0 + g * sub + jnp.arange(sub)
                    idx = (jnp.minimum(rows, n - 1)[:, None], jnp.minimum(cols, k - 1)[None, :])
                    ws.append(pltr.load(v_ref.at[idx], mask=(rows < n)[:, None] & kin[None, :], other=0))
                else:  # one contiguous bk-byte run per weight row: wide coalesced loads
                    ws.append(v_ref[pl.ds(n0 + g * sub, sub), pl.ds(k0, bk)])
            if gemv:
                xc = (pltr.load(x_ref.at[0, jnp.minimum(cols, k - 1)], mask=kin, other=0) if k_mask
                      else x_ref[0, pl.ds(k0, bk)])
            elif k_mask or m_tail:
                xc = pltr.load(x_ref.at[jnp.minimum(rows_m, m - 1)[:, None], jnp.minimum(cols, k - 1)[None, :]],
                               mask=mmask[:, None] & kin[None, :], other=0)
            else:
                xc = x_ref[pl.ds(mi * bm, bm), pl.ds(k0, bk)]
            scol = jnp.minimum(cols // SCALE_BLOCK, ns - 1)  # [bk]: each scale byte read by its 32 columns
            ss = [pltr.load(s_ref.at[jnp.minimum((n0 + g * sub) // SCALE_BLOCK, ks - 1), scol])
                  for g in range(bn // sub)]
            return ws, xc, ss

        def compute(accs, loaded):
            ws, xc, ss = loaded
            new = []
            for acc, w, s in zip(accs, ws, ss):
                mult = _e8m0_mult(s)  # [bk] float32 powers of two ([bk / 32] in the group view)
                w8 = jax.lax.bitcast_convert_type(w, jnp.float8_e4m3fn)  # loaded as bytes (masked fp8 loads fail)
                if gview:  # [sub, gpb, 32] x [gpb, 32] (the scale broadcast over its group): same exact products
                    new.append(acc + w8.astype(f32) * (xc.astype(f32) * mult[:, None])[None])
                elif gemv:  # float32 products: exact (4 x 8 significant bits, times a power of two)
                    new.append(acc + w8.astype(f32) * (xc.astype(f32) * mult)[None, :])
                elif x_side:  # x * 2^e: exact in the dot dtype while it stays a normal number
                    xs = (xc.astype(f32) * mult[None, :]).astype(dot_dtype)
                    new.append(acc + _dot_nt(xs, w8.astype(dot_dtype)))  # e4m3 -> bf16 / f32: exact
                else:
                    new.append(acc + _dot_nt(xc, (w8.astype(f32) * mult[None, :]).astype(dot_dtype)))
            return new

        acc_shape = (sub, gpb, SCALE_BLOCK) if gview else (sub, bk) if gemv else (bm, sub)
        if persistent:  # gemv, contiguous tiles: items are column blocks (``_persistent_items``)
            def load_at(c0, kb):
                k0 = kb * bk
                cols = k0 + jnp.arange(bk)
                ws = [v_ref[pl.ds(c0 + g * sub, sub), pl.ds(k0, bk)] for g in range(bn // sub)]
                ss = [pltr.load(s_ref.at[(c0 + g * sub) // SCALE_BLOCK, cols // SCALE_BLOCK])
                      for g in range(bn // sub)]
                return ws, x_ref[0, pl.ds(k0, bk)], ss

            def finish(accs, c0):
                for g, acc in enumerate(accs):
                    o_ref[0, pl.ds(c0 + g * sub, sub)] = jnp.sum(acc, axis=1).astype(o_ref.dtype)

            _persistent_items(n // bn, n_programs, kb_per, pf, lambda item: item * bn, load_at,
                              lambda accs, ld, i: tuple(compute(list(accs), ld)),
                              lambda: tuple(jnp.zeros(acc_shape, f32) for _ in range(bn // sub)), finish)
            return
        accs = [jnp.zeros(acc_shape, f32) for _ in range(bn // sub)]
        base = si * kb_per
        if pf == 0:  # one loop, software-pipelined by the compiler (num_stages)
            accs = list(jax.lax.fori_loop(0, kb_per, lambda i, a: tuple(compute(list(a), load(base + i))),
                                          tuple(accs)))
        else:  # unrolled: the loads of step i + pf are issued before step i is computed
            pending = [load(base + i) for i in range(pf)]
            for i in range(kb_per):
                if i + pf < kb_per:
                    pending.append(load(base + i + pf))
                accs = compute(accs, pending[i])
                pending[i] = None
        lead = (si,) if split_k > 1 else ()  # one indexer per access (the Triton lowering takes no chains)
        for g, acc in enumerate(accs):
            c0 = n0 + g * sub
            cols_n = c0 + jnp.arange(sub)
            if gemv:
                if gview:
                    acc = jnp.sum(acc, axis=2)
                res = jnp.sum(acc, axis=1).astype(o_ref.dtype)  # [sub]
                if n_tail:
                    pltr.store(o_ref.at[lead + (0, cols_n)], res, mask=cols_n < n)
                else:
                    o_ref[lead + (0, pl.ds(c0, sub))] = res
            elif m_tail or n_tail:  # unclamped (distinct) indices: masked lanes must not alias a written element
                pltr.store(o_ref.at[lead + (rows_m[:, None], cols_n[None, :])], acc.astype(o_ref.dtype),
                           mask=mmask[:, None] & (cols_n < n)[None, :])
            else:
                o_ref[lead + (pl.ds(mi * bm, bm), pl.ds(c0, sub))] = acc.astype(o_ref.dtype)

    def kernel(x_ref, *refs):
        w_refs, o_refs = refs[:2 * n_w], refs[2 * n_w:]
        if persistent:  # one row, one weight; the items are walked inside the program
            program(x_ref, w_refs[0], w_refs[1], o_refs[0], ns_[0], 0, 0, 0)
            return
        mi, ni, si = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        if n_w == 1:
            program(x_ref, w_refs[0], w_refs[1], o_refs[0], ns_[0], mi, ni, si)
            return
        for p in range(n_w):  # exactly one branch runs: the projection that owns column block ni
            @pl.when((ni >= starts[p]) & (ni < starts[p] + nns[p]))
            def _(p=p):
                program(x_ref, w_refs[2 * p], w_refs[2 * p + 1], o_refs[p], ns_[p], mi, ni - starts[p], si)

    out_shapes = tuple(jax.ShapeDtypeStruct((m, n) if split_k == 1 else (split_k, m, n), out_dtype) for n in ns_)
    flat_w = [a for vs in weights for a in vs]
    if gview:  # [rows, K/32, 32] views of the row-major bytes: no copy
        xd = xd.reshape(m, kg, SCALE_BLOCK)
        flat_w = [a.reshape(a.shape[0], kg, SCALE_BLOCK) if i % 2 == 0 else a for i, a in enumerate(flat_w)]
    outs = pl.pallas_call(
        kernel, grid=(n_programs,) if persistent else (nm, sum(nns), split_k), out_shape=out_shapes,
        compiler_params=_params(t["num_warps"], t["num_stages"]), interpret=interpret, name=name,
    )(xd, *flat_w)
    if split_k == 1:
        return tuple(outs)
    return tuple(jnp.sum(o, axis=0).astype(x.dtype) for o in outs)  # small fused reductions over the K splits


# ----------------------------------------------------------------------------------------------------------------
# Grouped FP4 (routed experts)
# ----------------------------------------------------------------------------------------------------------------

def tile_metadata(group_sizes, n_rows: int, block_m: int):
    """Row tiles of ``block_m`` rows that each lie inside one group (rows sorted by group), then tiles that zero the
    rows past the groups' total.

    -> (tile_group, tile_row0, tile_rows) int32 [T] with T = ceil(n_rows / block_m) + min(n_groups, n_rows) (a
    static bound: at most n_rows groups are non-empty). A GEMM tile has ``tile_rows > 0``; a zeroing tile
    ``tile_rows < 0`` (-rows to zero from ``tile_row0``); the rest ``0`` (nothing to do). Empty groups get no tile.
    T suffices: with S rows in ne non-empty groups, the GEMM tiles number <= S / bm + ne (bm - 1) / bm and the
    zeroing tiles <= (A - S) / bm + (bm - 1) / bm, an integer sum < A / bm + ne + 1, so <= ceil(A / bm) + ne."""
    g = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    tiles = (gs + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    row_start = jnp.cumsum(gs) - gs
    total = jnp.sum(gs)
    t_max = -(-n_rows // block_m) + min(g, n_rows)
    t = jnp.arange(t_max, dtype=jnp.int32)
    # a comparison count, not jnp.searchsorted's default scan: no loop in the XLA program around the kernel
    grp = jnp.clip(jnp.searchsorted(tile_end, t, side="right", method="compare_all"), 0, g - 1).astype(jnp.int32)
    r0 = row_start[grp] + (t - tile_start[grp]) * block_m
    nr = jnp.clip(row_start[grp] + gs[grp] - r0, 0, block_m)
    gemm = t < tile_end[-1]
    z0 = total + (t - tile_end[-1]) * block_m  # zeroing tiles follow the GEMM tiles
    nz = jnp.clip(n_rows - z0, 0, block_m)
    r0 = jnp.where(gemm, jnp.where(nr > 0, r0, 0), jnp.where(nz > 0, z0, 0))
    nr = jnp.where(gemm, nr, -nz)
    return grp, r0.astype(jnp.int32), nr.astype(jnp.int32)


def _group_tile(g_ref, r0_ref, nr_ref, block_m: int, block_n: int, n: int):
    """Inside a grouped kernel over the grid (row tile, column block, ...) of :func:`tile_metadata`: (tile index,
    column block, the tile's expert, its row count (< 0: a zeroing tile), its rows [block_m], its columns
    [block_n], the columns' mask against ``n``)."""
    ti, ni = pl.program_id(0), pl.program_id(1)
    rows = r0_ref[ti] + jnp.arange(block_m)
    cols_n = ni * block_n + jnp.arange(block_n)
    return ti, ni, g_ref[ti], nr_ref[ti], rows, cols_n, cols_n < n


def _zero_rows_past_groups(o_ref, nr, rows, cols_n, nmask, lead=()):
    """A zeroing tile (``nr < 0``) writes 0 to its -nr rows: the output past the groups' total is defined in the
    kernel, with no pass over it in XLA. ``lead``: leading output indices (a K split's slice)."""
    @pl.when(nr < 0)
    def _():
        bm, bn = rows.shape[0], cols_n.shape[0]
        zmask = (jnp.arange(bm) < -nr)[:, None] & nmask[None, :]
        pltr.store(o_ref.at[lead + (rows[:, None], cols_n[None, :])], jnp.zeros((bm, bn), o_ref.dtype), mask=zmask)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages",
                                             "prefetch", "mma_rows", "decode", "split_k", "mma", "name",
                                             "interpret"))
def fp4_grouped_gemm(x, group_sizes, values, scales, *, block_m: int | None = None, block_n: int | None = None,
                     block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                     prefetch: int = 0, mma_rows: str | None = None, decode: str | None = None,
                     split_k: int | None = None, mma: str | None = None, name: str = "fp4_grouped_gemm",
                     interpret: bool = False):
    """x [A, K] rows sorted by group; group_sizes [E] (sum <= A; rows past the sum give 0); values uint8
    [E, N, K/2]; scales uint8 [E, N, K/32] -> [A, N] in x.dtype.

    ``mma_rows``: which operand is the tensor-core product's row (M) side — "tokens" (the activation tile
    [block_m, K step] times the dequantised weight tile transposed) or "weights" (the dequantised weight tile
    [block_n, K step] times the activation tile transposed, the [block_n, block_m] result stored transposed).
    None: "weights" for calls of at most ``FP4_GROUPED_WEIGHT_ROWS_MAX`` rows (decode), else "tokens".
    ``decode`` (the "weights" form with bf16 activations only): how the packed bytes become the dot's bf16 operand —
    "f32" (the float16 pair decode widened to float32, scaled, rounded to bf16), "bf16x2" (inline PTX: each
    nibble's bf16 bit pattern built in a 16-bit half of a register, then two packed bf16 multiplies per two weights;
    ``_e2m1_bf16x2_scaled``) or "bf16x1" (the same patterns, one packed multiply by 2^(s - 1); exact for scale bytes
    <= 128 only, inf / NaN weights beyond: ``_e2m1_bf16x1_scaled``, chosen by ``quant_gemm.fp4_grouped`` through
    ``fp4_grouped_decode`` for weights whose recorded ``scale_max`` allows it). None:
    ``FP4_GROUPED_DEFAULT_DECODE``. ``split_k`` (the "weights" form only; must divide the K steps): K ranges given
    to separate programs, their float32 partial products [split_k, A, N] added by one small XLA reduction, then
    rounded to x.dtype — more programs when a call's (row tile, column block) programs fill the multiprocessors only
    about once.
    ``mma``: the tensor-core product's operand type — "bf16" (the default: weights decoded to the dot dtype) or
    "fp8" (the activations rounded to FP8 per 32 along K — the release's GEMM-input rounding, so exact for its
    already rounded inputs —, the nibbles decoded to e4m3 bytes, one FP8 product per 32-wide K chunk promoted to
    float32 with both scales, ``_fp4_grouped_fp8_mma``: with ``mma_rows`` None / "weights" one FP8 wgmma per chunk,
    with "tokens" the synchronous MMA path; both measured slower than the default
    on an H200)."""
    if mma not in (None, "bf16", "fp8"):
        raise ValueError(f"mma must be 'bf16' or 'fp8', got {mma!r}")
    if mma == "fp8":
        if mma_rows not in (None, "weights", "tokens") or decode is not None or (split_k or 1) != 1 or prefetch:
            raise ValueError("mma='fp8' takes mma_rows ('weights' / 'tokens') and no decode / split_k / prefetch "
                             f"options, got mma_rows={mma_rows!r}, decode={decode!r}, split_k={split_k}, "
                             f"prefetch={prefetch}")
        return _fp4_grouped_fp8_mma(x, group_sizes, values, scales, block_m=block_m, block_n=block_n,
                                    block_k=block_k, num_warps=num_warps, num_stages=num_stages, name=name,
                                    interpret=interpret, token_rows=mma_rows == "tokens")
    mma_rows = mma_rows or ("weights" if x.shape[0] <= FP4_GROUPED_WEIGHT_ROWS_MAX else "tokens")
    if mma_rows not in ("tokens", "weights"):
        raise ValueError(f"mma_rows must be 'tokens' or 'weights', got {mma_rows!r}")
    if mma_rows == "weights":
        return _fp4_grouped_weight_rows(x, group_sizes, values, scales, block_m=block_m, block_n=block_n,
                                        block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                                        decode=decode or FP4_GROUPED_DEFAULT_DECODE, split_k=split_k or 1,
                                        name=name, interpret=interpret)
    if (split_k or 1) != 1:
        raise ValueError(f"split_k is an option of the weights-as-rows form (mma_rows='weights'), got {split_k}")
    block_n, block_k = block_n or 64, block_k or 256
    num_warps, num_stages = num_warps or 4, num_stages or 3
    a, k = x.shape
    e, n, kh = values.shape
    bm = block_m or (16 if a <= 1024 else 64)  # decode: an expert holds <= M rows, mostly a handful
    bk = max(SCALE_BLOCK, min(block_k, _pow2(k)))  # values per K step (bk / 2 packed bytes, bk / 32 scales)
    if bk % SCALE_BLOCK or k % SCALE_BLOCK:
        raise ValueError(f"block_k {bk} and K {k} must be multiples of {SCALE_BLOCK}")
    bn = block_n
    bkh, sg = bk // 2, bk // SCALE_BLOCK
    hb = SCALE_BLOCK // 2  # packed bytes per scale
    dot_dtype = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16
    xd = x.astype(dot_dtype)
    grp, r0s, nrs = tile_metadata(group_sizes, a, bm)
    t_max = grp.shape[0]
    n_steps = -(-k // bk)
    pf = min(prefetch, n_steps)  # K steps loaded ahead (0: a fori_loop, pipelined by the compiler)
    k_tail, n_tail = k % bk != 0, n % bn != 0

    def kernel(g_ref, r0_ref, nr_ref, x_ref, v_ref, s_ref, o_ref):
        _, ni, ex, nr, rows, cols_n, nmask = _group_tile(g_ref, r0_ref, nr_ref, bm, bn, n)

        @pl.when(nr > 0)
        def _():
            rmask = jnp.arange(bm) < nr
            rows_c = jnp.minimum(rows, a - 1)
            cols_nc = jnp.minimum(cols_n, n - 1)

            def load(t):  # the K step's packed codes, scale bytes and activation tile
                cb = t * bkh + jnp.arange(bkh)  # packed bytes
                cs = t * sg + jnp.arange(sg)  # scale columns
                cx = t * bk + jnp.arange(bk)  # activation columns
                if k_tail or n_tail:
                    v = pltr.load(v_ref.at[ex, cols_nc[:, None], jnp.minimum(cb, kh - 1)[None, :]],
                                  mask=nmask[:, None] & (cb < kh)[None, :], other=0)
                    s = pltr.load(s_ref.at[ex, cols_nc[:, None], jnp.minimum(cs, k // SCALE_BLOCK - 1)[None, :]],
                                  mask=nmask[:, None] & (cs < k // SCALE_BLOCK)[None, :], other=127)
                else:  # contiguous bk / 2-byte runs per weight row
                    v = v_ref[ex, pl.ds(ni * bn, bn), pl.ds(t * bkh, bkh)]
                    s = s_ref[ex, pl.ds(ni * bn, bn), pl.ds(t * sg, sg)]
                cxc = jnp.minimum(cx, k - 1) if k_tail else cx  # unclamped: the compiler sees contiguous runs
                xc = pltr.load(x_ref.at[rows_c[:, None], cxc[None, :]],
                               mask=rmask[:, None] & (cx < k)[None, :], other=0)
                return v, s, xc

            def compute(acc, loaded):
                v, s, xc = loaded
                # element 2j of the chunk meets the low nibble of byte j, 2j+1 the high one
                xe, xo = jax.lax.unstack(xc.reshape(bm, bkh, 2), axis=2)
                # scale x 2^14 (the decoded nibbles are value x 2^-14): one float32 power of two for bytes <= 240;
                # larger bytes (weights >= 2^113: none a quantiser writes) and 0xFF give NaN, never a wrong number
                si = s.astype(jnp.int32)
                mult = jax.lax.bitcast_convert_type((si + 14) << 23, jnp.float32)
                mult = jnp.where(si > 240, jnp.float32(jnp.nan), mult)[:, :, None]
                vi = v.astype(jnp.int32)

                def dequant(codes):  # [bn, bk/2] codes -> scaled weights in the dot dtype (exact)
                    d = decode_e2m1_scaled(codes).astype(jnp.float32).reshape(bn, sg, hb)
                    return (d * mult).reshape(bn, bkh).astype(dot_dtype)

                return acc + _dot_nt(xe, dequant(vi & 15)) + _dot_nt(xo, dequant(vi >> 4))

            acc = jnp.zeros((bm, bn), jnp.float32)
            if pf == 0:  # one loop, software-pipelined by the compiler (num_stages)
                acc = jax.lax.fori_loop(0, n_steps, lambda t, a: compute(a, load(t)), acc)
            else:  # unrolled: the loads of step t + pf are issued before step t is computed
                pending = [load(t) for t in range(pf)]
                for t in range(n_steps):
                    if t + pf < n_steps:
                        pending.append(load(t + pf))
                    acc = compute(acc, pending[t])
                    pending[t] = None
            # unclamped (distinct) indices: masked lanes must not alias a written element
            pltr.store(o_ref.at[rows[:, None], cols_n[None, :]], acc.astype(o_ref.dtype),
                       mask=rmask[:, None] & nmask[None, :])

        _zero_rows_past_groups(o_ref, nr, rows, cols_n, nmask)

    return pl.pallas_call(
        kernel, grid=(t_max, -(-n // bn)),
        out_shape=jax.ShapeDtypeStruct((a, n), x.dtype),
        compiler_params=_params(num_warps, num_stages), interpret=interpret, name=name,
    )(grp, r0s, nrs, xd, values, scales)


# The weights-as-rows form with the bf16x2 decode is the default for decode-sized calls: measured on an H200
# (benchmarks/RESULTS.md, 2026-12-02 14:39 UTC) at the bench model's batch-32 decode step (192 rows over 16 experts
# of 2304 x 5120) 73.5 / 66.9 µs for w1 / w3 and w2 against 100.8 / 93.5 µs for the "tokens" form (29-32 % vs
# 21-23 % of 4.8 TB/s), the step's FP4 expert kernels 2.37 vs 3.48 ms. The SASS of the K loop (compiled for sm_90 off
# the device, benchmarks/kernel_sass.py fp4_grouped) holds 11.0 instructions per weight byte against 18.3 for the
# "tokens" form (16.0 for the "weights" form with the "f32" decode), with the weight tile as a register operand of
# Hopper's wgmma instead of an mma.sync operand staged through shared memory. Larger calls (prefill) keep the
# "tokens" form: the new one was not measured there.
FP4_GROUPED_WEIGHT_ROWS_MAX = 1024
# The "weights" form's token tile (the wgmma's column side): 16 rows while the experts hold at most this many rows on
# average (rows <= 12 x experts), else 32. Measured on an H200 (benchmarks/RESULTS.md, 2026-12-02 18:39 UTC) at the
# batch-32 decode step's 192 rows over 16 experts (12 per expert): 70.6 / 60.1 µs for w1 / w3 and w2 against
# 73.9 / 67.3 with 32-row tiles (the 14:39 run: 68.6 / 59.7 vs 73.5 / 66.9), the step's FP4 kernels 2.15 vs
# 2.38 ms — although an expert with more than 16 rows then reads its weights twice. Not measured at more rows per
# expert, where that re-read grows: those keep the 32-row tile.
FP4_GROUPED_SMALL_TILE_ROWS_PER_EXPERT = 12


def fp4_weight_rows_block_m(rows: int, experts: int) -> int:
    """The "weights" form's default token tile for ``rows`` routed rows over ``experts`` experts."""
    return 16 if rows <= FP4_GROUPED_SMALL_TILE_ROWS_PER_EXPERT * experts else 32 if rows <= 1024 else 64


FP4_GROUPED_DECODES = ("f32", "bf16x2", "bf16x1")
FP4_GROUPED_DEFAULT_DECODE = "bf16x2"
# "bf16x1" (``_e2m1_bf16x1_scaled``) is exact only for scale bytes <= this (2^(s - 1) must be a finite bf16); larger
# bytes give inf / NaN weights. So it is the decode only of weights known to stay below (``fp4_grouped_decode``; byte
# 128 is the scale 2: the quantiser writes it for groups whose largest |weight| is at most 12). Measured on an H200
# (benchmarks/RESULTS.md, 2026-12-04 08:42 UTC) at the batch-32 step's shapes (192 rows over 16 experts): kernel
# 59.0 vs 60.4-60.9 µs for w1 / w3 (1.02x, 39 vs 38 % of the read-only bandwidth measured in the same process) and
# 54.5-54.6 vs 57.6-57.7 µs for w2 (1.05-1.06x, 42 vs 40 %); the K loop's SASS 9.0 instructions per weight byte
# against 10.8 (``kernel_sass.py fp4_grouped``). On the device every packed byte x scale byte 0..128 came out equal
# to the exact dequantisation for both decodes (subnormal weights of bytes 0 / 1 included), and bytes 129..255
# inf / NaN for "bf16x1".
FP4_BF16X1_SCALE_MAX = 128

# e2m1 nibble -> bf16 bit pattern of value x 2^-126 (exact; code 1, the value 0.5, is the bf16 subnormal 0x0040):
# magnitude bits 0-2 to bits 6-8, sign bit 3 to bit 15. For two nibbles held at bits 0-3 and 16-19 of a register n,
# n * 0x1040 = n << 6 | n << 12 (the two copies do not overlap) and the mask 0x81C081C0 keeps bits 6-8 of the first
# copy and bit 15 of the second in each half; the high nibbles (bits 4-7 / 20-23) take n * 0x104 (<< 2 | << 8).
# "bf16x2": then two bf16x2 multiplies, by 2^126 (the e2m1 values, all normal or zero; the bf16 multiply keeps the
# subnormal input) and by the scale 2^(s - 127) — exact (powers of two) for every scale byte 1..254 (byte 0, 2^-127,
# is the bf16 subnormal 0x0040; 0xFF gives NaN). "bf16x1": one bf16x2 multiply by 2^(s - 1), the scale with the
# 2^126 folded in (``_fp4_bf16x1_multiplier``) — one instruction less per two packed bytes and nibble half; exact
# for scale bytes 0..128 (the products value x 2^(s - 127) are at most 12 and at least 2^-128, a bf16 subnormal the
# multiply writes exactly), while 2^(s - 1) for bytes > 128 is past bf16's largest power of two (2^127): the
# multiplier is +inf there and the weights inf (or NaN for zero codes), never a wrong finite number.
E2M1_BF16_MASKS = {0: ("0x000F000F", "0x1040"), 4: ("0x00F000F0", "0x104")}  # shift -> (nibble mask, multiplier)


def _e2m1_bf16x2_ptx(shift: int, one_multiply: bool = False) -> str:
    """PTX of one instance (two packed bytes in the 16-bit $1, their bf16 multipliers in $2 -> the two scaled bf16
    weights of the low (shift 0) or high (shift 4) nibbles in $0): "bf16x2" (two multiplies: 2^126, then $2 =
    ``_fp4_bf16_multiplier``) or, ``one_multiply``, "bf16x1" (one: $2 = ``_fp4_bf16x1_multiplier``)."""
    mask, mul = E2M1_BF16_MASKS[shift]
    scale = "mul.rn.bf16x2 $0, n, $2;" if one_multiply else "mul.rn.bf16x2 n, n, c;\nmul.rn.bf16x2 $0, n, $2;"
    const = "" if one_multiply else "mov.b32 c, 0x7E807E80;\n"
    return f"""{{
.reg .b32 w, n{"" if one_multiply else ", c"};
{const}cvt.u32.u16 w, $1;
prmt.b32 w, w, 0, 0x4140;
and.b32 n, w, {mask};
mul.lo.u32 n, n, {mul};
and.b32 n, n, 0x81C081C0;
{scale}
}}"""


def _fp4_bf16_multiplier(s):
    """e8m0 scale bytes -> bf16 2^(s - 127): the exponent bits for bytes 1..254, the subnormal 0x0040 for byte 0,
    NaN for 0xFF."""
    si = s.astype(jnp.int32)
    bits = jnp.where(si == 0, 0x0040, jnp.where(si == 255, 0x7FC0, si << 7))
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def _fp4_bf16x1_multiplier(s):
    """e8m0 scale bytes -> bf16 2^(s - 1) (the scale 2^(s - 127) times the 2^126 the "bf16x1" patterns lack): the
    exponent bits of bytes 0..128 (all normal); +inf for bytes 129..255, whose 2^(s - 1) bf16 cannot hold — clamped
    to the inf pattern so that no byte wraps into the sign bit (a finite -0 multiplier would be a wrong number)."""
    si = s.astype(jnp.int32)
    bits = jnp.minimum(si + 126, 255) << 7
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def fp4_grouped_decode(scale_max: int | None) -> str:
    """The grouped FP4 "weights" form's decode for weights whose largest scale byte is ``scale_max``
    (``QuantizedTensor.scale_max``; None: unknown): "bf16x1" where it is exact for every scale (<=
    ``FP4_BF16X1_SCALE_MAX``), else the exact-everywhere default ``FP4_GROUPED_DEFAULT_DECODE``."""
    if scale_max is not None and (isinstance(scale_max, bool) or not isinstance(scale_max, int)
                                  or not 0 <= scale_max <= 255):
        raise ValueError(f"scale_max must be a scale byte 0..255 or None, got {scale_max!r}")
    return "bf16x1" if scale_max is not None and scale_max <= FP4_BF16X1_SCALE_MAX else FP4_GROUPED_DEFAULT_DECODE


def _e2m1_bf16x2_scaled(v, mult, interpret: bool):
    """Packed e2m1 bytes v uint8 [...] and bf16 scales [...] (``_fp4_bf16_multiplier``) -> (low, high) nibbles
    as bf16 ``value x 2^(s - 127)``, exact. On the GPU inline PTX (``_e2m1_bf16x2_ptx``, two bytes per instance);
    in interpret mode the float16 decode's exact values (equal: exact products)."""
    if interpret:  # the same exact values computed another way (the float16 decode, value x 2^-14), with no
        # subnormal intermediate; the PTX's bit patterns are checked in tests/test_quant_gemm.py against the table
        vi = v.astype(jnp.int32)
        m = mult.astype(jnp.float32)

        def value(codes):
            d = decode_e2m1_scaled(codes).astype(jnp.float32) * jnp.float32(2.0 ** 14)
            return (d * m).astype(jnp.bfloat16)

        return value(vi & 15), value(vi >> 4)
    return _e2m1_ptx_nibbles(v, mult, one_multiply=False)


def _e2m1_ptx_nibbles(v, mult, one_multiply: bool):
    """The (low, high) nibbles' scaled bf16 weights by the inline PTX of ``_e2m1_bf16x2_ptx``: one instance per
    nibble half (the Pallas lowering takes one result per inline-asm op)."""
    return tuple(pltr.elementwise_inline_asm(_e2m1_bf16x2_ptx(sh, one_multiply), args=[v, mult],
                                             constraints="=r,h,r", pack=2,
                                             result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, jnp.bfloat16)])[0]
                 for sh in (0, 4))


def _e2m1_bf16x1_scaled(v, mult, interpret: bool):
    """Packed e2m1 bytes v uint8 [...] and bf16 multipliers 2^(s - 1) [...] (``_fp4_bf16x1_multiplier``) -> (low,
    high) nibbles as bf16 ``value x 2^(s - 127)``: exact for scale bytes 0..128, inf / NaN beyond. On the GPU inline
    PTX (``_e2m1_bf16x2_ptx(..., one_multiply=True)``). In interpret mode the same numbers from integer exponent
    arithmetic (``ops.quant._ldexp_exact``): XLA on the CPU flushes subnormal operands and results of float
    arithmetic to zero, which the GPU's bf16 multiply does not (scale bytes 0 and 1 give bf16 subnormals)."""
    if interpret:
        from dsv41_jax.ops.quant import _ldexp_exact

        vi = v.astype(jnp.int32)
        e = jax.lax.bitcast_convert_type(mult, jnp.uint16).astype(jnp.int32) >> 7  # biased exponent of 2^(s - 1)

        def value(codes):  # value x 2^-126 x 2^(s - 1) = value x 2^(e - 253); an inf multiplier (e 255): inf x value
            d = decode_e2m1_scaled(codes).astype(jnp.float32) * jnp.float32(2.0 ** 14)  # the e2m1 value, normal
            inf = jnp.where(d == 0, jnp.float32(jnp.nan), jnp.copysign(jnp.float32(jnp.inf), d))
            return jnp.where(e == 255, inf, _ldexp_exact(d, e - 253)).astype(jnp.bfloat16)

        return value(vi & 15), value(vi >> 4)
    return _e2m1_ptx_nibbles(v, mult, one_multiply=True)


# --- the e4m3 -> bf16 decode of the FP8 weights form (inline PTX): forms with the same bit patterns ---------------
# Both make the bf16 pattern ``(b & 0x80) << 8 | (b & 0x7F) << 4`` of each e4m3 byte b: value x 2^-120 (exact; the
# e4m3 subnormals become bf16 subnormals of the same ratio), for two bytes at once (at bits 0-7 / 16-23 of a register
# after the first prmt), then two packed multiplies by 2^120 and the block scale.
# "mask" (the form before): shift the magnitude and the sign separately, mask each, OR them.
# "sign": one prmt makes each 16-bit half (sign-replicated byte) << 8 | b — selector nibble 8 / 9 = "the sign bit of
#   byte 0 / 1, replicated over the byte" — so after one shift by 4 bit 15 of each half is the sign and bits 4-10 the
#   magnitude, and one mask 0x87F0 per half (dropping b's own sign at bit 11 and the low half's spill into bits
#   16-19) leaves the same pattern: two integer instructions fewer per byte pair. Exact for every byte but e4m3's
#   NaN bytes 0x7F / 0xFF (the release's quantiser never writes them; both forms give ±480 x scale there), checked
#   on all 256 bytes in tests/test_quant_gemm.py (an emulation of the PTX) and on the GPU by
#   benchmarks/bench_decode_gemv.py --m32.
# "sign_fold" (an option): "sign" with the two multiplies folded into one by 2^120 x scale = 2^(s - 7)
#   (``_e4m3_fold_multiplier``), one packed multiply fewer per byte pair. The single product p x 2^(s - 7) of the
#   exact pattern p is the same number as the two-multiply result (one rounding of the same exact value), but
#   2^(s - 7) is a bf16 only for scale bytes s <= 134: larger bytes (a 32 x 32 block whose largest magnitude is above
#   448 x 2^7) give NaN, never a wrong number — hence not the default, though no real weight comes near.
_E4M3_BF16X2_PTX = {
    "sign_fold": """{
.reg .b32 w, n;
cvt.u32.u16 w, $1;
prmt.b32 w, w, 0, 0x9180;
shl.b32 n, w, 4;
and.b32 n, n, 0x87F087F0;
mul.rn.bf16x2 $0, n, $2;
}""",
    "sign": """{
.reg .b32 w, n, c;
mov.b32 c, 0x7B807B80;
cvt.u32.u16 w, $1;
prmt.b32 w, w, 0, 0x9180;
shl.b32 n, w, 4;
and.b32 n, n, 0x87F087F0;
mul.rn.bf16x2 n, n, c;
mul.rn.bf16x2 $0, n, $2;
}""",
    "mask": """{
.reg .b32 w, n, t, c;
mov.b32 c, 0x7B807B80;
cvt.u32.u16 w, $1;
prmt.b32 w, w, 0, 0x4140;
shl.b32 n, w, 4;
and.b32 n, n, 0x07F007F0;
shl.b32 t, w, 8;
and.b32 t, t, 0x80008000;
or.b32 n, n, t;
mul.rn.bf16x2 n, n, c;
mul.rn.bf16x2 $0, n, $2;
}"""}


def _e4m3_bf16x2_ptx(decode: str = "sign") -> str:
    """PTX of one instance: two e4m3 bytes in the 16-bit $1, their bf16 scales in $2 -> the two scaled bf16 weights in
    $0 (``_E4M3_BF16X2_PTX``)."""
    return _E4M3_BF16X2_PTX[decode]


E4M3_FOLD_MAX_SCALE_BYTE = 134  # "sign_fold": 2^(134 - 7) is bf16's largest power of two


def _e4m3_fold_multiplier(s):
    """e8m0 scale bytes -> bf16 2^120 x 2^(s - 127) = 2^(s - 7) (the "sign_fold" decode's one multiplier): the exponent
    bits for bytes 0..134, NaN above (not a bf16 number) and for 0xFF."""
    si = s.astype(jnp.int32)
    bits = jnp.where(si > E4M3_FOLD_MAX_SCALE_BYTE, 0x7FC0, (si + 120) << 7)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def _e4m3_bf16x2_scaled(v, mult, interpret: bool, decode: str = "sign"):
    """e4m3 bytes v uint8 [...] and bf16 scales [...] (``_fp4_bf16_multiplier``; ``_e4m3_fold_multiplier`` for
    "sign_fold") -> bf16 ``value x 2^(s - 127)``, exact (bytes 0x7F / 0xFF, e4m3's NaN, which the release's quantiser
    never writes, decode to ±480 x scale on the GPU). In interpret mode the e4m3 conversion of XLA (equal for every
    other byte)."""
    if interpret:
        d = jax.lax.bitcast_convert_type(v, jnp.float8_e4m3fn).astype(jnp.float32)
        m = mult.astype(jnp.float32) * (jnp.float32(2.0 ** -120) if decode == "sign_fold" else 1)
        return (d * m).astype(jnp.bfloat16)
    return pltr.elementwise_inline_asm(_e4m3_bf16x2_ptx(decode), args=[v, mult], constraints="=r,h,r", pack=2,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, jnp.bfloat16)])[0]
# ------------------------------------------------------------------------------------------------------------------


def _fp4_weight_tile(v, s, decode: str, dot_dtype, interpret: bool):
    """A K step's weight tile of the weights-as-rows forms: packed bytes v [bn, bk/2] and scale bytes s [bn, bk/32]
    -> the (low, high) nibbles' weights ``value x 2^(s - 127)`` [bn, bk/2] in the dot dtype, exact. "bf16x2" (bf16
    dots): inline PTX (``_e2m1_bf16x2_scaled``); "bf16x1" (bf16 dots): inline PTX with one multiply
    (``_e2m1_bf16x1_scaled``; exact for scale bytes <= 128 only); else the float16 pair decode widened to float32
    and scaled."""
    bn, bkh = v.shape
    sg, hb = s.shape[1], SCALE_BLOCK // 2
    if decode in ("bf16x2", "bf16x1") and dot_dtype == jnp.bfloat16:
        one = decode == "bf16x1"
        mult = (_fp4_bf16x1_multiplier if one else _fp4_bf16_multiplier)(s)
        mult = jnp.broadcast_to(mult[:, :, None], (bn, sg, hb)).reshape(bn, bkh)
        return (_e2m1_bf16x1_scaled if one else _e2m1_bf16x2_scaled)(v, mult, interpret)
    mult = _fp4_scale_mult(s)[:, :, None]  # [bn, sg, 1]: 2^(s - 127 + 14), NaN past byte 240
    lo, hi = _e2m1_pair_f16(v)  # [bn, bkh] float32: value x 2^-14, exact

    def scaled(d):
        return (d.reshape(bn, sg, hb) * mult).reshape(bn, bkh).astype(dot_dtype)

    return scaled(lo), scaled(hi)


def _fp4_grouped_weight_rows(x, group_sizes, values, scales, *, block_m, block_n, block_k, num_warps, num_stages,
                             decode, split_k, name, interpret):
    """``fp4_grouped_gemm`` with the weights on the tensor-core product's row side: out[rows, cols]ᵀ =
    W[cols, K step] · x[rows, K step]ᵀ per tile. Why: at decode an expert holds a handful of rows (at batch 32 about
    12 of 192 on 16 experts), so the token side is the product's narrow side; with the weight tile as the row
    operand the product's row dimension is the weight tile's ``block_n`` rows and the column dimension the few
    tokens, and the activations arrive split into even / odd columns from XLA (no split in registers).
    Same exact products and the same float32 accumulation per K step as the "tokens" form."""
    if decode not in FP4_GROUPED_DECODES:
        raise ValueError(f"decode must be one of {FP4_GROUPED_DECODES}, got {decode!r}")
    a, k = x.shape
    e, n, kh = values.shape
    bm = block_m or fp4_weight_rows_block_m(a, e)
    bn = block_n or 64
    bk = max(SCALE_BLOCK, min(block_k or 256, _pow2(k)))
    if bk % SCALE_BLOCK or k % SCALE_BLOCK:
        raise ValueError(f"block_k {bk} and K {k} must be multiples of {SCALE_BLOCK}")
    bkh, sg = bk // 2, bk // SCALE_BLOCK
    dot_dtype = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16
    pairs = x.astype(dot_dtype).reshape(a, kh, 2)
    xe, xo = pairs[..., 0], pairs[..., 1]  # [A, K/2]: the activations of the low / high nibbles
    grp, r0s, nrs = tile_metadata(group_sizes, a, bm)
    t_max = grp.shape[0]
    n_steps = -(-k // bk)
    k_tail, n_tail = k % bk != 0, n % bn != 0
    if split_k < 1 or n_steps % split_k:
        raise ValueError(f"split_k {split_k} must divide the {n_steps} K steps of {bk} (K = {k})")
    per = n_steps // split_k

    def kernel(g_ref, r0_ref, nr_ref, xe_ref, xo_ref, v_ref, s_ref, o_ref):
        _, ni, ex, nr, rows, cols_n, nmask = _group_tile(g_ref, r0_ref, nr_ref, bm, bn, n)
        ki = pl.program_id(2)
        lead = (ki,) if split_k > 1 else ()

        @pl.when(nr > 0)
        def _():
            rmask = jnp.arange(bm) < nr
            rows_c = jnp.minimum(rows, a - 1)
            cols_nc = jnp.minimum(cols_n, n - 1)

            def load(t):
                cb = t * bkh + jnp.arange(bkh)
                cs = t * sg + jnp.arange(sg)
                if k_tail or n_tail:
                    v = pltr.load(v_ref.at[ex, cols_nc[:, None], jnp.minimum(cb, kh - 1)[None, :]],
                                  mask=nmask[:, None] & (cb < kh)[None, :], other=0)
                    s = pltr.load(s_ref.at[ex, cols_nc[:, None], jnp.minimum(cs, k // SCALE_BLOCK - 1)[None, :]],
                                  mask=nmask[:, None] & (cs < k // SCALE_BLOCK)[None, :], other=127)
                else:
                    v = v_ref[ex, pl.ds(ni * bn, bn), pl.ds(t * bkh, bkh)]
                    s = s_ref[ex, pl.ds(ni * bn, bn), pl.ds(t * sg, sg)]
                cbc = jnp.minimum(cb, kh - 1) if k_tail else cb
                xmask = rmask[:, None] & (cb < kh)[None, :]
                xe_t = pltr.load(xe_ref.at[rows_c[:, None], cbc[None, :]], mask=xmask, other=0)
                xo_t = pltr.load(xo_ref.at[rows_c[:, None], cbc[None, :]], mask=xmask, other=0)
                return v, s, xe_t, xo_t

            def compute(t, acc):
                v, s, xe_t, xo_t = load(t)
                lo, hi = _fp4_weight_tile(v, s, decode, dot_dtype, interpret)
                return acc + _dot_nt(lo, xe_t) + _dot_nt(hi, xo_t)

            # static bounds (a loop the compiler pipelines), this program's K range offset inside
            acc = jax.lax.fori_loop(0, per, lambda i, acc: compute(ki * per + i, acc),
                                    jnp.zeros((bn, bm), jnp.float32))
            # acc[j, i] is out[rows[i], cols[j]]: stored through transposed indices
            pltr.store(o_ref.at[lead + (rows[None, :], cols_n[:, None])], acc.astype(o_ref.dtype),
                       mask=rmask[None, :] & nmask[:, None])

        _zero_rows_past_groups(o_ref, nr, rows, cols_n, nmask, lead)

    out_shape = (a, n) if split_k == 1 else (split_k, a, n)
    out = pl.pallas_call(
        kernel, grid=(t_max, -(-n // bn), split_k),
        out_shape=jax.ShapeDtypeStruct(out_shape, x.dtype if split_k == 1 else jnp.float32),
        compiler_params=_params(num_warps or 4, num_stages or 3), interpret=interpret, name=name,
    )(grp, r0s, nrs, xe, xo, values, scales)
    return out if split_k == 1 else jnp.sum(out, axis=0).astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# FP8 tensor-core products (Hopper wgmma e4m3 x e4m3) with float32 promotion per 32-wide K chunk
# ----------------------------------------------------------------------------------------------------------------
# The release rounds every FP8 / FP4 GEMM input to FP8 (e4m3 codes, one power-of-two scale per 32 along K), so the
# activations are e4m3 codes x 2^k per 32, and an e2m1 weight nibble n is the e4m3 byte ``(n & 7) << 2 | (n & 8) << 4``
# of exactly value x 2^-6 (0.5, the e2m1 subnormal, lands on the e4m3 subnormal 4 x 2^-9). One 32-wide chunk of the
# product is then one FP8 tensor-core instruction (K = 32) on bytes as stored, and its float32 result is scaled by
# the two chunks' scales and added to a float32 accumulator ("promotion" per 32, the release's own kernels' form):
# the weight decode is a shift and a mask per byte, not a float conversion and multiply per value.
# JAX's Triton lowering emits ``tt.dot`` with ``maxNumImpreciseAcc = 0``, for which Triton gives FP8 operands with a
# float32 result to the pre-Hopper ``mma.sync`` path (each byte widened to float16 first: ``F2FP`` + ``HMMA`` in the
# SASS). ``fp8_dot_nt`` is a primitive of its own whose Triton lowering sets ``maxNumImpreciseAcc`` to the chunk's
# K: Triton then emits Hopper's ``wgmma`` on e4m3 (``QGMMA ... E4M3.E4M3``; benchmarks/kernel_sass.py); off the GPU
# (interpret mode, XLA) it is the exact float32 product of the e4m3 values.
# Both FP8 forms are options, NOT the defaults: measured on an H200 (benchmarks/RESULTS.md, 2026-12-03 21:25 UTC) the
# grouped FP4 form took 128-186 µs for the batch-32 w1 / w3 (default 61-63) and 100-121 µs for w2 (default 57), the
# release batch-32 step 30.58 ms against 22.85 with it; the dense form at M = 32 took 1.7x the default at equal grids
# (up to 5x where the default splits K, which the FP8 form does not). The SASS
# holds fewer instructions per weight byte (grouped 7.8 at block_n 128 vs 10.5; dense 3.5 vs 6.6), but each chunk's
# scaled promotion needs the wgmma's result at once: Triton emits every chunk's wgmma as commit + wait_group 0 (plus
# a fence.proxy.async for its shared-memory operand), so the 160 chunks of a program run one tensor-core latency
# after another. Triton keeps a wgmma in flight (wait_group 1) only for an accumulator carried straight into the
# next dot, i.e. with scales constant along K — not the release's per-32 scales.
# The synchronous alternative (``mma_rows="tokens"``: the 16 / 32-row token tile as the product's row side, below the
# 64-row wgmma, so Triton's mma.sync path — no commit / wait, the promotion a multiply-add on registers) has no FP8
# instruction under it on sm_90: ptxas assembles PTX's ``mma.sync ... m16n8k32 ... e4m3.e4m3`` for sm_90a as 12
# ``F2FP.F16.E4M3.UNPACK_B`` + 2 ``HMMA.16816.F32`` (``QMMA.16832 ... E4M3`` exists for sm_89; the raw disassembly
# in benchmarks/results/fp8_sync_mma_2026-12-04/), and Triton itself widens FP8 dot operands to float16 on that path
# for every target but sm_89 / sm_120. So each chunk is two float16 MMAs on widened bytes (both operands: the
# activation tile again in every program). K loop, SASS per weight byte (``kernel_sass.py``): dense M = 32 5.8 at
# block_n 64 (default 6.6), grouped 9.9 at block_n 128 (default 10.5) — and on an H200 (benchmarks/RESULTS.md,
# 2026-12-04 00:03 UTC) 0.34-0.59x the grouped default and 0.12-0.69x the dense default (0.64-0.69x where the grids
# match): options, not defaults.
def _fp8_dot_nt_impl(a, b):
    return jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), (((1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _fp8_dot_nt_abstract(a, b):
    if a.dtype != jnp.float8_e4m3fn or b.dtype != jnp.float8_e4m3fn or a.ndim != 2 or b.ndim != 2 or \
            a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_dot_nt takes two float8_e4m3fn tiles [M, K] and [N, K], got {a.dtype}{a.shape} and "
                         f"{b.dtype}{b.shape}")
    return jax.core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32)


def _fp8_dot_nt_triton(ctx, a, b):
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith as arith_dialect
    from jax._src.lib.triton import dialect as tt_dialect

    (m, kk), (n, _) = ctx.avals_in[0].shape, ctx.avals_in[1].shape
    f32 = ir.F32Type.get()
    acc_type = ir.RankedTensorType.get([m, n], f32)
    zeros = arith_dialect.constant(acc_type, ir.DenseElementsAttr.get_splat(acc_type, ir.FloatAttr.get(f32, 0.0)))
    return tt_dialect.dot(a, tt_dialect.trans(b, (1, 0)), zeros, max_num_imprecise_acc=kk)


def _make_fp8_dot_nt():
    from jax.extend import core as jex_core
    from jax.interpreters import mlir

    prim = jex_core.Primitive("fp8_dot_nt")
    prim.def_impl(_fp8_dot_nt_impl)
    prim.def_abstract_eval(_fp8_dot_nt_abstract)
    mlir.register_lowering(prim, mlir.lower_fun(_fp8_dot_nt_impl, multiple_results=False))
    try:  # JAX's private Pallas Triton lowering table (present in jax 0.10 and 0.11)
        from jax._src.pallas.triton import lowering as triton_lowering

        triton_lowering.register_lowering(prim)(_fp8_dot_nt_triton)
    except (ImportError, AttributeError):  # then the kernels using it fail to lower, with JAX's own error
        pass
    return prim


_FP8_DOT_NT = _make_fp8_dot_nt()


def fp8_dot_nt(a, b):
    """a [M, K] · b [N, K]ᵀ -> [M, N] float32 for float8_e4m3fn tiles: in a Pallas GPU kernel one Hopper FP8
    wgmma per 32 of K for M >= 64 (K = 32 here: one instruction, its result promoted by the caller); below 64 rows
    Triton's synchronous MMA path (on sm_90 float16 MMAs on the widened bytes; section comment above)."""
    return _FP8_DOT_NT.bind(a, b)


# e2m1 -> e4m3 bytes for four packed bytes per instance ($1: bytes b0..b3, each two nibbles): the low nibbles'
# e4m3 bytes ((n & 7) << 2 | (n & 8) << 4 per byte lane) or the high nibbles' ((n >> 4 & 7) << 2 | n & 0x80);
# the masks keep each lane's bits from its neighbours'.
_E2M1_E4M3_PTX = {
    0: """{
.reg .b32 a, b;
shl.b32 a, $1, 2;
and.b32 a, a, 0x1C1C1C1C;
shl.b32 b, $1, 4;
and.b32 b, b, 0x80808080;
or.b32 $0, a, b;
}""",
    4: """{
.reg .b32 a, b;
shr.b32 a, $1, 2;
and.b32 a, a, 0x1C1C1C1C;
and.b32 b, $1, 0x80808080;
or.b32 $0, a, b;
}""",
}


def e2m1_e4m3_bytes(v):
    """Packed e2m1 bytes uint8 [...] -> (low, high) nibbles' e4m3 bytes uint8 [...], each the exact e4m3 pattern of
    the nibble's value x 2^-6 (plain integer ops; the kernel's PTX computes the same four bytes at a time)."""
    vi = v.astype(jnp.int32)
    lo = ((vi & 7) << 2) | ((vi & 8) << 4)
    hi = ((vi >> 2) & 0x1C) | (vi & 0x80)
    return lo.astype(jnp.uint8), hi.astype(jnp.uint8)


def _e2m1_e4m3_chunk(v, interpret: bool):
    """One scale chunk's packed bytes uint8 [bn, 16] -> its 32 weights as e4m3 [bn, 32] (value x 2^-6) in the order
    ``FP8_CHUNK_ORDER``: position j < 16 holds element 2j (byte j's low nibble), 16 + j element 2j + 1."""
    if interpret:
        lo, hi = e2m1_e4m3_bytes(v)
    else:
        lo, hi = (pltr.elementwise_inline_asm(_E2M1_E4M3_PTX[sh], args=[v], constraints="=r,r", pack=4,
                                              result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, jnp.int8)])[0]
                  for sh in (0, 4))  # int8: Triton's inline asm takes signless integers only
    # chunk order [low nibbles | high nibbles]: the wgmma's register operand gives a thread four consecutive K
    # positions in each half, i.e. four consecutive packed bytes — one 32-bit word per half, no byte shuffles
    w = jnp.stack([lo, hi], axis=-1).transpose(0, 2, 1).reshape(v.shape[0], 2 * v.shape[1])
    return jax.lax.bitcast_convert_type(w, jnp.float8_e4m3fn)


# The K order of a 32-wide chunk in the FP8 form (weights and activations alike): the even elements, then the odd.
FP8_CHUNK_ORDER = tuple(range(0, SCALE_BLOCK, 2)) + tuple(range(1, SCALE_BLOCK, 2))


def _e8m0_x64(s):
    """e8m0 scale bytes -> float32 2^(s - 127) x 2^6 (undoes the e4m3 weights' 2^-6): exact for bytes <= 248 (every
    scale a quantiser writes for real weights); larger bytes and 0xFF give NaN."""
    si = s.astype(jnp.int32)
    return jnp.where(si > 248, jnp.float32(jnp.nan), jax.lax.bitcast_convert_type((si + 6) << 23, jnp.float32))


def _fp4_grouped_fp8_mma(x, group_sizes, values, scales, *, block_m, block_n, block_k, num_warps, num_stages,
                         name, interpret, token_rows: bool = False):
    """``fp4_grouped_gemm(..., mma="fp8")``: the grouped FP4 GEMM on FP8 tensor-core products. The activations become
    e4m3 codes and a float32 scale per 32 in XLA (``ops.quant.fp8_e4m3_block_codes``: exact for the release's
    FP8-rounded GEMM inputs, else it is that rounding); per 32-wide chunk a program decodes its [block_n, 16] packed
    bytes to [block_n, 32] e4m3 bytes (``_e2m1_e4m3_chunk``), takes their product with the [block_m, 32] activation
    codes (float32) and adds it times 2^6 x weight scale (per weight row) x activation scale (per token) to a
    float32 accumulator. ``token_rows`` False (``mma_rows`` None / "weights"): the weight rows are the product's row
    side, one Hopper wgmma per chunk; True ("tokens"): an expert's 16- or 32-row token tile is, below the 64-row
    wgmma, so Triton takes its synchronous MMA path (no commit / wait between chunks; on sm_90 F2FP + float16 HMMA)."""
    from dsv41_jax.ops.quant import fp8_e4m3_block_codes

    a, k = x.shape
    e, n, kh = values.shape
    if k % SCALE_BLOCK:
        raise ValueError(f"K {k} must be a multiple of {SCALE_BLOCK}")
    if token_rows:
        bm = block_m or (16 if a <= FP4_GROUPED_SMALL_TILE_ROWS_PER_EXPERT * e else 32)
        bn = block_n or 64
        if bm not in (16, 32) or bn < 16 or bn & (bn - 1):
            raise ValueError(f"the FP8 tokens form needs block_m 16 or 32 (below the 64-row wgmma) and block_n a "
                             f"power of two >= 16, got {block_m} / {block_n}")
    else:
        bm = block_m or fp4_weight_rows_block_m(a, e)
        bn = block_n or 64
        if bn < 64 or bm < 16:
            raise ValueError(f"the FP8 wgmma form needs block_n >= 64 and block_m >= 16, got {bn} / {bm}")
    chunks = k // SCALE_BLOCK
    sg = _largest_pow2_divisor(chunks, max(1, (block_k or 256) // SCALE_BLOCK))  # chunks per K step: divides K
    n_steps = chunks // sg
    hb = SCALE_BLOCK // 2
    n_tail = n % bn != 0
    codes, xs = fp8_e4m3_block_codes(x)  # [A, K] e4m3, [A, K / 32] float32
    grp, r0s, nrs = tile_metadata(group_sizes, a, bm)
    t_max = grp.shape[0]
    # each row tile's activations gathered by XLA (a few MB at decode): codes [T, bm, K] in FP8_CHUNK_ORDER, scales
    # [T, K / 32, bm] — a chunk's tiles are aligned contiguous runs (the codes straight into the product's shared-
    # memory operand); rows past a tile's group only reach output elements that are not stored
    tile_rows = jnp.minimum(jnp.maximum(r0s, 0)[:, None] + jnp.arange(bm)[None, :], a - 1)  # [T, bm]
    codes = codes.reshape(a, chunks, SCALE_BLOCK)[:, :, jnp.asarray(FP8_CHUNK_ORDER)].reshape(a, k)[tile_rows]
    xs = jnp.swapaxes(xs[tile_rows], 1, 2)

    def kernel(g_ref, r0_ref, nr_ref, xq_ref, xs_ref, v_ref, s_ref, o_ref):
        ti, ni, ex, nr, rows, cols_n, nmask = _group_tile(g_ref, r0_ref, nr_ref, bm, bn, n)

        @pl.when(nr > 0)
        def _():
            rmask = jnp.arange(bm) < nr
            cols_nc = jnp.minimum(cols_n, n - 1)

            def chunk(c, acc):  # the 32-wide K chunk c: one FP8 product, promoted with both scales
                cb = c * hb + jnp.arange(hb)
                if n_tail:
                    v = pltr.load(v_ref.at[ex, cols_nc[:, None], cb[None, :]], mask=nmask[:, None], other=0)
                    s = pltr.load(s_ref.at[ex, cols_nc, c], mask=nmask, other=127)
                else:
                    v = v_ref[ex, pl.ds(ni * bn, bn), pl.ds(c * hb, hb)]
                    s = s_ref[ex, pl.ds(ni * bn, bn), c]
                xq = xq_ref[ti, :, pl.ds(c * SCALE_BLOCK, SCALE_BLOCK)]
                xsc = xs_ref[ti, c, :]
                w = _e2m1_e4m3_chunk(v, interpret)
                if token_rows:  # [bm, bn]
                    return acc + fp8_dot_nt(xq, w) * (xsc[:, None] * _e8m0_x64(s)[None, :])
                return acc + fp8_dot_nt(w, xq) * (_e8m0_x64(s)[:, None] * xsc[None, :])  # [bn, bm]

            def step(t, acc):
                for j in range(sg):
                    acc = chunk(t * sg + j, acc)
                return acc

            acc = jax.lax.fori_loop(0, n_steps, step, jnp.zeros((bm, bn) if token_rows else (bn, bm), jnp.float32))
            if token_rows:
                pltr.store(o_ref.at[rows[:, None], cols_n[None, :]], acc.astype(o_ref.dtype),
                           mask=rmask[:, None] & nmask[None, :])
            else:  # acc[j, i] is out[rows[i], cols[j]]: stored through transposed indices
                pltr.store(o_ref.at[rows[None, :], cols_n[:, None]], acc.astype(o_ref.dtype),
                           mask=rmask[None, :] & nmask[:, None])

        _zero_rows_past_groups(o_ref, nr, rows, cols_n, nmask)

    return pl.pallas_call(
        kernel, grid=(t_max, -(-n // bn)),
        out_shape=jax.ShapeDtypeStruct((a, n), x.dtype),
        compiler_params=_params(num_warps or 4, num_stages or 3), interpret=interpret, name=name,
    )(grp, r0s, nrs, codes, xs, values, scales)


def _fp8_gemm_fp8_mma(x, values, scales, *, block_m, block_n, block_k, num_warps, num_stages, name, interpret):
    """``fp8_gemm(..., mma="fp8")``: the weights-as-rows form on FP8 tensor cores, no weight decode at all — per
    32-wide K chunk the [block_n, 32] e4m3 weight bytes as stored take one FP8 wgmma against the activations' FP8
    codes [block_m, 32] (``ops.quant.fp8_e4m3_block_codes``: exact for the release's FP8-rounded GEMM inputs, else
    that rounding), the float32 result added times the weight block's scale (per 32 rows) x the activation scale
    (per token) to a float32 accumulator. Grid: row block x 64-row column block, no K split."""
    from dsv41_jax.ops.quant import fp8_e4m3_block_codes

    m, k = x.shape
    n = values.shape[0]
    if k % SCALE_BLOCK:
        raise ValueError(f"the FP8 wgmma form needs K a multiple of {SCALE_BLOCK}, got {k}")
    bm = block_m or max(16, min(64, _pow2(m)))
    bn = block_n or 64
    if bn < 64 or bn % SCALE_BLOCK or bm < 16:
        raise ValueError(f"the FP8 wgmma form needs block_n >= 64 (a multiple of 32) and block_m >= 16, got {bn} / "
                         f"{bm}")
    chunks = k // SCALE_BLOCK
    sg = _largest_pow2_divisor(chunks, max(1, (block_k or 256) // SCALE_BLOCK))
    n_steps = chunks // sg
    nb, ks = bn // SCALE_BLOCK, -(-n // SCALE_BLOCK)
    n_tail = n % bn != 0
    nm = -(-m // bm)
    codes, xs = fp8_e4m3_block_codes(x)  # [M, K] e4m3, [M, K / 32] float32
    # rows padded to whole row blocks (read unmasked: straight into the wgmma's shared-memory operand; the padding
    # rows' outputs are not stored); scales transposed: a chunk's scales of a row block are one contiguous run
    codes = jnp.pad(codes, ((0, nm * bm - m), (0, 0)))
    xs = jnp.pad(xs.T, ((0, 0), (0, nm * bm - m)))
    w8 = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)

    def kernel(xq_ref, xs_ref, v_ref, s_ref, o_ref):
        mi, ni = pl.program_id(0), pl.program_id(1)
        rows_m = mi * bm + jnp.arange(bm)
        rows_n = ni * bn + jnp.arange(bn)
        nmask = rows_n < n
        srow = jnp.minimum(ni * nb + jnp.arange(nb), ks - 1)

        def chunk(c, acc):
            if n_tail:
                w = pltr.load(v_ref.at[jnp.minimum(rows_n, n - 1)[:, None],
                                       (c * SCALE_BLOCK + jnp.arange(SCALE_BLOCK))[None, :]])
            else:
                w = v_ref[pl.ds(ni * bn, bn), pl.ds(c * SCALE_BLOCK, SCALE_BLOCK)]
            xq = xq_ref[pl.ds(mi * bm, bm), pl.ds(c * SCALE_BLOCK, SCALE_BLOCK)]
            xsc = xs_ref[c, pl.ds(mi * bm, bm)]
            ws = jnp.broadcast_to(_e8m0_mult(s_ref[srow, c])[:, None], (nb, SCALE_BLOCK)).reshape(bn)
            return acc + fp8_dot_nt(w, xq) * (ws[:, None] * xsc[None, :])

        def step(t, acc):
            for j in range(sg):
                acc = chunk(t * sg + j, acc)
            return acc

        acc = jax.lax.fori_loop(0, n_steps, step, jnp.zeros((bn, bm), jnp.float32))
        pltr.store(o_ref.at[rows_m[None, :], rows_n[:, None]], acc.astype(o_ref.dtype),
                   mask=(rows_m < m)[None, :] & nmask[:, None])

    return pl.pallas_call(
        kernel, grid=(nm, -(-n // bn)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=_params(num_warps or 4, num_stages or 3), interpret=interpret, name=name,
    )(codes, xs, w8, scales)


def _fp8_gemm_fp8_mma_tokens(x, values, scales, *, block_m, block_n, block_k, num_warps, num_stages, name,
                             interpret):
    """``fp8_gemm(..., mma="fp8", mma_rows="tokens")``: the token tile (``block_m`` 16 or 32 rows: below Hopper's
    64-row wgmma, so Triton takes its synchronous MMA path and no wgmma commit / wait sits between the chunks) as the
    FP8 product's row side. Per 32-wide K chunk one product of the [block_m, 32] activation codes and the stored
    [block_n, 32] e4m3 weight bytes, added to the float32 accumulator times the activation scale (per token) x the
    weight block's scale (per 32 weight rows). On sm_90 the synchronous product is two float16 MMAs (both operands'
    bytes widened by ``F2FP``; see the section comment above)."""
    from dsv41_jax.ops.quant import fp8_e4m3_block_codes

    m, k = x.shape
    n = values.shape[0]
    if k % SCALE_BLOCK:
        raise ValueError(f"the FP8 tokens form needs K a multiple of {SCALE_BLOCK}, got {k}")
    bm = block_m or (16 if m <= 16 else 32)
    bn = block_n or 64
    if bm not in (16, 32) or bn < SCALE_BLOCK or bn % SCALE_BLOCK:
        raise ValueError(f"the FP8 tokens form needs block_m 16 or 32 (below the 64-row wgmma) and block_n a "
                         f"multiple of {SCALE_BLOCK}, got {block_m} / {block_n}")
    chunks = k // SCALE_BLOCK
    sg = _largest_pow2_divisor(chunks, max(1, (block_k or 256) // SCALE_BLOCK))
    n_steps = chunks // sg
    ks = -(-n // SCALE_BLOCK)
    n_tail = n % bn != 0
    nm = -(-m // bm)
    codes, xs = fp8_e4m3_block_codes(x)  # [M, K] e4m3, [M, K / 32] float32
    codes = jnp.pad(codes, ((0, nm * bm - m), (0, 0)))  # padding rows' outputs: not stored
    xs = jnp.pad(xs.T, ((0, 0), (0, nm * bm - m)))
    w8 = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)

    def kernel(xq_ref, xs_ref, v_ref, s_ref, o_ref):
        mi, ni = pl.program_id(0), pl.program_id(1)
        rows_m = mi * bm + jnp.arange(bm)
        rows_n = ni * bn + jnp.arange(bn)
        sub = jnp.arange(SCALE_BLOCK)
        # each weight row's scale row: a gather of cached bytes (a [nb] load broadcast to [bn] in registers costs
        # a shared-memory round trip per chunk in the SASS)
        srow = jnp.minimum(rows_n // SCALE_BLOCK, ks - 1)

        def chunk(c, acc):
            xq = xq_ref[pl.ds(mi * bm, bm), pl.ds(c * SCALE_BLOCK, SCALE_BLOCK)]
            xsc = xs_ref[c, pl.ds(mi * bm, bm)]
            if n_tail:
                w = pltr.load(v_ref.at[jnp.minimum(rows_n, n - 1)[:, None], (c * SCALE_BLOCK + sub)[None, :]])
            else:
                w = v_ref[pl.ds(ni * bn, bn), pl.ds(c * SCALE_BLOCK, SCALE_BLOCK)]
            ws = _e8m0_mult(pltr.load(s_ref.at[srow, c]))
            return acc + fp8_dot_nt(xq, w) * (xsc[:, None] * ws[None, :])

        def step(t, acc):
            for i in range(sg):
                acc = chunk(t * sg + i, acc)
            return acc

        acc = jax.lax.fori_loop(0, n_steps, step, jnp.zeros((bm, bn), jnp.float32))
        pltr.store(o_ref.at[rows_m[:, None], rows_n[None, :]], acc.astype(o_ref.dtype),
                   mask=(rows_m < m)[:, None] & (rows_n < n)[None, :])

    return pl.pallas_call(
        kernel, grid=(nm, -(-n // bn)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=_params(num_warps or 4, num_stages or 3), interpret=interpret, name=name,
    )(codes, xs, w8, scales)


# ----------------------------------------------------------------------------------------------------------------
# One token's routed experts (decode at batch 1): gemv kernels over the selected FP4 experts only
# ----------------------------------------------------------------------------------------------------------------
# At one token the grouped kernel above runs a 16-row tensor-core tile for one real row per expert, behind XLA ops
# that sort the picks and build the tile metadata (measured on an H200 at 2304 x 5120: 17-19 % of 4.8 TB/s). Here a
# token's top-k picks are the slots: ``fp4_slot_swiglu`` streams each picked expert's w1 and w3 rows once (grid:
# slot x column block) and applies the clamped SwiGLU and the routing weight in its epilogue; ``fp4_slot_down``
# streams the picked experts' w2 rows (grid: slot x column block) and one small XLA reduction sums the [S, D] slot
# outputs, so the routed experts of one token are two kernels and no XLA sort / tile metadata / scatter. No tensor
# cores: each weight byte's two e2m1 codes are decoded in registers (the grouped kernel's float16 bit trick:
# ``value * 2^-14``, exact), widened to float32 and multiplied with the matching even / odd activations; the
# products of a K step accumulate elementwise in a [block_n, block_k / 32, 16] float32 tile, each scaled by its e8m0
# scale x 2^14 (a power of two: exact), reduced once at the end. Weights are read as [E, N, K/32, 16] views of the
# packed bytes (16 bytes = one scale group) and the K steps are unrolled with the loads of step i + ``prefetch``
# issued before step i is computed (the FP8 gemv's form). Outputs are rounded as the grouped path rounds them
# (gate / up and each slot's down projection to the activations' dtype), so the two paths agree to float32
# accumulation order.
# Measured on an H200 in the bench model's batch-1 decode step (benchmarks/RESULTS.md, 2026-12-02 11:44 UTC), per
# layer for six 2304 x 5120 experts: gate / up 44.5 µs for 75 MB, down 22.2 µs for 38 MB (both 1.69 TB/s, 35 % of
# 4.8 TB/s) with the pair decode and per-group scaling (``decode="pair_group"``, the default), against 59.5 / 32.1 µs
# (26 / 24 %) for the one-nibble float16 decode scaled per byte (``"f16"``) in the same run. The limit is the CUDA
# cores, not the bytes: the SASS (compiled for sm_90 off the device) holds about 13 instructions per weight byte
# (byte extraction, the pair's two shifts and masks, two float16 -> float32 widenings, three float ops), 18 for "f16",
# whose 255 registers and spills also left one 8-warp program per multiprocessor (101 registers then).
# The "word" decode (the default since 2026-12-03) handles four packed bytes per inline-PTX instance: ≈ 7 instructions
# per byte in its core (decode 2.75, widenings 2, multiply-adds 2) and 8.9-9.6 in the whole kernels, 97-128
# registers; on an H200 gate / up 31.4 µs and down 18.1 µs per layer (54 % / 46 % of the read-only bandwidth, 1.36x
# the pair decode in the same run). The rest of the gap to the bytes is still the CUDA cores (each weight needs its
# widening and its multiply-add) and the activations / scales Triton passes through shared memory every K step.

FP4_HALF = SCALE_BLOCK // 2  # packed bytes per scale group


def _largest_pow2_divisor(n: int, cap: int, unit: int = 1) -> int:
    """The largest ``unit * 2^j <= cap`` dividing ``n`` (``unit`` must divide ``n``)."""
    b = unit
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def fp4_slot_tiling(n: int, k: int, *, block_n: int | None = None, block_k: int | None = None,
                    prefetch: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                    decode: str | None = None, programs: int | None = None, down: bool = False) -> dict:
    """Tiling of the one-token FP4 slot kernels for [n, k] expert matrices (any argument given overrides its
    default): block_n output rows per program and block_k values per K step, the largest powers of two (times 32
    for block_k) up to the defaults that divide n / k — the kernels have no tail masking. ``programs`` (0 / None:
    off): the persistent form, that many programs each walking a share of the (slot, row block) items with the
    next item's first K steps loaded while the current item's last steps are computed (``_persistent_items``)."""
    if k % SCALE_BLOCK:
        raise ValueError(f"K = {k} is not a multiple of the FP4 scale block {SCALE_BLOCK}")
    decode = decode or FP4_SLOT_DEFAULT_DECODE
    if decode not in FP4_SLOT_DECODES:
        raise ValueError(f"decode must be one of {FP4_SLOT_DECODES}, got {decode!r}")
    word = decode == "word"
    # the defaults as measured in the bench model's decode step on an H200 (benchmarks/RESULTS.md, 2026-12-02: gate /
    # up 8-row blocks, 512-wide K steps, 4 ahead, 8 warps; down 16-row blocks, 256-wide steps, 8 ahead, 4 warps —
    # the other tilings of that run and of the one before were slower). The "word" decode (fewer instructions and
    # registers per byte) is faster with more, smaller programs per multiprocessor: gate / up 4 warps and 2 steps
    # ahead (31.4 µs vs 37.4 with the older tiling), down 2 steps ahead (18.1 vs 21.6) at the bench model's shapes
    # (benchmarks/RESULTS.md, 2026-12-03, two passes in one session)
    bn = _largest_pow2_divisor(n, block_n or (16 if down else 8))
    bk = _largest_pow2_divisor(k, block_k or (256 if down else 512), SCALE_BLOCK)
    steps = k // bk
    pf_default = 2 if word else 8 if down else 4
    pf = min(steps, pf_default) if prefetch is None else max(0, min(prefetch, steps))
    if programs is not None and programs < 0:
        raise ValueError(f"programs must be >= 0 (0: one program per item), got {programs}")
    return dict(block_n=bn, block_k=bk, prefetch=pf, num_warps=num_warps or (4 if down or word else 8),
                num_stages=num_stages or 1, decode=decode, programs=int(programs or 0))


# how a K step's products are formed: "f16" each nibble's float16 bit pattern built alone, each byte's two products
# scaled and accumulated elementwise; "pair" both nibbles' patterns built at once in one 32-bit lane
# (``_e2m1_pair_f16``), products as "f16"; "pair_group" the pair decode with a 16-byte scale group's products summed
# first and scaled once (``_fp4_group_products``); "word" inline PTX over four packed bytes at a time
# (``_E2M1_WORD_PTX``). Per weight byte in the SASS of the gate / up kernel at the bench model's shape (compiled for
# sm_90 off the device): 17.9 / 14.4 / 13.3 / 8.9 instructions (word: 4 warps, 2 steps ahead; 10.2 at pair_group's
# tiling). "word" is the default: measured on an H200 (benchmarks/RESULTS.md, 2026-12-03) gate / up 31.4 µs and
# down 18.1 µs for six 2304 x 5120 experts against 44.8 / 22.5 for "pair_group" (1.36x; 51 % vs 38 % of the
# read-only bandwidth).
FP4_SLOT_DECODES = ("f16", "pair", "pair_group", "word")
FP4_SLOT_DEFAULT_DECODE = "word"  # read by ``quant_gemm``'s wrappers when a call names none


def _fp4_scale_mult(s):
    """e8m0 bytes -> float32 2^(s - 127 + 14) (the decoded codes carry 2^-14); bytes > 240 and 0xFF -> NaN."""
    si = s.astype(jnp.int32)
    m = jax.lax.bitcast_convert_type((si + 14) << 23, jnp.float32)
    return jnp.where(si > 240, jnp.float32(jnp.nan), m)


def _fp4_products(v, s, xe, xo):
    """[bn, g, 16] packed bytes, [bn, g] scale bytes, [g, 16] even / odd float32 activations -> the scaled products
    [bn, g, 16] float32 (element 2j of a group meets the low nibble of byte j, 2j+1 the high one)."""
    vi = v.astype(jnp.int32)
    lo = decode_e2m1_scaled(vi & 15).astype(jnp.float32)
    hi = decode_e2m1_scaled(vi >> 4).astype(jnp.float32)
    return (lo * xe[None] + hi * xo[None]) * _fp4_scale_mult(s)[:, :, None]


def _e2m1_pair_f16(v):
    """Packed e2m1 bytes -> (low, high) nibbles as float32 ``value * 2^-14`` (exact), both float16 bit patterns
    built at once in one 32-bit lane: t = b | b << 12 holds the low nibble at bits 0-3 and the high one at bits
    16-19, so ``(t << 9) & 0x0E000E00 | (t << 12) & 0x80008000`` is the pair's float16 patterns in the two 16-bit
    halves (magnitude bits to 9-11 / 25-27, sign bits to 15 / 31; the other nibble's copies fall outside the masks):
    one multiply, two shifts and one three-input logic op per byte instead of four shifts, masks and byte
    permutes."""
    b = v.astype(jnp.uint32)
    t = b * jnp.uint32(0x1001)
    pair = ((t << 9) & jnp.uint32(0x0E000E00)) | ((t << 12) & jnp.uint32(0x80008000))
    lo = jax.lax.bitcast_convert_type((pair & jnp.uint32(0xFFFF)).astype(jnp.uint16), jnp.float16)
    hi = jax.lax.bitcast_convert_type((pair >> 16).astype(jnp.uint16), jnp.float16)
    return lo.astype(jnp.float32), hi.astype(jnp.float32)


def _fp4_pair_products(v, s, xe, xo):
    """``_fp4_products`` with the pair decode (``_e2m1_pair_f16``): same exact products, scaled per byte."""
    lo, hi = _e2m1_pair_f16(v)
    return (lo * xe[None] + hi * xo[None]) * _fp4_scale_mult(s)[:, :, None]


def _fp4_group_products(v, s, xe, xo):
    """As ``_fp4_pair_products`` but summed over each 16-byte scale group before the scale is applied: [bn, g]
    float32 (one multiply per 32 weights instead of one per byte). Exact products; only the float32 summation order
    differs from the per-byte form."""
    lo, hi = _e2m1_pair_f16(v)
    return jnp.sum(lo * xe[None] + hi * xo[None], axis=2) * _fp4_scale_mult(s)


# The "word" decode: inline PTX over 32-bit words of four packed bytes (eight e2m1 codes). Each code becomes the high
# byte of its float16 pattern ``value * 2^-14`` (the ``decode_e2m1_scaled`` pattern: sign to bit 7, magnitude to
# bits 1-3, the low byte 0) for all four bytes at once — low nibbles ``(w << 1) & 0x0E0E0E0E | (w << 4) &
# 0x80808080``, high nibbles ``(w >> 3) & 0x0E0E0E0E | w & 0x80808080`` — then four byte permutes (``prmt``, a zero
# low byte under each) give four float16x2 registers, eight widenings to float32 and eight fused multiply-adds with
# the even / odd float32 activations sum the word's products; one more multiply-add adds ``scale x sum`` into the
# word's first accumulator lane (the other three pass through unchanged). 28 instructions per four bytes in the PTX
# against ≈ 13 per byte for "pair_group", whose Triton lowering handles every byte in its own 32-bit lane. Exact
# products (e2m1 x float32, power-of-two scales), float32 sums in another order.
_E2M1_WORD_PTX = """{
.reg .b32 w, a, b, lo, hi, p0, p1, p2, p3;
.reg .b16 h0, h1, h2, h3, h4, h5, h6, h7;
.reg .f32 f0, f1, f2, f3, f4, f5, f6, f7, s;
mov.b32 w, $4;
shl.b32 a, w, 1;
shl.b32 b, w, 4;
and.b32 b, b, 0x80808080;
and.b32 a, a, 0x0E0E0E0E;
or.b32 lo, a, b;
shr.u32 a, w, 3;
and.b32 b, w, 0x80808080;
and.b32 a, a, 0x0E0E0E0E;
or.b32 hi, a, b;
prmt.b32 p0, lo, 0, 0x1404;
prmt.b32 p1, lo, 0, 0x3424;
prmt.b32 p2, hi, 0, 0x1404;
prmt.b32 p3, hi, 0, 0x3424;
mov.b32 {h0, h1}, p0;
mov.b32 {h2, h3}, p1;
mov.b32 {h4, h5}, p2;
mov.b32 {h6, h7}, p3;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
cvt.f32.f16 f2, h2;
cvt.f32.f16 f3, h3;
cvt.f32.f16 f4, h4;
cvt.f32.f16 f5, h5;
cvt.f32.f16 f6, h6;
cvt.f32.f16 f7, h7;
mul.rn.f32 s, f0, $5;
fma.rn.f32 s, f4, $9, s;
fma.rn.f32 s, f1, $6, s;
fma.rn.f32 s, f5, $10, s;
fma.rn.f32 s, f2, $7, s;
fma.rn.f32 s, f6, $11, s;
fma.rn.f32 s, f3, $8, s;
fma.rn.f32 s, f7, $12, s;
fma.rn.f32 $0, s, $13, $17;
mov.b32 $1, $18;
mov.b32 $2, $19;
mov.b32 $3, $20;
}"""
# operands: $0-$3 the accumulator lanes out; $4 the word (four bytes); $5-$8 even and $9-$12 odd activations;
# $13-$16 the scale (one value: the word lies in one 16-byte scale group); $17-$20 the accumulator lanes in
_E2M1_WORD_CONSTRAINTS = "=f,=f,=f,=f,r," + ",".join(["f"] * 16)


def _fp4_word_accumulate(acc, v, s, xe, xo, interpret: bool = False):
    """[bn, g, 16] float32 accumulator + the scaled products of [bn, g, 16] packed bytes, [bn, g] scale bytes and
    [g, 16] even / odd float32 activations -> the new accumulator: each four-byte word's eight products summed, times
    the group's scale (``_fp4_scale_mult``), added to the word's first lane. On the GPU inline PTX
    (``_E2M1_WORD_PTX``); in interpret mode the same sums in JAX (the pair decode's exact values)."""
    bn, g, h = v.shape
    mult = jnp.broadcast_to(_fp4_scale_mult(s)[:, :, None], (bn, g, h))
    xe_b, xo_b = jnp.broadcast_to(xe[None], (bn, g, h)), jnp.broadcast_to(xo[None], (bn, g, h))
    if interpret:
        lo, hi = _e2m1_pair_f16(v)
        words = jnp.sum((lo * xe_b + hi * xo_b).reshape(bn, g, h // 4, 4), axis=3) * mult[:, :, ::4]
        first = (jnp.arange(h) % 4 == 0)[None, None, :]
        return acc + jnp.where(first, jnp.repeat(words, 4, axis=2), 0.0)
    return pltr.elementwise_inline_asm(_E2M1_WORD_PTX, args=[v, xe_b, xo_b, mult, acc],
                                       constraints=_E2M1_WORD_CONSTRAINTS, pack=4,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(acc.shape, jnp.float32)])[0]


def _slot_products(decode: str, bn: int, sg: int, interpret: bool = False):
    """The K step's accumulate function ``(acc, v, s, xe, xo) -> acc`` of a ``decode`` form and the shape of its
    float32 accumulator."""
    if decode == "word":
        return functools.partial(_fp4_word_accumulate, interpret=interpret), (bn, sg, FP4_HALF)
    prod, shape = {"f16": (_fp4_products, (bn, sg, FP4_HALF)), "pair": (_fp4_pair_products, (bn, sg, FP4_HALF)),
                   "pair_group": (_fp4_group_products, (bn, sg))}[decode]
    return (lambda acc, *ld: acc + prod(*ld)), shape


def _row_sums(acc):
    """[bn, sg(, 16)] float32 accumulator -> [bn] row sums."""
    if acc.ndim == 3:
        acc = jnp.sum(acc, axis=2)
    return jnp.sum(acc, axis=1)


def _even_odd_groups(a):
    """a [..., K] -> float32 (even, odd) elements as [..., K/32, 16] each."""
    a = a.astype(jnp.float32)
    lead, k = a.shape[:-1], a.shape[-1]
    pairs = a.reshape(lead + (k // 2, 2))
    return (pairs[..., 0].reshape(lead + (k // SCALE_BLOCK, FP4_HALF)),
            pairs[..., 1].reshape(lead + (k // SCALE_BLOCK, FP4_HALF)))


def _streamed(n_items, load, compute, state, pf):
    """``state = compute(state, load(i), i)`` for i < n_items, unrolled, the loads of item i + pf issued before
    item i is computed."""
    pending = [load(i) for i in range(min(pf, n_items))]
    for i in range(n_items):
        if i + pf < n_items:
            pending.append(load(i + pf))
        state = compute(state, pending[i], i)
        pending[i] = None
    return state


def _persistent_items(n_items, programs, steps, pf, coords, load, compute, init, finish):
    """A persistent program's walk over items ``p, p + P, p + 2P, ... < n_items`` (p this program, P =
    ``programs``). Per item: ``state = compute(state, load(c, i), i)`` over its ``steps`` K steps (unrolled) from
    ``init()``, then ``finish(state, c)``, with c = ``coords(item)``. The loads run ``pf`` steps ahead across item
    boundaries: while an item's last steps are computed the next item's first ones are in flight (carried through
    the item loop; past the program's last item they re-read its last item and are dropped), so a program pays one
    memory latency at its start instead of one per item, and items can be small (fine-grained items balance the
    work per multiprocessor). Why: with one program per item, each program's first loads stall it for a full
    memory round trip, and the last wave of programs leaves most multiprocessors idle."""
    p = pl.program_id(0)
    n_mine = (n_items - 1 - p) // programs + 1  # >= 1: the grid has at most n_items programs

    def item_coords(j):
        return coords(jnp.minimum(p + j * programs, n_items - 1))

    def body(j, pending):
        c, c_next = item_coords(j), item_coords(j + 1)
        pending = list(pending)
        state = init()
        for i in range(steps):
            if i + pf < steps:
                pending.append(load(c, i + pf))
            else:  # the next item's first steps
                pending.append(load(c_next, i + pf - steps))
            state = compute(state, pending[i], i)
            pending[i] = None
        finish(state, c)
        return tuple(pending[steps:])

    c0 = item_coords(0)
    jax.lax.fori_loop(0, n_mine, body, tuple(load(c0, i) for i in range(pf)))


def _check_slot_operands(what, values, scales, k):
    e, n, kh = values.shape
    if values.dtype != jnp.uint8 or kh * 2 != k or scales.dtype != jnp.uint8 or \
            tuple(scales.shape) != (e, n, k // SCALE_BLOCK):
        raise ValueError(f"{what}: values must be uint8 [E, N, {k // 2}] and scales uint8 [E, N, {k // SCALE_BLOCK}] "
                         f"for K = {k}, got {values.dtype} {tuple(values.shape)} / {scales.dtype} "
                         f"{tuple(scales.shape)}")


@functools.partial(jax.jit, static_argnames=("limit", "block_n", "block_k", "prefetch", "num_warps", "num_stages",
                                             "decode", "programs", "name", "interpret"))
def fp4_slot_swiglu(x, slot_expert, slot_wts, w1_values, w1_scales, w3_values, w3_scales, *, limit: float,
                    block_n: int | None = None, block_k: int | None = None, prefetch: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None, decode: str | None = None,
                    programs: int | None = None, name: str = "fp4_slot_swiglu", interpret: bool = False):
    """One token x [K] (bf16 / float32), its picks slot_expert int32 [S] and routing weights slot_wts float32 [S],
    stacked FP4 experts w1 / w3 (values uint8 [E, F, K/2], scales uint8 [E, F, K/32]) -> act [S, F] in x.dtype:
    ``silu(min(g, limit)) * clip(u, ±limit) * weight`` with g = x·w1[e]ᵀ, u = x·w3[e]ᵀ rounded to x.dtype."""
    (k,) = x.shape
    e, f, _ = w1_values.shape
    for nm, v, s in (("w1", w1_values, w1_scales), ("w3", w3_values, w3_scales)):
        _check_slot_operands(f"fp4_slot_swiglu {nm}", v, s, k)
    if tuple(w3_values.shape) != (e, f, k // 2):
        raise ValueError(f"fp4_slot_swiglu: w1 {tuple(w1_values.shape)} and w3 {tuple(w3_values.shape)} differ")
    s_n = slot_expert.shape[0]
    t = fp4_slot_tiling(f, k, block_n=block_n, block_k=block_k, prefetch=prefetch, num_warps=num_warps,
                        num_stages=num_stages, decode=decode, programs=programs)
    accum, acc_shape = _slot_products(t["decode"], t["block_n"], t["block_k"] // SCALE_BLOCK, interpret)
    bn, sg = t["block_n"], t["block_k"] // SCALE_BLOCK
    steps = k // t["block_k"]
    out_dtype = x.dtype
    view = (e, f, k // SCALE_BLOCK, FP4_HALF)
    xe, xo = _even_odd_groups(x)
    nb = f // bn
    persistent = t["programs"] > 0
    programs = min(t["programs"], s_n * nb)

    def epilogue(g, u, si, n0, wt_ref, o_ref):
        g = g.astype(out_dtype).astype(jnp.float32)
        u = u.astype(out_dtype).astype(jnp.float32)
        if limit > 0:
            u = jnp.clip(u, -limit, limit)
            g = jnp.minimum(g, limit)
        act = g / (1.0 + jnp.exp(-g)) * u * wt_ref[si]
        o_ref[si, pl.ds(n0, bn)] = act.astype(o_ref.dtype)

    def load_at(ex, n0, i):
        def ld(v1_ref, s1_ref, v3_ref, s3_ref, xe_ref, xo_ref):
            g0 = i * sg
            return (v1_ref[ex, pl.ds(n0, bn), pl.ds(g0, sg), :], s1_ref[ex, pl.ds(n0, bn), pl.ds(g0, sg)],
                    v3_ref[ex, pl.ds(n0, bn), pl.ds(g0, sg), :], s3_ref[ex, pl.ds(n0, bn), pl.ds(g0, sg)],
                    xe_ref[pl.ds(g0, sg), :], xo_ref[pl.ds(g0, sg), :])
        return ld

    def compute(accs, ld, i):
        v1, s1, v3, s3, xe_, xo_ = ld
        return accum(accs[0], v1, s1, xe_, xo_), accum(accs[1], v3, s3, xe_, xo_)

    def zeros():
        zero = jnp.zeros(acc_shape, jnp.float32)
        return zero, zero

    def kernel(se_ref, wt_ref, xe_ref, xo_ref, v1_ref, s1_ref, v3_ref, s3_ref, o_ref):
        refs = (v1_ref, s1_ref, v3_ref, s3_ref, xe_ref, xo_ref)
        if persistent:
            def coords(item):
                si = item // nb
                return si, se_ref[si], (item % nb) * bn

            def finish(accs, c):
                epilogue(_row_sums(accs[0]), _row_sums(accs[1]), c[0], c[2], wt_ref, o_ref)

            _persistent_items(s_n * nb, programs, steps, t["prefetch"], coords,
                              lambda c, i: load_at(c[1], c[2], i)(*refs), compute, zeros, finish)
            return
        si, ni = pl.program_id(0), pl.program_id(1)
        ex = se_ref[si]
        n0 = ni * bn
        a1, a3 = _streamed(steps, lambda i: load_at(ex, n0, i)(*refs), compute, zeros(), t["prefetch"])
        epilogue(_row_sums(a1), _row_sums(a3), si, n0, wt_ref, o_ref)

    return pl.pallas_call(
        kernel, grid=(programs,) if persistent else (s_n, nb), out_shape=jax.ShapeDtypeStruct((s_n, f), out_dtype),
        compiler_params=_params(t["num_warps"], t["num_stages"]), interpret=interpret, name=name,
    )(slot_expert.astype(jnp.int32), slot_wts.astype(jnp.float32), xe, xo, w1_values.reshape(view), w1_scales,
      w3_values.reshape(view), w3_scales)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "prefetch", "num_warps", "num_stages", "decode",
                                             "programs", "name", "interpret"))
def fp4_slot_down(act, slot_expert, w2_values, w2_scales, *, block_n: int | None = None, block_k: int | None = None,
                  prefetch: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  decode: str | None = None, programs: int | None = None, name: str = "fp4_slot_down",
                  interpret: bool = False):
    """act [S, F] (bf16 / float32; slot s's activations), slot_expert int32 [S], stacked FP4 experts w2 (values
    uint8 [E, D, F/2], scales uint8 [E, D, F/32]) -> y [D] float32 = sum over the slots of act[s]·w2[e_s]ᵀ, each
    slot's product rounded to act.dtype first (as the grouped path's per-row outputs).

    Grid (slot, column block), as ``fp4_slot_swiglu``: each program streams one picked expert's ``block_n`` rows;
    the [S, D] float32 slot outputs are summed by one small XLA reduction. (A first version ran every slot in one
    program per column block — 640 programs each streaming 54 K steps of 1 KB one after another — and took 92 µs
    per call in the bench model's decode step on an H200, 0.41 TB/s, 2.4x the grouped kernel's w2.)"""
    s_n, f = act.shape
    e, d, _ = w2_values.shape
    _check_slot_operands("fp4_slot_down w2", w2_values, w2_scales, f)
    t = fp4_slot_tiling(d, f, block_n=block_n, block_k=block_k, prefetch=prefetch, num_warps=num_warps,
                        num_stages=num_stages, decode=decode, programs=programs, down=True)
    accum, acc_shape = _slot_products(t["decode"], t["block_n"], t["block_k"] // SCALE_BLOCK, interpret)
    bn, sg = t["block_n"], t["block_k"] // SCALE_BLOCK
    steps = f // t["block_k"]
    round_dtype = act.dtype
    ae, ao = _even_odd_groups(act)

    nb = d // bn
    persistent = t["programs"] > 0
    programs = min(t["programs"], s_n * nb)

    def compute(acc, ld, i):
        return accum(acc, *ld)

    def zeros():
        return jnp.zeros(acc_shape, jnp.float32)

    def kernel(se_ref, ae_ref, ao_ref, v_ref, s_ref, o_ref):
        def load(si, ex, n0, i):
            g0 = i * sg
            return (v_ref[ex, pl.ds(n0, bn), pl.ds(g0, sg), :], s_ref[ex, pl.ds(n0, bn), pl.ds(g0, sg)],
                    ae_ref[si, pl.ds(g0, sg), :], ao_ref[si, pl.ds(g0, sg), :])

        def part(acc):
            return _row_sums(acc).astype(round_dtype).astype(jnp.float32)

        if persistent:
            def coords(item):
                si = item // nb
                return si, se_ref[si], (item % nb) * bn

            def finish(acc, c):
                o_ref[c[0], pl.ds(c[2], bn)] = part(acc)

            _persistent_items(s_n * nb, programs, steps, t["prefetch"], coords, lambda c, i: load(*c, i), compute,
                              zeros, finish)
            return
        si, ni = pl.program_id(0), pl.program_id(1)
        ex = se_ref[si]
        n0 = ni * bn
        acc = _streamed(steps, lambda i: load(si, ex, n0, i), compute, zeros(), t["prefetch"])
        o_ref[si, pl.ds(n0, bn)] = part(acc)

    parts = pl.pallas_call(
        kernel, grid=(programs,) if persistent else (s_n, nb), out_shape=jax.ShapeDtypeStruct((s_n, d), jnp.float32),
        compiler_params=_params(t["num_warps"], t["num_stages"]), interpret=interpret, name=name,
    )(slot_expert.astype(jnp.int32), ae, ao, w2_values.reshape(e, d, f // SCALE_BLOCK, FP4_HALF), w2_scales)
    return jnp.sum(parts, axis=0)


# ----------------------------------------------------------------------------------------------------------------
# Every expert on every token (decode batches): the routed experts without sort, tile table or scatter
# ----------------------------------------------------------------------------------------------------------------
# At a decode batch (2-64 tokens) the grouped kernel needs XLA around it to sort the assignments by expert, count
# them, build its tile table and scatter the rows back (≈ 7 launches a layer in the 40-layer bench model's batch-32
# step, benchmarks/RESULTS.md), and its tiles are ragged (an expert's handful of rows, 16-row token tiles). Here every
# expert takes the whole batch as its token tile — the bf16 path's ``inference.moe._routed_every_expert`` for the
# packed FP4 experts: ``fp4_every_swiglu`` (grid expert x column block) streams expert e's w1 and w3 rows once, one
# tensor-core product per K step each with the dequantised weight tile as the row side (the grouped kernel's
# "weights" form and bf16x2 decode) and all M tokens as the columns, and applies the clamped SwiGLU and the token's
# dense routing weight for e in its epilogue (exact 0 where the token did not pick e); ``fp4_every_down`` streams
# w2 the same way and adds each expert's products, rounded to the activations' dtype, into the float32 [M, D]
# output (atomic adds: the experts' sum in no fixed order, as the grouped path's scatter-add on a GPU). An expert no
# token picked (``used[e] = 0``) is not read: its programs write zeros (gate / up) or nothing (down), so the bytes
# read are those of the picked experts, as the grouped kernel's. Measured on an H200 (benchmarks/RESULTS.md,
# 2026-12-03 18:00 UTC; 32 tokens, 16 experts of 2304 x 5120): gate / up 153 µs (29 % of the read-only bandwidth),
# down 66 µs (34 %) against the grouped kernel's 125 / 54 µs (36 / 41 %); 32-row blocks, 8 warps or 128-wide K steps
# were slower still. Each gate / up program carries two weight streams and two accumulators.
EVERY_EXPERT_MAX_TOKENS = 64  # one token tile of at most 64 columns per program

_FP8_AMAX_FLOOR = 1e-4  # ops.quant's constants (float32 when used with float32 values)
_INV_448 = 1.0 / 448.0


def fp8_round_groups(v, axis: int):
    """The release's GEMM-input rounding (``ops.quant.fake_quant_gemm_input_fp8``, 32-value blocks) of float32
    values ``v`` whose ``axis`` is one 32-value block, in operations the Pallas Triton lowering takes (a kernel's
    epilogue rounds its output for the next GEMM with it) -> float32, bit for bit ``ops.quant``'s values: the scale
    2^k with k = ceil(log2(max(amax, 1e-4) / 448)) read off the float32 bits, q = clip(v / 2^k, ±448) converted to
    e4m3 (nearest-even) and back, times 2^k; a block holding an inf or NaN gives NaN (the reference's scale is inf
    there). Flags for inf / NaN are taken apart from the maximum, so NaN need not propagate through it."""
    a = jnp.abs(v)
    amax = jnp.max(a, axis=axis, keepdims=True)
    bad = jnp.max(jnp.where(a < jnp.float32(jnp.inf), 0, 1), axis=axis, keepdims=True) > 0
    t = jnp.maximum(amax, jnp.float32(_FP8_AMAX_FLOOR)) * jnp.float32(_INV_448)
    b = jax.lax.bitcast_convert_type(t, jnp.int32)  # t > 0: the sign bit is 0
    k = ((b >> 23) & 0xFF) - 127 + ((b & 0x7FFFFF) != 0).astype(jnp.int32)  # in [-22, 120] for finite blocks
    k = jnp.where(bad, 0, k)
    down = jax.lax.bitcast_convert_type((127 - k) << 23, jnp.float32)
    up = jax.lax.bitcast_convert_type((127 + k) << 23, jnp.float32)
    q = jnp.clip(v * down, -448.0, 448.0)
    y = q.astype(jnp.float8_e4m3fn).astype(jnp.float32) * up
    return jnp.where(bad, jnp.float32(jnp.nan), y)


def fp4_every_tiling(n: int, k: int, *, block_n: int | None = None, block_k: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None) -> dict:
    """Tiling of the every-expert kernels for [n, k] expert matrices (any argument given overrides its default):
    block_n weight rows per program (a power of two times 16 dividing n: the product's row side) and block_k values
    per K step (a power of two times 32 dividing k) — the kernels have no tail masking; defaults the grouped
    kernel's weights form (64 / 256, 4 warps, 3 stages)."""
    if n % 16 or k % SCALE_BLOCK:
        raise ValueError(f"the every-expert kernels need N a multiple of 16 and K of {SCALE_BLOCK}, got N {n}, K {k}")
    return dict(block_n=_largest_pow2_divisor(n, block_n or 64, 16),
                block_k=_largest_pow2_divisor(k, block_k or 256, SCALE_BLOCK), num_warps=num_warps or 4,
                num_stages=num_stages or 3)


def _every_rows(m: int):
    """The token tile (columns of each program's product) for m tokens, and whether rows need masking."""
    if not 1 <= m <= EVERY_EXPERT_MAX_TOKENS:
        raise ValueError(f"the every-expert kernels take 1..{EVERY_EXPERT_MAX_TOKENS} tokens, got {m}")
    bm = max(16, _pow2(m))
    return bm, bm != m


def _even_odd_columns(a, dot_dtype):
    """a [..., K] -> the activations of the low / high nibbles [..., K/2] each, in the dot dtype."""
    pairs = a.astype(dot_dtype).reshape(a.shape[:-1] + (a.shape[-1] // 2, 2))
    return pairs[..., 0], pairs[..., 1]


@functools.partial(jax.jit, static_argnames=("limit", "round_fp8", "block_n", "block_k", "num_warps", "num_stages",
                                             "name", "interpret"))
def fp4_every_swiglu(x, wts, used, w1_values, w1_scales, w3_values, w3_scales, *, limit: float,
                     round_fp8: bool = False, block_n: int | None = None, block_k: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None, name: str = "fp4_every_swiglu",
                     interpret: bool = False):
    """x [M, K] (bf16 / float32, M <= ``EVERY_EXPERT_MAX_TOKENS``), wts float32 [E, M] (token t's routing weight for
    expert e, 0 where it did not pick it), used int32 [E] (0: expert e is not read), stacked FP4 experts w1 / w3
    (values uint8 [E, F, K/2], scales uint8 [E, F, K/32]) -> act [E, M, F] in x.dtype: ``silu(min(g, limit)) *
    clip(u, ±limit) * wts[e, t]`` with g = x·w1[e]ᵀ, u = x·w3[e]ᵀ rounded to x.dtype; exactly 0 where
    wts[e, t] = 0 and for unused experts. ``round_fp8``: the activations then rounded as the down projection's input
    (``fp8_round_groups`` over each 32 of F, after the rounding to x.dtype) in the epilogue — no XLA rounding
    kernels between the two GEMMs; needs block_n a multiple of 32."""
    m, k = x.shape
    e, f, _ = w1_values.shape
    for nm, v, s in (("w1", w1_values, w1_scales), ("w3", w3_values, w3_scales)):
        _check_slot_operands(f"fp4_every_swiglu {nm}", v, s, k)
    if tuple(w3_values.shape) != tuple(w1_values.shape):
        raise ValueError(f"fp4_every_swiglu: w1 {tuple(w1_values.shape)} and w3 {tuple(w3_values.shape)} differ")
    if tuple(wts.shape) != (e, m) or tuple(used.shape) != (e,):
        raise ValueError(f"fp4_every_swiglu: wts must be [E, M] = {(e, m)} and used [E], got {tuple(wts.shape)} / "
                         f"{tuple(used.shape)}")
    t = fp4_every_tiling(f, k, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    bn, bk = t["block_n"], t["block_k"]
    if round_fp8 and bn % SCALE_BLOCK:
        raise ValueError(f"round_fp8 needs block_n a multiple of {SCALE_BLOCK} (whole rounding blocks), got {bn}")
    bkh, sg = bk // 2, bk // SCALE_BLOCK
    bm, row_mask = _every_rows(m)
    out_dtype = x.dtype
    dot_dtype = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16
    xe, xo = _even_odd_columns(x, dot_dtype)
    steps = k // bk

    def kernel(u_ref, w_ref, xe_ref, xo_ref, v1_ref, s1_ref, v3_ref, s3_ref, o_ref):
        ex, ni = pl.program_id(0), pl.program_id(1)
        rows = jnp.arange(bm)
        rmask = rows < m
        rows_c = jnp.minimum(rows, m - 1)
        cols = ni * bn + jnp.arange(bn)
        out_mask = jnp.broadcast_to(rmask[None, :], (bn, bm))

        def tokens(ref, t_):
            if not row_mask:
                return ref[:, pl.ds(t_ * bkh, bkh)]
            cb = t_ * bkh + jnp.arange(bkh)
            return pltr.load(ref.at[rows_c[:, None], cb[None, :]],
                             mask=jnp.broadcast_to(rmask[:, None], (bm, bkh)), other=0)

        def compute(t_, accs):
            xe_t, xo_t = tokens(xe_ref, t_), tokens(xo_ref, t_)
            new = []
            for acc, v_ref, s_ref in zip(accs, (v1_ref, v3_ref), (s1_ref, s3_ref)):
                v = v_ref[ex, pl.ds(ni * bn, bn), pl.ds(t_ * bkh, bkh)]
                s = s_ref[ex, pl.ds(ni * bn, bn), pl.ds(t_ * sg, sg)]
                lo, hi = _fp4_weight_tile(v, s, "bf16x2", dot_dtype, interpret)
                new.append(acc + _dot_nt(lo, xe_t) + _dot_nt(hi, xo_t))
            return tuple(new)

        @pl.when(u_ref[ex] > 0)
        def _():
            zero = jnp.zeros((bn, bm), jnp.float32)
            a1, a3 = jax.lax.fori_loop(0, steps, compute, (zero, zero))
            g = a1.astype(out_dtype).astype(jnp.float32)  # as the grouped kernel returns gate / up
            u = a3.astype(out_dtype).astype(jnp.float32)
            if limit > 0:
                u = jnp.clip(u, -limit, limit)
                g = jnp.minimum(g, limit)
            wt = pltr.load(w_ref.at[ex, rows_c], mask=rmask, other=0.0)[None, :]
            # a token that did not pick e (weight 0) gets 0, not silu · u · 0: an overflowed activation there would
            # reach its sum as NaN
            act = jnp.where(wt != 0, g / (1.0 + jnp.exp(-g)) * u * wt, 0.0)
            if round_fp8:  # rows of act are F: [bn / 32, 32, tokens] blocks of the next GEMM's rounding
                act = act.astype(out_dtype).astype(jnp.float32).reshape(bn // SCALE_BLOCK, SCALE_BLOCK, bm)
                act = fp8_round_groups(act, axis=1).reshape(bn, bm)
            # acc[j, i] is act[e, token i, column j]: stored through transposed indices
            pltr.store(o_ref.at[ex, rows[None, :], cols[:, None]], act.astype(out_dtype), mask=out_mask)

        @pl.when(u_ref[ex] == 0)
        def _():
            pltr.store(o_ref.at[ex, rows[None, :], cols[:, None]], jnp.zeros((bn, bm), out_dtype), mask=out_mask)

    return pl.pallas_call(
        kernel, grid=(e, f // bn), out_shape=jax.ShapeDtypeStruct((e, m, f), out_dtype),
        compiler_params=_params(t["num_warps"], t["num_stages"]), interpret=interpret, name=name,
    )(used.astype(jnp.int32), wts.astype(jnp.float32), xe, xo, w1_values, w1_scales, w3_values, w3_scales)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_warps", "num_stages", "name", "interpret"))
def fp4_every_down(act, used, w2_values, w2_scales, *, block_n: int | None = None, block_k: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None, name: str = "fp4_every_down",
                   interpret: bool = False):
    """act [E, M, F] (bf16 / float32; expert e's activations of every token), used int32 [E], stacked FP4 experts
    w2 (values uint8 [E, D, F/2], scales uint8 [E, D, F/32]) -> y [M, D] float32 = the sum over the used experts of
    act[e]·w2[e]ᵀ, each expert's product rounded to act.dtype first (as the grouped path's per-row outputs)."""
    e, m, f = act.shape
    _, d, _ = w2_values.shape
    _check_slot_operands("fp4_every_down w2", w2_values, w2_scales, f)
    if w2_values.shape[0] != e or tuple(used.shape) != (e,):
        raise ValueError(f"fp4_every_down: act has {e} experts, w2 {w2_values.shape[0]}, used {tuple(used.shape)}")
    t = fp4_every_tiling(d, f, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    bn, bk = t["block_n"], t["block_k"]
    bkh, sg = bk // 2, bk // SCALE_BLOCK
    bm, row_mask = _every_rows(m)
    round_dtype = act.dtype
    dot_dtype = jnp.float32 if act.dtype == jnp.float32 else jnp.bfloat16
    ae, ao = _even_odd_columns(act, dot_dtype)
    steps = f // bk

    def kernel(u_ref, ae_ref, ao_ref, v_ref, s_ref, _zeros_ref, o_ref):
        ex, ni = pl.program_id(0), pl.program_id(1)
        rows = jnp.arange(bm)
        rmask = rows < m
        rows_c = jnp.minimum(rows, m - 1)
        cols = ni * bn + jnp.arange(bn)

        def tokens(ref, t_):
            if not row_mask:
                return ref[ex, :, pl.ds(t_ * bkh, bkh)]
            cb = t_ * bkh + jnp.arange(bkh)
            return pltr.load(ref.at[ex, rows_c[:, None], cb[None, :]],
                             mask=jnp.broadcast_to(rmask[:, None], (bm, bkh)), other=0)

        def compute(t_, acc):
            v = v_ref[ex, pl.ds(ni * bn, bn), pl.ds(t_ * bkh, bkh)]
            s = s_ref[ex, pl.ds(ni * bn, bn), pl.ds(t_ * sg, sg)]
            lo, hi = _fp4_weight_tile(v, s, "bf16x2", dot_dtype, interpret)
            return acc + _dot_nt(lo, tokens(ae_ref, t_)) + _dot_nt(hi, tokens(ao_ref, t_))

        @pl.when(u_ref[ex] > 0)
        def _():
            acc = jax.lax.fori_loop(0, steps, compute, jnp.zeros((bn, bm), jnp.float32))
            part = acc.astype(round_dtype).astype(jnp.float32)
            # the output has the tile's bm rows (rows past M add the zeros of their masked activations): unmasked
            # adds, which interpret mode can run too
            pltr.atomic_add(o_ref, (rows[None, :], cols[:, None]), part)

    out = pl.pallas_call(
        kernel, grid=(e, d // bn), out_shape=jax.ShapeDtypeStruct((bm, d), jnp.float32),
        input_output_aliases={5: 0}, compiler_params=_params(t["num_warps"], t["num_stages"]), interpret=interpret,
        name=name,
    )(used.astype(jnp.int32), ae, ao, w2_values, w2_scales, jnp.zeros((bm, d), jnp.float32))
    return out[:m] if row_mask else out


# ----------------------------------------------------------------------------------------------------------------
# The GEMM-input FP8 rounding as one kernel
# ----------------------------------------------------------------------------------------------------------------
# XLA compiles ``ops.quant.fake_quant_gemm_input_fp8`` (amax per 32, then scale / round / rescale) into two kernels —
# the block amax (a reduction) and the rounding that reads it — because it does not fuse a reduction with the
# elementwise ops that consume it when those use bit casts (benchmarks/RESULTS.md, 2026-12-03: 2.86 µs per rounding at
# the batch-32 decode step, 7 roundings a layer). Here one program rounds a [32-value groups x 32] tile of one row
# in registers (``fp8_round_groups``); ``split`` writes the even / odd columns as two arrays, the activation layout
# of the FP4 kernels' weights-as-rows forms, so that split costs no kernel of its own either.
ROUND_GROUPS_PER_PROGRAM = 32


@functools.partial(jax.jit, static_argnames=("split", "groups", "num_warps", "name", "interpret"))
def fp8_round_rows(x, *, split: bool = False, groups: int | None = None, num_warps: int | None = None,
                   name: str = "fp8_round_rows", interpret: bool = False):
    """x [R, K] (bf16 / float32, K a multiple of 32) -> the release's GEMM-input rounding of every row
    (``ops.quant.fake_quant_gemm_input_fp8(x, 32)``: the same values bit for bit, in x.dtype), one kernel; with
    ``split`` the (even, odd) columns [R, K/2] each instead. Grid (row, group block): ``groups`` 32-value groups per
    program (the largest power of two up to ``ROUND_GROUPS_PER_PROGRAM`` dividing K / 32)."""
    r, k = x.shape
    if k % SCALE_BLOCK:
        raise ValueError(f"fp8_round_rows: K = {k} is not a multiple of the rounding block {SCALE_BLOCK}")
    kg = k // SCALE_BLOCK
    gb = _largest_pow2_divisor(kg, groups or ROUND_GROUPS_PER_PROGRAM)
    dtype = x.dtype
    half = SCALE_BLOCK // 2

    def kernel(x_ref, *o_refs):
        ri, gi = pl.program_id(0), pl.program_id(1)
        v = x_ref[ri, pl.ds(gi * gb, gb), :].astype(jnp.float32)  # [gb, 32]: whole rounding blocks
        y = fp8_round_groups(v, axis=1).astype(dtype)
        if not split:
            o_refs[0][ri, pl.ds(gi * gb, gb), :] = y
            return
        ev, od = jax.lax.unstack(y.reshape(gb, half, 2), axis=2)
        o_refs[0][ri, pl.ds(gi * gb, gb), :] = ev
        o_refs[1][ri, pl.ds(gi * gb, gb), :] = od

    shapes = ((jax.ShapeDtypeStruct((r, kg, half), dtype),) * 2 if split
              else (jax.ShapeDtypeStruct((r, kg, SCALE_BLOCK), dtype),))
    outs = pl.pallas_call(
        kernel, grid=(r, kg // gb), out_shape=shapes, compiler_params=_params(num_warps or 4, 1),
        interpret=interpret, name=name,
    )(x.reshape(r, kg, SCALE_BLOCK))
    if split:
        return tuple(o.reshape(r, k // 2) for o in outs)
    return outs[0].reshape(r, k)
