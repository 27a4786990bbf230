"""DSpark, the release's speculative drafter, as pure functions (SPEC §9; the official ``inference/model.py``
``DSparkBlock`` / ``DSparkAttention`` / ``DSparkMarkovHead`` / ``DSparkConfidenceHead`` / ``forward_spec``).

The target hands the drafter one feature vector per token: the mean over the mHC streams of the residual entering
each target layer (``dspark_target_layer_ids``, 37-39 in the release), concatenated (``forward(...,
return_dspark_features=True)`` or ``inference.step.run_layers(..., capture=...)``). The drafter:

* projects the features once, ``main_x = RMSNorm(main_proj(features))`` (``mtp.0.main_proj`` / ``main_norm``);
* every draft block turns ``main_x`` into its own context K=V latents with its own ``wkv`` + ``kv_norm``, the main
  RoPE at the token's position and the window-KV FP8 fake quantisation (a per-block 128-slot ring at inference);
* one parallel pass over the block ``[x_p, noise x (block_size - 1)]`` at positions ``p .. p + block_size - 1``
  (embedded with the target's embedding) runs the draft blocks: V4.1 blocks with SWA-only attention whose queries
  see every context latent in the ring plus every latent of the block (bidirectional inside the block), the
  DSpark MoE (``dspark_n_routed_experts`` routed, top ``dspark_num_experts_per_tok``, + the shared expert) and
  single-pass mHC carried across the blocks from the identity mix;
* the streams are collapsed with the last block's FFN ``pre`` mix (no ``hc_head`` in V4.1), normed with
  ``mtp.{last}.norm`` and projected by the target's LM head: the base logits of every slot;
* left to right, slot k adds the rank-r Markov bias of its predecessor (``x_p`` for slot 0, then the draft token
  just chosen) and picks its token: slot k drafts the token at position ``p + k + 1``;
* the confidence head reads the collapsed hidden state BEFORE the final norm and the Markov embedding of the
  predecessor, in float32. Like the official code it returns a logit; sigmoid(logit) is the predicted probability
  that the draft is accepted given that the earlier ones were.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv41_jax.config import ModelConfig
from dsv41_jax.ops import quant
from dsv41_jax.ops.attention import attention_inputs, attention_output, sparse_attention
from dsv41_jax.ops.linear import head_logits, linear
from dsv41_jax.ops.mhc import collapse, expand, mhc_coefficients
from dsv41_jax.ops.moe import moe
from dsv41_jax.ops.norms import rms_norm
from dsv41_jax.ops.rope import apply_rope, cos_sin, inv_frequencies


class DSparkError(ValueError):
    pass


class Draft(NamedTuple):
    """One drafted block for every sequence of a batch."""

    tokens: jax.Array  # [B, S] int32: slot k drafts the token at position p + k + 1
    logits: jax.Array  # [B, S, V] float32: base logits + Markov bias (the distribution slot k was drawn from)
    confidence: jax.Array  # [B, S] float32 logits of the confidence head
    hidden: jax.Array  # [B, S, d] collapsed pre-norm hidden state (the confidence head's input)


def check_dspark(params: dict, config: ModelConfig) -> None:
    """A clear error when the parameters or the config cannot run the drafter."""
    c = config
    if c.num_nextn_predict_layers <= 0 or c.dspark_block_size <= 0:
        raise DSparkError(f"config `{c.name}` has no DSpark drafter (num_nextn_predict_layers="
                          f"{c.num_nextn_predict_layers}, dspark_block_size={c.dspark_block_size})")
    if not c.dspark_target_layer_ids:
        raise DSparkError("config field `dspark_target_layer_ids` is empty: the drafter needs target layers")
    if not isinstance(params, dict) or "dspark" not in params:
        raise DSparkError("the parameters have no `dspark` subtree (build them with include_dspark=True or load the "
                          "checkpoint's mtp.* tensors)")
    n = len(params["dspark"]["blocks"])
    if n != c.num_nextn_predict_layers:
        raise DSparkError(f"params hold {n} DSpark blocks but num_nextn_predict_layers is "
                          f"{c.num_nextn_predict_layers}")


def target_features(streams: jax.Array) -> jax.Array:
    """The feature one target layer contributes: the mean over the mHC streams [..., hc, d] -> [..., d]."""
    return jnp.mean(streams, axis=-2)


def project_context(dp: dict, features: jax.Array, config: ModelConfig) -> jax.Array:
    """features [..., n_targets * d] -> main_x [..., d] = RMSNorm(main_proj(features))."""
    want = config.hidden_size * len(config.dspark_target_layer_ids)
    if features.shape[-1] != want:
        raise DSparkError(f"DSpark features have width {features.shape[-1]}, expected {want} "
                          f"(hidden_size x {len(config.dspark_target_layer_ids)} target layers)")
    return rms_norm(linear(features, dp["main_proj"]), dp["main_norm"], config.rms_norm_eps)


def main_rope(config: ModelConfig) -> jax.Array:
    """The draft blocks' RoPE: the main one (compress ratio 0: base ``rope_theta``, no YaRN)."""
    return jnp.asarray(inv_frequencies(config.qk_rope_head_dim, config.rope_theta, None))


