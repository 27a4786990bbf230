"""GEMMs on the release's stored FP8 / FP4 bytes (dsv41_jax.kernels.quant_gemm): the Pallas kernels (GPU Triton and
TPU Mosaic, in interpret mode on CPU) equal the plain-JAX dequantise-then-GEMM within float32 accumulation-order
noise — partial blocks, ragged groups with empty experts and rows past the groups included; bad operands fail with a
clear error; the Mosaic kernels compile ahead of time for a TPU v5p."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.checkpoint import names as N
from dsv41_jax.kernels import quant_gemm as QG
from dsv41_jax.model import release_weights as RW
from dsv41_jax.ops import quant as Q
from dsv41_jax.ops.linear import Fp8GemmInput, linear

KERNELS = ("pallas_gpu_interpret", "pallas_tpu_interpret")


def _weights(rng, shape, fmt, scale=0.05):
    # magnitudes spread over 2^±6 per row so block scales differ
    w = rng.standard_normal(shape).astype(np.float32) * scale * np.exp2(rng.integers(-6, 7, shape[:-1] + (1,)))
    return RW._quantize(w, fmt)


@pytest.mark.parametrize("backend", KERNELS)
def test_fp8_kernels_equal_the_dequantise_then_gemm_reference(backend):
    """M = 3 in float32 (N and K not multiples of 32 or of the kernels' blocks) and a bf16 GEMV."""
    rng = np.random.default_rng(0)
    w = _weights(rng, (80, 100), N.FP8_BLOCK)
    x = jnp.asarray(rng.standard_normal((3, 100)), jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(w.dequantize(), np.float64).T
    got = QG.fp8_linear(x, w, backend=backend)
    assert got.dtype == jnp.float32 and got.shape == (3, 80)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(got, QG.fp8_linear(x, w, backend="reference"), rtol=1e-5,
                               atol=1e-6 * np.abs(want).max())

    w = _weights(rng, (64, 256), N.FP8_BLOCK)
    xb = jnp.asarray(rng.standard_normal((1, 256)), jnp.bfloat16)
    got = QG.fp8_linear(xb, w, backend=backend)
    ref = QG.fp8_linear(xb, w, backend="reference")
    assert got.dtype == jnp.bfloat16
    # both accumulate exact bf16 products in float32 and round once to bf16: equal up to one bf16 rounding step
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=2 ** -7,
                               atol=2 ** -7 * float(jnp.max(jnp.abs(ref.astype(jnp.float32)))))


@pytest.mark.parametrize("backend", KERNELS)
def test_fp4_grouped_kernels_equal_ragged_reference(backend):
    """13 rows over 5 experts (two empty, rows past the groups' total give 0), K = 96 (partial K blocks), against
    the dequantise-then-GEMM in float64."""
    rng = np.random.default_rng(1)
    w = _weights(rng, (5, 40, 96), N.FP4_ROWS, scale=0.1)
    gs = jnp.array([3, 0, 6, 0, 2], jnp.int32)  # 11 of 13 rows
    x = Q.fake_quant_gemm_input_fp8(jnp.asarray(rng.standard_normal((13, 96)), jnp.float32), 32)
    wd = np.asarray(w.dequantize(), np.float64)
    want = np.zeros((13, 40))
    bounds = np.concatenate([[0], np.cumsum(np.asarray(gs))])
    for e in range(5):
        want[bounds[e]:bounds[e + 1]] = np.asarray(x, np.float64)[bounds[e]:bounds[e + 1]] @ wd[e].T
    got = QG.fp4_grouped(x, gs, w, backend=backend)
    assert got.shape == (13, 40) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(got)[11:], 0.0)


