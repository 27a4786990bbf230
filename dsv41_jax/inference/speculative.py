"""Speculative decoding with the DSpark drafter (SPEC §9): per-block context rings, drafting, lossless
verification (greedy: exact argmax match; sampling: speculative rejection sampling) with rollback.

State next to the target's cache (``inference.cache``): one ring of ``sliding_window`` context latents per draft
block, ``rings[i]`` [B, W, hd]. Like the target's SWA rings, slot s of a sequence holding L tokens contains the
projected target feature of the largest position p < L with p = s (mod W); positions below the cache's ``floor``
(CED bounded replay: the target layers never saw them) are invisible. The rings are written from the target
features of every token the target consumes: at prefill (``Engine.prefill(on_features=...)``) and at every
verification step, for the accepted tokens only.

A step, per sequence holding L tokens with the pending token x (sampled, not yet fed):

1. draft: one parallel pass of the drafter over ``[x, noise, ...]`` at positions L .. L + S - 1 gives S = γ
   drafts d_1 .. d_γ (d_k for position L + k), drawn left to right with the Markov bias;
2. verify: the target consumes the chunk ``[x, d_1, .., d_γ]`` (positions L .. L + γ) in one pass through the
   normal layer code (``step.run_layers``), logits at every position;
3. accept (:func:`speculative_accept`): greedy rows keep the longest prefix with d_k == argmax(target logits at
   L + k - 1) and then the target's argmax (the correction, or the bonus when all γ match): output identical to
   plain greedy decoding. Sampled rows accept d_k with probability min(1, p_k(d_k) / q_k(d_k)) against the
   distribution q the drafter drew from and draw the correction from normalise(max(p - q, 0)): output
   distributed as plain sampling. The last new token becomes the pending token;
4. roll back (:func:`restore_rejected`): before the pass, :func:`save_touched` reads the few rows a chunk can
   overwrite (the chunk's SWA ring slots, the compressed-entry / indexer-key rows it can complete, the partial
   groups); when a draft was rejected those rows get their saved contents back and every KV source's update is
   redone from the pass's compressor inputs with only the a + 1 accepted tokens valid, so every cache is what
   feeding those tokens gives (or, with ``rollback="rerun"``, the step is re-run on them: a second target pass).
   The host Engram history is advanced by the accepted tokens only; the DSpark rings get the accepted tokens'
   features.

Steps 2-4 and the next step's drafting (1) are one jitted program (:func:`speculative_round`) with the cache and
the rings donated and every shape static (a chunk of γ + 1 tokens, rows masked by their valid lengths): a
speculative step costs one program launch and one device-to-host read-back (accepted counts, next tokens, the next
drafts), as a plain decode step does; the host then hashes the next chunk's Engram ids and accounts the tokens.

The verification length is γ (less near ``max_len``), or chosen per row from the drafter's
confidences: a survival threshold (the chunk keeps its width, rows masked), or the hardware-aware prefix
scheduler over a measured step-time table (:meth:`SpeculativeDecoder.measure_step_times`), whose step is as wide
as its widest row (one program per width, at most γ + 1).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig, ceil_div
from dsv41_jax.inference.decode import _decode_opts, run_device_loop
from dsv41_jax.inference.engine import (Engine, EngineError, Request, Result, check_device_ends, finish_reason,
                                        stop_token_table)
from dsv41_jax.inference.sampling import sample_jit, sampler_for, sampling_logits
from dsv41_jax.inference.step import (InferenceOptions, embed, emit_entries, head, jit_for, ring_read, ring_write,
                                      run_layers)
from dsv41_jax.model.dspark import Draft, check_dspark, context_kvs, draft
from dsv41_jax.ops.engram_hash import EngramHistory, device_history, engram_row_ids_step_device
from dsv41_jax.ops.rope import rope_tables


# ----------------------------------------------------------------------------------------------------------
# Pure pieces (jitted below)
# ----------------------------------------------------------------------------------------------------------

def init_dspark_rings(config: ModelConfig, batch: int, dtype=jnp.float32) -> list:
    """Empty context rings, one [batch, sliding_window, head_dim] per draft block."""
    return [jnp.zeros((batch, config.sliding_window, config.head_dim), dtype)
            for _ in range(config.num_nextn_predict_layers)]


def _drafter_view(params: dict, config: ModelConfig, gemm_input_fp8: bool) -> dict:
    """The parameters as the drafter consumes them: with the release's weights (``gemm_input_fp8``) its FP8 / FP4
    GEMM weights are marked so their inputs are rounded to FP8, as the target's are (trace-time restructure)."""
    if not gemm_input_fp8:
        return params
    from dsv41_jax.model.release_weights import mark_fp8_gemm_inputs

    return mark_fp8_gemm_inputs(params, config)


def seed_rings(params: dict, rings: list, features: jax.Array, pos0: jax.Array, n_valid: jax.Array, *,
               config: ModelConfig, quant_on: bool, gemm_input_fp8: bool = False) -> list:
    """Write the context latents of target features [B, C, n_targets * d] (token i of row b at position
    pos0[b] + i, valid for i < n_valid[b]) into every block's ring."""
    params = _drafter_view(params, config, gemm_input_fp8)
    pos = pos0[:, None] + jnp.arange(features.shape[1], dtype=jnp.int32)[None, :]
    kvs = context_kvs(params["dspark"], features, pos, config, quant_on)
    return [ring_write(r, kv, pos0, n_valid) for r, kv in zip(rings, kvs)]


def ring_context(rings: list, length: jax.Array, floor: jax.Array):
    """(per-block latents [B, W, hd] in position order, their positions [B, W] with -1 = invisible)."""
    vals = [ring_read(r, length)[0] for r in rings]
    _, pos = ring_read(rings[0], length)
    return vals, jnp.where(pos >= floor[:, None], pos, -1)


def draft_from_rings(params: dict, rings: list, length: jax.Array, floor: jax.Array, first: jax.Array,
                     sampling=None, *, config: ModelConfig, quant_on: bool, moe_impl: str,
                     gemm_input_fp8: bool = False) -> Draft:
    """Drafts after the pending tokens ``first`` [B] (at positions ``length``): greedy, or with ``sampling`` =
    (temperature, top_k, top_p [B], keys [B, S]) drawn from the filtered Markov-corrected logits like the
    target's sampler (``sampling.sampling_logits``; top_k / top_p None: no filter; temperature 0 rows stay
    greedy)."""
    params = _drafter_view(params, config, gemm_input_fp8)
    ctx, ctx_pos = ring_context(rings, length, floor)
    kw = {}
    if sampling is not None:
        temperature, top_k, top_p, keys = sampling
        kw = dict(temperature=temperature, keys=keys,
                  filter_fn=lambda z: sampling_logits(z, temperature, top_k, top_p))
    return draft(params, first, length, ctx, ctx_pos, config=config, quant_on=quant_on, moe_impl=moe_impl, **kw)


