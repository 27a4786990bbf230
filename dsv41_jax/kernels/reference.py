"""Plain-JAX reference backend of the kernel dispatch (the definition of correct; runs everywhere, differentiable).

Thin wrappers around ``dsv41_jax.ops.attention`` / ``dsv41_jax.ops.indexer`` (whose semantics are NOT changed here),
plus the HSI pool format helpers shared by every backend:

* ``mask`` pool: ``[B, C, n_blocks]`` bool (what ``ops.indexer.candidate_blocks`` returns; O(N) per query);
* ``ids`` pool: ``[B, C, P]`` int32 kept block ids, ascending, ``-1`` padded, ``P = min(candidate_topk_blocks,
  n_blocks)`` (O(1) in N per query: what the kernels produce and consume, so a Reindex layer never touches O(N) data).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.ops import attention as _attn
from dsv41_jax.ops import indexer as _idx

NEG_INF = -jnp.inf


def sparse_attention(q, q_pos, win_kv, win_pos, compressed_kv, topk, sink, *, window, floor=0, scale=None, **seg):
    return _attn.sparse_attention(q, q_pos, win_kv, win_pos, compressed_kv, topk, sink, window=window, floor=floor,
                                  scale=scale, **seg)


def sequence_sparse_attention(q, kv, positions, compressed_kv, topk, sink, *, window, floor=0, chunk=256, **seg):
    return _attn.sequence_sparse_attention(q, kv, positions, compressed_kv, topk, sink, window=window, floor=floor,
                                           chunk=chunk, **seg)


def pool_ids_to_mask(ids: jax.Array, n_blocks: int) -> jax.Array:
    """[B, C, P] kept block ids (-1 padded) -> [B, C, n_blocks] bool."""
    hit = ids[..., None] == jnp.arange(n_blocks, dtype=ids.dtype)
    return jnp.any(hit & (ids[..., None] >= 0), axis=-2)


def pool_mask_to_ids(mask: jax.Array, width: int) -> jax.Array:
    """[B, C, n_blocks] bool -> [B, C, width] ascending kept block ids, -1 padded (the first ``width`` kept)."""
    n = mask.shape[-1]
    width = min(width, n)
    if width == 0:
        return jnp.zeros(mask.shape[:-1] + (0,), jnp.int32)
    key = jnp.where(mask, jnp.arange(n), n)
    ids = -jax.lax.top_k(-key, width)[0]  # the `width` smallest kept ids, ascending
    return jnp.where(ids >= n, -1, ids).astype(jnp.int32)


def indexer_topk(q, weights, keys, q_pos, *, ratio, topk, pool=None, block_size=8, candidate_topk_blocks=None,
                 pool_format="mask"):
    """``ops.indexer.indexer_topk`` with the pool accepted / returned in either format (see module doc)."""
    n = keys.shape[1]
    n_blocks = -(-n // block_size)
    if pool is not None and jnp.issubdtype(pool.dtype, jnp.integer):
        pool = pool_ids_to_mask(pool, n_blocks)
    sel, new_pool = _idx.indexer_topk(q, weights, keys, q_pos, ratio=ratio, topk=topk, pool=pool,
                                      block_size=block_size, candidate_topk_blocks=candidate_topk_blocks)
    if new_pool is not None and pool_format == "ids":
        new_pool = pool_mask_to_ids(new_pool, candidate_topk_blocks)
    return sel, new_pool
