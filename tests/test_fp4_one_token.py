"""One token's release FP4 routed experts on the GPU gemv kernels (``kernels.quant_gemm.fp4_slot_swiglu`` /
``fp4_slot_down``, Pallas interpret mode on CPU): equal to float64 on the dequantised picked experts and the
FP8-rounded input within float32 accumulation-order noise; ``moe_inference(..., fp4_one_token=True)`` takes them
for one token and they equal the grouped-kernel path; the Triton lowering works at the release's widths; bad
operands fail clearly."""

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


def test_fp4_slot_kernels_equal_float64_on_the_picked_experts():
    """float32 activations (no output rounding), 3 picks of 5 experts, K = 96 / F = 64 (several K steps; the
    tiling's prefetch, block sizes and decode forms varied), against float64 on the dequantised experts."""
    rng = np.random.default_rng(11)
    e, f, d, limit = 5, 64, 96, 0.7
    w1, w3 = _weights(rng, (e, f, d)), _weights(rng, (e, f, d))
    w2 = _weights(rng, (e, d, f))
    picks = jnp.array([3, 0, 4], jnp.int32)
    wts = jnp.asarray(rng.uniform(0.2, 1.5, 3), jnp.float32)
    x = Q.fake_quant_gemm_input_fp8(jnp.asarray(rng.standard_normal(d), jnp.float32), 32)
    w1d, w3d, w2d = (np.asarray(w.dequantize(), np.float64)[np.asarray(picks)] for w in (w1, w3, w2))
    g = np.einsum("i,soi->so", np.asarray(x, np.float64), w1d)
    u = np.einsum("i,soi->so", np.asarray(x, np.float64), w3d)
    want_act = _silu(np.minimum(g, limit)) * np.clip(u, -limit, limit) * np.asarray(wts, np.float64)[:, None]
    for tuning in (None, dict(block_n=4, block_k=32, prefetch=1), dict(decode="pair"),
                   dict(decode="pair_group", block_n=2, block_k=64, prefetch=1),
                   dict(decode="word", block_n=2, block_k=64, prefetch=1),
                   # persistent programs (48 items over 5 programs: 10 / 9 each; loads 2 steps ahead, across items)
                   dict(decode="word", block_n=4, block_k=32, prefetch=2, programs=5)):
        act = QG.fp4_slot_swiglu(x, picks, wts, w1, w3, limit=limit, backend=BE, tuning=tuning)
        assert act.shape == (3, f) and act.dtype == jnp.float32
        np.testing.assert_allclose(act, want_act, rtol=1e-5, atol=1e-6 * np.abs(want_act).max(), err_msg=str(tuning))
    a = Q.fake_quant_gemm_input_fp8(act, 32)
    want = np.einsum("si,soi->o", np.asarray(a, np.float64), w2d)
    for tuning in (None, dict(block_n=2, block_k=32, prefetch=2), dict(decode="pair"),
                   dict(decode="pair_group", block_n=4, block_k=32, prefetch=0),
                   dict(decode="word", block_n=4, block_k=64, prefetch=1),
                   dict(decode="word", block_n=8, block_k=32, prefetch=1, programs=7)):  # 36 items: 6 / 5 each
        y = QG.fp4_slot_down(a, picks, w2, backend=BE, tuning=tuning)
        assert y.shape == (d,) and y.dtype == jnp.float32
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=str(tuning))
    # the plain-JAX oracle of the same functions agrees too
    np.testing.assert_allclose(QG.fp4_slot_swiglu(x, picks, wts, w1, w3, limit=limit, backend="reference"),
                               want_act, rtol=1e-5, atol=1e-6 * np.abs(want_act).max())