def verify_chunk(params: dict, cache: dict, tokens: jax.Array, n_valid: jax.Array, engram_ids, *,
                 config: ModelConfig, opts: InferenceOptions):
    """The target over a chunk of new tokens [B, K] (valid prefix n_valid [B]) through every layer, as a decode
    step does: (logits [B, K, V] float32, DSpark features [B, K, n_targets * d], cache advanced by n_valid, the KV
    sources' compressor inputs for :func:`rollback`)."""
    pos0 = cache["length"]
    streams, pre_mix = embed(params, tokens, config)
    streams, pre_mix, cache, feats, comp = run_layers(
        params, cache, streams, pre_mix, pos0, n_valid, engram_ids, config=config, lo=0,
        hi=config.num_hidden_layers, opts=opts, capture=tuple(config.dspark_target_layer_ids),
        return_compressor_inputs=True)
    return head(params, streams, pre_mix, config), feats, dict(cache, length=pos0 + n_valid), comp


def save_touched(cache: dict, chunk: int, config: ModelConfig) -> dict:
    """What a verification pass over ``chunk`` tokens can overwrite, read before the pass (a few rows, not the
    caches): the SWA ring slots (pos0 + i) mod W of the chunk's tokens, the compressed-entry / indexer-key rows the
    chunk can complete and every KV source's partial group. Either cache layout (packed rows are kept packed)."""
    c = config
    w = c.sliding_window
    pos0 = cache["length"]
    slot = jnp.mod(pos0[:, None] + jnp.arange(chunk)[None, :], w)
    swa = [_take_rows(ring, slot) for ring in cache["swa"]]
    sources = {}
    for key, src in cache["sources"].items():
        rows = _entry_rows(pos0, chunk, c.compress_ratios[int(key)])
        nmax = src["kv"].shape[1]
        saved = {k: _take_rows(src[k], jnp.minimum(rows, nmax - 1)) for k in ("kv", "keys")}
        sources[key] = dict(saved, **{k: src[k] for k in ("buf_kv", "buf_gate") if k in src})
    return {"swa": swa, "sources": sources}


def _entry_rows(pos0: jax.Array, chunk: int, ratio: int) -> jax.Array:
    """[B, G] the entry rows a chunk of ``chunk`` tokens at pos0 can write (``step.emit_entries``' candidates)."""
    groups = chunk if ratio == 1 else ceil_div(ratio + chunk, ratio)
    return (pos0 // max(ratio, 1))[:, None] + jnp.arange(groups)[None, :]


def _take_rows(buf, rows: jax.Array):
    """buf[b, rows[b, i]] for every leaf of a cache buffer (a plain array or packed rows: rows on axis 1)."""
    def take(a):
        idx = rows.reshape(*rows.shape, *([1] * (a.ndim - 2)))
        return jnp.take_along_axis(a, idx, axis=1)

    return jax.tree.map(take, buf)


def _put_rows(buf, rows: jax.Array, vals):
    """buf with buf[b, rows[b, i]] = vals[b, i] (rows out of range are dropped), leaf by leaf."""
    bi = jnp.broadcast_to(jnp.arange(rows.shape[0])[:, None], rows.shape)
    return jax.tree.map(lambda a, v: a.at[bi, rows].set(v, mode="drop"), buf, vals)


def restore_rejected(params: dict, saved: dict, after: dict, compressor_inputs: dict, pos0: jax.Array,
                     n_keep: jax.Array, *, config: ModelConfig, opts: InferenceOptions, chunk: int) -> dict:
    """The cache after only the first n_keep [B] tokens of a verified chunk, in place on the cache ``after`` the
    pass (which consumed more) and the rows :func:`save_touched` read before it — what feeding just those tokens
    gives, without a second pass and without copying a cache:

    * SWA rings: the slots of the rejected tokens get their saved contents back (the chunk is at most a window
      long, so no slot was written twice);
    * KV sources: the rows the chunk could complete get their saved contents back, then the compressor update is
      redone from the pass's compressor inputs with n_keep valid tokens from the saved partial group (entries of
      the kept complete groups, the kept partial group), as the step itself does it;
    * lengths: pos0 + n_keep. Everything else (floor) is unchanged by a step."""
    c = config
    w = c.sliding_window
    i = jnp.arange(chunk)[None, :]
    slot = jnp.where(i >= n_keep[:, None], jnp.mod(pos0[:, None] + i, w), w)  # w: out of range, not restored
    swa = [_put_rows(ring, slot, old) for ring, old in zip(after["swa"], saved["swa"])]
    rope = {k: jnp.asarray(v) for k, v in rope_tables(c).items()}
    quant_on = opts.resolved_quant(c)
    sources = {}
    for key, src in after["sources"].items():
        layer = int(key)
        ratio = c.compress_ratios[layer]
        old = saved["sources"][key]
        rows = _entry_rows(pos0, chunk, ratio)
        rows = jnp.where(rows < src["kv"].shape[1], rows, src["kv"].shape[1])  # past the cache: dropped
        base = dict(src, kv=_put_rows(src["kv"], rows, old["kv"]), keys=_put_rows(src["keys"], rows, old["keys"]),
                    **{k: old[k] for k in ("buf_kv", "buf_gate") if k in old})
        attn = params["layers"][layer]["attn"]
        sources[key] = emit_entries(base, compressor_inputs[layer], attn["compressor"], attn["indexer"], ratio, pos0,
                                    n_keep, c, rope, quant_on)
    return dict(after, length=pos0 + n_keep, swa=swa, sources=sources)


def greedy_accept(target_logits: jax.Array, drafts: jax.Array, n_valid: jax.Array):
    """:func:`speculative_accept` for all-greedy batches, without the probability tables: the longest prefix of
    drafts equal to the target's argmax, then the target's argmax after it. (accepted [B], next token [B])."""
    choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, K + 1]
    k = drafts.shape[1]
    ok = (drafts == choice[:, :k]) & (jnp.arange(k)[None, :] < (n_valid[:, None] - 1))
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    return n_acc, jnp.take_along_axis(choice, n_acc[:, None], axis=1)[:, 0]


def greedy_acceptance(drafts: np.ndarray, target: np.ndarray, n_valid: np.ndarray) -> np.ndarray:
    """Accepted drafts per row: the longest prefix k < n_valid with drafts[:, k] == target[:, k] (target[:, k] is
    the target's argmax after the chunk's token k, i.e. its choice for the position draft k occupies)."""
    b, g = drafts.shape
    match = (drafts == target[:, :g]) & (np.arange(g)[None, :] < (n_valid[:, None] - 1))
    return np.cumprod(match, axis=1).sum(axis=1).astype(np.int64)


