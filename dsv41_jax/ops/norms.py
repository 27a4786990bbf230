"""RMS normalisation, computed in float32 (the precision policy: norms always run in fp32)."""

import jax
import jax.numpy as jnp


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32 (no weight)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, hf_rounding: bool = False) -> jax.Array:
    """Weighted RMSNorm, returned in x's dtype.

    Official V4.1 numerics (the default): ``(weight * x_f32).to(dtype)`` — the weight multiplies the float32
    normalised value and the product is rounded once (the weight's gradient, a sum over every token, is then also
    formed in float32). ``hf_rounding=True``: the HF port's order, ``weight * x_f32.to(dtype)`` (normalised value
    rounded first, product in the weight's dtype). The two are identical for float32 inputs (the golden fixtures)."""
    if hf_rounding:
        return weight * rms_normalize(x, eps).astype(x.dtype)
    return (weight.astype(jnp.float32) * rms_normalize(x, eps)).astype(x.dtype)
