"""bf16 gradients where many contributions meet, judged against float32 gradients on the same (upcast) inputs.

A compressed KV entry picked by hundreds of queries, an indexer key scored by every later query, an embedding row
read by thousands of tokens and an Engram row shared by many n-grams each sum hundreds of same-sign contributions
in their gradient. Summed in bf16 (a gather's scatter-add transpose, a ``lax.map`` carry) that sum stalls; summed in
float32 and rounded once, the bf16 gradient stays within bf16's own rounding of the float32 one.

Bound: relative L2 error ||g_bf16 - g_f32|| / ||g_f32|| <= 1e-2 for every gradient. Sizes are the smallest at
which the float32-vs-bf16 accumulation defect shows clearly on CPU (T in the thousands, a few heads).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import kernels

BOUND = 1e-2
BF16 = jnp.bfloat16


def _rel(got, want) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _up(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _attention_inputs(t=2048, h=2, d=64, n=64, k=64, seed=0):
    """Random bf16 inputs: every query picks k of the entries visible to it (n entries, one per t // n tokens)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((1, t, h, d)), BF16)
    kv = jnp.asarray(rng.standard_normal((1, t, d)), BF16)
    ckv = jnp.asarray(rng.standard_normal((1, n, d)), BF16)
    vis = (np.arange(t) + 1) // (t // n)
    topk = np.full((1, t, k), -1, np.int32)
    for i in range(t):
        m = min(int(vis[i]), k)
        topk[0, i, :m] = np.sort(rng.choice(int(vis[i]), m, replace=False)) if m else []
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    return q, kv, ckv, jnp.asarray(topk), sink, pos


def _attention_grads(fn, q, kv, ckv, sink):
    # loss = sum of outputs: every entry's contributions share a sign, the worst case for a stalled sum
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3)))(q, kv, ckv, sink)


def test_sparse_attention_bf16_gradients_match_float32():
    q, kv, ckv, topk, sink, pos = _attention_inputs()

    def attn(q_, kv_, ckv_, sink_):
        return kernels.sequence_sparse_attention(q_, kv_, pos, ckv_, topk, sink_, window=16, chunk=256,
                                                 backend="reference")

    want = _attention_grads(attn, *_up((q, kv, ckv, sink)))
    got = _attention_grads(attn, q, kv, ckv, sink)
    errs = {name: _rel(g, w) for name, g, w in zip(("dq", "dkv", "dckv", "dsink"), got, want)}
    assert all(e <= BOUND for e in errs.values()), errs


def test_reference_recompute_backward_bf16_matches_float32():
    """The backward the kernel backends use with ``tuning={"fused_bwd": False}``."""
    from dsv41_jax.kernels import _AttnCfg, _attention_bwd, _attn_reference

    q, kv, ckv, topk, sink, pos = _attention_inputs(seed=1)
    b, t = pos.shape
    cfg = _AttnCfg("pallas_tpu_interpret", "sequence", 16, 64 ** -0.5, 16, 256, (("fused_bwd", False),))
    wstart = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) - 15, (b, t))
    floor = jnp.zeros((b,), jnp.int32)

    def grads(q_, kv_, ckv_, sink_):
        out = _attn_reference(cfg, q_, pos, kv_, pos, floor, ckv_, topk, sink_, None, None)
        res = (q_, pos, kv_, pos, wstart, floor, ckv_, topk, sink_, None, None, out, None)
        g = _attention_bwd(cfg, res, jnp.ones_like(out))
        return g[0], g[2], g[6], g[8]

    want = jax.jit(grads)(*_up((q, kv, ckv, sink)))
    got = jax.jit(grads)(q, kv, ckv, sink)
    errs = {name: _rel(g, w) for name, g, w in zip(("dq", "dkv", "dckv", "dsink"), got, want)}
    assert all(e <= BOUND for e in errs.values()), errs


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_indexer_kl_key_gradient_bf16_matches_float32(mode):
    """The indexer keys' gradient in the KL objective (every later query scores a key): bf16 keys vs the same keys
    upcast, every other input float32, so the forward is identical and only the gradient's summation differs."""
    from dsv41_jax.ops.attention import sequence_window_lse
    from dsv41_jax.train.loss import indexer_kl_sum

    rng = np.random.default_rng(6)
    t, n, h, d, hi, di, ratio = 2048, 1024, 2, 32, 4, 32, 2
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    q, kv, win, qi, w = f32(1, t, h, d), f32(1, n, d), f32(1, t, d), f32(1, t, hi, di), f32(1, t, hi)
    keys = jnp.asarray(rng.standard_normal((1, n, di)), BF16)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    outside = sequence_window_lse(q, win, pos, f32(h), window=16, chunk=16)
    topk = None
    if mode == "sparse":  # 16 picks per query among the first 32 entries: ~1000 queries read each of them
        picks = np.sort(np.stack([rng.choice(32, 16, replace=False) for _ in range(t)]), axis=-1)[None]
        picks[:, :64] = -1
        topk = jnp.asarray(picks, jnp.int32)

    def grad(k):
        return jax.jit(jax.grad(lambda k_: indexer_kl_sum(q, kv, outside, qi, w, k_, jnp.ones((1, t)), pos,
                                                           ratio=ratio, mode=mode, topk=topk, chunk=16)[0]))(k)

    err = _rel(grad(keys), grad(keys.astype(jnp.float32)))
    assert err <= BOUND, err