def speculative_accept(target_logits: jax.Array, draft_logits: jax.Array, drafts: jax.Array, n_valid: jax.Array,
                       temperature: jax.Array, top_k: jax.Array | None, top_p: jax.Array | None, keys: jax.Array):
    """Lossless acceptance of verified chunks (standard speculative sampling; greedy rows: exact argmax match).

    target_logits [B, K + 1, V]: the target's logits after each chunk token; draft_logits [B, K, V]: the logits
    the drafts [B, K] were drawn from (DSpark: base + Markov bias), through the same sampling filter
    (``sampling.sampling_logits`` with the row's temperature / top-k / top-p; both None when no row filters: no
    vocabulary sort) as the target's; n_valid [B]: chunk
    tokens verified (1 + drafts); keys [B] PRNG keys. Draft k is accepted with probability min(1, p_k(x)/q_k(x));
    at the first rejection the next token is drawn from normalise(max(p - q, 0)) (p where that is empty), after
    all accepted from the target's next distribution: the emitted tokens are distributed as plain sampling's.
    Rows with temperature 0 use one-hot p = argmax of the target and q = the draft. Returns (accepted drafts [B],
    next token [B])."""
    b, k1, v = target_logits.shape
    k = k1 - 1

    def probs(z):
        n = z.shape[1]
        rep = lambda a: None if a is None else jnp.repeat(a, n)  # noqa: E731
        f = sampling_logits(z.reshape(b * n, v), rep(temperature), rep(top_k), rep(top_p))
        return jax.nn.softmax(f, axis=-1).reshape(b, n, v)

    greedy = (temperature <= 0)[:, None, None]
    p = jnp.where(greedy, jax.nn.one_hot(jnp.argmax(target_logits, -1), v), probs(target_logits))
    q = jnp.where(greedy, jax.nn.one_hot(drafts, v), probs(draft_logits))
    px = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    qx = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    split = jax.vmap(lambda key: jax.random.split(key, 2))(keys)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(split[:, 0])
    ok = (u * jnp.maximum(qx, 1e-8) < px) & (jnp.arange(k)[None, :] < (n_valid[:, None] - 1))
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_at = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]
    q_at = jnp.take_along_axis(q, jnp.minimum(n_acc, k - 1)[:, None, None], axis=1)[:, 0] if k else p_at
    rejected = (n_acc < n_valid - 1)[:, None]
    resid = jnp.where(rejected, jnp.maximum(p_at - q_at, 0.0), p_at)
    resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 1e-8, resid, p_at)
    drawn = jax.vmap(jax.random.categorical)(split[:, 1], jnp.log(resid))
    nxt = jnp.where(temperature <= 0, jnp.argmax(resid, -1), drawn)
    return n_acc.astype(jnp.int32), nxt.astype(jnp.int32)


def speculative_round(params: dict, cache: dict, rings, tokens: jax.Array, n_valid: jax.Array, engram_ids,
                      draft_logits, sampling, step: jax.Array, *, config: ModelConfig, opts: InferenceOptions,
                      greedy: bool, rerun: bool, draft_next: bool):
    """One whole speculative step as one program (the cache and the DSpark rings donated, every shape static):
    verify the chunk ``tokens`` [B, K + 1] = [pending, drafts] with n_valid [B] of it valid, accept (greedy, or
    speculative sampling against ``draft_logits`` [B, K, V] with ``sampling`` = (temperature, top_k, top_p, seeds)
    and the step's keys), roll back what was rejected (:func:`restore_rejected` on the rows saved before the pass;
    ``rerun``: a second pass over the kept tokens instead, when a row rejected), write the kept tokens' features
    into the DSpark rings and, with ``draft_next``, draft the next block after the new pending tokens.

    Returns (accepted drafts [B], next token [B], cache, rings, the next Draft or None)."""
    c = config
    chunk = tokens.shape[1]
    drafts = tokens[:, 1:]
    pos0, floor = cache["length"], cache["floor"]
    # the named scopes (SCOPES) label each phase's kernels in the compiled program (op_name), so that a device
    # profile of the step can be split into them; they change nothing computed
    with jax.named_scope("spec_rollback"):
        saved = None if rerun else save_touched(cache, chunk, c)
    before = cache if rerun else None
    with jax.named_scope("spec_verify"):
        logits, feats, after, comp = verify_chunk(params, cache, tokens, n_valid, engram_ids, config=c, opts=opts)
    with jax.named_scope("spec_accept"):
        if greedy:
            n_acc, nxt = greedy_accept(logits, drafts, n_valid)
        else:
            temperature, top_k, top_p, seeds = sampling
            n_acc, nxt = speculative_accept(logits, draft_logits[:, :drafts.shape[1]], drafts, n_valid,
                                            temperature, top_k, top_p, _row_keys(seeds, step, 1))
    n_keep = jnp.where(n_valid > 0, n_acc + 1, 0).astype(jnp.int32)
    if rerun:
        def again(_):
            _, f, cch, _ = verify_chunk(params, before, tokens, n_keep, engram_ids, config=c, opts=opts)
            return f, cch

        feats, cache = jax.lax.cond(jnp.any(n_keep < n_valid), again, lambda _: (feats, after), None)
    else:
        with jax.named_scope("spec_rollback"):
            cache = restore_rejected(params, saved, after, comp, pos0, n_keep, config=c, opts=opts, chunk=chunk)
    quant_on = opts.resolved_quant(c)
    nxt_draft = None
    if rings is not None:
        with jax.named_scope("spec_rings"):
            rings = seed_rings(params, rings, feats, pos0, n_keep, config=c, quant_on=quant_on,
                               gemm_input_fp8=opts.gemm_input_fp8)
        if draft_next:
            with jax.named_scope("spec_draft"):
                nxt_draft = draft_from_rings(params, rings, cache["length"], floor, nxt,
                                             None if greedy else _draft_sampling(c, sampling, step + 1), config=c,
                                             quant_on=quant_on, moe_impl=opts.moe_impl,
                                             gemm_input_fp8=opts.gemm_input_fp8)
    return n_acc, nxt, cache, rings, nxt_draft


# the phases of a speculative step, as named scopes in its program's op_names (speculative_round)
SCOPES = ("spec_verify", "spec_accept", "spec_rollback", "spec_rings", "spec_draft")