def test_moe_inference_takes_the_one_token_kernels_and_equals_the_grouped_path():
    """bf16 activations: one token through ``moe_inference(fp4_one_token=True)`` on marked FP4 experts takes the slot
    kernels (their names are in the lowered program, the grouped kernel's is not) and equals the grouped-kernel path
    (``fp4_one_token=False``; itself tested against the plain-JAX reference in test_quant_gemm.py) up to one bf16
    rounding step."""
    from dsv41_jax.inference.moe import moe_inference

    rng = np.random.default_rng(12)
    e, d, f = 6, 64, 32
    w1, w3 = _weights(rng, (e, f, d), 0.2), _weights(rng, (e, f, d), 0.2)
    w2 = _weights(rng, (e, d, f), 0.2)
    shared = {k: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.bfloat16)
              for k, s in (("w1", (f, d)), ("w2", (d, f)), ("w3", (f, d)))}
    gate = {"weight": jnp.asarray(rng.standard_normal((e, d)), jnp.float32), "bias": jnp.zeros((e,), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((1, 1, d)), jnp.bfloat16)

    def params(gemm):
        return {"gate": gate, "shared_experts": shared,
                "experts": {k: Fp8GemmInput(w, gemm) for k, w in (("w1", w1), ("w2", w2), ("w3", w3))}}

    def run(gemm, one_token, grouped_tuning=()):
        fn = jax.jit(lambda p, x: moe_inference(x, p, top_k=3, temp=1.0, scaling=1.5, limit=7.0,
                                                fp4_one_token=one_token, fp4_grouped_tuning=grouped_tuning))
        return fn(params(gemm), x), fn.lower(params(gemm), x).as_text()

    got, text = run(BE, True)
    assert "fp4_slot_swiglu" in text and "fp4_slot_down" in text and "fp4_grouped_gemm" not in text
    grouped, text_g = run(BE, False)
    assert "fp4_grouped_gemm" in text_g and "fp4_slot" not in text_g
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(grouped, np.float32), rtol=2 ** -7,
                               atol=2 ** -7 * float(jnp.max(jnp.abs(grouped.astype(jnp.float32)))))
    # the grouped kernel's tuning reaches it through moe_inference (InferenceOptions.fp4_grouped_tuning): its
    # tokens-as-rows form, the default before the weights-as-rows form
    tuned, text_t = run(BE, False, (("mma_rows", "tokens"),))
    assert "fp4_grouped_gemm" in text_t
    np.testing.assert_allclose(np.asarray(tuned, np.float32), np.asarray(grouped, np.float32), rtol=2 ** -7,
                               atol=2 ** -7 * float(jnp.max(jnp.abs(grouped.astype(jnp.float32)))))


