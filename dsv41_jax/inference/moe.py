"""MoE for inference: the same maths as :func:`dsv41_jax.ops.moe.moe` (router, clamped SwiGLU experts, one shared
expert), with the routed experts run as a tiled grouped matmul in plain JAX.

Assignments (token, expert) are sorted by expert; each expert's rows are cut into tiles of ``tile`` rows, and a
loop over the tiles that exist (a dynamic count) multiplies each tile by its own expert's weights. Only experts
that received tokens are read — a decode step with 6 active experts reads 6 experts' weights — and the work is
the assignments' work rounded up to tiles, not every expert on every token (``dense``). ``jax.lax.ragged_dot``
(``ragged``) computes the same thing but is slow on this JAX's CPU backend (measured: 4-13x slower than dense).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.ops.linear import linear, select_expert
from dsv41_jax.ops.moe import expert_mlp, route

_HI = jax.lax.Precision.HIGHEST


def _tile_rows(assignments: int, n_experts: int) -> int:
    t = 8
    while t < 256 and t * n_experts < assignments:
        t *= 2
    return t


def routed_tiled(x, weights, idx, w1, w2, w3, limit, tile: int | None = None):
    """x [M, d]; weights / idx [M, k] -> [M, d] float32 (sum of the weighted expert outputs)."""
    m, k = idx.shape
    n_exp = w1.shape[0]
    a = m * k
    tile = tile or _tile_rows(a, n_exp)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    wts = weights.reshape(-1)[order].astype(jnp.float32)
    counts = jnp.bincount(flat, length=n_exp).astype(jnp.int32)
    row_start = jnp.cumsum(counts) - counts  # first sorted row of each expert
    tiles = (counts + tile - 1) // tile
    tile_start = jnp.cumsum(tiles) - tiles
    n_tiles = jnp.sum(tiles)
    xs = jnp.pad(x[token], ((0, tile), (0, 0)))
    wts = jnp.pad(wts, (0, tile))
    d = x.shape[-1]

    def body(t, out):
        e = jnp.searchsorted(tile_start, t, side="right") - 1
        e = jnp.clip(e, 0, n_exp - 1)
        r0 = row_start[e] + (t - tile_start[e]) * tile
        rows = jax.lax.dynamic_slice_in_dim(xs, r0, tile, axis=0)
        valid = (r0 + jnp.arange(tile)) < row_start[e] + counts[e]
        # select_expert: only this expert's weights are read (and, in the release's FP4 form, dequantised)
        gate = linear(rows, select_expert(w1, e)).astype(jnp.float32)
        up = linear(rows, select_expert(w3, e)).astype(jnp.float32)
        if limit > 0:
            up = jnp.clip(up, -limit, limit)
            gate = jnp.minimum(gate, limit)
        act = jax.nn.silu(gate) * up * jax.lax.dynamic_slice_in_dim(wts, r0, tile)[:, None]
        y = linear(act.astype(x.dtype), select_expert(w2, e)).astype(jnp.float32)
        y = jnp.where(valid[:, None], y, 0.0)
        old = jax.lax.dynamic_slice_in_dim(out, r0, tile, axis=0)
        return jax.lax.dynamic_update_slice_in_dim(out, old + y, r0, axis=0)

    out = jax.lax.fori_loop(0, n_tiles, body, jnp.zeros((a + tile, d), jnp.float32))
    return jnp.zeros((m, d), jnp.float32).at[token].add(out[:a])


def moe_inference(x: jax.Array, params: dict, *, top_k: int, temp: float, scaling: float, limit: float,
                  normalize: bool = True, tile: int | None = None) -> jax.Array:
    """x [..., d] -> y [..., d] in x.dtype (router + tiled routed experts + the shared expert)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, idx, _ = route(flat, params["gate"]["weight"], params["gate"]["bias"], top_k=top_k, temp=temp,
                            scaling=scaling, normalize=normalize)
    e = params["experts"]
    y = routed_tiled(flat, weights, idx, e["w1"], e["w2"], e["w3"], limit, tile)
    s = params["shared_experts"]
    y = y + expert_mlp(flat, s["w1"], s["w2"], s["w3"], limit).astype(jnp.float32)
    return y.astype(x.dtype).reshape(shape)


__all__ = ["moe_inference", "routed_tiled"]
