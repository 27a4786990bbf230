"""Inference caches as explicit pytrees (SPEC §10), and their byte accounting.

One cache serves a fixed batch of ``max_batch`` sequence slots and a fixed ``max_len`` (static shapes: one
compile serves every step). Layout (a plain dict, so it flattens, donates and shards like any pytree)::

    length   int32 [B]              tokens held per slot (the next token's position)
    floor    int32 [B]              decoder SWA floor (CED bounded replay: T - min(replay_len, T) of the prompt)
    swa      [n_layers] x [B, W, hd]  per-layer ring of the last W window latents (after RoPE and the FP8 fake
                                    quantisation); position p lives in slot p mod W
    sources  {"<layer>": {...}}     per KV source (a Full layer):
        kv       [B, ceil(max_len / m), hd]  compressed main KV, rotated (+ FP4 fake quantised)
        keys     [B, ceil(max_len / m), di]  indexer keys
        buf_kv   [B, m, hd] float32          the compressor's partial group (ratio m > 1 only): projected KV ...
        buf_gate [B, m, hd] float32          ... and gate of the tokens of the not yet complete group

Ring positions are not stored: slot s of a ring whose sequence holds L tokens contains the largest position
p < L with p ≡ s (mod W), or nothing when that p < 0. Entries beyond a slot's length, or ring slots of an earlier
occupant, are therefore invisible without any clearing, so restarting a slot is just ``length = 0``.

``packed=True`` keeps ``swa``, ``kv`` and ``keys`` in the release's packed formats (:mod:`packed_cache`: FP8 window,
FP4 compressed KV and indexer keys, each with its block scales) — the bytes ``cache_footprint(config, "release")``
counts; the cached forward writes them through ``packed_cache.set_rows`` and reads them through ``packed_cache.read``
(reference / TPU) or hands them packed to the GPU kernels, which dequantise the rows they use in registers.

Engram's look-back state (the last n-1 compressed ids per slot) depends only on tokens and lives on the host next
to the hasher (``EngramHistory``), with a copy in the decode loop's device state while ``Engine.generate`` decodes
(``decode.decode_chain``); it is accounted for here all the same. Top-k selections and the HSI pool are
per-step values, not cache.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig, ceil_div
from dsv41_jax.inference import packed_cache as PC
from dsv41_jax.plan import FULL


class CacheError(ValueError):
    pass


def kv_sources(config: ModelConfig) -> list[tuple[int, int]]:
    """(layer, ratio) of every KV source (Full layer), in layer order."""
    return [(s.index, s.ratio) for s in config.plan if s.mode == FULL]


def source_entries(config: ModelConfig, max_len: int, ratio: int) -> int:
    """Entry slots of a KV source: ceil(max_len / ratio), rounded up to whole HSI blocks (the streaming indexer
    walks whole blocks)."""
    bs = config.candidate_block_size
    return ceil_div(ceil_div(max_len, ratio), bs) * bs


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *, packed: bool = False) -> dict:
    """An empty cache for ``batch`` slots of up to ``max_len`` tokens each (every slot at length 0). ``packed``:
    window KV, compressed KV and indexer keys in the release's packed formats (read back as ``dtype``)."""
    if batch <= 0 or max_len <= 0:
        raise CacheError(f"max_batch and max_len must be positive, got {batch} and {max_len}")
    return _init_cache_jit(config, batch, max_len, jnp.dtype(dtype), packed)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _init_cache_jit(config: ModelConfig, batch: int, max_len: int, dtype, packed: bool = False) -> dict:
    return _make_cache(config, batch, max_len, dtype, packed)


def _make_cache(config: ModelConfig, batch: int, max_len: int, dtype, packed: bool = False) -> dict:
    c = config
    w, hd, di = c.sliding_window, c.head_dim, c.index_head_dim

    def buf(shape, fmt):
        return PC.zeros(shape, fmt, dtype) if packed else jnp.zeros(shape, dtype)

    sources = {}
    for layer, m in kv_sources(c):
        n = source_entries(c, max_len, m)
        src = {"kv": buf((batch, n, hd), PC.FP4_E4M3_16), "keys": buf((batch, n, di), PC.FP4_UE8M0_32)}
        if m > 1:
            src["buf_kv"] = jnp.zeros((batch, m, hd), jnp.float32)
            src["buf_gate"] = jnp.zeros((batch, m, hd), jnp.float32)
        sources[str(layer)] = src
    return {
        "length": jnp.zeros((batch,), jnp.int32),
        "floor": jnp.zeros((batch,), jnp.int32),
        "swa": [buf((batch, w, hd), PC.FP8_UE8M0_32) for _ in range(c.num_hidden_layers)],
        "sources": sources,
    }