def test_fp4_slot_kernels_lower_to_triton_at_release_widths():
    """The Triton lowering (done in Python, no GPU) of both kernels at the bench model's expert shapes (16 experts
    of 2304 x 5120, top-6), bf16."""
    from dsv41_jax.kernels import quant_gemm_gpu as G

    sds, u8 = jax.ShapeDtypeStruct, jnp.uint8
    e, f, d = 16, 2304, 5120
    w13 = (sds((e, f, d // 2), u8), sds((e, f, d // 32), u8))
    up = jax.jit(lambda x, p, w, a, b, c, dd: G.fp4_slot_swiglu(x, p, w, a, b, c, dd, limit=10.0)).trace(
        sds((d,), jnp.bfloat16), sds((6,), jnp.int32), sds((6,), jnp.float32), *w13, *w13)
    down = jax.jit(G.fp4_slot_down).trace(sds((6, f), jnp.bfloat16), sds((6,), jnp.int32),
                                          sds((e, d, f // 2), u8), sds((e, d, f // 32), u8))
    for tr in (up, down):
        assert "triton" in tr.lower(lowering_platforms=("cuda",)).as_text()


def test_fp4_slot_kernels_refuse_bad_operands_clearly():
    rng = np.random.default_rng(13)
    w = _weights(rng, (3, 32, 64))
    x = jnp.ones((64,), jnp.float32)
    picks, wts = jnp.array([0, 2], jnp.int32), jnp.ones((2,), jnp.float32)
    with pytest.raises(QG.QuantGemmError, match="one token's features"):
        QG.fp4_slot_swiglu(x[None], picks, wts, w, w, limit=1.0, backend=BE)
    with pytest.raises(QG.QuantGemmError, match="one routing weight per slot"):
        QG.fp4_slot_swiglu(x, picks, wts[:1], w, w, limit=1.0, backend=BE)
    with pytest.raises(QG.QuantGemmError, match="integer vector"):
        QG.fp4_slot_swiglu(x, picks.astype(jnp.float32), wts, w, w, limit=1.0, backend=BE)
    with pytest.raises(QG.QuantGemmError, match="the weight takes K = 64"):
        QG.fp4_slot_swiglu(jnp.ones((32,), jnp.float32), picks, wts, w, w, limit=1.0, backend=BE)
    with pytest.raises(QG.QuantGemmError, match="one row per slot"):
        QG.fp4_slot_down(jnp.ones((3, 64), jnp.float32), picks, w, backend=BE)
    with pytest.raises(QG.QuantGemmError, match="no TPU kernel"):
        QG.fp4_slot_down(jnp.ones((2, 64), jnp.float32), picks, w, backend="pallas_tpu_interpret")


def test_pair_decode_equals_the_nibble_decode_on_every_byte():
    """``_e2m1_pair_f16`` (both nibbles' float16 patterns built in one 32-bit lane) equals the one-nibble decode
    bit for bit on all 256 packed bytes (signed zeros included)."""
    from dsv41_jax.kernels import quant_gemm_gpu as G

    b = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)
    lo, hi = G._e2m1_pair_f16(b)
    want_lo = G.decode_e2m1_scaled(b.astype(jnp.int32) & 15).astype(jnp.float32)
    want_hi = G.decode_e2m1_scaled(b.astype(jnp.int32) >> 4).astype(jnp.float32)
    for got, want in ((lo, want_lo), (hi, want_hi)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


def test_word_decode_ptx_bit_steps_equal_the_nibble_decode_on_every_byte():
    """The integer steps of ``_E2M1_WORD_PTX`` (shifts, masks, byte permutes with a zero low byte), replayed in
    numpy on words holding every byte value at every byte position, give each nibble's float16 pattern of
    ``decode_e2m1_scaled`` (the low nibble of byte j in half j of the first two float16x2 registers, the high one in
    the last two)."""
    from dsv41_jax.kernels import quant_gemm_gpu as G

    ptx = G._E2M1_WORD_PTX
    for step in ("shl.b32 a, w, 1;", "shl.b32 b, w, 4;", "and.b32 b, b, 0x80808080;", "and.b32 a, a, 0x0E0E0E0E;",
                 "shr.u32 a, w, 3;", "and.b32 b, w, 0x80808080;", "prmt.b32 p0, lo, 0, 0x1404;",
                 "prmt.b32 p1, lo, 0, 0x3424;", "prmt.b32 p2, hi, 0, 0x1404;", "prmt.b32 p3, hi, 0, 0x3424;"):
        assert step in ptx, step  # the replay below follows these instructions

    def prmt(a, sel):  # PTX prmt with b = 0: result byte i = byte (sel >> 4i) & 7 of (a, 0)
        out = np.zeros_like(a)
        for i in range(4):
            idx = (sel >> (4 * i)) & 7
            byte = (a >> np.uint32(8 * idx)) & np.uint32(0xFF) if idx < 4 else np.zeros_like(a)
            out |= byte << np.uint32(8 * i)
        return out

    b = np.arange(256, dtype=np.uint32)
    words = [b << np.uint32(8 * j) | ((b[::-1] + j) % 256) << np.uint32(8 * ((j + 1) % 4)) for j in range(4)]
    for w in words:
        lo = ((w << np.uint32(1)) & np.uint32(0x0E0E0E0E)) | ((w << np.uint32(4)) & np.uint32(0x80808080))
        hi = ((w >> np.uint32(3)) & np.uint32(0x0E0E0E0E)) | (w & np.uint32(0x80808080))
        regs = [prmt(lo, 0x1404), prmt(lo, 0x3424), prmt(hi, 0x1404), prmt(hi, 0x3424)]
        for j in range(4):
            byte = ((w >> np.uint32(8 * j)) & np.uint32(0xFF)).astype(np.int32)
            for r, nib in ((regs[j // 2], byte & 15), (regs[2 + j // 2], byte >> 4)):
                half = (r >> np.uint32(16 * (j % 2))) & np.uint32(0xFFFF)
                want = np.asarray(G.decode_e2m1_scaled(jnp.asarray(nib))).view(np.uint16)
                np.testing.assert_array_equal(half.astype(np.uint16), want)
