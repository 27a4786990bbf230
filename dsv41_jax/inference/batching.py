"""Continuous batching: a request queue served by an :class:`~dsv41_jax.inference.engine.Engine`'s slots.

    batcher = engine.batcher()                     # or: for done in engine.serve(requests): ...
    rid = batcher.submit(Request(prompt=ids, max_new_tokens=64, temperature=0.7, top_p=0.9, seed=3))
    while batcher.busy:
        for done in batcher.step():                # Completions finished in this iteration
            print(done.id, done.tokens, done.finish_reason, done.time_to_first_token_s)

Each request carries its own prompt, sampling parameters (temperature, top-k, top-p, seed) and limits
(``max_new_tokens``, stop tokens). One :meth:`ContinuousBatcher.step` is one engine iteration:

1. admit waiting requests (first come, first served) into every free slot, as long as a prefill lane is free;
2. run **one** prefill chunk for the lanes (at most ``prefill_chunk`` prompt tokens per lane), so the running
   sequences wait for one bounded chunk, never for a whole long prompt; a lane whose prompt is complete gets its
   CED decoder pass and samples its first token, and its slot joins the decode batch at once;
3. run a **run** of up to ``decode_run`` decode steps (default the engine's ``readback_every``) over every running
   slot: the engine's self-feeding step (``decode_chain``: sampling, the Engram hash and every slot's limits on the
   device), dispatched back to back, the run's tokens read back in one transfer at its end.

Where the time goes (why these choices): a serving loop that reads each step's tokens back before dispatching
the next, and prefills one admitted request per program, spends most of its time on the host and in programs
that are not decode steps: its throughput was 0.52x that of static batches of the same requests on an NVIDIA
H200 with the small default model. Here the decode steps of an iteration run without a host round-trip between
them (the same program as ``Engine.generate``'s device loop), and every request admitted in an iteration is
prefilled by one chunk program: with ``prefill_lanes == max_batch`` (the default) the lanes are the slots and the
chunk / CED decoder / sampling programs are exactly ``generate``'s (compiled once for both), so serving compiles
nothing of its own. A run ends early only when every running slot has reached its limits; a slot that ends
inside a run (stop token, ``max_new_tokens``) is not fed after its end and is refilled at the run's end, so a
freed slot waits at most ``decode_run - 1`` steps; while a prompt is mid-prefill (longer than one chunk) or a request
waits for a free lane, an iteration runs one decode step, so that chunks and admissions are not held back by runs.
``decode_run=1`` reads every step back (the lowest latency).
``prefill_lanes < max_batch`` gathers the lanes' cache rows into a P-row program instead (less compute per chunk
for a large model, one more set of programs to compile).

A sequence that finishes (stop token, ``max_new_tokens``) frees its slot in the same iteration; the next admitted
request restarts the slot (its length and floor set to 0: the old rows become invisible and are overwritten).
Shapes are static — ``max_batch`` slots, ``prefill_lanes`` lanes, chunk lengths bucketed to powers of two up to
``prefill_chunk`` — so serving compiles a handful of programs once, never one per request.

Equivalence: a greedy request gets the tokens it gets alone through :meth:`Engine.generate` (rows never mix; per-slot
lengths keep every sequence's windows, compressor groups, indexer and Engram n-grams its own). A sampled request
draws its k-th new token with the key ``fold_in(PRNGKey(seed), k)`` wherever it runs, as ``generate`` does, so
with a fixed seed it gets the same tokens too (up to floating-point differences between batch shapes, which can
only matter where two candidates are within rounding of each other).

Bad requests raise :class:`EngineError` from :meth:`submit` (empty prompt, prompt + ``max_new_tokens`` beyond
``max_len``, ids outside the vocabulary, invalid or unknown sampling options); :meth:`Engine.serve` reports them as
completions with ``finish_reason == "error"`` instead and serves the rest.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Iterable, Iterator

import jax.numpy as jnp
import numpy as np

from dsv41_jax.inference.decode import decode_chain
from dsv41_jax.inference.engine import (EngineError, Request, Result, check_device_ends, finish_reason,
                                        stop_token_table)
from dsv41_jax.inference.prefill import (_ced_chunk, _ced_decoder, _full_chunk, chunk_bucket, lanes_chunk,
                                         lanes_finish, new_stash, reset_slots)
from dsv41_jax.inference.sampling import sample, sample_jit
from dsv41_jax.inference.step import jit_for
from dsv41_jax.ops.engram_hash import advance_history, device_history

REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(Request))


@dataclasses.dataclass
class Completion(Result):
    """A finished request: its :class:`Result` plus its id and host timestamps (``time.perf_counter``)."""

    id: int = -1
    submitted_at: float = 0.0
    token_times: list[float] = dataclasses.field(default_factory=list)  # when each new token reached the host

    @property
    def time_to_first_token_s(self) -> float:
        return self.token_times[0] - self.submitted_at if self.token_times else float("nan")

    @property
    def inter_token_s(self) -> list[float]:
        """Gaps between consecutive new tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclasses.dataclass
