"""Small helpers shared by the tests (and handy for experiments): two 6-layer cuts of the tiny config, a random batch,
and a small text corpus on disk."""

from __future__ import annotations

import os

import numpy as np

from dsv41_jax.config import ModelConfig, load_config


def small_config() -> ModelConfig:
    """tiny with 6 layers: SWA, SWA + Engram, ratio-2 Full, ratio-2 Reuse, ratio-1 Full (HSI candidate source),
    ratio-1 Reindex (pool-restricted). Compiles about twice as fast as the 12-layer tiny."""
    return load_config("tiny").replace(
        name="tiny6", num_hidden_layers=6, compress_ratios=(0, 0, 2, 2, 1, 1), kv_source_layer_ids=(2, 4),
        index_source_layer_ids=(2, 4, 5), candidate_source_layer_id=4, engram_layer_ids=(1,),
        engram_num_embeddings=(660,), dspark_target_layer_ids=(3, 4, 5))


def every_role_config(**changes) -> ModelConfig:
    """tiny with 6 layers, one of each role the cached engine treats differently: SWA; ratio-2 Full + Engram;
    ratio-2 Reuse; ratio-1 Full (the decoder's first layer, the HSI candidate source and its only KV source, as CED
    needs); ratio-1 Reuse; ratio-1 Reindex (pool-restricted). Unlike :func:`small_config` the decoder has a Reuse
    layer. The engine tests compile many programs (prefill chunks, decode, oracles); on this cut each compiles in
    about half the time of the 12-layer tiny."""
    return load_config("tiny").replace(
        name="tiny_every_role", num_hidden_layers=6, compress_ratios=(0, 2, 2, 1, 1, 1), kv_source_layer_ids=(1, 3),
        index_source_layer_ids=(1, 3, 5), candidate_source_layer_id=3, engram_layer_ids=(1,),
        engram_num_embeddings=(660,), dspark_target_layer_ids=(3, 4, 5)).replace(**changes)


def random_batch(config: ModelConfig, batch: int, seq: int, seed: int = 0, hasher=None) -> dict:
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, config.vocab_size, (batch, seq + 1)).astype(np.int32)
    out = {"tokens": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": np.ones((batch, seq), np.float32),
           "valid": np.ones((batch, seq), bool)}
    if hasher is not None:
        out["engram_ids"] = hasher.row_ids(out["tokens"])
    return out


SAMPLE_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.\n" * 3,
    "import os\nprint(os.getcwd())\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit.\n" * 2,
    "for i in range(10):\n    print(i * i)\n",
]


def write_corpus(directory: str, n_copies: int = 3) -> str:
    """A few small .txt documents and one .jsonl file under ``directory``; returns it."""
    import json

    os.makedirs(directory, exist_ok=True)
    for i, text in enumerate(SAMPLE_TEXT * n_copies):
        with open(os.path.join(directory, f"doc{i:03d}.txt"), "w") as f:
            f.write(text)
    with open(os.path.join(directory, "more.jsonl"), "w") as f:
        for text in SAMPLE_TEXT:
            f.write(json.dumps({"text": text.upper()}) + "\n")
    return directory


def random_moe_params(rng: np.random.Generator, d: int, f: int, n_exp: int) -> dict:
    """A MoE layer's parameters (router, ``n_exp`` routed experts and the shared expert; hidden ``d``, expert width
    ``f``) drawn from ``rng`` in float32, with a zero routing bias: the input of the MoE implementations' tests."""
    import jax.numpy as jnp

    def draw(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    return {"gate": {"weight": draw(n_exp, d), "bias": jnp.zeros((n_exp,), jnp.float32)},
            "experts": {k: draw(*s, scale=0.25) for k, s in (("w1", (n_exp, f, d)), ("w3", (n_exp, f, d)),
                                                               ("w2", (n_exp, d, f)))},
            "shared_experts": {k: draw(*s, scale=0.25) for k, s in (("w1", (f, d)), ("w3", (f, d)), ("w2", (d, f)))}}
