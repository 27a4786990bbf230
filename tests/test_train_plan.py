"""The full-size fine-tuning plan's shapes-only estimate (launch/train_plan.py; no compile here): ZeRO-1 moment
specs, per-chip state bytes against the parameter shards, and the mode ordering."""

import os
import sys

import pytest
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))
train_plan = pytest.importorskip("train_plan")


def test_zero_spec_splits_moments_over_the_batch_axes_their_parameter_is_replicated_on():
    mesh = {"data": 2, "expert": 8, "tensor": 4}
    # attention weight [out, in] with out over tensor: the moments also split `in` over data x expert
    assert train_plan.zero_spec(P("tensor", None), (1280, 5120), mesh) == P("tensor", ("data", "expert"))
    # experts over expert x tensor: only data is left
    assert train_plan.zero_spec(P(("expert", "tensor"), None, None), (384, 2304, 5120), mesh) == \
        P(("expert", "tensor"), "data", None)
    # nothing divides by 16: fall back to data alone, then to the parameter's own spec
    assert train_plan.zero_spec(P(None), (24,), mesh) == P("data")
    assert train_plan.zero_spec(P(None), (3,), mesh) == P(None)


def test_state_bytes_per_chip(tiny_config):
    from dsv41_jax.model.params import flat_specs

    mesh = {"data": 1, "expert": 1, "tensor": 1}  # one chip: every shard is the whole tensor
    n = sum(s.size for _, s in flat_specs(tiny_config))
    full = train_plan.state_bytes(tiny_config, "full", mesh, "pod", 4)
    assert full["params_f32"] == 4 * n and full["opt_state"] == 8 * n and full["grads_f32"] == 4 * n
    lora = train_plan.state_bytes(tiny_config, "lora", mesh, "pod", 4)
    release = train_plan.state_bytes(tiny_config, "lora-release", mesh, "pod", 4)
    assert n * 2 <= lora["base"] < n * 4 and release["base"] < lora["base"] and lora["opt_state"] == 0
    # on 4 chips (tensor = 4) the sharded weights hold less per chip
    four = train_plan.state_bytes(tiny_config, "lora", train_plan.mesh_shape(4), "pod", 4)
    assert four["base"] < lora["base"]


def test_per_layer_remat_estimate_from_a_compiled_twin(tiny_config):
    """With a per-layer-remat compile of a depth-N twin (temporaries t per sequence), the full-depth figure is the
    state + t + (L - N) x one layer's saved inputs per sequence of a batch shard; without it, the projection."""
    seq, depth, t = 256, 2, 3.0e6
    e = train_plan.estimate(tiny_config, "full", "v5p-8", "pod", 4, None, 2, seq, layer_remat=(t, depth))
    saved = train_plan.saved_bytes_per_layer_seq(tiny_config, seq)
    assert saved >= 4 * seq * tiny_config.hc_mult * tiny_config.hidden_size  # the float32 mHC streams at least
    layers = tiny_config.num_hidden_layers
    expect = e["held"] + e["param_transients"] + e["seqs_per_shard"] * (t + (layers - depth) * saved)
    assert e["per_layer_remat_basis"] == "compiled" and e["per_layer_remat_projection"] == pytest.approx(expect)
    p = train_plan.estimate(tiny_config, "full", "v5p-8", "pod", 4, 1.0e6, 2, seq)
    assert p["per_layer_remat_basis"] == "projection" and p["total"] > p["held"] + p["param_transients"]


