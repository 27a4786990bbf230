"""Decode: one new token per active slot through all layers, as one jitted step with the cache donated.

Per layer: the token's window latent goes into the layer's SWA ring; a KV source adds it to its partial group and
emits a compressed entry (main KV + indexer keys) when the group completes; every index source scores its query
against its own group's current keys (decode ≡ prefill; the official code's stale indexer-key pointer is not
reproduced); the HSI candidate source publishes its pool and Reindex layers score only the pool's entries
(gathered); Reuse layers take the latest top-k. Inactive slots pass through untouched.

Capacity (a slot holds at most ``cache_capacity`` tokens; a token past it would lose its compressed entry):
``decode_step`` reads the slots' lengths on the host and raises :class:`DecodeError` for a full active slot; the
``Engine`` tracks lengths itself and stops a sequence at its ``max_len``. The jitted programs
(``decode_step_jit``, ``decode_and_sample``) cannot raise from the device without a host round-trip per step, so
they guard in the graph instead: a full slot is not fed (nothing is written, its length stays), its logits row is
NaN and its sampled token -1 — an invalid token id that every checked entry point rejects — so a caller that
ignores capacity gets a loud result, never a silently truncated cache.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.inference.cache import cache_capacity, check_capacity
from dsv41_jax.inference.sampling import check_sampler, sample
from dsv41_jax.inference.step import InferenceOptions, decode_compiler_options, embed, head, jit_for, run_layers
from dsv41_jax.ops.engram_hash import DeviceEngramHash, engram_row_ids_step_device


class DecodeError(ValueError):
    pass


def _step(params, cache, tokens, engram_ids, active, config: ModelConfig, opts: InferenceOptions):
    """(logits [B, V], cache, full [B] bool): ``full`` marks active slots refused for lack of room."""
    pos0 = cache["length"]
    full = active & (pos0 >= cache_capacity(config, cache))
    n_valid = (active & ~full).astype(jnp.int32)
    streams, pre_mix = embed(params, tokens[:, None], config)
    eids = None if engram_ids is None else engram_ids[:, None]
    streams, pre_mix, cache = run_layers(params, cache, streams, pre_mix, pos0, n_valid, eids, config=config, lo=0,
                                         hi=config.num_hidden_layers, opts=opts)
    logits = head(params, streams, pre_mix, config)[:, 0]
    logits = jnp.where(full[:, None], jnp.nan, logits)
    return logits, dict(cache, length=pos0 + n_valid), full


def _decode_opts(opts: InferenceOptions, *, verification: bool = False) -> InferenceOptions:
    """Decode ignores the prefill-only options: normalise them so one compile serves every prefill mode; its XLA
    options are ``step.decode_compiler_options`` (``verification``: the speculative verification programs', the
    dot merger off on the GPU)."""
    return dataclasses.replace(opts, ced=True, replay_len=None,
                               compiler_options=decode_compiler_options(opts, verification=verification))


def _decode(params, cache, tokens, engram_ids, active, *, config: ModelConfig, opts: InferenceOptions):
    return _step(params, cache, tokens, engram_ids, active, config, opts)[:2]


def _decode_sample(params, cache, tokens, engram_ids, active, temperature, top_k, top_p, seeds, steps, *,
                   config: ModelConfig, opts: InferenceOptions, return_logits: bool, sampler: str = "filtered"):
    logits, cache, full = _step(params, cache, tokens, engram_ids, active, config, opts)
    nxt = jnp.where(full, -1, sample(logits, temperature, top_k, top_p, seeds, steps, sampler))
    if return_logits:
        return nxt, cache, logits
    return nxt, cache


def decode_step_jit(params, cache, tokens, engram_ids, active, *, config: ModelConfig,
                    opts: InferenceOptions = InferenceOptions()):
    """The jitted decode step without host checks: (logits [B, V], cache); the cache is donated. An active slot
    already at the cache's capacity is not fed: its logits row is NaN and its cache untouched."""
    opts = _decode_opts(opts)
    return jit_for(_decode, opts)(params, cache, tokens, engram_ids, active, config=config, opts=opts)


