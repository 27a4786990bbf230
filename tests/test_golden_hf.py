"""Golden parity with the public reference (HF transformers ``deepseek_v41``, cache path, float32).

Fixtures (tests/fixtures/hf_v41/<config>/) hold the reference's config.json, weights (its own tensor names),
tokenizer.json and golden_<case>.npz (inputs, logits with the fake quantisation off and on, per-layer mHC streams,
Engram row ids, indexer top-k per index source). They were produced by tests/fixtures/generate_hf_fixtures.py.
"""

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import ForwardOptions, forward, load_checkpoint
from dsv41_jax.model.model import EngramHasher
from dsv41_jax.ops.rope import rope_tables
from dsv41_jax.tokenizer import load_tokenizer

from conftest import FIXTURES

CASES = sorted(glob.glob(os.path.join(FIXTURES, "hf_v41", "*", "golden_*.npz")))
# One xdist worker runs this module's tests (tests/conftest.py): the cases of a config share its compiled forwards
# (_run, at one padded shape: _pad), built once instead of once in each worker
pytestmark = pytest.mark.xdist_group("test_golden_hf")
REL_TOL = 1e-4  # max |ours - ref| / max |ref|, per the acceptance bar


def _case_id(path):
    return f"{os.path.basename(os.path.dirname(path))}-{os.path.basename(path)[7:-4]}"


_LOADED = {}


def _load(path):
    d = os.path.dirname(path)
    if d not in _LOADED:
        config, params = load_checkpoint(d)
        tokenizer = load_tokenizer(os.path.join(d, "tokenizer.json"), model_vocab_size=config.vocab_size)
        hasher = EngramHasher.from_tokenizer(config, tokenizer) if config.engram_layer_ids else None
        _LOADED[d] = (config, params, hasher)
    return _LOADED[d]


_FWD = {}


def _run(config, params, tokens, eids, quant):
    key = (id(config), quant)
    if key not in _FWD:
        _FWD[key] = jax.jit(lambda p, t, e: forward(p, t, config=config, engram_ids=e,
                                                    options=ForwardOptions(quant_sim=quant, query_chunk=64),
                                                    return_hidden=True, return_topk=True))
    return _FWD[key](params, tokens, eids)


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def _padded_shape(path):
    """The largest (batch, length) among the cases of path's config: every case of a config runs at this one shape,
    so each config compiles one forward per quantisation setting instead of one per case."""
    d = os.path.dirname(path)
    shapes = [np.load(c)["input_ids"].shape for c in CASES if os.path.dirname(c) == d]
    return max(b for b, _ in shapes), max(t for _, t in shapes)


def _pad(ids, shape):
    """Case tokens in the top-left corner of ``shape``, the rest token 0. The forward is causal (sliding window,
    compressed groups once complete, indexer and HSI pools over visible entries, Engram n-grams looking back) and
    batch rows are independent (per-token routing, no capacity), so the case's own rows and positions compute the
    same values; the tests compare exactly those (``_crop``)."""
    out = np.zeros(shape, ids.dtype)
    out[:ids.shape[0], :ids.shape[1]] = ids
    return out


def _crop(x, g):
    b, t = g["input_ids"].shape
    return np.asarray(x)[:b, :t]


@pytest.fixture(scope="module", params=CASES, ids=[_case_id(c) for c in CASES])
def case(request):
    path = request.param
    config, params, hasher = _load(path)
    g = dict(np.load(path))
    ids = _pad(g["input_ids"], _padded_shape(path))
    tokens = jnp.asarray(ids)
    eids = None if hasher is None else jnp.asarray(hasher.row_ids(ids))
    return config, params, hasher, g, tokens, eids


def test_fixtures_exist():
    configs = {os.path.basename(os.path.dirname(c)) for c in CASES}
    assert len(configs) >= 3, f"expected >= 3 golden configs, found {sorted(configs)}"


def test_rope_and_engram_layout_match(case):
    config, _, hasher, g, _, eids = case
    tables = rope_tables(config)
    np.testing.assert_allclose(tables["main"], g["rope_inv_freq_main"], rtol=1e-6)
    np.testing.assert_allclose(tables["compress"], g["rope_inv_freq_compress"], rtol=1e-6)
    if hasher is None:
        return
    np.testing.assert_array_equal(hasher.token_map[: len(g["token_map"])], g["token_map"])
    np.testing.assert_array_equal(hasher.layout.primes, g["engram_primes"])
    np.testing.assert_array_equal(hasher.layout.multipliers, g["engram_multipliers"])
    for slot, layer in enumerate(config.engram_layer_ids):
        np.testing.assert_array_equal(_crop(eids[:, :, slot], g), g[f"engram_hash_ids_L{layer}"])


def test_logits_hidden_and_topk_match_quant_off(case):
    config, params, _, g, tokens, eids = case
    logits, aux = _run(config, params, tokens, eids, quant=False)
    logits = _crop(logits, g)
    assert np.isfinite(logits).all()
    assert _rel(logits, g["logits"]) < REL_TOL
    if "hidden_states" in g:
        for layer in range(config.num_hidden_layers):
            assert _rel(_crop(aux["hidden"][layer], g), g["hidden_states"][layer]) < REL_TOL, f"layer {layer}"
    for layer, topk in aux["topk"].items():
        ref = g.get(f"topk_L{layer}")
        if ref is not None:
            np.testing.assert_array_equal(_crop(topk, g), ref, err_msg=f"top-k of layer {layer}")


def test_logits_match_quant_on_at_stable_positions(case):
    """With the release's fake quantisation the reference is discontinuous; compare where it is stable (its logits
    did not move under tiny input noise) and report how many positions were unstable."""
    config, params, _, g, tokens, eids = case
    logits, aux = _run(config, params, tokens, eids, quant=True)
    logits = _crop(logits, g)
    ref = g["logits_quant_on"]
    stable = ~g["quant_on_unstable"]
    err = np.max(np.abs(logits - ref), axis=-1) / np.max(np.abs(ref))
    print(f"quant-on: {int((~stable).sum())} of {stable.size} positions unstable in the reference; "
          f"max rel err stable {err[stable].max() if stable.any() else float('nan'):.2e}, "
          f"all {err.max():.2e}")
    if stable.any():
        assert err[stable].max() < REL_TOL
    for layer, topk in aux["topk"].items():
        ref_topk = g.get(f"topk_quant_on_L{layer}")
        if ref_topk is not None:
            rows = _crop(topk, g) != ref_topk
            assert not rows.any(-1)[stable].any(), f"top-k of layer {layer} differs at a stable position"