class _Sequence:
    id: int
    ids: list[int]  # prompt
    sampling: tuple  # (temperature, top_k, top_p, seed)
    stops: tuple[int, ...]
    max_new_tokens: int
    submitted_at: float
    engram_rows: np.ndarray | None = None  # [T, n_engram_layers, n_hash_cols], computed at admission
    prefilled: int = 0  # prompt tokens in the cache so far
    tokens: list[int] = dataclasses.field(default_factory=list)
    token_times: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class BatcherStats:
    iterations: int = 0
    prefill_chunks: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    max_running: int = 0  # most slots decoding at once
    max_prefilling: int = 0  # most lanes busy in one prefill chunk
    readbacks: int = 0  # device->host transfers (each waits for the device): one per decode run, one per admission
    prefill_s: float = 0.0  # host wall time in prefill chunks and first-token sampling, transfers included
    decode_s: float = 0.0  # host wall time in decode runs, their read-back included


class ContinuousBatcher:
    """Continuous batching over one engine's cache (see the module docstring).

    ``prefill_lanes``: prompts prefilled at once (default ``max_batch``: every free slot is refilled in the same
    chunk program, the one ``Engine.generate`` runs; fewer lanes gather their slots' rows into a smaller program);
    ``prefill_chunk``: prompt tokens per lane per iteration (default the engine's); ``decode_run``: decode steps per
    iteration, read back together (default the engine's ``readback_every``, whose readback buffer the step program
    shares with ``generate``). ``on_token(id, token)`` streams every new token.
    The batcher owns the engine's cache while it has work: do not call ``engine.generate`` / ``prefill`` /
    ``decode_step`` meanwhile (they raise)."""

    def __init__(self, engine, *, prefill_lanes: int | None = None, prefill_chunk: int | None = None,
                 on_token: Callable[[int, int], None] | None = None, decode_run: int | None = None):
        b = engine.max_batch
        lanes = b if prefill_lanes is None else prefill_lanes
        if not isinstance(lanes, int) or not 1 <= lanes <= b:
            raise EngineError(f"prefill_lanes must be an integer in [1, max_batch={b}], got {prefill_lanes!r}")
        chunk = engine.prefill_chunk if prefill_chunk is None else prefill_chunk
        if not isinstance(chunk, int) or chunk <= 0:
            raise EngineError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        run = engine.readback_every if decode_run is None else decode_run
        if not isinstance(run, int) or isinstance(run, bool) or run <= 0:
            raise EngineError(f"decode_run must be a positive integer, got {decode_run!r}")
        self.engine = engine
        self.lanes = lanes
        self.by_slot = lanes == b  # lane i is slot i: the full-cache programs of Engine.generate
        self.chunk = chunk
        self.decode_run = run
        self.on_token = on_token
        self.stats = BatcherStats()
        self._queue: collections.deque[_Sequence] = collections.deque()
        self._slot: list[_Sequence | None] = [None] * b  # the sequence holding each slot
        self._lane: list[int | None] = [None] * lanes  # the slot each lane prefills
        self._fresh = np.zeros((lanes,), bool)  # lane's slot not reset yet (its first chunk)
        self._next_id = 0
        c = engine.config
        r = engine.options.resolved_replay(c)
        self._stash = new_stash(c, lanes, r, engine.params["embed"].dtype, like=engine.cache["length"])
        # per-slot sampling parameters and limits on the device, refreshed when a slot changes hands
        self._samp_host = (np.zeros((b,), np.float32), np.zeros((b,), np.int32), np.ones((b,), np.float32),
                           np.zeros((b,), np.int32))
        self._samp_dev = None
        self._limits_dev = None

    # ------------------------------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        """Slots held (prefilling or decoding)."""
        return sum(s is not None for s in self._slot)

    @property
    def busy(self) -> bool:
        return bool(self._queue) or self.running > 0

    def submit(self, request: Request | dict | Iterable[int] | str, **fields) -> int:
        """Queue a request (a :class:`Request`, a dict of its fields, or a prompt with ``fields`` as keyword
        arguments); returns its id. Raises :class:`EngineError` for a bad request."""
        if isinstance(request, dict):
            fields = {**request, **fields}
            request = fields.pop("prompt", None)
            if request is None:
                raise EngineError("a request needs a 'prompt'")
        unknown = sorted(set(fields) - set(REQUEST_FIELDS))
        if unknown:
            raise EngineError(f"unknown request option(s) {unknown}; known: {list(REQUEST_FIELDS)}")
        if isinstance(request, Request):
            req = dataclasses.replace(request, **fields) if fields else request
        else:
            req = Request(prompt=request, **fields)
        eng = self.engine
        if eng._owner is not None and eng._owner is not self and eng._owner.busy:
            raise EngineError("another ContinuousBatcher is serving requests on this engine's cache; submit there")
        ids, sp, stops = eng._validate(req)
        need = len(ids) + req.max_new_tokens - 1  # the last new token is never fed back
        if need > eng.max_len:
            raise EngineError(f"prompt of {len(ids)} tokens + max_new_tokens {req.max_new_tokens} needs {need} cache "
                              f"positions, more than max_len {eng.max_len}")
        rid = self._next_id
        self._next_id += 1
        self._queue.append(_Sequence(rid, ids, (sp.temperature, sp.top_k, sp.top_p, sp.seed), stops,
                                     req.max_new_tokens, time.perf_counter()))
        eng._owner = self
        return rid

    # ------------------------------------------------------------------------------------------------------
    def step(self) -> list[Completion]:
        """One engine iteration (admit, one prefill chunk, one run of decode steps); returns the completions it
        finished."""
        if not self.busy:
            return []
        self.stats.iterations += 1
        done: list[Completion] = []
        self._admit()
        if any(lane is not None for lane in self._lane):
            t0 = time.perf_counter()
            self._prefill_chunk(done)
            self.stats.prefill_s += time.perf_counter() - t0
        running = np.array([s is not None and s.prefilled == len(s.ids) and bool(s.tokens) for s in self._slot])
        if running.any():
            # one step only while a prompt is mid-prefill or a request waits for a lane with a slot free: the next
            # chunk / admission then comes after one step, not after a whole run (fewer lanes than slots would
            # otherwise admit one request per run)
            admitting = any(lane is not None for lane in self._lane) or (
                bool(self._queue) and any(s is None for s in self._slot))
            t0 = time.perf_counter()
            self._decode_run(running, done, max_steps=1 if admitting else self.decode_run)
            self.stats.decode_s += time.perf_counter() - t0
        if not self.busy:
            self.engine._owner = None
        return done

    def run(self) -> Iterator[Completion]:
        """Step until every submitted request is done, yielding completions as they finish."""
        while self.busy:
            yield from self.step()

    # ------------------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        eng = self.engine
        changed = False
        for lane in range(self.lanes):
            if not self._queue:
                break
            if self._lane[lane] is not None:
                continue
            if self.by_slot:  # lane i is slot i
                if self._slot[lane] is not None:
                    continue
                free = lane
            else:
                free = next((s for s, seq in enumerate(self._slot) if seq is None), None)
                if free is None:
                    break
            seq = self._queue.popleft()
            self._slot[free] = seq
            self._lane[lane] = free
            self._fresh[lane] = True
            if eng.hasher is not None:  # the prompt's Engram rows and the slot's look-back, as Engine.prefill
                rows, h = eng.hasher.step(np.asarray([seq.ids]), eng.hasher.empty_history(1))
                seq.engram_rows = rows[0].astype(np.int32)
                for a, v in zip((eng._hist.tokens, eng._hist.segments, eng._hist.num_positions,
                                 eng._hist.num_valid), (h.tokens, h.segments, h.num_positions, h.num_valid)):
                    a[free] = v[0]
            for a, v in zip(self._samp_host, seq.sampling):
                a[free] = v
            changed = True
        if changed or self._samp_dev is None:
            # copies: on a CPU, jnp.asarray may alias a NumPy buffer, and a program dispatched earlier may still
            # be reading it when the host changes it for the next request (the same for _fresh below)
            self._samp_dev = tuple(jnp.asarray(a.copy()) for a in self._samp_host)
            self._limits_dev = None

    def _prefill_chunk(self, done: list[Completion]) -> None:
        eng, c, p = self.engine, self.engine.config, self.lanes
        b = eng.max_batch
        seqs = [None if s is None else self._slot[s] for s in self._lane]
        left = [0 if q is None else len(q.ids) - q.prefilled for q in seqs]
        size = chunk_bucket(max(left), self.chunk)
        tokens = np.zeros((p, size), np.int32)
        n_valid = np.zeros((p,), np.int32)
        eids = None if eng.hasher is None else np.zeros((p, size, len(c.engram_layer_ids), c.n_hash_cols), np.int32)
        for i, q in enumerate(seqs):
            if q is None:
                continue
            n = min(left[i], size)
            tokens[i, :n] = q.ids[q.prefilled:q.prefilled + n]
            n_valid[i] = n
            if eids is not None:
                eids[i, :n] = q.engram_rows[q.prefilled:q.prefilled + n]
        e_dev = None if eids is None else jnp.asarray(eids)
        last = None
        if self.by_slot:  # generate's own programs over the whole cache: rows with nothing to add are untouched
            if self._fresh.any():
                eng.cache = reset_slots(eng.cache, jnp.asarray(self._fresh.copy()))
            if eng.options.ced:
                fn = jit_for(_ced_chunk, eng.options, donate=("cache", "stash"))
                eng.cache, self._stash = fn(eng.params, eng.cache, self._stash, jnp.asarray(tokens),
                                            jnp.asarray(n_valid), e_dev, config=c, opts=eng.options)
            else:
                fn = jit_for(_full_chunk, eng.options, static=("config", "opts", "all_logits", "capture"))
                last, _, eng.cache = fn(eng.params, eng.cache, jnp.asarray(tokens), jnp.asarray(n_valid), e_dev,
                                        config=c, opts=eng.options, all_logits=False, capture=())
        else:
            slots = jnp.asarray(np.array([b if s is None else s for s in self._lane], np.int32))
            fn = jit_for(lanes_chunk, eng.options, donate=("cache", "stash"))
            eng.cache, self._stash, last = fn(eng.params, eng.cache, self._stash, slots, jnp.asarray(self._fresh.copy()),
                                              jnp.asarray(tokens), jnp.asarray(n_valid), e_dev, config=c,
                                              opts=eng.options)
        self._fresh[:] = False
        self.stats.prefill_chunks += 1
        self.stats.prompt_tokens += int(n_valid.sum())
        self.stats.max_prefilling = max(self.stats.max_prefilling, int((n_valid > 0).sum()))
        finished = np.zeros((p,), bool)
        for i, q in enumerate(seqs):
            if q is not None:
                q.prefilled += int(n_valid[i])
                finished[i] = q.prefilled == len(q.ids)
        if not finished.any():
            return
        seg_e = None
        if eng.options.ced:
            r = eng.options.resolved_replay(c)
            n_new = np.array([len(q.ids) if f else 0 for q, f in zip(seqs, finished)], np.int32)
            if eng.hasher is not None:  # the replayed segment's rows (the prompt's last min(r, T)), left-aligned
                seg_e = np.zeros((p, r) + eids.shape[2:], np.int32)
                for i, q in enumerate(seqs):
                    if finished[i]:
                        n_seg = min(len(q.ids), r)
                        seg_e[i, :n_seg] = q.engram_rows[len(q.ids) - n_seg:]
            seg_e = None if seg_e is None else jnp.asarray(seg_e)
        if self.by_slot:
            samp = self._samp_dev
            if eng.options.ced:
                fn = jit_for(_ced_decoder, eng.options, static=("config", "opts", "all_logits", "capture"))
                last, _, eng.cache = fn(eng.params, eng.cache, self._stash, jnp.asarray(n_new), seg_e, config=c,
                                        opts=eng.options, all_logits=False, capture=())
            first = sample_jit(last, *samp, jnp.zeros((p,), jnp.int32))
        else:
            lane_slots = np.array([0 if s is None else s for s in self._lane])
            samp = tuple(jnp.asarray(a[lane_slots]) for a in self._samp_host)
            if eng.options.ced:
                fn = jit_for(_finish_and_sample, eng.options)
                first, eng.cache = fn(eng.params, eng.cache, self._stash, slots, jnp.asarray(n_new), seg_e, *samp,
                                      config=c, opts=eng.options)
            else:  # full replay: the chunk gave the logits of each lane's last prompt token
                first = sample_jit(last, *samp, jnp.zeros((p,), jnp.int32))
        first = np.asarray(first)
        self.stats.readbacks += 1
        now = time.perf_counter()
        for i in np.flatnonzero(finished):
            slot = self._lane[i]
            self._lane[i] = None
            self._emit(slot, int(first[i]), now, done)

    def _decode_run(self, running: np.ndarray, done: list[Completion], max_steps: int) -> None:
        """Up to ``max_steps`` self-feeding decode steps over the running slots, dispatched back to back; their
        tokens come back in one transfer and are emitted in order (the host replays the slots' ends, which the
        device applied: checked)."""
        eng = self.engine
        b = eng.max_batch
        live = np.flatnonzero(running)
        seqs = {int(s): self._slot[s] for s in live}
        # steps each slot can still take: its max_new_tokens, and the cache room (finish_reason's "max_len")
        left = [min(q.max_new_tokens - len(q.tokens), eng.max_len - len(q.ids) - len(q.tokens) + 1)
                for q in seqs.values()]
        n = max(1, min(max_steps, max(left)))
        if self._limits_dev is None:  # per-slot limits, as generate's device loop: stop tokens, max_new, room
            max_new = np.zeros((b,), np.int32)
            room = np.zeros((b,), np.int32)
            stop_lists = {}
            for s, q in enumerate(self._slot):
                if q is not None:
                    max_new[s], room[s], stop_lists[s] = q.max_new_tokens, eng.max_len - len(q.ids), q.stops
            self._limits_dev = tuple(jnp.asarray(a) for a in (stop_token_table(b, stop_lists), max_new, room))
        fed = np.zeros((b,), np.int32)
        generated = np.zeros((b,), np.int32)
        for s, q in seqs.items():
            fed[s], generated[s] = q.tokens[-1], len(q.tokens)
        state = {"tokens": fed.copy(), "active": running.copy(), "generated": generated, "step": np.zeros((), np.int32),
                 "readback": np.zeros((self.decode_run + 1, b), np.int32)}
        tables = None
        if eng.hasher is not None:
            tables = eng.hasher.device_tables()
            state["engram_history"] = device_history(eng._hist)
        state = eng._on_device(state)
        for _ in range(n):
            _tok, state, eng.cache = decode_chain(eng.params, eng.cache, state, tables, *self._samp_dev,
                                                  *self._limits_dev, config=eng.config, opts=eng.options)
        buf = np.asarray(state["readback"])  # the run's only transfer: its tokens and the slots still fed
        now = time.perf_counter()
        self.stats.readbacks += 1
        self.stats.decode_steps += n
        self.stats.max_running = max(self.stats.max_running, len(live))
        active = running.copy()
        for i in range(n):
            if not active.any():
                break
            if eng.hasher is not None:  # the host look-back follows the tokens the device hashed
                eng._hist = advance_history(eng._hist, eng.hasher.token_map, np.where(active, fed, 0), active)
            row = buf[i]
            for s in np.flatnonzero(active):
                fed[s] = row[s]
                if self._emit(int(s), int(row[s]), now, done):
                    active[s] = False
        check_device_ends(active, buf[-1].astype(bool))

    def _emit(self, slot: int, token: int, now: float, done: list[Completion]) -> bool:
        """Append a new token to the slot's sequence; True if that ends it (its slot is then free)."""
        seq = self._slot[slot]
        seq.tokens.append(token)
        seq.token_times.append(now)
        self.stats.new_tokens += 1
        if self.on_token is not None:
            self.on_token(seq.id, token)
        reason = finish_reason(token, seq.stops, len(seq.tokens), seq.max_new_tokens, len(seq.ids),
                               self.engine.max_len)
        if reason is None:
            return False
        self._slot[slot] = None  # free at once: the next admitted request restarts it
        self._limits_dev = None
        done.append(Completion(seq.tokens, reason, len(seq.ids), text=self.engine._decode_text(seq.tokens),
                               id=seq.id, submitted_at=seq.submitted_at, token_times=seq.token_times))
        return True


