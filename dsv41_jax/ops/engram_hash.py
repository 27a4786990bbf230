"""Engram n-gram hashing on the host (numpy, exact int64 arithmetic).

Engram row ids depend only on token ids, so they are computed here, outside the
jitted model, and shipped to the device as int32 (SPEC §7).  Doing it on the host
also gives the lookups early enough to prefetch table rows, and avoids needing
64-bit integers on the accelerator (JAX runs with x64 off by default; the hash
multipliers are ~2^45..2^55 and must be multiplied and XOR-ed in 64 bits to
reproduce the released checkpoint's tables).

The maths follows the public HF ``deepseek_v41`` reference (EngramLayout,
compute_hash_multipliers, DeepseekV41NgramHashState); nothing here imports it.

Pipeline for one position ``t`` of one sequence and one engram layer ``l``:

1. Token ids are mapped to *compressed* ids through a tokenizer-derived
   canonical map (``dsv41_jax.tokenizer.compressed_token_map``), so that e.g.
   " The" / "the" / "THE" hash identically.
2. Look-back tokens ``x[t], x[t-1], ..., x[t-(N-1)]`` are gathered.  A look-back
   is *blocked* when it would reach before the sequence start, onto a DEAD
   position (padding, ``valid == False``) or into an earlier packed document
   (different ``segment_id``).  Blocking is sticky: once look-back ``j`` is
   blocked every ``j' > j`` is blocked too.  Blocked look-backs read the pad's
   compressed id.
3. ``products[j] = x[t-j] * m[l, j]`` with per-(layer, look-back) odd
   multipliers; ``rolling = products[0]`` then, for ``i = 1..N-1``,
   ``rolling ^= products[i]`` is the hash of the ``(i+1)``-gram.
4. Each of the ``H`` heads of n-gram ``i+1`` reduces that hash modulo its own
   prime and adds the head's offset in the layer's packed table.

Output column order (per layer): column ``(i-1)*H + h`` holds n-gram order
``i+1`` (i = 1..N-1, i.e. orders 2..N) and head ``h`` — order-major,
head-minor, exactly the reference's ``cat`` order, which is also the order the
embedding rows are concatenated in before ``wkv``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

__all__ = [
    "DEAD",
    "INT64_MAX",
    "is_prime",
    "engram_primes",
    "engram_multipliers",
    "engram_offsets",
    "EngramHashLayout",
    "engram_row_ids",
    "EngramHistory",
    "engram_row_ids_step",
    "DeviceEngramHash",
    "device_engram_hash",
    "device_history",
    "engram_row_ids_step_device",
    "advance_history",
]

#: Marker for "no token here" (before the sequence start or a DEAD/padding
#: position) in compressed-id buffers.  Compressed ids are >= 0, so -1 is free.
DEAD: int = -1

INT64_MAX: int = int(np.iinfo(np.int64).max)

# Seed stride of the per-layer multiplier RNG (the reference seeds
# ``np.random.default_rng(10007 * layer_id)``).
_MULTIPLIER_SEED_STRIDE = 10007

# Miller–Rabin with the first 13 primes as witnesses is deterministic for every
# n < 3.3e24, which covers all 64-bit integers (and far beyond).
_MR_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


# --------------------------------------------------------------------------------------
# Primes
# --------------------------------------------------------------------------------------


def is_prime(n: int) -> bool:
    """Deterministic primality test for any n < 3.3e24 (so every 64-bit integer)."""
    n = int(n)
    if n < 2:
        return False
    for p in _MR_WITNESSES:
        if n % p == 0:
            return n == p
    # n - 1 = d * 2^s with d odd.
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_WITNESSES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False  # a witnesses that n is composite
    return True


def engram_primes(num_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> np.ndarray:
    """Per-(layer, n-gram, head) table sizes: int64 ``[num_layers, max_ngram_size-1, n_heads]``.

    For (layer, order 2..N, head) in that nested order, take the smallest prime
    above ``vocab_size - 1`` (i.e. >= ``vocab_size``) that no earlier
    (layer, order, head) took.  The "used" set is shared across layers, so the
    second engram layer continues where the first stopped: in effect the result is
    the first ``L*(N-1)*H`` consecutive primes >= ``vocab_size``.  (The reference
    restarts each order's search at ``vocab_size - 1`` and skips used primes; that
    yields the same sequence, which is what we compute directly.)

    Only the number of layers matters, not their ids.
    """
    if num_layers < 0 or max_ngram_size < 2 or n_heads < 1 or vocab_size < 1:
        raise ValueError(
            f"need num_layers >= 0, max_ngram_size >= 2, n_heads >= 1, vocab_size >= 1; got "
            f"{num_layers=}, {max_ngram_size=}, {n_heads=}, {vocab_size=}"
        )
    count = num_layers * (max_ngram_size - 1) * n_heads
    primes: list[int] = []
    candidate = vocab_size  # first candidate is (vocab_size - 1) + 1
    while len(primes) < count:
        if is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    if primes and primes[-1] > INT64_MAX:
        raise ValueError("engram primes exceed int64")
    return np.asarray(primes, dtype=np.int64).reshape(num_layers, max_ngram_size - 1, n_heads)


# --------------------------------------------------------------------------------------
# Multipliers and offsets
# --------------------------------------------------------------------------------------


def engram_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """Odd hash multipliers, int64 ``[len(layer_ids), max_ngram_size]`` (one per look-back).

    Each layer draws from its own RNG seeded ``10007 * layer_id`` so the two engram
    layers hash differently.  The draw is bounded by ``(INT64_MAX // V') // 2`` and
    then made odd (``2v + 1``), so ``compressed_id * multiplier`` stays below
    ``INT64_MAX`` for every compressed id < V' — the products never overflow and
    the hash is non-negative.  Because the bound depends on V', the multipliers (and
    hence every table row) depend on the compressed vocabulary size: a tokenizer
    that yields a different V' silently rehashes everything.
    """
    if compressed_vocab_size < 1:
        raise ValueError(f"compressed_vocab_size must be >= 1, got {compressed_vocab_size}")
    bound = max(1, (INT64_MAX // int(compressed_vocab_size)) // 2)
    rows = []
    for layer_id in layer_ids:
        rng = np.random.default_rng(_MULTIPLIER_SEED_STRIDE * int(layer_id))
        draw = rng.integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
        rows.append(draw * 2 + 1)
    if not rows:
        return np.zeros((0, max_ngram_size), dtype=np.int64)
    return np.stack(rows).astype(np.int64)


def engram_offsets(primes: np.ndarray) -> np.ndarray:
    """Exclusive cumulative sum of the primes per layer, int64 ``[L, (N-1)*H]``.

    Each layer has ONE packed table; sub-table (order, head) starts at the sum of
    the sizes of the sub-tables before it in column order, starting from 0 for
    every layer (offsets are per layer, not global).
    """
    flat = np.asarray(primes, dtype=np.int64).reshape(primes.shape[0], -1)
    return np.cumsum(flat, axis=1) - flat


# --------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, dtype=np.int64, copy=True)
    a.setflags(write=False)  # the layout is shared; never let a caller mutate it
    return a


@dataclass(frozen=True, eq=False)
class EngramHashLayout:
    """Everything the hash needs besides the token map, for all engram layers.

    ``layer_ids`` are the model layer indices carrying an Engram (released:
    (1, 14)); index ``l`` in every array below is the position in ``layer_ids``
    (the "slot"), which is also axis 2 of ``engram_row_ids``' output.
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int  # N: n-gram orders 2..N
    n_heads: int  # H: heads per order
    vocab_size: int  # prime search start (config ``engram_vocab_size``), NOT the model vocab
    compressed_vocab_size: int  # V'
    pad_compressed_id: int  # compressed id read by blocked look-backs
    primes: np.ndarray = field(repr=False)  # int64 [L, N-1, H]
    offsets: np.ndarray = field(repr=False)  # int64 [L, (N-1)*H]
    multipliers: np.ndarray = field(repr=False)  # int64 [L, N]
    rows_per_layer: tuple[int, ...] = ()  # packed table size per layer (= sum of its primes)

    @classmethod
    def build(
        cls,
        layer_ids: Sequence[int],
        max_ngram_size: int,
        n_heads: int,
        vocab_size: int,
        compressed_vocab_size: int,
        pad_compressed_id: int,
    ) -> "EngramHashLayout":
        """Derive primes, offsets and multipliers from the config values.

        ``pad_compressed_id`` is the compressed id of the model's pad token
        (``token_map[engram_pad_id]``), not the raw pad token id.
        """
        layer_ids = tuple(int(i) for i in layer_ids)
        primes = engram_primes(len(layer_ids), max_ngram_size, n_heads, vocab_size)
        return cls(
            layer_ids=layer_ids,
            max_ngram_size=int(max_ngram_size),
            n_heads=int(n_heads),
            vocab_size=int(vocab_size),
            compressed_vocab_size=int(compressed_vocab_size),
            pad_compressed_id=int(pad_compressed_id),
            primes=primes,
            offsets=engram_offsets(primes),
            multipliers=engram_multipliers(layer_ids, max_ngram_size, compressed_vocab_size),
        )

    def __post_init__(self) -> None:
        L, N, H = len(self.layer_ids), self.max_ngram_size, self.n_heads
        if N < 2 or H < 1:
            raise ValueError(f"max_ngram_size must be >= 2 and n_heads >= 1, got {N=}, {H=}")
        if not 0 <= self.pad_compressed_id < self.compressed_vocab_size:
            raise ValueError(
                f"pad_compressed_id {self.pad_compressed_id} outside [0, {self.compressed_vocab_size})"
            )
        for name, shape in (("primes", (L, N - 1, H)), ("offsets", (L, (N - 1) * H)), ("multipliers", (L, N))):
            arr = np.asarray(getattr(self, name))
            if arr.shape != shape:
                raise ValueError(f"EngramHashLayout.{name} has shape {arr.shape}, expected {shape}")
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"EngramHashLayout.{name} must be an integer array, got {arr.dtype}")
            object.__setattr__(self, name, _frozen(arr))
        if np.any(self.primes <= 0):
            raise ValueError("EngramHashLayout.primes must be positive")
        rows = tuple(int(r) for r in self.primes.reshape(L, -1).sum(axis=1))
        if self.rows_per_layer and tuple(self.rows_per_layer) != rows:
            raise ValueError(f"rows_per_layer {self.rows_per_layer} != per-layer prime sums {rows}")
        object.__setattr__(self, "rows_per_layer", rows)
        # Row ids go to the device as int32.
        if rows and max(rows) > np.iinfo(np.int32).max + 1:
            raise ValueError(f"an engram table has {max(rows)} rows; int32 row ids cannot address it")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def num_columns(self) -> int:
        """Row ids per position per layer: (N-1) * H (released: 24)."""
        return (self.max_ngram_size - 1) * self.n_heads


