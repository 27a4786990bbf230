"""Engram host-side hashing and the compressed token map.

The row-id oracle here is an independent pure-Python big-integer implementation
(Python ints with explicit two's-complement 64-bit wraparound, no numpy), per
SPEC §11.3.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import numpy as np
import pytest

from dsv41_jax.ops.engram_hash import (
    DEAD,
    EngramHashLayout,
    EngramHistory,
    engram_multipliers,
    engram_primes,
    engram_row_ids,
    engram_row_ids_step,
    device_engram_hash,
    device_history,
    engram_row_ids_step_device,
    advance_history,
    is_prime,
)
from dsv41_jax.tokenizer import ByteTokenizer, HFTokenizer, compressed_token_map, load_tokenizer

FIXTURE_ROOT = os.path.join(os.path.dirname(__file__), "fixtures", "hf_v41")

# ----------------------------------------------------------------------------------------
# Independent oracle
# ----------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def _wrap64(x: int) -> int:
    """Python int -> the signed int64 a torch/numpy int64 op would produce."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _trial_division_is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    d = 3
    while d * d <= n:
        if n % d == 0:
            return False
        d += 2
    return True


def py_row_ids(ids, token_map, primes, multipliers, pad, valid, segments):
    """Reference row ids as nested lists [B][T][L][(N-1)*H] (pure Python ints)."""
    L = len(primes)
    N = len(multipliers[0])
    out = []
    for b in range(len(ids)):
        row_b = []
        for t in range(len(ids[b])):
            row_t = []
            # Look-back tokens with sticky blocking (start, DEAD, other document).
            toks, blocked = [], False
            for j in range(N):
                s = t - j
                if s < 0 or not valid[b][s] or segments[b][s] != segments[b][t]:
                    blocked = True
                toks.append(pad if blocked else token_map[ids[b][s]])
            for l in range(L):
                flat_primes = [p for order in primes[l] for p in order]
                cols = []
                rolling = _wrap64(toks[0] * multipliers[l][0])
                for i in range(1, N):
                    rolling = _wrap64(rolling ^ _wrap64(toks[i] * multipliers[l][i]))
                    for h, p in enumerate(primes[l][i - 1]):
                        c = (i - 1) * len(primes[l][i - 1]) + h
                        cols.append(rolling % p + sum(flat_primes[:c]))  # floor mod, like torch
                row_t.append(cols)
            row_b.append(row_t)
        out.append(row_b)
    return out


def _random_case(rng, B, T, V, Vc):
    token_map = rng.integers(0, Vc, size=V)
    token_map[: min(Vc, V)] = np.arange(min(Vc, V))  # every compressed id used
    ids = rng.integers(0, V, size=(B, T))
    valid = np.ones((B, T), dtype=bool)
    for b in range(B):
        left, right = rng.integers(0, 4), rng.integers(0, 4)
        valid[b, :left] = False
        valid[b, T - right :] = False
        if rng.random() < 0.5:  # a hole in the middle
            valid[b, rng.integers(0, T)] = False
    ids[~valid] = rng.choice([-7, 10**9, 0], size=int((~valid).sum()))  # garbage at DEAD slots
    segments = np.cumsum(rng.random((B, T)) < 0.15, axis=1)  # packed documents
    return ids, token_map, valid, segments


def _check_against_oracle(layout, ids, token_map, valid, segments):
    got = engram_row_ids(ids, token_map, layout, valid=valid, segment_ids=segments)
    want = py_row_ids(
        ids.tolist(),
        token_map.tolist(),
        layout.primes.tolist(),
        layout.multipliers.tolist(),
        layout.pad_compressed_id,
        valid.tolist(),
        segments.tolist(),
    )
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.array(want, dtype=np.int64))
    return got


TINY = dict(layer_ids=(1, 4), max_ngram_size=4, n_heads=2, vocab_size=101, compressed_vocab_size=256, pad_compressed_id=1)


# ----------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------


