"""Sharding on 8 fake CPU devices (tests/conftest.py sets them up): rules, clear errors for non-dividing meshes,
the expert-parallel MoE (dropless == dense; capacity mode drops exactly the overflow and reports it), and the
sharded forward / CED prefill + decode equal to the unsharded ones in float32 for the meshes
(data=2, expert=2, tensor=2), (expert=8) and (tensor=8)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax
from dsv41_jax import ForwardOptions
from dsv41_jax import parallel as par
from dsv41_jax.model.model import default_hasher
from dsv41_jax.model.params import param_specs
from dsv41_jax.ops import moe as moe_ops

MESHES = ["data=2,expert=2,tensor=2", "expert=8", "tensor=8"]
RTOL = 2e-5  # float32, only the reduction order differs


def _small():
    from dsv41_jax.train.testing import small_config  # 6 layers, every layer role of tiny (compiles 2x faster)

    return small_config()


# session scope (read-only for its tests): a shuffled order interleaves modules, and a module-scoped fixture is
# then built again each time its module comes back
@pytest.fixture(scope="session")
def sharding_config():
    # with a vocabulary, head count and output-group count that 8 devices divide (tiny has vocab 259, 4 heads and
    # 2 groups). The Engram row count (660) stays: tables are padded to a multiple of the row-shard count.
    return _small().replace(vocab_size=264, num_attention_heads=8, o_groups=8)


@pytest.fixture(scope="session")
def setup(sharding_config):
    cfg = sharding_config
    params = dsv41_jax.init_params(cfg, jax.random.PRNGKey(1))
    hasher = default_hasher(_small())  # row ids depend on the byte tokens only
    tokens = np.random.RandomState(0).randint(3, 259, (8, 40)).astype(np.int32)
    eids = jnp.asarray(hasher.row_ids(tokens))
    opts = ForwardOptions(quant_sim=False)
    ref = jax.jit(lambda p, t, e: dsv41_jax.forward(p, t, config=cfg, engram_ids=e, options=opts))(
        params, jnp.asarray(tokens), eids)
    return cfg, params, hasher, tokens, eids, np.asarray(ref)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# --------------------------------------------------------------------------------------------------------------
# rules and errors
# --------------------------------------------------------------------------------------------------------------

def test_rules_cover_every_parameter_axis():
    flash = dsv41_jax.load_config("flash")
    specs = jax.tree.leaves(param_specs(flash, include_dspark=True), is_leaf=lambda s: hasattr(s, "axes"))
    used = {a for s in specs for a in s.axes if a is not None}
    for rules in par.RULES.values():
        assert used <= set(rules.mapping), sorted(used - set(rules.mapping))
        assert rules.lookup("kv_latent") == ()  # the single K=V latent is replicated in every preset


def test_logical_to_spec_uses_each_mesh_axis_once():
    mesh = jax.sharding.AbstractMesh((2, 2, 2), par.AXES)
    rules = par.get_rules("tp")
    # wq_b is (q_heads, q_lora): both map to tensor; the first dim wins.
    assert par.logical_to_spec(("q_heads", "q_lora"), mesh, rules) == jax.sharding.PartitionSpec("tensor")
    assert par.logical_to_spec(("batch", "seq", "vocab"), mesh, rules) == \
        jax.sharding.PartitionSpec(("data", "expert"), None, "tensor")
    # activations fall back instead of failing; parameters fail loudly
    assert par.logical_to_spec(("batch",), mesh, rules, (2,), strict=False) == jax.sharding.PartitionSpec("data")
    with pytest.raises(par.MeshError, match=r"dimension 0 \(logical axis 'batch'\) has size 2"):
        par.logical_to_spec(("batch",), mesh, rules, (2,), strict=True)


@pytest.mark.parametrize("shape, rules, match", [
    ("tensor=3", "tp", r"mesh axis 'tensor' \(size 3\) does not divide num_attention_heads = 64"),
    ("expert=5", "tp", r"mesh axis 'expert' \(size 5\) does not divide n_routed_experts = 384"),
    ("expert=5,tensor=2", "dp_attention", r"'expert' \(size 5\) x 'tensor' \(size 2\) does not divide "
                                          r"n_routed_experts = 384"),
])
def test_non_dividing_mesh_names_axis_and_dimension(shape, rules, match):
    flash = dsv41_jax.load_config("flash")
    sizes = par.parse_mesh(shape)
    mesh = jax.sharding.AbstractMesh(tuple(sizes[a] for a in par.AXES), par.AXES)
    with pytest.raises(par.MeshError, match=match):
        par.check_model(flash, mesh, rules)


def test_non_dividing_vocab_and_batch(sharding_config):
    tiny = dsv41_jax.load_config("tiny")  # vocab 259
    mesh = par.make_mesh("tensor=2", devices=jax.devices()[:2])
    with pytest.raises(par.MeshError, match=r"does not divide vocab_size = 259"):
        par.param_shardings(tiny, mesh, "pod")
    mesh = par.make_mesh("data=2,expert=2,tensor=2")
    with pytest.raises(par.MeshError, match=r"batch size 6 is not divisible by mesh axis 'data' \(size 2\) x "
                                            r"'expert' \(size 2\)"):
        par.sharded_forward(sharding_config, mesh, "tp", batch=6)
    with pytest.raises(par.MeshError, match=r"needs 6 devices but 8 are available"):
        par.make_mesh("expert=3,tensor=2")


def test_engram_tables_padded_and_sharded(sharding_config, setup):
    cfg, params = setup[0], setup[1]
    mesh = par.make_mesh("data=2,expert=2,tensor=2")
    sp = par.shard_params(params, cfg, mesh, "tp")
    for slot, layer in enumerate(cfg.engram_layer_ids):
        table = sp["layers"][layer]["engram"]["embed"]
        rows = cfg.engram_num_embeddings[slot]
        assert table.shape[0] == -(-rows // 8) * 8
        assert table.sharding.spec == jax.sharding.PartitionSpec(("data", "expert", "tensor"))
        np.testing.assert_array_equal(np.asarray(table[:rows]), np.asarray(params["layers"][layer]["engram"]["embed"]))
    assert sp["layers"][0]["ffn"]["experts"]["w1"].sharding.spec == jax.sharding.PartitionSpec("expert", "tensor")
    assert sp["layers"][0]["attn"]["wkv"].sharding.spec == jax.sharding.PartitionSpec()  # K=V latent replicated


def test_constrain_is_a_noop_without_a_mesh():
    x = jnp.ones((4, 3))
    assert par.constrain(x, ("batch", None)) is x
    assert par.current() is None


# --------------------------------------------------------------------------------------------------------------
# expert-parallel MoE
# --------------------------------------------------------------------------------------------------------------

def _moe_setup(n_exp=8, f=32, d=64, b=4, t=12, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    p = {"gate": {"weight": jax.random.normal(ks[0], (n_exp, d)) * 0.1, "bias": jax.random.normal(ks[1], (n_exp,)) * 0.1},
         "experts": {"w1": jax.random.normal(ks[2], (n_exp, f, d)) * 0.1, "w2": jax.random.normal(ks[3], (n_exp, d, f)) * 0.1,
                     "w3": jax.random.normal(ks[4], (n_exp, f, d)) * 0.1},
         "shared_experts": {"w1": jax.random.normal(ks[5], (f, d)) * 0.1, "w2": jax.random.normal(ks[6], (d, f)) * 0.1,
                            "w3": jax.random.normal(ks[2], (f, d)) * 0.1}}
    return p, jax.random.normal(ks[6], (b, t, d))


MOE_KW = dict(top_k=2, temp=1.0, scaling=1.5, limit=10.0)


@pytest.mark.parametrize("shape, rules", [(m, "tp") for m in MESHES] + [
    ("data=2,expert=2,tensor=2", "pod"), ("data=2,expert=2,tensor=2", "dp_attention"), ("data=2,tensor=4", "pod")])
def test_expert_parallel_dropless_equals_dense(shape, rules):
    params, x = _moe_setup()
    ref, ref_aux = moe_ops.moe(x, params, impl="dense", **MOE_KW)
    mesh = par.make_mesh(shape)

    def run(x, p):
        with par.sharding_context(mesh, rules):
            return moe_ops.moe(x, p, impl="expert_parallel", **MOE_KW)

    y, aux = jax.jit(run)(x, params)
    assert _rel(y, ref) < RTOL
    np.testing.assert_array_equal(np.asarray(aux["indices"]), np.asarray(ref_aux["indices"]))
    assert int(aux["dropped"].sum()) == 0


def test_expert_parallel_needs_a_mesh():
    params, x = _moe_setup()
    with pytest.raises(par.MeshError, match="needs an active mesh"):
        moe_ops.moe(x, params, impl="expert_parallel", **MOE_KW)


@pytest.mark.parametrize("cf", [0.5, 1.0])
def test_expert_parallel_capacity_drops_overflow_and_reports_it(cf):
    """(expert=8): one expert per device; tokens split in 8 contiguous shards of 6. Each (source shard, expert)
    chunk keeps the first C = ceil(cf * 6 * k / 8) tokens in order; the rest lose that expert."""
    params, x = _moe_setup()
    mesh = par.make_mesh("expert=8")
    k, n_ep = MOE_KW["top_k"], 8

    def run(x, p):
        with par.sharding_context(mesh, "tp"):
            return moe_ops.moe(x, p, impl="expert_parallel", capacity_factor=cf, **MOE_KW)

    y, aux = jax.jit(run)(x, params)
    flat = x.reshape(-1, x.shape[-1])
    w, idx, _ = moe_ops.route(flat, params["gate"]["weight"], params["gate"]["bias"], top_k=k, temp=1.0,
                              scaling=1.5)
    w, idx = np.asarray(w), np.asarray(idx)
    m_loc = flat.shape[0] // n_ep
    cap = max(1, min(m_loc, math.ceil(cf * m_loc * k / n_ep)))
    keep = np.ones_like(w, bool)
    for s in range(n_ep):
        counts = np.zeros(n_ep, int)
        for i in range(s * m_loc, (s + 1) * m_loc):
            for j in range(k):
                e = idx[i, j]
                keep[i, j] = counts[e] < cap
            for e in set(idx[i].tolist()):
                counts[e] += 1
    dropped_ref = (~keep).sum(1)
    np.testing.assert_array_equal(np.asarray(aux["dropped"]).reshape(-1), dropped_ref)
    assert dropped_ref.sum() > 0 if cf < 1 else True
    e = params["experts"]
    y_ref = moe_ops.routed_dense(flat, jnp.asarray(np.where(keep, w, 0.0)), jnp.asarray(idx), e["w1"], e["w2"],
                                 e["w3"], 10.0)
    s = params["shared_experts"]
    y_ref = y_ref + moe_ops.expert_mlp(flat, s["w1"], s["w2"], s["w3"], 10.0)
    assert _rel(y.reshape(-1, x.shape[-1]), y_ref) < RTOL


# --------------------------------------------------------------------------------------------------------------
# the sharded forward
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, impl, rules", [(m, "expert_parallel", "tp") for m in MESHES] + [
    ("data=2,expert=2,tensor=2", "ragged", "tp"),  # plain GSPMD MoE (no shard_map)
    ("data=2,expert=2,tensor=2", "expert_parallel", "dp_attention"),  # data-parallel attention, EP over 4
])
def test_sharded_forward_equals_unsharded(setup, shape, impl, rules):
    cfg, params, _, tokens, eids, ref = setup
    mesh = par.make_mesh(shape)
    sp = par.shard_params(params, cfg, mesh, rules)
    fwd = par.sharded_forward(cfg, mesh, rules, ForwardOptions(quant_sim=False, moe_impl=impl))
    out = fwd(sp, jnp.asarray(tokens), eids)
    assert out.sharding.spec == par.logical_to_spec(("batch", "seq", "vocab"), mesh, par.get_rules(rules))
    assert _rel(out, ref) < RTOL


# --------------------------------------------------------------------------------------------------------------
# the engine's CED prefill + decode under a mesh
# --------------------------------------------------------------------------------------------------------------

def _engine():
    try:
        from dsv41_jax.inference.cache import init_cache
        from dsv41_jax.inference.decode import decode_step
        from dsv41_jax.inference.prefill import prefill
        from dsv41_jax.inference.step import InferenceOptions
    except ImportError as e:  # pragma: no cover - the engine lands separately
        pytest.skip(f"inference engine not available: {e}")
    return init_cache, prefill, decode_step, InferenceOptions


def _generate(params, cache, cfg, hasher, prompt, steps, opts):
    init_cache, prefill, decode_step, _ = _engine()
    ids = hasher.row_ids(prompt)
    last, cache = prefill(params, cache, prompt, engram_ids=ids, config=cfg, opts=opts)
    outs = [np.asarray(last)]
    seq = prompt
    for _ in range(steps):
        nxt = np.argmax(outs[-1], -1).astype(np.int32)
        seq = np.concatenate([seq, nxt[:, None]], 1)
        step_ids = hasher.row_ids(seq)[:, -1]
        last, cache = decode_step(params, cache, nxt, step_ids, config=cfg, opts=opts)
        outs.append(np.asarray(last))
    return outs


@pytest.fixture(scope="session")
def unsharded_generate(setup):
    """The unsharded CED prefill + 2 decode steps every mesh below is compared with: the same inputs for each mesh,
    so computed once (session scope, read-only: see ``setup``)."""
    init_cache, _, _, InferenceOptions = _engine()
    cfg, params, hasher, tokens, _, _ = setup
    prompt = tokens[:, :21]  # crosses the window (8), ratio-2 groups and HSI blocks
    return prompt, _generate(params, init_cache(cfg, 8, 32), cfg, hasher, prompt, 2, InferenceOptions(quant_sim=False))


@pytest.mark.parametrize("shape", MESHES)
def test_sharded_prefill_decode_equals_unsharded(setup, unsharded_generate, shape):
    init_cache, _, _, InferenceOptions = _engine()
    cfg, params, hasher, _, _, _ = setup
    prompt, ref = unsharded_generate
    mesh = par.make_mesh(shape)
    with par.sharding_context(mesh, "tp"):
        sp = par.shard_params(params, cfg, mesh, "tp")
        cache = init_cache(cfg, 8, 32)
        cache = jax.device_put(cache, par.cache_shardings(cache, mesh, "tp"))
        got = _generate(sp, cache, cfg, hasher, prompt, 2,
                        InferenceOptions(quant_sim=False, moe_impl="expert_parallel"))
    for a, b in zip(got, ref):
        assert _rel(a, b) < RTOL


# --------------------------------------------------------------------------------------------------------------
# the train step under a mesh
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.memory_heavy
def test_sharded_train_step_equals_unsharded():
    try:
        from dsv41_jax.train import TrainConfig, make_train_step
        from dsv41_jax.train.step import canonical_state
        from dsv41_jax.train.testing import small_config
    except ImportError as e:  # pragma: no cover - training lands separately
        pytest.skip(f"training not available: {e}")
    cfg = small_config().replace(vocab_size=264, num_attention_heads=8, o_groups=8)
    hasher = default_hasher(small_config())
    # eps = 1: Adam's first step is then ~lr * g, smooth in g (with the usual 1e-8 a gradient entry near eps
    # turns float32 reduction-order noise into a visible update difference).
    rng = np.random.default_rng(0)
    toks = rng.integers(3, 259, (4, 17)).astype(np.int32)
    batch = {"tokens": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": np.ones((4, 16), np.float32),
             "valid": np.ones((4, 16), bool), "engram_ids": hasher.row_ids(toks[:, :-1])}
    common = dict(seq_len=16, batch_size=4, compute_dtype="float32", quant_sim=False, weight_decay=0.0,
                  warmup_steps=1, lr=1e-2, eps=1.0)
    ref_step = make_train_step(cfg, TrainConfig(**common))
    state0 = ref_step.init_state(seed=3)
    init = [np.asarray(x) for x in jax.tree.leaves(state0["params"])]
    ref_state, ref_metrics = ref_step(state0, batch, 1e-2)
    mesh = par.make_mesh("data=2,expert=2,tensor=2")
    step = make_train_step(cfg, TrainConfig(**common, moe_impl="expert_parallel"), mesh=mesh)
    state, metrics = step(step.init_state(seed=3), batch, 1e-2)
    for k in ("loss", "grad_norm"):
        assert _rel(metrics[k], ref_metrics[k]) < 1e-5, k
    got = canonical_state(step, state)["params"]
    for (path, a), b, p0 in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref_state["params"]),
                                init):
        # the updates agree to 1e-4 of their size, up to a few float32 ulps of the parameters they were added to
        a, b = np.asarray(a), np.asarray(b)
        tol = max(1e-4 * np.abs(b - p0).max(), 8 * np.spacing(np.float32(np.abs(p0).max())))
        assert np.abs(a - b).max() <= tol, jax.tree_util.keystr(path)