def decode_and_sample(params, cache, tokens, engram_ids, active, temperature, top_k, top_p, seeds, steps, *,
                      config: ModelConfig, opts: InferenceOptions = InferenceOptions(), return_logits: bool = False,
                      sampler: str = "filtered"):
    """One decode step fused with sampling: (next tokens [B] int32, cache[, logits]); the cache is donated. An
    active slot already at the cache's capacity is not fed: its next token is -1 and its cache untouched.
    ``sampler``: ``sampling.sampler_for`` of the rows' parameters, to leave out work no row needs."""
    opts = _decode_opts(opts)
    fn = jit_for(_decode_sample, opts, static=("config", "opts", "return_logits", "sampler"))
    return fn(params, cache, tokens, engram_ids, active, temperature, top_k, top_p, seeds, steps, config=config,
              opts=opts, return_logits=return_logits, sampler=check_sampler(sampler))


def _decode_chain(params, cache, state, engram_hash, temperature, top_k, top_p, seeds, stops, max_new, room, *,
                  config: ModelConfig, opts: InferenceOptions, sampler: str = "filtered"):
    tokens, active = state["tokens"], state["active"]
    eids, new_state = None, {}
    if config.engram_layer_ids:
        eids, new_state["engram_history"] = engram_row_ids_step_device(engram_hash, state["engram_history"], tokens,
                                                                       active)
    logits, cache, full = _step(params, cache, tokens, eids, active, config, opts)
    step = state["step"] + 1
    # each slot's k-th new token (0-based: the prefill's is k = 0) samples with fold_in(seed, k), k = the tokens it
    # has generated so far: slots that started at different times (continuous batching) each keep their own stream
    nxt = jnp.where(full, -1, sample(logits, temperature, top_k, top_p, seeds, state["generated"], sampler))
    generated = state["generated"] + active.astype(jnp.int32)
    # the Engine's finish_reason, evaluated where the token is: stop token, max_new_tokens, cache room
    done = jnp.any(nxt[:, None] == stops, axis=-1) | (generated >= max_new) | (generated > room)
    new_state.update(tokens=jnp.where(active, nxt, tokens), active=active & ~done, generated=generated, step=step)
    if "readback" in state:  # the last R steps' tokens (row (step - 1) mod R) and, in row R, the active slots
        buf = state["readback"]
        r = buf.shape[0] - 1
        new_state["readback"] = buf.at[(step - 1) % r].set(nxt).at[r].set(new_state["active"].astype(jnp.int32))
    return nxt, new_state, cache


def decode_chain_program(opts: InferenceOptions):
    """The program store ``decode_chain`` runs for these (decode-normalised) options: for callers that prepare
    (compile ahead) or count its programs. Its static arguments: config, opts, sampler."""
    return jit_for(_decode_chain, opts, static=("config", "opts", "sampler"))


def decode_chain(params, cache, state: dict, engram_hash: DeviceEngramHash | None, temperature, top_k, top_p,
                 seeds, stops, max_new, room, *, config: ModelConfig, opts: InferenceOptions = InferenceOptions(),
                 sampler: str = "filtered"):
    """One decode step that feeds itself: (next tokens [B] int32, next state, cache); the cache is donated.

    Unlike ``decode_and_sample`` it needs nothing from the host between steps, so any number of steps can be
    dispatched back to back and their tokens read back later: the state carries the tokens to feed, the active
    slots, the tokens generated so far per slot (each slot's position in its sampling stream) and the step number
    (the readback row); with Engram
    layers also the slots' look-back (``ops.engram_hash.device_history``), hashed on the device
    (``engram_row_ids_step_device``, bit-identical to the host hasher with ``engram_hash`` = the hasher's
    ``device_tables()``). A slot ends — stays in the batch but is no longer fed — when it samples one of its
    ``stops`` (int32 [B, S], padded with -2), reaches ``max_new`` generated tokens, or generated more than
    ``room`` (its max_len minus its prompt length): the ``Engine``'s ``finish_reason``, so the host, replaying
    it on the tokens read back, agrees with the device on every slot's end.

    state: ``tokens`` int32 [B], ``active`` bool [B], ``generated`` int32 [B], ``step`` int32 [] (+
    ``engram_history`` int32 [B, N-1]; + optionally ``readback`` int32 [R + 1, B]: each step writes its tokens to
    row (step - 1) mod R and the active slots to row R, so that a run of up to R steps comes back in one transfer
    without any other program). An active slot at the cache's capacity is not fed and samples -1. ``sampler``:
    ``sampling.sampler_for`` of the rows' parameters, to leave out work no row needs (a greedy batch's steps
    skip the vocabulary sort)."""
    opts = _decode_opts(opts)
    if config.engram_layer_ids and (engram_hash is None or "engram_history" not in state):
        raise DecodeError("this config has Engram layers: decode_chain needs engram_hash (hasher.device_tables()) "
                          "and state['engram_history'] (ops.engram_hash.device_history)")
    fn = decode_chain_program(opts)
    return fn(params, cache, state, engram_hash if config.engram_layer_ids else None, temperature, top_k, top_p,
              seeds, stops, max_new, room, config=config, opts=opts, sampler=check_sampler(sampler))