def test_miller_rabin_matches_trial_division_and_known_cases():
    for n in range(-3, 20000):
        assert is_prime(n) == _trial_division_is_prime(n), n
    assert is_prime(2**61 - 1) and is_prime(2**64 - 59) and is_prime(2**63 - 25)
    # Strong pseudoprimes to many small bases, and a Carmichael number.
    for composite in (3215031751, 2152302898747, 3474749660383, 341550071728321, 3825123056546413051, 561, 2**64 - 1):
        assert not is_prime(composite), composite
    assert not is_prime(318665857834031151167461)  # strong pseudoprime to bases 2..37 (> 2^64)


def test_tiny_layout_matches_reference_notes():
    layout = EngramHashLayout.build(**TINY)
    assert layout.primes.tolist() == [[[101, 103], [107, 109], [113, 127]], [[131, 137], [139, 149], [151, 157]]]
    assert layout.offsets.tolist() == [[0, 101, 204, 311, 420, 533], [0, 131, 268, 407, 556, 707]]
    assert layout.multipliers.tolist() == [
        [29662608052400909, 1873410163432121, 13919202536988139, 28638879857136817],
        [31841131192811251, 1950019090429101, 28509641033320619, 7337012813361983],
    ]
    assert layout.rows_per_layer == (660, 864)
    assert layout.num_columns == 6
    assert not layout.primes.flags.writeable


def test_released_layout_row_totals():
    layout = EngramHashLayout.build((1, 14), 4, 8, 16_000_000, 99092, 2)
    assert layout.primes.shape == (2, 3, 8)
    assert layout.rows_per_layer == (384_006_168, 384_016_682)  # SPEC §1
    flat = layout.primes.reshape(-1).tolist()
    # Consecutive primes from 16,000,000: each is prime, none skipped in between.
    assert all(_trial_division_is_prime(p) for p in flat)
    assert not any(_trial_division_is_prime(n) for n in range(16_000_000, flat[-1]) if n not in set(flat))
    assert flat == sorted(flat) and flat[0] >= 16_000_000
    # Products of any compressed id with any multiplier fit in int64.
    assert int(layout.multipliers.max()) * (99092 - 1) < 2**63
    assert np.all(layout.multipliers % 2 == 1)
    assert max(layout.rows_per_layer) < 2**31


def test_primes_independent_of_layer_ids_and_shared_across_layers():
    a = engram_primes(3, 3, 2, 50)
    assert a.reshape(-1).tolist() == [53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101, 103]
    assert engram_multipliers((0,), 2, 5).shape == (1, 2)


# ----------------------------------------------------------------------------------------
# Row ids == pure-Python oracle
# ----------------------------------------------------------------------------------------


def test_row_ids_match_big_int_oracle_tiny_layout():
    rng = np.random.default_rng(0)
    layout = EngramHashLayout.build(**TINY)
    ids, token_map, valid, segments = _random_case(rng, B=3, T=29, V=300, Vc=256)
    got = _check_against_oracle(layout, ids, token_map, valid, segments)
    assert got.shape == (3, 29, 2, 6)
    for l, rows in enumerate(layout.rows_per_layer):
        assert got[:, :, l].min() >= 0 and got[:, :, l].max() < rows


def test_row_ids_match_big_int_oracle_released_sizes():
    rng = np.random.default_rng(1)
    layout = EngramHashLayout.build((1, 14), 4, 8, 16_000_000, 99092, 2)
    ids, token_map, valid, segments = _random_case(rng, B=2, T=17, V=129280, Vc=99092)
    _check_against_oracle(layout, ids, token_map, valid, segments)


def test_row_ids_match_oracle_with_wrapping_multipliers():
    # Multipliers beyond the derived bound overflow int64 and produce negative
    # hashes: we must wrap and floor-mod exactly like torch int64.
    rng = np.random.default_rng(2)
    base = EngramHashLayout.build(layer_ids=(0, 3, 7), max_ngram_size=5, n_heads=3, vocab_size=1000,
                                  compressed_vocab_size=40, pad_compressed_id=5)
    huge = rng.integers(2**62, 2**63 - 1, size=base.multipliers.shape, dtype=np.int64) | 1
    layout = dataclasses.replace(base, multipliers=huge, rows_per_layer=())
    ids, token_map, valid, segments = _random_case(rng, B=2, T=21, V=64, Vc=40)
    _check_against_oracle(layout, ids, token_map, valid, segments)