def test_gpu_kernel_tilings_are_exact_on_the_contiguous_paths():
    """Shapes that divide the blocks take the kernels' contiguous-load paths (the cases above take the masked
    ones); K splits, 16- and 64-row column blocks, and rows past the groups' total zeroed by the spare tiles."""
    rng = np.random.default_rng(4)
    w = _weights(rng, (64, 512), N.FP8_BLOCK)
    x = jnp.asarray(rng.standard_normal((16, 512)), jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(w.dequantize(), np.float64).T
    for tuning in (dict(block_n=16, block_k=128, split_k=3), dict(block_n=64, block_k=128, prefetch=2,
                                                                   scale_side="x"),
                   dict(mma_rows="weights", block_k=128, split_k=3), dict(mma_rows="weights", block_n=32)):
        got = QG.fp8_linear(x, w, backend="pallas_gpu_interpret", tuning=tuning)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=str(tuning))
    # the weights-as-rows form with bf16 activations (the bf16x2 e4m3 decode) and partial blocks (M 13, N 80, K 100)
    w_odd = _weights(rng, (80, 100), N.FP8_BLOCK)
    xb = jnp.asarray(rng.standard_normal((13, 100)), jnp.bfloat16)
    want_b = np.asarray(xb.astype(jnp.float32), np.float64) @ np.asarray(w_odd.dequantize(), np.float64).T
    got = QG.fp8_linear(xb, w_odd, backend="pallas_gpu_interpret", tuning=dict(mma_rows="weights", block_m=16,
                                                                                block_k=64))
    np.testing.assert_allclose(np.asarray(got, np.float32), want_b, rtol=2 ** -8, atol=2 ** -8 * np.abs(want_b).max())
    # the gemv form (M = 1): unrolled K steps loaded ahead, 3 K splits of 3 steps over 8 K blocks (one masked);
    # 4-row column blocks (8 programs per scale row) with every K step loaded ahead; the [rows, K/32, 32] group view
    # (scale bytes loaded per 32-column group) on the masked and the contiguous path
    for tuning in (dict(block_n=8, block_k=64, split_k=3, prefetch=1), dict(block_n=32, prefetch=0),
                   dict(block_n=4, block_k=128, prefetch=4), dict(block_n=8, block_k=64, split_k=3, group_view=True),
                   dict(block_n=4, block_k=128, prefetch=4, group_view=True),
                   # persistent programs walking the column blocks, loads 2 K steps ahead across blocks
                   dict(block_n=8, block_k=32, prefetch=2, programs=3)):
        got = QG.fp8_linear(x[:1], w, backend="pallas_gpu_interpret", tuning=tuning)
        np.testing.assert_allclose(got, want[:1], rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=str(tuning))
    w4 = _weights(rng, (3, 64, 512), N.FP4_ROWS, scale=0.1)
    gs = jnp.array([3, 0, 9], jnp.int32)
    x = Q.fake_quant_gemm_input_fp8(jnp.asarray(rng.standard_normal((16, 512)), jnp.float32), 32)
    wd = np.asarray(w4.dequantize(), np.float64)
    want = np.zeros((16, 64))
    want[:3], want[3:12] = np.asarray(x[:3], np.float64) @ wd[0].T, np.asarray(x[3:12], np.float64) @ wd[2].T
    for tuning in (dict(mma_rows="tokens", block_m=16, block_n=64, block_k=128),
                   dict(mma_rows="weights", block_m=16, block_n=32, block_k=128),
                   dict(mma_rows="weights", block_m=16, block_n=32, block_k=64, split_k=2)):
        got = QG.fp4_grouped(x, gs, w4, backend="pallas_gpu_interpret", tuning=tuning)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=str(tuning))
    # bf16 activations: the weights-as-rows form with the float32 and the bf16x2 decode (code 1 = 0.5 is a bf16
    # subnormal pattern before its scale) against float64 on the same bf16 inputs, within one bf16 rounding
    xb = x.astype(jnp.bfloat16)
    want_b = np.zeros((16, 64))
    xb64 = np.asarray(xb.astype(jnp.float32), np.float64)
    want_b[:3], want_b[3:12] = xb64[:3] @ wd[0].T, xb64[3:12] @ wd[2].T
    for tuning in (dict(mma_rows="weights", decode="f32", block_m=16, block_n=32, block_k=128),
                   dict(mma_rows="weights", decode="bf16x2", block_m=16, block_n=32, block_k=128),
                   dict(mma_rows="weights", decode="bf16x2", block_m=16, block_n=32, block_k=128, split_k=4)):
        got = QG.fp4_grouped(xb, gs, w4, backend="pallas_gpu_interpret", tuning=tuning)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), want_b, rtol=2 ** -8,
                                   atol=2 ** -8 * np.abs(want_b).max(), err_msg=str(tuning))


def test_decode_defaults_pick_the_measured_forms():
    """The decode defaults measured faster on an H200 (benchmarks/RESULTS.md, 2026-12-02 18:39 UTC and
    2026-12-03): the FP8 weights-as-rows form for 1 < M <= 32 unless a tokens-form option is asked for, the gemv
    form at M = 1 and its tilings per K, the tokens form above 32 rows; the grouped FP4 weights form's 16-row token
    tile up to 12 rows per expert on average; the one-token FP4 kernels' "word" decode and its tiling."""
    from dsv41_jax.kernels import quant_gemm_gpu as G

    assert G.fp8_default_tiling(32, 2304, 5120)["mma_rows"] == "weights"
    assert G.fp8_default_tiling(2, 2304, 5120)["mma_rows"] == "weights"
    assert G.fp8_default_tiling(1, 2304, 5120)["gemv"]
    assert G.fp8_default_tiling(33, 2304, 5120)["mma_rows"] == "tokens"
    for tokens_option in (dict(block_n=16), dict(scale_side="w"), dict(prefetch=2), dict(group_view=True)):
        assert G.fp8_default_tiling(32, 2304, 5120, **tokens_option)["mma_rows"] == "tokens", tokens_option
    assert G.fp8_default_tiling(32, 2304, 5120, block_n=32)["mma_rows"] == "weights"
    # the K split divides the K blocks where it can (K = 2304: 9 blocks of 256, 3 + 3 + 3, not 5 + 4, which takes the
    # masked loads in every K step); an asked-for split is kept, and a K with a partial block keeps the wanted split
    # (256-wide K steps named: the M = 32 default without them is pinned in test_fp8_tiling_pin_...)
    assert G.fp8_default_tiling(32, 5120, 2304, block_k=256)["split_k"] == 3
    assert G.fp8_default_tiling(32, 5120, 2304, split_k=2)["split_k"] == 2
    assert G.fp8_default_tiling(32, 5120, 8192, block_k=256)["split_k"] == 4
    assert G.fp8_default_tiling(32, 5120, 2300, block_k=256)["split_k"] == 2
    # the M = 1 gemv's K-step / column-block defaults at the bench model's single-weight shapes (2026-12-03): wo_b
    # (K 8192) 512-wide steps 2 ahead, the shared expert's w2 (K 2304) 128-wide steps, wq_b (K 1280, N 32768) 16-row
    # blocks (persistent, 1 step ahead); a K none of these measured (5120) keeps the 8-row, 256-wide, 8-ahead tiling
    pick = ("block_n", "block_k", "prefetch")
    assert [G.fp8_default_tiling(1, n, k)[a] for n, k in ((5120, 8192), (5120, 2304), (32768, 1280), (2304, 5120))
            for a in pick] == [8, 512, 2, 8, 128, 8, 16, 256, 1, 8, 256, 8]
    # wq_b persistent (528 programs, 1 step ahead; 2026-12-03 15:15), the other shapes not
    assert [G.fp8_default_tiling(1, n, k)["programs"] for n, k in ((32768, 1280), (5120, 8192), (5120, 2304))] == [
        528, 0, 0]
    # the one-token FP4 kernels: the "word" decode, gate / up 4 warps 2 steps ahead, down 2 ahead; "pair_group" keeps
    # the tiling it was measured at
    assert G.FP4_SLOT_DEFAULT_DECODE == "word"
    assert [G.fp4_slot_tiling(2304, 5120)[a] for a in ("num_warps", "prefetch")] == [4, 2]
    assert G.fp4_slot_tiling(5120, 2304, down=True)["prefetch"] == 2
    assert [G.fp4_slot_tiling(2304, 5120, decode="pair_group")[a] for a in ("num_warps", "prefetch")] == [8, 4]
    assert G.fp4_weight_rows_block_m(192, 16) == 16  # the batch-32 step: 12 rows per expert
    assert G.fp4_weight_rows_block_m(193, 16) == 32
    assert G.fp4_weight_rows_block_m(192, 256) == 16
    assert G.fp4_weight_rows_block_m(2048, 16) == 64


