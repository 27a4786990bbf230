"""``Engine``: batched generation over the cached CED prefill and the jitted decode step.

    engine = dsv41_jax.Engine(config, params, max_batch=8, max_len=4096)
    results = engine.generate(["Hello", "Bonjour"], max_new_tokens=32, temperature=0.7, top_p=0.9, seed=1,
                              on_token=lambda i, tok: ...)

One cache of ``max_batch`` slots x ``max_len`` tokens is allocated once; every prefill and decode step compiles for
those static sizes (prefill chunks also per power-of-two chunk length). Requests in one call may have different
prompt lengths: each slot keeps its own length, so nothing of another sequence or of padding reaches its
attention windows, compressor groups, indexer or Engram n-grams. The Engram look-back of each slot (its last n-1
compressed ids) is kept on the host next to the hasher, which hashes prompts; every decode step hashes its tokens on
the device instead (bit-identical): ``generate``'s device loop inside its step program, so that its steps run back to
back with the tokens read back in runs (``decode_loop`` / ``readback_every``), and ``decode_step``, the host loop and
``serve`` in a small program before the step, the host only appending the fed tokens to the look-back.

Per-request problems (empty prompt, prompt longer than ``max_len``, token ids outside the vocabulary, invalid
sampling parameters) are reported in that request's result (``finish_reason == "error"``) and the other requests
are served; problems of the whole call (more requests than ``max_batch``) raise ``EngineError``.

``generate`` serves one static batch (every sequence until the last one ends); ``serve`` / ``batcher`` serve any
number of requests by continuous batching over the same slots (:mod:`dsv41_jax.inference.batching`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.compilation_cache import enable_compilation_cache
from dsv41_jax.config import ModelConfig
from dsv41_jax.inference.cache import CacheFootprint, abstract_cache, cache_footprint, init_cache, tree_bytes
from dsv41_jax.inference.decode import decode_and_sample, decode_chain, decode_step_jit, run_device_loop
from dsv41_jax.inference.prefill import DEFAULT_PREFILL_CHUNK, default_prefill_chunk, prefill as _prefill
from dsv41_jax.inference.sampling import SamplingError, SamplingParams, sample_jit, sampler_for
from dsv41_jax.inference.step import InferenceOptions, check_ced_plan, grouped_prefill_moe
from dsv41_jax.model.params import validate_params
from dsv41_jax.ops.engram_hash import EngramHistory, advance_history, device_history, engram_row_ids_step_device


class EngineError(ValueError):
    pass


# One decode step's Engram hash on the device (decode_step, the host loop of generate, serve's decode steps); the
# device loop's steps hash inside their own program (decode_chain).
_hash_step = jax.jit(engram_row_ids_step_device)


@dataclasses.dataclass
class Request:
    prompt: Sequence[int] | str
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: Sequence[int] | None = None  # None -> the engine's default (eos)


@dataclasses.dataclass
class Result:
    tokens: list[int]
    finish_reason: str  # "stop" | "length" | "max_len" | "error"
    prompt_len: int = 0
    error: str | None = None
    text: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    first_step_s: float = 0.0  # the first decode step (includes its compile when not cached yet)
    compile_s: float = 0.0  # JAX lowering + XLA compilation during this generate call (jax.monitoring events)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def steady_tokens_per_s(self) -> float:
        """Tokens per second of the decode steps after the first (compile excluded), all sequences together."""
        rest = self.decode_s - self.first_step_s
        n = self.new_tokens - self.prefill_sequences - self.first_step_tokens
        return n / rest if rest > 0 and n > 0 else float("nan")

    prefill_sequences: int = 0
    first_step_tokens: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def time_to_first_token_s(self) -> float:
        """From the call to the first sampled token: the prefill (and its compiles) plus the first sampling."""
        return self.prefill_s


# Seconds of lowering + XLA compilation in this process, from jax.monitoring (registered once, on first use), so
# generate can report compile time apart from prefill and decode time. Tracing events are not counted: a jit
# traced inside another's trace reports its own (nested) duration.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration", "/jax/core/compile/backend_compile_duration")
_compile_seconds = [0.0]
_compile_listener_registered = []


def finish_reason(token: int, stops, n_generated: int, max_new_tokens: int, n_prompt: int, max_len: int):
    """Why a sequence ends after emitting ``token`` as its ``n_generated``-th new token, or None: ``stop`` (a stop
    token), ``length`` (its ``max_new_tokens``), ``max_len`` (the next token would not fit in the cache)."""
    if token in stops:
        return "stop"
    if n_generated >= max_new_tokens:
        return "length"
    if n_prompt + n_generated > max_len:
        return "max_len"
    return None


def compile_seconds() -> float:
    if not _compile_listener_registered:
        import jax.monitoring

        def listen(event: str, duration: float, **_kw) -> None:
            if event in _COMPILE_EVENTS:
                _compile_seconds[0] += duration

        jax.monitoring.register_event_duration_secs_listener(listen)
        _compile_listener_registered.append(listen)
    return _compile_seconds[0]


def check_device_ends(host_active: np.ndarray, device_active: np.ndarray) -> None:
    """A device decode loop ends slots on the device and the host replays the tokens read back: both must agree."""
    if not np.array_equal(host_active, device_active):
        raise EngineError(f"internal: the device ended slots {np.flatnonzero(device_active != host_active)} "
                          "differently from the host")


def stop_token_table(batch: int, stop_lists: dict) -> np.ndarray:
    """The stop tokens of the slots ({slot: tokens}) as int32 [batch, width] for a device loop, padded with -2
    (never sampled). The width is bucketed (4, 8, 16, ...) so that calls with different numbers of stop tokens run
    the same compiled step (its shapes are the program's: a new width would compile it again)."""
    width = 4
    while width < max((len(v) for v in stop_lists.values()), default=0):
        width *= 2
    stops = np.full((batch, width), -2, np.int32)
    for s, toks in stop_lists.items():
        stops[s, :len(toks)] = toks
    return stops


class Engine:
    """Batched generation for one model. See the module docstring."""

    def __init__(self, config: ModelConfig, params: dict, *, max_batch: int = 8, max_len: int = 4096,
                 tokenizer=None, hasher=None, prefill_chunk: int | None = None,
                 options: InferenceOptions = InferenceOptions(), cache_dtype=None, weights: str | None = None,
                 cache: str = "bf16", compilation_cache=None, decode_loop: str = "device",
                 readback_every: int = 8, decode_pipeline: bool = True, engram_tables: str = "auto"):
        """``compilation_cache``: JAX's persistent compilation cache — None (default: on, under
        ``$XDG_CACHE_HOME/dsv41_jax`` or ``~/.cache/dsv41_jax``, unless ``DSV41_COMPILATION_CACHE=off``), False (off),
        True, or a directory (``dsv41_jax.compilation_cache``).

        ``decode_loop``: how ``generate`` runs its decode steps — ``"device"`` (default: each step hashes Engram
        n-grams and feeds its own samples on the device, so steps are dispatched back to back and their tokens
        read back every ``readback_every`` steps; ``on_token`` is then called in runs of up to that many) or
        ``"host"`` (the tokens read back after every step, the previous loop; their Engram n-grams are hashed on the
        device too). ``decode_pipeline`` (device loop; default True): dispatch each run of steps before the
        previous run is read back, so the device does not idle while the host reads back, accounts and dispatches
        (``inference.decode.run_device_loop``); the tokens, ends, cache and Engram look-back are those of the
        unpipelined loop (False), but a batch whose every sequence ends on a stop token runs up to one more run of
        steps, whose tokens are discarded.

        ``prefill_chunk``: prompt tokens per prefill chunk program; None (default): 512, or on a Hopper GPU with the
        grouped expert GEMM for prefill (bf16 / float weights) up to 4096 while max_batch x chunk <= 4096
        (``inference.prefill.default_prefill_chunk``: measured faster there). ``batcher()``'s refill chunks default
        to 512 unless ``prefill_chunk`` is given (a refill chunk stalls the decoding slots for its length).

        ``engram_tables``: ``"device"``, ``"host"`` (the Engram tables in host memory, pinned: only each step's rows
        move to the device — read by the GPU itself on one CUDA GPU, gathered on the host elsewhere;
        ``inference.host_tables``) or ``"auto"`` (default:
        ``"host"`` when the weights and the cache would take more than the device's memory with the tables
        on it, ``"device"`` otherwise and wherever the backend reports no memory limit, as on the CPU)."""
        if not isinstance(max_batch, int) or max_batch <= 0:
            raise EngineError(f"max_batch must be a positive integer, got {max_batch!r}")
        if not isinstance(max_len, int) or max_len <= 0:
            raise EngineError(f"max_len must be a positive integer, got {max_len!r}")
        if max_len > config.max_position_embeddings:
            raise EngineError(f"max_len {max_len} exceeds the model's max_position_embeddings "
                              f"{config.max_position_embeddings}")
        if decode_loop not in ("device", "host"):
            raise EngineError(f"decode_loop must be 'device' or 'host', got {decode_loop!r}")
        if not isinstance(readback_every, int) or isinstance(readback_every, bool) or readback_every <= 0:
            raise EngineError(f"readback_every must be a positive integer, got {readback_every!r}")
        if not isinstance(decode_pipeline, bool):
            raise EngineError(f"decode_pipeline must be True or False, got {decode_pipeline!r}")
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool)
                                          or prefill_chunk <= 0):
            raise EngineError(f"prefill_chunk must be a positive integer or None, got {prefill_chunk!r}")
        validate_params(params, config)
        self.compilation_cache_dir = enable_compilation_cache(compilation_cache)  # before the first compile
        params, options = _precision(config, params, options, weights, cache)  # weights= / cache= (release)
        if engram_tables not in ("device", "host", "auto"):
            raise EngineError(f"engram_tables must be 'device', 'host' or 'auto', got {engram_tables!r}")
        from dsv41_jax.inference import host_tables as HT

        if engram_tables == "auto":
            tables = HT.engram_table_bytes(params)
            cache_bytes = tree_bytes(abstract_cache(config, max_batch, max_len, cache_dtype or params["embed"].dtype,
                                                    packed=cache == "release"))
            engram_tables = HT.choose_placement(HT.per_device_bytes(params), tables["host"] + tables["device"],
                                                cache_bytes, HT.device_memory_bytes())
        if engram_tables == "host":
            params = HT.place_engram_tables(params, "host")
        self.engram_tables = engram_tables
        if options.ced:
            check_ced_plan(config)
        self.config = config
        self.params = params
        self.max_batch = max_batch
        self.max_len = max_len
        grouped = grouped_prefill_moe(options) and not options.gemm_input_fp8  # measured on bf16 weights only
        self.prefill_chunk = default_prefill_chunk(max_batch, grouped) if prefill_chunk is None else prefill_chunk
        self.refill_chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk  # batcher() default
        self.decode_loop = decode_loop
        self.readback_every = readback_every
        self.decode_pipeline = decode_pipeline
        self.options = options
        self.tokenizer = tokenizer
        if hasher is None and config.engram_layer_ids:
            from dsv41_jax.model.hasher import default_hasher

            hasher = default_hasher(config, tokenizer)
        self.hasher = hasher
        self.cache_dtype = cache_dtype or params["embed"].dtype
        self.cache_format = cache
        self.cache = init_cache(config, max_batch, max_len, self.cache_dtype, packed=cache == "release")
        # Committed to its device from the start: jit keys its cache on the arguments' placement, and every program
        # returns the donated cache committed, so an uncommitted first cache would compile the first program twice.
        device = getattr(params["embed"], "sharding", None)
        if isinstance(device, jax.sharding.SingleDeviceSharding):
            self.cache = jax.device_put(self.cache, device)
        k = config.engram_max_ngram_size - 1 if config.engram_layer_ids else 1
        self._hist = EngramHistory.empty(max_batch, k + 1) if self.hasher is not None else None
        self.default_stop = (tokenizer.eos_id if tokenizer is not None else config.eos_token_id,)
        self.last_stats = GenerationStats()
        self._owner = None  # a ContinuousBatcher serving requests on this cache

    # ------------------------------------------------------------------------------------------------------
    def footprint(self, storage: str | None = None) -> CacheFootprint:
        """Cache bytes per token for ``storage`` (default: the engine's cache dtype) and for this engine's sizes."""
        storage = storage or ("release" if self.cache_format == "release" else str(jnp.dtype(self.cache_dtype)))
        return cache_footprint(self.config, storage, batch=self.max_batch, max_len=self.max_len)

    def allocated_bytes(self) -> int:
        return tree_bytes(self.cache)

    @property
    def weights_format(self) -> str:
        return "release" if self.options.gemm_input_fp8 else "bf16"

    def weight_bytes(self) -> int:
        """Bytes the parameters hold on device (values + scales of release-format weights; the release's ``wo_a``
        in the model's float dtype, as it is served)."""
        return tree_bytes(self.params)

    def lengths(self) -> np.ndarray:
        return np.asarray(self.cache["length"])

    # ------------------------------------------------------------------------------------------------------
    # Lower level: explicit slots
    # ------------------------------------------------------------------------------------------------------
    def _check_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EngineError("a text prompt needs a tokenizer (Engine(..., tokenizer=...)); or pass token ids")
            prompt = self.tokenizer.encode(prompt, add_bos=True)
        try:
            arr = np.asarray(prompt)
        except Exception:  # noqa: BLE001 - ragged or exotic input
            arr = None
        if arr is None or arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise EngineError(f"prompt must be a string or a 1-D sequence of integer token ids, got "
                              f"{type(prompt).__name__}" + ("" if arr is None else f" of dtype {arr.dtype}"))
        ids = [int(t) for t in arr]
        if not ids:
            raise EngineError("empty prompt: at least one token is needed")
        if len(ids) > self.max_len:
            raise EngineError(f"prompt of {len(ids)} tokens is longer than max_len {self.max_len}")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            pos = next(i for i, t in enumerate(ids) if not 0 <= t < self.config.vocab_size)
            raise EngineError(f"token id {bad[0]} at prompt position {pos} is outside the vocabulary "
                              f"[0, {self.config.vocab_size})")
        return ids

    def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int] | None = None, *,
                return_logits: bool = False, progress=None, on_features=None):
        """Start new sequences: prompt i goes into slot ``slots[i]`` (default 0..n-1), replacing what was there.
        Returns the logits of each prompt's last token, [n, V] (and with ``return_logits`` the replayed
        positions' logits [n, R, V]). ``on_features``: see :func:`dsv41_jax.inference.prefill.prefill` (the
        DSpark target features, over all ``max_batch`` slots)."""
        self._check_free()
        prompts = [self._check_prompt(p) for p in prompts]
        slots = list(range(len(prompts))) if slots is None else [int(s) for s in slots]
        if len(slots) != len(prompts) or len(set(slots)) != len(slots):
            raise EngineError(f"need one distinct slot per prompt, got slots {slots} for {len(prompts)} prompts")
        if any(not 0 <= s < self.max_batch for s in slots):
            raise EngineError(f"slots must lie in [0, max_batch={self.max_batch}), got {slots}")
        if not prompts:
            raise EngineError("no prompts to prefill")
        b = self.max_batch
        width = max(len(p) for p in prompts)
        tokens = np.zeros((b, width), np.int32)
        lengths = np.zeros((b,), np.int64)
        reset = np.zeros((b,), bool)
        eids = None
        if self.hasher is not None:
            c = self.config
            eids = np.zeros((b, width, len(c.engram_layer_ids), c.n_hash_cols), np.int32)
        hist = None if self._hist is None else [a.copy() for a in (self._hist.tokens, self._hist.segments,
                                                                     self._hist.num_positions, self._hist.num_valid)]
        for p, s in zip(prompts, slots):
            tokens[s, :len(p)] = p
            lengths[s] = len(p)
            reset[s] = True
            if self.hasher is not None:
                rows, h = self.hasher.step(np.asarray([p]), self.hasher.empty_history(1))
                eids[s, :len(p)] = rows[0]
                for a, v in zip(hist, (h.tokens, h.segments, h.num_positions, h.num_valid)):
                    a[s] = v[0]
        chunk = self.prefill_chunk
        out = _prefill(self.params, self.cache, tokens, lengths, eids, config=self.config, opts=self.options,
                       chunk=chunk, reset=reset, return_logits=return_logits, progress=progress,
                       on_features=on_features)
        if return_logits:
            last, self.cache, logits = out
        else:
            last, self.cache = out
        if hist is not None:
            self._hist = EngramHistory(*hist)
        idx = jnp.asarray(slots)
        if return_logits:
            return last[idx], logits[idx]
        return last[idx]

    def _engram_step(self, tokens: np.ndarray, active: np.ndarray) -> jax.Array | None:
        """The Engram row ids of one decode step's tokens, int32 [max_batch, n_engram_layers, n_hash_cols] on the
        device: hashed there (``engram_row_ids_step_device``, bit-identical to the host hasher's ``step``) from the
        slots' look-back, which the host brings up to date without hashing (``advance_history``). Inactive slots
        keep their look-back (their rows are those of token 0 and are not used)."""
        if self.hasher is None:
            return None
        safe = np.where(active, tokens, 0).astype(np.int32)
        rows, _ = _hash_step(self.hasher.device_tables(), jnp.asarray(device_history(self._hist)), jnp.asarray(safe))
        self._hist = advance_history(self._hist, self.hasher.token_map, safe, active)
        return rows

    def decode_step(self, tokens, active=None) -> jax.Array:
        """Feed one token to each active slot (tokens int [max_batch]); returns logits [max_batch, V]."""
        self._check_free()
        tok = np.asarray(tokens)
        b = self.max_batch
        act = np.asarray(self.lengths() > 0) if active is None else np.asarray(active, bool)
        if tok.shape != (b,) or act.shape != (b,):
            raise EngineError(f"tokens and active must have shape ({b},), got {tok.shape} and {act.shape}")
        bad = act & ((tok < 0) | (tok >= self.config.vocab_size))
        if bad.any():
            s = int(np.argmax(bad))
            raise EngineError(f"token id {int(tok[s])} (slot {s}) is outside the vocabulary "
                              f"[0, {self.config.vocab_size})")
        full = act & (self.lengths() >= self.max_len)
        if full.any():
            raise EngineError(f"slots {np.flatnonzero(full).tolist()} are full (max_len {self.max_len})")
        eids = self._engram_step(tok, act)
        logits, self.cache = decode_step_jit(self.params, self.cache, jnp.asarray(tok.astype(np.int32)),
                                             None if eids is None else jnp.asarray(eids), jnp.asarray(act),
                                             config=self.config, opts=self.options)
        return logits

    # ------------------------------------------------------------------------------------------------------
    # Generation
    # ------------------------------------------------------------------------------------------------------
    def _make_requests(self, prompts, kw) -> list[Request]:
        reqs = []
        for p in prompts:
            if isinstance(p, Request):
                reqs.append(p)
            else:
                reqs.append(Request(prompt=p, **kw))
        return reqs

    def _validate(self, r: Request) -> tuple[list[int], SamplingParams, tuple[int, ...]]:
        ids = self._check_prompt(r.prompt)
        sp = SamplingParams(r.temperature, r.top_k, r.top_p, r.seed)
        try:
            sp.validate()
        except SamplingError as e:
            raise EngineError(str(e)) from None
        if not isinstance(r.max_new_tokens, int) or isinstance(r.max_new_tokens, bool) or r.max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be an integer >= 1, got {r.max_new_tokens!r}")
        stops = self.default_stop if r.stop_tokens is None else tuple(int(t) for t in r.stop_tokens)
        bad = [t for t in stops if not 0 <= t < self.config.vocab_size]
        if bad:
            raise EngineError(f"stop token {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids, sp, stops

    def generate(self, prompts: Sequence, *, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] | None = None,
                 on_token: Callable[[int, int], None] | None = None, progress=None) -> list[Result]:
        """Generate for a batch of prompts (token-id sequences, strings with a tokenizer, or ``Request`` objects
        carrying their own parameters; the keyword arguments are the defaults for plain prompts).

        ``on_token(i, token)`` streams every new token of request i as soon as it is sampled. Returns one
        ``Result`` per request, in order; ``self.last_stats`` holds timings.
        """
        self._check_free()
        reqs = self._make_requests(prompts, dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                                 top_p=top_p, seed=seed, stop_tokens=stop_tokens))
        if len(reqs) > self.max_batch:
            raise EngineError(f"{len(reqs)} requests but the engine serves at most max_batch={self.max_batch} at "
                              "once; use engine.serve(requests) (continuous batching) or several generate calls")
        results: list[Result | None] = [None] * len(reqs)
        ok: list[tuple[int, list[int], SamplingParams, tuple[int, ...], int]] = []
        for i, r in enumerate(reqs):
            try:
                ids, sp, stops = self._validate(r)
            except EngineError as e:
                results[i] = Result([], "error", 0, error=str(e))
                continue
            ok.append((i, ids, sp, stops, r.max_new_tokens))
        stats = GenerationStats()
        self.last_stats = stats
        if not ok:
            return results  # type: ignore[return-value]

        b = self.max_batch
        slot_of = {i: s for s, (i, *_rest) in enumerate(ok)}
        temp = np.zeros((b,), np.float32)
        topk = np.zeros((b,), np.int32)
        topp = np.ones((b,), np.float32)
        seeds = np.zeros((b,), np.int32)
        for i, ids, sp, _, _ in ok:
            s = slot_of[i]
            temp[s], topk[s], topp[s], seeds[s] = sp.temperature, sp.top_k, sp.top_p, sp.seed
        samp = tuple(jnp.asarray(a) for a in (temp, topk, topp, seeds))
        sampler = sampler_for(temp, topk, topp)  # empty slots are greedy rows: they never widen the choice

        c0 = compile_seconds()
        t0 = time.perf_counter()
        last = self.prefill([ids for _, ids, *_ in ok], [slot_of[i] for i, *_ in ok], progress=progress)
        full_last = jnp.zeros((b, last.shape[-1]), last.dtype).at[jnp.asarray([slot_of[i] for i, *_ in ok])].set(last)
        nxt = np.asarray(sample_jit(full_last, *samp, jnp.zeros((b,), jnp.int32), sampler=sampler))
        stats.prefill_s = time.perf_counter() - t0
        stats.prompt_tokens = sum(len(ids) for _, ids, *_ in ok)
        stats.prefill_sequences = len(ok)

        out: dict[int, list[int]] = {i: [] for i, *_ in ok}
        active = np.zeros((b,), bool)
        for i, *_ in ok:
            active[slot_of[i]] = True
        info = {slot_of[i]: (i, ids, stops, mnt) for i, ids, _, stops, mnt in ok}

        def account(tokens) -> None:
            """The tokens one step sampled: append them to the active slots' outputs, finish what is done."""
            for s in np.flatnonzero(active):
                i, ids, stops, mnt = info[s]
                tok = int(tokens[s])
                out[i].append(tok)
                if on_token is not None:
                    on_token(i, tok)
                reason = finish_reason(tok, stops, len(out[i]), mnt, len(ids), self.max_len)
                if reason is not None:
                    active[s] = False
                    results[i] = Result(out[i], reason, len(ids), text=self._decode_text(out[i]))

        t1 = time.perf_counter()
        account(nxt)  # the prefill's tokens
        if self.decode_loop == "device":
            step = self._decode_on_device(nxt, active, out, info, samp, sampler, account, stats, t1)
        else:
            step = 0
            while active.any():
                step += 1
                eids = self._engram_step(nxt, active)
                res = decode_and_sample(self.params, self.cache, jnp.asarray(nxt.astype(np.int32)),
                                        None if eids is None else jnp.asarray(eids), jnp.asarray(active), *samp,
                                        jnp.full((b,), step, jnp.int32), config=self.config, opts=self.options,
                                        sampler=sampler)
                nxt_dev, self.cache = res
                nxt = np.asarray(nxt_dev)
                if step == 1:
                    stats.first_step_s = time.perf_counter() - t1
                    stats.first_step_tokens = int(active.sum())
                account(nxt)
        stats.decode_s = time.perf_counter() - t1
        stats.compile_s = compile_seconds() - c0
        stats.decode_steps = step
        stats.new_tokens = sum(len(v) for v in out.values())
        return results  # type: ignore[return-value]

    def _decode_on_device(self, nxt, active, out, info, samp, sampler, account, stats, t0) -> int:
        """The decode loop of ``generate`` with nothing read back between steps (``decode_chain``: each step
        hashes its Engram n-grams and feeds its own samples on the device, and ends slots by their limits there).
        Steps are dispatched in runs of up to ``readback_every`` (the first run is one step, so that
        ``first_step_s`` is the compile); each run's tokens come back at once and ``account`` replays them on the
        host, with the same ends as the device's (checked). A run is never longer than the most steps any active
        slot can still take, so only slots ended early by a stop token waste steps. With ``decode_pipeline`` the
        next run is dispatched before this one is read back (``decode.run_device_loop``), so the device never waits
        for the host; a batch that ends on stop tokens then also dispatches (and discards) up to one more run.
        Returns the steps dispatched."""
        b = self.max_batch
        stops = stop_token_table(b, {s: v[2] for s, v in info.items()})
        max_new = np.zeros((b,), np.int32)
        room = np.zeros((b,), np.int32)
        for s, (_i, ids, _st, mnt) in info.items():
            max_new[s], room[s] = mnt, self.max_len - len(ids)
        generated = np.asarray([len(out[info[s][0]]) if s in info else 0 for s in range(b)], np.int32)
        state = {"tokens": jnp.asarray(nxt.astype(np.int32)), "active": jnp.asarray(active),
                 "generated": jnp.asarray(generated), "step": jnp.zeros((), jnp.int32),
                 "readback": jnp.zeros((self.readback_every + 1, b), jnp.int32)}
        tables = None
        hist0 = self._hist
        if self.hasher is not None:
            tables = self.hasher.device_tables()
            state["engram_history"] = jnp.asarray(device_history(self._hist))
        limits = tuple(jnp.asarray(a) for a in (stops, max_new, room))
        state = self._on_device(state)
        r = self.readback_every

        def plan(read: int, queued: int) -> int:
            # the most steps an active slot may still take after the `queued - read` steps in flight (the host knows
            # the slots' outputs up to `read`); the first run is one step, so that first_step_s is the compile
            if not active.any():
                return 0
            left = max(min(max_new[s] - len(out[info[s][0]]), room[s] - len(out[info[s][0]]) + 1)
                       for s in np.flatnonzero(active))
            return 1 if queued == 0 else int(min(r, left - (queued - read)))

        def dispatch(first: int, n: int):
            nonlocal state
            for _ in range(n):
                _tok, state, self.cache = decode_chain(self.params, self.cache, state, tables, *samp, *limits,
                                                       config=self.config, opts=self.options, sampler=sampler)
            return state["readback"]

        def consume(readback, first: int, n: int) -> bool:
            fed = int(active.sum())
            # one transfer for the run: its tokens and the slots the device still feeds (decode_chain's readback)
            buf = np.asarray(readback)
            for i in range(n):
                if not active.any():
                    break
                account(buf[(first + i) % r])
            if first == 0:
                stats.first_step_s = time.perf_counter() - t0
                stats.first_step_tokens = fed
            check_device_ends(active, buf[-1].astype(bool))
            return bool(active.any())

        steps = run_device_loop(dispatch, plan, consume, pipeline=self.decode_pipeline)
        if self.hasher is not None:
            self._hist = self._fed_history(hist0, info, out)
        return steps

    def _on_device(self, state: dict) -> dict:
        """A decode loop's state on the device, committed like the state the steps return where the weights sit on
        one device, so that the first step's program serves the later ones (jit keys on placement)."""
        device = getattr(self.params["embed"], "sharding", None)
        if isinstance(device, jax.sharding.SingleDeviceSharding):
            return jax.device_put(state, device)
        return jax.tree.map(jnp.asarray, state)

    def _fed_history(self, hist: EngramHistory, info, out) -> EngramHistory:
        """The host look-back after ``_decode_on_device``: every token a slot was fed (its outputs but the
        last) appended, continuing its newest segment."""
        k = hist.tokens.shape[1]
        tokens, segments = hist.tokens.copy(), hist.segments.copy()
        positions, valid = hist.num_positions.copy(), hist.num_valid.copy()
        for s, (i, *_rest) in info.items():
            fed = out[i][:-1]
            if not fed:
                continue
            ids = self.hasher.token_map[np.asarray(fed)]
            tokens[s] = np.concatenate([hist.tokens[s], ids])[-k:]
            segments[s] = np.concatenate([hist.segments[s], np.full(len(fed), hist.segments[s, -1])])[-k:]
            positions[s] += len(fed)
            valid[s] += len(fed)
        return EngramHistory(tokens, segments, positions, valid)

    # ------------------------------------------------------------------------------------------------------
    # Continuous batching (dsv41_jax.inference.batching)
    # ------------------------------------------------------------------------------------------------------
    def batcher(self, *, prefill_lanes: int | None = None, prefill_chunk: int | None = None, on_token=None,
                decode_run: int | None = None, refill_min: int | None = None):
        """A :class:`~dsv41_jax.inference.batching.ContinuousBatcher` over this engine's slots: ``submit()``
        requests at any time, ``step()`` runs one iteration (one bounded refill chunk + a run of up to
        ``decode_run`` decode steps, default ``readback_every``); ``refill_min``: the admission policy (see
        :mod:`dsv41_jax.inference.batching`)."""
        from dsv41_jax.inference.batching import ContinuousBatcher

        return ContinuousBatcher(self, prefill_lanes=prefill_lanes, prefill_chunk=prefill_chunk, on_token=on_token,
                                 decode_run=decode_run, refill_min=refill_min)

    def serve(self, requests, *, on_token: Callable[[int, int], None] | None = None, prefill_lanes: int | None = None,
              prefill_chunk: int | None = None, decode_run: int | None = None, refill_min: int | None = None):
        """Serve any number of requests by continuous batching: an iterator of ``Completion``s in the order they
        finish (``completion.id`` = the request's index; ``on_token(index, token)`` streams). A finished sequence
        frees its slot at once and the next waiting request is prefilled into it, chunk by chunk, between decode
        steps of the others. See :mod:`dsv41_jax.inference.batching`."""
        from dsv41_jax.inference.batching import serve

        return serve(self, requests, on_token=on_token, prefill_lanes=prefill_lanes, prefill_chunk=prefill_chunk,
                     decode_run=decode_run, refill_min=refill_min)

    def _check_free(self) -> None:
        if self._owner is not None and self._owner.busy:
            raise EngineError("a ContinuousBatcher is serving requests on this engine's cache; finish it (step() "
                              "until not busy) before calling generate / prefill / decode_step")

    def _decode_text(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        try:
            return self.tokenizer.decode(ids)
        except ValueError:
            return None


__all__ = ["Engine", "EngineError", "Request", "Result", "GenerationStats"]


# ----------------------------------------------------------------------------------------------------------
# Serving precision (weights= / cache=)
# ----------------------------------------------------------------------------------------------------------

def _precision(config: ModelConfig, params: dict, options: InferenceOptions, weights: str | None, cache: str):
    """(params, options) for the requested serving precision.

    ``weights``: ``"release"`` serves the release's FP8 / FP4 weights (QuantizedTensor leaves; float ones are
    quantised here, once, on the host) with the release's FP8 rounding of every FP8 / FP4 GEMM's input, and
    ``wo_a`` as the official code serves it: its FP8 values dequantised once, here, to the model's float dtype
    (``release_weights.dequantize_wo_a``; exact, so the forward is unchanged, and no dequantisation per step);
    ``"bf16"`` serves float weights (QuantizedTensor leaves are dequantised to the embedding's dtype); ``None``:
    ``"release"`` when the parameters hold QuantizedTensor leaves, else ``"bf16"``. ``cache``: ``"bf16"`` (the
    cache dtype) or ``"release"`` (packed FP8 / FP4, see ``inference.packed_cache``)."""
    from dsv41_jax.checkpoint.quantized import QuantizedTensor
    from dsv41_jax.model import release_weights as RW

    if cache not in ("bf16", "release"):
        raise EngineError(f"cache must be 'bf16' or 'release', got {cache!r}")
    has_quantized = any(isinstance(x, QuantizedTensor) for x in
                        jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedTensor)))
    weights = weights or ("release" if has_quantized else "bf16")
    if weights == "release":
        served = RW.dequantize_wo_a(RW.quantize_params(params, config), params["embed"].dtype)
        return served, dataclasses.replace(options, gemm_input_fp8=True)
    if weights == "bf16":
        return (RW.dequantize_params(params, params["embed"].dtype) if has_quantized else params), options
    raise EngineError(f"weights must be 'bf16' or 'release', got {weights!r}")
