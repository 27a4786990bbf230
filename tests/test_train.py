"""Fine-tuning: losses, gradients through the sparse path, optimisers and freezing, the indexer KL objective,
data packing, the train step (a tiny model overfits a batch), bad input, and the ``dsv41 train`` CLI."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model.model import default_hasher
from dsv41_jax.ops import quant
from dsv41_jax.ops.attention import sparse_attention
from dsv41_jax.tokenizer import ByteTokenizer
from dsv41_jax.train import TrainConfig, TrainConfigError, TrainError, lr_at, make_train_step, train
from dsv41_jax.train.data import (DataError, Dataset, build_rows, load_corpus, read_documents,
                                  tokenize_documents)
from dsv41_jax.train.loss import balance_loss, expert_load, indexer_kl_loss, noaux_bias_update
from dsv41_jax.train.optimizer import build_optimizer, trainable_mask
from dsv41_jax.train.step import place_state
from dsv41_jax.train.testing import random_batch, random_moe_params, small_config, write_corpus

# The one train-step program most tests share (same HLO as `dsv41 train ... --seq-len 32 --batch-size 2
# --weight-decay 0` on the small config): bf16 compute, release fake quantisation with straight-through gradients.
STD = dict(seq_len=32, batch_size=2, weight_decay=0.0, warmup_steps=2)


@pytest.fixture(scope="module")
def cfg():
    return small_config()


# ----------------------------------------------------------------------------------------------------------------
# configuration, schedules
# ----------------------------------------------------------------------------------------------------------------

def test_train_config_validation():
    with pytest.raises(TrainConfigError, match="optimizer"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(TrainConfigError, match="seq_len"):
        TrainConfig(seq_len=0)
    with pytest.raises(TrainConfigError, match="frozen"):
        TrainConfig(frozen=("(",))
    tc = TrainConfig(trainable="attn/")
    assert tc.trainable == ("attn/",)
    assert TrainConfig.from_dict(tc.to_dict()) == tc


def test_lr_schedules():
    tc = TrainConfig(lr=1.0, warmup_steps=10, steps=110, min_lr_ratio=0.1)
    assert lr_at(0, tc) == pytest.approx(0.1) and lr_at(9, tc) == pytest.approx(1.0)
    assert lr_at(10, tc) == pytest.approx(1.0) and lr_at(110, tc) == pytest.approx(0.1)
    assert lr_at(60, tc) == pytest.approx(0.55)  # cosine midpoint
    lin = tc.replace(schedule="linear")
    assert lr_at(60, lin) == pytest.approx(0.55)
    assert lr_at(100, tc.replace(schedule="constant")) == 1.0
    wsd = tc.replace(schedule="wsd", decay_frac=0.2)
    assert lr_at(80, wsd) == 1.0 and lr_at(110, wsd) == pytest.approx(0.1)
    assert lr_at(100, tc, total_steps=100) == pytest.approx(0.1)  # the total can be overridden (time limits)


# ----------------------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------------------

def test_data_deterministic_shuffle_and_resumable_position(tmp_path, cfg):
    corpus = load_corpus([write_corpus(str(tmp_path / "c"))], ByteTokenizer(), glob="*.txt,*.jsonl")
    assert corpus.n_docs == 6 * 3 + 6
    for packing in ("concat", "pad", "segments"):
        ds = Dataset(corpus, seq_len=32, batch_size=3, packing=packing, seed=7, hasher=default_hasher(cfg))
        pos = {"epoch": 0, "row": 0}
        seen = []
        for _ in range(2 * ds.rows_per_epoch // 3 + 2):  # crosses an epoch boundary
            batch, pos = ds.batch_at(pos)
            seen.append((batch, dict(pos)))
        assert seen[-1][1]["epoch"] >= 1
        again = Dataset(corpus, seq_len=32, batch_size=3, packing=packing, seed=7, hasher=default_hasher(cfg))
        # resuming from any saved position replays the same batches
        k = len(seen) // 2
        b, _ = again.batch_at(seen[k - 1][1])
        for name in seen[k][0]:
            np.testing.assert_array_equal(b[name], seen[k][0][name])
        other = Dataset(corpus, seq_len=32, batch_size=3, packing=packing, seed=8)
        assert not np.array_equal(other.batch_at({"epoch": 0, "row": 0})[0]["tokens"], seen[0][0]["tokens"])
        for batch, _ in seen:
            t = batch["tokens"]
            assert t.shape == (3, 32) and batch["engram_ids"].shape[:2] == (3, 32)
            m = batch["loss_mask"] > 0
            if packing != "segments":  # targets are the next tokens of the same stream
                np.testing.assert_array_equal(batch["targets"][:, :-1][m[:, :-1] & m[:, 1:]],
                                              t[:, 1:][m[:, :-1] & m[:, 1:]])
    # every token of the corpus is a target exactly once per epoch (concat)
    ds = Dataset(corpus, seq_len=32, batch_size=1, packing="concat", seed=0)
    rows = ds.rows(0)
    assert int(rows.loss_mask.sum()) == len(corpus.tokens) - 1


def test_segment_rows_never_cross_documents():
    corpus = tokenize_documents(["abcdefghij", "xyz", "0123456789" * 5], ByteTokenizer())
    rows = build_rows(corpus, 16, "segments", np.random.default_rng(0))
    for tok, tgt, mask, seg in zip(rows.tokens, rows.targets, rows.loss_mask, rows.segment_ids):
        for i in range(15):
            if mask[i]:
                assert seg[i] == seg[i + 1] and tgt[i] == tok[i + 1]
    # each document piece starts a segment with its own id; total targets = tokens - pieces
    assert int(rows.loss_mask.sum()) == int(rows.valid.sum()) - len({(int(s)) for s in rows.segment_ids[rows.valid]})


def test_read_documents_jsonl_binary_and_errors(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n"two"\n\n{"body": "x", "text": "three"}\n')
    (tmp_path / "b.bin").write_bytes(b"\0\1\2binary")
    (tmp_path / "c.txt").write_text("four")
    assert read_documents([str(tmp_path)]) == ["one", "two", "three", "four"]
    assert read_documents([str(tmp_path)], glob="*.txt") == ["four"]
    (tmp_path / "bad.jsonl").write_text('{"body": 1}\n')
    with pytest.raises(DataError, match="bad.jsonl:1"):
        read_documents([str(tmp_path / "bad.jsonl")])
    with pytest.raises(FileNotFoundError, match="nope"):
        read_documents([str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    with pytest.raises(DataError, match="empty corpus"):
        read_documents([str(tmp_path / "empty")])


def test_binary_and_undecodable_files_are_counted_and_reported(tmp_path):
    from dsv41_jax.train.data import ReadReport
    from dsv41_jax.train.trainer import corpus_warnings

    only_binary = tmp_path / "bin"
    only_binary.mkdir()
    for i in range(3):
        (only_binary / f"blob{i}.dat").write_bytes(b"\x7fELF\0\0" + bytes(range(256)))
    with pytest.raises(DataError, match=r"3 binary file\(s\) skipped \(e\.g\. .*blob0\.dat\)"):
        read_documents([str(only_binary)])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("fine")
    (mixed / "b.dat").write_bytes(b"\0binary")
    (mixed / "c.txt").write_bytes(b"caf\xe9 latin-1")  # not UTF-8: read with U+FFFD, counted
    report = ReadReport()
    docs = read_documents([str(mixed)], report=report)
    assert docs == ["fine", "caf\ufffd latin-1"]
    assert report.files == 3 and report.documents == 2
    assert [os.path.basename(p) for p in report.binary] == ["b.dat"]
    assert [os.path.basename(p) for p in report.undecodable] == ["c.txt"]
    assert "1 binary file(s) skipped" in report.describe() and "1 file(s) with invalid UTF-8" in report.describe()
    warned = corpus_warnings(report, 10, TrainConfig(seq_len=32, batch_size=2))
    assert any("binary" in w for w in warned) and any("UTF-8" in w for w in warned)
    assert any("fewer than one batch" in w for w in warned)


def test_suspicious_train_settings_warn():
    assert TrainConfig(steps=1000, warmup_steps=100).warnings() == []
    short = TrainConfig(steps=20, warmup_steps=100).warnings()  # the default warm-up on a 20-step run
    assert len(short) == 1 and "warmup_steps 100 >= steps 20" in short[0] and "never reaches its peak" in short[0]
    assert any("decay" in w for w in TrainConfig(steps=100, warmup_steps=99).warnings())
    assert any("constant" in w for w in TrainConfig(min_lr_ratio=1.0).warnings())
    assert any("unusually high" in w for w in TrainConfig(lr=0.5).warnings())


def test_ctrl_c_before_the_training_loop_is_one_line(tmp_path, monkeypatch, capsys):
    """Ctrl-C while `dsv41 train` still reads data or compiles (before the loop installs its own handler): exit 130
    with one line, no KeyboardInterrupt traceback."""
    from dsv41_jax import cli
    from dsv41_jax.train import trainer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train", interrupted)
    (tmp_path / "a.txt").write_text("some text")
    assert cli.main(["train", "--data", str(tmp_path), "--steps", "5", "--warmup", "1"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "dsv41 train: interrupted (Ctrl-C) before the first training step; nothing to save"
    assert not any("Traceback" in line for line in err)


def test_cli_fine_tunes_the_default_model_from_its_weights(tmp_path, monkeypatch):
    """`dsv41 train --init-from default` takes the embedded model's config and starts from its parameters."""
    import argparse

    from dsv41_jax.default_model import default_model
    from dsv41_jax.train.cli import _resolve_config
    from dsv41_jax.train.trainer import load_init_params

    config, params, _ = default_model()
    args = argparse.Namespace(config=None, init_from="default")
    assert _resolve_config(args) == config
    got = load_init_params("default", config)
    for (pa, a), (pb, b) in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                                jax.tree_util.tree_flatten_with_path(params)[0]):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _resolve_config(argparse.Namespace(config=None, init_from=None)).name == "tiny"


