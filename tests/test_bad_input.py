"""Bad input gets a clear error naming the problem — never NaN, never a crash deep inside XLA."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dsv41_jax import CheckpointError, ForwardError, ParamError, forward, init_params, load_checkpoint, load_config
from dsv41_jax.model.model import default_hasher

from conftest import FIXTURES


# session scope (read-only for its tests): a shuffled order interleaves modules, and a module-scoped fixture is
# then built again each time its module comes back
@pytest.fixture(scope="session")
def setup():
    config = load_config("tiny")
    params = init_params(config, jax.random.PRNGKey(0))
    return config, params, default_hasher(config)


def _ids(hasher, tokens):
    return jnp.asarray(hasher.row_ids(np.asarray(tokens)))


def test_token_out_of_vocabulary(setup):
    config, params, hasher = setup
    tokens = np.array([[5, 6, config.vocab_size]])
    with pytest.raises(ForwardError, match=r"token id 259 at position \(0, 2\) is outside the vocabulary"):
        forward(params, jnp.asarray(tokens), config=config)  # tokens are checked before anything else
    with pytest.raises(ForwardError, match="outside the vocabulary"):
        forward(params, jnp.asarray([[-1, 3]]), config=config)


def test_empty_and_overlong_and_malformed(setup):
    config, params, hasher = setup
    with pytest.raises(ForwardError, match="empty input"):
        forward(params, jnp.zeros((1, 0), jnp.int32), config=config)
    with pytest.raises(ForwardError, match=r"shape \[batch, seq\]"):
        forward(params, jnp.zeros((4,), jnp.int32), config=config)
    with pytest.raises(ForwardError, match="must be integers"):
        forward(params, jnp.zeros((1, 4), jnp.float32), config=config)
    short = config.replace(max_position_embeddings=8)
    with pytest.raises(ForwardError, match="exceeds max_position_embeddings 8"):
        forward(params, jnp.zeros((1, 9), jnp.int32), config=short)


def test_engram_ids_required_and_checked(setup):
    config, params, hasher = setup
    tokens = jnp.asarray([[5, 6, 7]])
    with pytest.raises(ForwardError, match="pass engram_ids"):
        forward(params, tokens, config=config)
    with pytest.raises(ForwardError, match="engram_ids has shape"):
        forward(params, tokens, config=config, engram_ids=jnp.zeros((1, 3, 1, 6), jnp.int32))
    with pytest.raises(ValueError, match="outside the token map"):
        hasher.row_ids(np.array([[5, 9999]]))


def test_wrong_parameters(setup):
    config, params, hasher = setup
    tokens = jnp.asarray([[5, 6, 7]])
    ids = _ids(hasher, tokens)
    bad = jax.tree.map(lambda x: x, params)
    bad["layers"][3]["attn"]["wq_b"] = jnp.zeros((7, 7))
    with pytest.raises(ParamError, match=r"layers/3/attn/wq_b \(model.layers.3.attn.wq_b.weight\) has shape"):
        forward(bad, tokens, config=config, engram_ids=ids)
    bad = jax.tree.map(lambda x: x, params)
    bad["lm_head"] = bad["lm_head"].astype(jnp.int32)
    with pytest.raises(ParamError, match="lm_head .* has dtype int32"):
        forward(bad, tokens, config=config, engram_ids=ids)
    bad = jax.tree.map(lambda x: x, params)
    del bad["layers"][2]["attn"]["indexer"]
    with pytest.raises(ParamError, match="missing parameters: .*layers/2/attn/indexer"):
        forward(bad, tokens, config=config, engram_ids=ids)
    bad = jax.tree.map(lambda x: x, params)
    bad["layers"][0]["attn"]["compressor"] = {"wkv": jnp.zeros((64, 64))}
    with pytest.raises(ParamError, match="unexpected parameters: .*layers/0/attn/compressor/wkv"):
        forward(bad, tokens, config=config, engram_ids=ids)


@pytest.fixture()
def ckpt_copy(tmp_path):
    src = os.path.join(FIXTURES, "hf_v41", "tiny_b")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_checkpoint_errors_name_the_tensor(ckpt_copy):
    path = ckpt_copy / "model.safetensors"
    tensors = load_file(path)
    original = dict(tensors)
    tensors.pop("model.layers.2.attn.wq_a.weight")
    tensors["model.layers.3.attn.not_a_weight"] = np.zeros(3, np.float32)
    tensors["lm_head.weight"] = np.zeros((3, 3), np.float32)
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(ckpt_copy))
    msg = str(e.value)
    assert "missing tensor model.layers.2.attn.wq_a.weight" in msg
    assert "model.layers.3.attn.not_a_weight" in msg
    assert "lm_head.weight has shape (3, 3), expected (384, 48)" in msg
    save_file(original, path)
    config, params = load_checkpoint(str(ckpt_copy))  # the untouched copy loads
    assert config.num_hidden_layers == 8
    os.remove(path)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(str(ckpt_copy))


def test_tokenizer_file_errors(tmp_path):
    from dsv41_jax.tokenizer import load_tokenizer

    with pytest.raises(FileNotFoundError, match="tokenizer not found: .*missing.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="tokenizer not found: .*tokenizer.json"):
        load_tokenizer(str(tmp_path))  # a directory without a tokenizer.json
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: invalid JSON"):  # the file and the problem, named
        load_tokenizer(str(bad))