def test_bf16x2_e2m1_patterns_are_the_e2m1_values():
    """The bf16x2 decodes' bit arithmetic (``_e2m1_bf16x2_ptx`` / ``_e4m3_bf16x2_ptx``, run on the GPU only) on all
    256 bytes, in numpy (subnormals kept): the FP4 pattern of either nibble times 2^126 is the e2m1 value, the FP8
    pattern times 2^120 the e4m3 value."""
    import ml_dtypes

    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    b = np.arange(256, dtype=np.uint32)
    w = b | b << 16  # the PTX's prmt puts two bytes at bits 0-7 / 16-23; both halves must decode alike
    for mask, mul, codes in ((0x000F000F, 0x1040, b & 15), (0x00F000F0, 0x104, b >> 4)):
        pat = ((w & mask) * mul) & 0x81C081C0
        for half in (pat & 0xFFFF, pat >> 16):
            got = half.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64) * 2.0 ** 126
            np.testing.assert_array_equal(got, table[codes])
    # the e4m3 decode of the FP8 weights-as-rows form (``_e4m3_bf16x2_ptx``): pattern x 2^120 is the e4m3 value for
    # every byte but e4m3's NaN bytes 0x7f / 0xff (which the quantiser never writes)
    pat = ((w << 4) & 0x07F007F0) | ((w << 8) & 0x80008000)
    e4m3 = b.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    finite = (b & 0x7F) != 0x7F
    for half in (pat & 0xFFFF, pat >> 16):
        got = half.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64) * 2.0 ** 120
        np.testing.assert_array_equal(got[finite], e4m3[finite])


def _run_ptx(ptx: str, args: dict) -> np.ndarray:
    """A numpy interpreter of the few PTX instructions the bf16x2 e4m3 decodes use, on uint32 arrays (``args``: the
    asm operands $1, $2, ...); returns $0. prmt in its default mode (selector nibble bit 3: the selected byte's sign
    bit replicated over the byte); mul.rn.bf16x2 per 16-bit half: the product of two bf16 values is exact in float64,
    then one round-to-nearest-even to bf16 (subnormals kept, as the PTX ISA gives for bf16)."""
    import re

    import ml_dtypes

    regs = {k: np.asarray(v, np.uint64) & 0xFFFFFFFF for k, v in args.items()}

    def val(tok):
        return np.uint64(int(tok, 0)) if tok[0].isdigit() else regs[tok]

    def bf16_mul(a, b):
        out = np.zeros_like(a)
        for sh in (0, 16):
            fa, fb = (((x >> np.uint64(sh)) & np.uint64(0xFFFF)).astype(np.uint16).view(ml_dtypes.bfloat16)
                      .astype(np.float64) for x in (a, b))
            out |= (fa * fb).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint64) << np.uint64(sh)
        return out

    def prmt(a, b, sel):
        src = a | (b << np.uint64(32))  # bytes 0-3 from a, 4-7 from b
        out = np.zeros_like(a)
        for i in range(4):
            nib = (int(sel) >> (4 * i)) & 15
            byte = (src >> np.uint64(8 * (nib & 7))) & np.uint64(0xFF)
            if nib & 8:
                byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
            out |= byte << np.uint64(8 * i)
        return out

    for line in ptx.strip().strip("{}").strip().splitlines():
        op, _, rest = line.strip().rstrip(";").partition(" ")
        if op.startswith(".reg") or not op:
            continue
        d, *srcs = [t.strip() for t in rest.split(",")]
        x = [val(t) for t in srcs]
        if op == "mov.b32":
            r = x[0]
        elif op == "cvt.u32.u16":
            r = x[0] & np.uint64(0xFFFF)
        elif op == "prmt.b32":
            r = prmt(x[0], x[1], x[2])
        elif op == "shl.b32":
            r = x[0] << x[1]
        elif op in ("and.b32", "or.b32"):
            r = x[0] & x[1] if op == "and.b32" else x[0] | x[1]
        elif op == "mul.rn.bf16x2":
            r = bf16_mul(x[0], x[1])
        else:
            raise AssertionError(f"instruction {op!r} not emulated")
        regs[d] = r & np.uint64(0xFFFFFFFF)
        assert re.fullmatch(r"\$\d|[a-z]+", d), d
    return regs["$0"]


