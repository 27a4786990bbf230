"""The Mosaic TPU backward of sparse attention (``kernels.pallas_tpu.attention_bwd``: dQ per query, dKV by key block
with float32 sums, no atomics), in TPU interpret mode on CPU: bf16 gradients against float32 gradients on the same
upcast inputs, and the reader lists the selected rows' dKV kernel walks. (Float32 gradients equal the reference's
autodiff in tests/test_kernels.py, which routes both attention forms through this backward; the kernels compile for
v5p in tests/test_kernels_tpu_aot.py.)"""

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import kernels as KN
from dsv41_jax.kernels import pallas_tpu as T

BOUND = 1e-2  # bf16 gradients vs float32 on upcast inputs (relative Frobenius error per tensor)


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite gradient"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def test_block_readers_list_each_blocks_queries():
    rng = np.random.default_rng(0)
    b, c, k, n, bk = 2, 6, 5, 37, 16
    topk = rng.integers(-1, n + 3, size=(b, c, k))  # ids past the table read its last row, like the forward
    readers, count = jax.jit(T._block_readers, static_argnums=(1, 2))(jnp.asarray(topk, jnp.int32), n, bk)
    readers, count = np.asarray(readers)[:, :, 0], np.asarray(count)
    for bi in range(b):
        for kb in range(-(-n // bk)):
            want = [ci for ci in range(c) if any(e >= 0 and min(e, n - 1) // bk == kb for e in topk[bi, ci])]
            assert count[bi, kb] == len(want)
            assert list(readers[bi, kb, :len(want)]) == want


def test_tpu_backward_bf16_matches_float32():
    """bf16 inputs, loss = sum of outputs (every entry's contributions share a sign: where a 16-bit sum stalls),
    two packed documents above a floor; 40 tokens read 3 window blocks and 2 compressed blocks of 16 rows, lists
    with duplicates and empty slots. Reference: the plain-JAX forward's float32 gradients on the upcast inputs."""
    rng = np.random.default_rng(3)
    b, t, h, d, n, k, window = 1, 40, 2, 16, 24, 8, 16
    bf = jnp.bfloat16
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), bf)
    kv = jnp.asarray(rng.normal(size=(b, t, d)), bf)
    ckv = jnp.asarray(rng.normal(size=(b, n, d)), bf)
    topk = rng.integers(-1, n, size=(b, t, k))
    topk[..., 1::3] = topk[..., ::3][..., : topk[..., 1::3].shape[-1]]  # duplicates within a list
    topk = jnp.asarray(topk, jnp.int32)
    sink = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    seg = jnp.asarray([[0] * 18 + [1] * 22], jnp.int32)
    pos = jnp.asarray([np.r_[np.arange(18), np.arange(22)] + 2], jnp.int32)
    floor = jnp.asarray([3], jnp.int32)

    def grads(backend, *args):
        def loss(q_, kv_, ckv_, sink_):
            o = KN.sequence_sparse_attention(q_, kv_, pos, ckv_, topk, sink_, window=window, floor=floor, chunk=40,
                                             segments=seg, backend=backend)
            return jnp.sum(o.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)

    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = grads("reference", up(q), up(kv), up(ckv), sink)
    got = grads("pallas_tpu_interpret", q, kv, ckv, sink)
    assert [g.dtype for g in got] == [bf, bf, bf, jnp.float32]
    errs = {name: _rel(g, w) for name, g, w in zip(("dq", "dkv", "dckv", "dsink"), got, want)}
    print("bf16 vs float32 gradients:", errs)
    assert all(e <= BOUND for e in errs.values()), errs
