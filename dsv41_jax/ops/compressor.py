"""CSA2 compressor (KV-source layers only): non-overlapping groups of ``ratio`` tokens -> one 512-d latent.

ratio > 1: per group, a channel-wise softmax of the gate over the group's tokens weights the projected KV (fp32),
summed, then RMSNorm. ratio == 1: RMSNorm of the per-token projection, no gate. The latent returned is BEFORE
RoPE: the indexer keys derive from it; the attention's compressed KV is its rotated (and quantised) form.
Entry s covers tokens [s·ratio, s·ratio + ratio − 1] and is rotated at position s·ratio.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.ops.norms import rms_norm

_HI = jax.lax.Precision.HIGHEST


def project_compressor_inputs(x: jax.Array, wkv: jax.Array, wgate: jax.Array | None):
    """Per-token fp32 projections (kv, gate) — the pieces a streaming compressor buffers across calls."""
    kv = jnp.einsum("btd,fd->btf", x.astype(jnp.float32), wkv.astype(jnp.float32), precision=_HI)
    gate = None if wgate is None else jnp.einsum("btd,fd->btf", x.astype(jnp.float32), wgate.astype(jnp.float32),
                                                 precision=_HI)
    return kv, gate


def pool_groups(kv: jax.Array, gate: jax.Array | None, norm_weight: jax.Array, ratio: int, eps: float,
                out_dtype) -> jax.Array:
    """kv/gate [B, G·ratio, hd] (whole groups) -> latents [B, G, hd]."""
    b, t, hd = kv.shape
    if ratio == 1:
        return rms_norm(kv.astype(out_dtype), norm_weight, eps)
    g = t // ratio
    kv = kv.reshape(b, g, ratio, hd)
    weights = jax.nn.softmax(gate.reshape(b, g, ratio, hd), axis=2)
    latent = jnp.sum(kv * weights, axis=2)
    return rms_norm(latent.astype(out_dtype), norm_weight, eps)


def compress_sequence(x: jax.Array, params: dict, ratio: int, eps: float) -> jax.Array:
    """All complete groups of a sequence starting at position 0: [B, T, d] -> [B, T // ratio, hd]."""
    usable = (x.shape[1] // ratio) * ratio
    if ratio == 1:
        # Ratio 1 projects in the model dtype (the reference's plain Linear); ratio > 1 pools in fp32.
        kv = jnp.einsum("btd,fd->btf", x, params["wkv"], precision=_HI)
        return rms_norm(kv, params["norm"], eps)
    kv, gate = project_compressor_inputs(x[:, :usable], params["wkv"], params.get("wgate"))
    return pool_groups(kv, gate, params["norm"], ratio, eps, x.dtype)
