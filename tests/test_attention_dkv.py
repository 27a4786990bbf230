"""The sparse-attention backward's key-centric dKV (``kernels.pallas_gpu.attention_bwd``, ``dkv="by_key"``, the
GPU default): exact against plain-JAX autodiff in float32, within bf16 rounding of float32 in bf16, on CPU in Pallas
interpret mode. Shapes are tiny but span several key blocks and query splits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import kernels as KN
from dsv41_jax.kernels import pallas_gpu as G


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite gradient"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def test_key_block_groups_invert_the_topk_lists():
    """Every (query, entry) pick lands in its block's group of that query, duplicates counted, -1 skipped, ids
    past the table clipped to its last row (like the forward's gather), groups of a block in query order."""
    rng = np.random.default_rng(0)
    b, c, k, n, bk = 2, 9, 7, 37, 16
    topk = rng.integers(-1, n + 3, size=(b, c, k))
    topk[..., 1::2] = topk[..., ::2][..., : topk[..., 1::2].shape[-1]]  # duplicates within lists
    query, count, grange = jax.jit(G._key_block_groups, static_argnums=(1, 2))(jnp.asarray(topk, jnp.int32), n, bk)
    query, count, grange = np.asarray(query), np.asarray(count), np.asarray(grange)
    nkb = -(-n // bk)
    for bi in range(b):
        want = np.zeros((c, nkb * bk))
        for ci in range(c):
            for e in topk[bi, ci]:
                if e >= 0:
                    want[ci, min(e, n - 1)] += 1
        got = np.zeros_like(want)
        assert grange[bi, 0] == 0
        for kb in range(nkb):
            qs = query[bi, grange[bi, kb]:grange[bi, kb + 1]]
            assert np.all(np.diff(qs) > 0), "one group per (block, query), ascending queries"
            got[qs, kb * bk:(kb + 1) * bk] += count[bi, grange[bi, kb]:grange[bi, kb + 1]]
            assert np.all(want[qs, kb * bk:(kb + 1) * bk].sum(axis=1) > 0), "no empty group"
        np.testing.assert_array_equal(got, want)


def _case(seed, dtype, t=40, h=2, d=16, n=40, k=24):
    rng = np.random.default_rng(seed)
    b = 2
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
    kv = jnp.asarray(rng.normal(size=(b, t, d)), dtype)
    ckv = jnp.asarray(rng.normal(size=(b, n, d)), dtype)
    topk = rng.integers(-1, n, size=(b, t, k))
    topk[..., 1::3] = topk[..., ::3][..., : topk[..., 1::3].shape[-1]]  # duplicates within a list
    sink = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    cut = t // 3  # row 0: two packed documents (positions restart); row 1: one, with a floor
    seg = jnp.asarray([[0] * cut + [1] * (t - cut), [0] * t], jnp.int32)
    pos = jnp.asarray(np.stack([np.r_[np.arange(cut), np.arange(t - cut)], np.arange(t) + 3]), jnp.int32)
    return q, kv, ckv, jnp.asarray(topk, jnp.int32), sink, pos, seg, jnp.asarray([0, 7], jnp.int32)


def _grads(fn, q, kv, ckv, sink, ct):
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct), argnums=(0, 1, 2, 3)))(
        q, kv, ckv, sink)


@pytest.mark.parametrize("tuning,k", [({"bwd_key_block": 16, "bwd_key_splits": 2}, 24),
                                      ({}, 6)])  # lists < N / 4 wide: selected rows by scatter-add, window by key
def test_by_key_backward_equals_autodiff_float32(tuning, k):
    """Window of 8 over 40 tokens (3 window blocks of 16 slots), 24 picks among 40 entries (3 entry blocks), two
    query splits per block, packed documents, a floor, duplicates and -1 slots: every gradient equals the
    reference's autodiff gradient up to float32 summation order. Narrow lists: the default for selected rows is
    the scatter-add (``BY_KEY_MIN_FILL``), the window rows still by key."""
    q, kv, ckv, topk, sink, pos, seg, floor = _case(0, jnp.float32, k=k)
    ct = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    def attn(be, tuning=None):
        def f(q_, kv_, ckv_, sink_):
            kw = {} if be == "reference" else {"tuning": tuning}
            return KN.sequence_sparse_attention(q_, kv_, pos, ckv_, topk, sink_, window=8, floor=floor, chunk=16,
                                                segments=seg, backend=be, **kw)
        return f

    want = _grads(attn("reference"), q, kv, ckv, sink, ct)
    got = _grads(attn("pallas_gpu_interpret", tuning), q, kv, ckv, sink, ct)
    errs = {name: _rel(g, w) for name, g, w in zip(("dq", "dkv", "dckv", "dsink"), got, want)}
    assert all(e < 1e-5 for e in errs.values()), errs


def test_by_key_backward_bf16_matches_float32():
    """bf16 inputs, loss = sum of outputs (same-sign contributions: the case where a 16-bit sum stalls): the
    by-key gradients against the float32 reference on the same upcast inputs."""
    q, kv, ckv, topk, sink, pos, seg, floor = _case(2, jnp.bfloat16, t=64, n=32, k=32)
    ct = jnp.ones(q.shape, jnp.float32)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731

    def attn(be):
        def f(q_, kv_, ckv_, sink_):
            return KN.sequence_sparse_attention(q_, kv_, pos, ckv_, topk, sink_, window=16, floor=floor, chunk=64,
                                                segments=seg, backend=be)
        return f

    want = _grads(attn("reference"), up(q), up(kv), up(ckv), sink, ct)
    got = _grads(attn("pallas_gpu_interpret"), q, kv, ckv, sink, ct)
    errs = {name: _rel(g, w) for name, g, w in zip(("dq", "dkv", "dckv", "dsink"), got, want)}
    assert all(e <= 1e-2 for e in errs.values()), errs