def test_defaults_mean_one_live_document_from_position_zero():
    rng = np.random.default_rng(3)
    layout = EngramHashLayout.build(**TINY)
    ids = rng.integers(0, 256, size=(2, 9))
    token_map = np.arange(256)
    full = engram_row_ids(ids, token_map, layout)
    explicit = engram_row_ids(ids, token_map, layout, valid=np.ones((2, 9), bool), segment_ids=np.full((2, 9), 4))
    np.testing.assert_array_equal(full, explicit)
    # At t=0 every look-back but the token itself is the pad: the 2-gram hash of
    # (x0, pad) must equal an explicit (x0, pad) pair.
    pad = layout.pad_compressed_id
    pair = engram_row_ids(np.array([[pad, ids[0, 0]]]), token_map, layout)
    np.testing.assert_array_equal(full[0, 0, :, :2], pair[0, 1, :, :2])


def test_padding_never_leaks_into_real_tokens():
    rng = np.random.default_rng(4)
    layout = EngramHashLayout.build(**TINY)
    token_map = rng.integers(0, 256, size=400)
    real = rng.integers(0, 400, size=(1, 11))
    clean = engram_row_ids(real, token_map, layout)
    for left, right in [(3, 0), (0, 4), (5, 2)]:
        ids = np.concatenate([rng.integers(0, 400, (1, left)), real, rng.integers(0, 400, (1, right))], axis=1)
        valid = np.zeros(ids.shape, bool)
        valid[:, left : left + 11] = True
        got = engram_row_ids(ids, token_map, layout, valid=valid)
        np.testing.assert_array_equal(got[:, left : left + 11], clean)
        # DEAD positions hash as an all-pad n-gram, whatever id they carry.
        all_pad = engram_row_ids(np.zeros((1, 1), np.int64), np.full(400, layout.pad_compressed_id), layout)
        for t in np.flatnonzero(~valid[0]):
            np.testing.assert_array_equal(got[0, t], all_pad[0, 0])


def test_segments_act_like_sequence_starts():
    rng = np.random.default_rng(5)
    layout = EngramHashLayout.build(**TINY)
    token_map = np.arange(256)
    a, b = rng.integers(0, 256, (1, 7)), rng.integers(0, 256, (1, 5))
    packed = engram_row_ids(np.concatenate([a, b], 1), token_map, layout,
                            segment_ids=np.array([[0] * 7 + [1] * 5]))
    np.testing.assert_array_equal(packed[:, :7], engram_row_ids(a, token_map, layout))
    np.testing.assert_array_equal(packed[:, 7:], engram_row_ids(b, token_map, layout))


# ----------------------------------------------------------------------------------------
# Incremental == full
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_incremental_equals_full(seed):
    rng = np.random.default_rng(100 + seed)
    layout = EngramHashLayout.build(layer_ids=(2, 5), max_ngram_size=4, n_heads=3, vocab_size=200,
                                    compressed_vocab_size=30, pad_compressed_id=3)
    B, T = 3, 40
    ids, token_map, valid, segments = _random_case(rng, B=B, T=T, V=45, Vc=30)
    use_seg = seed % 2 == 0
    full = engram_row_ids(ids, token_map, layout, valid=valid, segment_ids=segments if use_seg else None)

    # Random chunking: a few prefill chunks (some of length 0 or 1), then decode steps.
    cuts = sorted(set(rng.integers(0, T - 5, size=4).tolist())) + list(range(T - 5, T + 1))
    cuts = [0] + cuts
    hist = EngramHistory.empty(B, layout.max_ngram_size)
    parts = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        rows, hist = engram_row_ids_step(ids[:, lo:hi], hist, token_map, layout, valid=valid[:, lo:hi],
                                         segment_ids=segments[:, lo:hi] if use_seg else None)
        assert rows.shape == (B, hi - lo, 2, 9)
        parts.append(rows)
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), full)
    assert hist.num_positions.tolist() == [T] * B
    assert hist.num_valid.tolist() == valid.sum(1).tolist()
    # The history holds the last N-1 compressed ids, DEAD where padding.
    want_tail = np.where(valid[:, -3:], token_map[np.where(valid[:, -3:], ids[:, -3:], 0)], DEAD)
    np.testing.assert_array_equal(hist.tokens, want_tail)


