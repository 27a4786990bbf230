"""Component parity with ``transformers.models.deepseek_v4`` (PyPI 5.23.0) for the pieces V4.1 shares with V4
(SPEC §11.2): router, clamped SwiGLU experts and shared expert, RoPE (main and YaRN compress, interleaved, inverse),
sink attention, grouped output projection, mHC mixing. Data: tests/fixtures/hf_v4_components.npz (see
tests/fixtures/hf_v41/README.md for each key's meaning)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.config import YarnConfig
from dsv41_jax.ops.attention import sparse_attention
from dsv41_jax.ops.mhc import collapse, expand, mhc_coefficients
from dsv41_jax.ops.moe import expert_mlp, route, routed_ragged
from dsv41_jax.ops.rope import apply_rope, cos_sin, inv_frequencies

from conftest import FIXTURES

PATH = os.path.join(FIXTURES, "hf_v4_components.npz")
pytestmark = pytest.mark.skipif(not os.path.exists(PATH), reason="no V4 component fixture")


@pytest.fixture(scope="module")
def g():
    return dict(np.load(PATH))


@pytest.mark.parametrize("one_pass", [False, True], ids=["split-K", "decode one-pass"])
def test_router(g, one_pass):
    weights, idx, _ = route(jnp.asarray(g["router_x"]), jnp.asarray(g["router_weight"]), jnp.asarray(g["router_bias"]),
                            top_k=2, temp=1.0, scaling=float(g["router_scaling"]), one_pass=one_pass)
    order = np.argsort(np.asarray(idx), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1), g["router_indices"])
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1), g["router_weights"], rtol=1e-5)


def test_routed_and_shared_experts(g):
    y = routed_ragged(jnp.asarray(g["experts_x"]), jnp.asarray(g["experts_weights"]),
                      jnp.asarray(g["experts_indices"]), jnp.asarray(g["experts_w1"]), jnp.asarray(g["experts_w2"]),
                      jnp.asarray(g["experts_w3"]), 10.0)
    assert g["experts_clamp_frac_gate"] > 0 and g["experts_clamp_frac_up"] > 0  # the clamps are exercised
    np.testing.assert_allclose(np.asarray(y), g["experts_y"], rtol=1e-4, atol=1e-4 * np.abs(g["experts_y"]).max())
    y = expert_mlp(jnp.asarray(g["mlp_x"]), jnp.asarray(g["mlp_w1"]), jnp.asarray(g["mlp_w2"]),
                   jnp.asarray(g["mlp_w3"]), 10.0)
    np.testing.assert_allclose(np.asarray(y), g["mlp_y"], rtol=1e-4, atol=1e-4 * np.abs(g["mlp_y"]).max())


@pytest.mark.parametrize("kind", ["main", "compress"])
def test_rope(g, kind):
    yarn = YarnConfig(16.0, 65536, 32.0, 1.0) if kind == "compress" else None
    inv = inv_frequencies(16, 160000.0 if kind == "compress" else 10000.0, yarn)
    np.testing.assert_allclose(inv, g[f"rope_inv_freq_{kind}"], rtol=1e-6)
    cos, sin = cos_sin(inv, jnp.asarray(g["rope_positions"]))
    np.testing.assert_allclose(np.asarray(cos), g[f"rope_cos_{kind}"], atol=2e-6)
    x = jnp.asarray(g[f"rope_x_{kind}"])  # [B, H, S, hd]
    rot = apply_rope(x, cos[:, None], sin[:, None])
    np.testing.assert_allclose(np.asarray(rot), g[f"rope_rotated_{kind}"], atol=1e-5)
    inv_rot = apply_rope(x, cos[:, None], sin[:, None], inverse=True)
    np.testing.assert_allclose(np.asarray(inv_rot), g[f"rope_inverse_{kind}"], atol=1e-5)


def test_sink_attention(g):
    q = jnp.asarray(g["attn_q"]).transpose(0, 2, 1, 3)  # [B, S, H, D]
    kv = jnp.asarray(g["attn_kv"])[:, 0]  # [B, L, D]
    mask = g["attn_mask"][:, 0]  # [B, S, L]: 0 visible / -inf
    b, s, _, _ = q.shape
    n_keys = kv.shape[1]
    # Express the recorded mask as explicit per-query key lists: every visible key becomes a "selected" entry.
    topk = np.full((b, s, n_keys), -1, np.int32)
    for bi in range(b):
        for si in range(s):
            vis = np.nonzero(mask[bi, si] == 0)[0]
            topk[bi, si, : len(vis)] = vis
    pos = jnp.zeros((b, 0), jnp.int32)
    out = sparse_attention(q, jnp.zeros((b, s), jnp.int32), jnp.zeros((b, 0, kv.shape[-1])), pos, kv,
                           jnp.asarray(topk), jnp.asarray(g["attn_sinks"]), window=1, scale=float(g["attn_scaling"]))
    np.testing.assert_allclose(np.asarray(out), g["attn_out"], rtol=1e-5, atol=1e-6)


def test_grouped_output_projection(g):
    x = jnp.asarray(g["oproj_x"])  # [B, S, H, D]
    b, s, h, d = x.shape
    groups, rank = 2, 16
    grouped = x.reshape(b, s, groups, -1)
    mid = jnp.einsum("bsgi,goi->bsgo", grouped, jnp.asarray(g["oproj_wo_a"]).reshape(groups, rank, -1))
    np.testing.assert_allclose(np.asarray(mid), g["oproj_mid"], rtol=1e-5, atol=1e-5)
    y = mid.reshape(b, s, -1) @ jnp.asarray(g["oproj_wo_b"]).T
    np.testing.assert_allclose(np.asarray(y), g["oproj_y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["default", "decode one-pass"])
def test_mhc_mixing(g, fused):
    """Against the reference's values; ``fused``: the decode step's forms (InferenceOptions.mhc_one_pass: the
    projection and RMS as one reduction, the stream mixes as unrolled sums), to the same tolerances."""
    x = jnp.asarray(g["hc_x"])
    pre, post, comb = mhc_coefficients(x, jnp.asarray(g["hc_fn"]), jnp.asarray(g["hc_base"]),
                                       jnp.asarray(g["hc_scale"]), hc_eps=float(g["hc_eps"]),
                                       rms_eps=float(g["hc_norm_eps"]), sinkhorn_iters=int(g["hc_sinkhorn_iters"]),
                                       one_pass=fused)
    np.testing.assert_allclose(np.asarray(pre), g["hc_pre"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(post), g["hc_post"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(comb), g["hc_comb"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(collapse(x, pre, unrolled=fused)), g["hc_collapsed"], rtol=1e-5, atol=1e-5)
    out = expand(x, jnp.asarray(g["hc_expand_y"]), post, comb, unrolled=fused)
    np.testing.assert_allclose(np.asarray(out), g["hc_expand_out"], rtol=1e-5, atol=1e-5)
