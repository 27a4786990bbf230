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
4. roll back (:func:`rollback`): the verification pass ran on a copy (the cache is not donated); when a draft
   was rejected, the SWA ring slots of the rejected tokens are restored from the cache before the pass and every
   KV source's update (compressed entries, indexer keys, partial group) is redone from the pass's compressor
   inputs with only the a + 1 accepted tokens valid, so every cache is what feeding those tokens gives (or, with
   ``rollback="rerun"``, the step is re-run on them: a second target pass). The host Engram history is advanced
   by the accepted tokens only; the DSpark rings get the accepted tokens' features.

The verification length is γ (less near ``max_len``), or chosen per row from the drafter's
confidences: a survival threshold, or the hardware-aware prefix scheduler over a measured step rate.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.inference.engine import Engine, EngineError, Request, Result, finish_reason
from dsv41_jax.inference.sampling import filter_logits, sample_jit
from dsv41_jax.inference.step import (InferenceOptions, embed, emit_entries, head, jit_for, ring_read, ring_write,
                                      run_layers)
from dsv41_jax.model.dspark import Draft, check_dspark, context_kvs, draft
from dsv41_jax.ops.engram_hash import EngramHistory
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
    target's sampler (``sampling.filter_logits``; temperature 0 rows stay greedy)."""
    params = _drafter_view(params, config, gemm_input_fp8)
    ctx, ctx_pos = ring_context(rings, length, floor)
    kw = {}
    if sampling is not None:
        temperature, top_k, top_p, keys = sampling
        kw = dict(temperature=temperature, keys=keys,
                  filter_fn=lambda z: filter_logits(z, temperature, top_k, top_p))
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


def rollback(params: dict, before: dict, after: dict, compressor_inputs: dict, n_keep: jax.Array, *,
             config: ModelConfig, opts: InferenceOptions, chunk: int) -> dict:
    """The cache after only the first n_keep [B] tokens of a verified chunk, from the caches ``before`` and
    ``after`` the pass (which consumed more) — what feeding just those tokens gives, without a second pass:

    * SWA rings: the slots the kept tokens wrote come from ``after``, every other slot from ``before`` (the chunk
      is at most a window long, so no slot was written twice);
    * KV sources: the compressor update is redone on ``before`` from the pass's compressor inputs with n_keep
      valid tokens (entries of the kept complete groups, the kept partial group), as the step itself does it;
    * lengths: ``before`` + n_keep. Everything else (floor) is unchanged by a step."""
    c = config
    w = c.sliding_window
    pos0 = before["length"]
    i = jnp.arange(chunk)[None, :]
    slot = jnp.where(i < n_keep[:, None], jnp.mod(pos0[:, None] + i, w), w)  # w: not written
    written = jnp.any(slot[:, :, None] == jnp.arange(w)[None, None, :], axis=1)  # [B, W]
    swa = [jnp.where(written[:, :, None], a, b) for a, b in zip(after["swa"], before["swa"])]
    rope = {k: jnp.asarray(v) for k, v in rope_tables(c).items()}
    quant_on = opts.resolved_quant(c)
    sources = {}
    for key, src in before["sources"].items():
        layer = int(key)
        attn = params["layers"][layer]["attn"]
        sources[key] = emit_entries(src, compressor_inputs[layer], attn["compressor"], attn["indexer"],
                                    c.compress_ratios[layer], pos0, n_keep, c, rope, quant_on)
    return dict(after, length=pos0 + n_keep, swa=swa, sources=sources)


def greedy_acceptance(drafts: np.ndarray, target: np.ndarray, n_valid: np.ndarray) -> np.ndarray:
    """Accepted drafts per row: the longest prefix k < n_valid with drafts[:, k] == target[:, k] (target[:, k] is
    the target's argmax after the chunk's token k, i.e. its choice for the position draft k occupies)."""
    b, g = drafts.shape
    match = (drafts == target[:, :g]) & (np.arange(g)[None, :] < (n_valid[:, None] - 1))
    return np.cumprod(match, axis=1).sum(axis=1).astype(np.int64)


