"""Kernels (dsv41_jax.kernels) == the plain-JAX reference, on CPU in Pallas interpret mode (forward and gradients).

Both kernel families run here: the GPU (Triton-lowered) kernels with ``interpret=True`` and the TPU Mosaic kernels
in TPU interpret mode (simulated DMAs / semaphores / SMEM). Property cases draw random shapes per seed, with ragged
window lengths (< window), -1 padding, duplicate indices, floors, packed documents and top-k wider than the visible
count. Interpret-mode compiles dominate the cost, so shapes are small and few.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compiled
from dsv41_jax import kernels as KN
from dsv41_jax.kernels import hier_topk as HT
from dsv41_jax.kernels import pallas_gpu as G
from dsv41_jax.ops import attention as RA
from dsv41_jax.ops import indexer as RI
from dsv41_jax.train.testing import every_role_config

BACKENDS = ["pallas_gpu_interpret", "pallas_tpu_interpret"]


def _close(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite kernel output"
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


def test_dispatch_resolution():
    assert KN.resolve_backend("auto") == "reference"  # CPU
    assert KN.resolve_backend("pallas_tpu") == "pallas_tpu"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        KN.resolve_backend("cuda")
    assert KN.backward_kind("pallas_gpu") == "fused"
    assert KN.backward_kind("pallas_gpu", jnp.bfloat16) == "fused"  # accurate in bf16 too (fp32 atomics)
    assert KN.backward_kind("pallas_gpu_interpret", jnp.bfloat16) == "fused"
    assert KN.backward_kind("pallas_tpu") == "fused"  # the Mosaic backward kernels (float32 sums)
    assert KN.backward_kind("pallas_tpu", jnp.bfloat16) == "fused"


def _decode_case(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    b, c = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    h, d = 4, 32
    window = 8
    l = int(rng.integers(3, window + 1))  # ring shorter than the window
    n = int(rng.integers(5, 40))
    k = int(rng.integers(1, 2 * n))  # may exceed the entries that exist
    q = jnp.asarray(rng.normal(size=(b, c, h, d)), dtype)
    win = jnp.asarray(rng.normal(size=(b, l, d)), dtype)
    qpos = jnp.asarray(rng.integers(0, 30, size=(b, c)), jnp.int32)
    wpos = jnp.asarray(rng.integers(-1, 30, size=(b, l)), jnp.int32)  # -1 = empty ring slot
    ckv = jnp.asarray(rng.normal(size=(b, n, d)), dtype)
    topk = rng.integers(-1, n, size=(b, c, k))
    topk[..., 1::3] = topk[..., ::3][..., : topk[..., 1::3].shape[-1]]  # duplicates
    topk = jnp.asarray(topk, jnp.int32)
    sink = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    floor = jnp.asarray(rng.integers(0, 10, size=(b,)), jnp.int32)
    return dict(q=q, qpos=qpos, win=win, wpos=wpos, ckv=ckv, topk=topk, sink=sink, floor=floor, window=window)


@pytest.mark.parametrize("backend,seed", [("pallas_gpu_interpret", 0), ("pallas_tpu_interpret", 1)])
def test_decode_attention_fwd_and_grads(backend, seed):
    x = _decode_case(seed)
    window = x.pop("window")

    def run(fn, x):
        def f(q, win, ckv, sink):
            o = fn(q, x["qpos"], win, x["wpos"], ckv, x["topk"], sink, window=window, floor=x["floor"])
            return jnp.sum(o * jnp.sin(o)), o
        (_, o), g = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(x["q"], x["win"], x["ckv"], x["sink"])
        return o, g

    (o_r, g_r), (o_k, g_k) = compiled(lambda x: (
        run(RA.sparse_attention, x), run(lambda *a, **k: KN.sparse_attention(*a, **k, backend=backend), x)), x)
    _close(o_k, o_r, 1e-5)
    for a, b in zip(g_k, g_r):
        _close(a, b, 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_attention_bf16(backend):
    x = _decode_case(3, jnp.bfloat16)
    window = x.pop("window")
    f32 = lambda a: a.astype(jnp.float32)
    ref, out = compiled(lambda x: (
        RA.sparse_attention(f32(x["q"]), x["qpos"], f32(x["win"]), x["wpos"], f32(x["ckv"]), x["topk"], x["sink"],
                            window=window, floor=x["floor"]),
        KN.sparse_attention(x["q"], x["qpos"], x["win"], x["wpos"], x["ckv"], x["topk"], x["sink"], window=window,
                            floor=x["floor"], backend=backend)), x)
    assert out.dtype == jnp.bfloat16
    _close(out, ref, 2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_attention_fwd_and_grads(backend):
    """Prefill / training form: T not a multiple of the chunk, offset positions, floors, packed documents."""
    rng = np.random.default_rng(7)
    b, t, h, d, n, k, window = 2, 19, 4, 32, 7, 5, 6
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    ckv = jnp.asarray(rng.normal(size=(b, n, d)), jnp.float32)
    topk = jnp.asarray(rng.integers(-1, n, size=(b, t, k)), jnp.int32)
    sink = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    seg = jnp.asarray([[0] * 7 + [1] * 12, [0] * 19], jnp.int32)
    doc_pos = jnp.asarray(np.stack([np.r_[np.arange(7), np.arange(12)], np.arange(19) + 3]), jnp.int32)
    inc_pos = jnp.asarray(np.stack([np.arange(19), np.arange(19) + 3]), jnp.int32)  # strictly increasing
    # one case per backend keeps the interpret-mode cost down: floors on GPU, packed documents on TPU
    cases = {"pallas_gpu_interpret": (None, jnp.asarray([0, 9], jnp.int32), inc_pos),
             "pallas_tpu_interpret": (seg, 0, doc_pos)}
    for segments, floor, pos in (cases[backend],):
        def run(fn, q, kv, pos, ckv, topk, sink, floor, segments):
            def f(q_, kv_, c_, s_):
                o = fn(q_, kv_, pos, c_, topk, s_, window=window, floor=floor, chunk=8,
                       **({} if segments is None else {"segments": segments}))
                return jnp.sum(jnp.tanh(o)), o
            return jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(q, kv, ckv, sink)

        ((_, o_r), g_r), ((_, o_k), g_k) = compiled(lambda *a: (
            run(RA.sequence_sparse_attention, *a),
            run(lambda *a_, **kw: KN.sequence_sparse_attention(*a_, **kw, backend=backend), *a)),
            q, kv, pos, ckv, topk, sink, floor, segments)
        _close(o_k, o_r, 1e-5)
        for a, b_ in zip(g_k, g_r):
            _close(a, b_, 1e-4)


def test_banded_chunk_attention_equals_the_mapped_reference():
    """A prefill chunk longer than the query block (ring of W rows, then the chunk's): the banded kernel call (each
    query scans only its window's rows) equals the reference mapped over query blocks. A ring partly empty (pos0 <
    W) and a full one, padded chunk rows (no key), a floor, top-k with -1 padding; window < W so the band's span
    starts inside the ring."""
    from dsv41_jax.inference.step import chunk_attention, ring_positions

    rng = np.random.default_rng(12)
    b, c, w, window, h, d, n, k = 2, 11, 8, 6, 4, 32, 9, 5
    pos0 = jnp.asarray([3, 20], jnp.int32)
    n_valid = jnp.asarray([9, 11], jnp.int32)
    pos = pos0[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
    win_pos = jnp.concatenate([ring_positions(pos0, w), jnp.where(jnp.arange(c)[None] < n_valid[:, None], pos, -1)],
                              axis=1)
    q = jnp.asarray(rng.normal(size=(b, c, h, d)), jnp.float32)
    win_kv = jnp.asarray(rng.normal(size=(b, w + c, d)), jnp.float32)
    ckv = jnp.asarray(rng.normal(size=(b, n, d)), jnp.float32)
    topk = jnp.asarray(rng.integers(-1, n, size=(b, c, k)), jnp.int32)
    sink = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    floor = jnp.asarray([0, 17], jnp.int32)
    args = (q, pos, win_kv, win_pos, ckv, topk, sink)
    want = chunk_attention(*args, window=window, floor=floor, q_block=4, backend="reference")
    got = chunk_attention(*args, window=window, floor=floor, q_block=4, backend="pallas_gpu_interpret", banded=True)
    _close(got, want, 1e-5)


def test_sequence_attention_bwd_rotated_loop_order():
    """The GPU backward with ``bwd_rotate`` (each program starts its window / selected-row loops at its own block:
    3 window blocks and 3 selected-row blocks of 16 rows here) gives the reference gradients."""
    rng = np.random.default_rng(8)
    b, t, h, d, n, k, window = 1, 40, 2, 16, 40, 40, 40
    q, kv, ckv = (jnp.asarray(rng.normal(size=s_), jnp.float32) for s_ in ((b, t, h, d), (b, t, d), (b, n, d)))
    topk = jnp.asarray(rng.integers(-1, n, size=(b, t, k)), jnp.int32)
    sink = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]

    def grads(fn, q, kv, pos, ckv, topk, sink):
        return jax.grad(lambda q_, kv_, c_, s_: jnp.sum(jnp.tanh(fn(q_, kv_, pos, c_, topk, s_, window=window))),
                        argnums=(0, 1, 2, 3))(q, kv, ckv, sink)

    want, got = compiled(lambda *a: (
        grads(RA.sequence_sparse_attention, *a),
        grads(lambda *a_, **kw: KN.sequence_sparse_attention(*a_, **kw, backend="pallas_gpu_interpret",
                                                             tuning={"bwd_rotate": True}), *a)),
        q, kv, pos, ckv, topk, sink)
    for a, b_ in zip(got, want):
        _close(a, b_, 1e-4)


def _indexer_case(seed, n, ratio, t=6):
    """Exactly representable inputs (small integers, weights k/4, head dim 64): every score is exact in fp32 in any
    summation order, so kernel and reference index sets must agree bit for bit — with many exact ties."""
    rng = np.random.default_rng(seed)
    b, hi, di = 2, 16, 64
    q = jnp.asarray(rng.integers(-2, 3, size=(b, t, hi, di)), jnp.float32)
    keys = jnp.asarray(rng.integers(-2, 3, size=(b, n, di)), jnp.float32)
    w = jnp.asarray(rng.integers(-4, 5, size=(b, t, hi)) / 4, jnp.float32)
    qpos = jnp.asarray(rng.integers(0, n * ratio + 3, size=(b, t)), jnp.int32)
    qpos = qpos.at[0, 0].set(0).at[1, 0].set(2 * ratio)  # few visible entries: top-k wider than visible
    return q, w, keys, qpos


@pytest.mark.parametrize("backend,n,ratio,block", [("pallas_gpu_interpret", 300, 2, 2),
                                                    ("pallas_tpu_interpret", 700, 1, 8)])
def test_indexer_hsi_reindex_exact(backend, n, ratio, block):
    q, w, keys, qpos = _indexer_case(n, n, ratio)
    k, blocks = 12, 20
    n_blocks = -(-n // block)

    def run(q, w, keys, qpos):
        r_sel, r_pool = RI.indexer_topk(q, w, keys, qpos, ratio=ratio, topk=k, block_size=block,
                                        candidate_topk_blocks=blocks)
        k_sel, k_pool = KN.indexer_topk(q, w, keys, qpos, ratio=ratio, topk=k, block_size=block,
                                        candidate_topk_blocks=blocks, backend=backend)
        # Reindex: pool-restricted top-k from the ids pool (kernels) and from the reference mask
        r2, _ = RI.indexer_topk(q, w, keys, qpos, ratio=ratio, topk=k, block_size=block, pool=r_pool)
        k2, _ = KN.indexer_topk(q, w, keys, qpos, ratio=ratio, topk=k, block_size=block, pool=k_pool,
                                backend=backend)
        return r_sel, r_pool, k_sel, KN.pool_ids_to_mask(k_pool, n_blocks), r2, k2

    r_sel, r_pool, k_sel, k_mask, r2, k2 = compiled(run, q, w, keys, qpos)
    np.testing.assert_array_equal(k_sel, r_sel)
    np.testing.assert_array_equal(k_mask, r_pool)
    np.testing.assert_array_equal(k2, r2)


def test_indexer_short_context_in_a_long_cache_gpu_interpret():
    """Every query sees only the first entries of a long cache (a decode step early in a large allocation): the
    score kernel skips the unseen tiles and must still report them as -inf (same sets and HSI pool)."""
    q, w, keys, _ = _indexer_case(5, 1200, 1)
    qpos = jnp.asarray([[3, 40, 150, 199, 0, 77], [12, 0, 255, 100, 5, 9]], jnp.int32)
    def run(q, w, keys, qpos):
        r_sel, r_pool = RI.indexer_topk(q, w, keys, qpos, ratio=1, topk=16, block_size=8, candidate_topk_blocks=6)
        k_sel, k_pool = KN.indexer_topk(q, w, keys, qpos, ratio=1, topk=16, block_size=8, candidate_topk_blocks=6,
                                        backend="pallas_gpu_interpret")
        return r_sel, r_pool, k_sel, KN.pool_ids_to_mask(k_pool, 150)

    r_sel, r_pool, k_sel, k_mask = compiled(run, q, w, keys, qpos)
    np.testing.assert_array_equal(k_sel, r_sel)
    np.testing.assert_array_equal(k_mask, r_pool)


def test_indexer_random_floats_gpu_interpret():
    """Random float scores: sets equal up to near-ties (a swapped pair must have equal reference scores)."""
    rng = np.random.default_rng(11)
    b, t, hi, di, n = 1, 4, 16, 32, 500
    q = jnp.asarray(rng.normal(size=(b, t, hi, di)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(b, n, di)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, hi)), jnp.float32) * hi ** -0.5
    qpos = jnp.asarray([[499, 350, 90, 3]], jnp.int32)
    r_sel, k_sel, scores = compiled(lambda q, w, keys, qpos: (
        RI.indexer_topk(q, w, keys, qpos, ratio=1, topk=40)[0],
        KN.indexer_topk(q, w, keys, qpos, ratio=1, topk=40, backend="pallas_gpu_interpret")[0],
        RI.mask_invisible(RI.indexer_scores(q, w, keys), qpos, 1)), q, w, keys, qpos)
    scores = np.asarray(scores)
    for row in range(t):
        a, b_ = set(np.asarray(k_sel)[0, row]) - {-1}, set(np.asarray(r_sel)[0, row]) - {-1}
        diff = a ^ b_
        if diff:  # only acceptable at a numerical tie with the k-th score
            kth = np.sort(scores[0, row])[::-1][len(b_) - 1]
            assert all(abs(scores[0, row, i] - kth) <= 1e-5 * max(1, abs(kth)) for i in diff)


def test_select_kernel_ties_padding_and_small_k():
    rng = np.random.default_rng(5)
    v = np.round(rng.normal(size=(3, 5, 300)) * 4) / 4  # many exact ties
    v[rng.random(v.shape) < 0.3] = -np.inf
    v[0, 0, :] = -np.inf  # nothing valid
    v[0, 1, 3:] = -np.inf  # fewer valid than k
    v[1, 2, 10] = -0.0
    v[1, 2, 11] = 0.0
    v = jnp.asarray(v, jnp.float32)
    ids = jnp.broadcast_to(jnp.arange(300, dtype=jnp.int32), v.shape)
    ks = (1, 7, 64, 400)
    kernel, want, xla = compiled(lambda v, ids: (
        G.select(v, ids, 64, interpret=True), [RI.select_topk(v, k) for k in ks],
        [HT.select_xla(v, ids, k) for k in ks]), v, ids)
    np.testing.assert_array_equal(kernel, want[ks.index(64)])
    for k, got, ref in zip(ks, xla, want):
        np.testing.assert_array_equal(got, ref, err_msg=f"k={k}")


@pytest.mark.parametrize("seed", range(4))
def test_hierarchical_topk_property(seed):
    """The hierarchy (superblocks -> blocks -> entries) is exact: random shapes, ties, -inf, pinned blocks."""
    rng = np.random.default_rng(100 + seed)
    b, c = 2, 3
    n = int(rng.integers(1, 3000))
    g1 = int(2 ** rng.integers(0, 4))
    k = int(rng.integers(1, 300))
    kb = int(rng.integers(1, 300))
    s = np.round(rng.normal(size=(b, c, n)) * 3) / 3
    s[rng.random(s.shape) < 0.2] = -np.inf
    vis = rng.integers(0, n + 1, size=(b, c))
    s = np.where(np.arange(n) < vis[..., None], s, -np.inf)
    scores = jnp.asarray(s, jnp.float32)
    nb, ns = -(-n // g1), -(-n // (g1 * HT.G2))
    pad = jnp.pad(scores, ((0, 0), (0, 0), (0, nb * g1 - n)), constant_values=-jnp.inf)
    bmax = pad.reshape(b, c, nb, g1).max(-1)
    smax = jnp.pad(bmax, ((0, 0), (0, 0), (0, ns * HT.G2 - nb)), constant_values=-jnp.inf).reshape(
        b, c, ns, HT.G2).max(-1)
    qpos = jnp.asarray(vis - 1, jnp.int32)  # ratio 1: visible count = q_pos + 1

    @jax.jit  # one compile per case instead of op-by-op dispatch
    def both(scores, bmax, smax, qpos):
        leaf = lambda cand: jnp.where(cand >= 0, jnp.take_along_axis(scores, jnp.maximum(cand, 0), -1), -jnp.inf)
        got = HT.top_entries(bmax, smax, n, g1, k, HT.select_xla, leaf, direct_max=8)
        vis_ = qpos + 1
        newest = jnp.where(vis_ > 0, (vis_ - 1) // g1, -1)
        ids = HT.top_blocks(*HT.pin_newest(bmax, smax, newest), kb, HT.select_xla, direct_max=8)
        cand = HT.pool_entries(ids, g1, n)
        got2 = HT.select_in_pool(leaf(cand), cand, g1, k, n, HT.select_xla, direct_max=8)
        ref_pool = RI.candidate_blocks(scores, qpos, 1, g1, kb)
        refs = (RI.select_topk(scores, k), ref_pool, KN.pool_mask_to_ids(ref_pool, kb),
                RI.select_topk(RI.restrict_to_pool(scores, ref_pool, g1), k))
        return (got, KN.pool_ids_to_mask(ids, nb), ids, got2), refs

    mine, refs = both(scores, bmax, smax, qpos)
    for a, b_ in zip(mine, refs):
        np.testing.assert_array_equal(a, b_)


def test_reference_backend_is_the_reference():
    x = _decode_case(9)
    a = KN.sparse_attention(x["q"], x["qpos"], x["win"], x["wpos"], x["ckv"], x["topk"], x["sink"],
                            window=x["window"], floor=x["floor"], backend="reference")
    b = RA.sparse_attention(x["q"], x["qpos"], x["win"], x["wpos"], x["ckv"], x["topk"], x["sink"],
                            window=x["window"], floor=x["floor"])
    np.testing.assert_array_equal(a, b)


def test_forward_routes_attention_and_indexer_through_the_dispatch(monkeypatch):
    """ForwardOptions.kernel_backend reaches every attention and (unpacked) indexer call of the forward."""
    from dsv41_jax import ForwardOptions, forward, init_params
    from dsv41_jax.model.model import default_hasher

    seen = []
    real_attn, real_idx = KN.sequence_sparse_attention, KN.indexer_topk

    def attn(*a, backend="auto", **kw):
        seen.append(("attention", backend))
        return real_attn(*a, backend="reference", **kw)

    def idx(*a, backend="auto", **kw):
        seen.append(("indexer", backend))
        return real_idx(*a, backend="reference", **kw)

    # the 6-layer cut with every layer role once (SWA, Full ratio 2 / 1, Reuse, Reindex with its HSI pool): what is
    # checked is per call and per role, and its programs compile in about half the time of the 12-layer tiny's
    config = every_role_config()
    params = init_params(config, jax.random.PRNGKey(0), std=0.1)
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (1, 13), 3, config.vocab_size))
    eids = jnp.asarray(default_hasher(config).row_ids(tokens))
    run = lambda opts: jax.jit(lambda p, tk, e: forward(p, tk, config=config, engram_ids=e, options=opts))(
        params, jnp.asarray(tokens), eids)
    base = run(ForwardOptions())
    monkeypatch.setattr(KN, "sequence_sparse_attention", attn)
    monkeypatch.setattr(KN, "indexer_topk", idx)
    out = run(ForwardOptions(kernel_backend="pallas_tpu"))
    n_index = sum(1 for s_ in config.plan if s_.runs_indexer)
    assert seen.count(("attention", "pallas_tpu")) == config.num_hidden_layers
    assert seen.count(("indexer", "pallas_tpu")) == n_index
    np.testing.assert_array_equal(out, base)


def test_forward_kernel_backend_matches_reference():
    """ForwardOptions.kernel_backend routes the forward's attention and indexer (ids-format HSI pools) through the
    kernels: same top-k in every index layer, same logits."""
    from dsv41_jax import ForwardOptions, forward, init_params
    from dsv41_jax.model.model import default_hasher

    # the 6-layer cut with every layer role once (SWA, Full ratio 2 / 1, Reuse, Reindex with its HSI pool): what is
    # checked is per call and per role, and its programs compile in about half the time of the 12-layer tiny's
    config = every_role_config()
    params = init_params(config, jax.random.PRNGKey(0), std=0.1)
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (1, 13), 3, config.vocab_size))
    eids = jnp.asarray(default_hasher(config).row_ids(tokens))
    out = {}
    for be in ("reference", "pallas_gpu_interpret"):
        opts = ForwardOptions(quant_sim=False, kernel_backend=be)
        fwd = jax.jit(lambda p, tk, e, opts=opts: forward(p, tk, config=config, engram_ids=e, options=opts,
                                                          return_topk=True))
        out[be], aux = fwd(params, jnp.asarray(tokens), eids)
        out[be + "_topk"] = aux["topk"]
    for layer, sel in out["reference_topk"].items():
        np.testing.assert_array_equal(out["pallas_gpu_interpret_topk"][layer], sel)
    _close(out["pallas_gpu_interpret"], out["reference"], 1e-5)