def test_token_embedding_bf16_gradient_matches_float32():
    from dsv41_jax.model.forward import embed_tokens

    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.standard_normal((64, 32)), BF16)
    tokens = jnp.asarray(rng.integers(0, 16, (2, 4096)), jnp.int32)  # ~512 reads per used row
    w = jnp.asarray(rng.uniform(0.5, 1.5, (2, 4096, 32)), jnp.float32)  # same-sign, not exactly summable

    def grad(tab):
        return jax.jit(jax.grad(lambda x: jnp.sum(embed_tokens(x, tokens).astype(jnp.float32) * w)))(tab)

    err = _rel(grad(table), grad(table.astype(jnp.float32)))
    assert err <= BOUND, err


def test_engram_table_bf16_gradient_matches_float32():
    from dsv41_jax.ops.engram import engram_write

    rng = np.random.default_rng(4)
    b, t, hc, d, cols, ehd, rows = 1, 2048, 2, 32, 4, 16, 20
    # q_weight = 0 holds the gate at sigmoid(sqrt(clamp)): the square root's infinite slope at a zero dot would
    # otherwise turn bf16 rounding of the forward into gate-gradient noise that has nothing to do with summation
    params = {"embed": rng.standard_normal((rows, ehd)), "wkv": 0.3 * rng.standard_normal(((hc + 1) * d, cols * ehd)),
              "q_weight": np.zeros((hc, d)), "k_weight": rng.standard_normal((hc, d))}
    params = {k: jnp.asarray(v, BF16) for k, v in params.items()}
    streams = jnp.asarray(rng.standard_normal((b, t, hc, d)), BF16)
    row_ids = jnp.asarray(rng.integers(0, rows, (b, t, cols)), jnp.int32)  # ~400 reads per row

    def grad(p, s):
        return jax.jit(jax.grad(lambda p_: jnp.sum(engram_write(s, row_ids, p_, eps=1e-6).astype(jnp.float32))))(p)

    want = grad(_up(params), streams.astype(jnp.float32))
    got = grad(params, streams)
    errs = {k: _rel(got[k], want[k]) for k in ("embed", "wkv")}
    assert all(e <= BOUND for e in errs.values()), errs


# ----------------------------------------------------------------------------------------------------------------
# the official V4.1 numerics (SPEC §12) and their HF-port switches
# ----------------------------------------------------------------------------------------------------------------

