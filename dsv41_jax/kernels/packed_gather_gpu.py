"""Fused gather-and-unpack of packed cache rows (Pallas, Triton lowering): the packed cache's "gather" attention
form (``kernels.PACKED_ATTENTION_FORMS``) in one launch per gather instead of XLA's gathers and unpack fusions.

Why: the gather form hands the bf16-cache attention kernel a dense bf16 copy of only the rows it reads. Built by
plain JAX it is three XLA fusions per top-k list (the scales' gather, the bytes' gather with the nibble split, the
e2m1 x e4m3 convert) plus the window ring's unpack and concatenation per layer; on an H200 at batch 32 those ran at
≈ 0.5 TB/s, ≈ 56 µs of a layer's 113 µs (benchmarks/RESULTS.md, 2026-12-03 21:15 UTC). Here each program loads a
block of selected rows' packed bytes and scales as contiguous tiles (``pallas_gpu.load_packed_tile``), decodes them
in registers and writes the rows once.

* :func:`selected_rows`: rows ``clip(idx, 0, N - 1)`` of a packed buffer [B, N, D] -> [B, M, D] in ``dtype``.
* :func:`window_rows`: a packed ring of R slots in window order (row j = slot (base + j) mod R) followed by the
  chunk's own rows ``new`` [B, L, D] -> [B, R + L, D] in ``new.dtype`` (the ring's unpack and the concatenation).

Both equal ``packed_cache.unpack`` of the same rows bit for bit (the decoders' products are exact in float32 and the
rows are cast once, as the unpacker casts them), so the attention over them is unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from dsv41_jax.kernels.pallas_gpu import PACKED_FORMATS, _check_packed, load_packed_tile

BLOCK_ROWS = 32  # rows a program gathers: [32, 512] bf16 is 32 KB written per program, 512 programs at batch 32
NUM_WARPS = 4


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def fits(dim: int, fmt: str) -> bool:
    """Whether these kernels serve rows of ``dim`` values in ``fmt``: a whole row is one tile, whose byte and scale
    counts must be powers of two (Triton's tile shapes)."""
    block, per_byte, _ = PACKED_FORMATS[fmt]
    return dim % block == 0 and _pow2(dim // per_byte) == dim // per_byte and _pow2(dim // block) == dim // block


def _check(vals, scales, fmt, dim, what):
    _check_packed((vals, scales), fmt, dim, what)
    if not fits(dim, fmt):
        raise ValueError(f"{what}: rows of {dim} values in {fmt} are not one power-of-two tile; unpack them instead")


def selected_rows(vals, scales, idx, *, fmt: str, dim: int, dtype, block_rows: int = BLOCK_ROWS,
                  num_warps: int = NUM_WARPS, interpret: bool = False):
    """Packed buffer (values uint8 [B, N, dim / per_byte], scales uint8 [B, N, dim / block]) and row ids idx int
    [B, M] -> the rows ``clip(idx, 0, N - 1)`` unpacked to ``dtype`` [B, M, dim] (an empty entry, -1, reads row 0,
    as the plain-JAX gather does)."""
    _check(vals, scales, fmt, dim, "packed_gather_gpu.selected_rows")
    if idx.ndim != 2 or idx.shape[0] != vals.shape[0] or not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"selected_rows: row ids must be integers [B={vals.shape[0]}, M], got {idx.dtype}"
                         f"{list(idx.shape)}")
    b, n = vals.shape[:2]
    m = idx.shape[1]
    bk = min(_pow2(block_rows), _pow2(max(m, 1)))

    def kernel(idx_ref, v_ref, s_ref, o_ref):
        bi, r = pl.program_id(0), pl.program_id(1) * bk + jnp.arange(bk)
        live = r < m
        rows = jnp.clip(pltr.load(idx_ref.at[bi, jnp.minimum(r, m - 1)]), 0, n - 1)
        x = load_packed_tile(v_ref, s_ref, bi, rows, 0, dim, live, fmt=fmt, dtype=dtype)
        pltr.store(o_ref.at[bi, r[:, None], jnp.arange(dim)[None, :]], x, mask=live[:, None])

    return pl.pallas_call(kernel, grid=(b, pl.cdiv(m, bk)), out_shape=jax.ShapeDtypeStruct((b, m, dim), dtype),
                          compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
                          interpret=interpret, name="packed_selected_rows")(idx.astype(jnp.int32), vals, scales)


def window_rows(vals, scales, base, new, *, fmt: str, ring_dtype, block_rows: int = BLOCK_ROWS,
                num_warps: int = NUM_WARPS, interpret: bool = False):
    """A packed ring (values / scales [B, R, ...]) read in window order from ``base`` [B] (row j = slot (base + j)
    mod R, floor mod) and unpacked to ``ring_dtype``, then the rows ``new`` [B, L, D]: [B, R + L, D] in
    ``new.dtype``, i.e. ``concatenate([ring_rows(ring, base).astype(new.dtype), new], 1)``."""
    b, r_len = vals.shape[:2]
    dim = int(new.shape[-1])
    _check(vals, scales, fmt, dim, "packed_gather_gpu.window_rows")
    if new.ndim != 3 or new.shape[0] != b or jnp.shape(base) != (b,):
        raise ValueError(f"window_rows: need new [B={b}, L, D] and base [B], got {list(new.shape)} and "
                         f"{list(jnp.shape(base))}")
    n_new = int(new.shape[1])
    s_len = r_len + n_new
    bk = min(_pow2(block_rows), _pow2(s_len))

    def kernel(base_ref, v_ref, s_ref, *refs):
        *new_ref, o_ref = refs
        bi, j, cols = pl.program_id(0), pl.program_id(1) * bk + jnp.arange(bk), jnp.arange(dim)
        live, in_ring = j < s_len, j < r_len
        b0 = jax.lax.rem(jax.lax.rem(base_ref[bi], r_len) + r_len, r_len)  # floor mod, as jnp.mod
        slot = jax.lax.rem(b0 + jnp.minimum(j, r_len - 1), r_len)
        x = load_packed_tile(v_ref, s_ref, bi, slot, 0, dim, live & in_ring, fmt=fmt, dtype=ring_dtype)
        x = x.astype(o_ref.dtype)
        if n_new:
            plain = pltr.load(new_ref[0].at[bi, jnp.clip(j - r_len, 0, n_new - 1)[:, None], cols[None, :]],
                              mask=(live & ~in_ring)[:, None], other=0)
            x = jnp.where(in_ring[:, None], x, plain)
        pltr.store(o_ref.at[bi, j[:, None], cols[None, :]], x, mask=live[:, None])

    return pl.pallas_call(kernel, grid=(b, pl.cdiv(s_len, bk)),
                          out_shape=jax.ShapeDtypeStruct((b, s_len, dim), new.dtype),
                          compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
                          interpret=interpret, name="packed_window_rows")(
        jnp.asarray(base, jnp.int32), vals, scales, *((new,) if n_new else ()))