def speculative_accept(target_logits: jax.Array, draft_logits: jax.Array, drafts: jax.Array, n_valid: jax.Array,
                       temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, keys: jax.Array):
    """Lossless acceptance of verified chunks (standard speculative sampling; greedy rows: exact argmax match).

    target_logits [B, K + 1, V]: the target's logits after each chunk token; draft_logits [B, K, V]: the logits
    the drafts [B, K] were drawn from (DSpark: base + Markov bias), through the same sampling filter
    (``sampling.filter_logits`` with the row's temperature / top-k / top-p) as the target's; n_valid [B]: chunk
    tokens verified (1 + drafts); keys [B] PRNG keys. Draft k is accepted with probability min(1, p_k(x)/q_k(x));
    at the first rejection the next token is drawn from normalise(max(p - q, 0)) (p where that is empty), after
    all accepted from the target's next distribution: the emitted tokens are distributed as plain sampling's.
    Rows with temperature 0 use one-hot p = argmax of the target and q = the draft. Returns (accepted drafts [B],
    next token [B])."""
    b, k1, v = target_logits.shape
    k = k1 - 1

    def probs(z):
        n = z.shape[1]
        rep = lambda a: jnp.repeat(a, n)  # noqa: E731
        f = filter_logits(z.reshape(b * n, v), rep(temperature), rep(top_k), rep(top_p))
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
    q_at = jnp.take_along_axis(q, jnp.minimum(n_acc, k - 1)[:, None, None], axis=1)[:, 0]
    rejected = (n_acc < n_valid - 1)[:, None]
    resid = jnp.where(rejected, jnp.maximum(p_at - q_at, 0.0), p_at)
    resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 1e-8, resid, p_at)
    drawn = jax.vmap(jax.random.categorical)(split[:, 1], jnp.log(resid))
    nxt = jnp.where(temperature <= 0, jnp.argmax(resid, -1), drawn)
    return n_acc.astype(jnp.int32), nxt.astype(jnp.int32)


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


