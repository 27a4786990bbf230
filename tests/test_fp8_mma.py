"""The grouped FP4 kernel's FP8 tensor-core form (``quant_gemm_gpu.fp4_grouped_gemm(..., mma="fp8")``): e2m1 nibbles
as e4m3 bytes (all 16 patterns, and the inline PTX's word arithmetic in numpy), the activations' FP8 codes and scales
(``ops.quant.fp8_e4m3_block_codes``), the kernel in interpret mode against float64 on the dequantised values
(partial groups, empty experts, rows past the groups, a partial weight-row block, several K steps), and its Triton
lowering: an FP8 ``tt.dot`` with ``maxNumImpreciseAcc`` = 32 (the condition for Hopper's FP8 wgmma)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.checkpoint import names as N
from dsv41_jax.kernels import quant_gemm as QG
from dsv41_jax.kernels import quant_gemm_gpu as G
from dsv41_jax.model import release_weights as RW
from dsv41_jax.ops import quant as Q

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _e4m3(b):
    return np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def test_e2m1_nibbles_are_e4m3_bytes_of_the_value_times_2_pow_minus_6():
    """Every byte's two nibbles (so all 16 patterns, 0.5 the e2m1 subnormal and -0 included) through
    ``e2m1_e4m3_bytes`` and through the PTX's four-bytes-a-word arithmetic (``_E2M1_E4M3_PTX``, emulated on uint32):
    the e4m3 value is the e2m1 value x 2^-6, exactly."""
    b = np.arange(256, dtype=np.uint8)
    lo, hi = (np.asarray(t) for t in G.e2m1_e4m3_bytes(jnp.asarray(b)))
    np.testing.assert_array_equal(_e4m3(lo), E2M1[b & 15] * 2.0 ** -6)
    np.testing.assert_array_equal(_e4m3(hi), E2M1[b >> 4] * 2.0 ** -6)
    assert np.array_equal(np.signbit(_e4m3(lo)), np.signbit(E2M1[b & 15]))
    # the PTX on words of four bytes (every byte in every lane, with neighbours that would leak through a bad mask)
    words = np.stack([b, np.roll(b, 1), np.roll(b, 7), 255 - b], axis=1).copy().view(np.uint32)[:, 0]
    lo_w = ((words << 2) & 0x1C1C1C1C) | ((words << 4) & 0x80808080)
    hi_w = ((words >> 2) & 0x1C1C1C1C) | (words & 0x80808080)
    src = words.view(np.uint8)
    np.testing.assert_array_equal(_e4m3(lo_w.view(np.uint8)), E2M1[src & 15] * 2.0 ** -6)
    np.testing.assert_array_equal(_e4m3(hi_w.view(np.uint8)), E2M1[src >> 4] * 2.0 ** -6)
    assert G.FP8_CHUNK_ORDER == tuple(range(0, 32, 2)) + tuple(range(1, 32, 2))


def test_fp8_block_codes_are_the_fp8_rounding_in_parts():
    """codes x scale is the release's FP8 rounding bit for bit (rounded input: the input itself); a block holding an
    inf gets a NaN scale."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 128)).astype(np.float32) * np.exp2(rng.integers(-20, 20, (5, 4, 1))).repeat(32, 2) \
        .reshape(5, 128)
    x[4, 40] = np.inf
    codes, scale = Q.fp8_e4m3_block_codes(jnp.asarray(x))
    assert codes.dtype == jnp.float8_e4m3fn and codes.shape == (5, 128) and scale.shape == (5, 4)
    y = np.asarray(codes, np.float32).reshape(5, 4, 32) * np.asarray(scale)[:, :, None]
    want = np.asarray(Q.fake_quant_gemm_input_fp8(jnp.asarray(x), 32)).reshape(5, 4, 32)
    np.testing.assert_array_equal(y[:4], want[:4])
    np.testing.assert_array_equal(y[4][[0, 2, 3]], want[4][[0, 2, 3]])
    assert np.isnan(np.asarray(scale)[4, 1])
    c2, s2 = Q.fp8_e4m3_block_codes(jnp.asarray(want[:4].reshape(4, 128)))  # already rounded: exact
    np.testing.assert_array_equal(np.asarray(c2, np.float32).reshape(4, 4, 32) * np.asarray(s2)[:, :, None],
                                  want[:4])