def _finish_and_sample(params, cache, stash, slots, n_new, engram_ids, temperature, top_k, top_p, seeds, *,
                       config, opts):
    """The lanes' CED decoder pass fused with sampling their first new token (generation step 0)."""
    last, cache = lanes_finish(params, cache, stash, slots, n_new, engram_ids, config=config, opts=opts)
    return sample(last, temperature, top_k, top_p, seeds, jnp.zeros_like(seeds)), cache


def serve(engine, requests: Iterable, *, on_token=None, **batcher_kw) -> Iterator[Completion]:
    """Serve ``requests`` (``Request``s, dicts of their fields, or prompts) by continuous batching; yields a
    :class:`Completion` per request as it finishes (``id`` = the request's index). A bad request yields at once a
    completion with ``finish_reason == "error"``."""
    ids: dict[int, int] = {}  # batcher id -> request index
    stream = None if on_token is None else (lambda rid, tok: on_token(ids[rid], tok))
    batcher = ContinuousBatcher(engine, on_token=stream, **batcher_kw)
    for i, r in enumerate(requests):
        try:
            ids[batcher.submit(r)] = i
        except EngineError as e:
            yield Completion([], "error", 0, error=str(e), id=i, submitted_at=time.perf_counter())
    for done in batcher.run():
        done.id = ids[done.id]
        yield done


__all__ = ["ContinuousBatcher", "Completion", "BatcherStats", "serve"]