def speculative_chain(params: dict, cache: dict, rings, state: dict, engram_hash, *, config: ModelConfig,
                      opts: InferenceOptions):
    """One DSpark speculative step that feeds itself (cf. ``decode_chain``): verify ``state["drafts"]`` after
    ``state["pending"]``, accept, roll back, draft the next block — :func:`speculative_round` — and update the
    state on the device, so that any number of steps run back to back and their tokens are read back later.
    Greedy, or with the state entries ``temperature`` / ``top_p`` float32 [B], ``top_k`` / ``seeds`` int32 [B]
    (``top_k`` / ``top_p`` left out when no row filters: sampling without the vocabulary sort) and
    ``draft_logits`` float32 [B, K, V] (what the pending drafts were drawn from) speculative sampling, whose
    random keys are the host loop's (``step`` is the host loop's step count): the same draws, the same tokens.

    state: ``pending`` int32 [B], ``drafts`` int32 [B, K], ``active`` bool [B], ``generated`` int32 [B] (tokens
    emitted so far, the first one included), ``max_new`` / ``n_prompt`` int32 [B], ``stops`` int32 [B, S] (padded
    with -2), ``max_len`` int32 [], ``step`` int32 [], (with Engram layers ``engram_history`` int32 [B, N-1],
    ``ops.engram_hash.device_history``) and the read-back ring: ``out`` int32 [R, B, K + 1] (row step mod R: the
    step's kept tokens), ``kept`` / ``valid`` int32 [R, B] (tokens kept / verified per row); optionally the
    confidence schedule: ``threshold`` float32 [] and the drafts' ``confidence`` logits float32 [B, K] (each row
    verifies the longest prefix of its drafts whose predicted survival stays >= threshold, as
    :func:`threshold_lengths`; the chunk keeps its width, the rest of the row is masked and picks no expert in
    the MoE). A row ends as
    ``Engine.generate``'s ``finish_reason`` ends it (a stop token, ``max_new`` tokens, the cache's length), so the
    host, replaying the ring, agrees with the device on every row's end. Returns (state, cache, rings)."""
    c = config
    pending, drafts, active = state["pending"], state["drafts"], state["active"]
    b, k = drafts.shape
    tokens = jnp.concatenate([pending[:, None], jnp.where(active[:, None], drafts, 0)], axis=1)
    room = jnp.maximum(state["max_len"] - cache["length"], 0)
    width = k + 1
    if "threshold" in state:  # the confidence schedule: drafts verified per row, as threshold_lengths
        survival = jnp.cumprod(jax.nn.sigmoid(state["confidence"].astype(jnp.float32)), axis=-1)
        width = 1 + jnp.sum(jnp.cumprod(survival >= state["threshold"], axis=-1), axis=-1)
    n_valid = jnp.where(active, jnp.minimum(width, room), 0).astype(jnp.int32)
    eids, new = None, {}
    if c.engram_layer_ids:  # the chunk's n-gram rows, position by position, and the look-back after each
        hist = state["engram_history"]
        rows, hists = [], [hist]
        for j in range(k + 1):
            r, hist = engram_row_ids_step_device(engram_hash, hist, tokens[:, j], active)
            rows.append(r)
            hists.append(hist)
        eids = jnp.stack(rows, axis=1)
    greedy = "temperature" not in state
    sampling = None if greedy else (state["temperature"], state.get("top_k"), state.get("top_p"), state["seeds"])
    n_acc, nxt, cache, rings, nd = speculative_round(params, cache, rings, tokens, n_valid, eids,
                                                     None if greedy else state["draft_logits"], sampling,
                                                     state["step"], config=c, opts=opts, greedy=greedy,
                                                     rerun=False, draft_next=True)
    n_acc = jnp.where(n_valid > 0, n_acc, 0)
    n_keep = jnp.where(n_valid > 0, n_acc + 1, 0).astype(jnp.int32)
    col = jnp.arange(k + 1)[None]
    kept = jnp.where(col < n_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), nxt[:, None])  # drafts, then nxt
    if c.engram_layer_ids:
        new["engram_history"] = jnp.take_along_axis(jnp.stack(hists, axis=1), n_keep[:, None, None], axis=1)[:, 0]
    live = col < n_keep[:, None]
    # the host's finish_reason on each kept token in order: the first that ends the row ends it
    n_before = state["generated"][:, None] + col  # tokens emitted before kept token j
    ends = (jnp.any(kept[..., None] == state["stops"][:, None, :], axis=-1)
            | (n_before + 1 >= state["max_new"][:, None])
            | (state["n_prompt"][:, None] + n_before + 1 > state["max_len"]))
    ended = jnp.any(ends & live, axis=1)
    step = state["step"] + 1
    r = state["out"].shape[0]
    new.update(pending=jnp.where(n_keep > 0, nxt, pending), drafts=nd.tokens[:, :k].astype(jnp.int32),
               active=active & ~ended, generated=state["generated"] + n_keep, step=step,
               **({"confidence": nd.confidence[:, :k].astype(jnp.float32)} if "threshold" in state else {}),
               **({} if greedy else {"draft_logits": nd.logits[:, :k]}),
               out=state["out"].at[(step - 1) % r].set(jnp.where(live, kept, -1).astype(jnp.int32)),
               kept=state["kept"].at[(step - 1) % r].set(n_keep), valid=state["valid"].at[(step - 1) % r].set(n_valid))
    return {**state, **new}, cache, rings


def _draft_sampling(config: ModelConfig, sampling, step):
    """The drafter's sampling arguments of a step: (temperature, top_k, top_p, keys [B, block size])."""
    temperature, top_k, top_p, seeds = sampling
    keys = jax.vmap(lambda k: jax.random.split(k, config.dspark_block_size))(_row_keys(seeds, step, 0))
    return temperature, top_k, top_p, keys


# ----------------------------------------------------------------------------------------------------------
# Verification length from the confidences (non-anticipating: the decision for draft k uses the confidences
# c_1..c_k, and c_k depends on the drafts before k only, never on d_k itself; so truncation stays lossless)
# ----------------------------------------------------------------------------------------------------------

def prefix_survival(confidence_logits: np.ndarray) -> np.ndarray:
    """a[r, k] = prod_{i <= k} sigmoid(c[r, i]): the predicted probability that drafts 1..k are all accepted."""
    c = 1.0 / (1.0 + np.exp(-np.asarray(confidence_logits, np.float64)))
    return np.cumprod(c, axis=-1)


def threshold_lengths(confidence_logits: np.ndarray, threshold: float) -> np.ndarray:
    """Drafts to verify per row: the longest prefix whose survival a[r, k] stays >= threshold."""
    a = prefix_survival(confidence_logits)
    return (a >= threshold).cumprod(axis=-1).sum(axis=-1).astype(np.int64)


def prefix_schedule(a: np.ndarray, steps_per_s: Callable[[int], float], *, early_stop: bool = True) -> np.ndarray:
    """The hardware-aware prefix scheduler (DSpark paper, Algorithm 1): drafts to verify per request.

    ``a`` [R, γ] prefix survivals (non-increasing along each row); ``steps_per_s(n)``: verification steps per
    second for a batch of n tokens (measured). Candidates (r, j) are admitted in decreasing a (a row's drafts in
    order), each adding one token to the batch and a[r, j] expected accepted tokens; the prefix maximising the
    expected tokens per second tau * SPS(B), B = sum_r (1 + l_r), tau = sum_r (1 + sum_{j <= l_r} a[r, j]), is
    returned. ``early_stop`` stops at the first admission that does not improve it (optimal when the objective is
    unimodal along the path); False searches the whole path (jagged step-time curves)."""
    a = np.asarray(a, np.float64)
    r, g = a.shape
    lengths = np.zeros((r,), np.int64)
    n_tokens, tau = r, float(r)
    best, best_lengths = tau * steps_per_s(n_tokens), lengths.copy()
    order = sorted(((-a[i, j], j, i) for i in range(r) for j in range(g) if a[i, j] > 0))
    for _, j, i in order:
        lengths[i] = j + 1
        n_tokens += 1
        tau += a[i, j]
        value = tau * steps_per_s(n_tokens)
        if value > best:
            best, best_lengths = value, lengths.copy()
        elif early_stop:
            break
    return best_lengths