def context_kv(attn: dict, main_x: jax.Array, positions: jax.Array, config: ModelConfig, quant_on: bool):
    """A draft block's context K=V latents of projected target features main_x [B, T, d] at positions [B, T]:
    its own ``wkv`` + ``kv_norm``, the main RoPE, then the window-KV FP8 fake quantisation (as every window
    latent of the target)."""
    cos, sin = cos_sin(main_rope(config), positions)
    kv = apply_rope(rms_norm(linear(main_x, attn["wkv"]), attn["kv_norm"], config.rms_norm_eps), cos, sin)
    if quant_on:
        kv = quant.fake_quant_fp8_e4m3_block(kv, 32)
    return kv


def context_kvs(dp: dict, features: jax.Array, positions: jax.Array, config: ModelConfig, quant_on: bool):
    """Every draft block's context latents of raw target features [B, T, n_targets * d]: a list of [B, T, hd]."""
    main_x = project_context(dp, features, config)
    return [context_kv(bp["attn"], main_x, positions, config, quant_on) for bp in dp["blocks"]]


def block_attention(p: dict, x: jax.Array, block_pos: jax.Array, ctx_kv: jax.Array, ctx_pos: jax.Array,
                    config: ModelConfig, quant_on: bool) -> jax.Array:
    """A draft block's attention. x [B, S, d] (normalised site input) at block_pos [B, S]; context latents
    ctx_kv [B, K, hd] with ctx_pos [B, K] (< 0 = empty slot; all before the block's first position).

    Every block query sees every valid context latent and every latent of its own block: the project's sparse
    attention is reused with the block's keys all given the block's first position (so none is "in the future")
    and a window spanning context + block, which turns its causal-window test into exactly that visibility. The
    plain-JAX form is used on every backend: the block is a handful of queries and its keys are not a window."""
    c = config
    s = x.shape[1]
    cos, sin = cos_sin(main_rope(c), block_pos)
    _, q, kv = attention_inputs(p, x, cos, sin, c, quant_on)
    keys = jnp.concatenate([ctx_kv.astype(kv.dtype), kv], axis=1)
    key_pos = jnp.concatenate([ctx_pos, jnp.broadcast_to(block_pos[:, :1], block_pos.shape)], axis=1)
    out = sparse_attention(q, block_pos, keys, key_pos, None, None, p["attn_sink"], window=ctx_kv.shape[1] + s)
    return attention_output(p, out, cos, sin, c)


def _ffn(p: dict, h: jax.Array, config: ModelConfig, moe_impl: str) -> jax.Array:
    c = config
    kw = dict(top_k=c.dspark_num_experts_per_tok, temp=c.gate_temp, scaling=c.routed_scaling_factor,
              limit=c.swiglu_limit, normalize=c.norm_topk_prob)
    if moe_impl == "tiled":
        from dsv41_jax.inference.moe import moe_inference  # lazy: the model package does not need inference

        return moe_inference(h, p, **kw)
    y, _ = moe(h, p, impl=moe_impl, **kw)
    return y


