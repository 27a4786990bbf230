"""Pallas TPU (Mosaic) kernels for GEMMs that read the release's quantised weights directly.

The weights arrive in VMEM as their stored bytes (uint8 blocks through the BlockSpec pipeline) and are dequantised
in the kernel on the vector unit with integer arithmetic (no float8 support needed from the chip):

* e4m3 byte -> float32: sign, exponent and mantissa fields moved into float32's bit positions (exponent + 120),
  subnormals (exponent field 0) as ``mantissa * 2^-9``, 0x7F / 0xFF -> NaN;
* e2m1 code -> float32: the same with exponent + 126, magnitude 1 -> 0.5, 0 -> 0.

Scales are per block of 32 along K (and 32 along N for the FP8 32 x 32 blocks); a TPU vector holds 128 lanes, so
the block scale is spread over its 32 (FP8) or 16 (FP4 packed bytes) lanes by a product with a 0/1 expansion
matrix on the MXU (exact: one power of two times 1.0 per output). The dequantised tile, cast to the activations'
dtype (exact for bf16: <= 3 significant bits times a power of two), meets the activations in an MXU dot with float32
accumulation into the resident output block.

* ``fp8_gemm``: grid (row block, column block, K block); scales enter as float32 multipliers transposed to
  [K/32, N/32] (a few KB, so one block holds all column blocks' scales for a K block; a 0/1 row selection on the MXU
  picks this column block's rows).
* ``fp4_grouped_gemm``: megablox-style ragged tiling: tiles are (row block, group) pairs in row order, their
  group / row block / row range scalar-prefetched into SMEM; consecutive tiles of one row block accumulate into
  the same resident output block; tiles past the real ones repeat the last block indices (no new DMA) and add
  nothing. An expert without rows is never read. Whole K per step (the scale block's lanes must span the full
  K / 32), dequantised in 128-byte chunks.

Scale bytes 0 (2^-127, a float32 subnormal) and 0xFF (NaN) are outside what the TPU kernels reproduce: TPUs flush
float32 subnormals, and no quantiser writes either byte (the FP8 / FP4 scale floors are far above 2^-127).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

SCALE_BLOCK = 32


def _interp(interpret):
    if interpret is True:
        return pltpu.InterpretParams(out_of_bounds_reads="raise")
    return interpret or False


def _e8m0_f32(s):
    """e8m0 bytes (int32) -> 2^(s - 127) float32 (bytes 1..254)."""
    return jax.lax.bitcast_convert_type(s << 23, jnp.float32)


def decode_e4m3(b):
    """e4m3 bytes (int32 0..255) -> float32 values (exact)."""
    e = (b >> 3) & 15
    m = b & 7
    normal = jax.lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
    val = jnp.where(e == 0, m.astype(jnp.float32) * jnp.float32(2.0 ** -9), normal)
    val = jnp.where((b & 128) != 0, -val, val)
    return jnp.where((b & 127) == 127, jnp.float32(jnp.nan), val)


def decode_e2m1(c):
    """e2m1 codes (int32 0..15) -> float32 values (exact)."""
    mag = c & 7
    normal = jax.lax.bitcast_convert_type((((mag >> 1) + 126) << 23) | ((mag & 1) << 22), jnp.float32)
    val = jnp.where(mag < 2, mag.astype(jnp.float32) * jnp.float32(0.5), normal)
    return jnp.where((c & 8) != 0, -val, val)


def _onehot_expand(n_scales: int, width: int, per: int):
    """[n_scales, width] float32: 1 where lane l belongs to scale l // per."""
    r = jax.lax.broadcasted_iota(jnp.int32, (n_scales, width), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (n_scales, width), 1)
    return ((c >> (per.bit_length() - 1)) == r).astype(jnp.float32)  # per: a power of two (no integer division)