def test_step_does_not_mutate_history():
    layout = EngramHashLayout.build(**TINY)
    hist = EngramHistory.empty(1, 4)
    _, new = engram_row_ids_step(np.array([[5, 6]]), hist, np.arange(256), layout)
    assert hist.tokens.tolist() == [[DEAD] * 3] and new.tokens.tolist() == [[DEAD, 5, 6]]


# ----------------------------------------------------------------------------------------
# The decode step's hash on the device (uint32 words) == the host's int64 hash
# ----------------------------------------------------------------------------------------


def _device_layouts(rng):
    base = EngramHashLayout.build(layer_ids=(0, 3, 7), max_ngram_size=5, n_heads=3, vocab_size=1000,
                                  compressed_vocab_size=40, pad_compressed_id=5)
    shape = base.multipliers.shape
    return [
        ("released", EngramHashLayout.build((1, 14), 4, 8, 16_000_000, 99092, 2), 129280),
        ("tiny", EngramHashLayout.build(**TINY), 300),
        ("bigrams only", EngramHashLayout.build((2,), 2, 3, 50, 17, 16), 20),
        # products that overflow int64 and XORs with the sign bit set: wrapped, floor-mod of negative hashes
        ("wrapping", dataclasses.replace(base, multipliers=rng.integers(2**62, 2**63 - 1, shape, np.int64) | 1,
                                         rows_per_layer=()), 64),
        ("negative", dataclasses.replace(base, multipliers=rng.integers(-2**63, 2**63 - 1, shape, np.int64) | 1,
                                         rows_per_layer=()), 64),
        # primes just below 2^30: the modulo's Horner chunks shrink to 2 bits
        ("primes near 2^30", EngramHashLayout.build((2,), 2, 2, 2**30 - 100, 1000, 3), 1000),
    ]


def test_device_step_hash_equals_the_host_hash():
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(7)
    step = jax.jit(engram_row_ids_step_device)
    for name, layout, V in _device_layouts(rng):
        vc = layout.compressed_vocab_size
        token_map = rng.integers(0, vc, size=V)
        token_map[:4] = [0, vc - 1, layout.pad_compressed_id, vc - 1]  # boundary compressed ids, the pad's id
        token_map[-1] = vc - 1
        tables = device_engram_hash(token_map, layout)
        B = 48
        # histories: empty, shorter than N-1, padding holes, documents starting just before the new token
        T = int(rng.integers(0, 2 * layout.max_ngram_size))
        ids = rng.integers(0, V, size=(B, T))
        valid = rng.random((B, T)) > 0.25
        segments = np.cumsum(rng.random((B, T)) < 0.25, axis=1)
        _, hist = engram_row_ids_step(ids, EngramHistory.empty(B, layout.max_ngram_size), token_map, layout,
                                      valid=valid, segment_ids=segments)
        dev = jnp.asarray(device_history(hist))
        for _ in range(layout.max_ngram_size + 1):  # until every row's look-back is all decoded tokens
            new = rng.integers(0, V, size=B)
            new[:4] = [0, V - 1, 2, 3]
            active = rng.random(B) > 0.2
            want, after = engram_row_ids_step(new[:, None], hist, token_map, layout)
            got, dev_after = step(tables, dev, jnp.asarray(new, jnp.int32), jnp.asarray(active))
            np.testing.assert_array_equal(np.asarray(got)[active], want[active, 0], err_msg=name)
            keep = active[:, None]
            advanced = advance_history(hist, token_map, new, active)  # the host's look-back, no hashing
            hist = EngramHistory(np.where(keep, after.tokens, hist.tokens), np.where(keep, after.segments,
                                 hist.segments), np.where(active, after.num_positions, hist.num_positions),
                                 np.where(active, after.num_valid, hist.num_valid))
            for field in ("tokens", "segments", "num_positions", "num_valid"):
                np.testing.assert_array_equal(getattr(advanced, field), getattr(hist, field), err_msg=name)
            dev = dev_after
            np.testing.assert_array_equal(np.asarray(dev), device_history(hist), err_msg=name)


# ----------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------


