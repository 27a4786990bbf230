"""CSA2 indexer and the hierarchical sparse indexer (HSI), plain-JAX reference.

Score of query t for compressed entry s (SPEC §5):  I[t, s] = Σ_h w_h(t) · ReLU(q_h(t) · k_s) · d_i^-0.5,
with w_h = weights_proj(x)_h · H_i^-0.5, visible iff s < (t + 1) // ratio. The top ``index_topk`` visible entries
are selected, returned sorted by position with -1 in empty slots.

HSI: the candidate-source layer max-pools its scores over blocks of ``candidate_block_size`` entries, pins the
block holding the newest visible entry, keeps the top ``candidate_topk_blocks`` blocks (dropping -inf picks) and
publishes that block mask; every later index source (Reindex) masks its scores outside the pool before its top-k.
Pools are kept at block granularity ([.., n_blocks] booleans), never as a dense [T, N] mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.ops import quant
from dsv41_jax.ops.linear import linear
from dsv41_jax.ops.rope import apply_rope

_HI = jax.lax.Precision.HIGHEST
NEG_INF = -jnp.inf


def indexer_queries(ip: dict, x: jax.Array, q_res: jax.Array, cos: jax.Array, sin: jax.Array, *, n_heads: int,
                    head_dim: int, quant_on: bool) -> tuple[jax.Array, jax.Array]:
    """The indexer's queries and head weights from the layer's attention-site input ``x`` [B, T, d] and its q LoRA
    residual ``q_res``: (q [B, T, Hi, di] with the compress RoPE (cos / sin [B, T, r/2]) and, with the release's
    fake quantisation, FP4 e2m1 / ue8m0 block-32 rounding; w [B, T, Hi] float32 = weights_proj(x) · Hi^-½)."""
    b, t, _ = x.shape
    q = linear(q_res, ip["wq_b"]).reshape(b, t, n_heads, head_dim)
    q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    if quant_on:
        q = quant.fake_quant_fp4_e2m1_block(q, 32, scale_format="ue8m0")
    w = linear(x, ip["weights_proj"]).astype(jnp.float32) * (n_heads ** -0.5)
    return q, w


def indexer_scores(q: jax.Array, weights: jax.Array, keys: jax.Array) -> jax.Array:
    """q [B, C, Hi, di] (rotated), weights [B, C, Hi] (already × Hi^-0.5), keys [B, N, di] -> [B, C, N] fp32."""
    di = q.shape[-1]
    dots = jnp.einsum("bchd,bnd->bchn", q.astype(jnp.float32), keys.astype(jnp.float32), precision=_HI)
    dots = jax.nn.relu(dots) * (di ** -0.5)
    return jnp.einsum("bchn,bch->bcn", dots, weights.astype(jnp.float32), precision=_HI)


def visible_counts(q_pos: jax.Array, ratio: int) -> jax.Array:
    """Number of compressed entries a query at ``q_pos`` may see: (q_pos + 1) // ratio."""
    return (q_pos + 1) // ratio


def mask_invisible(scores: jax.Array, q_pos: jax.Array, ratio: int) -> jax.Array:
    entry = jnp.arange(scores.shape[-1])
    return jnp.where(entry[None, None, :] < visible_counts(q_pos, ratio)[..., None], scores, NEG_INF)


def candidate_blocks(scores: jax.Array, q_pos: jax.Array, ratio: int, block_size: int, topk_blocks: int) -> jax.Array:
    """HSI level one. scores [B, C, N] (invisible = -inf) -> kept-block mask [B, C, n_blocks] (bool)."""
    n = scores.shape[-1]
    n_blocks = -(-n // block_size)
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, n_blocks * block_size - n)), constant_values=NEG_INF)
    block_scores = jnp.max(padded.reshape(*scores.shape[:-1], n_blocks, block_size), axis=-1)
    newest = (visible_counts(q_pos, ratio) - 1) // block_size  # -1 when nothing is visible yet
    block_ids = jnp.arange(n_blocks)
    block_scores = jnp.where(block_ids[None, None, :] == newest[..., None], jnp.inf, block_scores)
    k = min(topk_blocks, n_blocks)
    values, picks = jax.lax.top_k(block_scores, k)
    keep_pick = values > NEG_INF
    mask = jnp.zeros(block_scores.shape, bool)
    b_idx = jnp.arange(scores.shape[0])[:, None, None]
    c_idx = jnp.arange(scores.shape[1])[None, :, None]
    return mask.at[b_idx, c_idx, picks].max(keep_pick)


def restrict_to_pool(scores: jax.Array, pool: jax.Array, block_size: int) -> jax.Array:
    """Mask scores [B, C, N] outside the kept blocks pool [B, C, n_blocks]."""
    entry_block = jnp.arange(scores.shape[-1]) // block_size
    in_pool = jnp.take(pool, entry_block, axis=-1)
    return jnp.where(in_pool, scores, NEG_INF)