def test_hf_tokenizer_json_corpus():
    from dsv41_jax.tokenizer import load_tokenizer

    tok_path = os.path.join(os.path.dirname(__file__), "fixtures", "hf_v41", "tiny_a", "tokenizer.json")
    tok = load_tokenizer(tok_path)
    corpus = tokenize_documents(["hello world", "def f(): pass"], tok, model_vocab_size=tok.vocab_size)
    assert corpus.n_docs == 2 and corpus.doc(0)[0] == tok.bos_id and corpus.doc(1)[-1] == tok.eos_id
    assert corpus.tokens.max() < tok.vocab_size
    with pytest.raises(DataError, match="512 ids but the model's vocabulary has 259"):
        tokenize_documents(["x"], tok, model_vocab_size=259)


# ----------------------------------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------------------------------

def _dense_reference(q, q_pos, win_kv, win_pos, ckv, topk, sink, window):
    """Independent dense formulation: every window key and every compressed entry, masked, one softmax + sink."""
    b, c, h, d = q.shape
    keys = jnp.concatenate([win_kv, ckv], axis=1)  # [B, L + N, D]
    kp, qp = win_pos[:, None, :], q_pos[:, :, None]
    win_vis = (kp >= 0) & (kp <= qp) & (kp > qp - window)
    n = ckv.shape[1]
    sel = jnp.zeros((b, c, n), bool).at[jnp.arange(b)[:, None, None], jnp.arange(c)[None, :, None],
                                        jnp.where(topk >= 0, topk, n)].set(True, mode="drop")
    vis = jnp.concatenate([win_vis, sel], axis=-1)
    s = jnp.einsum("bchd,bkd->bhck", q, keys) * d ** -0.5
    s = jnp.where(vis[:, None], s, -jnp.inf)
    m = jnp.maximum(s.max(-1), sink[None, :, None])
    p = jnp.exp(s - m[..., None])
    den = p.sum(-1) + jnp.exp(sink[None, :, None] - m)
    return jnp.einsum("bhck,bkd->bchd", p / den[..., None], keys)