def run_blocks(params: dict, block_tokens: jax.Array, block_pos: jax.Array, ctx_kvs, ctx_pos: jax.Array, *,
               config: ModelConfig, quant_on: bool, moe_impl: str = "dense"):
    """The parallel pass over the draft blocks. block_tokens / block_pos [B, S]; ctx_kvs: one [B, K, hd] per block;
    ctx_pos [B, K]. Returns (hidden [B, S, d] collapsed before the final norm, base logits [B, S, V] float32)."""
    c = config
    dp = params["dspark"]
    b, s = block_tokens.shape
    x = params["embed"][block_tokens]
    streams = jnp.broadcast_to(x[:, :, None, :], (b, s, c.hc_mult, c.hidden_size))
    pre_mix = jax.nn.one_hot(jnp.zeros((b, s), jnp.int32), c.hc_mult, dtype=jnp.float32)  # identity mix
    kw = dict(hc_eps=c.hc_eps, rms_eps=c.rms_norm_eps, sinkhorn_iters=c.hc_sinkhorn_iters)
    for bp, ctx_kv in zip(dp["blocks"], ctx_kvs):
        a_pre, a_post, a_comb = mhc_coefficients(streams, **bp["hc_attn"], **kw)
        h = rms_norm(collapse(streams, pre_mix), bp["attn_norm"], c.rms_norm_eps)
        y = block_attention(bp["attn"], h, block_pos, ctx_kv, ctx_pos, c, quant_on)
        streams = expand(streams, y, a_post, a_comb)
        f_pre, f_post, f_comb = mhc_coefficients(streams, **bp["hc_ffn"], **kw)
        h = rms_norm(collapse(streams, a_pre), bp["ffn_norm"], c.rms_norm_eps)
        streams = expand(streams, _ffn(bp["ffn"], h, c, moe_impl), f_post, f_comb)
        pre_mix = f_pre
    hidden = collapse(streams, pre_mix)
    logits = head_logits(rms_norm(hidden, dp["norm"], c.rms_norm_eps), params["lm_head"])  # the shared fp32 head
    return hidden, logits


