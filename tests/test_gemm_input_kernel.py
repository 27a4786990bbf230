"""The release's GEMM-input FP8 rounding as one Pallas GPU kernel (``kernels.quant_gemm.fp8_round`` /
``quant_gemm_gpu.fp8_round_rows``, interpret mode on CPU) and as a kernel epilogue (``fp8_round_groups``): bit for bit
``ops.quant.fake_quant_gemm_input_fp8`` on bf16 and float32 rows spanning the whole exponent range, zeros of both
signs, subnormal and overflowing inputs and blocks holding an inf; NaN keeps its block NaN; the split form gives the
even / odd columns; ``gemm_input`` takes the kernel only where the marker asks for it; the Triton lowering works."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.checkpoint import names as N
from dsv41_jax.kernels import quant_gemm as QG
from dsv41_jax.kernels import quant_gemm_gpu as G
from dsv41_jax.model import release_weights as RW
from dsv41_jax.ops import quant as Q
from dsv41_jax.ops.linear import Fp8GemmInput, gemm_input

BE = "pallas_gpu_interpret"


def _rows(rng, r, k):
    x = rng.standard_normal((r, k)).astype(np.float32) * np.exp2(rng.integers(-40, 40, (r, k)))
    x[0, :32] = 0.0
    x[0, 32:64] = -0.0
    x[1, :32] = np.float32(1e-42) * rng.standard_normal(32)  # float32 subnormals (bf16: flushed by the cast)
    x[2, :32] = np.float32(3e38) * np.sign(rng.standard_normal(32))  # near the float32 maximum
    x[3, :32] = np.float32(2e-5) * rng.standard_normal(32)  # amax under the 1e-4 floor
    x[3, 40], x[4, 70] = np.inf, -np.inf  # the whole block NaN
    return x


def _bits(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32)).view(np.uint32)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_round_kernel_is_bit_exact(dtype):
    rng = np.random.default_rng(31)
    x = jnp.asarray(_rows(rng, 6, 320)).astype(dtype)
    want = Q.fake_quant_gemm_input_fp8(x, 32)
    assert np.isnan(np.asarray(want, np.float32)[3, 32:64]).all()  # the inf block
    for groups in (None, 1):  # 10 groups of 32 a row: 2 groups a program (the default's divisor), or 1
        got = G.fp8_round_rows(x, groups=groups, interpret=True)
        assert got.dtype == dtype
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=str(groups))
    ev, od = QG.fp8_round(x.reshape(2, 3, 320), split=True, backend=BE)
    assert ev.shape == od.shape == (2, 3, 160)
    np.testing.assert_array_equal(_bits(ev.reshape(6, 160)), _bits(want[:, 0::2]))
    np.testing.assert_array_equal(_bits(od.reshape(6, 160)), _bits(want[:, 1::2]))
    # the epilogue form over a middle axis (the FP4 gate / up kernel's [F blocks, 32, tokens] tile)
    xt = jnp.swapaxes(x.astype(jnp.float32).reshape(6, 10, 32), 0, 2)  # [32, 10, 6]: axis 0 is the block
    got = jnp.swapaxes(G.fp8_round_groups(xt, axis=0), 0, 2).reshape(6, 320).astype(dtype)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_round_kernel_keeps_nan_blocks_nan():
    """A block holding a NaN is NaN throughout (the reference's scale is NaN when its maximum propagates the NaN,
    as XLA's GPU reduction does; XLA's CPU reduction drops it, which leaves only the NaN itself NaN there)."""
    x = jnp.ones((2, 64), jnp.float32).at[1, 33].set(jnp.nan)
    got = np.asarray(G.fp8_round_rows(x, interpret=True))
    assert np.isnan(got[1, 32:]).all() and not np.isnan(got[:, :32]).any() and not np.isnan(got[0]).any()
    np.testing.assert_array_equal(got[:, :32], Q.fake_quant_gemm_input_fp8(x, 32)[:, :32])


def test_gemm_input_takes_the_kernel_only_where_marked():
    rng = np.random.default_rng(32)
    w = RW._quantize(rng.standard_normal((64, 96)).astype(np.float32), N.FP8_BLOCK)
    x = jnp.asarray(rng.standard_normal((3, 96)), jnp.bfloat16)

    def text(marker):
        return jax.jit(lambda x: gemm_input(x, marker)).lower(x).as_text()

    kern = Fp8GemmInput(w, BE, round_kernel=True)
    assert "fp8_round_rows" in text(kern)
    assert "fp8_round_rows" not in text(Fp8GemmInput(w, BE))  # not asked for
    assert "fp8_round_rows" not in text(Fp8GemmInput(w, "reference", round_kernel=True))  # no GPU kernel backend
    np.testing.assert_array_equal(_bits(gemm_input(x, kern)), _bits(gemm_input(x, Fp8GemmInput(w, BE))))
    with pytest.raises(QG.QuantGemmError, match="multiple of 32"):
        QG.fp8_round(jnp.ones((2, 48), jnp.float32), backend=BE)


def test_round_kernel_lowers_to_triton():
    sds = jax.ShapeDtypeStruct
    for shape in ((32, 5120), (1, 1280), (192, 2304)):
        for split in (False, True):
            tr = jax.jit(lambda a: G.fp8_round_rows(a, split=split)).trace(sds(shape, jnp.bfloat16))
            assert "triton" in tr.lower(lowering_platforms=("cuda",)).as_text()


def test_the_rounding_kernel_is_the_default_on_the_gpu_backend_only():
    from dsv41_jax.inference.step import InferenceOptions, gemm_input_kernel

    assert gemm_input_kernel(InferenceOptions(quantized_gemm="pallas_gpu"))
    assert not gemm_input_kernel(InferenceOptions(quantized_gemm="pallas_gpu", gemm_input_kernel=False))
    assert not gemm_input_kernel(InferenceOptions(quantized_gemm="pallas_gpu_interpret"))  # CPU tests: XLA's form
    assert not gemm_input_kernel(InferenceOptions(quantized_gemm="reference"))
    assert gemm_input_kernel(InferenceOptions(quantized_gemm="pallas_gpu_interpret", gemm_input_kernel=True))