@pytest.mark.slow  # two train-step compiles (≈ 8 s of CPU)
def test_zero3_train_step_equals_unsharded():
    """ZeRO-3 (``TrainConfig.zero = 3``) on 8 fake CPU devices: the float32 masters and optimiser moments split
    over the batch axes too (checked on the state), each layer's weights gathered inside its per-layer checkpoint;
    loss, gradient norm and the updated masters equal the unsharded step's (float32)."""
    import jax
    import numpy as np

    from dsv41_jax import parallel as par
    from dsv41_jax.train import TrainConfig, make_train_step
    from dsv41_jax.train.testing import small_config

    cfg = train_plan.reduced_config(small_config().replace(vocab_size=264, num_attention_heads=8, o_groups=8), 1)
    rng = np.random.default_rng(0)
    toks = rng.integers(3, 259, (4, 17)).astype(np.int32)
    batch = {"tokens": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": np.ones((4, 16), np.float32),
             "valid": np.ones((4, 16), bool)}
    # eps = 1: Adam's first step is ~lr * g, smooth in g (float32 reduction-order noise stays small in the update)
    common = dict(seq_len=16, batch_size=4, compute_dtype="float32", quant_sim=False, weight_decay=0.0,
                  warmup_steps=1, lr=1e-2, eps=1.0, remat="full", remat_scope="layer")
    ref_step = make_train_step(cfg, TrainConfig(**common))
    state0 = ref_step.init_state(seed=3)
    init = [np.asarray(x) for x in jax.tree.leaves(state0["params"])]
    ref_state, ref_metrics = ref_step(state0, batch, 1e-2)
    mesh = par.make_mesh("data=2,expert=2,tensor=2")
    step = make_train_step(cfg, TrainConfig(**common, moe_impl="expert_parallel", zero=3), mesh=mesh)
    state, metrics = step(step.init_state(seed=3), batch, 1e-2)
    wq = state["params"]["layers"][0]["attn"]["wq_b"]  # heads over tensor; the batch axes added by ZeRO-3
    spec = tuple(wq.sharding.spec)
    assert "tensor" in str(spec) and "data" in str(spec) and "expert" in str(spec), spec
    mu = jax.tree.leaves(state["opt_state"], is_leaf=lambda x: hasattr(x, "sharding"))
    assert any("data" in str(getattr(m, "sharding", None) and m.sharding.spec) for m in mu)
    for k in ("loss", "grad_norm"):
        a, b = float(metrics[k]), float(ref_metrics[k])
        assert abs(a - b) <= 1e-5 * abs(b), (k, a, b)
    for (path, a), b, p0 in zip(jax.tree_util.tree_flatten_with_path(state["params"])[0],
                                jax.tree.leaves(ref_state["params"]), init):
        a, b = np.asarray(a), np.asarray(b)
        tol = max(1e-4 * np.abs(b - p0).max(), 8 * np.spacing(np.float32(np.abs(p0).max())))
        assert np.abs(a - b).max() <= tol, jax.tree_util.keystr(path)


def test_kernels_run_per_shard_under_a_mesh():
    """``kernels._per_shard`` (how the Pallas attention / indexer calls run on a mesh: shard_map over the batch
    and head axes): values and gradients equal the unsharded function's, including the gradient of an operand
    replicated over the batch shards (the sinks: summed over them), and a non-dividing batch falls back to fewer
    axes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv41_jax import kernels as KN
    from dsv41_jax import parallel as par

    mesh = par.make_mesh("data=2,expert=2,tensor=2")
    rng = np.random.default_rng(0)

    def fn(q, kv, sink):  # stands in for a kernel: per batch row and head
        return jnp.tanh(q * sink[None, None, :, None] + kv[:, :, None, :])

    dims = (("b", None, "h", None), ("b", None, None), ("h",))
    for b in (4, 2):  # 4 rows: data x expert; 2 rows: data only
        q = jnp.asarray(rng.normal(size=(b, 6, 4, 8)), jnp.float32)
        kv = jnp.asarray(rng.normal(size=(b, 6, 8)), jnp.float32)
        sink = jnp.asarray(rng.normal(size=(4,)), jnp.float32)

        def loss(q, kv, sink, sharded):
            if not sharded:
                return jnp.sum(jnp.cos(fn(q, kv, sink)))
            with par.sharding_context(mesh, "pod"):
                return jnp.sum(jnp.cos(KN._per_shard(fn, (q, kv, sink), dims, ("b", None, "h", None))))

        assert "shard_map" in str(jax.make_jaxpr(loss, static_argnums=3)(q, kv, sink, True))
        want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, kv, sink, False)
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, kv, sink, True)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
