"""The training-mode forward: a pure function of (params, tokens) -> float32 logits (SPEC §3–§8).

Per layer: Engram write (Engram layers) -> attention site (single-pass mHC) -> FFN site. Attention keeps its own Q,
SWA K=V, output projection and sink in every mode; CSA2 layers add the compressed entries chosen by the latest
index source. The cross-layer state of one forward (the current group's compressed KV and indexer keys, the
latest top-k, the HSI pool) is threaded explicitly through ``_GroupState``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.params import is_spec, param_specs, validate_params
from dsv41_jax import kernels as _kernels  # sparse attention / indexer dispatch (reference or Pallas)
from dsv41_jax.ops.attention import attention_inputs, attention_output
from dsv41_jax.ops.compressor import compress_packed, compress_sequence, compressed_entries
from dsv41_jax.ops.engram import engram_write
from dsv41_jax.ops.gather import take_rows
from dsv41_jax.ops.indexer import indexer_queries, packed_entry_layout, packed_indexer_topk
from dsv41_jax.ops.mhc import collapse, expand, mhc_coefficients
from dsv41_jax.ops.moe import moe
from dsv41_jax.ops.linear import head_logits
from dsv41_jax.ops.norms import rms_norm
from dsv41_jax.ops.query_blocks import map_query_blocks
from dsv41_jax.ops.rope import cos_sin, rope_tables
from dsv41_jax.parallel.rules import constrain  # sharding hints; no-ops without a sharding context
from dsv41_jax.plan import FULL, REINDEX, LayerSpec

_STREAM_AXES = ("batch", "seq", "streams", "embed")  # logical axes of the mHC residual streams [B, T, hc, d]

# Rematerialisation policies by name (``ForwardOptions.remat_layers``, ``TrainConfig.remat``): what the forward keeps
# for the backward pass; everything else is recomputed from the checkpointed region's inputs.
REMAT_POLICIES = {
    "full": "nothing_saveable",  # keep only the region's inputs
    "dots": "dots_saveable",  # keep every matmul output
    "dots_no_batch": "dots_with_no_batch_dims_saveable",  # keep matmul outputs without batch dimensions
}


def remat_policy(name: str):
    """The ``jax.checkpoint_policies`` member for a policy name of :data:`REMAT_POLICIES`."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {name!r}; choose from {tuple(REMAT_POLICIES)}")
    return getattr(jax.checkpoint_policies, REMAT_POLICIES[name])


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    quant_sim: bool | None = None  # None -> config.quant_sim
    bounded_replay: bool = False  # CED decoder-SWA truncation to the last `replay_len` tokens (SPEC §8)
    replay_len: int | None = None  # None -> sliding_window (128 in the release)
    # "auto" (grouped kernels on GPUs, ragged elsewhere: ops.moe.resolve_moe_impl) | "ragged" | "blocked" | "grouped"
    # | "grouped_mgpu" (all dropless, ops.moe) | "dense" (tests) | "expert_parallel" (mesh)
    moe_impl: str = "auto"
    moe_capacity_factor: float | None = None  # expert_parallel only: None = dropless, else may drop (reported)
    query_chunk: int = 256  # queries per attention / indexer block (memory O(T · chunk))
    kernel_backend: str = "auto"  # dsv41_jax.kernels: auto (Pallas on GPU/TPU, reference on CPU) | reference | ...
    # The release's GEMM-input rounding (SPEC §5, §12): the input of every GEMM whose weight the release stores
    # FP8 / FP4 is rounded to FP8 e4m3 per 32 (ue8m0 scale) first. Weights may be float arrays or QuantizedTensors.
    gemm_input_fp8: bool = False
    # How those GEMMs run on QuantizedTensor weights (with gemm_input_fp8): "reference" (dequantise in XLA, then
    # the GEMM) or a dsv41_jax.kernels.quant_gemm backend ("auto", "pallas_gpu", "pallas_tpu", "*_interpret").
    quantized_gemm: str = "reference"
    # Per-layer rematerialisation: "none", or a REMAT_POLICIES name: every decoder layer runs under jax.checkpoint
    # with that policy, so the backward keeps each layer's inputs (mHC streams, the group state) plus what the
    # policy saves, and recomputes one layer at a time.
    remat_layers: str = "none"
    # ZeRO-3 (``TrainConfig.zero = 3``): the parameters arrive split over the batch axes too; gather each decoder
    # layer's weights to their rule sharding inside the layer (inside its checkpoint, so the backward gathers them
    # again instead of keeping every layer's gathered weights), the others at the start. Needs a sharding context.
    gather_params: bool = False


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["compressed_kv", "index_keys", "topk", "pool", "entries"], meta_fields=[])
@dataclasses.dataclass
class _GroupState:
    """What a CSA2 layer reads from earlier layers of the same forward."""

    compressed_kv: jax.Array | None = None  # [B, N, hd] float32 rotated (+ quantised) entries of the latest KV source
    index_keys: jax.Array | None = None  # [B, N, di] indexer keys of the latest KV source
    topk: jax.Array | None = None  # [B, T, K] of the latest index source
    pool: jax.Array | None = None  # [B, T, n_blocks] HSI candidate blocks ([B, T, T] key slots when packed)
    entries: dict | None = None  # packed documents: per-slot entry metadata (ops.indexer.packed_entry_layout)


