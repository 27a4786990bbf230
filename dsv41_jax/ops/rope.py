"""Rotary position embeddings as V4.1 uses them: partial (the LAST ``rope_dim`` channels of a head), interleaved
(adjacent channel pairs rotate as one complex number), two flavours (``main`` for SWA-only layers; ``compress``
with a larger base and YaRN interpolation for every layer with a compressed branch), and an inverse rotation for
the attention output (K = V carries the key's rotation, so the output's rope slice is rotated back by the query
position before the output projection).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig, YarnConfig


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def inv_frequencies(rope_dim: int, base: float, yarn: YarnConfig | None) -> np.ndarray:
    """One inverse frequency per channel pair (``rope_dim // 2`` values), float32.

    YaRN: frequencies below the ``beta_slow`` correction dimension are interpolated (divided by ``factor``), those
    above ``beta_fast`` are kept, with a linear ramp between; the correction range is truncated to integers
    (floor/ceil), and no attention (m)scale is applied — the V4.1 reference forces the attention factor to 1.
    """
    exponents = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    pos_freqs = np.power(np.float32(base), exponents, dtype=np.float32)
    inv_extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if yarn is None:
        return inv_extrapolation
    inv_interpolation = (np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)).astype(np.float32)
    low = math.floor(_yarn_correction_dim(yarn.beta_fast, rope_dim, base, yarn.original_max_position_embeddings))
    high = math.ceil(_yarn_correction_dim(yarn.beta_slow, rope_dim, base, yarn.original_max_position_embeddings))
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = (np.float32(1.0) - ramp).astype(np.float32)
    return (inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight).astype(np.float32)


def rope_tables(config: ModelConfig) -> dict[str, np.ndarray]:
    """The two inverse-frequency vectors, keyed by rope flavour."""
    d = config.qk_rope_head_dim
    return {
        "main": inv_frequencies(d, config.rope_theta, None),
        "compress": inv_frequencies(d, config.compress_rope_theta, config.compress_yarn),
    }


def cos_sin(inv_freq: jax.Array | np.ndarray, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin of ``positions[..., None] * inv_freq`` in float32; shape ``positions.shape + (rope_dim // 2,)``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, inverse: bool = False) -> jax.Array:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` as interleaved (even, odd) pairs.

    ``cos``/``sin`` broadcast against ``x[..., :rope_dim // 2]`` with a head axis inserted by the caller where
    needed. Math in float32, result in ``x.dtype``.

    The rotation is written over every channel as x·cos + swap(x)·(∓sin) (swap: each pair's two channels
    exchanged; the tables padded with cos 1 / sin 0 over the unrotated leading pairs, and repeated per channel),
    and the leading channels are then selected from ``x`` itself: they pass through bit for bit, and the rotated
    ones are the same float32 products and sums (``-odd · sin`` added for ``- odd · sin``). The result is one
    elementwise map of ``x`` with no concatenate, which XLA fuses with its producer or consumer; the concatenate of
    the unrotated and rotated parts was a GPU kernel of its own at the attention output of a decode step's layers
    (benchmarks/RESULTS.md).
    """
    if inverse:
        sin = -sin
    half = cos.shape[-1]
    rope_dim = 2 * half
    d = x.shape[-1]
    if d % 2:  # odd width: the unrotated part does not split into pairs
        nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
        return jnp.concatenate([nope, _rotate(rope, cos, sin)], axis=-1)
    lead = [(0, 0)] * (cos.ndim - 1) + [(d // 2 - half, 0)]
    cos = jnp.pad(cos.astype(jnp.float32), lead, constant_values=1.0)
    sin = jnp.pad(sin.astype(jnp.float32), lead)
    # x's own channel read once (float32 and back is exact), its pair partner once: fusible with a producer that
    # XLA would not recompute per read (the split-softmax merge before the attention output's inverse rotation)
    xf = x.astype(jnp.float32)
    return jnp.where(jnp.arange(d) >= d - rope_dim, _rotate_f32(xf, cos, sin), xf).astype(x.dtype)


def _rotate_f32(xf: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Every (even, odd) channel pair of float32 ``xf`` rotated by cos / sin (one entry per pair):
    (even · cos - odd · sin, odd · cos + even · sin), written per channel without splitting the pairs."""
    swapped = xf.reshape(*xf.shape[:-1], -1, 2)[..., ::-1].reshape(xf.shape)  # (odd, even) at (even, odd)
    cos_c = jnp.repeat(cos, 2, axis=-1)
    sin_c = jnp.repeat(sin, 2, axis=-1) * jnp.tile(jnp.asarray([-1.0, 1.0], jnp.float32), cos.shape[-1])
    return xf * cos_c + swapped * sin_c


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    return _rotate_f32(x.astype(jnp.float32), cos, sin).astype(x.dtype)
