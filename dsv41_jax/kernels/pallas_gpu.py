"""Pallas GPU kernels (Triton lowering) for CSA2 sparse attention and the indexer.

Backend choice (measured on the H200, benchmarks/RESULTS.md): Pallas' Triton lowering. The gathers here are
per-row (a query's 512 selected compressed entries are arbitrary 1 KB rows). The Triton lowering turns an array
index into a pointer tensor, so a block of gathered rows is one coalesced masked load straight into registers /
shared memory; Mosaic GPU on sm90 copies GMEM->SMEM through TMA only (hardware gather TMA is sm100+), so a gather is
one TMA descriptor issue per row (two for a 1 KB bf16 row: a TMA box spans <= 256 elements), and neither lowering
supports scalar prefetch. ``benchmarks/bench_kernels.py`` measures both gathers (``mgpu_probe.py``) in the same run
as the kernels: on the H200 (jax 0.11.2) the Triton gather-copy of 1 KB rows ran at 3.43 TB/s (81% of the measured
4.24 TB/s copy) and the Mosaic GPU per-row-TMA one at 2.11 TB/s (50%) — hence Triton, although JAX 0.11 deprecates
it (it still ships and works in 0.11.2).

Kernels (all run in Pallas interpret mode on CPU for the tests):
  * ``attention_fwd``: one program per (query, head block, value-dim block, split). Online softmax over the
    query's window rows (contiguous index range, masked by positions / floor) then its top-k rows gathered block by
    block (BK rows per step); the per-head sink starts the running max / denominator. Gathered rows live only in
    registers / shared memory. Optional split-K over the key list for small batches (flash-decoding), merged in
    JAX. Returns the output and the log-sum-exp (for the backward).
  * ``attention_bwd``: backward. Per (query, head block): dQ in registers. dKV (= dK + dV, K = V) per block of
    rows (``_dkv_by_key``): the queries that read the block (a contiguous range for window rows, an inverted index
    of the top-k lists for selected rows) are looped over with the block's dKV tile in float32 registers, written
    once, no atomics; selected rows of lists narrower than a quarter of the entries are scatter-added with fp32
    atomics from the dQ programs instead (``BY_KEY_MIN_FILL``). Duplicates across queries and within a list are
    summed like the reference's gather transpose; the sink gradient comes from the LSE in JAX.
  * ``score_pool``: indexer scoring Σ_h w_h·ReLU(q_h·k)·d^-½ over streamed key tiles, visibility mask, and per-block
    / per-superblock maxima only (see ``hier_topk``); never writes the score matrix.
  * ``gather_score``: scores of explicit entry ids (the hierarchical top-k leaves, HSI pools for Reindex layers).
  * ``select``: exact top-k of up to 16384 candidates per row held in registers: bisection on the order-preserving
    int32 image of the float scores (32 count passes), ties by candidate position via a cumsum, then a compacting
    scatter in position order -> sorted, -1 padded output.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

NEG_INF = float("-inf")
_INT_MIN = -(2 ** 31)
SELECT_MAX = 16384  # candidates per row the select kernel holds in registers


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _params(num_warps: int, num_stages: int = 2):
    return pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _dot_nt(a, b, precision):
    """a [M, K] · b [N, K]ᵀ -> [M, N] fp32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _dot_nn(a, b, precision):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _dot_tn(a, b, precision):
    """a [K, M]ᵀ · b [K, N] -> [M, N] fp32."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _prec(dtype):
    # explicit either way: a global jax_default_matmul_precision must not change 16-bit tensor-core dots
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _window_rows(wpos_ref, wseg_ref, bi, j, s_len, qp, qs, window, fl, wend):
    """Window key slots ``j`` of batch row ``bi`` (inside a kernel): (clamped slot ids, valid mask). A key is valid
    when its slot exists, lies in the query's slot span (before ``wend`` = its first slot + wspan) and holds a
    position inside the query's window, at or above the floor, in its document."""
    inb = (j >= 0) & (j < s_len) & (j < wend)
    jj = jnp.clip(j, 0, s_len - 1)
    kp = pltr.load(wpos_ref.at[bi, jj], mask=inb, other=-1)
    ksg = pltr.load(wseg_ref.at[bi, jj], mask=inb, other=-1)
    return jj, _window_valid(inb, kp, ksg, qp, qs, window, fl)


def _window_valid(inb, kp, ksg, qp, qs, window, fl):
    return inb & (kp >= 0) & (kp <= qp) & (kp > qp - window) & (kp >= fl) & (ksg == qs)


# ----------------------------------------------------------------------------------------------------------------
# Packed cache rows (the release's formats, ``inference.packed_cache``), dequantised in registers
# ----------------------------------------------------------------------------------------------------------------

# format name -> (values per scale, values per byte, scale format); the names are ``packed_cache``'s (kept as
# strings here: kernels do not import the inference package)
PACKED_FORMATS = {"fp8_e4m3_ue8m0_32": (32, 1, "ue8m0"),  # window KV
                  "fp4_e2m1_e4m3_16": (16, 2, "e4m3"),  # compressed KV
                  "fp4_e2m1_ue8m0_32": (32, 2, "ue8m0")}  # indexer keys


def e4m3_from_bits(bits):
    """FP8 e4m3 bytes (int32 0..255) -> float32 by integer arithmetic (no fp8 type in the kernel): a normal
    (exponent e >= 1) is (8 + m) * 2^(e - 10), a subnormal 2m * 2^-10; both integers times 2^-10 are exact. The
    sign of zero is kept. (The NaN codes 0x7f / 0xff never occur in a packed cache: the packer clips to 448.)"""
    e = (bits >> 3) & 15
    m = bits & 7
    mag = jnp.where(e == 0, m << 1, (m + 8) << e).astype(jnp.float32) * (2.0 ** -10)
    return jnp.where(bits >= 128, -mag, mag)


def e2m1_from_code(code):
    """FP4 e2m1 codes (int32 0..15, sign in bit 3) -> float32: magnitudes 0, .5, 1, 1.5 (= c / 2), 2, 3 (= c - 2),
    4, 6 (= 2c - 8); code 8 is -0.0, as ``packed_cache.unpack`` gives."""
    c = code & 7
    cf = c.astype(jnp.float32)
    mag = jnp.where(c < 4, cf * 0.5, jnp.where(c < 6, cf - 2.0, cf * 2.0 - 8.0))
    return jnp.where(code >= 8, -mag, mag)


def ue8m0_from_bits(bits):
    """ue8m0 scale bytes (int32 1..254) -> 2^(bits - 127) exactly, as a float32 built from its exponent field
    (byte 0 gives 0.0: it only occurs in never-written rows, whose values are all zero)."""
    return jax.lax.bitcast_convert_type(bits << 23, jnp.float32)