class ForwardError(ValueError):
    pass


def check_tokens(tokens, config: ModelConfig) -> None:
    """Host-side validation of concrete token ids (skipped for traced values)."""
    if not hasattr(tokens, "shape") or len(tokens.shape) != 2:
        raise ForwardError(f"tokens must be an int array of shape [batch, seq], got shape {getattr(tokens, 'shape', None)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ForwardError(f"tokens must be integers, got dtype {tokens.dtype}")
    b, t = tokens.shape
    if b == 0 or t == 0:
        raise ForwardError(f"empty input: tokens has shape {tokens.shape}")
    if t > config.max_position_embeddings:
        raise ForwardError(f"sequence length {t} exceeds max_position_embeddings {config.max_position_embeddings}")
    if isinstance(tokens, jax.core.Tracer):
        return
    arr = np.asarray(tokens)
    bad = (arr < 0) | (arr >= config.vocab_size)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ForwardError(f"token id {int(arr[pos])} at position {pos} is outside the vocabulary "
                           f"[0, {config.vocab_size})")


def embed_tokens(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Token embedding rows [B, T, d] of ``table`` [V, d]; a row read by many tokens gets its gradient summed in
    float32 (ops.gather), not by a bf16 scatter-add."""
    return take_rows(table, tokens)


def attention_layer(p: dict, x: jax.Array, spec: LayerSpec, positions: jax.Array, state: _GroupState,
                    config: ModelConfig, rope: dict, opts: ForwardOptions, quant_on: bool, floor,
                    segments: jax.Array | None = None):
    """One attention sub-layer over a whole sequence. x [B, T, d] is the normalised site input.

    ``segments`` [B, T] marks packed documents (``positions`` are then document-relative): windows, compressor
    groups, indexer visibility and HSI blocks all restart at each document."""
    c = config
    b, t, _ = x.shape
    inv_freq = rope[spec.rope]
    cos, sin = cos_sin(inv_freq, positions)  # [B, T, r/2]
    q_res, q, kv = attention_inputs(p, x, cos, sin, c, quant_on)

    topk = None
    compressed = None
    if spec.ratio > 0:
        if spec.mode == FULL:
            entries = None
            if segments is None:
                latent = compress_sequence(x, p["compressor"], spec.ratio, c.rms_norm_eps)  # [B, N, hd] pre-rope
                entry_pos = (jnp.arange(latent.shape[1]) * spec.ratio)[None, :]
            else:  # slot space: one candidate entry per token, valid where a document's group starts
                latent, valid = compress_packed(x, p["compressor"], spec.ratio, c.rms_norm_eps, positions, segments)
                entry_pos = positions
                entries = packed_entry_layout(positions, segments, valid, spec.ratio, c.candidate_block_size)
            ccos, csin = cos_sin(rope["compress"], entry_pos)
            rotated, keys = compressed_entries(latent, p["indexer"], ccos, csin, c.rms_norm_eps, quant_on)
            # Every Reuse / Reindex layer of the group attends to these entries, and JAX sums their gradients in the
            # array's dtype: kept in float32 (the attention reads the same values), so up to 20 layers' gradients
            # are summed in float32 rather than bf16.
            state = dataclasses.replace(state, compressed_kv=rotated.astype(jnp.float32), index_keys=keys,
                                        entries=entries)
        if spec.mode in (FULL, REINDEX):
            state = _run_indexer(p["indexer"], x, q_res, spec, positions, state, config, rope, opts, quant_on,
                                 segments)
        compressed, topk = state.compressed_kv, state.topk

    out = _kernels.sequence_sparse_attention(q, kv, positions, compressed, topk, p["attn_sink"],
                                             window=c.sliding_window, floor=floor, chunk=opts.query_chunk,
                                             segments=segments, backend=opts.kernel_backend)
    return attention_output(p, out, cos, sin, c), state


def _run_indexer(ip: dict, x, q_res, spec: LayerSpec, positions, state: _GroupState, config: ModelConfig, rope,
                 opts: ForwardOptions, quant_on: bool, segments=None) -> _GroupState:
    c = config
    b, t, _ = x.shape
    cos, sin = cos_sin(rope["compress"], positions)
    qi, w = indexer_queries(ip, x, q_res, cos, sin, n_heads=c.index_n_heads, head_dim=c.index_head_dim,
                            quant_on=quant_on)
    keys = state.index_keys
    if keys.shape[1] == 0:  # no complete group yet: nothing to select
        n_blocks = 0
        empty_pool = jnp.zeros((b, t, n_blocks), bool) if spec.candidate_source else state.pool
        return dataclasses.replace(state, topk=jnp.full((b, t, 0), -1, jnp.int32), pool=empty_pool)
    cand = c.candidate_topk_blocks if spec.candidate_source else None
    pool = state.pool if spec.uses_candidates else None

    pool_args = (pool,) if pool is not None else ()
    if segments is None:
        def run(qc, wc, pc, *pool_c):
            return _kernels.indexer_topk(qc, wc, keys, pc, ratio=spec.ratio, topk=c.index_topk,
                                         pool=pool_c[0] if pool_c else None, block_size=c.candidate_block_size,
                                         candidate_topk_blocks=cand, backend=opts.kernel_backend)

        args = (qi, w, positions) + pool_args
    else:  # packed documents: visibility and HSI blocks per document (plain JAX)
        entries = state.entries
        q_index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

        def run(qc, wc, pc, sc, ic, *pool_c):
            return packed_indexer_topk(qc, wc, keys, pc, sc, ic, entries, ratio=spec.ratio, topk=c.index_topk,
                                       pool=pool_c[0] if pool_c else None, block_size=c.candidate_block_size,
                                       candidate_topk_blocks=cand)

        args = (qi, w, positions, segments, q_index) + pool_args
    topk, new_pool = map_query_blocks(run, t, opts.query_chunk, *args)
    return dataclasses.replace(state, topk=topk, pool=new_pool if spec.candidate_source else state.pool)


def decoder_layer(lp: dict, streams, pre_mix, state: _GroupState, positions, segments, engram_ids, rope: dict, *,
                  spec: LayerSpec, config: ModelConfig, options: ForwardOptions, quant_on: bool, floor,
                  return_feature: bool = False, return_mhc: bool = False):
    """One decoder layer: Engram write (``engram_ids`` [B, T, cols] of this layer, or None), the attention site, the
    FFN site. Returns (streams, the FFN site's pre-mix, the group state, the attention site's normalised input,
    the router's stats, extras): ``extras`` holds, when asked, ``feature`` (``return_feature``: the DSpark feature,
    the mean over the streams entering the attention site, after the Engram write) and ``mhc`` (``return_mhc``:
    {"attn": (pre, post, comb), "ffn": (pre, post, comb)}, the two sites' mHC coefficients). A pure function of
    arrays (the keyword arguments are static), so the forward can wrap it in ``jax.checkpoint``."""
    c = config
    mhc_kw = dict(hc_eps=c.hc_eps, rms_eps=c.rms_norm_eps, sinkhorn_iters=c.hc_sinkhorn_iters)
    extras = {}
    if engram_ids is not None:
        streams = engram_write(streams, engram_ids, lp["engram"], eps=c.rms_norm_eps)
    if return_feature:
        extras["feature"] = jnp.mean(streams, axis=2)
    a_pre, a_post, a_comb = mhc_coefficients(streams, **lp["hc_attn"], **mhc_kw)
    h_attn = rms_norm(collapse(streams, pre_mix), lp["attn_norm"], c.rms_norm_eps)
    y, state = attention_layer(lp["attn"], h_attn, spec, positions, state, c, rope, options, quant_on, floor,
                               segments)
    streams = expand(streams, y, a_post, a_comb)
    f_pre, f_post, f_comb = mhc_coefficients(streams, **lp["hc_ffn"], **mhc_kw)
    h = rms_norm(collapse(streams, a_pre), lp["ffn_norm"], c.rms_norm_eps)
    y, stats = moe(h, lp["ffn"], top_k=c.num_experts_per_tok, temp=c.gate_temp, scaling=c.routed_scaling_factor,
                   limit=c.swiglu_limit, impl=options.moe_impl, normalize=c.norm_topk_prob,
                   capacity_factor=options.moe_capacity_factor)
    streams = constrain(expand(streams, y, f_post, f_comb), _STREAM_AXES)
    if return_mhc:
        extras["mhc"] = {"attn": (a_pre, a_post, a_comb), "ffn": (f_pre, f_post, f_comb)}
    return streams, f_pre, state, h_attn, stats, extras


def _gather_to_rules(params, specs):
    """``params`` constrained to their logical axes' rule sharding (an all-gather of a ZeRO-3 split; the transpose
    reduce-scatters the gradient back)."""
    # Engram tables: rows already split over every mesh axis (and padded: the sliced rows would not divide)
    return jax.tree.map(lambda s, x: x if s.axes[0] == "engram_rows" else constrain(x, s.axes), specs, params,
                        is_leaf=is_spec)


def _gathering(layer, config: ModelConfig, index: int):
    """``layer`` (decoder_layer's signature) with its weights gathered first (ZeRO-3: ``ForwardOptions.gather_params``)."""
    specs = param_specs(config)["layers"][index]

    def run(lp, *args):
        return layer(_gather_to_rules(lp, specs), *args)

    return run


def forward(params: dict, tokens: jax.Array, *, config: ModelConfig, engram_ids: jax.Array | None = None,
            positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
            options: ForwardOptions = ForwardOptions(),
            return_hidden: bool = False, return_topk: bool = False, return_router: bool = False,
            return_attn_inputs: bool = False, return_site_inputs: bool = False,
            return_dspark_features: bool = False, return_mhc: bool = False):
    """Logits [B, T, V] (float32) of a whole sequence, every token through every layer.

    ``engram_ids`` [B, T, n_engram_layers, n_hash_cols] int32 are the host-computed Engram row ids
    (``EngramHasher.row_ids``, with the same ``segment_ids``); required when the config has Engram layers.
    ``segment_ids`` [B, T] (packed documents, training): each maximal run of equal ids is one document whose
    positions restart at 0 and whose attention windows, compressor groups, indexer and HSI never see another
    document — the logits equal running each document alone. With ``return_*`` flags a second
    value is returned: a dict with ``hidden`` ([L, B, T, hc, d] streams after each layer), ``topk`` (per layer
    that runs an indexer), ``router`` (per-layer expert indices and scores) and ``attn_inputs`` (the normalised
    attention-site input [B, T, d] of every layer that runs an indexer; training's indexer KL); ``site_inputs`` is
    the same for every layer (``return_site_inputs``: analyses of what a Reuse layer's own queries would pick);
    ``dspark_features`` ([B, T, len(dspark_target_layer_ids) * d]: the mean over the mHC streams of the residual
    entering each DSpark target layer, after its Engram write, concatenated in config order; the drafter's input,
    ``dsv41_jax.model.dspark``) and ``mhc`` (per layer {"attn": (pre, post, comb), "ffn": (pre, post, comb)}: the
    two sites' mHC coefficients, pre / post [B, T, hc], comb [B, T, hc, hc] in → out).
    """
    c = config
    check_tokens(tokens, c)
    validate_params(params, c)
    if options.gemm_input_fp8:
        from dsv41_jax.model.release_weights import mark_fp8_gemm_inputs

        params = mark_fp8_gemm_inputs(params, c, options.quantized_gemm)
    b, t = tokens.shape
    if c.engram_layer_ids:
        expect = (b, t, len(c.engram_layer_ids), c.n_hash_cols)
        if engram_ids is None:
            raise ForwardError("this config has Engram layers: pass engram_ids (from dsv41_jax.engram_row_ids or "
                               "dsv41_jax.Model, which computes them from the tokens)")
        if tuple(engram_ids.shape) != expect:
            raise ForwardError(f"engram_ids has shape {tuple(engram_ids.shape)}, expected {expect}")
    if segment_ids is not None:
        if tuple(segment_ids.shape) != (b, t):
            raise ForwardError(f"segment_ids has shape {tuple(segment_ids.shape)}, expected {(b, t)}")
        if options.bounded_replay:
            raise ForwardError("bounded_replay applies to single prompts; it cannot be combined with segment_ids")
        segment_ids = segment_ids.astype(jnp.int32)
        if positions is None:
            idx = jnp.arange(t, dtype=jnp.int32)[None, :]
            starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
            positions = idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    quant_on = c.quant_sim if options.quant_sim is None else options.quant_sim
    rope = {k: jnp.asarray(v) for k, v in rope_tables(c).items()}
    replay = c.sliding_window if options.replay_len is None else options.replay_len
    decoder_floor = t - min(replay, t) if options.bounded_replay else 0

    if options.gather_params:
        params = {**params, **_gather_to_rules({k: v for k, v in params.items() if k != "layers"},
                                               {k: v for k, v in param_specs(c).items() if k != "layers"})}
    x = embed_tokens(params["embed"], tokens)
    streams = constrain(jnp.broadcast_to(x[:, :, None, :], (b, t, c.hc_mult, c.hidden_size)), _STREAM_AXES)
    pre_mix = jax.nn.one_hot(jnp.zeros((b, t), jnp.int32), c.hc_mult, dtype=jnp.float32)
    state = _GroupState()
    hidden, topks, router, attn_inputs, site_inputs, dspark_features, mhc = [], {}, [], {}, {}, {}, []
    if options.remat_layers != "none":
        policy = remat_policy(options.remat_layers)
    for spec, lp in zip(c.plan, params["layers"]):
        floor = decoder_floor if spec.stack == "decoder" else 0
        want_feature = return_dspark_features and spec.index in c.dspark_target_layer_ids
        layer = functools.partial(decoder_layer, spec=spec, config=c, options=options, quant_on=quant_on, floor=floor,
                                  return_feature=want_feature, return_mhc=return_mhc)
        if options.gather_params:
            layer = _gathering(layer, c, spec.index)
        if options.remat_layers != "none":
            layer = jax.checkpoint(layer, policy=policy)
        e_ids = engram_ids[:, :, spec.engram_slot] if spec.engram_slot is not None else None
        streams, pre_mix, state, h_attn, stats, extras = layer(lp, streams, pre_mix, state, positions,
                                                               segment_ids, e_ids, rope)
        if "feature" in extras:
            dspark_features[spec.index] = extras["feature"]
        if return_mhc:
            mhc.append(extras["mhc"])
        if return_hidden:
            hidden.append(streams)
        if return_topk and spec.runs_indexer:
            topks[spec.index] = state.topk
        if return_attn_inputs and spec.runs_indexer:  # the indexer KL objective (dsv41_jax.train.loss)
            attn_inputs[spec.index] = h_attn
        if return_site_inputs:
            site_inputs[spec.index] = h_attn
        if return_router:
            router.append(stats)
    h = rms_norm(collapse(streams, pre_mix), params["norm"], c.rms_norm_eps)
    logits = constrain(head_logits(h, params["lm_head"]), ("batch", "seq", "vocab"))  # official fp32 head
    if not (return_hidden or return_topk or return_router or return_attn_inputs or return_site_inputs
            or return_dspark_features or return_mhc):
        return logits
    aux: dict[str, Any] = {}
    if return_hidden:
        aux["hidden"] = jnp.stack(hidden)
    if return_topk:
        aux["topk"] = topks
    if return_router:
        aux["router"] = router
    if return_attn_inputs:
        aux["attn_inputs"] = attn_inputs
    if return_site_inputs:
        aux["site_inputs"] = site_inputs
    if return_dspark_features:
        if not c.dspark_target_layer_ids:
            raise ForwardError("return_dspark_features: this config has no dspark_target_layer_ids")
        aux["dspark_features"] = jnp.concatenate([dspark_features[i] for i in c.dspark_target_layer_ids], axis=-1)
    if return_mhc:
        aux["mhc"] = mhc
    return logits, aux