def test_rms_norm_and_head_follow_the_official_rounding():
    from dsv41_jax.ops.linear import head_logits
    from dsv41_jax.ops.norms import rms_norm

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 64)), BF16)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(64), BF16)
    x32 = x.astype(jnp.float32)
    normed = x32 / np.sqrt(np.mean(np.square(np.asarray(x32)), -1, keepdims=True) + 1e-6)
    official = rms_norm(x, w, 1e-6)
    assert official.dtype == BF16
    np.testing.assert_array_equal(np.asarray(official, np.float32),
                                  np.asarray((w.astype(jnp.float32) * normed).astype(BF16), np.float32))
    hf = rms_norm(x, w, 1e-6, hf_rounding=True)
    np.testing.assert_array_equal(np.asarray(hf, np.float32), np.asarray(w * normed.astype(BF16), np.float32))
    assert not np.array_equal(np.asarray(hf, np.float32), np.asarray(official, np.float32))  # bf16 tells them apart
    np.testing.assert_array_equal(rms_norm(x32, w.astype(jnp.float32), 1e-6),
                                  rms_norm(x32, w.astype(jnp.float32), 1e-6, hf_rounding=True))  # fp32: identical

    head = jnp.asarray(rng.standard_normal((50, 64)), BF16)
    logits = head_logits(x, head)
    assert logits.dtype == jnp.float32
    exact = np.asarray(x, np.float64) @ np.asarray(head, np.float64).T  # x.float() @ head.float()
    np.testing.assert_allclose(np.asarray(logits), exact, rtol=1e-5, atol=1e-5)
    hf_logits = head_logits(x, head, hf_rounding=True)  # lm_head(x).float(): rounded to bf16 first
    np.testing.assert_array_equal(np.asarray(hf_logits), np.asarray(jnp.asarray(exact, jnp.float32).astype(BF16),
                                                                     np.float32))


def test_head_bf16_backward_runs_16bit_gemms_and_matches_float32():
    """The fp32 head's backward rounds the logits' cotangent to bf16 once and runs bf16 GEMMs with float32
    accumulation (not float32 GEMMs: TF32 on GPUs, a slow kernel of the train step); both gradients stay within the
    bound of the float32 gradients on upcast inputs, summed over 1,024 tokens."""
    from dsv41_jax.ops.linear import head_logits

    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((4, 256, 64)), BF16)
    head = jnp.asarray(rng.standard_normal((300, 64)) / 8, BF16)
    target = jnp.asarray(rng.integers(0, 300, (4, 256)))

    def loss(h, w):
        logits = head_logits(h, w)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), target[..., None], -1))

    got = jax.grad(loss, (0, 1))(x, head)
    want = jax.grad(loss, (0, 1))(*_up((x, head)))
    assert got[0].dtype == BF16 and got[1].dtype == BF16
    errs = [_rel(a, b) for a, b in zip(got, want)]
    assert max(errs) <= BOUND, errs
    hlo = jax.jit(jax.grad(loss, (0, 1))).lower(x, head).as_text()
    operands = [re.search(r"\((tensor<[^>]*>), (tensor<[^>]*>)\) ->", ln).groups()
                for ln in hlo.splitlines() if "dot_general" in ln]
    assert len(operands) == 3 and all(t.endswith("bf16>") for pair in operands for t in pair), operands


def test_yarn_factor_is_read_from_the_config():
    from dsv41_jax.config import ModelConfig

    d = {"num_hidden_layers": 40, "num_nextn_predict_layers": 3, "max_position_embeddings": 1048576,
         "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 65536,
                          "beta_fast": 32, "beta_slow": 1}}
    assert ModelConfig.from_hf_dict(d).compress_yarn.factor == 8.0  # official: the field as written
    assert ModelConfig.from_hf_dict(d, yarn_factor="hf").compress_yarn.factor == 16.0  # HF: max_pos / original
    del d["rope_scaling"]["factor"]
    assert ModelConfig.from_hf_dict(d).compress_yarn.factor == 16.0
    with pytest.raises(ValueError, match="yarn_factor"):
        ModelConfig.from_hf_dict(d, yarn_factor="bogus")