def test_e4m3_bf16x2_decodes_give_the_e4m3_values_for_every_byte():
    """The inline-PTX e4m3 decodes of the FP8 weights form (``_E4M3_BF16X2_PTX``: "sign", the default, "mask" and the
    "sign_fold" option), run by a numpy interpreter of their instructions on all 65,536 byte pairs (each byte in both
    halves next to every other byte) with two different block scales: each half is the e4m3 value times its scale,
    exactly, for every byte but e4m3fn's NaN bytes 0x7F / 0xFF (the release's quantiser never writes them), which
    give ±480 x scale; the subnormal bytes (0x01-0x07, 0x81-0x87) are exact. So the default decode is exact for
    every byte a release weight can hold."""
    import ml_dtypes

    from dsv41_jax.kernels import quant_gemm_gpu as G

    pairs = np.arange(1 << 16, dtype=np.uint64)  # $1: byte lo | byte hi << 8
    lo, hi = pairs & 0xFF, pairs >> 8
    s_lo, s_hi = 2.0 ** -9, 2.0 ** 3  # bf16 scales, $2 = hi << 16 | lo
    scales = (np.array([s_hi], ml_dtypes.bfloat16).view(np.uint16).astype(np.uint64) << 16) | \
        np.array([s_lo], ml_dtypes.bfloat16).view(np.uint16).astype(np.uint64)
    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    nan = (np.arange(256) & 0x7F) == 0x7F
    want = np.where(nan, np.where(np.arange(256) & 0x80, -480.0, 480.0), e4m3)
    assert np.all(np.isnan(e4m3[nan])) and e4m3[1] == 2.0 ** -9 and e4m3[0x87] == -7 * 2.0 ** -9  # subnormals
    # "sign_fold" (an option): one multiply by 2^120 x scale (``_e4m3_fold_multiplier``: 2^(s - 7) for scale bytes
    # <= 134, NaN above and for 0xFF)
    fold = np.asarray(G._e4m3_fold_multiplier(jnp.arange(256, dtype=jnp.uint8)).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(fold[:135], 2.0 ** (np.arange(135) - 7))
    assert np.all(np.isnan(fold[135:]))
    fold_scales = (np.uint64(np.array([2.0 ** 123], ml_dtypes.bfloat16).view(np.uint16)[0]) << np.uint64(16)) | \
        np.uint64(np.array([2.0 ** 111], ml_dtypes.bfloat16).view(np.uint16)[0])  # 2^120 x (2^-9, 2^3)
    for decode, sc2 in (("sign", scales), ("mask", scales), ("sign_fold", fold_scales)):
        out = _run_ptx(G._e4m3_bf16x2_ptx(decode), {"$1": pairs, "$2": np.broadcast_to(sc2, pairs.shape)})
        for half, b, sc in ((out & 0xFFFF, lo, s_lo), (out >> 16, hi, s_hi)):
            got = half.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
            np.testing.assert_array_equal(got, want[b] * sc, err_msg=decode)


def test_fp8_tiling_pin_and_the_m32_split_k_path_equal_the_float32_reference():
    """The M = 32 (batch-32 decode) default — 128-wide K steps, the K split of ``_fp8_m32_split`` — changes no other
    M: the default tilings at M = 1 and 64 are pinned as they were before it (main 1666707), and at M = 32 given
    block_k = 256 gives the tiling before it. The M = 32 default with a K split of 2 (N 64, K 768: 6 K blocks, one
    output tile) equals float64 on the dequantised weights in interpret mode within the float32 accumulation-noise
    tolerance of the other tests (the partial sums added in float32 afterwards), bf16 activations within one bf16
    rounding."""
    from dsv41_jax.kernels import quant_gemm_gpu as G

    base = dict(num_warps=4, num_stages=3, group_view=False, e4m3_decode=None)
    gemv = dict(base, block_m=1, split_k=1, gemv=True, scale_side="x", mma_rows="tokens")
    tokens = dict(base, block_m=64, block_n=32, block_k=256, prefetch=0, gemv=False, scale_side="w",
                  mma_rows="tokens", programs=0)
    pinned = {(1, 32768, 1280): dict(gemv, block_n=16, block_k=256, prefetch=1, programs=528),
              (1, 2304, 5120): dict(gemv, block_n=8, block_k=256, prefetch=8, programs=0),
              (1, 5120, 2304): dict(gemv, block_n=8, block_k=128, prefetch=8, programs=0),
              (64, 32768, 1280): dict(tokens, split_k=1), (64, 2304, 5120): dict(tokens, split_k=4),
              (64, 5120, 2304): dict(tokens, split_k=3)}
    for (m, n, k), want in pinned.items():
        assert G.fp8_default_tiling(m, n, k) == want, (m, n, k)
    weights = dict(block_m=32, block_n=64, num_warps=4, num_stages=3, prefetch=0, gemv=False, scale_side="w",
                   group_view=False, mma_rows="weights", programs=0, e4m3_decode="sign")
    # the bench model's dense projections at M = 32 (the fused ones at their total N), and the tiling before (256)
    for (n, k), split, split_before in (((32768, 1280), 1, 1), ((5120, 8192), 8, 4), ((5120, 2304), 6, 3),
                                        ((1792, 5120), 10, 5), ((4608, 5120), 8, 4)):
        assert G.fp8_default_tiling(32, n, k) == dict(weights, block_k=128, split_k=split), (n, k)
        assert G.fp8_default_tiling(32, n, k, block_k=256) == dict(weights, block_k=256, split_k=split_before)
    assert G.fp8_default_tiling(32, 5120, 8192, e4m3_decode="mask")["e4m3_decode"] == "mask"
    with pytest.raises(ValueError, match="e4m3_decode"):
        G.fp8_default_tiling(64, 5120, 8192, e4m3_decode="sign")  # the tokens form has no PTX decode

    rng = np.random.default_rng(21)
    w = _weights(rng, (64, 768), N.FP8_BLOCK)
    assert G.fp8_default_tiling(32, 64, 768)["split_k"] == 2
    x = jnp.asarray(rng.standard_normal((32, 768)), jnp.float32)
    wd = np.asarray(w.dequantize(), np.float64)
    want = np.asarray(x, np.float64) @ wd.T
    got = QG.fp8_linear(x, w, backend="pallas_gpu_interpret")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    xb = x.astype(jnp.bfloat16)
    want_b = np.asarray(xb.astype(jnp.float32), np.float64) @ wd.T
    got = QG.fp8_linear(xb, w, backend="pallas_gpu_interpret")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want_b, rtol=2 ** -8, atol=2 ** -8 * np.abs(want_b).max())
    # the "sign_fold" option's multiplier path: the same exact weights, so the same output bit for bit
    np.testing.assert_array_equal(got, QG.fp8_linear(xb, w, backend="pallas_gpu_interpret",
                                                     tuning=dict(e4m3_decode="sign_fold")))