def cache_capacity(config: ModelConfig, cache: dict) -> int:
    """Tokens a slot of ``cache`` can hold: the fewest any compressed-KV source's entry slots cover (``entries *
    ratio``, at least the ``max_len`` the cache was made for: entries are rounded up to whole HSI blocks) and at
    most the model's ``max_position_embeddings``. Static (read from shapes), so jitted code can use it too.

    A token at position ``p >= capacity`` would have its compressed entry dropped by the cache writes (XLA's
    out-of-range scatter semantics): every writer checks this bound instead (prefill, decode, ``Engine``)."""
    cap = int(config.max_position_embeddings)
    for layer, src in cache["sources"].items():
        cap = min(cap, int(src["kv"].shape[1]) * int(config.compress_ratios[int(layer)]))
    return cap


def check_capacity(config: ModelConfig, cache: dict, lengths, new_tokens, *, error=None) -> None:
    """Raise ``error`` (default :class:`CacheError`) naming the first slot whose ``lengths + new_tokens`` exceeds
    :func:`cache_capacity`. ``lengths`` / ``new_tokens`` are host integers per slot (0 new tokens never fails)."""
    cap = cache_capacity(config, cache)
    have = np.asarray(lengths, np.int64)
    add = np.broadcast_to(np.asarray(new_tokens, np.int64), have.shape)
    over = (add > 0) & (have + add > cap)
    if over.any():
        row = int(np.argmax(over))
        raise (error or CacheError)(
            f"slot {row} is full: {int(have[row])} cached + {int(add[row])} new tokens exceed the cache's capacity "
            f"of {cap} tokens (init_cache max_len); start a new sequence there or use a larger cache")


def visible_state(cache: dict, config: ModelConfig, rows=None) -> dict:
    """The parts of a cache that a later step can read, per slot in ``rows`` (default all), as host arrays: the
    lengths and SWA floors, the ring slots holding positions >= 0 (in position order), the compressed entries and
    indexer keys of complete groups, and the partial group's filled rows. Two caches with equal visible states
    decode alike; what differs elsewhere (rows past a slot's length, ring slots of an earlier occupant, the partial
    group's unfilled rows, written with whatever an unfed slot's step computed) is never read."""
    length = np.asarray(cache["length"])
    rows = range(length.shape[0]) if rows is None else rows
    w = config.sliding_window
    out = {"length": length[list(rows)], "floor": np.asarray(cache["floor"])[list(rows)]}
    for layer, ring in enumerate(cache["swa"]):
        ring = np.asarray(PC.read(ring))
        for r in rows:
            p = length[r] - w + np.arange(w)
            out[f"swa{layer}/{r}"] = ring[r][np.mod(p[p >= 0], w)]
    for key, src in cache["sources"].items():
        m = config.compress_ratios[int(key)]
        kv, keys = np.asarray(PC.read(src["kv"])), np.asarray(PC.read(src["keys"]))
        if m > 1:  # read back once per source, not once per row
            buf_kv, buf_gate = np.asarray(src["buf_kv"]), np.asarray(src["buf_gate"])
        for r in rows:
            out[f"{key}/kv/{r}"] = kv[r, :length[r] // m]
            out[f"{key}/keys/{r}"] = keys[r, :length[r] // m]
            if m > 1:
                out[f"{key}/buf/{r}"] = np.concatenate([buf_kv[r, :length[r] % m], buf_gate[r, :length[r] % m]])
    return out


def abstract_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *, packed: bool = False):
    """ShapeDtypeStructs of :func:`init_cache` (nothing allocated)."""
    return jax.eval_shape(lambda: _make_cache(config, batch, max_len, jnp.dtype(dtype), packed))


# ----------------------------------------------------------------------------------------------------------
# Byte accounting
# ----------------------------------------------------------------------------------------------------------

# Bytes per stored vector for each storage format. "release" is the released model's packed layout:
# compressed KV FP4 e2m1 + one e4m3 scale per 16 values, indexer keys FP4 e2m1 + one ue8m0 scale per 32,
# window KV FP8 e4m3 + one ue8m0 scale per 32.
_ITEMSIZE = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def _vector_bytes(dim: int, storage: str, kind: str) -> float:
    if storage == "release":
        if kind == "kv":  # FP4 values + e4m3 scale per 16
            return dim / 2 + dim / 16
        if kind == "keys":  # FP4 values + ue8m0 scale per 32
            return dim / 2 + dim / 32
        if kind == "swa":  # FP8 values + ue8m0 scale per 32
            return dim + dim / 32
        raise CacheError(kind)
    if storage not in _ITEMSIZE:
        raise CacheError(f"unknown storage format {storage!r}; use one of {sorted(_ITEMSIZE)} or 'release'")
    return dim * _ITEMSIZE[storage]


@dataclasses.dataclass(frozen=True)
class CacheFootprint:
    storage: str
    per_token: float  # bytes per context token (compressed KV + indexer keys over all sources)
    entries_per_token: float  # compressed entries per token, summed over sources
    per_source: dict  # layer -> (ratio, bytes per entry main, bytes per entry keys)
    per_sequence_fixed: float  # SWA rings + partial groups + lengths + Engram history, per slot
    batch: int | None = None
    max_len: int | None = None
    allocated: float | None = None  # bytes allocated for batch x max_len

    def describe(self) -> str:
        src = ", ".join(f"L{l} (ratio {m}): {kv:g} B main + {k:g} B keys per entry"
                        for l, (m, kv, k) in self.per_source.items())
        s = (f"KV cache [{self.storage}]: {self.per_token:,.1f} B/token ({self.entries_per_token:g} compressed "
             f"entries/token; {src}); fixed {self.per_sequence_fixed / 1024:,.1f} KiB/sequence "
             f"(SWA rings, partial groups)")
        if self.allocated is not None:
            s += f"; allocated {_human(self.allocated)} for batch {self.batch} x {self.max_len} tokens"
        return s


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f}"


