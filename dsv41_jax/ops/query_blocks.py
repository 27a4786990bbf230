"""Run a function over blocks of queries (axis 1) with ``lax.map``, so per-query buffers (attention gathers,
[queries, heads, entries] indexer scores) stay O(block) instead of O(T)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _split(a: jax.Array, n_blocks: int, block: int) -> jax.Array:
    """[B, T, ...] -> [n_blocks, B, block, ...], zero-padded at the end of axis 1."""
    pad = n_blocks * block - a.shape[1]
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    return jnp.moveaxis(a.reshape(a.shape[0], n_blocks, block, *a.shape[2:]), 1, 0)


def map_query_blocks(fn, t: int, block: int, *arrays):
    """``fn`` over blocks of ``block`` queries of ``arrays`` (query axis 1, length t); the outputs (a pytree of
    [B, block, ...] arrays) are concatenated back on axis 1 and cut to t."""
    if t <= block:
        return fn(*arrays)
    n = -(-t // block)
    outs = jax.lax.map(lambda xs: fn(*xs), tuple(_split(a, n, block) for a in arrays))

    def merge(o):
        o = jnp.moveaxis(o, 0, 1)
        return o.reshape(o.shape[0], n * block, *o.shape[3:])[:, :t]

    return jax.tree.map(merge, outs)


def sum_query_blocks(fn, t: int, block: int, *arrays):
    """Σ over query blocks of ``fn(*block_arrays) -> (sum, count)``; padded queries must contribute nothing."""
    if t <= block:
        return fn(*arrays)
    n = -(-t // block)
    sums, counts = jax.lax.map(lambda xs: fn(*xs), tuple(_split(a, n, block) for a in arrays))
    return jnp.sum(sums), jnp.sum(counts)