def parse_step_times(text: str) -> dict[int, float]:
    """A step-time table ``"N:MS,N:MS,..."`` (verification step time in milliseconds for a chunk of N tokens per
    row) -> {N: seconds}. Raises ValueError naming the bad entry."""
    table = {}
    for item in str(text).replace(" ", "").split(","):
        if not item:
            continue
        try:
            n, ms = item.split(":")
            n, ms = int(n), float(ms)
        except ValueError:
            raise ValueError(f"step-time entry {item!r} is not N:MS (tokens per row : milliseconds), e.g. "
                             "'1:4.0,2:4.2,6:5.1'") from None
        if n < 1 or not ms > 0:
            raise ValueError(f"step-time entry {item!r}: need N >= 1 tokens and a time > 0 ms")
        table[n] = ms / 1e3
    if not table:
        raise ValueError("the step-time table is empty (expected 'N:MS,N:MS,...')")
    return table


def steps_per_s_from_table(table: dict[int, float], rows: int = 1) -> Callable[[int], float]:
    """steps_per_s(n) for :func:`prefix_schedule` from measured step times per chunk width {width: seconds}: n
    tokens over ``rows`` sequences need a chunk of width ceil(n / rows) (a step's program is as wide as its
    widest row); widths between measured ones take the next measured one (the largest beyond them)."""
    widths = sorted(table)

    def steps_per_s(n: int) -> float:
        w = -(-int(n) // max(int(rows), 1))
        fit = [x for x in widths if x >= w]
        return 1.0 / table[fit[0] if fit else widths[-1]]

    return steps_per_s


_accept_jit = jax.jit(speculative_accept)
_seed_jit = jax.jit(seed_rings, static_argnames=("config", "quant_on", "gemm_input_fp8"), donate_argnames=("rings",))
_draft_jit = jax.jit(draft_from_rings, static_argnames=("config", "quant_on", "moe_impl", "gemm_input_fp8"))
_ROUND_STATIC = ("config", "opts", "greedy", "rerun", "draft_next")


# ----------------------------------------------------------------------------------------------------------
# The host loop
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class SpeculativeStats:
    steps: int = 0  # verification passes
    rows_verified: int = 0  # (sequence, step) pairs verified
    drafted: int = 0  # drafts sent to verification
    accepted: int = 0  # drafts accepted
    emitted: int = 0  # tokens produced by verification steps (accepted + one correction / bonus per row)
    rollbacks: int = 0  # steps that rolled back (some row rejected a draft)
    reruns: int = 0  # ... of which by a second target pass (rollback="rerun")
    device_steps: int = 0  # steps run by the device loop (speculative_chain)
    decode_s: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified sequence-step (accepted drafts + the target's token): 1.0 = no speed-up."""
        return self.emitted / self.rows_verified if self.rows_verified else float("nan")


Drafter = Callable[["SpeculativeDecoder", np.ndarray, np.ndarray], np.ndarray]


def _row_keys(seeds: jax.Array, step: int, stream: int) -> jax.Array:
    """Per-row PRNG keys of one speculative step: fold_in(fold_in(PRNGKey(seed), step), stream)."""
    return jax.vmap(lambda s: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), step), stream))(
        seeds.astype(jnp.uint32))


