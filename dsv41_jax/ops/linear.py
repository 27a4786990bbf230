"""The projection every layer uses: ``x @ w.T`` with PyTorch-layout weights [out, in], and the LM head."""

import jax
import jax.numpy as jnp


def matmul_precision(*operands):
    """The matmul precision for these operands: HIGHEST when any is float32 (float32 parity with the reference),
    the backend default for 16-bit ones. Products of two bf16 values are exact in the float32 accumulator that every
    backend uses for 16-bit dots (MXU, tensor cores, XLA:CPU), so HIGHEST buys nothing there but can force
    multi-pass or float32 emulation (and Mosaic rejects it on a bf16 ragged_dot)."""
    wide = any(jnp.dtype(o.dtype).itemsize >= 4 for o in operands)
    return jax.lax.Precision.HIGHEST if wide else None


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] · w [out, in] -> [..., out] (precision: ``matmul_precision``)."""
    return jnp.einsum("...i,oi->...o", x, w, precision=matmul_precision(x, w))


def head_logits(h: jax.Array, w: jax.Array, *, hf_rounding: bool = False) -> jax.Array:
    """float32 logits h [..., d] · head [V, d]ᵀ.

    Official V4.1 numerics (the default): an fp32 head, ``x.float() @ head``. The products of two bf16 values are
    exact in float32, so this is the matmul of the stored operands with float32 accumulation and a float32 result
    (``preferred_element_type``) — no float32 copy of the [V, d] head. ``hf_rounding=True``: the HF port's order,
    ``lm_head(x).float()`` (the logits rounded to the compute dtype first). Identical for float32 inputs (the golden
    fixtures are float32)."""
    if hf_rounding:
        return linear(h, w).astype(jnp.float32)
    return jnp.einsum("...i,oi->...o", h, w, precision=matmul_precision(h, w), preferred_element_type=jnp.float32)