def test_bf16x1_decode_is_exact_up_to_scale_byte_128_and_never_finite_beyond():
    """The grouped FP4 kernel's one-multiply decode ("bf16x1") on every packed byte (both nibbles) x every scale
    byte 0..255, against the float32 reference dequantisation (``QuantizedTensor.dequantize``, exact, subnormals
    kept): bit-equal bf16 for scale bytes 0..128; for 129..255 every weight inf or NaN (the multiplier 2^(s - 1) is
    past bf16's range), never a finite number. Checked twice: the kernel's interpret-mode decode
    (``_fp4_weight_tile``), and the inline PTX's instruction sequence replayed in numpy — the integer steps on both
    16-bit halves of a register, then one exact multiply by the kernel's bf16 multiplier."""
    import ml_dtypes

    from dsv41_jax.checkpoint import quantized as QZ
    from dsv41_jax.kernels import quant_gemm_gpu as G

    bf16 = ml_dtypes.bfloat16
    b = np.arange(256, dtype=np.uint32)
    v = np.tile(b.astype(np.uint8), (256, 1))  # row r: all 256 bytes (16 scale groups), every group scale byte r
    s = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    qt = QZ.QuantizedTensor(jnp.asarray(v), jnp.asarray(s), N.FP4_ROWS, (256, 512), (1, 32))
    ref = np.asarray(qt.dequantize(jnp.float32)).reshape(256, 256, 2)  # [scale byte, byte, low / high nibble]
    ref_bits = ref.astype(bf16).view(np.uint16)  # exact: <= 3 significant bits, inside bf16's range (subnormal too)
    assert (ref_bits[:129] != ref.view(np.uint32)[:129] >> 16).sum() == 0  # the float32 values are bf16 values
    lo, hi = G._fp4_weight_tile(jnp.asarray(v), jnp.asarray(s), "bf16x1", jnp.bfloat16, interpret=True)
    got = np.stack([np.asarray(lo), np.asarray(hi)], -1)
    np.testing.assert_array_equal(got[:129].view(np.uint16), ref_bits[:129])
    assert not np.isfinite(got[129:].astype(np.float32)).any()
    # the PTX (``_e2m1_bf16x2_ptx(shift, one_multiply=True)``): the two bytes at bits 0-7 / 16-23 of a register
    # (prmt), the nibble masked and spread by one integer multiply, masked to the bf16 pattern of value x 2^-126;
    # then one bf16 multiply by ``_fp4_bf16x1_multiplier`` — here in float64, exact for these powers of two
    mult = np.asarray(G._fp4_bf16x1_multiplier(jnp.arange(256, dtype=jnp.uint8))).astype(np.float64)
    assert all("mul.rn.bf16x2" in G._e2m1_bf16x2_ptx(sh, one_multiply=True) for sh in (0, 4))
    w = b | b << 16
    for nib, (mask, mul) in G.E2M1_BF16_MASKS.items():
        assert G._e2m1_bf16x2_ptx(nib, one_multiply=True).count("mul.rn.bf16x2") == 1
        pat = ((w & int(mask, 16)) * int(mul, 16)) & 0x81C081C0
        for half in (pat & 0xFFFF, pat >> 16):
            with np.errstate(invalid="ignore"):  # 0 x inf -> NaN, as on the GPU
                prod = half.astype(np.uint16).view(bf16).astype(np.float64)[None, :] * mult[:, None]
            prod = prod.astype(bf16)
            np.testing.assert_array_equal(prod[:129].view(np.uint16), ref_bits[:129, :, nib // 4])
            assert not np.isfinite(prod[129:].astype(np.float32)).any()


def test_grouped_fp4_bf16x1_equals_the_reference_and_bf16x2():
    """``fp4_grouped_gemm(decode="bf16x1")`` (interpret mode, one compile): 13 bf16 rows over 3 experts (one empty,
    rows past the groups' total zero) with scale bytes <= 128 against float64 on the same inputs within one bf16
    rounding, and bit-equal to the default decode (the same exact weights, the same accumulation)."""
    from dsv41_jax.kernels import quant_gemm_gpu as G

    rng = np.random.default_rng(9)
    w = _weights(rng, (3, 64, 256), N.FP4_ROWS, scale=0.01)
    assert w.scale_max is not None and w.scale_max <= 128
    gs = jnp.array([5, 0, 6], jnp.int32)
    xb = jnp.asarray(rng.standard_normal((13, 256)), jnp.float32).astype(jnp.bfloat16)
    wd = np.asarray(w.dequantize(), np.float64)
    x64 = np.asarray(xb.astype(jnp.float32), np.float64)
    want = np.zeros((13, 64))
    want[:5], want[5:11] = x64[:5] @ wd[0].T, x64[5:11] @ wd[2].T
    tiling = dict(mma_rows="weights", block_m=16, block_n=32, block_k=128)
    got = G.fp4_grouped_gemm(xb, gs, w.values, w.scales, decode="bf16x1", interpret=True, **tiling)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2 ** -8, atol=2 ** -8 * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(got, np.float32)[11:], 0.0)
    base = G.fp4_grouped_gemm(xb, gs, w.values, w.scales, decode="bf16x2", interpret=True, **tiling)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(base).view(np.uint16))


