"""Looking inside a forward pass (the research notebooks): each CSA2 layer's indexer scores, HSI pool and
selection re-derived with the model's own functions from the attention-site inputs that
``forward(..., return_site_inputs=True)`` returns, and the attention mass a layer's own queries put on every
compressed entry of its group.

Everything here composes ``ops.compressor`` / ``ops.indexer`` / ``ops.attention`` exactly as the forward does
(contiguous sequences from position 0, no packing), so :func:`selections` reproduces the forward's ``topk`` — the
notebooks' tests check that — and the variations (another pool size, a Reuse layer's own preference) change one
thing only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.config import ModelConfig
from dsv41_jax.ops.attention import attention_inputs
from dsv41_jax.ops.compressor import compress_sequence, compressed_entries
from dsv41_jax.ops.indexer import (candidate_blocks, indexer_queries, indexer_scores, mask_invisible,
                                   restrict_to_pool, select_topk)
from dsv41_jax.ops.rope import cos_sin, rope_tables
from dsv41_jax.plan import FULL, REUSE

_HI = jax.lax.Precision.HIGHEST


def _quant(config: ModelConfig, quant_on: bool | None) -> bool:
    return config.quant_sim if quant_on is None else quant_on


def _positions(x: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])


def _site_input(site_inputs: dict, layer: int) -> jax.Array:
    if layer not in site_inputs:
        raise KeyError(f"no attention-site input for layer {layer}: run forward(..., return_site_inputs=True) and "
                       f"pass aux['site_inputs']")
    return site_inputs[layer]


def compressed_group(params: dict, config: ModelConfig, site_inputs: dict, source: int, *,
                     quant_on: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(compressed KV [B, N, D] as attention reads it, indexer keys [B, N, di]) of the KV source ``source``."""
    spec = config.plan[source]
    if spec.mode != FULL:
        raise ValueError(f"layer {source} is a {spec.mode} layer, not a KV source (Full)")
    c = config
    p = params["layers"][source]["attn"]
    latent = compress_sequence(_site_input(site_inputs, source), p["compressor"], spec.ratio, c.rms_norm_eps)
    entry_pos = (jnp.arange(latent.shape[1]) * spec.ratio)[None, :]
    ccos, csin = cos_sin(jnp.asarray(rope_tables(c)["compress"]), entry_pos)
    return compressed_entries(latent, p["indexer"], ccos, csin, c.rms_norm_eps, _quant(c, quant_on))


def indexer_scores_of(params: dict, config: ModelConfig, site_inputs: dict, layer: int, *,
                      quant_on: bool | None = None) -> jax.Array:
    """Scores [B, T, N] float32 the indexer of ``layer`` (Full or Reindex) gives every compressed entry of its KV
    group (SPEC §5: Σ_h w_h · ReLU(q_h · k_s)); entries a query may not see are −inf."""
    spec = config.plan[layer]
    if not spec.runs_indexer:
        raise ValueError(f"layer {layer} is a {spec.mode} layer: it has no indexer")
    c = config
    q_on = _quant(c, quant_on)
    x = _site_input(site_inputs, layer)
    positions = _positions(x)
    p = params["layers"][layer]["attn"]
    cos, sin = cos_sin(jnp.asarray(rope_tables(c)["compress"]), positions)
    q_res, _, _ = attention_inputs(p, x, cos, sin, c, q_on)
    qi, w = indexer_queries(p["indexer"], x, q_res, cos, sin, n_heads=c.index_n_heads, head_dim=c.index_head_dim,
                            quant_on=q_on)
    _, keys = compressed_group(params, c, site_inputs, spec.kv_source, quant_on=q_on)
    return mask_invisible(indexer_scores(qi, w, keys), positions, spec.ratio)


def hsi_pool(scores: jax.Array, config: ModelConfig, *, topk_blocks: int | None = None,
             block_size: int | None = None) -> jax.Array:
    """The HSI candidate pool [B, T, n_blocks] (bool) the candidate source publishes from its scores [B, T, N];
    ``topk_blocks`` / ``block_size`` default to the config's (override them to study smaller or larger pools)."""
    c = config
    ratio = c.plan[c.candidate_source_layer_id].ratio
    return candidate_blocks(scores, _positions(scores), ratio, block_size or c.candidate_block_size,
                            topk_blocks or c.candidate_topk_blocks)


