"""A decode batch's release FP4 routed experts as every expert on every token (``kernels.quant_gemm.fp4_every_swiglu``
/ ``fp4_every_down``, Pallas interpret mode on CPU): equal to float64 on the dequantised experts within float32
accumulation-order noise, unused experts and zero routing weights giving exact zeros, the epilogue's FP8 rounding bit
for bit XLA's; ``moe_inference(...,
fp4_every_expert=True)`` takes them at decode batches (several tokens on one expert) and equals the grouped-kernel
path, ``live`` masking included; the Triton lowering works at the bench model's widths; the rule and bad operands."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.checkpoint import names as N
from dsv41_jax.kernels import quant_gemm as QG
from dsv41_jax.model import release_weights as RW
from dsv41_jax.ops import quant as Q
from dsv41_jax.ops.linear import Fp8GemmInput

BE = "pallas_gpu_interpret"


def _weights(rng, shape, scale=0.1):
    # magnitudes spread over 2^±6 per row so the scales differ
    w = rng.standard_normal(shape).astype(np.float32) * scale * np.exp2(rng.integers(-6, 7, shape[:-1] + (1,)))
    return RW._quantize(w, N.FP4_ROWS)


def _silu(g):
    return g / (1.0 + np.exp(-g))


def test_every_expert_kernels_equal_float64_on_the_dequantised_experts():
    """float32 activations, 5 tokens (a masked 16-column token tile) on 5 experts, K = 96 / F = 64: expert 1 unused,
    token 2 not on expert 3 (weight 0) — exact zeros there; two tilings (several K steps and column blocks)."""
    rng = np.random.default_rng(21)
    e, f, d, m, limit = 5, 64, 96, 5, 0.7
    w1, w3, w2 = _weights(rng, (e, f, d)), _weights(rng, (e, f, d)), _weights(rng, (e, d, f))
    x = Q.fake_quant_gemm_input_fp8(jnp.asarray(rng.standard_normal((m, d)), jnp.float32), 32)
    wts = rng.uniform(0.2, 1.5, (e, m)).astype(np.float32)
    wts[1], wts[3, 2] = 0.0, 0.0
    used = jnp.array([1, 0, 1, 1, 1], jnp.int32)
    x64 = np.asarray(x, np.float64)
    w1d, w3d, w2d = (np.asarray(w.dequantize(), np.float64) for w in (w1, w3, w2))
    g, u = np.einsum("mi,eoi->emo", x64, w1d), np.einsum("mi,eoi->emo", x64, w3d)
    want_act = _silu(np.minimum(g, limit)) * np.clip(u, -limit, limit) * wts[:, :, None]
    for tuning in (None, dict(block_n=16, block_k=32)):
        act = QG.fp4_every_swiglu(x, jnp.asarray(wts), used, w1, w3, limit=limit, backend=BE, tuning=tuning)
        assert act.shape == (e, m, f) and act.dtype == jnp.float32
        np.testing.assert_allclose(act, want_act, rtol=1e-5, atol=1e-6 * np.abs(want_act).max(), err_msg=str(tuning))
        assert not np.any(np.asarray(act)[1]) and not np.any(np.asarray(act)[3, 2])  # exact zeros
    # the epilogue's rounding for the down projection: bit for bit the XLA rounding of the same activations
    tun = dict(block_n=32, block_k=32)
    plain = QG.fp4_every_swiglu(x, jnp.asarray(wts), used, w1, w3, limit=limit, backend=BE, tuning=tun)
    rounded = QG.fp4_every_swiglu(x, jnp.asarray(wts), used, w1, w3, limit=limit, round_fp8=True, backend=BE,
                                  tuning=tun)
    np.testing.assert_array_equal(np.asarray(rounded).view(np.uint32),
                                  np.asarray(Q.fake_quant_gemm_input_fp8(plain, 32)).view(np.uint32))
    with pytest.raises(ValueError, match="multiple of 32"):
        QG.fp4_every_swiglu(x, jnp.asarray(wts), used, w1, w3, limit=limit, round_fp8=True, backend=BE,
                            tuning=dict(block_n=16))
    a = Q.fake_quant_gemm_input_fp8(jnp.asarray(want_act, jnp.float32), 32)
    want = np.einsum("emi,eoi->mo", np.delete(np.asarray(a, np.float64), 1, 0), np.delete(w2d, 1, 0))
    a = a.at[1].set(1.0)  # an unused expert's activations are not read
    for tuning in (None, dict(block_n=32, block_k=32)):
        y = QG.fp4_every_down(a, used, w2, backend=BE, tuning=tuning)
        assert y.shape == (m, d) and y.dtype == jnp.float32
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=str(tuning))
    # the plain-JAX oracle of the same functions agrees too
    np.testing.assert_allclose(QG.fp4_every_down(a, used, w2, backend="reference"), want, rtol=1e-5,
                               atol=1e-6 * np.abs(want).max())


def _moe_params(rng, e, d, f, gemm):
    w1, w3, w2 = _weights(rng, (e, f, d), 0.2), _weights(rng, (e, f, d), 0.2), _weights(rng, (e, d, f), 0.2)
    shared = {k: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.bfloat16)
              for k, s in (("w1", (f, d)), ("w2", (d, f)), ("w3", (f, d)))}
    gate = {"weight": jnp.asarray(rng.standard_normal((e, d)), jnp.float32), "bias": jnp.zeros((e,), jnp.float32)}
    return {"gate": gate, "shared_experts": shared,
            "experts": {k: Fp8GemmInput(w, gemm) for k, w in (("w1", w1), ("w2", w2), ("w3", w3))}}


def test_moe_inference_takes_the_every_expert_kernels_and_equals_the_grouped_path():
    """bf16, 4 tokens x top-3 on 6 experts (several tokens on one expert): ``fp4_every_expert=True`` lowers to the
    every-expert kernels (not the grouped one) and equals the grouped-kernel path (tested against the plain-JAX
    reference in test_quant_gemm.py) up to one bf16 rounding step; with ``live`` the masked token's routed output
    is exactly 0 and the live tokens' are unchanged."""
    from dsv41_jax.inference.moe import moe_inference, routed_fp4_every_expert
    from dsv41_jax.ops.moe import route

    rng = np.random.default_rng(22)
    e, d, f, k = 6, 64, 32, 3
    p = _moe_params(rng, e, d, f, BE)
    x = jnp.asarray(rng.standard_normal((2, 2, d)), jnp.bfloat16)

    def run(every):
        fn = jax.jit(lambda p, x: moe_inference(x, p, top_k=k, temp=1.0, scaling=1.5, limit=7.0,
                                                fp4_every_expert=every))
        return fn(p, x), fn.lower(p, x).as_text()

    got, text = run(True)
    assert "fp4_every_swiglu" in text and "fp4_every_down" in text and "fp4_grouped_gemm" not in text
    grouped, text_g = run(False)
    assert "fp4_grouped_gemm" in text_g and "fp4_every" not in text_g
    tol = dict(rtol=2 ** -7, atol=2 ** -7 * float(jnp.max(jnp.abs(grouped.astype(jnp.float32)))))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(grouped, np.float32), **tol)

    flat = x.reshape(-1, d)
    weights, idx, _ = route(flat, p["gate"]["weight"], p["gate"]["bias"], top_k=k, temp=1.0, scaling=1.5)
    assert np.bincount(np.asarray(idx).ravel(), minlength=e).max() >= 2  # tokens sharing an expert
    ex = p["experts"]
    full = routed_fp4_every_expert(flat, weights, idx, ex["w1"], ex["w2"], ex["w3"], 7.0, BE)
    live = jnp.array([True, False, True, True])
    part = routed_fp4_every_expert(flat, weights, idx, ex["w1"], ex["w2"], ex["w3"], 7.0, BE, live=live)
    np.testing.assert_array_equal(np.asarray(part)[1], 0.0)
    np.testing.assert_allclose(np.asarray(part)[live], np.asarray(full)[live], rtol=1e-6,
                               atol=1e-6 * float(jnp.max(jnp.abs(full))))