# --------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------


def _as_int_array(x, name: str, ndim: int) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    return a.astype(np.int64, copy=False)


def _check_token_map(token_map, layout: EngramHashLayout) -> np.ndarray:
    tm = _as_int_array(token_map, "token_map", 1)
    if tm.size == 0:
        raise ValueError("token_map is empty")
    lo, hi = int(tm.min()), int(tm.max())
    if lo < 0 or hi >= layout.compressed_vocab_size:
        bad = int(np.flatnonzero((tm < 0) | (tm >= layout.compressed_vocab_size))[0])
        raise ValueError(
            f"token_map[{bad}] = {int(tm[bad])} is outside the compressed vocabulary "
            f"[0, {layout.compressed_vocab_size})"
        )
    return tm


def _prepare(
    token_ids, token_map: np.ndarray, valid, segment_ids, default_segment: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Compressed ids (DEAD where not valid) and segment ids for a [B, S] block."""
    ids = _as_int_array(token_ids, "token_ids", 2)
    B, S = ids.shape
    if valid is None:
        live = np.ones((B, S), dtype=bool)
    else:
        live = np.asarray(valid)
        if live.dtype != np.bool_:
            raise ValueError(f"valid must be a bool array, got dtype {live.dtype}")
        if live.shape != (B, S):
            raise ValueError(f"valid has shape {live.shape}, expected {(B, S)}")
    if segment_ids is None:
        seg = np.broadcast_to(default_segment[:, None], (B, S)).astype(np.int64)
    else:
        seg = _as_int_array(segment_ids, "segment_ids", 2)
        if seg.shape != (B, S):
            raise ValueError(f"segment_ids has shape {seg.shape}, expected {(B, S)}")
    # Ids of DEAD positions are never looked up (padding may carry any value, e.g. -1).
    V = token_map.shape[0]
    bad = live & ((ids < 0) | (ids >= V))
    if bad.any():
        b, t = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"token id {int(ids[b, t])} at (batch {b}, position {t}) is outside the token map's "
            f"range [0, {V})"
        )
    compressed = np.where(live, token_map[np.where(live, ids, 0)], DEAD)
    return compressed, seg


# --------------------------------------------------------------------------------------
# Hash core
# --------------------------------------------------------------------------------------


def _hash_block(ext_tokens: np.ndarray, ext_segments: np.ndarray, layout: EngramHashLayout) -> np.ndarray:
    """Row ids for the last S positions of ``ext`` ([B, (N-1)+S]).

    The first N-1 columns of ``ext_tokens``/``ext_segments`` are look-back context
    only (earlier positions, DEAD where there is none); they get no output.
    """
    N = layout.max_ngram_size
    K = N - 1
    S = ext_tokens.shape[1] - K
    cur_seg = ext_segments[:, K:]
    blocked = np.zeros(cur_seg.shape, dtype=bool)
    lookback = []
    for j in range(N):
        src = ext_tokens[:, K - j : K - j + S]
        src_seg = ext_segments[:, K - j : K - j + S]
        # Sticky: a DEAD slot or a document boundary at look-back j blocks j and
        # everything further back, so an n-gram never spans padding or documents.
        blocked = blocked | (src == DEAD) | (src_seg != cur_seg)
        lookback.append(np.where(blocked, layout.pad_compressed_id, src))
    tokens = np.stack(lookback, axis=-1)  # [B, S, N] int64

    # [B, S, 1, N] * [L, N] -> [B, S, L, N].  numpy int64 array arithmetic wraps
    # modulo 2^64 like torch's (no overflow occurs with the derived multipliers,
    # but a hand-made layout must still hash like the reference).
    products = tokens[:, :, None, :] * layout.multipliers
    rolling = products[..., 0]
    per_order = []
    for i in range(1, N):
        rolling = rolling ^ products[..., i]  # hash of the (i+1)-gram, [B, S, L]
        # Floor modulo (numpy and torch agree; the sign follows the positive prime).
        per_order.append(rolling[..., None] % layout.primes[:, i - 1, :])  # [B, S, L, H]
    rows = np.concatenate(per_order, axis=-1) + layout.offsets  # [B, S, L, (N-1)*H]
    return rows.astype(np.int32)


def engram_row_ids(
    token_ids,
    token_map,
    layout: EngramHashLayout,
    *,
    valid=None,
    segment_ids=None,
) -> np.ndarray:
    """Engram table row ids, int32 ``[B, T, L, (N-1)*H]``, for whole sequences.

    Args:
      token_ids: int ``[B, T]`` raw token ids; each sequence starts at index 0.
      token_map: int ``[V]`` raw id -> compressed id (``compressed_token_map``).
      layout: the ``EngramHashLayout``.
      valid: optional bool ``[B, T]``; False marks left/right padding (or any
        position to ignore).  Such positions are DEAD: no real token's n-gram reads
        them (look-back stops there), and their own row ids are those of an
        all-pad n-gram (the reference hashes them that way; the model should
        still gate them off).  Their token ids are not looked up or validated.
      segment_ids: optional int ``[B, T]`` document ids for packed sequences; a
        look-back never reaches a position with a different segment id than the
        current token (a document start acts like a sequence start).

    Column ``(i-1)*H + h`` of axis 3 is n-gram order ``i+1`` (orders 2..N), head
    ``h``; axis 2 follows ``layout.layer_ids``.  Row ids index each layer's own
    packed table (``0 <= id < layout.rows_per_layer[l]``).

    Raises:
      ValueError: malformed shapes/dtypes, or a (valid) token id outside
        ``[0, len(token_map))`` — the message names the value and its position.
    """
    tm = _check_token_map(token_map, layout)
    ids = _as_int_array(token_ids, "token_ids", 2)
    B = ids.shape[0]
    compressed, seg = _prepare(ids, tm, valid, segment_ids, np.zeros((B,), np.int64))
    history = EngramHistory.empty(B, layout.max_ngram_size)
    ext_tokens = np.concatenate([history.tokens, compressed], axis=1)
    ext_segments = np.concatenate([history.segments, seg], axis=1)
    return _hash_block(ext_tokens, ext_segments, layout)


# --------------------------------------------------------------------------------------
# Incremental form (decode / chunked prefill)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class EngramHistory:
    """Look-back state of a batch of sequences between hashing calls.

    Only the last N-1 positions can influence future n-grams, so that is all we
    keep (unlike the reference's absolute-position buffer, which grows with the
    sequence).

    tokens:        int64 ``[B, N-1]`` compressed ids of the last N-1 positions,
                   oldest first; ``DEAD`` (-1) for positions that do not exist
                   (before the start) or were DEAD (padding).
    segments:      int64 ``[B, N-1]`` their segment ids (the newest one is also
                   the default segment of the next chunk when none is given).
    num_positions: int64 ``[B]`` positions consumed so far (valid or not).
    num_valid:     int64 ``[B]`` real (valid) tokens consumed so far.
    """

    tokens: np.ndarray
    segments: np.ndarray
    num_positions: np.ndarray
    num_valid: np.ndarray

    @classmethod
    def empty(cls, batch_size: int, max_ngram_size: int) -> "EngramHistory":
        """State of B sequences that have not started yet."""
        K = max_ngram_size - 1
        return cls(
            tokens=np.full((batch_size, K), DEAD, dtype=np.int64),
            segments=np.zeros((batch_size, K), dtype=np.int64),
            num_positions=np.zeros((batch_size,), dtype=np.int64),
            num_valid=np.zeros((batch_size,), dtype=np.int64),
        )

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])


def engram_row_ids_step(
    new_token_ids,
    history: EngramHistory,
    token_map,
    layout: EngramHashLayout,
    *,
    valid=None,
    segment_ids=None,
) -> tuple[np.ndarray, EngramHistory]:
    """Row ids for S new tokens per sequence, continuing from ``history``.

    Returns ``(row_ids int32 [B, S, L, (N-1)*H], new_history)``.  Feeding a
    sequence in any chunking (prefill chunks, then S=1 decode steps) gives exactly
    ``engram_row_ids`` of the concatenated sequence, with the same meaning of
    ``valid`` and ``segment_ids``.  When ``segment_ids`` is None the new tokens
    continue the segment of the newest history position.  ``history`` is not
    modified.
    """
    tm = _check_token_map(token_map, layout)
    ids = _as_int_array(new_token_ids, "new_token_ids", 2)
    B = ids.shape[0]
    K = layout.max_ngram_size - 1
    if history.tokens.shape != (B, K) or history.segments.shape != (B, K):
        raise ValueError(
            f"history holds tokens {history.tokens.shape} / segments {history.segments.shape}, "
            f"expected {(B, K)} for batch {B} and max_ngram_size {layout.max_ngram_size}"
        )
    compressed, seg = _prepare(ids, tm, valid, segment_ids, history.segments[:, -1])
    ext_tokens = np.concatenate([history.tokens, compressed], axis=1)
    ext_segments = np.concatenate([history.segments, seg], axis=1)
    rows = _hash_block(ext_tokens, ext_segments, layout)
    live_count = (compressed != DEAD).sum(axis=1)
    new_history = EngramHistory(
        tokens=ext_tokens[:, ext_tokens.shape[1] - K :].copy(),
        segments=ext_segments[:, ext_segments.shape[1] - K :].copy(),
        num_positions=history.num_positions + ids.shape[1],
        num_valid=history.num_valid + live_count,
    )
    return rows, new_history


# --------------------------------------------------------------------------------------
# The decode step's hash on the device (32-bit arithmetic, bit-identical)
# --------------------------------------------------------------------------------------
#
# A decode step hashes one new token per sequence. Doing that on the host forces the
# sampled token back to the host before the next step can be dispatched; on the device
# the step can feed its own sample to the next one. JAX runs with 64-bit integers off,
# so the int64 arithmetic above is carried out on (hi, lo) pairs of uint32 words:
#
# * ``compressed_id * multiplier mod 2^64``: the id is < 2^31, so the low word's 32 x 32
#   product is formed from 16-bit halves (every partial product fits 32 bits) and the
#   high word adds ``id * multiplier_hi mod 2^32``;
# * XOR is word-wise;
# * the floor modulo by a prime p < 2^31 runs Horner's rule over w-bit chunks of the
#   64-bit value, most significant first, with w chosen so that ``r * 2^w + chunk``
#   (r < p) stays below 2^32; a negative int64 (top bit set) is ``x_u - 2^64``, so its
#   floor modulo is ``(x_u mod p - 2^64 mod p) mod p``.


@dataclass(frozen=True, eq=False)
class DeviceEngramHash:
    """The hash constants as device arrays (a pytree; ``pad`` and ``chunk_bits`` are static).

    token_map int32 [V]; mult_hi / mult_lo uint32 [L, N]; primes and two64_mod (2^64 mod p)
    uint32 [L, N-1, H]; offsets int32 [L, (N-1)*H].
    """

    token_map: object
    mult_hi: object
    mult_lo: object
    primes: object
    two64_mod: object
    offsets: object
    pad: int
    chunk_bits: int

    @property
    def max_ngram_size(self) -> int:
        return int(self.mult_hi.shape[1])


def _flatten_device_hash(t: DeviceEngramHash):
    return (t.token_map, t.mult_hi, t.mult_lo, t.primes, t.two64_mod, t.offsets), (t.pad, t.chunk_bits)


def _unflatten_device_hash(aux, leaves) -> DeviceEngramHash:
    return DeviceEngramHash(*leaves, *aux)


def _register_pytree() -> None:
    import jax

    jax.tree_util.register_pytree_node(DeviceEngramHash, _flatten_device_hash, _unflatten_device_hash)


_register_pytree()


def device_engram_hash(token_map, layout: EngramHashLayout) -> DeviceEngramHash:
    """The device form of ``layout`` and ``token_map`` (checked like the host hash's)."""
    import jax.numpy as jnp

    tm = _check_token_map(token_map, layout)
    if layout.compressed_vocab_size > 2**31:
        raise ValueError(f"compressed_vocab_size {layout.compressed_vocab_size} does not fit int32 device ids")
    primes = layout.primes.astype(np.int64)
    if primes.max(initial=2) >= 2**31:
        raise ValueError(f"an engram prime ({int(primes.max())}) is >= 2^31; the device hash needs primes < 2^31")
    # Largest w with p * 2^w <= 2^32 for every prime (p < 2^bitlen(p)); at most 31.
    chunk_bits = int(min(32 - int(p).bit_length() for p in primes.reshape(-1))) if primes.size else 16
    words = layout.multipliers.astype(np.int64).view(np.uint64)
    two64 = np.asarray([[[(1 << 64) % int(p) for p in hs] for hs in orders] for orders in primes], np.uint32)
    return DeviceEngramHash(
        token_map=jnp.asarray(tm.astype(np.int32)),
        mult_hi=jnp.asarray((words >> np.uint64(32)).astype(np.uint32)),
        mult_lo=jnp.asarray((words & np.uint64(0xFFFFFFFF)).astype(np.uint32)),
        primes=jnp.asarray(primes.astype(np.uint32)),
        two64_mod=jnp.asarray(two64.reshape(primes.shape)),
        offsets=jnp.asarray(layout.offsets.astype(np.int32)),
        pad=int(layout.pad_compressed_id),
        chunk_bits=chunk_bits,
    )


def device_history(history: EngramHistory):
    """The device look-back of ``history`` for decoding (new tokens continue the newest segment): int32 [B, N-1]
    compressed ids, oldest first, ``DEAD`` where the look-back is blocked (no token, padding, or an earlier
    segment than the newest position's). Blocking is sticky, so a blocked entry blocks everything older."""
    tokens = np.asarray(history.tokens, np.int64)
    segments = np.asarray(history.segments, np.int64)
    live = (tokens != DEAD) & (segments == segments[:, -1:])
    return np.where(live, tokens, DEAD).astype(np.int32)


def advance_history(history: EngramHistory, token_map, new_tokens, active=None) -> EngramHistory:
    """The host look-back after one decode step hashed on the device: each active row appends its token's compressed
    id (continuing its newest segment), inactive rows keep theirs. Equal to the history ``engram_row_ids_step``
    returns for one valid token per row, without computing any hash (the rows come from
    ``engram_row_ids_step_device``)."""
    tokens = _as_int_array(new_tokens, "new_tokens", 1)
    b, k = history.tokens.shape
    if tokens.shape != (b,):
        raise ValueError(f"new_tokens has shape {tokens.shape}, expected ({b},) for the history's batch")
    live = np.ones((b,), bool) if active is None else np.asarray(active, bool)
    tm = np.asarray(token_map)
    bad = live & ((tokens < 0) | (tokens >= tm.shape[0]))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(f"token id {int(tokens[row])} (row {row}) is outside the token map's range [0, {tm.shape[0]})")
    compressed = tm[np.where(live, tokens, 0)].astype(np.int64)
    keep = live[:, None]
    if k == 0:
        shifted_t, shifted_s = history.tokens, history.segments
    else:
        shifted_t = np.concatenate([history.tokens[:, 1:], compressed[:, None]], axis=1)
        shifted_s = np.concatenate([history.segments[:, 1:], history.segments[:, -1:]], axis=1)
    step = live.astype(np.int64)
    return EngramHistory(tokens=np.where(keep, shifted_t, history.tokens),
                         segments=np.where(keep, shifted_s, history.segments),
                         num_positions=history.num_positions + step, num_valid=history.num_valid + step)


def _mul_u64_by_u32(t, hi, lo):
    """(t * (hi * 2^32 + lo)) mod 2^64 as (hi, lo) uint32 words; t uint32."""
    import jax.numpy as jnp

    m16 = jnp.uint32(0xFFFF)
    t0, t1 = t & m16, t >> 16
    a0, a1 = lo & m16, lo >> 16
    p00, p01, p10, p11 = t0 * a0, t0 * a1, t1 * a0, t1 * a1
    mid = (p00 >> 16) + (p01 & m16) + (p10 & m16)  # < 3 * 2^16
    out_lo = (mid << 16) | (p00 & m16)
    out_hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16) + t * hi  # wraps mod 2^32
    return out_hi, out_lo


def _floor_mod_i64(hi, lo, p, two64_mod, w: int):
    """Floor modulo of the int64 (hi, lo) by p (uint32, < 2^31): Horner over w-bit chunks (p * 2^w <= 2^32)."""
    import jax.numpy as jnp

    r = jnp.zeros(jnp.broadcast_shapes(hi.shape, p.shape), jnp.uint32)
    top = 64
    while top > 0:
        width = min(w, top)
        bottom = top - width
        # bits [bottom, top) of the 64-bit value
        if bottom >= 32:
            chunk = (hi >> (bottom - 32)) & jnp.uint32((1 << width) - 1)
        elif top <= 32:
            chunk = (lo >> bottom) & jnp.uint32((1 << width) - 1)
        else:  # straddles the words
            chunk = ((hi & jnp.uint32((1 << (top - 32)) - 1)) << (32 - bottom)) | (lo >> bottom)
        r = ((r << width) | chunk) % p if width < 32 else chunk % p
        top = bottom
    negative = (hi >> 31) == 1
    return jnp.where(negative, (r + p - two64_mod) % p, r)


def engram_row_ids_step_device(tables: DeviceEngramHash, history, new_tokens, active=None):
    """One decode step of the hash on the device: ``history`` int32 [B, N-1] (``device_history``), ``new_tokens``
    int [B] raw ids (clipped into the token map: every caller feeds sampled ids), ``active`` bool [B] (inactive
    rows keep their history). Returns ``(row_ids int32 [B, L, (N-1)*H], new_history)``, bit-identical to
    ``engram_row_ids_step`` of one valid token continuing the newest segment."""
    import jax.numpy as jnp

    n = tables.max_ngram_size
    k = n - 1
    compressed = jnp.take(tables.token_map, new_tokens.astype(jnp.int32), mode="clip")  # [B]
    src = jnp.concatenate([compressed[:, None], history[:, ::-1]], axis=1)  # look-back j = 0..N-1
    blocked = jnp.cumsum((src == DEAD).astype(jnp.int32), axis=1) > 0  # sticky
    look = jnp.where(blocked, tables.pad, src).astype(jnp.uint32)  # [B, N]
    hi, lo = _mul_u64_by_u32(look[:, None, :], tables.mult_hi[None], tables.mult_lo[None])  # [B, L, N]
    r_hi, r_lo = hi[..., 0], lo[..., 0]
    per_order = []
    for i in range(1, n):
        r_hi, r_lo = r_hi ^ hi[..., i], r_lo ^ lo[..., i]  # hash of the (i+1)-gram, [B, L]
        per_order.append(_floor_mod_i64(r_hi[..., None], r_lo[..., None], tables.primes[None, :, i - 1],
                                        tables.two64_mod[None, :, i - 1], tables.chunk_bits))  # [B, L, H]
    rows = jnp.concatenate(per_order, axis=-1).astype(jnp.int32) + tables.offsets[None]
    new_history = jnp.concatenate([history[:, 1:], compressed[:, None]], axis=1) if k > 1 else compressed[:, None]
    if active is not None:
        new_history = jnp.where(active[:, None], new_history, history)
    return rows, new_history
