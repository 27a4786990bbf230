"""LoRA fine-tuning (dsv41_jax.train.lora): zero-initialised adapters leave the model unchanged, adapter gradients
equal those of the dense weight W + s·(a·b)ᵀ, only adapters train (the base is bit-identical), merge equals the
adapted forward, checkpoints resume exactly, release-precision bases, bad input, and ``dsv41 train --lora``."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model.forward import forward
from dsv41_jax.model.params import flat_specs
from dsv41_jax.train import TrainConfig, make_train_step, train
from dsv41_jax.train.lora import (DEFAULT_TARGETS, LoraConfig, LoraError, attach, init_adapters, lora_targets,
                                  merge)
from dsv41_jax.config import load_config
from dsv41_jax.train.testing import random_batch, write_corpus

LC = LoraConfig(rank=4, alpha=8.0)
# float32 so that "equal" means float32 noise. One LoRA train-step program is shared by the tests below, the
# trainer and the CLI run (the same TrainConfig as `dsv41 train --lora --lora-rank 4 --lora-alpha 8
# --lora-dropout 0.1 --dtype float32 --seq-len 16 --batch-size 2 --steps 4 --warmup 1 --lr 1e-2
# --schedule constant --weight-decay 0`).
LORA_TC = TrainConfig(seq_len=16, batch_size=2, weight_decay=0.0, warmup_steps=1, steps=4, compute_dtype="float32",
                      lora=True, lora_rank=LC.rank, lora_alpha=LC.alpha, lora_dropout=0.1, lr=1e-2,
                      schedule="constant")


@pytest.fixture(scope="module")
def cfg():
    """tiny with one (sliding-window) layer: the attention projections LoRA targets at the smallest compile cost."""
    return load_config("tiny").replace(
        name="tiny1", num_hidden_layers=1, compress_ratios=(0,), kv_source_layer_ids=(), index_source_layer_ids=(),
        candidate_source_layer_id=-1, engram_layer_ids=(), engram_num_embeddings=(), dspark_target_layer_ids=(0,))


def host_params(config, seed):
    """Random parameters like ``init_params`` (normal(0, 0.02) / ones / zeros by spec), drawn by numpy: no
    per-shape random-kernel compiles."""
    from dsv41_jax.model.params import is_spec, param_specs

    rng = np.random.default_rng(seed)

    def make(s):
        dt = np.float32
        if s.init == "ones":
            return np.ones(s.shape, dt)
        if s.init == "zeros":
            return np.zeros(s.shape, dt)
        return (0.02 * rng.standard_normal(s.shape)).astype(dt)

    return jax.tree.map(make, param_specs(config), is_leaf=is_spec)


@pytest.fixture(scope="module")
def setup(cfg):
    params = host_params(cfg, 1)
    batch = random_batch(cfg, 2, 16, seed=3)
    adapters = init_adapters(cfg, LC, jax.random.PRNGKey(2))
    rng = np.random.default_rng(4)  # non-zero b, so that the adapter path is exercised
    trained = {p: {"a": ab["a"], "b": 0.05 * rng.standard_normal(ab["b"].shape).astype(np.float32)}
               for p, ab in adapters.items()}
    fwd = jax.jit(lambda p, t: forward(p, t, config=cfg))
    return params, batch, adapters, trained, fwd


def test_targets_default_and_bad_input(cfg):
    t = lora_targets(cfg, LC)
    assert sorted({p.split("/")[-1] for p in t}) == ["wkv", "wo_b", "wq_a", "wq_b"]
    assert len(t) == 4 * cfg.num_hidden_layers and DEFAULT_TARGETS == LC.targets
    deeper = load_config("tiny")  # 12 layers: the indexer's and shared experts' projections can be adapted too
    n_query, n_key = (sum(p.endswith(f"/indexer/{w}") for p, _ in flat_specs(deeper)) for w in ("wq_b", "wk"))
    assert n_query > n_key > 0  # Reindex layers have their own queries, only Full layers index keys
    assert len(lora_targets(deeper, LoraConfig(targets=r"indexer/(wq_b|wk)$|shared_experts/w1$"))) == \
        n_query + n_key + deeper.num_hidden_layers
    with pytest.raises(LoraError, match="matches no parameter path"):
        lora_targets(cfg, LoraConfig(targets="attn/nonexistent"))
    with pytest.raises(LoraError, match=r"layers/0/attn/attn_sink has shape \(4,\): not a matrix"):
        lora_targets(cfg, LoraConfig(targets="attn/attn_sink"))
    with pytest.raises(LoraError, match="stack of expert matrices"):
        lora_targets(cfg, LoraConfig(targets="experts/w1"))
    with pytest.raises(LoraError, match="wo_a .* not a plain projection"):
        lora_targets(cfg, LoraConfig(targets="attn/wo_a"))
    with pytest.raises(LoraError, match=r"rank 40 exceeds min\(out, in\) = 32 of layers/0/attn/wo_b"):
        lora_targets(cfg, LoraConfig(rank=40))
    for bad in (0, -1):
        with pytest.raises(LoraError, match="rank must be a positive integer"):
            LoraConfig(rank=bad)
    with pytest.raises(ValueError, match="lora_rank"):
        TrainConfig(lora=True, lora_rank=0)
    with pytest.raises(ValueError, match="trainable / frozen"):
        TrainConfig(lora=True, trainable=("attn",))
    with pytest.raises(LoraError, match="dropout"):
        LoraConfig(dropout=1.0)


def test_zero_init_is_the_base_and_merge_equals_the_adapted_forward(cfg, setup):
    params, batch, adapters, trained, fwd = setup
    args = (jnp.asarray(batch["tokens"]),)
    base = np.asarray(fwd(params, *args))
    np.testing.assert_array_equal(np.asarray(fwd(attach(params, adapters, LC), *args)), base)
    adapted = np.asarray(fwd(attach(params, trained, LC), *args))
    merged = np.asarray(fwd(merge(params, trained, LC), *args))
    assert np.abs(adapted - base).max() > 1e-3  # the adapters do change the model
    np.testing.assert_allclose(merged, adapted, rtol=0, atol=2e-5 * np.abs(adapted).max())
    # a release-precision (QuantizedTensor) base: the adapter adds to the GEMM of the dequantised weight
    from dsv41_jax.model.release_weights import dequantize_params, quantize_params

    q = quantize_params(jax.device_get(params), cfg)
    deq = dequantize_params(q)
    assert any(hasattr(w, "scales") for w in jax.tree.leaves(q, is_leaf=lambda x: hasattr(x, "scales")))
    np.testing.assert_allclose(np.asarray(fwd(attach(q, trained, LC), *args)),
                               np.asarray(fwd(attach(deq, trained, LC), *args)), rtol=0, atol=1e-5)


def test_adapter_gradients_equal_the_dense_reference(cfg, setup):
    """float32: d loss / d (a, b) through the adapter path = through the dense weight W + s·(a·b)ᵀ."""
    params, batch, _, trained, _ = setup
    step = make_train_step(cfg, LORA_TC)
    step.set_base(params)
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    g_lora = jax.jit(jax.grad(lambda ad: step.lora_loss(ad, step.base, b)[0]))(trained)
    g_dense = jax.jit(jax.grad(lambda ad: step.model_loss(merge(params, ad, LC), b)[0]))(trained)
    for p in trained:
        for k in ("a", "b"):
            x, y = np.asarray(g_lora[p][k]), np.asarray(g_dense[p][k])
            assert np.abs(y).max() > 0
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-4 * np.abs(y).max(), err_msg=f"{p}/{k}")


def test_only_adapters_train_and_the_base_is_untouched(cfg, setup):
    params, batch, _, _, _ = setup
    step = make_train_step(cfg, LORA_TC)
    state = step.init_state(params)
    before = jax.device_get(step.base)
    a0 = jax.device_get(state["params"])
    opt_leaves = jax.tree.leaves(state["opt_state"])
    n_adapter = sum(x.size for x in jax.tree.leaves(a0))
    # the optimiser state holds the adapters' moments only (AdamW: mu + nu, plus counters)
    assert sum(x.size for x in opt_leaves if x.ndim > 0) == 2 * n_adapter
    for _ in range(2):
        state, m = step(state, batch, 1e-2)
    assert np.isfinite(float(m["loss"]))
    after = jax.device_get(state["params"])
    for p in a0:
        assert np.abs(after[p]["b"]).max() > 0 and not np.array_equal(after[p]["a"], a0[p]["a"])
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(step.base))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(params))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_resume_is_exact_and_export_loads(tmp_path, cfg):
    from dsv41_jax.checkpoint.orbax_ckpt import load_checkpoint

    corpus = write_corpus(str(tmp_path / "corpus"))
    base_dir = tmp_path / "base"
    os.makedirs(base_dir)
    from dsv41_jax.checkpoint.orbax_ckpt import export_params

    export_params(str(base_dir), host_params(cfg, 1), cfg)
    kw = dict(glob="*.txt", progress=False, handle_sigterm=False, async_save=False, init_from=str(base_dir))
    tc = LORA_TC
    full = train(cfg, tc, corpus, **kw)
    ckpt = str(tmp_path / "ckpt")
    part = train(cfg, tc, corpus, ckpt_dir=ckpt, save_every=2, stop_after=2, **kw)
    assert part.step == 2
    rest = train(cfg, tc, corpus, ckpt_dir=ckpt, save_every=2, export_dir=str(tmp_path / "export"), **kw)
    assert rest.resumed_from == 2 and rest.step == 4
    for x, y in zip(jax.tree.leaves(jax.device_get(full.state)), jax.tree.leaves(jax.device_get(rest.state))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the export and the training checkpoint both load as plain (merged) parameters
    step = make_train_step(cfg, tc)
    step.set_base(load_checkpoint(str(base_dir))[1])
    want = jax.device_get(step.merged_params(rest.state["params"]))
    for path in (str(tmp_path / "export"), ckpt):
        _, got = load_checkpoint(path)
        for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # resuming with another base or without --lora is refused
    with pytest.raises(ValueError, match="another setup"):
        train(cfg, tc.replace(lora_alpha=4.0), corpus, ckpt_dir=ckpt, **kw)
    with pytest.raises(ValueError, match="holds LoRA adapters"):
        train(cfg, tc.replace(lora=False), corpus, ckpt_dir=ckpt, **kw)


def test_cli_lora(tmp_path, cfg, capsys):
    """`dsv41 train --lora ...` (the embedded default model goes the same way with --init-from default)."""
    from dsv41_jax.checkpoint.orbax_ckpt import export_params, load_checkpoint
    from dsv41_jax.cli import main

    corpus = write_corpus(str(tmp_path / "corpus"))
    base_dir = str(tmp_path / "base")
    export_params(base_dir, host_params(cfg, 1), cfg)
    export = str(tmp_path / "export")
    args = ["train", "--init-from", base_dir, "--lora", "--lora-rank", "4", "--lora-alpha", "8",
            "--lora-dropout", "0.1", "--dtype", "float32", "--data", corpus, "--glob", "*.txt", "--steps", "4",
            "--seq-len", "16", "--batch-size", "2", "--warmup", "1", "--lr", "1e-2", "--schedule", "constant",
            "--weight-decay", "0", "--no-progress", "--export", export]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "LoRA rank 4 alpha 8 dropout 0.1 on 4 weights" in err and "finished at step 4/4" in err
    _, merged = load_checkpoint(export)  # what `dsv41 generate --checkpoint` reads
    _, base = load_checkpoint(base_dir)
    changed = {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p)
               for (p, x), y in zip(jax.tree_util.tree_flatten_with_path(merged)[0], jax.tree.leaves(base))
               if not np.array_equal(np.asarray(x), np.asarray(y))}
    assert changed == set(lora_targets(cfg, LC))  # the merged export differs from the base exactly at the targets
    for bad, msg in ((["--lora-targets", "nothing_matches"], "matches no parameter path"),
                     (["--lora-rank", "0"], "lora_rank"), (["--lora-targets", "ffn_norm"], "not a matrix")):
        assert main(args[:-2] + bad) == 2
        assert msg in capsys.readouterr().err