def test_sparse_attention_gradients_match_dense_reference_and_finite_differences():
    key = jax.random.split(jax.random.PRNGKey(0), 5)
    b, c, h, d, l, n, k, window = 2, 5, 3, 8, 9, 7, 3, 4
    q = jax.random.normal(key[0], (b, c, h, d))
    win_kv = jax.random.normal(key[1], (b, l, d))
    ckv = jax.random.normal(key[2], (b, n, d))
    sink = jax.random.normal(key[3], (h,))
    q_pos = jnp.broadcast_to(jnp.arange(4, 4 + c), (b, c))
    win_pos = jnp.broadcast_to(jnp.arange(l), (b, l))
    perm = jax.vmap(lambda kk: jax.random.permutation(kk, n))(jax.random.split(key[4], b * c)).reshape(b, c, n)
    topk = jnp.sort(perm[..., :k], axis=-1).at[:, 0, -1].set(-1)  # distinct picks, one empty slot
    w = jax.random.normal(jax.random.PRNGKey(9), (b, c, h, d))

    def sparse_loss(q, win_kv, ckv, sink):
        return jnp.sum(sparse_attention(q, q_pos, win_kv, win_pos, ckv, topk, sink, window=window) * w)

    def dense_loss(q, win_kv, ckv, sink):
        return jnp.sum(_dense_reference(q, q_pos, win_kv, win_pos, ckv, topk, sink, window) * w)

    args = (q, win_kv, ckv, sink)
    sparse_loss, dense_loss = jax.jit(sparse_loss), jax.jit(dense_loss)
    np.testing.assert_allclose(sparse_loss(*args), dense_loss(*args), rtol=1e-5, atol=1e-5)
    g_sparse = jax.jit(jax.grad(sparse_loss, argnums=(0, 1, 2, 3)))(*args)
    g_dense = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2, 3)))(*args)
    for a, r in zip(g_sparse, g_dense):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(g_sparse[2]).sum()) > 0  # the compressed entries really receive gradient
    # finite differences along random directions (float32 central differences)
    for i, arg in enumerate(args):
        v = jax.random.normal(jax.random.PRNGKey(100 + i), arg.shape)
        eps = 1e-2
        plus = [a + eps * v if j == i else a for j, a in enumerate(args)]
        minus = [a - eps * v if j == i else a for j, a in enumerate(args)]
        fd = (sparse_loss(*plus) - sparse_loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(fd, jnp.vdot(g_sparse[i], v), rtol=2e-2, atol=2e-2)


def test_fake_quantisers_are_straight_through():
    x = jnp.linspace(-3.0, 3.0, 64, dtype=jnp.float32).reshape(2, 32)
    for f in (lambda x: quant.fake_quant_fp8_e4m3_block(x, 32),
              lambda x: quant.fake_quant_fp4_e2m1_block(x, 16, scale_format="e4m3"),
              lambda x: quant.fake_quant_fp4_e2m1_block(x, 32, scale_format="ue8m0")):
        y = f(x)
        assert not np.array_equal(y, x)  # it really quantises
        np.testing.assert_array_equal(jax.jit(jax.grad(lambda x: jnp.sum(f(x) * 3.0)))(x), 3.0)
        np.testing.assert_array_equal(jax.jit(f)(x), y)  # forward value unchanged under jit


# ----------------------------------------------------------------------------------------------------------------
# MoE balance, optimisers, freezing
# ----------------------------------------------------------------------------------------------------------------

def test_noaux_bias_update_and_balance_loss():
    idx = jnp.array([[0, 1], [0, 2], [0, 1], [3, 0]])
    load = expert_load(idx, jnp.array([True, True, True, False]), 4)
    np.testing.assert_array_equal(load, [3, 2, 1, 0])
    bias = noaux_bias_update(jnp.zeros(4), load, 0.01)
    np.testing.assert_allclose(bias, [-0.01, -0.01, 0.01, 0.01])  # mean 1.5: over-loaded down, under-loaded up
    e, k = 4, 2
    balanced_scores = jnp.ones((8, e))
    balanced_idx = jnp.array([[0, 1], [2, 3]] * 4)
    assert float(balance_loss(balanced_scores, balanced_idx, jnp.ones((2, 4), bool), k)) == pytest.approx(1.0)
    skewed = balance_loss(jnp.eye(e)[jnp.zeros(8, int)] + 1e-3, jnp.array([[0, 1]] * 8), jnp.ones((2, 4), bool), k)
    assert float(skewed) > 1.5


def test_freezing_by_path_and_muon(cfg):
    from dsv41_jax import init_params

    # 3 layers (SWA, SWA + Engram, ratio-2 Full): every kind of parameter path, half the compile time
    cfg = cfg.replace(num_hidden_layers=3, compress_ratios=(0, 0, 2), kv_source_layer_ids=(2,),
                      index_source_layer_ids=(2,), candidate_source_layer_id=-1, dspark_target_layer_ids=(0, 1, 2))
    params = init_params(cfg, jax.random.PRNGKey(0))
    grads = jax.tree.map(jnp.ones_like, params)
    for tc, should_move in (
        (TrainConfig(trainable=("/attn/",), weight_decay=0.0), lambda p: "/attn/" in p),
        (TrainConfig(frozen=(r"engram/embed$",), weight_decay=0.0), lambda p: not p.endswith("engram/embed")),
        (TrainConfig(optimizer="muon", weight_decay=0.0), lambda p: True),
    ):
        opt = build_optimizer(tc, params)
        updates, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
        moved = {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): bool(np.any(np.asarray(u) != 0))
                 for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]}
        for path, m in moved.items():
            expect = should_move(path) and not path.endswith("ffn/gate/bias")  # router bias: noaux rule only
            assert m == expect, (tc.trainable, tc.frozen, tc.optimizer, path)
    mask = trainable_mask(params, TrainConfig(trainable=("indexer",)))
    assert mask["layers"][2]["attn"]["indexer"]["wq_b"] and not mask["layers"][2]["attn"]["wq_b"]
    with pytest.raises(ValueError, match="matches no parameter"):
        make_train_step(cfg, TrainConfig(trainable=("no_such_param",)))