def _ragged_reference(x, gs, wd):
    want = np.zeros((x.shape[0], wd.shape[1]))
    bounds = np.concatenate([[0], np.cumsum(gs)])
    for e in range(len(gs)):
        want[bounds[e]:bounds[e + 1]] = x[bounds[e]:bounds[e + 1]] @ wd[e].T
    return want, bounds[-1]


@pytest.mark.parametrize("form", [dict(), dict(mma_rows="tokens"), dict(mma_rows="tokens", block_m=32, block_n=32)])
def test_fp8_mma_form_equals_float64_on_the_dequantised_values(form):
    """21 rows over 5 experts (three empty, 3 rows past the groups' total give 0; a group of 17 spans two 16-row tiles),
    N = 80 (a partial weight-row block), K = 192 in 64-wide K steps (3 steps of 2 chunks), float32 FP8-rounded
    rows: equal to float64 within float32 accumulation noise — the weights-as-rows form and the tokens-as-rows form
    (16- and 32-row token tiles). Rows not on the FP8 grid are rounded first (the release's GEMM-input rounding);
    bf16 rows give the float32 result rounded once."""
    rng = np.random.default_rng(5)
    w = RW._quantize(rng.standard_normal((5, 80, 192)).astype(np.float32) * 0.1
                     * np.exp2(rng.integers(-6, 7, (5, 80, 1))), N.FP4_ROWS)
    wd = np.asarray(w.dequantize(), np.float64)
    gs = np.array([1, 0, 17, 0, 0], np.int32)
    raw = jnp.asarray(rng.standard_normal((21, 192)) * np.exp2(rng.integers(-8, 8, (21, 1))), jnp.float32)
    x = Q.fake_quant_gemm_input_fp8(raw, 32)
    want, total = _ragged_reference(np.asarray(x, np.float64), gs, wd)
    assert total == 18
    run = jax.jit(lambda x: G.fp4_grouped_gemm(x, jnp.asarray(gs), w.values, w.scales, mma="fp8", block_k=64,
                                               interpret=True, **form))
    got = run(x)
    assert got.shape == (21, 80) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(got)[18:], 0.0)
    np.testing.assert_array_equal(run(raw), got)  # unrounded rows: the kernel rounds them as the release does
    gb = G.fp4_grouped_gemm(x.astype(jnp.bfloat16), jnp.asarray(gs), w.values, w.scales, mma="fp8", block_k=64,
                            interpret=True, **form)
    assert gb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(gb, np.float32), np.asarray(got.astype(jnp.bfloat16), np.float32))


def test_fp8_mma_form_refuses_options_of_other_forms():
    x, gs = jnp.ones((4, 64), jnp.float32), jnp.array([4], jnp.int32)
    v, s = jnp.zeros((1, 64, 32), jnp.uint8), jnp.full((1, 64, 2), 127, jnp.uint8)
    for bad in (dict(mma_rows="lanes"), dict(decode="bf16x2"), dict(split_k=2), dict(block_n=32),
                dict(mma_rows="tokens", block_m=64), dict(mma_rows="tokens", block_n=48)):
        with pytest.raises(ValueError):
            G.fp4_grouped_gemm(x, gs, v, s, mma="fp8", interpret=True, **bad)
    v8, s8 = jnp.zeros((64, 64), jnp.uint8), jnp.full((2, 2), 127, jnp.uint8)
    for bad in (dict(block_m=64), dict(block_n=48)):
        with pytest.raises(ValueError, match="below the 64-row wgmma"):
            G.fp8_gemm(x, v8, s8, mma="fp8", mma_rows="tokens", interpret=True, **bad)
    with pytest.raises(ValueError, match="mma must be"):
        G.fp4_grouped_gemm(x, gs, v, s, mma="fp16", interpret=True)
    assert QG.fp4_grouped is not None


