"""Exact hierarchical top-k for the indexer, shared by every backend.

The scoring kernels never write the [queries, N] score matrix. They stream the keys once and write only per-block
maxima: ``bmax`` over blocks of ``G1`` entries (G1 = the HSI ``candidate_block_size``, so these ARE the HSI block
scores) and ``smax`` over superblocks of ``G2`` blocks (G1·G2 entries) — 1/G1 + 1/(G1·G2) of the score bytes.

Exactness (ranking = value descending, then position ascending, like ``lax.top_k``): if an element is in the
top-k, its block is among the top-k blocks ranked by (block max, block index) — otherwise k blocks rank above
it, each holding an element that ranks above the element. The same holds for superblocks over blocks. So

    top-k superblocks (of N/(G1·G2))  ->  their G2·k blocks  ->  top-k blocks  ->  their G1·k entries
    ->  re-score those G1·k entries from the keys (a gather of G1·k rows, O(k), not O(N))  ->  top-k entries

returns exactly the reference's index set. The HSI pool is the same walk with k = candidate_topk_blocks, stopping
at blocks, with the newest block (and its superblock) pinned to +inf as in ``ops.indexer.candidate_blocks``.

Every selection step takes candidates in ascending position order (invalid = -inf / id -1 anywhere), so "lower
index wins" ties and "sorted by position" output come for free. Backends supply ``select(vals, ids, k)`` (top-k of
[.., M] candidates -> [.., min(k, M)] ascending ids, -1 padded) and ``leaf_score(entries)`` (scores of explicit
entry ids, -inf where id < 0 or invisible).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf
G2 = 8  # blocks per superblock

Select = Callable[[jax.Array, jax.Array, int], jax.Array]


def select_xla(vals: jax.Array, ids: jax.Array, k: int) -> jax.Array:
    """Reference selection with ``lax.top_k`` (ties -> lower candidate position, which is the lower id)."""
    m = vals.shape[-1]
    kk = min(k, m)
    if kk == 0:
        return jnp.full(vals.shape[:-1] + (0,), -1, jnp.int32)
    v, p = jax.lax.top_k(vals, kk)
    big = jnp.iinfo(jnp.int32).max
    sel = jnp.where(v > NEG_INF, jnp.take_along_axis(ids, p, axis=-1), big)
    sel = jnp.sort(sel, axis=-1)
    return jnp.where(sel == big, -1, sel).astype(jnp.int32)


def _fit(x: jax.Array, width: int) -> jax.Array:
    """Slice or -1-pad the last axis to ``width``."""
    w = x.shape[-1]
    if w >= width:
        return x[..., :width]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - w)], constant_values=-1)


def _children(parent: jax.Array, fan: int, limit: int) -> jax.Array:
    """[.., P] parent ids (-1 = none) -> [.., P·fan] child ids (ascending where parents are), -1 outside."""
    ch = parent[..., None] * fan + jnp.arange(fan, dtype=jnp.int32)
    ok = (parent[..., None] >= 0) & (ch < limit)
    return jnp.where(ok, ch, -1).reshape(*parent.shape[:-1], parent.shape[-1] * fan)


def _take(values: jax.Array, ids: jax.Array) -> jax.Array:
    got = jnp.take_along_axis(values, jnp.maximum(ids, 0), axis=-1)
    return jnp.where(ids >= 0, got, NEG_INF)


def top_blocks(bmax: jax.Array, smax: jax.Array, k: int, select: Select, direct_max: int = 8192) -> jax.Array:
    """Exact top-k blocks (ascending ids, -1 padded, width min(k, n_blocks)) from block / superblock maxima."""
    nb, ns = bmax.shape[-1], smax.shape[-1]
    width = min(k, nb)
    if width == 0:
        return jnp.full(bmax.shape[:-1] + (0,), -1, jnp.int32)
    if nb <= max(k, direct_max):  # small: select over the blocks directly
        ids = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), bmax.shape)
        return _fit(select(bmax, ids, k), width)
    sids = jnp.broadcast_to(jnp.arange(ns, dtype=jnp.int32), smax.shape)
    sup = select(smax, sids, k)
    cand = _children(sup, G2, nb)
    return _fit(select(_take(bmax, cand), cand, k), width)


def top_entries(bmax: jax.Array, smax: jax.Array, n: int, g1: int, k: int, select: Select,
                leaf_score: Callable[[jax.Array], jax.Array], direct_max: int = 8192) -> jax.Array:
    """Exact top-k entries [.., min(k, n)] (ascending, -1 padded) given the maxima and a leaf re-scorer."""
    width = min(k, n)
    if width == 0:
        return jnp.full(bmax.shape[:-1] + (0,), -1, jnp.int32)
    blocks = top_blocks(bmax, smax, k, select, direct_max)
    cand = _children(blocks, g1, n)
    return _fit(select(leaf_score(cand), cand, k), width)


def pin_newest(bmax: jax.Array, smax: jax.Array, newest: jax.Array):
    """Set the newest visible block (and its superblock) to +inf; newest [B, C] (-1 = none)."""
    nb, ns = bmax.shape[-1], smax.shape[-1]
    bpin = jnp.where(jnp.arange(nb) == newest[..., None], jnp.inf, bmax)
    sn = jnp.where(newest >= 0, newest // G2, -1)
    spin = jnp.where(jnp.arange(ns) == sn[..., None], jnp.inf, smax)
    return bpin, spin


def pool_entries(pool_ids: jax.Array, g1: int, n: int) -> jax.Array:
    """[.., P] pool block ids -> [.., P·g1] candidate entry ids (ascending, -1 padded)."""
    return _children(pool_ids, g1, n)


def select_in_pool(scores: jax.Array, cand: jax.Array, g1: int, k: int, n: int, select: Select,
                   direct_max: int = 8192) -> jax.Array:
    """Top-k over pooled candidates (scores/cand [.., P·g1], blocks of g1 contiguous entries) -> [.., min(k, n)]."""
    width = min(k, n)
    m = cand.shape[-1]
    if width == 0:
        return jnp.full(cand.shape[:-1] + (0,), -1, jnp.int32)
    if m <= direct_max:
        return _fit(select(scores, cand, k), width)
    p = m // g1
    bvals = jnp.max(scores.reshape(*scores.shape[:-1], p, g1), axis=-1)
    bpos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), bvals.shape)
    bvals = jnp.where(cand.reshape(*cand.shape[:-1], p, g1)[..., 0] >= 0, bvals, NEG_INF)
    kb = select(bvals, bpos, k)  # positions within the pool, ascending
    sub = _children(kb, g1, m)  # candidate-slot positions
    sub_scores = _take(scores, sub)
    sub_ids = jnp.where(sub >= 0, jnp.take_along_axis(cand, jnp.maximum(sub, 0), axis=-1), -1)
    sub_scores = jnp.where(sub_ids >= 0, sub_scores, NEG_INF)
    return _fit(select(sub_scores, sub_ids, k), width)