def _dot(a, b, dims):
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=prec, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# Dense FP8 (32 x 32 block scales)
# ----------------------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def fp8_gemm(x, values, scales, *, block_m: int | None = None, block_n: int = 256, block_k: int = 512,
             interpret=False):
    """x [M, K] (bf16 / f32), values uint8 (e4m3 bytes) [N, K], scales uint8 [ceil(N/32), ceil(K/32)] -> [M, N]."""
    m, k = x.shape
    n = values.shape[0]
    sub = 16 if x.dtype == jnp.bfloat16 else 8
    bm = block_m or min(256, -(-m // sub) * sub)
    mp = -(-m // bm) * bm
    bk = min(block_k, -(-k // 256) * 256)
    assert bk % 256 == 0, "block_k: a multiple of 256 (8 scale rows per block)"
    n_kb = -(-k // bk)
    kp = n_kb * bk
    bn = n if n <= block_n else block_n
    assert bn == n or (bn % 128 == 0), "block_n: a multiple of 128"
    n32 = scales.shape[0]
    ks = bk // SCALE_BLOCK
    xp = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    # float32 multipliers, transposed: [K/32 (padded to whole K blocks), N/32]
    st = _e8m0_f32(scales.astype(jnp.int32)).T
    st = jnp.pad(st, ((0, n_kb * ks - st.shape[0]), (0, 0)))
    k_tail = k % bk != 0

    def kernel(x_ref, v_ref, s_ref, o_ref):
        j, kk = pl.program_id(1), pl.program_id(2)

        @pl.when(kk == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        val = decode_e4m3(v_ref[...].astype(jnp.int32))  # [bn, bk]
        if k_tail:  # columns past K hold whatever the partial block DMA left: zero them (x is zero-padded there)
            col = kk * bk + jax.lax.broadcasted_iota(jnp.int32, val.shape, 1)
            val = jnp.where(col < k, val, 0.0)
        rsel = (jax.lax.broadcasted_iota(jnp.int32, (bn, n32), 1)
                == j * (bn // SCALE_BLOCK) + (jax.lax.broadcasted_iota(jnp.int32, (bn, n32), 0) >> 5))
        s_nk = _dot(rsel.astype(jnp.float32), s_ref[...], ((1,), (1,)))  # [bn, bk/32]; rows past N: 0
        s_full = _dot(s_nk, _onehot_expand(ks, bk, SCALE_BLOCK), ((1,), (0,)))  # [bn, bk]
        w = (val * s_full).astype(x_ref.dtype)
        o_ref[...] += _dot(x_ref[...], w, ((1,), (1,)))

    out = pl.pallas_call(
        kernel, grid=(mp // bm, -(-n // bn), n_kb),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((bn, bk), lambda i, j, kk: (j, kk)),
                  pl.BlockSpec((ks, n32), lambda i, j, kk: (kk, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, n), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=_interp(interpret), name="fp8_block_gemm",
    )(xp, values, st)
    return out[:m].astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Grouped FP4 (routed experts)
# ----------------------------------------------------------------------------------------------------------------

def tile_metadata(group_sizes, n_rows: int, block_m: int):
    """(row block, group) tiles in row order, megablox style.

    -> (tile_group, tile_block, tile_lo, tile_hi, tile_first) int32 [T], T = ceil(n_rows / block_m) +
    min(n_groups, n_rows) (a static bound): the tile covers rows [tile_lo, tile_hi) of row block ``tile_block`` for group ``tile_group``;
    ``tile_first`` marks a row block's first tile (its output block is zeroed). Tiles past the real ones repeat the
    last real tile's group and block with an empty row range."""
    g = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    end = jnp.cumsum(gs)
    start = end - gs
    first_b = start // block_m
    last_b = (end - 1) // block_m
    count = jnp.where(gs > 0, last_b - first_b + 1, 0)
    tend = jnp.cumsum(count)
    tstart = tend - count
    t_max = -(-n_rows // block_m) + min(g, n_rows)  # at most n_rows groups are non-empty
    t = jnp.arange(t_max, dtype=jnp.int32)
    total = tend[-1]
    tc = jnp.minimum(t, jnp.maximum(total - 1, 0))
    grp = jnp.clip(jnp.searchsorted(tend, tc, side="right", method="compare_all"), 0, g - 1).astype(jnp.int32)
    blk = first_b[grp] + (tc - tstart[grp])
    lo = jnp.maximum(start[grp], blk * block_m)
    hi = jnp.minimum(end[grp], (blk + 1) * block_m)
    real = t < total
    lo, hi = jnp.where(real, lo, 0), jnp.where(real, hi, 0)
    prev_blk = jnp.concatenate([jnp.full((1,), -1, jnp.int32), blk[:-1]])
    first = real & (blk != prev_blk)
    blk = jnp.clip(blk, 0, -(-n_rows // block_m) - 1)
    return grp, blk.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32), first.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "interpret"))
def fp4_grouped_gemm(x, group_sizes, values, scales, *, block_m: int | None = None, block_n: int = 256,
                     interpret=False):
    """x [A, K] rows sorted by group; group_sizes [E]; values uint8 [E, N, K/2]; scales uint8 [E, N, K/32]
    -> [A, N] in x.dtype (rows past sum(group_sizes): 0). K: a multiple of 32 (of 256 for whole-lane chunks)."""
    a, k = x.shape
    e, n, kh = values.shape
    bm = block_m or (16 if x.dtype == jnp.bfloat16 else 8)
    ap = -(-a // bm) * bm
    bn = n if n <= block_n else block_n
    assert bn == n or (bn % 128 == 0), "block_n: a multiple of 128"
    k32 = k // SCALE_BLOCK
    chunk = 128  # packed bytes per dequantisation step (8 scales; a whole lane row), smaller when K needs it
    while kh % chunk:
        chunk //= 2  # K is a multiple of 32, so kh of 16: stops at 16 at the latest
    xd = jnp.pad(x, ((0, ap - a), (0, 0)))
    x_even, x_odd = xd[:, 0::2], xd[:, 1::2]
    grp, blk, lo, hi, first = tile_metadata(group_sizes, ap, bm)
    t_max = grp.shape[0]

    def kernel(g_ref, b_ref, lo_ref, hi_ref, f_ref, xe_ref, xo_ref, v_ref, s_ref, o_ref):
        t = pl.program_id(1)

        @pl.when(f_ref[t] != 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        @pl.when(hi_ref[t] > lo_ref[t])
        def _():
            rows = b_ref[t] * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
            live = (rows >= lo_ref[t]) & (rows < hi_ref[t])
            sf = _e8m0_f32(s_ref[...].astype(jnp.int32))  # [bn, K/32]
            expand = _onehot_expand(chunk // 16, chunk, 16)
            acc = jnp.zeros((bm, bn), jnp.float32)
            for c in range(kh // chunk):
                sl = slice(c * chunk, (c + 1) * chunk)
                v = v_ref[:, sl].astype(jnp.int32)  # [bn, 128]
                s_full = _dot(sf[:, c * (chunk // 16):(c + 1) * (chunk // 16)], expand, ((1,), (0,)))
                w_lo = (decode_e2m1(v & 15) * s_full).astype(x.dtype)
                w_hi = (decode_e2m1(v >> 4) * s_full).astype(x.dtype)
                acc += _dot(xe_ref[:, sl], w_lo, ((1,), (1,))) + _dot(xo_ref[:, sl], w_hi, ((1,), (1,)))
            o_ref[...] += jnp.where(live, acc, 0.0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5, grid=(-(-n // bn), t_max),
        in_specs=[pl.BlockSpec((bm, kh), lambda j, t, g, b, *_: (b[t], 0)),
                  pl.BlockSpec((bm, kh), lambda j, t, g, b, *_: (b[t], 0)),
                  pl.BlockSpec((None, bn, kh), lambda j, t, g, b, *_: (g[t], j, 0)),
                  pl.BlockSpec((None, bn, k32), lambda j, t, g, b, *_: (g[t], j, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda j, t, g, b, *_: (b[t], j)))
    out = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((ap, n), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interp(interpret), name="fp4_grouped_gemm",
    )(grp, blk, lo, hi, first, x_even, x_odd, values, scales)
    covered = jnp.arange(a) < jnp.sum(group_sizes)
    return jnp.where(covered[:, None], out[:a], 0.0).astype(x.dtype)