def select_topk(scores: jax.Array, k: int) -> jax.Array:
    """Top-k entries per query, sorted by position ascending, -1 for empty (-inf) slots: [B, C, k] int32.

    k is clipped to N; callers that need a fixed width pad afterwards.
    """
    n = scores.shape[-1]
    kk = min(k, n)
    if kk == 0:
        return jnp.full(scores.shape[:-1] + (0,), -1, jnp.int32)
    values, idx = jax.lax.top_k(scores, kk)
    idx = jnp.where(values > NEG_INF, idx, n).astype(jnp.int32)  # sort empties last
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx >= n, -1, idx)


def indexer_topk(q: jax.Array, weights: jax.Array, keys: jax.Array, q_pos: jax.Array, *, ratio: int, topk: int,
                 pool: jax.Array | None = None, block_size: int = 8, candidate_topk_blocks: int | None = None):
    """The whole per-query indexer for one chunk of queries.

    Returns (topk_indices [B, C, min(topk, N)], new_pool or None). ``pool`` restricts the selection (Reindex);
    ``candidate_topk_blocks`` makes this the candidate source (its own top-k is NOT restricted).
    """
    scores = mask_invisible(indexer_scores(q, weights, keys), q_pos, ratio)
    new_pool = None
    if candidate_topk_blocks is not None:
        new_pool = candidate_blocks(scores, q_pos, ratio, block_size, candidate_topk_blocks)
    if pool is not None:
        scores = restrict_to_pool(scores, pool, block_size)
    return select_topk(scores, topk), new_pool


# --------------------------------------------------------------------------------------------------------------
# Packed documents (training): several documents share one row, each with its own positions, compressor groups,
# entries and HSI blocks. Compressed entries then live in "slot" space — entry slots are token indices (the slot of
# a group is its first token), so N = T and a document's entries never mix with another's.
# --------------------------------------------------------------------------------------------------------------


def packed_entry_layout(positions: jax.Array, segments: jax.Array, valid: jax.Array, ratio: int, block_size: int):
    """Per-slot entry metadata for packed rows: (rank within the document, HSI block key slot).

    ``positions`` are document-relative. The block key of an entry is the slot of the first entry of its block.
    """
    rank = positions // ratio
    key = jnp.arange(positions.shape[1])[None, :] - (rank % block_size) * ratio
    return {"rank": rank, "segments": segments, "valid": valid, "key": key}


def packed_visible(scores: jax.Array, q_pos: jax.Array, q_seg: jax.Array, entries: dict, ratio: int) -> jax.Array:
    vis = (entries["valid"][:, None, :] & (entries["segments"][:, None, :] == q_seg[:, :, None])
           & (entries["rank"][:, None, :] < visible_counts(q_pos, ratio)[..., None]))
    return jnp.where(vis, scores, NEG_INF)


def packed_candidate_blocks(scores: jax.Array, q_pos: jax.Array, q_index: jax.Array, entries: dict, ratio: int,
                            block_size: int, topk_blocks: int) -> jax.Array:
    """HSI level one in slot space: block scores are scattered onto their key slots; the pool is [B, C, T] bool
    over key slots. Same rules as :func:`candidate_blocks` (newest block pinned, -inf blocks dropped)."""
    b, c, n = scores.shape
    b_idx = jnp.arange(b)[:, None, None]
    c_idx = jnp.arange(c)[None, :, None]
    key = jnp.broadcast_to(entries["key"][:, None, :], scores.shape)
    block_scores = jnp.full(scores.shape, NEG_INF).at[b_idx, c_idx, key].max(scores)
    newest_rank = visible_counts(q_pos, ratio) - 1
    newest_key = q_index - q_pos + newest_rank * ratio - (newest_rank % block_size) * ratio
    newest_key = jnp.where(newest_rank >= 0, newest_key, -1)
    block_scores = jnp.where(jnp.arange(n)[None, None, :] == newest_key[..., None], jnp.inf, block_scores)
    values, picks = jax.lax.top_k(block_scores, min(topk_blocks, n))
    return jnp.zeros(scores.shape, bool).at[b_idx, c_idx, picks].max(values > NEG_INF)


def packed_restrict_to_pool(scores: jax.Array, pool: jax.Array, entries: dict) -> jax.Array:
    key = jnp.broadcast_to(entries["key"][:, None, :], scores.shape)
    return jnp.where(jnp.take_along_axis(pool, key, axis=-1), scores, NEG_INF)


def packed_indexer_topk(q, weights, keys, q_pos, q_seg, q_index, entries: dict, *, ratio: int, topk: int,
                        pool=None, block_size: int = 8, candidate_topk_blocks: int | None = None):
    """:func:`indexer_topk` for packed documents (slot-space entries)."""
    scores = packed_visible(indexer_scores(q, weights, keys), q_pos, q_seg, entries, ratio)
    new_pool = None
    if candidate_topk_blocks is not None:
        new_pool = packed_candidate_blocks(scores, q_pos, q_index, entries, ratio, block_size, candidate_topk_blocks)
    if pool is not None:
        scores = packed_restrict_to_pool(scores, pool, entries)
    return select_topk(scores, topk), new_pool
