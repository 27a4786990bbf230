"""Prefill: CED with bounded replay (SPEC §8), chunked, per-sequence lengths.

CED (``InferenceOptions.ced``, the default):
  1. the encoder (layers before the first ratio-1 layer) runs over the whole prompt, chunk by chunk, through the
     caches (SWA rings, compressed KV, indexer keys, partial groups);
  2. in the same chunks, the decoder's KV source (its first layer) compresses the encoder output of every prompt
     token into its compressed KV and indexer keys — its compressor input depends on the encoder output alone;
  3. the decoder (layers from the first ratio-1 layer on) runs only over the last n = min(replay_len, T) prompt
     tokens with its SWA truncated to that segment (the cache's ``floor``); the encoder output of those tokens is
     kept in a small ring (``stash``) while the chunks go by.
  Logits exist for the replayed segment only (the last one samples the first new token).
Full replay (``ced=False``): every layer over every prompt token (the baseline the benchmarks compare against).

Memory is linear in T: the caches are O(max_len) and each chunk's transient buffers are O(chunk · cache length)
(the indexer is blocked over queries so its [queries, heads, entries] scores stay under a fixed budget).

Appending: prefill continues each sequence from the cache's current length. The segment is the last
min(replay_len, n_new) new tokens; if n_new > replay_len the decoder floor moves to T - replay_len (bounded replay),
otherwise the old floor stays and the decoder sees its earlier states (appending ≤ replay_len tokens is then
exactly equivalent to decoding them one by one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.inference.cache import check_capacity
from dsv41_jax.inference.sampling import sample
from dsv41_jax.inference.step import (InferenceOptions, check_ced_plan, embed, emit_decoder_source, head,
                                      jit_for, ring_read, ring_write, run_layers)


class PrefillError(ValueError):
    pass


# The Engine's prompt chunk (``Engine(prefill_chunk=None)``). A chunk program runs max_batch x chunk token rows; on a
# Hopper GPU, where the routed experts run as one grouped GEMM per projection (``step.grouped_prefill_moe``), a
# longer chunk gives each expert more rows per GEMM and the prompt fewer launches: a 32K-token CED prefill of the
# 12-layer bench model at batch 1 on an H200 took 0.797 / 0.687 / 0.637 / 0.611 s in chunks of 512 / 1024 / 2048 /
# 4096 tokens (one process, benchmarks/RESULTS.md 2026-12-03 06:40), the chunk program's buffers (XLA's memory
# report) 1.9 GiB more at 4096 than at 512. So there the chunk is doubled from 512 while max_batch x chunk stays
# within GROUPED_PREFILL_ROWS: batch 1 -> 4096, 2 -> 2048, 4 -> 1024, 8 and up -> 512 (rows per program never past
# what 512 gave at batch 8). Elsewhere (CPU, TPU, other GPUs, release-format weights: not measured) it stays 512.
DEFAULT_PREFILL_CHUNK = 512
GROUPED_PREFILL_ROWS = 4096


def default_prefill_chunk(max_batch: int, grouped_moe: bool) -> int:
    """The prompt chunk for an engine of ``max_batch`` slots: ``DEFAULT_PREFILL_CHUNK``, doubled while ``grouped_moe``
    (the prefill's routed experts on the grouped GEMM) and max_batch x the doubled chunk <= GROUPED_PREFILL_ROWS."""
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch <= 0:
        raise PrefillError(f"max_batch must be a positive integer, got {max_batch!r}")
    chunk = DEFAULT_PREFILL_CHUNK
    while grouped_moe and 2 * chunk * max_batch <= GROUPED_PREFILL_ROWS:
        chunk *= 2
    return chunk


def chunk_bucket(n: int, cap: int | None) -> int:
    """Chunk length for n tokens: a power of two >= 16 (few compiles), at most ``cap``."""
    c = 16
    while c < n:
        c *= 2
    return c if cap is None else min(c, cap)


@functools.partial(jax.jit, donate_argnames=("cache",))
def reset_slots(cache: dict, mask: jax.Array) -> dict:
    """Restart the masked slots at length 0 (their old contents become invisible; nothing is cleared)."""
    return dict(cache, length=jnp.where(mask, 0, cache["length"]), floor=jnp.where(mask, 0, cache["floor"]))


def new_stash(config: ModelConfig, batch: int, replay_len: int, dtype, *, like: jax.Array) -> dict:
    """An empty CED stash (the encoder output of the last ``replay_len`` positions per row), placed like ``like``
    on a single device: a chunk program's later calls get the stash back committed there, and jit keys its cache
    on that, so a stash left uncommitted would compile the chunk program twice."""
    stash = {"streams": jnp.zeros((batch, replay_len, config.hc_mult, config.hidden_size), dtype),
             "pre_mix": jnp.zeros((batch, replay_len, config.hc_mult), jnp.float32)}
    sharding = getattr(like, "sharding", None)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        stash = jax.device_put(stash, sharding)
    return stash


def _ced_chunk(params, cache, stash, tokens, n_valid, engram_ids, *, config: ModelConfig, opts: InferenceOptions):
    pos0 = cache["length"]
    streams, pre_mix = embed(params, tokens, config)
    ds = config.plan.decoder_start
    streams, pre_mix, cache = run_layers(params, cache, streams, pre_mix, pos0, n_valid, engram_ids, config=config,
                                         lo=0, hi=ds, opts=opts)
    if ds < config.num_hidden_layers:
        cache = emit_decoder_source(params, cache, streams, pre_mix, pos0, n_valid, engram_ids, config=config,
                                    opts=opts)
    stash = {"streams": ring_write(stash["streams"], streams, pos0, n_valid),
             "pre_mix": ring_write(stash["pre_mix"], pre_mix, pos0, n_valid)}
    return dict(cache, length=pos0 + n_valid), stash


def _ced_decoder(params, cache, stash, n_new, engram_ids, *, config: ModelConfig, opts: InferenceOptions,
                 all_logits: bool, capture: tuple = ()):
    r = opts.resolved_replay(config)
    total = cache["length"]
    n_seg = jnp.minimum(n_new, r)
    pos0 = total - n_seg
    streams, pos = ring_read(stash["streams"], pos0 + r)  # positions pos0 .. pos0 + r - 1
    pre_mix, _ = ring_read(stash["pre_mix"], pos0 + r)
    floor = jnp.where(n_new > r, total - r, cache["floor"])
    cache = dict(cache, floor=floor)
    ds = config.plan.decoder_start
    out = run_layers(params, cache, streams, pre_mix, pos0, n_seg, engram_ids, config=config, lo=ds,
                     hi=config.num_hidden_layers, opts=opts, no_emit=(ds,), capture=capture)
    streams, pre_mix, cache = out[:3]
    extra = (out[3], pos0, n_seg) if capture else ()  # DSpark features of the replayed segment
    if all_logits:
        logits = head(params, streams, pre_mix, config)
        last = jnp.take_along_axis(logits, jnp.maximum(n_seg - 1, 0)[:, None, None], axis=1)[:, 0]
        return (last, logits, cache) + extra
    idx = jnp.maximum(n_seg - 1, 0)[:, None, None, None]
    s_last = jnp.take_along_axis(streams, idx, axis=1)
    p_last = jnp.take_along_axis(pre_mix, idx[..., 0], axis=1)
    return (head(params, s_last, p_last, config)[:, 0], None, cache) + extra


def _full_chunk(params, cache, tokens, n_valid, engram_ids, *, config: ModelConfig, opts: InferenceOptions,
                all_logits: bool, capture: tuple = ()):
    pos0 = cache["length"]
    streams, pre_mix = embed(params, tokens, config)
    out = run_layers(params, cache, streams, pre_mix, pos0, n_valid, engram_ids, config=config, lo=0,
                     hi=config.num_hidden_layers, opts=opts, capture=capture)
    streams, pre_mix, cache = out[:3]
    extra = (out[3], pos0, n_valid) if capture else ()  # DSpark features of the chunk
    cache = dict(cache, length=pos0 + n_valid)
    if all_logits:
        logits = head(params, streams, pre_mix, config)
        last = jnp.take_along_axis(logits, jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)[:, 0]
        return (last, logits, cache) + extra
    idx = jnp.maximum(n_valid - 1, 0)[:, None, None, None]
    s_last = jnp.take_along_axis(streams, idx, axis=1)
    p_last = jnp.take_along_axis(pre_mix, idx[..., 0], axis=1)
    return (head(params, s_last, p_last, config)[:, 0], None, cache) + extra


def _check_inputs(config: ModelConfig, cache: dict, tokens: np.ndarray, lengths: np.ndarray, engram_ids):
    if tokens.ndim != 2:
        raise PrefillError(f"tokens must have shape [batch, seq], got {tokens.shape}")
    b, t = tokens.shape
    batch = cache["length"].shape[0]
    if b != batch:
        raise PrefillError(f"tokens have batch {b} but the cache holds {batch} slots")
    if lengths.shape != (b,):
        raise PrefillError(f"lengths must have shape ({b},), got {lengths.shape}")
    if (lengths < 0).any() or (lengths > t).any():
        raise PrefillError(f"lengths must lie in [0, {t}] (the tokens' width), got {lengths.tolist()}")
    valid = np.arange(t)[None, :] < lengths[:, None]
    bad = valid & ((tokens < 0) | (tokens >= config.vocab_size))
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise PrefillError(f"token id {int(tokens[row, col])} (row {row}, position {col}) is outside the vocabulary "
                           f"[0, {config.vocab_size})")
    check_capacity(config, cache, np.asarray(cache["length"]), lengths, error=PrefillError)
    if config.engram_layer_ids:
        expect = (b, t, len(config.engram_layer_ids), config.n_hash_cols)
        if engram_ids is None:
            raise PrefillError("this config has Engram layers: pass engram_ids (hasher.row_ids / hasher.step)")
        if tuple(engram_ids.shape) != expect:
            raise PrefillError(f"engram_ids has shape {tuple(engram_ids.shape)}, expected {expect}")


def _cols(a: np.ndarray, start: int, width: int) -> np.ndarray:
    """Columns [start, start + width) of a [B, T, ...] array, zero-padded past T."""
    part = a[:, start:start + width]
    if part.shape[1] < width:
        part = np.concatenate([part, np.zeros((a.shape[0], width - part.shape[1]) + a.shape[2:], a.dtype)], axis=1)
    return part


def prefill(params: dict, cache: dict, tokens, lengths=None, engram_ids=None, *, config: ModelConfig,
            opts: InferenceOptions = InferenceOptions(), chunk: int | None = None, reset=None,
            return_logits: bool = False, progress=None, on_features=None):
    """Append ``tokens[b, :lengths[b]]`` to every slot b of the cache (rows with length 0 are untouched).

    Args:
      tokens: int [B, T] (B = the cache's slots), row b's new tokens left-aligned.
      lengths: int [B] new tokens per row (default: T for every row).
      engram_ids: int32 [B, T, n_engram_layers, n_hash_cols] row ids of the new tokens (host-computed from each
        sequence's own history; required with Engram layers).
      chunk: tokens per prefill chunk (default: the whole prompt in one chunk). Any chunking gives the same result.
      reset: bool [B], rows that start a new sequence (length and floor set to 0 first).
      return_logits: also return the logits of every replayed position ([B, replay_len, V] under CED, the segment
        left-aligned; [B, T, V] for full replay).
      progress: optional callable(done_tokens, total_tokens) called after every chunk.
      on_features: optional callable(features [B, C, n_targets * d], pos0 [B], n_valid [B]) receiving the DSpark
        target features (``run_layers(capture=...)``) of every pass that runs the target layers: token i of row b
        is at position pos0[b] + i, valid for i < n_valid[b] (under CED: the replayed segment only, which is
        every position at or after the cache's ``floor``).
    Returns ``(last_logits [B, V], cache)`` — logits of each row's last new token — or
    ``(last_logits, cache, logits)`` with ``return_logits``. The input cache is donated.
    """
    c = config
    tokens = np.asarray(tokens)
    if not np.issubdtype(tokens.dtype, np.integer):
        raise PrefillError(f"tokens must be integers, got dtype {tokens.dtype}")
    b, t = tokens.shape if tokens.ndim == 2 else (None, None)
    lengths = np.full((b,), t, np.int64) if lengths is None and b is not None else np.asarray(lengths, np.int64)
    if reset is not None:
        cache = reset_slots(cache, jnp.asarray(np.asarray(reset, bool)))
    eids = None if engram_ids is None else np.asarray(engram_ids)
    _check_inputs(c, cache, tokens, lengths, eids)
    # Committed to its device, as the stash is (new_stash): every chunk program returns the donated cache committed
    # and jit keys its programs on the arguments' placement, so a cache fresh from init_cache (uncommitted) compiled
    # the chunk program a second time for the second chunk.
    placed = getattr(cache["length"], "sharding", None)
    if isinstance(placed, jax.sharding.SingleDeviceSharding) and not cache["length"].committed:
        cache = jax.device_put(cache, placed)
    if t == 0 or not lengths.any():
        raise PrefillError("empty prompt: no row has any token to prefill")
    if opts.ced:
        check_ced_plan(c)
    capture = tuple(c.dspark_target_layer_ids) if on_features is not None else ()
    if capture and opts.ced and min(capture) < c.plan.decoder_start:
        raise PrefillError(f"DSpark target layers {list(capture)} include encoder layers (decoder starts at "
                           f"{c.plan.decoder_start}); CED prefill runs them before the replay segment is known. "
                           "Use InferenceOptions(ced=False).")
    if chunk is not None and (not isinstance(chunk, int) or chunk <= 0):
        raise PrefillError(f"chunk must be a positive integer, got {chunk!r}")
    width = int(lengths.max())
    size = chunk_bucket(width, chunk)  # chunk columns: a power of two >= 16 covering the prompt, at most `chunk`
    tok = tokens.astype(np.int32)
    n_eid = None if eids is None else eids.astype(np.int32)
    done = 0
    if opts.ced:
        r = opts.resolved_replay(c)
        stash = new_stash(c, b, r, params["embed"].dtype, like=cache["length"])
        for s in range(0, width, size):
            nv = np.clip(lengths - s, 0, size).astype(np.int32)
            e = None if n_eid is None else jnp.asarray(_cols(n_eid, s, size))
            cache, stash = jit_for(_ced_chunk, opts, donate=("cache", "stash"))(params, cache, stash, jnp.asarray(_cols(tok, s, size)), jnp.asarray(nv), e,
                                      config=c, opts=opts)
            done += int(nv.sum())
            if progress is not None:
                progress(done, int(lengths.sum()))
        seg_e = None
        if n_eid is not None:
            n_seg = np.minimum(lengths, r)
            cols = (lengths - n_seg)[:, None] + np.arange(r)[None, :]
            cols = np.minimum(cols, max(t - 1, 0))
            seg_e = jnp.asarray(np.take_along_axis(n_eid, cols[:, :, None, None], axis=1))
        out = jit_for(_ced_decoder, opts, static=("config", "opts", "all_logits", "capture"))(
            params, cache, stash, jnp.asarray(lengths.astype(np.int32)), seg_e, config=c, opts=opts,
            all_logits=return_logits, capture=capture)
        last, logits, cache = out[:3]
        if capture:
            on_features(*out[3:])
    else:
        last = None
        all_l = []
        for s in range(0, width, size):
            nv = np.clip(lengths - s, 0, size).astype(np.int32)
            e = None if n_eid is None else jnp.asarray(_cols(n_eid, s, size))
            out = jit_for(_full_chunk, opts, static=("config", "opts", "all_logits", "capture"))(
                params, cache, jnp.asarray(_cols(tok, s, size)), jnp.asarray(nv), e, config=c, opts=opts,
                all_logits=return_logits, capture=capture)
            lg, chunk_logits, cache = out[:3]
            if capture:
                on_features(*out[3:])
            last = lg if last is None else jnp.where(jnp.asarray(nv > 0)[:, None], lg, last)
            if return_logits:
                all_l.append(chunk_logits)
            done += int(nv.sum())
            if progress is not None:
                progress(done, int(lengths.sum()))
        logits = jnp.concatenate(all_l, axis=1)[:, :t] if return_logits else None
    if return_logits:
        return last, cache, logits
    return last, cache


# ----------------------------------------------------------------------------------------------------------
# Refill: a few slots prefilled while the others decode (continuous batching, ``inference.batching``)
# ----------------------------------------------------------------------------------------------------------
#
# A refill program runs P rows, each bound to one cache slot: it gathers those slots' cache rows (and their CED
# stash rows), runs the ordinary chunk (and, for the rows whose prompt completes, the CED decoder pass and the
# first token's sampling) on that P-row sub-cache, and scatters the rows back in place (cache and stash donated),
# so a refill costs P rows of work however many slots decode meanwhile. P is bucketed (``refill_buckets``) so
# that a refill of two slots runs a 2-row program, not a max_batch-row one, and few programs are compiled. A
# padding row points at slot index B (out of range): it reads a clamped row and its write-back is dropped.

def refill_buckets(max_rows: int) -> tuple[int, ...]:
    """The row counts refill programs are compiled for: powers of two below ``max_rows``, and ``max_rows``."""
    if not isinstance(max_rows, int) or max_rows < 1:
        raise PrefillError(f"max_rows must be a positive integer, got {max_rows!r}")
    out, p = [], 1
    while p < max_rows:
        out.append(p)
        p *= 2
    return tuple(out) + (max_rows,)


def refill_bucket(n: int, max_rows: int) -> int:
    """The smallest refill row bucket holding n rows."""
    return next(p for p in refill_buckets(max_rows) if p >= n)


def gather_rows(tree: dict, slots: jax.Array) -> dict:
    """The rows ``slots`` [P] of a batch-leading tree (the cache, the stash); out-of-range slots read the last row."""
    return jax.tree.map(lambda x: jnp.take(x, slots, axis=0, mode="clip"), tree)


def scatter_rows(tree: dict, rows: dict, slots: jax.Array) -> dict:
    """``tree`` with rows ``slots`` [P] replaced by ``rows``; out-of-range slots (padding rows) are dropped."""
    return jax.tree.map(lambda x, r: x.at[slots].set(r, mode="drop"), tree, rows)


def refill_rows(params, cache, stash, slots, fresh, tokens, n_valid, engram_ids, n_new, seg_engram_ids, temperature,
                top_k, top_p, seeds, *, config: ModelConfig, opts: InferenceOptions):
    """One prefill chunk of P slots: row i appends ``tokens[i, :n_valid[i]]`` to slot ``slots[i]`` (``fresh[i]``: the
    slot starts a new sequence, its length and floor set to 0 first). ``stash``: the CED stash of every slot
    (``new_stash`` with max_batch rows; None under full replay).

    The rows whose prompt completes here (``n_new[i]`` = their prompt length, 0 for the others) also get the CED
    decoder pass (``seg_engram_ids`` [P, replay_len, ...]: the row ids of each one's last min(replay_len, n_new)
    prompt tokens, left-aligned) and their first new token is sampled with the slots' parameters (``temperature``
    ... ``seeds``: [max_batch], gathered here; generation step 0). Under CED a chunk where no prompt completes
    skips the decoder pass at run time (a conditional: one program serves both, half the compiles). Returns
    ``(cache, stash, first tokens [P] int32)`` (meaningful for completing rows only); cache and stash are
    updated in place (donated)."""
    sub = gather_rows(cache, slots)
    sub = dict(sub, length=jnp.where(fresh, 0, sub["length"]), floor=jnp.where(fresh, 0, sub["floor"]))
    samp = [jnp.take(a, slots, mode="clip") for a in (temperature, top_k, top_p, seeds)]
    steps = jnp.zeros_like(slots)
    if opts.ced:
        sub_stash = gather_rows(stash, slots)
        sub, sub_stash = _ced_chunk(params, sub, sub_stash, tokens, n_valid, engram_ids, config=config, opts=opts)
        stash = scatter_rows(stash, sub_stash, slots)

        def finish(sub):
            last, _, sub = _ced_decoder(params, sub, sub_stash, n_new, seg_engram_ids, config=config, opts=opts,
                                        all_logits=False)
            return sample(last, *samp, steps), sub

        first, sub = jax.lax.cond(jnp.any(n_new > 0), finish, lambda sub: (jnp.zeros_like(slots), sub), sub)
    else:
        last, _, sub = _full_chunk(params, sub, tokens, n_valid, engram_ids, config=config, opts=opts,
                                   all_logits=False)
        first = sample(last, *samp, steps)
    return scatter_rows(cache, sub, slots), stash, first


def refill_program(opts: InferenceOptions):
    """:func:`refill_rows` jitted (one program per row bucket and chunk length; cache and stash donated)."""
    return jit_for(refill_rows, opts, static=("config", "opts"), donate=("cache", "stash"))


def refill_rows_jit(*args, config: ModelConfig, opts: InferenceOptions):
    return refill_program(opts)(*args, config=config, opts=opts)


__all__ = ["PrefillError", "prefill", "chunk_bucket", "reset_slots", "new_stash", "refill_buckets", "refill_bucket",
           "refill_rows", "refill_program", "refill_rows_jit", "gather_rows", "scatter_rows"]
