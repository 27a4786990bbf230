"""Pallas GPU kernels (Triton lowering) for GEMMs that read the release's quantised weights directly.

* ``fp8_gemm``: ``x [M, K] · w [N, K]ᵀ`` with ``w`` e4m3 bytes and one e8m0 scale per 32 x 32 block. Grid
  (row block, column block, K split). Each program streams its ``block_n`` weight rows through the K loop in
  ``block_k``-wide tiles: the tile's bytes are converted e4m3 -> float32 in registers, multiplied by their block
  scale (a [block_k] vector of multipliers per 32 weight rows, gathered from the few scale bytes), cast to the dot
  dtype (exact: <= 4 significant bits times a power of two) and multiplied with the activations on the tensor
  cores, float32 accumulation. Decode shapes (M <= 64, N a few thousand) give too few column blocks to fill the
  132 multiprocessors, so K is split and the float32 partial sums are added in XLA.
* ``fp4_grouped_gemm``: rows sorted by expert (``group_sizes``), ``w [E, N, K/2]`` two e2m1 codes per byte
  (element 2j in the low nibble, 2j+1 in the high one, as ``checkpoint.quantized``) and one e8m0 scale per 32 along
  K. Grid (row tile, column block): each row tile belongs to one expert (tile metadata from XLA: expert, first row,
  row count; at most ``ceil(rows / block_m) + min(E, rows)`` tiles, those past the real ones do nothing), so an
  expert that received no rows is never read. Per 32-value K chunk (16 packed bytes, one scale) the codes are
  decoded in registers: ``sign << 15 | magnitude << 9`` is the float16 bit pattern of ``value * 2^-14`` (the e2m1
  exponent lands in float16's, magnitude 1 becomes the float16 subnormal 2^-15), exact in the dot dtype; the
  activations are split into even / odd columns by XLA so low and high nibbles each meet their own input column,
  and the chunk's scale x 2^14 multiplies the [block_m, block_n] partial product (as two normal float32 powers of
  two, so every scale byte is exact).

Scales: e8m0 byte b -> 2^(b - 127) built from the exponent bits, 0xFF -> NaN, as ``checkpoint.quantized``. In the
FP8 kernel the dequantised weight ``value * 2^(b - 127)`` is exact while it is a normal float32, i.e. for scale
bytes >= 10 — every scale a quantiser writes for real weights is far above.

Measured on the H200 (benchmarks/RESULTS.md): correct, faster than the plain-JAX dequantise-then-GEMM path, but far
from the bandwidth goal (FP8 dense <= 22 % of the copy bandwidth, FP4 grouped <= 16 %); this layout (two e2m1
nibbles per byte, scales per 32 values) is decoded on the CUDA cores, and where the time goes is not yet profiled.
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


def _exp2_f32(e):
    """2.0 ** e (int32 tensor, |e| <= 126) as float32, built from the exponent bits (exact, never subnormal)."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def scale_factor(part, s_byte, extra_exp: int = 0):
    """``part * 2^(s_byte - 127 + extra_exp)`` for e8m0 bytes (NaN for 0xFF), as two normal powers of two."""
    t = s_byte.astype(jnp.int32) - 127 + extra_exp
    lo = t >> 1  # floor(t / 2) (arithmetic shift)
    out = part * _exp2_f32(lo) * _exp2_f32(t - lo)
    return jnp.where(s_byte.astype(jnp.int32) == 255, jnp.float32(jnp.nan), out)


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


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages",
                                             "interpret"))
