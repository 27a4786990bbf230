"""Pallas GPU kernel (Triton lowering): the input gradient of a narrow float32 projection, dx [M, K] = g [M, N] · w [N, K]
for a few outputs N (the mHC coefficient projection: N = 24, K = 20,480; the router: N = the routed experts).

The contraction is only N long, so every output element is N float32 multiply-adds and the work is one write of dx.
XLA writes it as a sum over the middle axis of the [M, N, K] products (a column reduction through shared memory:
0.755 ms per mHC site of the ``fullwidth4`` train step on an H200, ~4.7x one read + one write; benchmarks/RESULTS.md,
2026-12-02 14:29). Here each program computes a [block_m, block_k] tile of dx as one Triton dot of g's rows (N
zero-padded to a power of two, >= 16) and w's columns at IEEE float32 precision — no TF32: fused multiply-adds on the
CUDA cores, the operands staged once through shared memory. Exact float32 products; only the order (and the single
rounding of each multiply-add) of the N additions differs from a plain sum. Compiled for sm_90 (deviceless, block 64
x 256, 8 warps) each thread issues 2,048 FMAs against 176 shared-memory loads; the same tile written as N rank-1
products issued a separate multiply and add per product and a global load per operand (1,536 + 1,472 + 1,560).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

BLOCK_M = (64, 32, 16)  # the first that divides M
BLOCK_K = (256, 128)  # the first that divides K


def narrow_dx_tiles(m: int, k: int) -> tuple[int, int] | None:
    """(block_m, block_k) for dx [m, k], or None when no tile divides it (the caller then uses an XLA form)."""
    bm = next((b for b in BLOCK_M if m % b == 0), None)
    bk = next((b for b in BLOCK_K if k % b == 0), None)
    return None if bm is None or bk is None else (bm, bk)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def narrow_dx(g: jax.Array, w: jax.Array, *, interpret: bool = False, num_warps: int = 8) -> jax.Array:
    """g float32 [M, N] · w float32 [N, K] -> float32 [M, K] (N small). Needs a tile of ``narrow_dx_tiles``."""
    if g.ndim != 2 or w.ndim != 2 or g.shape[1] != w.shape[0]:
        raise ValueError(f"narrow_dx: want g [M, N] and w [N, K], got {g.shape} and {w.shape}")
    if g.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"narrow_dx: float32 operands only, got {g.dtype} and {w.dtype}")
    m, n = g.shape
    k = w.shape[1]
    tiles = narrow_dx_tiles(m, k)
    if tiles is None:
        raise ValueError(f"narrow_dx: no tile in {BLOCK_M} x {BLOCK_K} divides dx [{m}, {k}]")
    bm, bk = tiles
    npad = max(16, 1 << (n - 1).bit_length())  # a Triton dot's contraction: a power of two, at least 16
    g = jnp.pad(g, ((0, 0), (0, npad - n)))  # zero products: the sum is unchanged
    w = jnp.pad(w, ((0, npad - n), (0, 0)))

    def kernel(g_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(g_ref[...], w_ref[...], precision=jax.lax.Precision.HIGHEST)  # IEEE float32

    return pl.pallas_call(
        kernel, grid=(m // bm, k // bk),
        in_specs=[pl.BlockSpec((bm, npad), lambda i, j: (i, 0)), pl.BlockSpec((npad, bk), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, k), jnp.float32),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="narrow_dx",
    )(g, w)


__all__ = ["narrow_dx", "narrow_dx_tiles"]