# ----------------------------------------------------------------------------------------------------------------
# indexer KL objective
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_indexer_kl_trains_only_the_indexer(cfg, mode):
    from dsv41_jax import forward, init_params
    from dsv41_jax.ops.rope import rope_tables

    c = cfg.replace(quant_sim=False)
    params = init_params(c, jax.random.PRNGKey(1), std=0.2)
    batch = random_batch(c, 2, 24, seed=3, hasher=default_hasher(c))
    _, aux = jax.jit(lambda p, t, e: forward(p, t, config=c, engram_ids=e, return_attn_inputs=True,
                                             return_topk=True))(params, batch["tokens"], batch["engram_ids"])
    assert sorted(aux["attn_inputs"]) == [s.index for s in c.plan if s.runs_indexer]
    rope = {k: jnp.asarray(v) for k, v in rope_tables(c).items()}
    pos = jnp.broadcast_to(jnp.arange(24), (2, 24))

    def kl(p):
        return indexer_kl_loss(p, aux["attn_inputs"], aux["topk"], c, pos, rope, mode=mode, quant_on=False,
                               weight=jnp.ones((2, 24)), chunk=8)[0]

    value_and_grad = jax.jit(jax.value_and_grad(kl))
    value, grads = value_and_grad(params)
    assert float(value) > 0
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        if "/indexer/" not in name:
            assert not np.any(np.asarray(g) != 0), name  # the indexer input is detached
    g_idx = grads["layers"][2]["attn"]["indexer"]
    assert float(jnp.abs(g_idx["wq_b"]).sum()) > 0 and float(jnp.abs(g_idx["weights_proj"]).sum()) > 0
    if mode == "dense":
        assert float(jnp.abs(g_idx["wk"]).sum()) > 0
    # a few plain gradient steps on the indexer lower its KL
    p, g = params, grads
    for _ in range(5):
        p = jax.tree.map(lambda x, d: x - 0.5 * d, p, g)
        new_value, g = value_and_grad(p)
    assert float(new_value) < float(value)