def test_every_expert_rule():
    """Only release FP4 experts on the GPU kernels, 2-64 tokens whose picks can cover every expert."""
    from dsv41_jax.inference.moe import fp4_every_expert_backend

    rng = np.random.default_rng(23)
    gpu = _moe_params(rng, 16, 64, 32, "pallas_gpu")["experts"]
    ref = _moe_params(rng, 16, 64, 32, "reference")["experts"]
    ws = (gpu["w1"], gpu["w2"], gpu["w3"])
    assert fp4_every_expert_backend(32, 6, *ws) == "pallas_gpu"
    assert fp4_every_expert_backend(3, 6, *ws) == "pallas_gpu"  # 18 picks >= 16 experts
    assert fp4_every_expert_backend(2, 6, *ws) is None  # 12 picks < 16 experts: most unpicked
    assert fp4_every_expert_backend(1, 6, *ws) is None  # one token: the one-token kernels
    assert fp4_every_expert_backend(65, 6, *ws) is None  # past one token tile
    assert fp4_every_expert_backend(32, 6, ref["w1"], ref["w2"], ref["w3"]) is None


def test_every_expert_kernels_lower_to_triton_and_refuse_bad_operands():
    """The Triton lowering (no GPU) at the bench model's expert shapes (16 experts of 2304 x 5120), batch 32 and a
    masked batch of 5, bf16; bad operands fail clearly."""
    from dsv41_jax.kernels import quant_gemm_gpu as G

    sds, u8 = jax.ShapeDtypeStruct, jnp.uint8
    e, f, d = 16, 2304, 5120
    w13 = (sds((e, f, d // 2), u8), sds((e, f, d // 32), u8))
    for m in (32, 5):
        up = jax.jit(lambda x, w, u, a, b, c, dd: G.fp4_every_swiglu(x, w, u, a, b, c, dd, limit=10.0)).trace(
            sds((m, d), jnp.bfloat16), sds((e, m), jnp.float32), sds((e,), jnp.int32), *w13, *w13)
        down = jax.jit(G.fp4_every_down).trace(sds((e, m, f), jnp.bfloat16), sds((e,), jnp.int32),
                                               sds((e, d, f // 2), u8), sds((e, d, f // 32), u8))
        for tr in (up, down):
            assert "triton" in tr.lower(lowering_platforms=("cuda",)).as_text()
    rng = np.random.default_rng(24)
    w = _weights(rng, (3, 32, 64))
    x, wts, used = jnp.ones((4, 64), jnp.float32), jnp.ones((3, 4), jnp.float32), jnp.ones((3,), jnp.int32)
    with pytest.raises(QG.QuantGemmError, match="1..64 tokens"):
        QG.fp4_every_swiglu(jnp.ones((65, 64), jnp.float32), jnp.ones((3, 65)), used, w, w, limit=1.0, backend=BE)
    with pytest.raises(QG.QuantGemmError, match=r"wts must be \[E, M\]"):
        QG.fp4_every_swiglu(x, wts[:, :3], used, w, w, limit=1.0, backend=BE)
    with pytest.raises(QG.QuantGemmError, match="integer vector of 3 experts"):
        QG.fp4_every_swiglu(x, wts, used[:2], w, w, limit=1.0, backend=BE)
    with pytest.raises(QG.QuantGemmError, match=r"act must be \[E, tokens, F\]"):
        QG.fp4_every_down(jnp.ones((2, 4, 64), jnp.float32), used, w, backend=BE)
    with pytest.raises(QG.QuantGemmError, match="no TPU kernel"):
        QG.fp4_every_down(jnp.ones((3, 4, 64), jnp.float32), used, w, backend="pallas_tpu_interpret")