def test_grouped_fp4_decode_follows_the_recorded_scale_max(monkeypatch):
    """``fp4_grouped_decode``: "bf16x1" only for a known scale_max <= 128, else the exact default; bad values fail
    clearly. ``quant_gemm.fp4_grouped`` passes that choice to the kernel unless the caller names a decode (or the
    FP8 form, which takes none). ``release_weights``' quantiser records the FP4 experts' largest scale byte."""
    import dataclasses

    from dsv41_jax.checkpoint import quantized as QZ
    from dsv41_jax.kernels import quant_gemm_gpu as G

    assert [G.fp4_grouped_decode(sm) for sm in (None, 0, 120, 128, 129, 255)] == [
        "bf16x2", "bf16x1", "bf16x1", "bf16x1", "bf16x2", "bf16x2"]
    for bad in (-1, 256, 1.5, True, "128"):
        with pytest.raises(ValueError, match="scale_max"):
            G.fp4_grouped_decode(bad)
    rng = np.random.default_rng(2)
    w = _weights(rng, (2, 32, 64), N.FP4_ROWS, scale=0.01)
    assert w.scale_max == int(np.asarray(w.scales).max()) <= 128
    assert _weights(rng, (32, 64), N.FP8_BLOCK).scale_max is None  # only the FP4 experts record it
    with pytest.raises(QZ.QuantFormatError, match="scale_max"):
        dataclasses.replace(w, scale_max=300)
    seen = []

    def fake(x, gs, values, scales, **kw):
        seen.append((kw.get("decode"), kw.get("mma")))
        return jnp.zeros((x.shape[0], values.shape[1]), x.dtype)

    monkeypatch.setattr(G, "fp4_grouped_gemm", fake)
    x, gs = jnp.zeros((4, 64), jnp.bfloat16), jnp.array([2, 2], jnp.int32)
    for sm, tuning in ((w.scale_max, None), (None, None), (200, None), (w.scale_max, dict(decode="bf16x2")),
                       (w.scale_max, dict(block_n=32)), (w.scale_max, dict(mma="fp8"))):
        QG.fp4_grouped(x, gs, dataclasses.replace(w, scale_max=sm), backend="pallas_gpu_interpret", tuning=tuning)
    assert seen == [("bf16x1", None), ("bf16x2", None), ("bf16x2", None), ("bf16x2", None), ("bf16x1", None),
                    (None, "fp8")]


def test_fused_fp8_kernel_equals_the_float32_reference_and_the_separate_kernels():
    """Several projections of one input in one launch (``fp8_linear_fused``): each output equals float64 on the
    dequantised weights (float32 in: accumulation-order noise; bf16 in: one bf16 rounding), and equals the separate
    kernel with the same tiling bit for bit (checked on the projection placed after the first) — partial column
    blocks at a projection's end (N = 80, 40), masked K, rows past M, K splits, and the M = 1 gemv form."""
    rng = np.random.default_rng(7)
    ws = [_weights(rng, (n, 100), N.FP8_BLOCK) for n in (80, 32)]
    x = jnp.asarray(rng.standard_normal((3, 100)), jnp.float32)
    xf = np.asarray(x, np.float64)
    for tuning in (None, dict(block_n=16, block_k=64, split_k=2)):
        got = QG.fp8_linear_fused(x, ws, backend="pallas_gpu_interpret", tuning=tuning)
        for y, w in zip(got, ws):
            want = xf @ np.asarray(w.dequantize(), np.float64).T
            assert y.dtype == jnp.float32 and y.shape == want.shape
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=str(tuning))
            if tuning and w is ws[-1]:  # the projection whose column blocks start past the first's
                np.testing.assert_array_equal(y, QG.fp8_linear(x, w, backend="pallas_gpu_interpret", tuning=tuning))
    ws = [_weights(rng, (n, 256), N.FP8_BLOCK) for n in (64, 40)]
    xb = Q.fake_quant_gemm_input_fp8(jnp.asarray(rng.standard_normal((1, 256)), jnp.float32), 32).astype(jnp.bfloat16)
    tuning = dict(block_n=8, block_k=64, prefetch=2)  # gemv: 4 unrolled K steps, 2 loaded ahead
    got = QG.fp8_linear_fused(xb, ws, backend="pallas_gpu_interpret", tuning=tuning)
    for y, w in zip(got, ws):
        want = np.asarray(xb, np.float64) @ np.asarray(w.dequantize(), np.float64).T
        assert y.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2 ** -8, atol=1e-6 * np.abs(want).max())
        if w is ws[-1]:
            np.testing.assert_array_equal(y, QG.fp8_linear(xb, w, backend="pallas_gpu_interpret", tuning=tuning))


def test_linear_many_fuses_marked_fp8_weights_and_falls_back_otherwise():
    """``ops.linear.linear_many``: marked release FP8 weights on a kernel backend -> one fused launch; a mix of
    forms (a float weight among them) -> ``linear`` per weight; both equal the per-weight ``linear``."""
    from dsv41_jax.ops.linear import linear_many

    rng = np.random.default_rng(8)
    a, b = (_weights(rng, (n, 64), N.FP8_BLOCK) for n in (64, 32))
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    marked = (Fp8GemmInput(a, "pallas_gpu_interpret"), Fp8GemmInput(b, "pallas_gpu_interpret"))
    fused = jax.make_jaxpr(lambda x: linear_many(x, marked))(x)
    assert str(fused).count("pallas_call") == 1
    for got, w in zip(linear_many(x, marked), marked):
        ref = linear(x, Fp8GemmInput(w.weight))  # the reference: input rounded to FP8, dequantise, GEMM
        assert got.shape == (2, 3, w.shape[0])
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(ref))))
    mixed = (marked[0], jnp.asarray(rng.standard_normal((16, 64)), jnp.float32))
    for got, w in zip(linear_many(x, mixed), mixed):
        np.testing.assert_array_equal(got, linear(x, w))
    # a tuning on the marker (Fp8GemmInput.tuning, InferenceOptions.fp8_gemm_tuning) reaches the fused kernel: the
    # weights-as-rows form, one launch, the same values
    tuned = tuple(Fp8GemmInput(w.weight, "pallas_gpu_interpret", (("mma_rows", "weights"),)) for w in marked)
    assert str(jax.make_jaxpr(lambda x: linear_many(x, tuned))(x)).count("pallas_call") == 1
    for got, w in zip(linear_many(x, tuned), marked):
        ref = linear(x, Fp8GemmInput(w.weight))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(ref))))
    with pytest.raises(ValueError, match="mma_rows"):  # the tuning is the kernel's: a wrong one fails there
        linear(x, Fp8GemmInput(marked[0].weight, "pallas_gpu_interpret", (("mma_rows", "columns"),)))