class SpeculativeDecoder:
    """Speculative generation on top of an :class:`Engine` (its cache, Engram history and options).

    ``drafter(decoder, pending [B], active [B])`` proposes the tokens after each slot's pending token: drafts
    [B, γ], or (drafts, draft logits [B, γ, V]) — the logits they were drawn from, needed when sampling; by
    default the DSpark drafter of ``engine.params["dspark"]``. With any drafter greedy output is identical to
    plain greedy decoding and sampled output is distributed as plain sampling; a good drafter needs fewer target
    passes. ``self.sampling`` (temperature, top_k, top_p, seeds: [B] arrays, set by :meth:`generate`; top_k and
    top_p None when no sampled row filters) selects sampling; None is greedy.

    ``schedule``: None (verify every draft), "threshold" (survival >= ``threshold``) or "prefix" (the
    hardware-aware scheduler), whose step rate is ``steps_per_s(n_tokens)`` (the chunk keeps its full width, rows
    masked) or the table ``step_times`` {chunk width: seconds} (:meth:`measure_step_times`; each step's chunk is
    then as wide as its widest row, the cost the table measured).

    ``chain_every``: DSpark speculation (greedy or sampled) without a schedule or with the threshold schedule runs
    on the device (:func:`speculative_chain`: each step feeds the next, nothing read back between steps) and reads
    its tokens back every this many steps; 0 = the host loop (one read-back per step, as every other mode). Both
    loops draw the same random numbers: the same tokens. ``pipeline``: the device loop queues its next run before
    it reads the current one back (``decode.run_device_loop``), as plain decoding's does; False: one run at a time.
    """

    def __init__(self, engine: Engine, drafter: Drafter | None = None, *, num_draft: int | None = None,
                 schedule: str | None = None, threshold: float = 0.5,
                 steps_per_s: Callable[[int], float] | None = None, early_stop: bool = True,
                 rollback: str = "restore", step_times: dict[int, float] | None = None, chain_every: int = 8,
                 pipeline: bool = True):
        c = engine.config
        self.engine = engine
        self.config = c
        self.quant_on = engine.options.resolved_quant(c)
        # the verification pass is a decode step over a chunk: the prefill-only options do not apply
        self.opts = _decode_opts(engine.options, verification=True)
        self.rings = None
        if drafter is None:
            check_dspark(engine.params, c)
            drafter = SpeculativeDecoder.dspark_drafter
        if isinstance(engine.params, dict) and "dspark" in engine.params and c.num_nextn_predict_layers > 0:
            self.rings = init_dspark_rings(c, engine.max_batch, engine.cache_dtype)
            # committed like the engine's cache and the rings every step returns: fresh uncommitted rings would
            # compile the ring-seeding program a second time on the decoder's second prefill
            device = getattr(engine.params["embed"], "sharding", None)
            if isinstance(device, jax.sharding.SingleDeviceSharding):
                self.rings = jax.device_put(self.rings, device)
        self.drafter = drafter
        self.num_draft = c.dspark_block_size if num_draft is None else int(num_draft)
        if self.num_draft < 1:
            raise EngineError(f"num_draft must be >= 1, got {self.num_draft}")
        if rollback not in ("restore", "rerun"):
            raise EngineError(f"rollback must be 'restore' or 'rerun', got {rollback!r}")
        self.rollback = rollback
        if not isinstance(chain_every, int) or isinstance(chain_every, bool) or chain_every < 0:
            raise EngineError(f"chain_every must be an integer >= 0, got {chain_every!r}")
        self.chain_every = chain_every
        self.pipeline = bool(pipeline)
        if schedule not in (None, "threshold", "prefix"):
            raise EngineError(f"schedule must be None, 'threshold' or 'prefix', got {schedule!r}")
        if schedule == "prefix" and steps_per_s is None and not step_times:
            raise EngineError("schedule='prefix' needs steps_per_s(n_tokens), the measured verification step rate, "
                              "or step_times {chunk width: seconds} (measure_step_times)")
        bad = [w for w, t in (step_times or {}).items() if int(w) < 1 or not t > 0]
        if bad:
            raise EngineError(f"step_times needs widths >= 1 and times > 0 s, got {bad[0]}: {step_times[bad[0]]}")
        self.step_times = dict(step_times) if step_times else None
        if schedule is not None and drafter is not SpeculativeDecoder.dspark_drafter:
            raise EngineError("confidence scheduling needs the DSpark drafter's confidences")
        self.schedule, self.threshold, self.steps_per_s, self.early_stop = schedule, threshold, steps_per_s, early_stop
        self.stats = SpeculativeStats()
        self.last_draft: Draft | None = None
        self.sampling = None  # (temperature, top_k | None, top_p | None, seeds) device arrays [B], or None: greedy

    # ------------------------------------------------------------------------------------------------------
    def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int] | None = None):
        """Engine.prefill that also seeds the DSpark rings. Returns the last logits [n, V]."""
        return self.engine.prefill(prompts, slots, on_features=self._on_features if self.rings is not None else None)

    def _on_features(self, features, pos0, n_valid) -> None:
        self.rings = _seed_jit(self.engine.params, self.rings, features, pos0, n_valid, config=self.config,
                               quant_on=self.quant_on, gemm_input_fp8=self.opts.gemm_input_fp8)

    @staticmethod
    def dspark_drafter(dec: "SpeculativeDecoder", pending: np.ndarray, active: np.ndarray):
        e = dec.engine
        sampling = None if dec.sampling is None else _draft_sampling(dec.config, dec.sampling, dec.stats.steps)
        d = _draft_jit(e.params, dec.rings, e.cache["length"], e.cache["floor"],
                       jnp.asarray(pending.astype(np.int32)), sampling, config=dec.config, quant_on=dec.quant_on,
                       moe_impl=dec.opts.moe_impl, gemm_input_fp8=dec.opts.gemm_input_fp8)
        dec.last_draft = d
        return np.asarray(d.tokens), d.logits

    def verification_lengths(self, active: np.ndarray) -> np.ndarray | None:
        """Drafts to verify per slot from the last draft's confidences (None: all)."""
        if self.schedule is None:
            return None
        conf = np.asarray(self.last_draft.confidence)[:, :self.num_draft]
        if self.schedule == "threshold":
            return threshold_lengths(conf, self.threshold)
        rows = np.flatnonzero(active)
        lengths = np.zeros((len(active),), np.int64)
        sps = self.steps_per_s or steps_per_s_from_table(self.step_times, rows=len(rows))
        lengths[rows] = prefix_schedule(prefix_survival(conf[rows]), sps, early_stop=self.early_stop)
        return lengths

    def measure_step_times(self, widths: Sequence[int] | None = None, reps: int = 3) -> dict[int, float]:
        """The step program's time per chunk width (default 1 .. num_draft + 1 tokens per row: a step verifying
        w - 1 drafts), best of ``reps`` calls after a compiling one, on the engine's batch with no token valid —
        the same work as a real step (static shapes), and nothing in the caches changes. {width: seconds}, the
        table behind the prefix schedule (:func:`steps_per_s_from_table`)."""
        e = self.engine
        b = e.max_batch
        fn = jit_for(speculative_round, self.opts, static=_ROUND_STATIC, donate=("cache", "rings"))
        table = {}
        for w in widths or range(1, self.num_draft + 2):
            chunk = np.zeros((b, int(w)), np.int32)
            eids = self._engram_rows(chunk, np.zeros((b,), bool))
            times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                n_acc, nxt, e.cache, self.rings, nd = fn(
                    e.params, e.cache, self.rings, jnp.asarray(chunk), jnp.zeros((b,), jnp.int32), eids, None, None,
                    jnp.int32(0), config=self.config, opts=self.opts, greedy=True,
                    rerun=self.rollback == "rerun" or w > self.config.sliding_window,
                    draft_next=self.rings is not None)
                jax.device_get((n_acc, nxt) + (() if nd is None else (nd.tokens,)))
                times.append(time.perf_counter() - t0)
            table[int(w)] = min(times[1:]) if reps else times[0]
        return table

    # ------------------------------------------------------------------------------------------------------
    def _engram_rows(self, chunk: np.ndarray, active: np.ndarray):
        e = self.engine
        if e.hasher is None:
            return None
        rows, _ = e.hasher.step(np.where(active[:, None], chunk, 0), e._hist)
        return jnp.asarray(rows)

    def _advance_engram(self, chunk: np.ndarray, n_keep: np.ndarray) -> None:
        """The host Engram history after each row's first n_keep[b] chunk tokens (rows with 0 are unchanged): one
        hasher step per distinct kept length, over the whole batch."""
        e = self.engine
        if e.hasher is None:
            return
        old = e._hist
        fields = (old.tokens, old.segments, old.num_positions, old.num_valid)
        new = [a.copy() for a in fields]
        for n in np.unique(n_keep[n_keep > 0]):
            rows = n_keep == n
            _, h = e.hasher.step(chunk[:, :n], old)
            for a, v in zip(new, (h.tokens, h.segments, h.num_positions, h.num_valid)):
                a[rows] = v[rows]
        e._hist = EngramHistory(*new)

    def verify_greedy(self, pending: np.ndarray, drafts: np.ndarray, active: np.ndarray):
        """:meth:`verify` without sampling (exact argmax matching)."""
        saved, self.sampling = self.sampling, None
        try:
            return self.verify(pending, drafts, active)
        finally:
            self.sampling = saved

    def verify(self, pending: np.ndarray, drafts: np.ndarray, active: np.ndarray, draft_logits=None,
               num_verify: np.ndarray | None = None):
        """Verify ``drafts`` [B, γ] after the pending tokens [B] of the active slots (greedy, or by speculative
        sampling against ``draft_logits`` [B, γ, V] when ``self.sampling`` is set), roll back what was rejected.

        Returns (new tokens per slot: accepted drafts then the target's next token — the correction, or the bonus
        when all were accepted — which is also the new pending token; accepted draft counts [B]).
        ``num_verify`` [B]: drafts to verify per row (default all; a scheduler's choice, 0 = plain decoding)."""
        new, n_acc, _ = self._verify(pending, drafts, active, draft_logits, num_verify)
        return new, n_acc

    def _verify(self, pending, drafts, active, draft_logits=None, num_verify=None, *, length=None,
                draft_next: bool = False):
        """:meth:`verify` as one :func:`speculative_round` program and one read-back; ``length``: the slots'
        lengths when the caller tracks them (else read from the device); ``draft_next``: the program also drafts
        the next block (DSpark), returned as a Draft whose tokens (and confidences, when scheduling) are host
        arrays. Returns (new tokens per slot, accepted drafts [B], next Draft or None)."""
        e = self.engine
        c = self.config
        b = e.max_batch
        pending = np.asarray(pending, np.int64)
        drafts = np.asarray(drafts, np.int64)
        active = np.asarray(active, bool)
        if drafts.ndim != 2 or drafts.shape[0] != b or pending.shape != (b,) or active.shape != (b,):
            raise EngineError(f"verify: need pending [{b}], drafts [{b}, k], active [{b}]; got "
                              f"{pending.shape}, {drafts.shape}, {active.shape}")
        bad = active[:, None] & ((drafts < 0) | (drafts >= c.vocab_size))
        if bad.any():
            row = int(np.argmax(bad.any(axis=1)))
            raise EngineError(f"the drafter proposed token ids outside the vocabulary [0, {c.vocab_size}) for slot "
                              f"{row}: {drafts[row].tolist()}")
        greedy = self.sampling is None
        if not greedy and draft_logits is None:
            raise EngineError("sampling needs the draft logits the drafts were drawn from (drafter returns "
                              "(drafts, logits))")
        length = (e.lengths() if length is None else np.asarray(length)).astype(np.int64)
        chunk = np.concatenate([pending[:, None], np.where(active[:, None], drafts, 0)], axis=1)
        room = np.maximum(e.max_len - length, 0)
        want = chunk.shape[1] if num_verify is None else 1 + np.clip(np.asarray(num_verify), 0, drafts.shape[1])
        n_valid = np.where(active, np.minimum(want, room), 0).astype(np.int32)
        eids = self._engram_rows(chunk, active)
        # restore needs every slot a chunk writes to be distinct: a chunk longer than the window is re-run
        rerun = self.rollback == "rerun" or chunk.shape[1] > c.sliding_window
        draft_next = draft_next and self.rings is not None
        fn = jit_for(speculative_round, self.opts, static=_ROUND_STATIC, donate=("cache", "rings"))
        n_acc, nxt, e.cache, self.rings, nd = fn(
            e.params, e.cache, self.rings, jnp.asarray(chunk.astype(np.int32)), jnp.asarray(n_valid), eids,
            None if greedy else draft_logits, None if greedy else self.sampling, jnp.int32(self.stats.steps),
            config=c, opts=self.opts, greedy=greedy, rerun=rerun, draft_next=draft_next)
        want_conf = nd is not None and self.schedule is not None
        host = jax.device_get((n_acc, nxt) + ((nd.tokens,) if nd is not None else ())
                              + ((nd.confidence,) if want_conf else ()))  # the step's one read-back
        n_acc = np.where(active, host[0], 0).astype(np.int64)
        nxt = host[1]
        if nd is not None:
            nd = nd._replace(tokens=host[2], confidence=host[3] if want_conf else nd.confidence)
        n_keep = np.where(n_valid > 0, n_acc + 1, 0).astype(np.int32)
        st = self.stats
        if (n_keep != n_valid).any():
            st.rollbacks += 1
            st.reruns += int(rerun)
        self._advance_engram(chunk, n_keep)
        new = [[int(t) for t in drafts[s, :n_acc[s]]] + [int(nxt[s])] if n_keep[s] else [] for s in range(b)]
        st.steps += 1
        st.rows_verified += int((n_keep > 0).sum())
        st.drafted += int(np.maximum(n_valid - 1, 0).sum())
        st.accepted += int(n_acc.sum())
        st.emitted += sum(len(x) for x in new)
        return new, n_acc, nd

    def _chain(self, pending: np.ndarray, active: np.ndarray, info: dict, out: dict, account) -> None:
        """The decode loop of ``generate`` on the device (:func:`speculative_chain`), read back in runs of up to
        ``chain_every`` steps; ``account`` replays each step's kept tokens on the host, which must end the same rows
        as the device (checked). A run is never longer than the fewest steps the longest-running row still needs
        (every draft accepted), so no step runs with every row ended. Updates the stats and the host Engram
        look-back."""
        e, c, st = self.engine, self.config, self.stats
        b, k, r = e.max_batch, self.num_draft, self.chain_every
        stops = stop_token_table(b, {s: v[2] for s, v in info.items()})
        max_new = np.zeros((b,), np.int32)
        n_prompt = np.zeros((b,), np.int32)
        generated = np.zeros((b,), np.int32)
        for s, (i, ids, _sp, mnt) in info.items():
            max_new[s], n_prompt[s], generated[s] = mnt, len(ids), len(out[i])
        state = {"pending": jnp.asarray(pending.astype(np.int32)), "drafts": jnp.asarray(
                     np.asarray(self.last_draft.tokens)[:, :k].astype(np.int32)),
                 "active": jnp.asarray(active), "generated": jnp.asarray(generated),
                 "max_new": jnp.asarray(max_new), "n_prompt": jnp.asarray(n_prompt), "stops": jnp.asarray(stops),
                 "max_len": jnp.asarray(e.max_len, jnp.int32), "step": jnp.zeros((), jnp.int32),
                 "out": jnp.zeros((r, b, k + 1), jnp.int32), "kept": jnp.zeros((r, b), jnp.int32),
                 "valid": jnp.zeros((r, b), jnp.int32)}
        if self.sampling is not None:  # speculative sampling against the distribution each draft was drawn from
            state.update((n, a) for n, a in zip(("temperature", "top_k", "top_p", "seeds"), self.sampling)
                         if a is not None)
            state["draft_logits"] = jnp.asarray(self.last_draft.logits)[:, :k]
        if self.schedule == "threshold":
            state["threshold"] = jnp.asarray(self.threshold, jnp.float32)
            state["confidence"] = jnp.asarray(np.asarray(self.last_draft.confidence)[:, :k], jnp.float32)
        tables, hist0 = None, e._hist
        if e.hasher is not None:
            tables = e.hasher.device_tables()
            state["engram_history"] = jnp.asarray(device_history(e._hist))
        device = getattr(e.params["embed"], "sharding", None)
        if isinstance(device, jax.sharding.SingleDeviceSharding):  # committed like the state the steps return
            state = jax.device_put(state, device)
        fn = jit_for(speculative_chain, self.opts, donate=("cache", "rings"))
        held = [state]

        def dispatch(first, n):
            st_ = held[0]
            for _ in range(n):
                st_, e.cache, self.rings = fn(e.params, e.cache, self.rings, st_, tables, config=c, opts=self.opts)
            held[0] = st_
            # the run's read-back: arrays of its own (the state is not donated), so the next run may be queued
            # before these are read
            return st_["out"], st_["kept"], st_["valid"], st_["active"]

        def plan(read, queued):
            """Steps of the next run: only steps the longest-running row surely still needs — it emits at most
            k + 1 tokens a step, so it runs at least ceil(left / (k + 1)) more steps from the last step read back —
            less those already queued. At most one run ahead of the read-back, so the device does not idle while
            the host reads a run back, accounts it and queues the next (measured on an H200: 0.6 ms of a 2.8 ms
            batch-1 step idle with one run at a time, benchmarks/RESULTS.md)."""
            if not active.any():
                return 0
            left = max(min(int(max_new[s]), e.max_len - int(n_prompt[s]) + 1) - len(out[info[s][0]])
                       for s in np.flatnonzero(active))  # tokens the longest-running row may still emit
            need = -(-left // (k + 1)) - (queued - read)
            return max(1, min(r, need)) if queued == read else max(0, min(r, need))

        def consume(buf, first, n):
            toks, kept, valid, dev_active = jax.device_get(buf)  # the run's one read-back
            for j in range(n):
                row = (first + j) % r
                kp, vl = kept[row], valid[row]
                st.steps += 1
                st.device_steps += 1
                st.rows_verified += int((kp > 0).sum())
                st.drafted += int(np.maximum(vl - 1, 0).sum())
                st.accepted += int(np.maximum(kp - 1, 0).sum())
                st.emitted += int(kp.sum())
                st.rollbacks += int((kp != vl).any())
                for s in np.flatnonzero(active):
                    account(int(s), [int(t) for t in toks[row, s, :kp[s]]])
            check_device_ends(active, dev_active)
            return bool(active.any())

        run_device_loop(dispatch, plan, consume, pipeline=self.pipeline)
        if e.hasher is not None:
            e._hist = e._fed_history(hist0, info, out)

    # ------------------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence, *, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] | None = None,
                 on_token: Callable[[int, int], None] | None = None) -> list[Result]:
        """``Engine.generate`` by speculation: greedy output is identical token for token in float32 (in 16-bit
        the multi-token verification pass and the one-token step round differently, so near-tied top logits may
        pick different tokens); sampled output has the same distribution (not the same draws: the random streams
        differ)."""
        e = self.engine
        c = self.config
        reqs = [p if isinstance(p, Request) else Request(prompt=p, max_new_tokens=max_new_tokens,
                                                         temperature=temperature, top_k=top_k, top_p=top_p,
                                                         seed=seed, stop_tokens=stop_tokens) for p in prompts]
        if len(reqs) > e.max_batch:
            raise EngineError(f"{len(reqs)} requests but the engine serves at most max_batch={e.max_batch}")
        results: list[Result | None] = [None] * len(reqs)
        ok = []
        for i, r in enumerate(reqs):
            try:
                ids, sp, stops = e._validate(r)
            except EngineError as err:
                results[i] = Result([], "error", 0, error=str(err))
                continue
            ok.append((i, ids, stops, r.max_new_tokens, sp))
        self.stats = SpeculativeStats()
        if not ok:
            return results  # type: ignore[return-value]
        b = e.max_batch
        slot_of = {i: s for s, (i, *_rest) in enumerate(ok)}
        samp = [np.zeros((b,), np.float32), np.zeros((b,), np.int32), np.ones((b,), np.float32),
                np.zeros((b,), np.int32)]
        for i, *_, sp in ok:
            for a, v in zip(samp, (sp.temperature, sp.top_k, sp.top_p, sp.seed)):
                a[slot_of[i]] = v
        samp = tuple(jnp.asarray(a) for a in samp)
        self.sampling = None
        if (samp[0] > 0).any():  # top-k / top-p None when no sampled row filters: no vocabulary sort per step
            t, k, p, seeds = samp
            self.sampling = (t, None, None, seeds) if sampler_for(t, k, p) == "unfiltered" else samp
        last = self.prefill([ids for _, ids, *_ in ok], [slot_of[i] for i, *_ in ok])
        full_last = jnp.zeros((b, last.shape[-1]), last.dtype).at[jnp.asarray([slot_of[i] for i, *_ in ok])].set(last)
        # the first token as the plain engine samples it (same key: step 0 of the row's seed)
        pending = np.asarray(sample_jit(full_last, *samp, jnp.zeros((b,), jnp.int32))).astype(np.int64)
        out = {i: [] for i, *_ in ok}
        info = {slot_of[i]: (i, ids, stops, mnt) for i, ids, stops, mnt, _ in ok}
        active = np.zeros((b,), bool)
        active[list(info)] = True
        t0 = time.perf_counter()

        def account(s: int, toks: list[int]) -> None:
            i, ids, stops, mnt = info[s]
            for t in toks:
                out[i].append(t)
                if on_token is not None:
                    on_token(i, t)
                reason = finish_reason(t, stops, len(out[i]), mnt, len(ids), e.max_len)
                if reason is not None:
                    active[s] = False
                    results[i] = Result(out[i], reason, len(ids), text=e._decode_text(out[i]))
                    return

        for s in list(info):
            account(s, [int(pending[s])])
        # the DSpark drafter runs inside each step's program, drafting the next block after the step's own
        # result: one program and one read-back per step (any other drafter is called between the steps)
        fused = self.drafter is SpeculativeDecoder.dspark_drafter and self.rings is not None
        length = e.lengths().astype(np.int64)
        if fused and active.any():
            self.drafter(self, pending, active.copy())
        if fused and active.any() and self.schedule in (None, "threshold") \
                and self.chain_every > 0 \
                and self.num_draft + 1 <= c.sliding_window:
            self._chain(pending, active, info, out, account)
        while active.any():
            if fused:
                drafts, draft_logits = np.asarray(self.last_draft.tokens), self.last_draft.logits
            else:
                proposal = self.drafter(self, pending, active.copy())
                drafts, draft_logits = proposal if isinstance(proposal, tuple) else (proposal, None)
            drafts = np.asarray(drafts)[:, :self.num_draft]
            num_verify = self.verification_lengths(active)
            if self.schedule == "prefix" and self.step_times:  # a step as wide as its widest row: the time the
                drafts = drafts[:, :int(num_verify[active].max())]  # table (per width) gave the scheduler
            new, n_acc, nd = self._verify(pending, drafts, active, draft_logits, num_verify, length=length,
                                          draft_next=fused)
            if nd is not None:
                self.last_draft = nd
            for s in np.flatnonzero(active):
                length[s] += len(new[s])
                pending[s] = new[s][-1]
                account(int(s), new[s])
        self.stats.decode_s = time.perf_counter() - t0
        return results  # type: ignore[return-value]


__all__ = ["init_dspark_rings", "seed_rings", "ring_context", "draft_from_rings", "verify_chunk", "save_touched",
           "restore_rejected", "greedy_accept", "speculative_round", "speculative_chain", "greedy_acceptance",
           "speculative_accept",
           "prefix_survival", "threshold_lengths", "prefix_schedule", "parse_step_times",
           "steps_per_s_from_table", "SpeculativeStats", "SpeculativeDecoder"]