def test_bad_inputs_raise():
    layout = EngramHashLayout.build(**TINY)
    tm = np.arange(256)
    ids = np.zeros((2, 6), np.int64)
    bad = ids.copy()
    bad[1, 4] = 256
    with pytest.raises(ValueError, match=r"token id 256 at \(batch 1, position 4\)"):
        engram_row_ids(bad, tm, layout)
    bad[1, 4] = -1
    with pytest.raises(ValueError, match=r"token id -1 at \(batch 1, position 4\)"):
        engram_row_ids(bad, tm, layout)
    # ... but the same id at a DEAD position is fine.
    valid = np.ones((2, 6), bool)
    valid[1, 4] = False
    engram_row_ids(bad, tm, layout, valid=valid)
    with pytest.raises(ValueError, match="integer"):
        engram_row_ids(ids.astype(np.float32), tm, layout)
    with pytest.raises(ValueError, match="2-D"):
        engram_row_ids(ids[0], tm, layout)
    with pytest.raises(ValueError, match="valid"):
        engram_row_ids(ids, tm, layout, valid=valid[:, :3])
    with pytest.raises(ValueError, match="valid"):
        engram_row_ids(ids, tm, layout, valid=valid.astype(np.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        engram_row_ids(ids, tm, layout, segment_ids=np.zeros((2, 5), np.int64))
    with pytest.raises(ValueError, match=r"token_map\[3\] = 256"):
        engram_row_ids(ids, np.array([0, 1, 2, 256]), layout)
    with pytest.raises(ValueError, match="history"):
        engram_row_ids_step(ids, EngramHistory.empty(3, 4), tm, layout)
    with pytest.raises(ValueError, match="pad_compressed_id"):
        EngramHashLayout.build((1,), 3, 2, 101, 10, 10)
    with pytest.raises(ValueError, match="max_ngram_size"):
        EngramHashLayout.build((1,), 1, 2, 101, 10, 0)


# ----------------------------------------------------------------------------------------
# Tokenizers and the compressed token map
# ----------------------------------------------------------------------------------------


def _write_wordlevel(tmp_path, tokens, specials=("<bos>", "<eos>", "<pad>")):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {t: i for i, t in enumerate(list(specials) + list(tokens))}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    path = os.path.join(tmp_path, "tokenizer.json")
    tok.save(path)
    return path


def test_compressed_token_map_wordlevel(tmp_path):
    tokens = [
        "Word", "word", "WORD",  # case pairs merge
        "Café", "cafe", "CAFÉ",  # accents stripped
        "ﬁne", "fine",  # NFKC ligature
        " ", "\t", "\n\r ",  # whitespace runs -> one space (kept alive by the sentinel)
        "  x ", "x",  # surrounding whitespace stripped
        "\u000b",  # normalises to "" -> keyed by its own text
        "\ufffdA", "\ufffda",  # partial UTF-8: keyed raw, case NOT merged
        "Other",
    ]
    tok = HFTokenizer(_write_wordlevel(tmp_path, tokens))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (3 + len(tokens), 0, 1, 2)
    token_map, vc = compressed_token_map(tok)
    assert token_map.dtype == np.int64
    want = [0, 1, 2, 3, 3, 3, 4, 4, 4, 5, 5, 6, 6, 6, 7, 7, 8, 9, 10, 11]
    assert token_map.tolist() == want
    assert vc == 12
    # The bare tokenizers.Tokenizer gives the same map.
    m2, v2 = compressed_token_map(tok.backend)
    assert m2.tolist() == want and v2 == vc
    with pytest.raises(ValueError, match="engram_compressed_vocab_size is 13"):
        compressed_token_map(tok, expected_size=13)
    assert tok.decode(tok.encode("Word cafe", add_bos=True), skip_special_tokens=True) == "Word cafe"


def test_hf_tokenizer_config_and_vocab_limit(tmp_path):
    path = _write_wordlevel(tmp_path, ["a", "b"], specials=("<s>", "</s>", "<p>"))
    with open(os.path.join(tmp_path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": {"content": "</s>"}, "eos_token": "<s>"}, f)
    tok = load_tokenizer(str(tmp_path), model_vocab_size=5)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 0, 2)
    with pytest.raises(ValueError, match="4 rows"):
        load_tokenizer(path, model_vocab_size=4)


def test_byte_tokenizer():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 259
    text = "Héllo\tWorld ✓"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == 0 and ids[-1] == 1 and ids[1] == ord("H") + 3
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>" + text + "<|eos|>"
    with pytest.raises(ValueError, match="259 token ids"):
        ByteTokenizer(model_vocab_size=258)
    token_map, vc = compressed_token_map(tok)
    assert vc == 259 - 26 - 3  # A-Z merge into a-z; \t \n \r merge into " "
    assert token_map[3 + ord("Q")] == token_map[3 + ord("q")]
    assert token_map[3 + ord("\n")] == token_map[3 + ord(" ")]
    assert len(set(token_map[3 + 0x80 :].tolist())) == 128  # high bytes keyed raw, all distinct
    assert token_map[:3].tolist() == [0, 1, 2]


# ----------------------------------------------------------------------------------------
# Golden fixtures recorded from the HF reference (if present)
# ----------------------------------------------------------------------------------------

_GOLDEN = sorted(glob.glob(os.path.join(FIXTURE_ROOT, "*", "golden_*.npz")))


def _text_config(path):
    with open(path) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg) if "engram_layer_ids" not in cfg else cfg


def _recorded_hash_ids(data, layer_ids):
    """[B, T, L, cols] from either one stacked key or per-layer ``engram_hash_ids_L{id}`` keys."""
    if "engram_hash_ids" in data.files:
        return data["engram_hash_ids"]
    keys = [f"engram_hash_ids_L{l}" for l in layer_ids]
    if not all(k in data.files for k in keys):
        return None
    return np.stack([data[k] for k in keys], axis=2)


@pytest.mark.skipif(not _GOLDEN, reason=f"no reference fixtures under {FIXTURE_ROOT}/*/golden_*.npz yet")
@pytest.mark.parametrize("golden", _GOLDEN, ids=lambda p: os.path.relpath(p, FIXTURE_ROOT))
def test_matches_reference_fixture(golden):
    d = os.path.dirname(golden)
    for name in ("tokenizer.json", "config.json"):
        if not os.path.exists(os.path.join(d, name)):
            pytest.skip(f"{d} has no {name}")
    cfg = _text_config(os.path.join(d, "config.json"))
    if not cfg.get("engram_layer_ids"):
        pytest.skip(f"{d}/config.json has no engram layers")
    data = np.load(golden)
    want = _recorded_hash_ids(data, cfg["engram_layer_ids"])
    if want is None:
        pytest.skip(f"{golden} records no engram hash ids")

    token_map, vc = compressed_token_map(HFTokenizer(os.path.join(d, "tokenizer.json")),
                                         expected_size=cfg["engram_compressed_vocab_size"])
    if "token_map" in data.files:
        np.testing.assert_array_equal(token_map, data["token_map"])
    layout = EngramHashLayout.build(
        cfg["engram_layer_ids"], cfg["engram_max_ngram_size"], cfg["engram_n_heads"], cfg["engram_vocab_size"],
        vc, int(token_map[cfg.get("engram_pad_id", 2)]),
    )
    for key, ours in (("engram_primes", layout.primes), ("engram_offsets", layout.offsets),
                      ("engram_multipliers", layout.multipliers)):
        if key in data.files:
            np.testing.assert_array_equal(ours, data[key], err_msg=key)
    if "engram_pad_compressed_id" in data.files:
        assert layout.pad_compressed_id == int(data["engram_pad_compressed_id"])
    if "engram_num_embeddings" in cfg:
        assert all(n >= r for n, r in zip(cfg["engram_num_embeddings"], layout.rows_per_layer))

    ids = data["input_ids"]
    valid = data["attention_mask"].astype(bool) if "attention_mask" in data.files else None
    got = engram_row_ids(ids, token_map, layout, valid=valid)
    np.testing.assert_array_equal(got, want)
    # The incremental form, one token at a time after a prefix, agrees too.
    split = ids.shape[1] // 2
    rows, hist = engram_row_ids_step(ids[:, :split], EngramHistory.empty(ids.shape[0], layout.max_ngram_size),
                                     token_map, layout)
    steps = [rows]
    for t in range(split, ids.shape[1]):
        rows, hist = engram_row_ids_step(ids[:, t : t + 1], hist, token_map, layout)
        steps.append(rows)
    np.testing.assert_array_equal(np.concatenate(steps, axis=1), want)
