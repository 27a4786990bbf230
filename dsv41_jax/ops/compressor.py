"""CSA2 compressor (KV-source layers only): non-overlapping groups of ``ratio`` tokens -> one 512-d latent.

ratio > 1: per group, a channel-wise softmax of the gate over the group's tokens weights the projected KV (fp32),
summed, then RMSNorm. ratio == 1: RMSNorm of the per-token projection, no gate. The latent returned is BEFORE
RoPE: the indexer keys derive from it; the attention's compressed KV is its rotated (and quantised) form.
Entry s covers tokens [s·ratio, s·ratio + ratio − 1] and is rotated at position s·ratio.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.ops import quant
from dsv41_jax.ops.linear import linear, matmul_precision
from dsv41_jax.ops.norms import rms_norm
from dsv41_jax.ops.rope import apply_rope

_HI = jax.lax.Precision.HIGHEST


def compressed_entries(latent: jax.Array, indexer_p: dict, cos: jax.Array, sin: jax.Array, eps: float,
                       quant_on: bool) -> tuple[jax.Array, jax.Array]:
    """Compressor latents [B, N, D] (pre-RoPE) -> (the attention's compressed KV: rotated at each entry's position,
    FP4 e2m1 / e4m3 block-16 under fake quantisation; the indexer keys: wk + k_norm, rotated, FP4 e2m1 / ue8m0
    block-32). cos / sin [B or 1, N, r/2] are the compress RoPE tables at the entries' positions."""
    keys = apply_rope(rms_norm(linear(latent, indexer_p["wk"]), indexer_p["k_norm"], eps), cos, sin)
    rotated = apply_rope(latent, cos, sin)
    if quant_on:
        keys = quant.fake_quant_fp4_e2m1_block(keys, 32, scale_format="ue8m0")
        rotated = quant.fake_quant_fp4_e2m1_block(rotated, 16, scale_format="e4m3")
    return rotated, keys


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
        kv = jnp.einsum("btd,fd->btf", x, params["wkv"], precision=matmul_precision(x, params["wkv"]))
        return rms_norm(kv, params["norm"], eps)
    kv, gate = project_compressor_inputs(x[:, :usable], params["wkv"], params.get("wgate"))
    return pool_groups(kv, gate, params["norm"], ratio, eps, x.dtype)


def compress_packed(x: jax.Array, params: dict, ratio: int, eps: float, positions: jax.Array,
                    segments: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Packed documents: one candidate group per token slot, [B, T, hd] latents plus a validity mask.

    Slot j holds the group starting at token j; it is an entry iff j starts a group of its own document
    (document-relative position divisible by ``ratio``) and the group's last token is in the same document.
    """
    b, t, _ = x.shape
    if ratio == 1:
        kv = jnp.einsum("btd,fd->btf", x, params["wkv"], precision=matmul_precision(x, params["wkv"]))
        return rms_norm(kv, params["norm"], eps), jnp.ones((b, t), bool)
    kv, gate = project_compressor_inputs(x, params["wkv"], params["wgate"])
    pad = ((0, 0), (0, ratio - 1), (0, 0))
    kv_p, gate_p = jnp.pad(kv, pad), jnp.pad(gate, pad)
    kv_s = jnp.stack([kv_p[:, i:i + t] for i in range(ratio)], axis=2)  # [B, T, ratio, hd]
    gate_s = jnp.stack([gate_p[:, i:i + t] for i in range(ratio)], axis=2)
    latent = jnp.sum(kv_s * jax.nn.softmax(gate_s, axis=2), axis=2)
    last_seg = jnp.pad(segments, ((0, 0), (0, ratio - 1)), constant_values=-1)[:, ratio - 1:ratio - 1 + t]
    valid = (positions % ratio == 0) & (last_seg == segments)
    return rms_norm(latent.astype(x.dtype), params["norm"], eps), valid
