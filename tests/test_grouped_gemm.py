"""The Pallas grouped expert GEMM (``kernels.grouped_gemm_gpu``: every row block reads its expert's weight in place,
dX and dW kernels for the gradients) against ``jax.lax.ragged_dot``, in Pallas interpret mode on CPU: float32 values
and gradients equal to float32 rounding, bf16 within 1e-2 of float32 on the same upcast inputs, and the MoE layer
with ``impl="grouped"`` equal to ``impl="ragged"``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compiled
from dsv41_jax.kernels import grouped_gemm_gpu as gg
from dsv41_jax.ops.moe import blocked_grouped_matmul, moe
from dsv41_jax.train.testing import random_moe_params

HI = jax.lax.Precision.HIGHEST
# empty groups (first, middle, last), a group over several 16-row blocks, groups of one row; 6 groups
SIZES = jnp.asarray([0, 7, 0, 13, 1, 37, 0], jnp.int32)


def _operands(dtype, k=32, n=48, seed=0):
    rng = np.random.default_rng(seed)
    m = int(SIZES.sum())
    rows = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((SIZES.shape[0], n, k)) / np.sqrt(k), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    return rows.astype(dtype), w.astype(dtype), ct


def _value_and_grads(fn, rows, w, ct):
    loss = lambda r, w_: jnp.sum(fn(r, w_).astype(jnp.float32) * ct)  # noqa: E731
    return fn(rows, w), jax.grad(loss, (0, 1))(rows, w)


def _kernel(r, w):
    return blocked_grouped_matmul(r, w, SIZES, kernel="interpret")


def _ragged(r, w):
    return jax.lax.ragged_dot(r, jnp.swapaxes(w, 1, 2), SIZES, precision=HI)


def test_grouped_gemm_kernel_float32_equals_ragged_dot():
    """Values, dX and dW of the kernel path equal ragged_dot's in float32 (only the order of additions differs),
    and the tiles really are the kernel's: the shapes divide 16-wide tiles, so no XLA fallback is taken."""
    rows, w, ct = _operands(jnp.float32)
    assert gg.grouped_tiles(32, 48, w.size) is not None
    (y, grads), (y_ref, grads_ref) = compiled(lambda *a: (_value_and_grads(_kernel, *a),
                                                         _value_and_grads(_ragged, *a)), rows, w, ct)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("d_rows", "d_w"), grads, grads_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    # the groups with no rows get an exactly-zero weight gradient (their dW programs loop zero times)
    assert not np.any(np.asarray(grads[1])[np.asarray(SIZES) == 0])


def test_grouped_gemm_kernel_bf16_within_1e2_of_float32():
    """bf16 operands (bf16 products, float32 accumulation, bf16 outputs; dW summed in float32) against float32 on
    the same upcast inputs: relative L2 error ≤ 1e-2 for the value and both gradients."""
    rows, w, ct = _operands(jnp.bfloat16, seed=1)
    (y, grads), (y_ref, grads_ref) = compiled(lambda rows, w, ct: (
        _value_and_grads(_kernel, rows, w, ct),
        _value_and_grads(_ragged, rows.astype(jnp.float32), w.astype(jnp.float32), ct)), rows, w, ct)
    assert y.dtype == jnp.bfloat16 and grads[0].dtype == grads[1].dtype == jnp.bfloat16
    for name, a, b in (("y", y, y_ref), ("d_rows", grads[0], grads_ref[0]), ("d_w", grads[1], grads_ref[1])):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b), name


def test_moe_grouped_equals_ragged_and_bad_tiles_fall_back():
    """The MoE layer with ``impl="grouped"`` equals ``impl="ragged"`` (float32, values and gradients of the expert
    weights); widths no 16-wide tile divides take the XLA blocked form instead of failing."""
    rng = np.random.default_rng(2)
    d, f, n_exp = 32, 48, 6
    params = random_moe_params(rng, d, f, n_exp)
    x = jnp.asarray(rng.standard_normal((2, 9, d)), jnp.float32)
    kw = dict(top_k=2, temp=1.0, scaling=1.5, limit=7.0)

    def loss(experts, impl):
        y, _ = moe(x, {**params, "experts": experts}, impl=impl, **kw)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))

    (l_g, g_g), (l_r, g_r) = compiled(lambda e: tuple(jax.value_and_grad(loss)(e, i) for i in ("grouped", "ragged")),
                                      params["experts"])
    np.testing.assert_allclose(l_g, l_r, rtol=1e-5)
    for name in ("w1", "w2", "w3"):
        np.testing.assert_allclose(g_g[name], g_r[name], rtol=1e-5, atol=1e-5, err_msg=name)
    assert gg.grouped_tiles(24, 40, 1000) is None  # neither 24 nor 40 has a power-of-two divisor >= 16
    rows, w, _ = _operands(jnp.float32, k=24, n=40)
    got, want = compiled(lambda rows, w: (blocked_grouped_matmul(rows, w, SIZES, kernel="interpret"), _ragged(rows, w)),
                         rows, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_mgpu_ragged_gemm_vjp_wiring_with_reference_products():
    """``kernels.grouped_gemm_mgpu.ragged_gemm`` (Hopper-only kernels, no interpret mode) with the ``jax.lax``
    ragged products in the kernels' places: its custom VJP (dX = dy · w[g], dW[g] = dy_gᵀ · x_g) gives ragged_dot's
    autodiff gradients in float32, empty groups included. The kernels' own values are checked on the device."""
    from dsv41_jax.kernels import grouped_gemm_mgpu as gm

    rows, w, ct = _operands(jnp.float32, seed=3)
    key = gm.tiles_key(gm.MGPU_TILES)
    (y, grads), (y_ref, grads_ref) = compiled(lambda *a: (
        _value_and_grads(lambda r, w_: gm.ragged_gemm(r, w_, SIZES, "reference", key), *a),
        _value_and_grads(_ragged, *a)), rows, w, ct)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("d_rows", "d_w"), grads, grads_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    assert gm.mgpu_fits(24576, 5120, 2304) and gm.mgpu_fits(24576, 2304, 5120) and not gm.mgpu_fits(64, 32, 48)
    assert not gm.mgpu_fits(24576, 5120, 2304, groups=384)


def test_mgpu_grid_band_divides_each_products_output_columns():
    """``grid_block_n`` is a ceiling: each product gets the widest band (halving) whose block_n x band divides its
    own output columns — the forward's N, dX's and dW's K — so the fullwidth4 shapes get 2 where 2304 = 18 tiles."""
    from dsv41_jax.kernels import grouped_gemm_mgpu as gm

    tiles = {kind: dict(t, grid_block_n=4) for kind, t in gm.MGPU_TILES.items()}
    bands = {(n, k): {kind: gm.product_tiles(kind, k, n, tiles)["grid_block_n"] for kind in ("fwd", "dx", "dw")}
             for n, k in ((2304, 5120), (5120, 2304))}
    assert bands == {(2304, 5120): {"fwd": 2, "dx": 4, "dw": 4}, (5120, 2304): {"fwd": 4, "dx": 2, "dw": 2}}
    assert gm.mgpu_fits(24576, 5120, 2304, tiles=tiles) and gm.mgpu_fits(24576, 2304, 5120, tiles=tiles)
    assert gm.product_tiles("fwd", 5120, 384, tiles)["grid_block_n"] == 1  # 3 tiles of 128: no band divides
    assert tiles["fwd"]["grid_block_n"] == 4  # the caller's dict is not modified
    with pytest.raises(ValueError, match="fwd, dx or dw"):
        gm.product_tiles("bwd", 5120, 2304, tiles)
