"""Continuous batching: a request queue served by an :class:`~dsv41_jax.inference.engine.Engine`'s slots.

    batcher = engine.batcher()                     # or: for done in engine.serve(requests): ...
    rid = batcher.submit(Request(prompt=ids, max_new_tokens=64, temperature=0.7, top_p=0.9, seed=3))
    while batcher.busy:
        for done in batcher.step():                # Completions finished in this iteration
            print(done.id, done.tokens, done.finish_reason, done.time_to_first_token_s)

Each request carries its own prompt, sampling parameters (temperature, top-k, top-p, seed) and limits
(``max_new_tokens``, stop tokens). One :meth:`ContinuousBatcher.step` is one engine iteration:

1. admit waiting requests (first come, first served) into free slots, by the admission policy below;
2. run **one** refill chunk for the slots being prefilled (at most ``prefill_chunk`` prompt tokens each), so the
   running sequences wait for one bounded chunk, never for a whole long prompt; a slot whose prompt completes gets
   its CED decoder pass and samples its first token in the same program, and joins the decode batch at once;
3. run a **run** of up to ``decode_run`` decode steps (default the engine's ``readback_every``) over every running
   slot: the engine's self-feeding step (``decode_chain``: sampling, the Engram hash and every slot's limits on the
   device), dispatched back to back, the run's tokens read back in one transfer at its end.

Refills cost the rows they fill. The refill program gathers the refilled slots' cache rows (and CED stash rows)
into a P-row sub-batch, prefills it and writes the rows back by slot index, in place (the cache is donated), with
P bucketed to 1, 2, 4, ... up to ``prefill_lanes`` (default ``max_batch``): refilling two slots runs a 2-row
program. (Before, every refill ran ``generate``'s full-batch chunk program, max_batch rows however few slots it
filled: on an NVIDIA H200 with the default model 31 such refills took 1.71 s of a 2.57 s run, and continuous
batching reached 0.465x the throughput of static batches.) The programs — one per row bucket and chunk length —
are compiled by :meth:`ContinuousBatcher.precompile` (or on first use).

Admission policy (``refill_min``): a refill costs a program and a read-back whatever its size, so while other
slots decode, requests are admitted only once ``min(refill_min, waiting requests, prefill_lanes)`` slots are free:
a few refills of several slots rather than one per finished sequence. No request waits for the slowest of a
batch: a refill needs ``refill_min`` free slots, not every slot. To keep freed slots idle for as short a time as
possible, a decode run that has requests waiting ends as soon as enough slots will have reached their limits
(``max_new_tokens``, cache room; a stop token frees a slot earlier, seen at the run's end). With nothing decoding,
waiting requests are admitted at once; with an empty queue, arrivals wait at most one run. ``refill_min=1``
refills as soon as any slot frees. The default, :data:`DEFAULT_REFILL_FRACTION` = 1/4 of ``max_batch`` (rounded
up; 8 of 32 slots), was chosen by measurement (``benchmarks/bench_serving.py``, benchmarks/RESULTS.md): on an
NVIDIA H200 with the default model, 128 requests on 32 slots, continuous batching reached 0.58 / 0.79 / 0.80 /
0.97 / 0.95x the throughput of static batches with ``refill_min`` 1 / 2 / 4 / 8 / 16 (a refill costs 8-23 ms
there, a decode step 1.5-2 ms: refilling one slot at a time spends more on refills than idle slots cost).

Runs: a run ends early only when every running slot has reached its limits; a slot that ends inside a run is not
fed after its end and is refilled at the run's end. While a prompt is mid-prefill (longer than one chunk) an
iteration runs one decode step, so that its chunks are not held back by runs. ``decode_run=1`` reads every step
back (the lowest latency).

A sequence that finishes (stop token, ``max_new_tokens``) frees its slot in the same iteration; the next admitted
request restarts the slot (its length and floor set to 0: the old rows become invisible and are overwritten).
Shapes are static — ``max_batch`` slots, refill rows and chunk lengths bucketed (powers of two) — so serving
compiles a handful of programs once, never one per request.

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
import concurrent.futures
import dataclasses
import math
import os
import time
from typing import Callable, Iterable, Iterator

import jax.numpy as jnp
import numpy as np

from dsv41_jax.inference.decode import _decode_opts, decode_chain, decode_chain_program
from dsv41_jax.inference.engine import (EngineError, Request, Result, check_device_ends, finish_reason,
                                        stop_token_table)
from dsv41_jax.inference.prefill import (chunk_bucket, new_stash, refill_bucket, refill_buckets, refill_program,
                                         refill_rows_jit)
from dsv41_jax.ops.engram_hash import advance_history, device_history

REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(Request))

# The default refill_min as a fraction of max_batch (rounded up): the best measured (module docstring, RESULTS.md)
DEFAULT_REFILL_FRACTION = 0.25


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
    prefill_chunks: int = 0  # refill programs run
    prefill_rows: int = 0  # rows those programs ran (their row buckets summed)
    prefill_rows_used: int = 0  # rows holding a prompt chunk
    refill_buckets: dict = dataclasses.field(default_factory=dict)  # row bucket -> refill programs run
    decode_steps: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    max_running: int = 0  # most slots decoding at once
    max_prefilling: int = 0  # most slots in one refill chunk
    readbacks: int = 0  # device->host transfers (each waits for the device): one per decode run, one per refill
    prefill_s: float = 0.0  # host wall time in refill chunks (first-token sampling and read-back included)
    decode_s: float = 0.0  # host wall time in decode runs, their read-back included


class ContinuousBatcher:
    """Continuous batching over one engine's cache (see the module docstring).

    ``prefill_lanes``: most slots prefilled in one refill program (default ``max_batch``; its row count is
    bucketed to the slots it fills); ``prefill_chunk``: prompt tokens per slot per iteration (default the
    engine's ``refill_chunk``: its ``prefill_chunk`` where given, else 512); ``decode_run``: decode steps per
    iteration, read back together (default the engine's ``readback_every``, whose readback buffer the step
    program shares with ``generate``); ``refill_min``: while
    other slots decode, admit only once this many slots are free (or as many as there are waiting requests;
    default ``ceil(DEFAULT_REFILL_FRACTION * max_batch)``). ``on_token(id, token)`` streams every new token.
    The batcher owns the engine's cache while it has work: do not call ``engine.generate`` / ``prefill`` /
    ``decode_step`` meanwhile (they raise)."""

    def __init__(self, engine, *, prefill_lanes: int | None = None, prefill_chunk: int | None = None,
                 on_token: Callable[[int, int], None] | None = None, decode_run: int | None = None,
                 refill_min: int | None = None):
        b = engine.max_batch
        lanes = b if prefill_lanes is None else prefill_lanes
        if not isinstance(lanes, int) or isinstance(lanes, bool) or not 1 <= lanes <= b:
            raise EngineError(f"prefill_lanes must be an integer in [1, max_batch={b}], got {prefill_lanes!r}")
        chunk = engine.refill_chunk if prefill_chunk is None else prefill_chunk
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
            raise EngineError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        run = engine.readback_every if decode_run is None else decode_run
        if not isinstance(run, int) or isinstance(run, bool) or run <= 0:
            raise EngineError(f"decode_run must be a positive integer, got {decode_run!r}")
        rmin = max(1, math.ceil(DEFAULT_REFILL_FRACTION * b)) if refill_min is None else refill_min
        if not isinstance(rmin, int) or isinstance(rmin, bool) or not 1 <= rmin <= b:
            raise EngineError(f"refill_min must be an integer in [1, max_batch={b}], got {refill_min!r}")
        self.engine = engine
        self.lanes = lanes
        self.row_buckets = refill_buckets(lanes)
        self.chunk = chunk
        self.decode_run = run
        self.refill_min = rmin
        self.on_token = on_token
        self.stats = BatcherStats()
        self._queue: collections.deque[_Sequence] = collections.deque()
        self._slot: list[_Sequence | None] = [None] * b  # the sequence holding each slot
        self._prefilling: list[int] = []  # slots whose prompt is being prefilled, in admission order
        self._fresh: set[int] = set()  # of those, slots not reset yet (their first chunk)
        self._next_id = 0
        c = engine.config
        self._replay = engine.options.resolved_replay(c)
        # the CED stash of every slot (a refill gathers its rows): prompts of several chunks keep their encoder
        # output there between iterations, whichever rows their chunks run in
        self._stash = (new_stash(c, b, self._replay, engine.params["embed"].dtype, like=engine.cache["length"])
                       if engine.options.ced else None)
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
        """One engine iteration (admit, one refill chunk, one run of decode steps); returns the completions it
        finished."""
        if not self.busy:
            return []
        self.stats.iterations += 1
        done: list[Completion] = []
        self._admit()
        if self._prefilling:
            t0 = time.perf_counter()
            self._refill_chunk(done)
            self.stats.prefill_s += time.perf_counter() - t0
        running = self._decoding()
        if running.any():
            t0 = time.perf_counter()
            # one step only while a prompt is mid-prefill, so that its next chunk is not held back by a run
            self._decode_run(running, done, max_steps=1 if self._prefilling else self.decode_run)
            self.stats.decode_s += time.perf_counter() - t0
        if not self.busy:
            self.engine._owner = None
        return done

    def run(self) -> Iterator[Completion]:
        """Step until every submitted request is done, yielding completions as they finish."""
        while self.busy:
            yield from self.step()

    def precompile(self, prompt_lens: tuple[int, int] | None = None) -> float:
        """Compile every program serving can run — the refill program of each row bucket and chunk length, and the
        decode step — by running each once on idle rows (nothing in the cache changes), so that serving then
        compiles nothing. ``prompt_lens``: (shortest, longest) prompt expected (default 1 to ``max_len``), which
        bounds the chunk lengths. Returns the seconds it took. Call it while the batcher has no work."""
        if self.busy:
            raise EngineError("precompile needs an idle batcher (it runs programs on the engine's cache)")
        eng = self.engine
        t0 = time.perf_counter()
        lo, hi = (1, eng.max_len) if prompt_lens is None else prompt_lens
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise EngineError(f"prompt_lens must be (shortest, longest) with 1 <= shortest <= longest, got "
                              f"{prompt_lens!r}")
        # a chunk's length is the bucket of the longest prompt part left in it: any tail of a prompt longer than a
        # chunk, else the whole prompt
        sizes = sorted({chunk_bucket(n, self.chunk) for n in range(1 if hi > self.chunk else lo, hi + 1)})
        self._ensure_samp()
        self._ensure_limits()
        refills = [self._refill_args([], rows, size)[0] for rows in self.row_buckets for size in sizes]
        idle = np.zeros((eng.max_batch,), np.int32)
        state, tables = self._decode_state(np.zeros((eng.max_batch,), bool), idle, idle)
        dopts = _decode_opts(eng.options)
        decode_args = (eng.params, eng.cache, state, tables if eng.config.engram_layer_ids else None,
                       *self._samp_dev, *self._limits_dev)
        # build the programs concurrently where the program store keeps them (compiles release the GIL) ...
        jobs = [lambda a=a: refill_program(eng.options).prepare(*a, config=eng.config, opts=eng.options)
                for a in refills]
        jobs.append(lambda: decode_chain_program(dopts).prepare(*decode_args, config=eng.config, opts=dopts,
                                                                sampler="filtered"))
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            list(pool.map(lambda job: job(), jobs))
        # ... then run each once on idle rows (compiling here what the store did not keep)
        for args in refills:
            eng.cache, self._stash, first = refill_rows_jit(*((eng.params, eng.cache, self._stash) + args[3:]),
                                                            config=eng.config, opts=eng.options)
        _tok, state, eng.cache = decode_chain(eng.params, eng.cache, state, tables, *self._samp_dev,
                                              *self._limits_dev, config=eng.config, opts=eng.options)
        np.asarray(first), np.asarray(state["readback"])
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------------------
    def _decoding(self) -> np.ndarray:
        return np.array([s is not None and s.prefilled == len(s.ids) and bool(s.tokens) for s in self._slot])

    def _admit(self) -> None:
        eng = self.engine
        free = [s for s, seq in enumerate(self._slot) if seq is None]
        n = min(len(free), len(self._queue), self.lanes - len(self._prefilling))
        if n <= 0:
            return
        # the admission policy: while others decode and no refill runs anyway, wait for enough free slots
        target = min(self.refill_min, len(self._queue), self.lanes)
        if self._decoding().any() and not self._prefilling and n < target:
            return
        for slot in free[:n]:
            seq = self._queue.popleft()
            self._slot[slot] = seq
            self._prefilling.append(slot)
            self._fresh.add(slot)
            if eng.hasher is not None:  # the prompt's Engram rows and the slot's look-back, as Engine.prefill
                rows, h = eng.hasher.step(np.asarray([seq.ids]), eng.hasher.empty_history(1))
                seq.engram_rows = rows[0].astype(np.int32)
                for a, v in zip((eng._hist.tokens, eng._hist.segments, eng._hist.num_positions,
                                 eng._hist.num_valid), (h.tokens, h.segments, h.num_positions, h.num_valid)):
                    a[slot] = v[0]
            for a, v in zip(self._samp_host, seq.sampling):
                a[slot] = v
        self._samp_dev = None
        self._limits_dev = None

    def _ensure_samp(self) -> None:
        if self._samp_dev is None:
            # copies: on a CPU, jnp.asarray may alias a NumPy buffer, and a program dispatched earlier may still
            # be reading it when the host changes it for the next request
            self._samp_dev = tuple(jnp.asarray(a.copy()) for a in self._samp_host)

    def _refill_chunk(self, done: list[Completion]) -> None:
        """One refill program over the slots being prefilled (rows bucketed), their first tokens read back."""
        slots = list(self._prefilling)
        seqs = [self._slot[s] for s in slots]
        left = [len(q.ids) - q.prefilled for q in seqs]
        size = chunk_bucket(max(left), self.chunk)
        finishing = [n <= size for n in left]
        rows = refill_bucket(len(slots), self.lanes)
        self._ensure_samp()
        first, n_valid = self._run_refill(slots, rows, size)
        st = self.stats
        st.prefill_chunks += 1
        st.prefill_rows += rows
        st.prefill_rows_used += len(slots)
        st.refill_buckets[rows] = st.refill_buckets.get(rows, 0) + 1
        st.prompt_tokens += int(n_valid.sum())
        st.max_prefilling = max(st.max_prefilling, len(slots))
        self._fresh.difference_update(slots)
        for q, n in zip(seqs, n_valid):
            q.prefilled += int(n)
        if not any(finishing):
            return
        first = np.asarray(first)
        st.readbacks += 1
        now = time.perf_counter()
        for i, (slot, fin) in enumerate(zip(slots, finishing)):
            if fin:
                self._prefilling.remove(slot)
                self._emit(slot, int(first[i]), now, done)

    def _run_refill(self, slots: list[int], rows: int, size: int):
        """Dispatch the refill program of ``rows`` rows and chunk length ``size`` for ``slots`` (the next chunk of
        each one's prompt; padding rows are idle). Returns (first tokens [rows] on the device, n_valid)."""
        eng = self.engine
        args, n_valid = self._refill_args(slots, rows, size)
        eng.cache, self._stash, first = refill_rows_jit(*args, config=eng.config, opts=eng.options)
        return first, n_valid

    def _refill_args(self, slots: list[int], rows: int, size: int):
        """(the refill program's positional arguments, n_valid) for ``slots`` (see :meth:`_run_refill`)."""
        eng, c = self.engine, self.engine.config
        b = eng.max_batch
        idx = np.full((rows,), b, np.int32)  # padding rows: slot b, out of range (clamped read, dropped write)
        fresh = np.zeros((rows,), bool)
        tokens = np.zeros((rows, size), np.int32)
        n_valid = np.zeros((rows,), np.int32)
        n_new = np.zeros((rows,), np.int32)
        eids = None if eng.hasher is None else np.zeros((rows, size, len(c.engram_layer_ids), c.n_hash_cols),
                                                        np.int32)
        seg_e = None
        if eng.options.ced and eng.hasher is not None:
            seg_e = np.zeros((rows, self._replay) + eids.shape[2:], np.int32)
        for i, s in enumerate(slots):
            q = self._slot[s]
            idx[i], fresh[i] = s, s in self._fresh
            n = min(len(q.ids) - q.prefilled, size)
            tokens[i, :n] = q.ids[q.prefilled:q.prefilled + n]
            n_valid[i] = n
            if eids is not None:
                eids[i, :n] = q.engram_rows[q.prefilled:q.prefilled + n]
            if q.prefilled + n == len(q.ids):  # its prompt completes: the CED decoder replays its last tokens
                n_new[i] = len(q.ids)
                if seg_e is not None:  # the replayed segment's rows (the prompt's last min(r, T)), left-aligned
                    n_seg = min(len(q.ids), self._replay)
                    seg_e[i, :n_seg] = q.engram_rows[len(q.ids) - n_seg:]
        as_dev = lambda a: None if a is None else jnp.asarray(a)  # noqa: E731
        return (eng.params, eng.cache, self._stash, as_dev(idx), as_dev(fresh), as_dev(tokens), as_dev(n_valid),
                as_dev(eids), as_dev(n_new), as_dev(seg_e), *self._samp_dev), n_valid

    def _ensure_limits(self) -> None:
        if self._limits_dev is None:  # per-slot limits, as generate's device loop: stop tokens, max_new, room
            eng = self.engine
            b = eng.max_batch
            max_new = np.zeros((b,), np.int32)
            room = np.zeros((b,), np.int32)
            stop_lists = {}
            for s, q in enumerate(self._slot):
                if q is not None:
                    max_new[s], room[s], stop_lists[s] = q.max_new_tokens, eng.max_len - len(q.ids), q.stops
            self._limits_dev = tuple(jnp.asarray(a) for a in (stop_token_table(b, stop_lists), max_new, room))

    def _decode_state(self, running: np.ndarray, fed: np.ndarray, generated: np.ndarray):
        """A decode run's initial state on the device, and the Engram hash tables (None without Engram layers)."""
        eng = self.engine
        state = {"tokens": fed.copy(), "active": running.copy(), "generated": generated.copy(),
                 "step": np.zeros((), np.int32), "readback": np.zeros((self.decode_run + 1, eng.max_batch), np.int32)}
        tables = None
        if eng.hasher is not None:
            tables = eng.hasher.device_tables()
            state["engram_history"] = device_history(eng._hist)
        return eng._on_device(state), tables

    def _decode_run(self, running: np.ndarray, done: list[Completion], max_steps: int) -> None:
        """Up to ``max_steps`` self-feeding decode steps over the running slots, dispatched back to back; their
        tokens come back in one transfer and are emitted in order (the host replays the slots' ends, which the
        device applied: checked). With requests waiting, the run ends once enough slots for a refill
        (``refill_min``) will have reached their limits."""
        eng = self.engine
        b = eng.max_batch
        live = np.flatnonzero(running)
        seqs = {int(s): self._slot[s] for s in live}
        # steps each slot can still take: its max_new_tokens, and the cache room (finish_reason's "max_len")
        left = sorted(min(q.max_new_tokens - len(q.tokens), eng.max_len - len(q.ids) - len(q.tokens) + 1)
                      for q in seqs.values())
        n = max(1, min(max_steps, left[-1]))
        if self._queue and not self._prefilling:
            need = min(self.refill_min, len(self._queue), self.lanes) - sum(q is None for q in self._slot)
            if 0 < need <= len(left):
                n = max(1, min(n, left[need - 1]))  # after that many steps `need` more slots are free
        self._ensure_samp()
        self._ensure_limits()
        fed = np.zeros((b,), np.int32)
        generated = np.zeros((b,), np.int32)
        for s, q in seqs.items():
            fed[s], generated[s] = q.tokens[-1], len(q.tokens)
        state, tables = self._decode_state(running, fed, generated)
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


__all__ = ["ContinuousBatcher", "Completion", "BatcherStats", "DEFAULT_REFILL_FRACTION", "serve"]