@pytest.mark.parametrize("chunk", [16, 64])
def test_indexer_kl_target_is_the_attention_distribution(chunk):
    """V3.2's target against a direct dense computation: per head one softmax over the window keys, the candidate
    entries and the sink; the candidates' probabilities summed over heads and L1-normalised."""
    from dsv41_jax.ops.attention import sequence_window_lse
    from dsv41_jax.train.loss import kl_target

    rng = np.random.default_rng(7)
    t, h, d, window, ratio = 40, 3, 16, 5, 2
    n = t // ratio
    q = rng.standard_normal((1, t, h, d)).astype(np.float32)
    kv = rng.standard_normal((1, t, d)).astype(np.float32)
    ckv = rng.standard_normal((1, n, d)).astype(np.float32)
    sink = rng.standard_normal(h).astype(np.float32)
    scale = d ** -0.5
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    cand = (np.arange(n)[None, :] < ((np.arange(t) + 1) // ratio)[:, None])[None]  # dense: every visible entry
    outside = sequence_window_lse(jnp.asarray(q), jnp.asarray(kv), pos, jnp.asarray(sink), window=window,
                                  chunk=chunk)
    cmp_logits = jnp.einsum("bthd,bnd->bthn", q, ckv) * scale
    got = np.asarray(kl_target(cmp_logits, jnp.asarray(cand), outside))

    want = np.zeros((t, n))
    for i in range(t):
        for j in range(h):
            win = [float(q[0, i, j] @ kv[0, k]) * scale for k in range(max(0, i - window + 1), i + 1)]
            ent = {s_: float(q[0, i, j] @ ckv[0, s_]) * scale for s_ in range(n) if cand[0, i, s_]}
            z = np.exp(win).sum() + sum(np.exp(v) for v in ent.values()) + np.exp(float(sink[j]))
            for s_, v in ent.items():
                want[i, s_] += np.exp(v) / z
    want = want / np.maximum(want.sum(-1, keepdims=True), 1e-30)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-7)
    assert np.all(got[0, 0] == 0)  # no visible entry: an all-zero target (the row does not count)


# ----------------------------------------------------------------------------------------------------------------
# the train step
# ----------------------------------------------------------------------------------------------------------------

def test_tiny_model_overfits_a_small_batch(cfg):
    tc = TrainConfig(lr=3e-3, steps=50, schedule="constant", **STD)
    step = make_train_step(cfg, tc)
    # host parameters with one leaf committed to a device, as loaded ones are: the fresh state is committed as a
    # whole, like every later step's output state, so the step compiles once (a mixed fresh state compiled a second
    # program at step 2: the default model's fine-tuning did)
    host = jax.tree.map(np.asarray, step.init_state()["params"])
    host["norm"] = jax.device_put(host["norm"], jax.devices()[0])
    state = step.init_state(host)
    assert all(x.committed for x in jax.tree.leaves(state))
    batch = random_batch(cfg, 2, 32, seed=0, hasher=default_hasher(cfg))
    programs_before = step.jitted(batch)._cache_size()
    bias0 = np.asarray(state["params"]["layers"][3]["ffn"]["gate"]["bias"])
    losses = []
    for i in range(tc.steps):
        state, m = step(state, batch, lr_at(i, tc))
        losses.append(float(m["ce"]))
    assert step.jitted(batch)._cache_size() - programs_before <= 1
    assert losses[-1] < 0.1 * losses[0], losses
    assert all(np.isfinite(losses))
    assert int(state["step"]) == tc.steps
    assert state["params"]["layers"][0]["attn"]["wq_a"].dtype == jnp.float32  # fp32 masters under bf16 compute
    bias = np.asarray(state["params"]["layers"][3]["ffn"]["gate"]["bias"])
    assert not np.array_equal(bias, bias0)
    # the noaux rule moves the bias in steps of the rate (sums of signs)
    np.testing.assert_allclose(np.round(bias / 1e-3), bias / 1e-3, atol=1e-3)


@pytest.mark.slow  # one more train-step program (~30 s of compilation on 2 cores)
def test_compute_copy_steps_equal_casting_the_masters(cfg):
    """TrainConfig.compute_copy (the bf16 weights kept in the state, written by the update) trains the same as
    casting the float32 masters every step: two steps give the same masters, moments and losses (the gradient of
    the copy, upcast, is the masters' gradient: the transpose of the cast), and the copy is the new masters cast."""
    tc = TrainConfig(lr=3e-3, steps=50, schedule="constant", **STD)  # test_tiny_model_overfits' program
    plain, copied = make_train_step(cfg, tc), make_train_step(cfg, tc.replace(compute_copy=True))
    batch = random_batch(cfg, 2, 32, seed=0, hasher=default_hasher(cfg))
    a, b = plain.init_state(seed=0), copied.init_state(seed=0)
    assert "compute" not in a and b["compute"]["layers"][0]["attn"]["wq_a"].dtype == jnp.bfloat16
    for i in range(2):
        a, ma = plain(a, batch, lr_at(i, tc))
        b, mb = copied(b, batch, lr_at(i, tc))
        assert float(mb["loss"]) == pytest.approx(float(ma["loss"]), rel=1e-6)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path((a["params"], a["opt_state"]))[0],
                            jax.tree.leaves((b["params"], b["opt_state"]))):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.linalg.norm(x - y) <= 1e-6 * max(np.linalg.norm(x), 1e-30), jax.tree_util.keystr(path)
    for x, y in zip(jax.tree.leaves(copied.compute_params(b["params"])), jax.tree.leaves(b["compute"])):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
    # a restored state (checkpoints hold no copy) gets it back from place_state
    assert "compute" in place_state(copied, {k: v for k, v in b.items() if k != "compute"})
    with pytest.raises(TrainConfigError, match="compute_copy"):
        TrainConfig(compute_copy=True, compute_dtype="float32")