_accept_jit = jax.jit(speculative_accept)
_seed_jit = jax.jit(seed_rings, static_argnames=("config", "quant_on", "gemm_input_fp8"), donate_argnames=("rings",))
_draft_jit = jax.jit(draft_from_rings, static_argnames=("config", "quant_on", "moe_impl", "gemm_input_fp8"))


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
    passes. ``self.sampling`` (temperature, top_k, top_p, seeds: [B] arrays, set by :meth:`generate`) selects
    sampling; None is greedy.
    """

    def __init__(self, engine: Engine, drafter: Drafter | None = None, *, num_draft: int | None = None,
                 schedule: str | None = None, threshold: float = 0.5,
                 steps_per_s: Callable[[int], float] | None = None, early_stop: bool = True,
                 rollback: str = "restore"):
        c = engine.config
        self.engine = engine
        self.config = c
        self.quant_on = engine.options.resolved_quant(c)
        # the verification pass is a decode step over a chunk: the prefill-only options do not apply
        self.opts = dataclasses.replace(engine.options, ced=True, replay_len=None)
        self.rings = None
        if drafter is None:
            check_dspark(engine.params, c)
            drafter = SpeculativeDecoder.dspark_drafter
        if isinstance(engine.params, dict) and "dspark" in engine.params and c.num_nextn_predict_layers > 0:
            self.rings = init_dspark_rings(c, engine.max_batch, engine.cache_dtype)
        self.drafter = drafter
        self.num_draft = c.dspark_block_size if num_draft is None else int(num_draft)
        if self.num_draft < 1:
            raise EngineError(f"num_draft must be >= 1, got {self.num_draft}")
        if rollback not in ("restore", "rerun"):
            raise EngineError(f"rollback must be 'restore' or 'rerun', got {rollback!r}")
        self.rollback = rollback
        if schedule not in (None, "threshold", "prefix"):
            raise EngineError(f"schedule must be None, 'threshold' or 'prefix', got {schedule!r}")
        if schedule == "prefix" and steps_per_s is None:
            raise EngineError("schedule='prefix' needs steps_per_s(n_tokens), the measured verification step rate")
        if schedule is not None and drafter is not SpeculativeDecoder.dspark_drafter:
            raise EngineError("confidence scheduling needs the DSpark drafter's confidences")
        self.schedule, self.threshold, self.steps_per_s, self.early_stop = schedule, threshold, steps_per_s, early_stop
        self.stats = SpeculativeStats()
        self.last_draft: Draft | None = None
        self.sampling = None  # (temperature, top_k, top_p, seeds) device arrays [B], or None: greedy

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
        sampling = None
        if dec.sampling is not None:
            temperature, top_k, top_p, seeds = dec.sampling
            keys = jax.vmap(lambda k: jax.random.split(k, dec.config.dspark_block_size))(
                _row_keys(seeds, dec.stats.steps, 0))
            sampling = (temperature, top_k, top_p, keys)
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
        lengths[rows] = prefix_schedule(prefix_survival(conf[rows]), self.steps_per_s, early_stop=self.early_stop)
        return lengths

    # ------------------------------------------------------------------------------------------------------
    def _engram_rows(self, chunk: np.ndarray, active: np.ndarray):
        e = self.engine
        if e.hasher is None:
            return None
        rows, _ = e.hasher.step(np.where(active[:, None], chunk, 0), e._hist)
        return jnp.asarray(rows)

    def _advance_engram(self, chunk: np.ndarray, n_keep: np.ndarray) -> None:
        """The host Engram history after each row's first n_keep[b] chunk tokens (rows with 0 are unchanged)."""
        e = self.engine
        if e.hasher is None:
            return
        old = e._hist
        new = [a.copy() for a in (old.tokens, old.segments, old.num_positions, old.num_valid)]
        for row in np.flatnonzero(n_keep > 0):
            one = EngramHistory(*(a[row:row + 1] for a in (old.tokens, old.segments, old.num_positions,
                                                           old.num_valid)))
            _, h = e.hasher.step(chunk[row:row + 1, :n_keep[row]], one)
            for a, v in zip(new, (h.tokens, h.segments, h.num_positions, h.num_valid)):
                a[row] = v[0]
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
        length = e.lengths().astype(np.int64)
        chunk = np.concatenate([pending[:, None], np.where(active[:, None], drafts, 0)], axis=1)
        room = np.maximum(e.max_len - length, 0)
        want = chunk.shape[1] if num_verify is None else 1 + np.clip(np.asarray(num_verify), 0, drafts.shape[1])
        n_valid = np.where(active, np.minimum(want, room), 0).astype(np.int32)
        eids = self._engram_rows(chunk, active)
        verify = jit_for(verify_chunk, self.opts, donate=())
        tok = jnp.asarray(chunk.astype(np.int32))
        logits, feats, verified, comp = verify(e.params, e.cache, tok, jnp.asarray(n_valid), eids, config=c,
                                               opts=self.opts)
        k = drafts.shape[1]
        if self.sampling is None:
            sampling = (jnp.zeros((b,)), jnp.zeros((b,), jnp.int32), jnp.ones((b,)), jnp.zeros((b,), jnp.int32))
        else:
            sampling = self.sampling
            if draft_logits is None:
                raise EngineError("sampling needs the draft logits the drafts were drawn from (drafter returns "
                                  "(drafts, logits))")
        q = logits[:, :k] if draft_logits is None else jnp.asarray(draft_logits)[:, :k]
        n_acc, nxt = _accept_jit(logits, q, jnp.asarray(drafts.astype(np.int32)), jnp.asarray(n_valid),
                                 *sampling[:3], _row_keys(sampling[3], self.stats.steps, 1))
        n_acc = np.where(active, np.asarray(n_acc), 0).astype(np.int64)
        nxt = np.asarray(nxt)
        n_keep = np.where(n_valid > 0, n_acc + 1, 0).astype(np.int32)
        if (n_keep == n_valid).all():
            e.cache = verified
        elif self.rollback == "restore" and chunk.shape[1] <= c.sliding_window:
            self.stats.rollbacks += 1
            # no donation: unchanged leaves (floor) may be one buffer in both caches
            fn = jit_for(rollback, self.opts, static=("config", "opts", "chunk"), donate=())
            e.cache = fn(e.params, e.cache, verified, comp, jnp.asarray(n_keep), config=c, opts=self.opts,
                         chunk=chunk.shape[1])
        else:  # redo the step from the untouched cache with only the accepted tokens valid
            self.stats.rollbacks += 1
            self.stats.reruns += 1
            _, feats, e.cache, _ = verify(e.params, e.cache, tok, jnp.asarray(n_keep), eids, config=c,
                                          opts=self.opts)
        self._advance_engram(chunk, n_keep)
        if self.rings is not None:
            self.rings = _seed_jit(e.params, self.rings, feats, jnp.asarray(length.astype(np.int32)),
                                   jnp.asarray(n_keep), config=c, quant_on=self.quant_on,
                                   gemm_input_fp8=self.opts.gemm_input_fp8)
        new = [[int(t) for t in drafts[s, :n_acc[s]]] + [int(nxt[s])] if n_keep[s] else [] for s in range(b)]
        st = self.stats
        st.steps += 1
        st.rows_verified += int((n_keep > 0).sum())
        st.drafted += int(np.maximum(n_valid - 1, 0).sum())
        st.accepted += int(n_acc.sum())
        st.emitted += sum(len(x) for x in new)
        return new, n_acc

    # ------------------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence, *, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] | None = None,
                 on_token: Callable[[int, int], None] | None = None) -> list[Result]:
        """``Engine.generate`` by speculation: greedy output is identical token for token; sampled output has
        the same distribution (not the same draws: the random streams differ)."""
        e = self.engine
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
        self.sampling = samp if (samp[0] > 0).any() else None
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
        while active.any():
            proposal = self.drafter(self, pending, active.copy())
            drafts, draft_logits = proposal if isinstance(proposal, tuple) else (proposal, None)
            drafts = np.asarray(drafts)[:, :self.num_draft]
            new, _ = self.verify(pending, drafts, active, draft_logits, self.verification_lengths(active))
            for s in np.flatnonzero(active):
                pending[s] = new[s][-1]
                account(int(s), new[s])
        self.stats.decode_s = time.perf_counter() - t0
        return results  # type: ignore[return-value]


__all__ = ["init_dspark_rings", "seed_rings", "ring_context", "draft_from_rings", "verify_chunk", "rollback",
           "greedy_acceptance", "speculative_accept", "prefix_survival", "threshold_lengths", "prefix_schedule",
           "SpeculativeStats", "SpeculativeDecoder"]
