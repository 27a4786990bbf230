"""RMS normalisation, computed in float32 (the precision policy: norms always run in fp32)."""

import jax
import jax.numpy as jnp


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32 (no weight)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Weighted RMSNorm. Like the reference, the normalised value is cast back to the input dtype before the
    weight multiplies it, so bf16 activations see the same rounding point as the released model."""
    return weight * rms_normalize(x, eps).astype(x.dtype)