def test_packed_documents_loss_equals_separate_documents(cfg):
    """Packing: with segment ids the train loss of a packed row equals the loss of its documents run alone."""
    tc = TrainConfig(seq_len=24, batch_size=1, packing="segments", compute_dtype="float32", quant_sim=False)
    step = make_train_step(cfg, tc)
    state = step.init_state()
    hasher = default_hasher(cfg)
    rng = np.random.default_rng(5)
    docs = [rng.integers(3, 259, 14).astype(np.int32), rng.integers(3, 259, 10).astype(np.int32)]
    packed = {"tokens": np.concatenate(docs)[None], "segment_ids": np.array([[0] * 14 + [1] * 10], np.int32),
              "valid": np.ones((1, 24), bool)}
    packed["targets"] = np.concatenate([np.r_[d[1:], 0] for d in docs])[None]
    packed["loss_mask"] = np.array([[1] * 13 + [0] + [1] * 9 + [0]], np.float32)
    packed["engram_ids"] = hasher.row_ids(packed["tokens"], segment_ids=packed["segment_ids"])
    loss = jax.jit(lambda p, b: step.loss_fn(p, b)[1][0]["ce"])
    total = float(loss(state["params"], packed)) * 22
    alone = 0.0
    for d in docs:  # each document alone, right-padded to the same length (masked)
        tok = np.zeros((1, 24), np.int32)
        tok[0, :len(d)] = d
        tgt = np.zeros((1, 24), np.int32)
        tgt[0, :len(d) - 1] = d[1:]
        mask = np.zeros((1, 24), np.float32)
        mask[0, :len(d) - 1] = 1
        b = {"tokens": tok, "targets": tgt, "loss_mask": mask, "valid": np.ones((1, 24), bool),
             "segment_ids": np.where(np.arange(24) < len(d), 0, 1)[None].astype(np.int32)}
        b["engram_ids"] = hasher.row_ids(tok, segment_ids=b["segment_ids"])
        alone += float(loss(state["params"], b)) * (len(d) - 1)
    assert total == pytest.approx(alone, rel=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# bad input and the CLI
# ----------------------------------------------------------------------------------------------------------------

def _snapshot(path):
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = (fh.read(), os.stat(p).st_mtime_ns)
    return out


def test_bad_input_errors_and_nothing_overwritten(tmp_path, cfg):
    from dsv41_jax.checkpoint.hf import CheckpointError
    from dsv41_jax.checkpoint.orbax_ckpt import TrainCheckpointer

    corpus = write_corpus(str(tmp_path / "corpus"))
    tc = TrainConfig(steps=2, **STD)
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        train(cfg, tc, [str(tmp_path / "missing.txt")], ckpt_dir=ckpt, progress=False)
    assert not os.path.exists(ckpt)  # nothing created before the data is known to be good
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty corpus"):
        train(cfg, tc, [str(tmp_path / "empty")], ckpt_dir=ckpt, progress=False)
    with pytest.raises(TrainError, match="max_position_embeddings"):
        train(cfg.replace(max_position_embeddings=16), tc, [corpus], ckpt_dir=ckpt, progress=False)
    with pytest.raises(TrainConfigError, match="seq_len"):
        TrainConfig(seq_len=-4)
    # a checkpoint of another config
    other = cfg.replace(hidden_size=32)
    step = make_train_step(other, tc)
    ck = TrainCheckpointer(ckpt, async_save=False)
    ck.save(1, step.init_state(), data_position={"epoch": 0, "row": 0}, model_config=other, train_config=tc)
    ck.close()
    before = _snapshot(ckpt)
    with pytest.raises(CheckpointError, match="hidden_size: checkpoint 32 vs config 64"):
        train(cfg, tc, [corpus], ckpt_dir=ckpt, progress=False)
    assert _snapshot(ckpt) == before
    # a non-empty directory that is not a checkpoint is refused, untouched
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="refusing"):
        train(cfg, tc, [corpus], ckpt_dir=str(junk), progress=False)
    assert os.listdir(junk) == ["notes.txt"]