def cache_footprint(config: ModelConfig, storage: str = "bfloat16", *, batch: int | None = None,
                    max_len: int | None = None) -> CacheFootprint:
    """Cache bytes per token for a storage format (``float32`` / ``bfloat16`` / ``release`` = FP4/FP8 packed),
    and, given ``batch`` and ``max_len``, the bytes :func:`init_cache` allocates (same format for every part;
    the partial-group buffers are always float32 and counted as such)."""
    c = config
    storage = str(jnp.dtype(storage)) if storage not in ("release",) and storage not in _ITEMSIZE else storage
    per_source = {}
    per_token = 0.0
    entries = 0.0
    fixed = 8.0  # length + floor (int32 each)
    for layer, m in kv_sources(c):
        kv_b = _vector_bytes(c.head_dim, storage, "kv")
        k_b = _vector_bytes(c.index_head_dim, storage, "keys")
        per_source[layer] = (m, kv_b, k_b)
        per_token += (kv_b + k_b) / m
        entries += 1.0 / m
        if m > 1:
            fixed += 2 * m * c.head_dim * 4  # float32 partial group (kv + gate)
    fixed += c.num_hidden_layers * c.sliding_window * _vector_bytes(c.head_dim, storage, "swa")
    if c.engram_layer_ids:
        fixed += (c.engram_max_ngram_size - 1) * 4  # last n-1 compressed ids (int32)
    allocated = None
    if batch is not None and max_len is not None:
        main = sum(source_entries(c, max_len, m) * (kv + k) for m, kv, k in per_source.values())
        allocated = batch * (main + fixed)
    return CacheFootprint(storage, per_token, entries, per_source, fixed, batch, max_len, allocated)


def cache_bytes_per_token(config: ModelConfig, storage: str = "bfloat16") -> float:
    return cache_footprint(config, storage).per_token


def cache_bytes(config: ModelConfig, batch: int, max_len: int, storage: str = "bfloat16") -> float:
    return cache_footprint(config, storage, batch=batch, max_len=max_len).allocated


def tree_bytes(tree) -> int:
    """Bytes actually held by an (abstract or concrete) pytree of arrays."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


__all__ = ["CacheError", "cache_capacity", "check_capacity", "source_entries", "init_cache", "abstract_cache",
           "visible_state", "kv_sources", "CacheFootprint", "cache_footprint",
           "cache_bytes_per_token", "cache_bytes", "tree_bytes"]