def run_device_loop(dispatch, plan, consume, *, pipeline: bool = True) -> int:
    """Drive a self-feeding decode loop (``decode_chain``) in runs of steps, each run read back in one transfer.

    ``dispatch(first, n)``: enqueue steps ``first .. first + n - 1`` (asynchronously: JAX returns before the device
    has run them) and return the run's read-back, a device array not yet read. ``plan(read, queued)``: the length of
    the next run, given ``read`` steps read back and accounted and ``queued`` steps dispatched in all; 0 when no
    further step can be needed. ``consume(readback, first, n)``: read the run back, account its tokens; False ends
    the loop. Returns the number of steps dispatched.

    Unpipelined, a run is dispatched after the previous one is read back, so the device idles while the host waits
    for the transfer, accounts the tokens and dispatches the next run's first step. Pipelined (default), the next
    run is dispatched before the current one is read back, so the device always has a run queued. The host then
    decides each run one run late: ``plan`` bounds it by the steps still possible after those in flight (so no run
    is dispatched that a length limit rules out), but a run dispatched after every slot has ended on a stop token
    is only learnt to be useless once dispatched. Such steps change nothing: ``decode_chain`` feeds only the slots
    still active on the device (an ended slot writes no cache entry, keeps its length and generated count) and
    ``consume`` accounts only the host's active slots; the readback of each run is its own array (the state is not
    donated), so reading run n after dispatching run n + 1 reads run n's tokens."""
    pending = []  # (readback, first step, steps) of the runs dispatched and not yet read back
    read = queued = 0
    while True:
        while len(pending) < (2 if pipeline else 1):
            n = plan(read, queued)
            if n <= 0:
                break
            pending.append((dispatch(queued, n), queued, n))
            queued += n
        if not pending:
            return queued
        buf, first, n = pending.pop(0)
        alive = consume(buf, first, n)
        read += n
        if not alive:
            return queued


def decode_step(params: dict, cache: dict, tokens, engram_ids=None, active=None, *, config: ModelConfig,
                opts: InferenceOptions = InferenceOptions()):
    """Feed one token per slot: ``tokens`` int [B]; ``engram_ids`` int32 [B, n_engram_layers, n_hash_cols] (the
    host hasher's ``step`` output for these tokens); ``active`` bool [B] (default: all). Returns
    ``(logits [B, V] float32, cache)``; the input cache is donated. Checks concrete inputs on the host, including
    that every active slot has room for one more token (this reads the slots' lengths back from the device)."""
    tok = np.asarray(tokens)
    b = cache["length"].shape[0]
    if tok.shape != (b,) or not np.issubdtype(tok.dtype, np.integer):
        raise DecodeError(f"tokens must be an int array of shape ({b},), got {tok.dtype} {tok.shape}")
    act = np.ones((b,), bool) if active is None else np.asarray(active, bool)
    if act.shape != (b,):
        raise DecodeError(f"active must have shape ({b},), got {act.shape}")
    bad = act & ((tok < 0) | (tok >= config.vocab_size))
    if bad.any():
        row = int(np.argmax(bad))
        raise DecodeError(f"token id {int(tok[row])} (slot {row}) is outside the vocabulary [0, {config.vocab_size})")
    if config.engram_layer_ids:
        expect = (b, len(config.engram_layer_ids), config.n_hash_cols)
        if engram_ids is None or tuple(np.shape(engram_ids)) != expect:
            raise DecodeError(f"engram_ids must have shape {expect} (hasher.step of these tokens), got "
                              f"{None if engram_ids is None else tuple(np.shape(engram_ids))}")
        engram_ids = jnp.asarray(engram_ids, jnp.int32)
    check_capacity(config, cache, np.asarray(cache["length"]), act.astype(np.int64), error=DecodeError)
    return decode_step_jit(params, cache, jnp.asarray(tok.astype(np.int32)), engram_ids, jnp.asarray(act),
                           config=config, opts=opts)


__all__ = ["DecodeError", "decode_step", "decode_step_jit", "decode_and_sample", "decode_chain", "run_device_loop"]