def selections(params: dict, config: ModelConfig, site_inputs: dict, *, quant_on: bool | None = None) -> dict:
    """Per CSA2 layer: {"topk": [B, T, K] entries its attention reads (−1 = empty), "scores": its own indexer
    scores or None for Reuse, "pool": the HSI pool it was restricted to or None} — the forward's rules
    re-applied (Full: own top-k; Reindex: own top-k inside the pool; Reuse: the latest index source's top-k)."""
    c = config
    out: dict = {}
    pool = None
    for spec in c.plan:
        if spec.ratio == 0:
            continue
        if spec.mode == REUSE:
            out[spec.index] = {"topk": out[spec.index_source]["topk"], "scores": None, "pool": None}
            continue
        scores = indexer_scores_of(params, c, site_inputs, spec.index, quant_on=quant_on)
        used_pool = pool if spec.uses_candidates else None
        if spec.candidate_source:
            pool = hsi_pool(scores, c)
        picked = scores if used_pool is None else restrict_to_pool(scores, used_pool, c.candidate_block_size)
        out[spec.index] = {"topk": select_topk(picked, c.index_topk), "scores": scores, "pool": used_pool}
    return out


def attention_mass(params: dict, config: ModelConfig, site_inputs: dict, layer: int, *,
                   quant_on: bool | None = None) -> jax.Array:
    """How a CSA2 layer's OWN attention queries would spread over every visible compressed entry of its group:
    per head a softmax of q·kv·D^-½ over the visible entries, summed over heads, normalised to 1 per query
    ([B, T, N] float32; invisible entries 0; rows with nothing visible all 0). This is the distribution the
    indexer is trained to match (``dsv41_jax.train.loss.indexer_kl_loss``, dense mode), so its top-k is the
    selection an indexer fitted to this layer would aim for — defined for Reuse layers too, which have none."""
    spec = config.plan[layer]
    if spec.ratio == 0:
        raise ValueError(f"layer {layer} has no compressed entries (SWA only)")
    c = config
    q_on = _quant(c, quant_on)
    x = _site_input(site_inputs, layer)
    positions = _positions(x)
    cos, sin = cos_sin(jnp.asarray(rope_tables(c)["compress"]), positions)
    _, q, _ = attention_inputs(params["layers"][layer]["attn"], x, cos, sin, c, q_on)
    kv, _ = compressed_group(params, c, site_inputs, spec.kv_source, quant_on=q_on)
    logits = jnp.einsum("bthd,bnd->bthn", q.astype(jnp.float32), kv.astype(jnp.float32),
                        precision=_HI) * c.head_dim ** -0.5
    visible = jnp.isfinite(mask_invisible(jnp.zeros(logits.shape[:2] + logits.shape[3:]), positions, spec.ratio))
    p = jax.nn.softmax(jnp.where(visible[:, :, None, :], logits, -jnp.inf), axis=-1)
    p = jnp.sum(jnp.where(visible[:, :, None, :], p, 0.0), axis=2)
    return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)


def attended(params: dict, config: ModelConfig, site_inputs: dict, layer: int, topk: jax.Array | None,
             query: int, *, quant_on: bool | None = None) -> tuple[jax.Array, jax.Array | None]:
    """What the attention of ``layer`` actually reads for one query (batch row 0), found by differentiation: the
    window keys [T] and compressed entries [N] (bool) on which its output depends (non-zero gradient of a random
    projection of the output through the real ``ops.attention.sequence_sparse_attention``). ``topk`` [B, T, K]
    is the selection the layer uses (:func:`selections`); None for SWA-only layers."""
    from dsv41_jax.ops.attention import sequence_sparse_attention

    spec = config.plan[layer]
    c = config
    q_on = _quant(c, quant_on)
    x = _site_input(site_inputs, layer)
    positions = _positions(x)
    p = params["layers"][layer]["attn"]
    cos, sin = cos_sin(jnp.asarray(rope_tables(c)[spec.rope]), positions)
    _, q, kv = attention_inputs(p, x, cos, sin, c, q_on)
    comp = compressed_group(params, c, site_inputs, spec.kv_source, quant_on=q_on)[0] if spec.ratio else None
    probe = jax.random.normal(jax.random.PRNGKey(0), q.shape[2:], jnp.float32)

    def read(kv_, comp_):
        out = sequence_sparse_attention(q, kv_, positions, comp_, topk, p["attn_sink"], window=c.sliding_window)
        return jnp.sum(out[0, query].astype(jnp.float32) * probe)

    if comp is None:
        return jnp.any(jax.grad(read)(kv, None)[0] != 0, axis=-1), None
    g_kv, g_comp = jax.grad(read, argnums=(0, 1))(kv, comp)
    return jnp.any(g_kv[0] != 0, axis=-1), jnp.any(g_comp[0] != 0, axis=-1)
