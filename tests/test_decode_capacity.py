"""Cache capacity: no writer (prefill, the checked decode step, the jitted decode programs, the Engine) ever drops
a token's cache entries silently when a slot is full."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import Engine, load_config
from dsv41_jax.inference import FAST_COMPILE, EngineError, InferenceOptions, decode_step, prefill
from dsv41_jax.inference.cache import cache_capacity, init_cache
from dsv41_jax.inference.decode import DecodeError, decode_and_sample, decode_step_jit
from dsv41_jax.inference.prefill import PrefillError
from dsv41_jax.inference.weights import host_random_params
from dsv41_jax.train.testing import every_role_config

MAX_LEN = 16


@functools.lru_cache(maxsize=None)
def _engine():
    config = every_role_config(quant_sim=False)
    params = host_random_params(config, 5, std=0.1)
    return Engine(config, params, max_batch=2, max_len=MAX_LEN, options=InferenceOptions(compiler_options=FAST_COMPILE))


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _rows(tree, b, all_leaves=False):
    """Row b of every cache leaf except the compressor's partial-group buffers: slot 0 below holds a multiple of
    the ratio, so its partial group is empty and those buffers' contents are unused (any step may rewrite them)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [np.asarray(x)[b] for path, x in leaves if all_leaves or "buf_" not in jax.tree_util.keystr(path)]


def test_capacity_is_read_from_the_shapes():
    config = load_config("tiny")
    assert cache_capacity(config, init_cache(config, 1, MAX_LEN)) == MAX_LEN
    # entry slots are rounded up to whole HSI blocks: capacity >= max_len, set by the tightest source
    cache = init_cache(config, 1, 13)
    want = min(v["kv"].shape[1] * config.compress_ratios[int(k)] for k, v in cache["sources"].items())
    assert cache_capacity(config, cache) == want >= 13


def test_a_full_slot_is_a_clear_error_or_a_loud_refusal_never_a_silent_drop():
    eng = _engine()
    config, params, opts = eng.config, eng.params, eng.options
    rng = np.random.default_rng(0)
    eng.prefill([rng.integers(3, 259, MAX_LEN).tolist(), rng.integers(3, 259, 3).tolist()])
    assert eng.lengths().tolist() == [MAX_LEN, 3]
    tok = np.array([7, 9])
    both = np.array([True, True])
    eids = eng._engram_step(tok, both)  # row ids for these tokens (host hashing; the history is not reused below)

    # the checked public step reads the lengths and names the full slot
    with pytest.raises(DecodeError, match=f"slot 0 is full: {MAX_LEN} cached \\+ 1 new tokens exceed the cache's "
                                          f"capacity of {MAX_LEN}"):
        decode_step(params, _copy(eng.cache), tok, eids, both, config=config, opts=opts)
    # ... prefill too, and the Engine's own step
    with pytest.raises(PrefillError, match="slot 0 is full"):
        prefill(params, _copy(eng.cache), np.array([[5], [0]]), np.array([1, 0]),
                np.zeros((2, 1) + eids.shape[1:], np.int32), config=config, opts=opts)
    with pytest.raises(EngineError, match="full"):
        eng.decode_step(tok, both)

    # the slot with room is served by the checked step; its result is the reference for the jitted programs
    only1 = np.array([False, True])
    want_logits, want_cache = decode_step(params, _copy(eng.cache), tok, eids, only1, config=config, opts=opts)

    # the jitted step, fed past capacity: slot 0 is refused loudly (NaN logits), its cache untouched
    before = _rows(eng.cache, 0)
    logits, cache = decode_step_jit(params, _copy(eng.cache), jnp.asarray(tok, jnp.int32), jnp.asarray(eids),
                                    jnp.asarray(both), config=config, opts=opts)
    logits = np.asarray(logits)
    assert np.isnan(logits[0]).all()
    np.testing.assert_array_equal(logits[1], np.asarray(want_logits)[1])
    assert np.asarray(cache["length"]).tolist() == [MAX_LEN, 4]
    for a, b in zip(before, _rows(cache, 0)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_rows(want_cache, 1, True), _rows(cache, 1, True)):
        np.testing.assert_array_equal(a, b)

    # ... and fused with sampling: the refused slot's token is -1, which every checked entry point rejects
    ones = jnp.ones((2,))
    nxt, cache = decode_and_sample(params, _copy(eng.cache), jnp.asarray(tok, jnp.int32), jnp.asarray(eids),
                                   jnp.asarray(both), 0 * ones, jnp.zeros((2,), jnp.int32), ones,
                                   jnp.zeros((2,), jnp.int32), jnp.ones((2,), jnp.int32), config=config, opts=opts)
    nxt = np.asarray(nxt)
    assert nxt[0] == -1 and nxt[1] == int(np.argmax(np.asarray(want_logits)[1]))
    with pytest.raises(DecodeError, match="token id -1"):
        decode_step(params, cache, nxt, eids, both, config=config, opts=opts)