def test_cli_train_progress_metrics_and_resume(tmp_path, cfg, capsys):
    from dsv41_jax.checkpoint.orbax_ckpt import write_config_json
    from dsv41_jax.cli import main

    corpus = write_corpus(str(tmp_path / "corpus"))
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    write_config_json(str(cfg_dir), cfg)
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    args = ["train", "--config", str(cfg_dir / "config.json"), "--data", corpus, "--glob", "*.txt",
            "--steps", "4", "--seq-len", "32", "--batch-size", "2", "--weight-decay", "0", "--warmup", "2",
            "--ckpt-dir", ckpt, "--save-every", "2", "--metrics", metrics, "--log-every", "1",
            "--export", str(tmp_path / "export")]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "tok/s" in err and "balance" in err and "finished at step 4/4" in err
    lines = [json.loads(x) for x in open(metrics)]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert {"ce", "tokens_per_s", "balance", "grad_norm", "lr"} <= set(lines[0])
    assert sorted(int(d) for d in os.listdir(ckpt) if d.isdigit()) == [2, 4]
    # the same command with more steps resumes
    args[args.index("--steps") + 1] = "6"
    args = args[:-2]
    assert main(args) == 0
    assert "resumed from step 4" in capsys.readouterr().err
    # bad input: a clear message and exit status 2
    assert main(["train", "--config", "tiny", "--data", str(tmp_path / "nothing")]) == 2
    assert "training data not found" in capsys.readouterr().err



def test_per_layer_remat_gradients_equal_plain_gradients(cfg):
    """jax.checkpoint around each decoder layer recomputes the same math: float32 gradients of the LM loss + the
    indexer KL on packed documents (Engram, ratio-2 and ratio-1 Full layers, HSI pool) equal those without remat."""
    c3 = cfg.replace(name="tiny3", num_hidden_layers=3, compress_ratios=(0, 2, 1), kv_source_layer_ids=(1, 2),
                     index_source_layer_ids=(1, 2), candidate_source_layer_id=2, engram_layer_ids=(0,),
                     engram_num_embeddings=(660,), dspark_target_layer_ids=(0, 1, 2))
    batch = random_batch(c3, 2, 32, seed=3, hasher=default_hasher(c3))
    batch["segment_ids"] = np.repeat(np.array([[0] * 20 + [1] * 12]), 2, axis=0).astype(np.int32)
    base = TrainConfig(**STD, compute_dtype="float32", indexer_loss="sparse", quant_sim=False)
    plain = make_train_step(c3, base)
    layered = make_train_step(c3, base.replace(remat="full", remat_scope="layer"))
    params = plain.init_state(seed=0)["params"]
    grad = lambda step: jax.jit(jax.value_and_grad(step.loss_fn, has_aux=True))  # noqa: E731
    traced = grad(layered).trace(params, batch)  # one trace: its jaxpr is checked, then it is compiled and run
    assert str(traced.jaxpr).count("remat") == c3.num_hidden_layers  # one checkpoint per layer, none around the forward
    (ref_loss, _), ref = grad(plain)(params, batch)
    (loss, _), got = traced.lower().compile()(params, batch)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    # float32 rounding only (XLA fuses the recomputed forward differently; measured: per-leaf relative L2 error
    # ~1e-6, at most 1.4e-5 on a 3-element mHC scale whose gradient is a cancelling sum): each leaf's relative L2
    # error and every element's error relative to its leaf's largest entry under 1e-4, the whole gradient's under
    # 1e-5. A wiring error (a dropped state, a layer's input mixed up) would be O(1).
    sq_err = sq_ref = 0.0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * max(1e-30, float(np.abs(b).max())), err_msg=name)
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b), name
        sq_err, sq_ref = sq_err + float(np.sum((a - b) ** 2)), sq_ref + float(np.sum(b ** 2))
    assert sq_err ** 0.5 <= 1e-5 * sq_ref ** 0.5
    with pytest.raises(TrainConfigError, match="remat_scope"):
        TrainConfig(remat_scope="block")


