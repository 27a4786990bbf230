"""Pallas GPU kernels (Triton lowering) for the decode step's routed experts when fewer experts are used than exist.

A decode step with few tokens (tokens x top-k < experts: batch 1 and 2 on 16 experts, up to 63 on the release's
384) runs each used expert once, as one *slot* of ``R`` rows (``inference.moe.routed_slots``). Written in XLA, slot
``s``'s weights are ``w[slot_expert[s]]``, a dynamic slice that XLA on a GPU copies out of the stacked weights
before its GEMM (measured on an H200: the copies were 2.4 ms of an 11.1 ms batch-1 step), so every used expert is
read, written and read again. These kernels read the stacked weights in place: the slot's expert id is a scalar
loaded in the kernel and used as the leading index of the weight reference.

* ``slot_swiglu``: per slot, ``act = silu(min(x w1ᵀ, limit)) * clip(x w3ᵀ, ±limit) * row_weight`` — the gate and
  up projections in one pass over ``x`` (two weight streams, float32 accumulators, the activation in the
  epilogue), stored in the activations' dtype (as the XLA path rounds ``act`` before the down projection).
  Grid (slot, column block of the expert width).
* ``slot_down``: per slot, ``y = act w2ᵀ`` in float32. Grid (slot, column block of the model width).

A slot marked not live (a spare slot: fewer distinct experts were picked than slots exist) reads no weights and
writes zeros. Each program streams ``block_n`` weight rows through a K loop of ``block_k`` columns (one contiguous
run of ``2 * block_k`` bytes per row for bf16); rows are padded to at least 16 (the tensor-core dot's minimum),
the slot's unused rows carry zeros. Shapes must divide the blocks (``slot_blocks`` says whether they do; the caller
keeps its XLA path otherwise).

Addressing: the Triton lowering uses 32-bit signed element offsets; a stacked weight of 2^31 elements or more is
refused by ``slot_blocks`` (the caller then keeps the XLA path).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from dsv41_jax.kernels.quant_gemm_gpu import _dot_nt

MIN_ROWS = 16  # the tensor-core dot's smallest M


def _largest_pow2_divisor(n: int, cap: int, floor: int = 16) -> int | None:
    b = cap
    while b >= floor:
        if n % b == 0:
            return b
        b //= 2
    return None


def slot_blocks(rows: int, k: int, n: int, n_elements: int) -> tuple[int, int] | None:
    """(block_n, block_k) for a slot GEMM of ``rows`` rows, reduction ``k``, ``n`` output columns over a stacked
    weight of ``n_elements`` elements; None where the shapes do not divide or the weight is too large to address."""
    if rows % MIN_ROWS or n_elements >= 2 ** 31:
        return None
    bk = _largest_pow2_divisor(k, 256 if rows <= 16 else 128)
    bn = _largest_pow2_divisor(n, 32)
    if bk is None or bn is None:
        return None
    return bn, bk


def _check_blocks(what: str, rows: int, k: int, n: int, block_n: int, block_k: int):
    """The kernels have no tail masking: a shape the blocks do not divide would silently drop columns."""
    if rows % MIN_ROWS or k % block_k or n % block_n:
        raise ValueError(f"{what}: rows {rows} must be a multiple of {MIN_ROWS}, K {k} of block_k {block_k} and N "
                         f"{n} of block_n {block_n} (slot_blocks picks dividing blocks)")


def _silu(g):
    return g / (1.0 + jnp.exp(-g))


@functools.partial(jax.jit, static_argnames=("limit", "block_n", "block_k", "num_warps", "num_stages", "interpret"))
def slot_swiglu(xs, slot_expert, slot_live, slot_wts, w1, w3, *, limit: float, block_n: int, block_k: int,
                num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
    """xs [S, R, K], or [1, 1, K]: one row every slot reads (one token's picks: no broadcast copy of the token
    before the kernel); slot_expert / slot_live int32 [S]; slot_wts float32 [S, R]; w1, w3 [E, F, K]
    -> act [S, R, F] in xs.dtype."""
    s, r = slot_wts.shape
    k = xs.shape[-1]
    shared = xs.shape[:2] == (1, 1)
    if not shared and xs.shape != (s, r, k):
        raise ValueError(f"slot_swiglu: xs must be [{s}, {r}, K] (slot_wts' slots and rows) or [1, 1, K], got "
                         f"{xs.shape}")
    _, f, _ = w1.shape
    bn, bk = block_n, block_k
    _check_blocks("slot_swiglu", r, k, f, bn, bk)
    n_steps = k // bk

    def kernel(se_ref, live_ref, x_ref, wt_ref, w1_ref, w3_ref, o_ref):
        si, ni = pl.program_id(0), pl.program_id(1)
        ex = se_ref[si]
        n0 = ni * bn

        @pl.when(live_ref[si] > 0)
        def _():
            def body(t, accs):
                g, u = accs
                k0 = t * bk
                if shared:  # the one row, broadcast in registers to the tile's rows
                    xc = jnp.broadcast_to(x_ref[0, pl.ds(0, 1), pl.ds(k0, bk)], (r, bk))
                else:
                    xc = x_ref[si, :, pl.ds(k0, bk)]
                # a weight tile in another dtype is cast in registers (no converted copy of the stack)
                g = g + _dot_nt(xc, w1_ref[ex, pl.ds(n0, bn), pl.ds(k0, bk)].astype(xc.dtype))
                u = u + _dot_nt(xc, w3_ref[ex, pl.ds(n0, bn), pl.ds(k0, bk)].astype(xc.dtype))
                return g, u

            zero = jnp.zeros((r, bn), jnp.float32)
            g, u = jax.lax.fori_loop(0, n_steps, body, (zero, zero))
            if limit > 0:
                u = jnp.clip(u, -limit, limit)
                g = jnp.minimum(g, limit)
            act = _silu(g) * u * wt_ref[si, :][:, None]
            o_ref[si, :, pl.ds(n0, bn)] = act.astype(o_ref.dtype)

        @pl.when(live_ref[si] == 0)
        def _():
            o_ref[si, :, pl.ds(n0, bn)] = jnp.zeros((r, bn), o_ref.dtype)

    return pl.pallas_call(
        kernel, grid=(s, f // bn),
        out_shape=jax.ShapeDtypeStruct((s, r, f), xs.dtype),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages), interpret=interpret,
        name="slot_swiglu",
    )(slot_expert, slot_live, xs, slot_wts, w1, w3)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_warps", "num_stages", "interpret"))
def slot_down(act, slot_expert, slot_live, w2, *, block_n: int, block_k: int, num_warps: int = 4,
              num_stages: int = 3, interpret: bool = False):
    """act [S, R, F]; slot_expert / slot_live int32 [S]; w2 [E, N, F] -> [S, R, N] float32."""
    s, r, f = act.shape
    _, n, _ = w2.shape
    bn, bk = block_n, block_k
    _check_blocks("slot_down", r, f, n, bn, bk)
    n_steps = f // bk

    def kernel(se_ref, live_ref, a_ref, w_ref, o_ref):
        si, ni = pl.program_id(0), pl.program_id(1)
        ex = se_ref[si]
        n0 = ni * bn

        @pl.when(live_ref[si] > 0)
        def _():
            def body(t, acc):
                k0 = t * bk
                a = a_ref[si, :, pl.ds(k0, bk)]
                return acc + _dot_nt(a, w_ref[ex, pl.ds(n0, bn), pl.ds(k0, bk)].astype(a.dtype))

            o_ref[si, :, pl.ds(n0, bn)] = jax.lax.fori_loop(0, n_steps, body, jnp.zeros((r, bn), jnp.float32))

        @pl.when(live_ref[si] == 0)
        def _():
            o_ref[si, :, pl.ds(n0, bn)] = jnp.zeros((r, bn), jnp.float32)

    return pl.pallas_call(
        kernel, grid=(s, n // bn),
        out_shape=jax.ShapeDtypeStruct((s, r, n), jnp.float32),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages), interpret=interpret,
        name="slot_down",
    )(slot_expert, slot_live, act, w2)


__all__ = ["slot_swiglu", "slot_down", "slot_blocks", "MIN_ROWS"]