def test_fused_fp8_refuses_unsupported_operands_clearly():
    rng = np.random.default_rng(9)
    a, b = _weights(rng, (32, 64), N.FP8_BLOCK), _weights(rng, (32, 96), N.FP8_BLOCK)
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(QG.QuantGemmError, match="must share K"):
        QG.fp8_linear_fused(x, [a, b], backend="pallas_gpu_interpret")
    with pytest.raises(QG.QuantGemmError, match="no weights"):
        QG.fp8_linear_fused(x, [], backend="pallas_gpu_interpret")
    with pytest.raises(QG.QuantGemmError, match="weight 1: fp8_linear takes an FP8 block-scaled"):
        QG.fp8_linear_fused(x, [a, _weights(rng, (2, 32, 64), N.FP4_ROWS)])
    with pytest.raises(QG.QuantGemmError, match="the weight takes K = 64"):
        QG.fp8_linear_fused(jnp.ones((2, 48), jnp.float32), [a, a])
    from dsv41_jax.kernels import quant_gemm_gpu as G

    with pytest.raises(ValueError, match="input's K = 64"):
        G.fp8_gemm_fused(x, ((a.values, a.scales), (b.values, b.scales)), interpret=True)
    # empty GEMMs are defined (zeros of the right shapes), not a crash inside the tiling
    e = type(a)(jnp.zeros((0, 64), jnp.uint8), jnp.zeros((0, 2), jnp.uint8), N.FP8_BLOCK, (0, 64), (32, 32))
    ys = QG.fp8_linear_fused(jnp.ones((0, 64), jnp.float32), [a, a], backend="pallas_gpu_interpret")
    assert [y.shape for y in ys] == [(0, 32), (0, 32)]
    ys = QG.fp8_linear_fused(x, [a, e], backend="pallas_gpu_interpret")
    assert [y.shape for y in ys] == [(2, 32), (2, 0)]
    np.testing.assert_allclose(ys[0], QG.fp8_linear(x, a, backend="reference"), rtol=1e-5, atol=1e-6)


