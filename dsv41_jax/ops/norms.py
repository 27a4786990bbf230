"""RMS normalisation, computed in float32 (the precision policy: norms always run in fp32)."""

import jax
import jax.numpy as jnp


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32 (no weight)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, hf_rounding: bool = False,
             kernel: str | None = None) -> jax.Array:
    """Weighted RMSNorm, returned in x's dtype.

    Official V4.1 numerics (the default): ``(weight * x_f32).to(dtype)`` — the weight multiplies the float32
    normalised value and the product is rounded once (the weight's gradient, a sum over every token, is then also
    formed in float32). ``hf_rounding=True``: the HF port's order, ``weight * x_f32.to(dtype)`` (normalised value
    rounded first, product in the weight's dtype). The two are identical for float32 inputs (the golden fixtures).

    ``kernel`` (``"pallas_gpu"``, or ``"pallas_gpu_interpret"`` on a CPU; the default numerics only): the sum of
    squares and the normalisation in one Pallas kernel (``kernels.mhc_gpu.collapse_rms_norm_kernel`` without a
    collapse), one program per row — for a decode step's few rows, where XLA launches two kernels."""
    if kernel is not None and not hf_rounding:
        from dsv41_jax.kernels.mhc_gpu import collapse_rms_norm_kernel  # lazy: ops does not need the kernels package

        rows = x.reshape(-1, 1, x.shape[-1])
        return collapse_rms_norm_kernel(rows, None, weight, eps=float(eps),
                                        interpret=kernel.endswith("interpret")).reshape(x.shape)
    if hf_rounding:
        return weight * rms_normalize(x, eps).astype(x.dtype)
    return (weight.astype(jnp.float32) * rms_normalize(x, eps)).astype(x.dtype)