@pytest.mark.parametrize("rows, shape", [("weights", "64x16"), ("tokens", "16x64")])
def test_fp8_mma_form_lowers_to_an_fp8_dot_with_float32_promotion(rows, shape):
    """The Triton IR of the batch-32 w1 shape: the e4m3 x e4m3 ``tt.dot`` carries ``maxNumImpreciseAcc = 32`` (else
    Triton takes FP8 with a float32 result to the pre-Hopper mma.sync path, widening each byte), and no bf16 dot;
    its result is [64 weight rows, 16 tokens] in the weights-as-rows form, [16 tokens, 64 weight rows] in the
    tokens-as-rows form (below the 64-row wgmma: Triton's synchronous MMA path)."""
    from jax._src.pallas.triton import lowering as L
    from jax._src.pallas.triton import pallas_call_registration as R

    got, orig = [], L.lower_jaxpr_to_triton_module

    def wrapped(*a, **k):
        res = orig(*a, **k)
        got.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    sds, u8 = jax.ShapeDtypeStruct, jnp.uint8
    R.lowering.lower_jaxpr_to_triton_module = wrapped
    try:
        jax.jit(lambda x, g, v, s: G.fp4_grouped_gemm(x, g, v, s, mma="fp8", mma_rows=rows)).trace(
            sds((192, 5120), jnp.bfloat16), sds((16,), jnp.int32), sds((16, 2304, 2560), u8),
            sds((16, 2304, 160), u8)).lower(lowering_platforms=("cuda",))
    finally:
        R.lowering.lower_jaxpr_to_triton_module = orig
    (ir,) = got
    dots = [ln for ln in ir.splitlines() if "tt.dot" in ln]
    assert dots and all("maxNumImpreciseAcc = 32" in ln and "f8E4M3FN" in ln and f"-> tensor<{shape}xf32>" in ln
                        for ln in dots)


@pytest.mark.parametrize("form", [dict(), dict(mma_rows="tokens"), dict(mma_rows="tokens", block_m=16, block_n=32)])
def test_fp8_dense_mma_form_equals_float64_on_the_dequantised_values(form):
    """``fp8_gemm(..., mma="fp8")``: 13 FP8-rounded float32 rows (a partial row block), N = 80 (a partial weight
    block; 32 x 32 block scales), K = 192 in 64-wide K steps: equal to float64 within float32 accumulation noise —
    the weights-as-rows form and the tokens-as-rows form (32- and 16-row token tiles, 64- and 32-row weight blocks);
    unrounded rows are rounded first; bf16 rows give the float32 result rounded once."""
    rng = np.random.default_rng(9)
    w = RW._quantize(rng.standard_normal((80, 192)).astype(np.float32) * 0.05
                     * np.exp2(rng.integers(-6, 7, (80, 1))), N.FP8_BLOCK)
    raw = jnp.asarray(rng.standard_normal((13, 192)) * np.exp2(rng.integers(-8, 8, (13, 1))), jnp.float32)
    x = Q.fake_quant_gemm_input_fp8(raw, 32)
    want = np.asarray(x, np.float64) @ np.asarray(w.dequantize(), np.float64).T
    run = jax.jit(lambda x: G.fp8_gemm(x, w.values, w.scales, mma="fp8", block_k=64, interpret=True, **form))
    got = run(x)
    assert got.shape == (13, 80) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    np.testing.assert_array_equal(run(raw), got)
    gb = G.fp8_gemm(x.astype(jnp.bfloat16), w.values, w.scales, mma="fp8", block_k=64, interpret=True, **form)
    np.testing.assert_array_equal(np.asarray(gb, np.float32), np.asarray(got.astype(jnp.bfloat16), np.float32))
    with pytest.raises(ValueError, match="mma='fp8'"):
        G.fp8_gemm(x, w.values, w.scales, mma="fp8", split_k=2, interpret=True)