def markov_bias(dp: dict, prev: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The rank-r transition bias of predecessor tokens prev [...]: (bias [..., V] float32, embedding [..., r])."""
    e = dp["markov_embed"][prev]
    return linear(e.astype(jnp.float32), dp["markov_head"].astype(jnp.float32)), e


def confidence_logits(dp: dict, hidden: jax.Array, markov_embeds: jax.Array) -> jax.Array:
    """The confidence head, in float32: [B, S, d] pre-norm hidden + [B, S, r] predecessor embedding -> [B, S]."""
    z = jnp.concatenate([hidden.astype(jnp.float32), markov_embeds.astype(jnp.float32)], axis=-1)
    return linear(z, dp["confidence"].astype(jnp.float32))[..., 0]


def sample_sequential(dp: dict, base_logits: jax.Array, first: jax.Array, *, temperature: jax.Array | None = None,
                      keys: jax.Array | None = None, filter_fn=None):
    """Left-to-right drafting: slot k adds the Markov bias of its predecessor (``first`` [B] for slot 0) and draws
    its token: argmax where ``temperature`` [B] is 0 or None, else a categorical draw from
    ``filter_fn(corrected logits)`` (default: logits / temperature) with ``keys`` [B, S] PRNG keys. Returns
    (tokens [B, S] int32, corrected logits [B, S, V], Markov embeddings [B, S, r] of each slot's predecessor)."""
    b, s, _ = base_logits.shape

    def body(prev, k):
        bias, e = markov_bias(dp, prev)
        logits = base_logits[:, k] + bias
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if temperature is not None:
            t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
            z = logits / t if filter_fn is None else filter_fn(logits)
            drawn = jax.vmap(jax.random.categorical)(keys[:, k], z).astype(jnp.int32)
            tok = jnp.where(temperature > 0, drawn, tok)
        return tok, (tok, logits, e)

    _, (tokens, logits, embeds) = jax.lax.scan(body, first.astype(jnp.int32), jnp.arange(s))
    return tokens.T, jnp.moveaxis(logits, 0, 1), jnp.moveaxis(embeds, 0, 1)


def draft(params: dict, first: jax.Array, first_pos: jax.Array, ctx_kvs, ctx_pos: jax.Array, *,
          config: ModelConfig, quant_on: bool, moe_impl: str = "dense", temperature: jax.Array | None = None,
          keys: jax.Array | None = None, filter_fn=None) -> Draft:
    """Draft ``dspark_block_size`` tokens after ``first`` [B] (the token at position first_pos [B], not yet seen
    by the target; its context latents ctx_kvs / ctx_pos cover positions < first_pos)."""
    c = config
    s = c.dspark_block_size
    b = first.shape[0]
    block = jnp.concatenate([first[:, None].astype(jnp.int32),
                             jnp.full((b, s - 1), c.dspark_noise_token_id, jnp.int32)], axis=1)
    block_pos = first_pos[:, None].astype(jnp.int32) + jnp.arange(s, dtype=jnp.int32)[None, :]
    hidden, base = run_blocks(params, block, block_pos, ctx_kvs, ctx_pos, config=c, quant_on=quant_on,
                              moe_impl=moe_impl)
    dp = params["dspark"]
    tokens, logits, embeds = sample_sequential(dp, base, first, temperature=temperature, keys=keys,
                                               filter_fn=filter_fn)
    return Draft(tokens, logits, confidence_logits(dp, hidden, embeds), hidden)


def anchor_context(ctx_kvs, anchors: jax.Array, window: int, floor: jax.Array | int = 0):
    """Training: each anchor's context latents, the ``window`` positions before it (what the inference ring holds
    when the anchor token is pending). ctx_kvs: per block [B, T, hd] latents of every position; anchors [B, A].
    Returns (per block [B, A, window, hd], positions [B, A, window] with -1 = none)."""
    p = anchors[..., None] - window + jnp.arange(window)  # [B, A, W]
    floor = jnp.asarray(floor)
    valid = (p >= 0) & (p >= (floor[:, None, None] if floor.ndim else floor))
    safe = jnp.clip(p, 0, None)
    gather = jax.vmap(lambda kv, idx: kv[idx])  # per batch row: [T, hd][A, W] -> [A, W, hd]
    return [gather(kv, safe) for kv in ctx_kvs], jnp.where(valid, p, -1)


def train_forward(params: dict, features: jax.Array, tokens: jax.Array, anchors: jax.Array, *, config: ModelConfig,
                  quant_on: bool, moe_impl: str = "dense", label_tokens: jax.Array | None = None):
    """The drafter over many anchors of whole sequences at once (training; the target is frozen: ``features``
    [B, T, n_targets * d] come from ``forward(..., return_dspark_features=True)``).

    Anchor p (``anchors`` [B, A], 0 <= p < T) runs the block ``[tokens[p], noise ...]`` at positions p .. p + S - 1
    over the context latents of positions p - W .. p - 1, exactly as a drafting step with tokens[p] pending. Slot k
    is trained to predict tokens[p + k + 1] (or ``label_tokens[p + k + 1]`` [B, T] when given, e.g. the target's
    greedy choice at every position); its Markov predecessor is the label before it (teacher forcing).
    Returns (Markov-corrected logits [B, A, S, V], confidence logits [B, A, S], labels [B, A, S], valid [B, A, S]:
    the label exists inside the sequence)."""
    c = config
    b, t = tokens.shape
    a = anchors.shape[1]
    s = c.dspark_block_size
    dp = params["dspark"]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    kvs = context_kvs(dp, features, pos, c, quant_on)
    ctx, ctx_pos = anchor_context(kvs, anchors, c.sliding_window)
    first = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, A]
    block = jnp.concatenate([first[..., None], jnp.full((b, a, s - 1), c.dspark_noise_token_id, tokens.dtype)], -1)
    block_pos = anchors[..., None] + jnp.arange(s, dtype=anchors.dtype)
    fold = lambda x: x.reshape(b * a, *x.shape[2:])  # noqa: E731
    hidden, base = run_blocks(params, fold(block), fold(block_pos), [fold(x) for x in ctx], fold(ctx_pos), config=c,
                              quant_on=quant_on, moe_impl=moe_impl)
    label_pos = anchors[..., None] + 1 + jnp.arange(s, dtype=anchors.dtype)  # [B, A, S]
    valid = label_pos < t
    source = tokens if label_tokens is None else label_tokens
    labels = jnp.take_along_axis(source, jnp.clip(label_pos, 0, t - 1).reshape(b, a * s), axis=1).reshape(b, a, s)
    prev = jnp.concatenate([first[..., None], labels[..., :-1]], axis=-1)  # teacher-forced predecessors
    bias, embeds = markov_bias(dp, fold(prev))
    logits = (base + bias).reshape(b, a, s, -1)
    conf = confidence_logits(dp, hidden, embeds).reshape(b, a, s)
    return logits, conf, labels, valid


__all__ = ["DSparkError", "Draft", "check_dspark", "target_features", "project_context", "main_rope", "context_kv",
           "context_kvs", "block_attention", "run_blocks", "markov_bias", "confidence_logits", "sample_sequential",
           "draft", "anchor_context", "train_forward"]