def test_blocked_grouped_matmul_equals_ragged_dot():
    """The blocked grouped GEMM (no ragged_dot: XLA's GPU lowering multiplies every row by every expert) gives the
    ragged_dot values and gradients, with empty groups, groups longer than a block and a trailing empty block, and
    the MoE layer built on it equals the ragged one (float32)."""
    from dsv41_jax.ops.moe import blocked_grouped_matmul, moe

    rng = np.random.default_rng(0)
    hi = jax.lax.Precision.HIGHEST
    sizes = jnp.asarray([7, 0, 13, 1, 29, 0], jnp.int32)
    m = int(sizes.sum())
    rows = jnp.asarray(rng.standard_normal((m, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((6, 12, 16)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((m, 12)), jnp.float32)
    blocked = lambda r, w_: blocked_grouped_matmul(r, w_, sizes, block=8, precision=hi)  # noqa: E731
    ragged = lambda r, w_: jax.lax.ragged_dot(r, jnp.swapaxes(w_, 1, 2), sizes, precision=hi)  # noqa: E731
    # values and gradients of both in one jitted program (one compile, not one per primitive op by op)
    both = jax.jit(lambda r, w_: [(f(r, w_), jax.grad(lambda r, w_: jnp.sum(f(r, w_) * ct), (0, 1))(r, w_))
                                  for f in (blocked, ragged)])
    (y_b, g_b), (y_r, g_r) = both(rows, w)
    np.testing.assert_allclose(y_b, y_r, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_b, g_r):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    d, f, n_exp = 16, 24, 6
    params = random_moe_params(rng, d, f, n_exp)
    x = jnp.asarray(rng.standard_normal((2, 9, d)), jnp.float32)
    kw = dict(top_k=2, temp=1.0, scaling=1.5, limit=7.0)
    y_ragged, y_blocked = jax.jit(lambda x, p: [moe(x, p, impl=i, **kw)[0] for i in ("ragged", "blocked")])(x, params)
    np.testing.assert_allclose(y_blocked, y_ragged, rtol=1e-5, atol=1e-5)


def test_moe_impl_auto_picks_grouped_kernels_on_gpus_only(monkeypatch):
    """``auto`` (the default of ForwardOptions, TrainConfig and ``dsv41 train``) is the Mosaic GPU ragged-dot kernels
    on a Hopper GPU, the Pallas grouped GEMM on other GPU backends and ragged_dot elsewhere; an unknown name is an
    error naming the choices."""
    from dsv41_jax.model.forward import ForwardOptions
    from dsv41_jax.ops import moe as moe_ops

    assert ForwardOptions().moe_impl == "auto" and TrainConfig().moe_impl == "auto"
    for platform, hopper, want in (("gpu", False, "grouped"), ("cuda", False, "grouped"), ("gpu", True, "grouped_mgpu"),
                                   ("tpu", False, "ragged"), ("cpu", False, "ragged")):
        monkeypatch.setattr(moe_ops.jax, "default_backend", lambda p=platform: p)
        monkeypatch.setattr(moe_ops, "is_hopper_gpu", lambda h=hopper: h)
        assert moe_ops.resolve_moe_impl("auto") == want
    assert moe_ops.resolve_moe_impl("dense") == "dense"
    assert moe_ops.resolve_moe_impl("grouped") == "grouped"
    with pytest.raises(ValueError, match="moe impl 'tiled'"):
        moe_ops.resolve_moe_impl("tiled")
    with pytest.raises(TrainConfigError, match="moe_impl"):
        TrainConfig(moe_impl="tiled")