def test_gpu_kernels_refuse_operands_the_lowering_would_address_wrong():
    """2-4 GiB operands get 32-bit signed offsets in the Triton lowering (wrong past 2 GiB): a clear error at trace
    time (abstract shapes, nothing allocated), not a silently wrong GEMM."""
    from dsv41_jax.checkpoint.quantized import QuantizedTensor

    e, n, k = 384, 2304, 5120  # the release's routed-expert w1 stack on one device: 2.26 GB of packed bytes
    sds = jax.ShapeDtypeStruct

    def call(v, s, x, gs):
        return QG.fp4_grouped(x, gs, QuantizedTensor(v, s, N.FP4_ROWS, (e, n, k), (1, 32)),
                              backend="pallas_gpu_interpret")

    args = (sds((e, n, k // 2), jnp.uint8), sds((e, n, k // 32), jnp.uint8), sds((6, k), jnp.bfloat16),
            sds((e,), jnp.int32))
    with pytest.raises(QG.QuantGemmError, match="32-bit signed offsets"):
        jax.eval_shape(call, *args)
    e = 256  # 1.5 GB: accepted
    args = (sds((e, n, k // 2), jnp.uint8), sds((e, n, k // 32), jnp.uint8), sds((6, k), jnp.bfloat16),
            sds((e,), jnp.int32))
    assert jax.eval_shape(call, *args).shape == (6, n)


def test_moe_and_linear_take_the_kernels_through_the_weight_marker():
    """``Fp8GemmInput(w, gemm=...)`` routes the serving MoE's routed experts to the grouped kernel (bf16
    activations); it equals the engine's plain-JAX decode path (``routed_slots``) on the same weights."""
    from dsv41_jax.inference.moe import moe_inference

    rng = np.random.default_rng(2)
    e, d, f = 4, 64, 32
    w1, w3 = (_weights(rng, (e, f, d), N.FP4_ROWS, 0.2) for _ in range(2))
    w2 = _weights(rng, (e, d, f), N.FP4_ROWS, 0.2)
    shared = {k: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.bfloat16)
              for k, s in (("w1", (f, d)), ("w2", (d, f)), ("w3", (f, d)))}
    gate = {"weight": jnp.asarray(rng.standard_normal((e, d)), jnp.float32), "bias": jnp.zeros((e,), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((3, d)), jnp.bfloat16)

    def params(gemm):
        return {"gate": gate, "shared_experts": shared,
                "experts": {k: Fp8GemmInput(w, gemm) for k, w in (("w1", w1), ("w2", w2), ("w3", w3))}}

    run = jax.jit(lambda p, x: moe_inference(x, p, top_k=2, temp=1.0, scaling=1.5, limit=7.0))
    ref = run(params("reference"), x)
    got = run(params("pallas_gpu_interpret"), x)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=2 ** -7,
                               atol=2 ** -7 * float(jnp.max(jnp.abs(ref.astype(jnp.float32)))))
    wd = _weights(rng, (48, d), N.FP8_BLOCK)
    # "auto" on CPU is the reference path: the same program as "reference"
    np.testing.assert_array_equal(linear(x, Fp8GemmInput(wd, "auto")), linear(x, Fp8GemmInput(wd)))


def test_bad_operands_fail_with_a_clear_error():
    rng = np.random.default_rng(3)
    w8 = _weights(rng, (32, 64), N.FP8_BLOCK)
    w4 = _weights(rng, (2, 32, 64), N.FP4_ROWS)
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(QG.QuantGemmError, match="FP8 block-scaled"):
        QG.fp8_linear(x, w4, backend="reference")
    with pytest.raises(QG.QuantGemmError, match="bfloat16 or float32"):
        QG.fp8_linear(x.astype(jnp.float16), w8)
    with pytest.raises(QG.QuantGemmError, match="the weight takes K = 64"):
        QG.fp8_linear(jnp.ones((2, 48), jnp.float32), w8)
    with pytest.raises(QG.QuantGemmError, match="scales must be uint8"):
        QG.fp8_linear(x, type(w8)(w8.values, w8.scales.astype(jnp.float32), w8.fmt, w8.shape, w8.block))
    with pytest.raises(QG.QuantGemmError, match="stacked FP4 experts"):
        QG.fp4_grouped(x, jnp.array([1, 1]), w8)
    with pytest.raises(QG.QuantGemmError, match="integer vector of 2 experts"):
        QG.fp4_grouped(x, jnp.array([1, 1, 0]), w4)
    with pytest.raises(QG.QuantGemmError, match="values must be uint8"):
        QG.fp4_grouped(x, jnp.array([1, 1]), type(w4)(w4.values[..., :16], w4.scales, w4.fmt, w4.shape, w4.block))
    with pytest.raises(QG.QuantGemmError, match="unknown quantized_gemm backend"):
        QG.fp8_linear(x, w8, backend="cuda")
    with pytest.raises(QG.QuantGemmError, match="unknown quantized_gemm backend"):
        RW.mark_fp8_gemm_inputs({}, None, "triton")


def test_gpu_kernels_lower_to_triton_without_a_gpu():
    """The Triton lowering (Pallas -> Triton IR, done in Python) of both GPU kernels at release shapes, partial
    blocks and float32 included: catches unsupported operations before a GPU run."""
    from dsv41_jax.kernels import quant_gemm_gpu as G

    sds, bf, u8 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.uint8
    cases = [(G.fp8_gemm, (sds((1, 5120), bf), sds((2304, 5120), u8), sds((72, 160), u8))),
             (G.fp8_gemm, (sds((3, 1000), jnp.float32), sds((300, 1000), u8), sds((10, 32), u8))),
             # the weights-as-rows tensor-core form (the e4m3 bf16x2 decode's inline PTX), M = 32, and with tails
             (functools.partial(G.fp8_gemm, mma_rows="weights"),
              (sds((32, 5120), bf), sds((2304, 5120), u8), sds((72, 160), u8))),
             (functools.partial(G.fp8_gemm, mma_rows="weights"),
              (sds((13, 1000), bf), sds((300, 1000), u8), sds((10, 32), u8))),
             # the attention's wq_a + wkv of the release in one launch: M = 1 (gemv form) and M = 8 (dot form)
             (G.fp8_gemm_fused, (sds((1, 5120), bf), ((sds((1280, 5120), u8), sds((40, 160), u8)),
                                                      (sds((512, 5120), u8), sds((16, 160), u8))))),
             (G.fp8_gemm_fused, (sds((8, 5120), bf), ((sds((1280, 5120), u8), sds((40, 160), u8)),
                                                      (sds((512, 5120), u8), sds((16, 160), u8))))),
             (functools.partial(G.fp4_grouped_gemm, mma_rows="tokens"),
              (sds((48, 5120), bf), sds((384,), jnp.int32), sds((384, 2304, 2560), u8), sds((384, 2304, 160), u8))),
             (G.fp4_grouped_gemm, (sds((13, 96), jnp.float32), sds((5,), jnp.int32), sds((5, 40, 48), u8),
                                   sds((5, 40, 3), u8))),
             # the decode default: weights on the product's row side, the bf16x2 decode's inline PTX
             (G.fp4_grouped_gemm,
              (sds((192, 5120), bf), sds((16,), jnp.int32), sds((16, 2304, 2560), u8), sds((16, 2304, 160), u8))),
             (G.fp4_grouped_gemm, (sds((13, 96), bf), sds((5,), jnp.int32), sds((5, 40, 48), u8),
                                   sds((5, 40, 3), u8))),
             # the one-multiply decode's inline PTX (weights with scale bytes <= 128)
             (functools.partial(G.fp4_grouped_gemm, decode="bf16x1"),
              (sds((13, 96), bf), sds((5,), jnp.int32), sds((5, 40, 48), u8), sds((5, 40, 3), u8)))]
    for fn, args in cases:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text or "triton" in text


_AOT_SCRIPT = """
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding
from dsv41_jax.kernels import quant_gemm_tpu as T
dev = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(dev))
bf, u8 = jnp.bfloat16, jnp.uint8
fp8 = jax.jit(T.fp8_gemm).trace(sds((8, 1280), bf), sds((640, 1280), u8), sds((20, 40), u8)).lower().compile()
fp4 = jax.jit(T.fp4_grouped_gemm).trace(sds((24, 512), bf), sds((8,), jnp.int32), sds((8, 256, 256), u8),
                                        sds((8, 256, 16), u8)).lower().compile()
print("OK", all("tpu_custom_call" in c.as_text() for c in (fp8, fp4)))
"""


@pytest.mark.slow  # a subprocess that imports jax and compiles with libtpu (~10 s)
def test_mosaic_quant_gemm_kernels_compile_for_tpu_v5p():
    pytest.importorskip("libtpu", reason="AOT TPU compile needs the tpu extra (jax[tpu] / libtpu)")
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
               PYTHONPATH=str(root) + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "OK True"  # both Mosaic kernels are in the compiled programs


def test_cli_quantized_gemm_option_fails_early_with_clear_errors(capsys):
    """`dsv41 generate --quantized-gemm`: unknown names, kernels for another platform and bf16 weights are refused
    before any weight is loaded or compiled; `auto` resolves to the reference on CPU. (A full `--weights release
    --quantized-gemm auto` generation is a 2-minute CPU run: not repeated here, see the inference tests.)"""
    from dsv41_jax.cli import _quantized_gemm_option, main

    base = ["generate", "--config", "tiny", "--max-new-tokens", "1", "--no-compilation-cache"]
    for extra, msg in ((["--quantized-gemm", "cuda"], "unknown quantized_gemm backend 'cuda'"),
                       (["--weights", "release", "--quantized-gemm", "pallas_tpu"], "kernels need a TPU"),
                       (["--weights", "bf16", "--quantized-gemm", "auto"], "applies to --weights release")):
        assert main(base + extra) == 2
        assert msg in capsys.readouterr().err
    assert _quantized_gemm_option("auto", "release", "cpu") == ("auto", "reference")
    assert _quantized_gemm_option("pallas_gpu", None, "gpu") == ("pallas_gpu", "pallas_gpu")
    assert _quantized_gemm_option("pallas_gpu_interpret", "release", "cpu")[1] == "pallas_gpu_interpret"