def load_packed_rows(vals_ref, scales_ref, bi, rows, cols, valid, *, fmt: str, dim: int):
    """Rows ``rows`` [R] (in range) of batch row ``bi`` of a packed buffer, columns ``cols`` [1, D'] -> float32
    [R, D'] (0 where ``valid`` [R] is False or a column is >= ``dim``). Inside a kernel: each column's byte and
    scale are loaded by a pointer tensor of the column's own address (two columns share an FP4 byte, a block its
    scale: the repeated addresses are served by the same cache lines), then decoded in registers. Exactly
    ``packed_cache.unpack``'s values: the products code x scale are exact in float32. The "gather" read
    (``PACKED_LOADS``): the fallback for column ranges the tile load does not serve, and the same-run baseline."""
    block, per_byte, scale_fmt = PACKED_FORMATS[fmt]
    cc = jnp.minimum(cols, dim - 1)
    m = valid[:, None] & (cols < dim)
    byte = pltr.load(vals_ref.at[bi, rows[:, None], cc // per_byte], mask=m, other=0).astype(jnp.int32)
    sb = pltr.load(scales_ref.at[bi, rows[:, None], cc // block], mask=m, other=0).astype(jnp.int32)
    x = e4m3_from_bits(byte) if per_byte == 1 else e2m1_from_code((byte >> ((cc & 1) * 4)) & 15)
    return x * (e4m3_from_bits(sb) if scale_fmt == "e4m3" else ue8m0_from_bits(sb))


# How a kernel reads packed rows: "tile" (the default) loads a row block's bytes as one contiguous [R, D' / per_byte]
# uint8 tile and its scales as one [R, D' / block] tile (vectorised loads: a thread's 16 consecutive bytes in one
# instruction), decodes the low / high nibble tiles and interleaves them (``jnp.stack`` + reshape: Triton's join, a
# register shuffle) and broadcasts each scale over its block in registers; "gather" (the first form, kept as the
# same-run baseline) loads each column's byte and scale through a pointer tensor of its own address (one byte load
# per value for the byte and another for the scale, each with its own 64-bit address arithmetic: in the sm_90 SASS
# of the batch-32 sparse attention that load traffic, not the HBM bytes, bounded the kernel — benchmarks/RESULTS.md).
PACKED_LOADS = ("tile", "gather")
PACKED_LOAD = "tile"
# The sparse attention's default ``packed_ahead`` (``attention_fwd``): packed compressed rows loaded one key block
# ahead and decoded once for both dots, instead of pipelined tile loads that Triton decoded once per dot operand
# (three times per value). sm_90 SASS of the bench40 decode kernel: the compressed-row loop 2,699 -> 1,541
# instructions a key block at batch 32, 2,280 -> 985 at batch 1; on an H200 the one-layer call ran 206.4 against
# 214.3 µs at batch 32 and 140.0 against 142.6 at batch 1, same run (benchmarks/RESULTS.md, 2026-12-03 15:00 UTC)
PACKED_AHEAD = True


def load_packed_tile(vals_ref, scales_ref, bi, rows, c0, width: int, valid, *, fmt: str, dtype=jnp.float32):
    """Rows ``rows`` [R] (in range) of batch row ``bi`` of a packed buffer, the ``width`` columns from ``c0`` (a
    multiple of the format's block; ``width`` too) -> ``dtype`` [R, width] (0 where ``valid`` [R] is False), the
    same values as :func:`load_packed_rows` (exact in bf16 too: at most 6 significant bits): each row's packed bytes
    and scales are loaded as contiguous tiles."""
    return decode_packed_tile(*load_packed_bytes(vals_ref, scales_ref, bi, rows, c0, width, valid, fmt=fmt),
                              fmt=fmt, dtype=dtype)


def load_packed_bytes(vals_ref, scales_ref, bi, rows, c0, width: int, valid, *, fmt: str):
    """The two contiguous tiles :func:`load_packed_tile` decodes: (value bytes [R, width / per_byte], scale bytes
    [R, width / block]), uint8, 0 in invalid rows."""
    block, per_byte, _ = PACKED_FORMATS[fmt]
    r = rows.shape[0]
    nb, ns = width // per_byte, width // block
    byte = pltr.load(vals_ref.at[bi, rows[:, None], c0 // per_byte + jnp.arange(nb)[None, :]],
                     mask=jnp.broadcast_to(valid[:, None], (r, nb)), other=0)
    sb = pltr.load(scales_ref.at[bi, rows[:, None], c0 // block + jnp.arange(ns)[None, :]],
                   mask=jnp.broadcast_to(valid[:, None], (r, ns)), other=0)
    return byte, sb


def decode_packed_tile(byte, sb, *, fmt: str, dtype=jnp.float32):
    """Value bytes [R, nb] and scale bytes [R, ns] of ``fmt`` (from :func:`load_packed_bytes`) -> ``dtype``
    [R, nb * per_byte], decoded in registers."""
    block, per_byte, scale_fmt = PACKED_FORMATS[fmt]
    r, nb = byte.shape
    ns, width = sb.shape[1], nb * per_byte
    byte, sb = byte.astype(jnp.int32), sb.astype(jnp.int32)
    sc = e4m3_from_bits(sb) if scale_fmt == "e4m3" else ue8m0_from_bits(sb)  # [R, ns]
    # one scale per byte (an FP4 byte's two values share their block's scale)
    sc = jnp.broadcast_to(sc[:, :, None], (r, ns, block // per_byte)).reshape(r, nb)
    if per_byte == 1:
        return ((_f16_pattern(byte, 0x80, 8, 0x7F, 7) * 2.0 ** 8) * sc).astype(dtype)
    if scale_fmt == "e4m3":
        sc = sc * 2.0 ** 14  # exact: an e4m3 scale times 2^14 is a normal float32
        lo, hi = _f16_pattern(byte, 0x08, 12, 0x07, 9) * sc, _f16_pattern(byte, 0x80, 8, 0x70, 5) * sc
    else:
        lo = (_f16_pattern(byte, 0x08, 12, 0x07, 9) * 2.0 ** 14) * sc
        hi = (_f16_pattern(byte, 0x80, 8, 0x70, 5) * 2.0 ** 14) * sc
    # element 2j of the row is the low nibble of byte j, 2j + 1 the high one; interleaved in the narrow dtype (half
    # the register shuffles of a float32 join)
    return jnp.stack([lo.astype(dtype), hi.astype(dtype)], axis=-1).reshape(r, width)


def _f16_pattern(byte, sign_mask: int, sign_shift: int, mag_mask: int, mag_shift: int):
    """A float16 bit pattern placed from fields of packed bytes (int32), widened to float32 (exact, subnormals
    included). An e2m1 nibble (sign s, exponent e, mantissa m) placed as s << 15 | (e, m) << 9 is the float16
    value x 2^-14 (e >= 1: 2^(e - 15) (1 + m/2); e = 0: the subnormal m 2^-15 = 0.5 m 2^-14); an e4m3 byte placed as
    s << 15 | (e, m) << 7 is its value x 2^-8 (bias 15 against 7; its subnormals are float16 subnormals of the same
    ratio). A few integer ops and one conversion per value, where the arithmetic decode took a dozen."""
    bits = ((byte & sign_mask) << sign_shift) | ((byte & mag_mask) << mag_shift)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def packed_rows(vals_ref, scales_ref, bi, rows, c0, width: int, valid, *, fmt: str, dim: int, how: str, dtype):
    """Columns [c0, c0 + width) of packed rows (0 past ``dim`` and for invalid rows) -> float32 [R, width], read
    as ``how`` ("tile" or "gather", ``PACKED_LOADS``), returned as ``dtype``; the tile load serves whole blocks
    inside ``dim`` and falls back to the gather otherwise (a column range padded past ``dim`` or narrower than a
    block)."""
    block = PACKED_FORMATS[fmt][0]
    if how == "tile" and width % block == 0 and width <= dim and dim % width == 0:
        return load_packed_tile(vals_ref, scales_ref, bi, rows, c0, width, valid, fmt=fmt, dtype=dtype)
    return load_packed_rows(vals_ref, scales_ref, bi, rows, c0 + jnp.arange(width)[None, :], valid, fmt=fmt,
                            dim=dim).astype(dtype)


def _check_load(how):
    if how not in PACKED_LOADS:
        raise ValueError(f"packed_load must be one of {PACKED_LOADS}, got {how!r}")


def _check_packed(arr, fmt, dim, what):
    if fmt not in PACKED_FORMATS:
        raise ValueError(f"{what}: unknown packed format {fmt!r}; one of {sorted(PACKED_FORMATS)}")
    block, per_byte, _ = PACKED_FORMATS[fmt]
    vals, scales = arr
    if vals.dtype != jnp.uint8 or scales.dtype != jnp.uint8 or vals.shape[-1] * per_byte != dim or \
            scales.shape[-1] * block != dim or vals.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"{what}: packed {fmt} rows of {dim} values need uint8 values [..., {dim // per_byte}] and "
                         f"scales [..., {dim // block}], got {vals.dtype}{list(vals.shape)} and "
                         f"{scales.dtype}{list(scales.shape)}")


# ----------------------------------------------------------------------------------------------------------------
# Sparse attention, forward
# ----------------------------------------------------------------------------------------------------------------

# attention_fwd's split merge: up to this many query rows its weights are computed inside the fused merge
MERGE_FUSED_ROWS = 8


@functools.partial(jax.jit, static_argnames=("window", "scale", "wspan", "block_h", "block_d", "block_k",
                                             "num_splits", "num_warps", "num_stages", "prefetch", "ckv_fmt",
                                             "ring_fmt", "packed_load", "packed_ahead", "interpret"))
def attention_fwd(q, q_pos, wkv, wpos, wstart, floor, ckv, topk, sink, qseg=None, wseg=None, *, window: int,
                  scale: float, wspan: int, block_h: int = 64, block_d: int = 512, block_k: int = 64,
                  num_splits: int = 1, num_warps: int = 8, num_stages: int = 2, prefetch: bool = False,
                  ckv_fmt: str | None = None, ring=None, ring_fmt: str | None = None, packed_load: str = "tile",
                  packed_ahead: bool = False, interpret: bool = False):
    """Core forward. q [B, C, H, D]; q_pos [B, C]; window rows of query (b, c) are wkv[b, wstart[b,c] + j] for
    j < wspan (positions wpos, masked like the reference; with document ids qseg [B, C] / wseg [B, S] also
    masked to the query's document); ckv [B, N, D] / topk [B, C, K] (or None); sink [H]; floor [B].
    ``ckv_fmt``: ckv is a packed cache buffer (values uint8, scales uint8) in that ``PACKED_FORMATS`` format, its
    selected rows dequantised to q.dtype in registers (only their packed bytes are read).
    ``ring`` = (values, scales, base) with ``ring_fmt``: the window's first R rows come from a packed ring buffer of
    R slots [B, R, ...] (window row j < R is slot (base[b] + j) mod R, i.e. ``step.ring_read``'s position order)
    and rows R + i from wkv [B, S - R, D] (the chunk's new rows); wpos / wseg / wspan then cover all S rows.
    ``packed_load``: how packed rows are read (``PACKED_LOADS``). ``packed_ahead``: packed compressed rows read
    as tiles (``packed_load="tile"``, one value-dim block, an unpadded head dim) are loaded one key block ahead as
    raw bytes and decoded once per block for both dots (see the loop below); elsewhere ignored.
    Returns (out [B, C, H, D] q.dtype, lse [B, C, H] fp32)."""
    _check_load(packed_load)
    b, c, h, d = q.shape
    n_ring = 0
    if ring_fmt is not None:
        _check_packed(ring[:2], ring_fmt, d, "attention_fwd window ring")
        rvals, rscales, rbase = ring
        n_ring = rvals.shape[1]
        if wkv.shape[1] == 0:
            raise ValueError("attention_fwd: a packed window ring needs at least one new row in wkv")
    s_len = n_ring + wkv.shape[1]
    if qseg is None:
        qseg, wseg = jnp.zeros((b, c), jnp.int32), jnp.zeros((b, s_len), jnp.int32)
    has_cmp = ckv is not None and topk is not None and topk.shape[-1] > 0
    if not has_cmp:  # a dummy one-row cache keeps one kernel signature
        ckv = jnp.zeros((b, 1, d), wkv.dtype)
        topk = jnp.full((b, c, 1), -1, jnp.int32)
        ckv_fmt = None
    if ckv_fmt is not None:
        _check_packed(ckv, ckv_fmt, d, "attention_fwd compressed KV")
        cvals, cscales = ckv
        n = cvals.shape[1]
    else:
        n = ckv.shape[1]
    kk = topk.shape[-1]
    bh = max(16, min(_pow2(block_h), _pow2(h)))
    hp = -(-h // bh) * bh
    dp = _pow2(d)
    bd = min(_pow2(block_d), dp)
    bk = max(16, _pow2(block_k))
    if hp != h or dp != d:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, hp - h), (0, dp - d)))
        sink = jnp.pad(sink, (0, hp - h))
    if dp != d:
        wkv = jnp.pad(wkv, ((0, 0), (0, 0), (0, dp - d)))
        if ckv_fmt is None:
            ckv = jnp.pad(ckv, ((0, 0), (0, 0), (0, dp - d)))
    n_w = -(-wspan // bk)
    n_c = -(-kk // bk) if has_cmp else 0
    nblk = n_w + n_c
    splits = max(1, min(num_splits, nblk))
    per = -(-nblk // splits)
    n_hb, n_db = hp // bh, dp // bd
    prec = _prec(q.dtype)
    vdt = wkv.dtype
    ahead = bool(packed_ahead and ckv_fmt is not None and packed_load == "tile" and bd == dp == d
                 and d % PACKED_FORMATS[ckv_fmt][0] == 0)

    n_new = wkv.shape[1]

    def kernel(q_ref, qpos_ref, wkv_ref, wpos_ref, wstart_ref, floor_ref, *refs):
        if ring_fmt is not None:
            rval_ref, rscale_ref, rbase_ref, *refs = refs
        if ckv_fmt is None:
            ckv_ref, topk_ref, sink_ref, qseg_ref, wseg_ref, *outs = refs
        else:
            cval_ref, cscale_ref, topk_ref, sink_ref, qseg_ref, wseg_ref, *outs = refs
        r = pl.program_id(0)
        hd = pl.program_id(1)
        sp = pl.program_id(2)
        bi = r // c
        ci = r % c
        h0 = (hd // n_db) * bh
        d0 = (hd % n_db) * bd
        qv = q_ref[bi, ci, pl.ds(h0, bh), :]  # [bh, dp]
        qp = qpos_ref[bi, ci]
        fl = floor_ref[bi]
        ws = wstart_ref[bi, ci]
        qs = qseg_ref[bi, ci]
        sk = sink_ref[pl.ds(h0, bh)].astype(jnp.float32)
        cols = jnp.arange(dp)[None, :]
        vcols = d0 + jnp.arange(bd)[None, :]

        def step(carry, kmat, vmat, valid):
            m, l, acc = carry
            s = _dot_nt(qv, kmat, prec) * scale
            s = jnp.where(valid[None, :], s, NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])
            l = l * alpha + jnp.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot_nn(p.astype(vdt), vmat, prec)
            return m_new, l, acc

        def load_win(i):
            jj, valid = _window_rows(wpos_ref, wseg_ref, bi, ws + i * bk + jnp.arange(bk), s_len, qp, qs, window, fl,
                                      ws + wspan)
            if ring_fmt is not None:  # ring rows dequantised from the packed ring, the chunk's rows from wkv
                in_ring = jj < n_ring
                slot = jax.lax.rem(rbase_ref[bi] + jnp.minimum(jj, n_ring - 1), n_ring)
                new = jnp.clip(jj - n_ring, 0, n_new - 1)

                def rows(c0, width):
                    packed = packed_rows(rval_ref, rscale_ref, bi, slot, c0, width, valid & in_ring, fmt=ring_fmt,
                                         dim=d, how=packed_load, dtype=vdt)
                    cc = c0 + jnp.arange(width)[None, :]
                    plain = pltr.load(wkv_ref.at[bi, new[:, None], cc], mask=(valid & ~in_ring)[:, None], other=0)
                    return jnp.where(in_ring[:, None], packed, plain)

                return (rows(0, dp), valid) if bd == dp else (rows(0, dp), rows(d0, bd), valid)
            kmat = pltr.load(wkv_ref.at[bi, jj[:, None], cols], mask=valid[:, None], other=0)
            if bd == dp:
                return kmat, valid
            return kmat, pltr.load(wkv_ref.at[bi, jj[:, None], vcols], mask=valid[:, None], other=0), valid

        def cmp_rows(i):  # (clamped compressed-row ids, valid) of selected block i
            t = i * bk + jnp.arange(bk)
            idx = pltr.load(topk_ref.at[bi, ci, jnp.minimum(t, kk - 1)], mask=t < kk, other=-1)
            return jnp.clip(idx, 0, n - 1), idx >= 0

        def load_cmp(i):
            safe, valid = cmp_rows(i)
            if ckv_fmt is not None:  # packed rows: dequantised here, the same values packed_cache.read gives
                def rows(c0, width):
                    return packed_rows(cval_ref, cscale_ref, bi, safe, c0, width, valid, fmt=ckv_fmt, dim=d,
                                       how=packed_load, dtype=vdt)

                kmat = rows(0, dp)
                return (kmat, valid) if bd == dp else (kmat, rows(d0, bd), valid)
            kmat = pltr.load(ckv_ref.at[bi, safe[:, None], cols], mask=valid[:, None], other=0)
            if bd == dp:
                return kmat, valid
            return kmat, pltr.load(ckv_ref.at[bi, safe[:, None], vcols], mask=valid[:, None], other=0), valid

        def apply(carry, blk):
            kmat, valid = blk[0], blk[-1]
            return step(carry, kmat, kmat if bd == dp else blk[1], valid)

        lo = sp * per
        hi = jnp.minimum(lo + per, nblk)
        m0 = sk
        l0 = jnp.ones((bh,), jnp.float32) if splits == 1 else jnp.zeros((bh,), jnp.float32)
        carry = (m0, l0, jnp.zeros((bh, bd), jnp.float32))
        if prefetch:  # one loop over window + selected blocks; block i+1's gather is in flight during block i
            def load_any(i):
                if not n_c:
                    return load_win(i)
                return jax.lax.cond(i < n_w, load_win, lambda i_: load_cmp(i_ - n_w), i)

            def body(i, cr):
                nxt = load_any(jnp.minimum(i + 1, hi - 1))
                return apply(cr[:3], cr[3:]) + tuple(nxt)

            cur = load_any(jnp.minimum(lo, nblk - 1))
            carry = jax.lax.fori_loop(lo, hi, body, carry + tuple(cur))[:3]
        else:
            carry = jax.lax.fori_loop(jnp.minimum(lo, n_w), jnp.minimum(hi, n_w),
                                      lambda i, cr: apply(cr, load_win(i)), carry)
            c_lo, c_hi = jnp.maximum(lo, n_w) - n_w, jnp.maximum(hi, n_w) - n_w
            if n_c and ahead:
                # Packed rows, decoded ONCE per block. The score dot reads the tile transposed, the PV dot as is:
                # the two operand layouts differ, so one must pass through shared memory. When the bytes come from
                # a pipelined (cp.async -> shared memory) load, Triton's layout pass instead re-derives the whole
                # decode for the score operand from the shared byte tile, in that operand's register layout (where
                # two of the 8 warps hold each value), besides the decode it stores for the PV dot:
                # three decodes per value in the sm_90 SASS (benchmarks/RESULTS.md). Here block i + 1's raw bytes
                # are loaded into registers during block i and carried by the loop: the chain back from the dots
                # ends at a global load, which the layout pass does not duplicate, so the tile is decoded once,
                # stored once to shared memory and read there by both dots. The same values and dots as
                # ``load_cmp``: bit-equal results.
                def raw(i):
                    safe, valid = cmp_rows(i)
                    return load_packed_bytes(cval_ref, cscale_ref, bi, safe, 0, dp, valid, fmt=ckv_fmt) + (valid,)

                def ahead_body(i, cr):
                    nxt = raw(jnp.minimum(i + 1, c_hi - 1))
                    byte, sb, valid = cr[3:]
                    return apply(cr[:3], (decode_packed_tile(byte, sb, fmt=ckv_fmt, dtype=vdt), valid)) + nxt

                carry = jax.lax.fori_loop(c_lo, c_hi, ahead_body, carry + raw(jnp.clip(c_lo, 0, n_c - 1)))[:3]
            elif n_c:
                carry = jax.lax.fori_loop(c_lo, c_hi, lambda i, cr: apply(cr, load_cmp(i)), carry)
        m, l, acc = carry
        if splits == 1:
            o_ref, lse_ref = outs
            o_ref[bi, ci, pl.ds(h0, bh), pl.ds(d0, bd)] = (acc / l[:, None]).astype(o_ref.dtype)
            lse_ref[bi, ci, pl.ds(h0, bh)] = m + jnp.log(l)
        else:
            acc_ref, m_ref, l_ref = outs
            acc_ref[r, sp, pl.ds(h0, bh), pl.ds(d0, bd)] = acc
            m_ref[r, sp, pl.ds(h0, bh)] = m
            l_ref[r, sp, pl.ds(h0, bh)] = l

    if splits == 1:
        out_shape = (jax.ShapeDtypeStruct((b, c, hp, dp), q.dtype), jax.ShapeDtypeStruct((b, c, hp), jnp.float32))
    else:
        out_shape = (jax.ShapeDtypeStruct((b * c, splits, hp, dp), jnp.float32),
                     jax.ShapeDtypeStruct((b * c, splits, hp), jnp.float32),
                     jax.ShapeDtypeStruct((b * c, splits, hp), jnp.float32))
    outs = pl.pallas_call(kernel, grid=(b * c, n_hb * n_db, splits), out_shape=out_shape,
                          compiler_params=_params(num_warps, num_stages), interpret=interpret,
                          name="csa2_sparse_attention_fwd")(
        q, q_pos.astype(jnp.int32), wkv, wpos.astype(jnp.int32), wstart.astype(jnp.int32),
        floor.astype(jnp.int32), *(() if ring_fmt is None else (rvals, rscales, rbase.astype(jnp.int32))),
        *(ckv if ckv_fmt is not None else (ckv,)), topk.astype(jnp.int32), sink,
        qseg.astype(jnp.int32), wseg.astype(jnp.int32))
    if splits == 1:
        out, lse = outs
    else:  # merge the partial softmaxes; the sink enters once
        acc, m, l = outs
        sk = sink.astype(jnp.float32)[None, None, :]
        mm = jnp.maximum(jnp.max(m, axis=1, keepdims=True), sk)
        # every sum over the splits is an unrolled chain of adds (elementwise, not a reduction), so that XLA fuses
        # the merge into its consumer (the attention output's inverse RoPE in a decode step) instead of giving each
        # reduction a kernel. Few rows (batch 1): the weights' exps are recomputed inside that one fusion. Many rows
        # (batch 32), where XLA keeps the exps in a kernel of their own: the sink's weight joins the splits' in that
        # kernel, so that the normaliser needs no exp and fuses too (deviceless H200 compile, benchmarks/RESULTS.md)
        if b * c <= MERGE_FUSED_ROWS:
            wgt = jnp.exp(m - mm)
            w_sink = jnp.exp(sk[:, 0] - mm[:, 0])
        else:
            wgt = jnp.exp(jnp.concatenate([m, jnp.broadcast_to(sk, (m.shape[0], 1, m.shape[2]))], axis=1) - mm)
            w_sink = wgt[:, splits]
        lt = l[:, 0] * wgt[:, 0]
        for si in range(1, splits):
            lt = lt + l[:, si] * wgt[:, si]
        lt = lt + w_sink
        o = acc[:, 0] * wgt[:, 0, :, None]
        for si in range(1, splits):
            o = o + acc[:, si] * wgt[:, si, :, None]
        o = o / lt[..., None]
        out = o.reshape(b, c, hp, dp).astype(q.dtype)
        lse = (mm[:, 0] + jnp.log(lt)).reshape(b, c, hp)
    return out[:, :, :h, :d], lse[:, :, :h]


# ----------------------------------------------------------------------------------------------------------------
# Sparse attention, backward
# ----------------------------------------------------------------------------------------------------------------

DKV_MODES = ("by_key", "atomic", "slab")


def _key_block_groups(topk, n: int, bk: int):
    """Inverted index of the selections, per batch row: which queries picked entries of each block of ``bk``
    compressed entries, and how often each entry.

    topk [B, C, K] (-1 = empty; ids clipped to [0, n) like the forward's gather) -> (group_query [B, G] int32,
    group_count [B, G, bk] float32: how many times the group's query lists each entry of the block (duplicates
    within a list count, as in the forward's softmax), group_range [B, n_blocks + 1] int32: the groups of block
    ``kb`` are ``group_range[kb] <= g < group_range[kb + 1]``, in ascending query order). A group is one
    (block, query) pair; G = C · min(K, n_blocks) bounds their number. Built by one sort of the B·C·K picks."""
    b, c, k = topk.shape
    nkb = -(-n // bk)
    g_max = c * min(k, nkb)
    big = nkb * c  # sorts after every real (block, query) key
    ids = topk.reshape(b, c * k)
    query = jnp.broadcast_to(jnp.arange(c * k, dtype=jnp.int32) // k, (b, c * k))
    safe = jnp.clip(ids, 0, n - 1)
    key = jnp.where(ids >= 0, (safe // bk) * c + query, big)
    key, slot = jax.lax.sort((key, safe % bk), dimension=1, num_keys=1)
    real = key < big
    first = real & jnp.concatenate([jnp.ones((b, 1), bool), key[:, 1:] != key[:, :-1]], axis=1)
    gid = jnp.where(real, jnp.cumsum(first, axis=1, dtype=jnp.int32) - 1, g_max)  # g_max: dropped
    rows = jnp.arange(b)[:, None]
    count = jnp.zeros((b, g_max, bk), jnp.float32).at[rows, gid, slot].add(1.0, mode="drop")
    gkey = jnp.full((b, g_max), big, jnp.int32).at[rows, jnp.where(first, gid, g_max)].set(key, mode="drop")
    bounds = jnp.arange(nkb + 1, dtype=jnp.int32) * c
    grange = jax.vmap(lambda g_: jnp.searchsorted(g_, bounds, side="left"))(gkey).astype(jnp.int32)
    return gkey % c, count, grange


def _window_query_ranges(wstart, wspan: int, s_len: int, bk: int):
    """For each block of ``bk`` window slots, the range of queries whose slot span [wstart, wstart + wspan) meets
    it: (lo, hi), each [B, n_blocks] int32. ``wstart`` must be non-decreasing along the queries (both call sites:
    all zeros, or t - window + 1), so those queries are contiguous."""
    nkb = -(-s_len // bk)
    first_row = jnp.arange(nkb, dtype=jnp.int32) * bk
    lo = jax.vmap(lambda w: jnp.searchsorted(w + wspan, first_row, side="right"))(wstart)
    hi = jax.vmap(lambda w: jnp.searchsorted(w, first_row + bk - 1, side="right"))(wstart)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def _dkv_by_key(qq, do, lse_p, delta_p, rows_kv, *, lists, window_args, scale, bk, bh, n_split, num_warps,
                num_stages, interpret):
    """dKV of a table of K = V rows without atomics: one program per (batch row, block of ``bk`` rows, head block,
    split of the block's query list) holds the block's rows and its dKV tile, loops over the queries that read the
    block (recomputing their probabilities from the saved log-sum-exp) and writes the tile once; the head blocks
    and splits are summed afterwards. Window rows: ``lists`` = (lo, hi) query ranges per block
    (``_window_query_ranges``) and ``window_args`` = (q_pos, wpos, wstart, floor, qseg, wseg, window, wspan), the
    mask computed per query as in the forward. Selected rows: ``lists`` = ``_key_block_groups``' output and
    ``window_args`` None, each group's pick counts weighting its probabilities. Returns [B, R, dp] float32."""
    b, c, hp, dp = qq.shape
    r_len = rows_kv.shape[1]
    nkb = -(-r_len // bk)
    if nkb * bk != r_len:
        rows_kv = jnp.pad(rows_kv, ((0, 0), (0, nkb * bk - r_len), (0, 0)))
    n_hb = hp // bh
    prec = _prec(qq.dtype)
    vdt = rows_kv.dtype
    is_window = window_args is not None
    if is_window:
        q_pos, wpos, wstart, floor, qseg, wseg, window, wspan = window_args
        lo, hi = lists
        extra = (q_pos, jnp.pad(wpos, ((0, 0), (0, nkb * bk - r_len)), constant_values=-1), wstart, floor, qseg,
                 jnp.pad(wseg, ((0, 0), (0, nkb * bk - r_len)), constant_values=-1))
    else:
        group_query, group_count, grange = lists
        lo, hi = grange[:, :-1], grange[:, 1:]
        extra = (group_query, group_count)

    def kernel(q_ref, do_ref, lse_ref, dl_ref, kv_ref, lo_ref, hi_ref, *refs):
        out_ref = refs[-1]
        pid = pl.program_id(0)
        hb = pl.program_id(1)
        sp = pl.program_id(2)
        bi = pid // nkb
        kb = pid % nkb
        h0 = hb * bh
        r0 = kb * bk
        kmat = kv_ref[bi, pl.ds(r0, bk), :]  # [bk, dp]
        g_lo = lo_ref[bi, kb]
        g_hi = hi_ref[bi, kb]
        per = (g_hi - g_lo + n_split - 1) // n_split
        a = g_lo + sp * per
        e = jnp.minimum(a + per, g_hi)
        slots = r0 + jnp.arange(bk)
        if is_window:
            qpos_ref, wpos_ref, wstart_ref, floor_ref, qseg_ref, wseg_ref = refs[:6]
            kp = wpos_ref[bi, pl.ds(r0, bk)]
            ksg = wseg_ref[bi, pl.ds(r0, bk)]
            fl = floor_ref[bi]
        else:
            gq_ref, gc_ref = refs[:2]

        def body(g, acc):
            if is_window:
                ci = g
                ws = wstart_ref[bi, ci]
                inb = (slots >= ws) & (slots < ws + wspan) & (slots < r_len)
                valid = _window_valid(inb, kp, ksg, qpos_ref[bi, ci], qseg_ref[bi, ci], window, fl)
                count = valid.astype(jnp.float32)
            else:
                ci = gq_ref[bi, g]
                count = gc_ref[bi, g, :]
                valid = count > 0
            qv = q_ref[bi, ci, pl.ds(h0, bh), :]
            dov = do_ref[bi, ci, pl.ds(h0, bh), :]
            lse_v = lse_ref[bi, ci, pl.ds(h0, bh)]
            dl = dl_ref[bi, ci, pl.ds(h0, bh)]
            s = _dot_nt(qv, kmat, prec) * scale  # [bh, bk]
            # unread rows may score far above the log-sum-exp: masked before the product, never inf · 0
            p = jnp.where(valid[None, :], jnp.exp(jnp.where(valid[None, :], s, 0.0) - lse_v[:, None]), 0.0)
            p = p * count[None, :]
            ds = p * (_dot_nt(dov, kmat, prec) - dl[:, None])
            return acc + _dot_tn(ds.astype(vdt), qv, prec) * scale + _dot_tn(p.astype(vdt), dov, prec)

        acc = jax.lax.fori_loop(a, e, body, jnp.zeros((bk, dp), jnp.float32))
        out_ref[bi, hb * n_split + sp, pl.ds(r0, bk), :] = acc

    part = pl.pallas_call(
        kernel, grid=(b * nkb, n_hb, n_split),
        out_shape=jax.ShapeDtypeStruct((b, n_hb * n_split, nkb * bk, dp), jnp.float32),
        compiler_params=_params(num_warps, num_stages), interpret=interpret,
        name="csa2_sparse_attention_bwd_dkv_window" if is_window else "csa2_sparse_attention_bwd_dkv_selected",
    )(qq, do, lse_p, delta_p, rows_kv, lo, hi, *extra)
    return jnp.sum(part, axis=1)[:, :r_len]


# Selected rows go by key block when the lists are at least this share of the entries wide (K >= N / 4): then a
# key block's groups are mostly full. Sparser lists waste most of each group's tile: top-512 of a 4096-entry
# ratio-1 sequence on the H200 took 33.5 ms fwd + bwd with both row kinds by key, 22.0 ms with both atomic
# (benchmarks/RESULTS.md).
BY_KEY_MIN_FILL = 0.25


@functools.partial(jax.jit, static_argnames=("window", "scale", "wspan", "block_h", "block_k", "num_warps",
                                             "num_stages", "rotate", "dkv", "dkv_selected", "key_block",
                                             "key_block_h", "key_splits", "key_warps", "key_stages", "interpret"))
def attention_bwd(q, q_pos, wkv, wpos, wstart, floor, ckv, topk, sink, out, lse, dout, qseg=None, wseg=None, *,
                  window: int, scale: float, wspan: int, block_h: int = 64, block_k: int = 32, num_warps: int = 8,
                  num_stages: int = 1, rotate: bool = False, dkv: str = "by_key", dkv_selected: str = "auto",
                  key_block: int | None = None, key_block_h: int | None = None, key_splits: int | None = None,
                  key_warps: int = 8, key_stages: int = 1, interpret: bool = False):
    """Gradients (dq, dwkv, dckv, dsink) of ``attention_fwd``'s output.

    dQ: one program per (query, head block), dQ in registers, over the query's window / selected rows (BK =
    ``block_k`` rows per step). ``rotate``: each program starts its loops at a block offset of its own.

    dKV (= dK + dV, K = V) of the window rows by ``dkv``, of the selected (compressed) rows by ``dkv_selected``
    ("auto": ``"by_key"`` when the lists are at least ``BY_KEY_MIN_FILL`` of the entries wide, else ``"atomic"``):
      * ``"by_key"``: key-centric, no atomics (``_dkv_by_key``): per block of ``key_block`` window slots, the
        contiguous range of queries whose window spans it (``wstart`` non-decreasing); per block of compressed
        entries, the queries that picked any of them, from an inverted index of the top-k lists
        (``_key_block_groups``: one sort). Each row's dKV is summed in float32 in registers over those queries
        and written once. Rows picked twice in one list count twice, like the reference's gather transpose.
      * ``"atomic"``: the dQ programs scatter-add every (query, row) dKV with fp32 atomics (neighbouring queries
        collide on the same rows).
      * ``"slab"``: per-(query, row) dKV blocks written out and summed by an XLA scatter-add (interpret mode's
        stand-in for ``"atomic"``, which it replaces there: its atomic emulation neither masks nor sums duplicate
        indices)."""
    b, c, h, d = q.shape
    s_len = wkv.shape[1]
    if qseg is None:
        qseg, wseg = jnp.zeros((b, c), jnp.int32), jnp.zeros((b, s_len), jnp.int32)
    has_cmp = ckv is not None and topk is not None and topk.shape[-1] > 0
    ckv_in = ckv
    if not has_cmp:
        ckv = jnp.zeros((b, 1, d), wkv.dtype)
        topk = jnp.full((b, c, 1), -1, jnp.int32)
    n, kk = ckv.shape[1], topk.shape[-1]
    if dkv_selected == "auto":
        dkv_selected = "by_key" if kk >= BY_KEY_MIN_FILL * n else "atomic"
    for name, mode in (("dkv", dkv), ("dkv_selected", dkv_selected)):
        if mode not in DKV_MODES:
            raise ValueError(f"attention_bwd: {name} must be one of {DKV_MODES} (or 'auto' for dkv_selected), "
                             f"got {mode!r}")
    modes = ["slab" if interpret and m == "atomic" else m for m in (dkv, dkv_selected if has_cmp else "by_key")]
    bh = max(16, min(_pow2(block_h), _pow2(h)))
    hp = -(-h // bh) * bh
    dp = _pow2(d)
    bk = max(16, _pow2(block_k))
    of = out.astype(jnp.float32)
    delta = jnp.sum(of * dout.astype(jnp.float32), axis=-1)  # [B, C, H]
    # sink: out = Σ p v / (Σ p + e^{σ-m}) -> dσ_h = -Σ_{b,c} e^{σ_h - lse} · (dO·O)
    dsink = -jnp.sum(jnp.exp(sink.astype(jnp.float32)[None, None, :] - lse) * delta, axis=(0, 1))
    pad4 = ((0, 0), (0, 0), (0, hp - h), (0, dp - d))
    qq = jnp.pad(q, pad4)
    do = jnp.pad(dout.astype(q.dtype), pad4)
    lse_p = jnp.pad(lse, ((0, 0), (0, 0), (0, hp - h)))
    delta_p = jnp.pad(delta, ((0, 0), (0, 0), (0, hp - h)))
    wkv_p = jnp.pad(wkv, ((0, 0), (0, 0), (0, dp - d)))
    ckv_p = jnp.pad(ckv, ((0, 0), (0, 0), (0, dp - d)))
    n_w = -(-wspan // bk)
    n_c = -(-kk // bk) if has_cmp else 0
    n_hb = hp // bh
    prec = _prec(q.dtype)
    vdt = wkv.dtype
    topk = topk.astype(jnp.int32)
    wstart = wstart.astype(jnp.int32)
    # the dQ kernel's extra outputs: (kind index, mode, shape) for the rows whose dKV it emits
    shapes = {"atomic": ((b, s_len, dp), (b, n, dp)),
              "slab": ((b * c, n_hb, n_w * bk, dp), (b * c, n_hb, max(n_c, 1) * bk, dp))}
    emitted = [(i, m, shapes[m][i]) for i, m in enumerate(modes) if m != "by_key"]

    def kernel(q_ref, do_ref, lse_ref, dl_ref, qpos_ref, wkv_ref, wpos_ref, wstart_ref, floor_ref, ckv_ref,
               topk_ref, qseg_ref, wseg_ref, *refs):
        outs = refs[len(refs) - 1 - len(emitted):]  # (the zero inputs aliased to atomic outputs come first)
        dq_ref = outs[0]
        dst = [None, None]
        for (i, _, _), ref in zip(emitted, outs[1:]):
            dst[i] = ref
        r = pl.program_id(0)
        hb = pl.program_id(1)
        h0 = hb * bh
        bi = r // c
        ci = r % c
        qv = q_ref[bi, ci, pl.ds(h0, bh), :]
        dov = do_ref[bi, ci, pl.ds(h0, bh), :]
        lse_v = lse_ref[bi, ci, pl.ds(h0, bh)]
        dl = dl_ref[bi, ci, pl.ds(h0, bh)]
        qp = qpos_ref[bi, ci]
        fl = floor_ref[bi]
        ws = wstart_ref[bi, ci]
        qs = qseg_ref[bi, ci]
        cols = jnp.arange(dp)[None, :]

        def grads(dq, kmat, valid, kind):
            s = _dot_nt(qv, kmat, prec) * scale
            p = jnp.where(valid[None, :], jnp.exp(s - lse_v[:, None]), 0.0)  # [bh, bk]
            dpm = _dot_nt(dov, kmat, prec)
            ds = p * (dpm - dl[:, None])
            dq = dq + _dot_nn(ds.astype(vdt), kmat, prec) * scale
            if modes[kind] == "by_key":
                return dq, None
            dkv = _dot_tn(ds.astype(vdt), qv, prec) * scale + _dot_tn(p.astype(vdt), dov, prec)  # [bk, dp]
            return dq, dkv

        def emit(kind, rows, i, dkv, valid):
            if modes[kind] == "atomic":
                pltr.atomic_add(dst[kind], (bi, rows[:, None], cols), dkv,
                                mask=jnp.broadcast_to(valid[:, None], dkv.shape))
            elif modes[kind] == "slab":  # per-(query, head block) slab, summed outside
                dst[kind][r, hb, pl.ds(i * bk, bk), :] = jnp.where(valid[:, None], dkv, 0.0)

        def win_body(i, dq):
            if rotate:
                i = (i + ci) % n_w
            jj, valid = _window_rows(wpos_ref, wseg_ref, bi, ws + i * bk + jnp.arange(bk), s_len, qp, qs, window, fl,
                                     ws + wspan)
            kmat = pltr.load(wkv_ref.at[bi, jj[:, None], cols], mask=valid[:, None], other=0)
            dq, dkv = grads(dq, kmat, valid, 0)
            emit(0, jj, i, dkv, valid)
            return dq

        def cmp_body(i, dq):
            if rotate:
                i = (i + ci) % n_c
            t = i * bk + jnp.arange(bk)
            idx = pltr.load(topk_ref.at[bi, ci, jnp.minimum(t, kk - 1)], mask=t < kk, other=-1)
            valid = idx >= 0
            safe = jnp.clip(idx, 0, n - 1)
            kmat = pltr.load(ckv_ref.at[bi, safe[:, None], cols], mask=valid[:, None], other=0)
            dq, dkv = grads(dq, kmat, valid, 1)
            emit(1, safe, i, dkv, valid)
            return dq

        dq = jnp.zeros((bh, dp), jnp.float32)
        dq = jax.lax.fori_loop(0, n_w, win_body, dq)
        if n_c:
            dq = jax.lax.fori_loop(0, n_c, cmp_body, dq)
        dq_ref[bi, ci, pl.ds(h0, bh), :] = dq

    args = (qq, do, lse_p, delta_p, q_pos.astype(jnp.int32), wkv_p, wpos.astype(jnp.int32), wstart,
            floor.astype(jnp.int32), ckv_p, topk, qseg.astype(jnp.int32), wseg.astype(jnp.int32))
    aliases = {}
    for j, (_, m, shape) in enumerate(emitted):
        if m == "atomic":  # the atomics accumulate into zero-initialised buffers aliased to the outputs
            aliases[len(args)] = 1 + j
            args = args + (jnp.zeros(shape, jnp.float32),)
    out_shape = (jax.ShapeDtypeStruct((b, c, hp, dp), jnp.float32),) + tuple(
        jax.ShapeDtypeStruct(shape, jnp.float32) for _, _, shape in emitted)
    res = pl.pallas_call(
        kernel, grid=(b * c, n_hb), out_shape=out_shape,
        input_output_aliases=aliases, compiler_params=_params(num_warps, num_stages), interpret=interpret,
        name="csa2_sparse_attention_bwd" if emitted else "csa2_sparse_attention_bwd_dq",
    )(*args)
    dq = res[0]
    grads_kv = [None, None]
    bidx = jnp.repeat(jnp.arange(b), c)[:, None]
    for (i, m, _), g in zip(emitted, res[1:]):
        if m == "atomic":
            grads_kv[i] = g
        elif i == 0:
            wrows = jnp.clip(wstart.reshape(b * c, 1) + jnp.arange(n_w * bk)[None, :], 0, s_len - 1)
            grads_kv[0] = jnp.zeros((b, s_len, dp), jnp.float32).at[bidx, wrows].add(jnp.sum(g, axis=1))
        else:
            t = jnp.arange(max(n_c, 1) * bk)
            crows = jnp.where(t[None, :] < kk, topk.reshape(b * c, kk)[:, jnp.minimum(t, kk - 1)], -1)
            grads_kv[1] = jnp.zeros((b, n, dp), jnp.float32).at[bidx, jnp.clip(crows, 0, n - 1)].add(
                jnp.where((crows >= 0)[..., None], jnp.sum(g, axis=1), 0.0))
    if "by_key" in modes:
        wide = jnp.dtype(q.dtype).itemsize >= 4
        kbk = max(16, _pow2(key_block or (16 if wide else 32)))
        kbh = max(16, min(_pow2(key_block_h or (16 if wide else 32)), hp))
        while hp % kbh:
            kbh //= 2
        k_hb = hp // kbh

        def splits(rows):  # enough programs for a few waves of a 132-SM GPU, at most 8 partial tiles per row
            if key_splits:
                return key_splits
            progs = b * (-(-rows // kbk)) * k_hb
            return int(max(1, min(8, -(-528 // progs))))

        common = dict(scale=scale, bk=kbk, bh=kbh, num_warps=key_warps, num_stages=key_stages, interpret=interpret)
        if modes[0] == "by_key":
            grads_kv[0] = _dkv_by_key(qq, do, lse_p, delta_p, wkv_p,
                                      lists=_window_query_ranges(wstart, wspan, s_len, kbk),
                                      window_args=(q_pos.astype(jnp.int32), wpos.astype(jnp.int32), wstart,
                                                   floor.astype(jnp.int32), qseg.astype(jnp.int32),
                                                   wseg.astype(jnp.int32), window, wspan),
                                      n_split=splits(s_len), **common)
        if modes[1] == "by_key" and has_cmp:
            grads_kv[1] = _dkv_by_key(qq, do, lse_p, delta_p, ckv_p, lists=_key_block_groups(topk, n, kbk),
                                      window_args=None, n_split=splits(n), **common)
    dw, dc = grads_kv
    dq = dq[:, :, :h, :d].astype(q.dtype)
    dw = dw[..., :d].astype(wkv.dtype)
    dc = None if ckv_in is None else (dc[..., :d].astype(ckv_in.dtype) if has_cmp else jnp.zeros_like(ckv_in))
    return dq, dw, dc, dsink.astype(sink.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Indexer: streamed scoring -> block / superblock maxima
# ----------------------------------------------------------------------------------------------------------------

def _packed_keys(keys, keys_fmt, keys_dtype, di, what, packed_load="tile"):
    """(n, keys operands, row loader) of an indexer kernel's key table: plain [B, N, di], or packed (values,
    scales) in ``keys_fmt`` dequantised in registers to ``keys_dtype`` (the packed buffer's read dtype)."""
    if keys_fmt is None:
        def load(k_refs, bi, rows, cols, valid):
            return pltr.load(k_refs[0].at[bi, rows[:, None], cols], mask=valid[:, None], other=0)

        return keys.shape[1], (keys,), load
    _check_packed(keys, keys_fmt, di, what)
    dt = jnp.dtype(keys_dtype or jnp.float32)

    _check_load(packed_load)

    def load_packed(k_refs, bi, rows, cols, valid):
        return packed_rows(*k_refs, bi, rows, 0, cols.shape[-1], valid, fmt=keys_fmt, dim=di, how=packed_load,
                           dtype=dt)

    return keys[0].shape[1], tuple(keys), load_packed


@functools.partial(jax.jit, static_argnames=("g1", "g2", "block_q", "tile", "tiles_per_program", "num_warps",
                                             "num_stages", "keys_fmt", "keys_dtype", "packed_load", "interpret"))
def score_pool(q, w, keys, vis, *, g1: int, g2: int = 8, block_q: int | None = None, tile: int = 256,
               tiles_per_program: int | None = None, num_warps: int = 4, num_stages: int = 3,
               keys_fmt: str | None = None, keys_dtype: str | None = None, packed_load: str = "tile",
               interpret: bool = False):
    """q [B, C, Hi, di], w [B, C, Hi] (already × Hi^-½), keys [B, N, di], vis [B, C] visible counts ->
    (bmax [B, C, ceil(N/g1)], smax [B, C, ceil(N/(g1·g2))]) fp32, -inf where nothing visible.
    ``keys_fmt``: keys is a packed buffer (values, scales) in that format, read as ``keys_dtype`` (``packed_load``:
    how, ``PACKED_LOADS``)."""
    b, c, hi, di = q.shape
    n, key_ops, load_keys = _packed_keys(keys, keys_fmt, keys_dtype, di, "score_pool keys", packed_load)
    assert g1 & (g1 - 1) == 0 and g2 & (g2 - 1) == 0, "block sizes must be powers of two"
    sup = g1 * g2
    nb, ns = -(-n // g1), -(-n // sup)
    bn = max(_pow2(tile), sup)
    bq = _pow2(block_q or min(4, c))
    cp = -(-c // bq) * bq
    hip, dip = max(_pow2(hi), 16 // bq if bq < 16 else 1), max(16, _pow2(di))
    if (cp, hip, dip) != (c, hi, di):
        q = jnp.pad(q, ((0, 0), (0, cp - c), (0, hip - hi), (0, dip - di)))
        w = jnp.pad(w, ((0, 0), (0, cp - c), (0, hip - hi)))
        vis = jnp.pad(vis, ((0, 0), (0, cp - c)))
    if dip != di and keys_fmt is None:
        key_ops = (jnp.pad(keys, ((0, 0), (0, 0), (0, dip - di))),)
    nk = len(key_ops)
    n_tiles = -(-n // bn)
    if tiles_per_program is None:  # enough programs to fill the GPU twice, long enough to stream well
        tiles_per_program = max(1, min(16, (n_tiles * b * (cp // bq)) // 1024))
    tpp = max(1, min(tiles_per_program, n_tiles))
    n_prog = -(-n_tiles // tpp)
    scale = di ** -0.5
    prec = _prec(q.dtype)
    tb, ts = bn // g1, bn // sup

    def kernel(q_ref, w_ref, *refs):
        k_refs, (vis_ref, bmax_ref, smax_ref) = refs[:nk], refs[nk:]
        bi = pl.program_id(0)
        q0 = pl.program_id(1) * bq
        sg = pl.program_id(2)
        qm = q_ref[bi, pl.ds(q0, bq), :, :].reshape(bq * hip, dip)
        wv = w_ref[bi, pl.ds(q0, bq), :].reshape(bq * hip).astype(jnp.float32)
        vv = vis_ref[bi, pl.ds(q0, bq)]
        cols = jnp.arange(dip)[None, :]

        def body(t, carry):
            base = (sg * tpp + t) * bn
            rows = base + jnp.arange(bn)
            inb = rows < n
            kmat = load_keys(k_refs, bi, jnp.minimum(rows, n - 1), cols, inb)
            dots = jnp.maximum(_dot_nt(qm, kmat, prec), 0.0) * scale * wv[:, None]  # [bq·hi, bn]
            s = jnp.sum(dots.reshape(bq, hip, bn), axis=1)
            s = jnp.where(rows[None, :] < vv[:, None], s, NEG_INF)
            bm = jnp.max(s.reshape(bq, tb, g1), axis=2)
            sm = jnp.max(bm.reshape(bq, ts, g2), axis=2)
            bmax_ref[bi, pl.ds(q0, bq), pl.ds(base // g1, tb)] = bm
            smax_ref[bi, pl.ds(q0, bq), pl.ds(base // sup, ts)] = sm
            return carry

        hi_t = jnp.minimum(tpp, n_tiles - sg * tpp)
        # Tiles past every query's visible count are not read: they only get -inf maxima, so a decode step over a
        # long, mostly empty cache streams only the entries its context holds.
        needed = (jnp.max(vv) + bn - 1) // bn - sg * tpp
        live = jnp.clip(needed, 0, hi_t)
        jax.lax.fori_loop(0, live, body, jnp.int32(0))

        def blank(t, carry):
            base = (sg * tpp + t) * bn
            bmax_ref[bi, pl.ds(q0, bq), pl.ds(base // g1, tb)] = jnp.full((bq, tb), NEG_INF, jnp.float32)
            smax_ref[bi, pl.ds(q0, bq), pl.ds(base // sup, ts)] = jnp.full((bq, ts), NEG_INF, jnp.float32)
            return carry

        jax.lax.fori_loop(live, hi_t, blank, jnp.int32(0))

    bmax, smax = pl.pallas_call(
        kernel, grid=(b, cp // bq, n_prog),
        out_shape=(jax.ShapeDtypeStruct((b, cp, n_prog * tpp * tb), jnp.float32),
                   jax.ShapeDtypeStruct((b, cp, n_prog * tpp * ts), jnp.float32)),
        compiler_params=_params(num_warps, num_stages), interpret=interpret, name="indexer_score_pool",
    )(q, w, *key_ops, vis.astype(jnp.int32))
    return bmax[:, :c, :nb], smax[:, :c, :ns]


@functools.partial(jax.jit, static_argnames=("tile", "num_warps", "num_stages", "keys_fmt", "keys_dtype",
                                             "packed_load", "interpret"))
def gather_score(q, w, keys, vis, cand, *, tile: int = 128, num_warps: int = 4, num_stages: int = 3,
                 keys_fmt: str | None = None, keys_dtype: str | None = None, packed_load: str = "tile",
                 interpret: bool = False):
    """Scores of explicit entries: cand [B, C, M] entry ids (-1 = none) -> [B, C, M] fp32 (-inf: none/invisible).
    ``keys_fmt`` / ``keys_dtype``: packed keys, as in :func:`score_pool`."""
    b, c, hi, di = q.shape
    n, key_ops, load_keys = _packed_keys(keys, keys_fmt, keys_dtype, di, "gather_score keys", packed_load)
    m = cand.shape[-1]
    hip, dip = max(16, _pow2(hi)), max(16, _pow2(di))
    if (hip, dip) != (hi, di):
        q = jnp.pad(q, ((0, 0), (0, 0), (0, hip - hi), (0, dip - di)))
        w = jnp.pad(w, ((0, 0), (0, 0), (0, hip - hi)))
    if dip != di and keys_fmt is None:
        key_ops = (jnp.pad(keys, ((0, 0), (0, 0), (0, dip - di))),)
    nk = len(key_ops)
    bn = min(_pow2(tile), _pow2(m))
    mp = -(-m // bn) * bn
    if mp != m:
        cand = jnp.pad(cand, ((0, 0), (0, 0), (0, mp - m)), constant_values=-1)
    scale = di ** -0.5
    prec = _prec(q.dtype)

    def kernel(q_ref, w_ref, *refs):
        k_refs, (vis_ref, cand_ref, out_ref) = refs[:nk], refs[nk:]
        r = pl.program_id(0)
        bi = r // c
        ci = r % c
        t = pl.program_id(1)
        qm = q_ref[bi, ci, :, :]
        wv = w_ref[bi, ci, :].astype(jnp.float32)
        vv = vis_ref[bi, ci]
        ids = cand_ref[bi, ci, pl.ds(t * bn, bn)]
        valid = (ids >= 0) & (ids < vv)
        kmat = load_keys(k_refs, bi, jnp.clip(ids, 0, n - 1), jnp.arange(dip)[None, :], valid)
        dots = jnp.maximum(_dot_nt(qm, kmat, prec), 0.0) * scale * wv[:, None]  # [hi, bn]
        s = jnp.sum(dots, axis=0)
        out_ref[bi, ci, pl.ds(t * bn, bn)] = jnp.where(valid, s, NEG_INF)

    out = pl.pallas_call(kernel, grid=(b * c, mp // bn), out_shape=jax.ShapeDtypeStruct((b, c, mp), jnp.float32),
                         compiler_params=_params(num_warps, num_stages), interpret=interpret,
                         name="indexer_gather_score")(q, w, *key_ops, vis.astype(jnp.int32), cand.astype(jnp.int32))
    return out[..., :m]


# ----------------------------------------------------------------------------------------------------------------
# Exact top-k selection of candidates held in registers
# ----------------------------------------------------------------------------------------------------------------

def _ordered_int(v):
    """float32 -> int32 with the same (total) order: -0.0 < +0.0, like lax.top_k."""
    i = jax.lax.bitcast_convert_type(v, jnp.int32)
    return i ^ ((i >> 31) & 0x7FFFFFFF)


@functools.partial(jax.jit, static_argnames=("k", "num_warps", "interpret"))
def select(vals, ids, k: int, *, num_warps: int | None = None, interpret: bool = False):
    """vals [.., M] fp32, ids [.., M] int32 (ascending among valid) -> [.., min(k, M)] ascending ids, -1 padded.

    Ranking: value descending, candidate position ascending (= lax.top_k); -inf / NaN never selected."""
    lead = vals.shape[:-1]
    m = vals.shape[-1]
    kk = min(k, m)
    if kk == 0:
        return jnp.full(lead + (0,), -1, jnp.int32)
    if m > SELECT_MAX:
        raise ValueError(f"select holds at most {SELECT_MAX} candidates per row, got {m}")
    rows = math.prod(lead)
    mp = max(16, _pow2(m))
    kp = max(16, _pow2(kk))
    v2 = vals.reshape(rows, m).astype(jnp.float32)
    i2 = ids.reshape(rows, m).astype(jnp.int32)
    if mp != m:
        v2 = jnp.pad(v2, ((0, 0), (0, mp - m)), constant_values=NEG_INF)
        i2 = jnp.pad(i2, ((0, 0), (0, mp - m)), constant_values=-1)
    warps = num_warps or (4 if mp <= 2048 else 8 if mp <= 4096 else 16)

    def kernel(v_ref, i_ref, o_ref):
        r = pl.program_id(0)
        v = v_ref[r, :]
        idv = i_ref[r, :]
        valid = v > NEG_INF  # False for NaN too
        key = _ordered_int(v)
        tau = jnp.int32(0)  # unsigned bit pattern of the k-th largest, built MSB first
        for bit in range(31, -1, -1):
            cand = tau | jnp.int32(_INT_MIN if bit == 31 else 1 << bit)
            cnt = jnp.sum((valid & (key >= (cand ^ jnp.int32(_INT_MIN)))).astype(jnp.int32))
            tau = jnp.where(cnt >= kk, cand, tau)
        tau = tau ^ jnp.int32(_INT_MIN)
        gt = valid & (key > tau)
        n_gt = jnp.sum(gt.astype(jnp.int32))
        eq = (valid & (key == tau)).astype(jnp.int32)
        eq_rank = jnp.cumsum(eq) - eq
        sel = gt | ((eq > 0) & (eq_rank < kk - n_gt))
        # fewer than k valid: tau ends at the bottom and every valid candidate is `gt`
        seli = sel.astype(jnp.int32)
        pos = jnp.cumsum(seli) - 1
        n_sel = jnp.sum(seli)
        # unselected candidates aim past the k slots (unique targets: masked lanes never collide with kept ones)
        pltr.store(o_ref.at[r, jnp.where(sel, pos, kp + jnp.arange(mp))], idv, mask=sel)
        slots = jnp.arange(kp)
        pltr.store(o_ref.at[r, slots], jnp.full((kp,), -1, jnp.int32), mask=slots >= n_sel)

    out = pl.pallas_call(kernel, grid=(rows,), out_shape=jax.ShapeDtypeStruct((rows, kp + mp), jnp.int32),
                         compiler_params=_params(warps, 1), interpret=interpret, name="topk_select")(v2, i2)
    return out[:, :kk].reshape(lead + (kk,))