def fp8_gemm(x, values, scales, *, block_m: int | None = None, block_n: int = 32, block_k: int = 256,
             split_k: int | None = None, num_warps: int = 4, num_stages: int = 4, interpret: bool = False):
    """x [M, K] (bf16 / f32), values uint8 e4m3 bytes [N, K], scales uint8 [ceil(N/32), ceil(K/32)] -> [M, N]
    x.dtype."""
    m, k = x.shape
    n = values.shape[0]
    bm = block_m or min(64, max(16, _pow2(m)))
    mp = -(-m // bm) * bm
    bk = max(SCALE_BLOCK, min(block_k, _pow2(k)))
    bn = block_n
    if bk % SCALE_BLOCK or bn % SCALE_BLOCK:
        raise ValueError(f"block_k {bk} and block_n {bn} must be multiples of {SCALE_BLOCK}")
    n_kb = -(-k // bk)
    kp = n_kb * bk
    dot_dtype = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16
    xp = jnp.pad(x.astype(dot_dtype), ((0, mp - m), (0, kp - k)))  # zero K tail: masked weight columns add 0
    nm, nn = mp // bm, -(-n // bn)
    if split_k is None:  # enough programs for two waves over 132 multiprocessors, at least 4 K blocks each
        split_k = max(1, min(n_kb // 4, -(-264 // (nm * nn))))
    split_k = max(1, min(split_k, n_kb))
    kb_per = -(-n_kb // split_k)
    tails = k % bk != 0 or n % bn != 0
    ks, ns = scales.shape
    groups = bn // SCALE_BLOCK

    def kernel(x_ref, v_ref, s_ref, o_ref):
        mi, ni, si = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        rows = ni * bn + jnp.arange(bn)
        rmask = rows < n
        rows_c = jnp.minimum(rows, n - 1)
        local = jnp.arange(bn)[:, None]

        def body(t, acc):
            k0 = (si * kb_per + t) * bk
            cols = k0 + jnp.arange(bk)
            if tails:
                w = pltr.load(v_ref.at[rows_c[:, None], jnp.minimum(cols, k - 1)[None, :]],
                              mask=rmask[:, None] & (cols < k)[None, :], other=0)
            else:
                w = v_ref[pl.ds(ni * bn, bn), pl.ds(k0, bk)]
            scol = jnp.minimum(cols // SCALE_BLOCK, ns - 1)
            # one scale row per 32 weight rows: [bk] multipliers per row group, selected by row
            mult = None
            for g in range(groups):
                srow = jnp.minimum(ni * groups + g, ks - 1)
                mg = _e8m0_mult(pltr.load(s_ref.at[srow, scol]))[None, :]
                mult = mg if mult is None else jnp.where(local >= g * SCALE_BLOCK, mg, mult)
            w = jax.lax.bitcast_convert_type(w, jnp.float8_e4m3fn)  # loaded as bytes (a masked fp8 load cannot lower)
            wd = (w.astype(jnp.float32) * mult).astype(dot_dtype)  # exact: e4m3 x 2^k
            xc = x_ref[pl.ds(mi * bm, bm), pl.ds(k0, bk)]
            return acc + _dot_nt(xc, wd)

        start = si * kb_per
        steps = jnp.clip(n_kb - start, 0, kb_per)
        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
        o_ref[si, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)] = acc

    out = pl.pallas_call(
        kernel, grid=(nm, nn, split_k),
        out_shape=jax.ShapeDtypeStruct((split_k, mp, nn * bn), jnp.float32),
        compiler_params=_params(num_warps, num_stages), interpret=interpret, name="fp8_block_gemm",
    )(xp, values, scales)
    y = out[0] if split_k == 1 else jnp.sum(out, axis=0)
    return y[:m, :n].astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Grouped FP4 (routed experts)
# ----------------------------------------------------------------------------------------------------------------

def tile_metadata(group_sizes, n_rows: int, block_m: int):
    """Row tiles of ``block_m`` rows that each lie inside one group (rows sorted by group).

    -> (tile_group, tile_row0, tile_rows) int32 [T] with T = ceil(n_rows / block_m) + min(n_groups, n_rows) (a
    static bound: at most n_rows groups are non-empty); tiles past the real ones have ``tile_rows == 0``. Empty
    groups get no tile."""
    g = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    tiles = (gs + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    row_start = jnp.cumsum(gs) - gs
    t_max = -(-n_rows // block_m) + min(g, n_rows)
    t = jnp.arange(t_max, dtype=jnp.int32)
    # a comparison count, not jnp.searchsorted's default scan: no loop in the XLA program around the kernel
    grp = jnp.clip(jnp.searchsorted(tile_end, t, side="right", method="compare_all"), 0, g - 1).astype(jnp.int32)
    r0 = row_start[grp] + (t - tile_start[grp]) * block_m
    nr = jnp.clip(row_start[grp] + gs[grp] - r0, 0, block_m)
    nr = jnp.where(t < tile_end[-1], nr, 0)
    return grp, jnp.where(nr > 0, r0, 0).astype(jnp.int32), nr.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def fp4_grouped_gemm(x, group_sizes, values, scales, *, block_m: int | None = None, block_n: int = 64,
                     block_k: int = 64, num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
    """x [A, K] rows sorted by group; group_sizes [E] (sum <= A; rows past the sum give 0); values uint8
    [E, N, K/2]; scales uint8 [E, N, K/32] -> [A, N] in x.dtype."""
    a, k = x.shape
    e, n, kh = values.shape
    bm = block_m or (16 if a <= 1024 else 64)  # decode: an expert holds <= M rows, mostly a handful
    bk = max(SCALE_BLOCK, min(block_k, _pow2(k)))  # values per K step (bk / 2 packed bytes)
    assert bk % SCALE_BLOCK == 0 and k % SCALE_BLOCK == 0
    bn = block_n
    dot_dtype = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16
    xd = x.astype(dot_dtype)
    x_even, x_odd = xd[:, 0::2], xd[:, 1::2]  # element 2j meets the low nibble of byte j, 2j+1 the high one
    grp, r0s, nrs = tile_metadata(group_sizes, a, bm)
    t_max = grp.shape[0]
    n_steps = -(-k // bk)
    k_tail = k % bk != 0
    hb = SCALE_BLOCK // 2  # packed bytes per scale

    def kernel(g_ref, r0_ref, nr_ref, xe_ref, xo_ref, v_ref, s_ref, o_ref):
        ti, ni = pl.program_id(0), pl.program_id(1)
        ex, r0, nr = g_ref[ti], r0_ref[ti], nr_ref[ti]

        @pl.when(nr > 0)
        def _():
            rows = r0 + jnp.arange(bm)
            rmask = jnp.arange(bm) < nr
            rows_c = jnp.minimum(rows, a - 1)
            cols_n = ni * bn + jnp.arange(bn)
            nmask = cols_n < n
            cols_nc = jnp.minimum(cols_n, n - 1)

            def body(t, acc):
                for j in range(bk // SCALE_BLOCK):
                    b0 = t * (bk // 2) + j * hb  # first packed byte of this scale block
                    cb = b0 + jnp.arange(hb)
                    cmask = cb < kh
                    cbc = jnp.minimum(cb, kh - 1)
                    wmask = nmask[:, None] & cmask[None, :]
                    v = pltr.load(v_ref.at[ex, cols_nc[:, None], cbc[None, :]], mask=wmask, other=0)
                    v = v.astype(jnp.int32)
                    lo = decode_e2m1_scaled(v & 15).astype(dot_dtype)  # [bn, 16]
                    hi = decode_e2m1_scaled(v >> 4).astype(dot_dtype)
                    xmask = rmask[:, None] & cmask[None, :]
                    xe = pltr.load(xe_ref.at[rows_c[:, None], cbc[None, :]], mask=xmask, other=0)
                    xo = pltr.load(xo_ref.at[rows_c[:, None], cbc[None, :]], mask=xmask, other=0)
                    part = _dot_nt(xe, lo) + _dot_nt(xo, hi)  # [bm, bn] x (value * 2^-14)
                    sc = pltr.load(s_ref.at[ex, cols_nc, jnp.minimum(b0 // hb, k // SCALE_BLOCK - 1)])  # [bn]
                    acc = acc + scale_factor(part, sc[None, :], 14)
                return acc

            acc = jax.lax.fori_loop(0, n_steps, body, jnp.zeros((bm, bn), jnp.float32))
            # unclamped (distinct) indices: masked lanes must not alias a written element
            pltr.store(o_ref.at[rows[:, None], cols_n[None, :]], acc.astype(o_ref.dtype),
                       mask=rmask[:, None] & nmask[None, :])

    out = pl.pallas_call(
        kernel, grid=(t_max, -(-n // bn)),
        out_shape=jax.ShapeDtypeStruct((a, n), x.dtype),
        compiler_params=_params(num_warps, num_stages), interpret=interpret, name="fp4_grouped_gemm",
    )(grp, r0s, nrs, x_even, x_odd, values, scales)
    # rows that no tile covers (past sum(group_sizes)) are left unwritten by the kernel: define them as 0
    covered = jnp.arange(a) < jnp.sum(group_sizes)
    return jnp.where(covered[:, None], out, jnp.zeros((), out.dtype))
