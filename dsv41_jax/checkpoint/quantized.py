"""The release's block-scaled weight formats: exact dequantisation, the quantisers that write them, and
:class:`QuantizedTensor`, a pytree leaf that keeps values + scales for serving.

Formats (``names.FP8_BLOCK`` / ``FP4_ROWS`` / ``ENGRAM_ROWS``; official ``inference/model.py`` ``Linear`` and
``ParallelEngramEmbedding``, ``convert.py``):

* FP8 weight: ``w[i, j] = e4m3(v[i, j]) * 2^(s[i // 32, j // 32] - 127)``, ``v`` float8_e4m3fn ``[out, in]``,
  ``s`` float8_e8m0fnu ``[ceil(out/32), ceil(in/32)]`` (a float32 scale tensor is accepted as well).
* FP4 routed expert: ``v`` int8 / uint8 / F4 ``[out, in/2]``, two e2m1 codes per byte, **element 2j in the low
  nibble, 2j+1 in the high nibble** (``convert.py`` unpacks ``low = x & 0x0F`` then ``high = x >> 4`` and
  interleaves them ``stack([low, high], -1).flatten``); code -> value by the e2m1 table
  ``[0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6]``; ``s`` e8m0 ``[out, in/32]``.
* Engram table: ``v`` e4m3 ``[rows, head_dim]``, ``s`` e8m0 ``[rows, head_dim/32]``, one scale per 32 values of
  a row (``values.unflatten(-1, (-1, 32)) * scales.unsqueeze(-1)``).

Dequantisation is exact: every product ``e4m3 * 2^k`` (or ``e2m1 * 2^k``) is a float32 value computed without
rounding (numpy keeps subnormals; the jax path uses integer exponent arithmetic, immune to XLA:CPU flush-to-zero), and
the cast to the caller's dtype rounds once, to nearest even — what the official code does (``.float() * scale`` then
``.to(bfloat16)``).

Quantisers (writer side). The release's offline weight quantiser is not public; any power-of-two scale is valid for
the format. We use the official activation quantisers' rule, through the project's bit-exact implementation
(:mod:`dsv41_jax.ops.quant`): FP8 scale ``2^ceil(log2(max(amax, 1e-4) / 448))`` per block, e4m3 round-to-nearest-
even; FP4 scale ``2^ceil(log2(max(amax, 6·2^-126) / 6))`` per 32, e2m1 round-to-nearest-even.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41_jax.checkpoint import names as N
from dsv41_jax.ops import quant as Q

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E8M0_BIAS = 127
FP8_BLOCK_SHAPE = (32, 32)


class QuantFormatError(ValueError):
    pass


# ----------------------------------------------------------------------------------------------------------------
# host (numpy) decoding
# ----------------------------------------------------------------------------------------------------------------

def as_uint8(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def e8m0_to_f32(s: np.ndarray) -> np.ndarray:
    """Scale tensor -> float32 multipliers. e8m0 byte b -> 2^(b-127) (b = 0 gives the subnormal 2^-127, 255 NaN);
    a float scale tensor (V4-Flash-Base style) is used as is."""
    if s.dtype == ml_dtypes.float8_e8m0fnu or s.dtype == np.uint8:
        b = as_uint8(s).astype(np.int32)
        out = np.ldexp(np.float32(1.0), b - E8M0_BIAS).astype(np.float32)
        return np.where(b == 255, np.float32(np.nan), out)
    if np.issubdtype(s.dtype, np.floating) or s.dtype == ml_dtypes.bfloat16:
        return s.astype(np.float32)
    raise QuantFormatError(f"unsupported scale dtype {s.dtype}")


# byte -> value tables (a gather is several times faster than unpacking / converting element by element)
E4M3_TABLE = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
FP4_PAIR_TABLE = np.stack([E2M1_VALUES[np.arange(256) & 0x0F], E2M1_VALUES[np.arange(256) >> 4]], axis=-1)  # [256, 2]


def e4m3_to_f32(v: np.ndarray) -> np.ndarray:
    return E4M3_TABLE[as_uint8(v)]


def unpack_fp4_codes(packed: np.ndarray) -> np.ndarray:
    """[..., n/2] bytes -> [..., n] e2m1 codes: element 2j from the low nibble, 2j+1 from the high nibble."""
    b = as_uint8(packed)
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[:-1] + (2 * b.shape[-1],))


def pack_fp4_codes(codes: np.ndarray) -> np.ndarray:
    c = np.asarray(codes, np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def _expand(s: np.ndarray, axis: int, block: int, offset: int, length: int) -> np.ndarray:
    """Repeat scale rows / columns ``block`` times and cut the window [offset, offset + length)."""
    return np.repeat(s, block, axis=axis).take(np.arange(offset, offset + length), axis=axis)


def dequant_fp8_block(values: np.ndarray, scale: np.ndarray, block=FP8_BLOCK_SHAPE, row0: int = 0) -> np.ndarray:
    """float32 ``[r, in]`` from e4m3 rows ``[row0, row0 + r)`` of an FP8 weight and the scale rows covering them
    (``scale[row0 // bo : ...]``)."""
    bo, bi = block
    r, i = values.shape
    s = _expand(e8m0_to_f32(scale), 0, bo, row0 - (row0 // bo) * bo, r)  # [r, ceil(i/bi)]
    v = e4m3_to_f32(values)
    if i % bi == 0:
        return _scale_rows(v, s, bi)
    return v * _expand(s, 1, bi, 0, i)


def _scale_rows(v: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """``v [r, n] *= scale [r, n/block]`` broadcast over blocks of the last axis, in place."""
    r, n = v.shape
    vb = v.reshape(r, n // block, block)
    vb *= e8m0_to_f32(scale)[..., None]
    return v


def dequant_fp4_rows(packed: np.ndarray, scale: np.ndarray, block: int = N.FP4_BLOCK) -> np.ndarray:
    """float32 ``[r, in]`` from packed e2m1 ``[r, in/2]`` (element 2j in the low nibble) and e8m0 ``[r, in/32]``."""
    b = as_uint8(packed)
    v = FP4_PAIR_TABLE[b].reshape(b.shape[0], 2 * b.shape[1])  # [r, in/2, (low, high)] -> [r, in]
    return _scale_rows(v, scale, block)


def dequant_engram_rows(values: np.ndarray, scale: np.ndarray, block: int = N.ENGRAM_BLOCK) -> np.ndarray:
    return _scale_rows(e4m3_to_f32(values), scale, block)


def cast(x: np.ndarray, dtype) -> np.ndarray:
    """float32 -> dtype, one round-to-nearest-even (ml_dtypes for bf16, as torch's ``.to(bfloat16)``)."""
    dtype = np.dtype(dtype)
    return x if x.dtype == dtype else x.astype(dtype)


# ----------------------------------------------------------------------------------------------------------------
# quantisers (writer side), through dsv41_jax.ops.quant's bit-exact arithmetic
# ----------------------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(1, 2))
def _fp8_block_grid(x, bo: int, bi: int):
    """(e4m3 grid values, block exponents k) of ``x`` [po, pi] in bo x bi blocks (the official act_quant rule)."""
    po, pi = x.shape
    xb = x.reshape(po // bo, bo, pi // bi, bi)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=(1, 3), keepdims=True), Q._FP8_AMAX_FLOOR)
    k = Q._pow2_ceil_exponent(amax * Q._INV_448)
    return Q.round_to_fp8_e4m3(jnp.clip(Q._ldexp_exact(xb, -k), -Q.FP8_E4M3_MAX, Q.FP8_E4M3_MAX)), k


@functools.partial(jax.jit, static_argnums=(1,))
def _fp4_rows_grid(w, block: int):
    """(e2m1 grid values, exponents k) of ``w`` [o, i] with one ue8m0 scale per ``block`` (official fp4_act_quant)."""
    o, i = w.shape
    xb = w.reshape(o, i // block, block)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    k = Q._pow2_ceil_exponent(jnp.maximum(amax, Q._FP4_UE8M0_AMAX_FLOOR) * Q._INV_6)
    return Q.round_to_fp4_e2m1(jnp.clip(Q._ldexp_exact(xb, -k), -Q.FP4_E2M1_MAX, Q.FP4_E2M1_MAX)), k


def quantize_fp8_block(w: np.ndarray, block=FP8_BLOCK_SHAPE) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn ``[out, in]``, float8_e8m0fnu ``[ceil(out/bo), ceil(in/bi)]``) with a power-of-two scale per
    block: ``2^ceil(log2(max(amax, 1e-4) / 448))`` (the official ``act_quant`` rule). Blocks may be partial."""
    bo, bi = block
    w = np.asarray(w, np.float32)
    o, i = w.shape
    po, pi = -(-o // bo) * bo, -(-i // bi) * bi
    padded = np.zeros((po, pi), np.float32)
    padded[:o, :i] = w
    q, k = _fp8_block_grid(jnp.asarray(padded), bo, bi)
    codes = np.asarray(q).reshape(po, pi)[:o, :i].astype(ml_dtypes.float8_e4m3fn)
    scale = (np.asarray(k).reshape(po // bo, pi // bi) + E8M0_BIAS).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return codes, scale


def quantize_engram_rows(table: np.ndarray, block: int = N.ENGRAM_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 ``[rows, hd]``, e8m0 ``[rows, hd/32]``): the FP8 rule per 1 x 32 block."""
    if table.shape[-1] % block:
        raise QuantFormatError(f"Engram head_dim {table.shape[-1]} is not a multiple of {block}")
    return quantize_fp8_block(table, (1, block))


def quantize_fp4_rows(w: np.ndarray, block: int = N.FP4_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 packed ``[out, in/2]`` — the release stores it as int8 — , e8m0 ``[out, in/32]``): e2m1 codes with a
    power-of-two scale per 32 inputs ``2^ceil(log2(max(amax, 6·2^-126) / 6))`` (official ``fp4_act_quant``)."""
    w = np.asarray(w, np.float32)
    o, i = w.shape
    if i % block:
        raise QuantFormatError(f"FP4 input dim {i} is not a multiple of {block}")
    q, k = _fp4_rows_grid(jnp.asarray(w), block)
    q = np.asarray(q)
    mag = np.searchsorted(E2M1_VALUES[:8], np.abs(q))  # exact grid values -> code 0..7
    codes = (mag + 8 * ((q < 0) & (mag > 0))).astype(np.uint8).reshape(o, i)
    scale = (np.asarray(k).reshape(o, i // block) + E8M0_BIAS).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return pack_fp4_codes(codes), scale


# ----------------------------------------------------------------------------------------------------------------
# QuantizedTensor: values + scales as one pytree leaf (serving keeps FP8 / FP4 weights)
# ----------------------------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """A weight kept in the release's storage format. ``values``: uint8 (e4m3 bytes, or two e2m1 codes per byte for
    ``fmt == FP4_ROWS``); ``scales``: uint8 e8m0 bytes (or float32); ``fmt``: one of ``names.FP8_BLOCK``,
    ``FP4_ROWS``, ``ENGRAM_ROWS``; ``shape``: the logical (dequantised) shape. Leading axes (stacked experts) are
    allowed. ``dequantize(dtype)`` is exact and jittable.

    ``scale_max`` (static, optional): the largest e8m0 scale byte of ``scales``, or None (unknown). Recorded on the
    host, once, where the release's FP4 experts are built or loaded (``scale_byte_max``); the grouped FP4 GEMM takes
    its one-multiply decode only for weights known to stay at or below byte 128 (``kernels.quant_gemm_gpu.
    fp4_grouped_decode``). A static field, not a leaf: pytrees, shardings and the leaves' arrays are as before; a
    tensor derived from another (a slice of its experts) may keep it, as an upper bound."""

    values: jax.Array
    scales: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    block: tuple[int, int] = dataclasses.field(default=FP8_BLOCK_SHAPE, metadata=dict(static=True))
    scale_max: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        sm = self.scale_max
        if sm is not None and (isinstance(sm, bool) or not isinstance(sm, int) or not 0 <= sm <= 255):
            raise QuantFormatError(f"QuantizedTensor.scale_max must be an int scale byte 0..255 or None, got {sm!r}")

    @property
    def dtype(self):
        return jnp.dtype(jnp.uint8)

    @property
    def nbytes(self) -> int:
        return int(self.values.size * self.values.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize(self, dtype)


def scale_byte_max(scales) -> int | None:
    """The largest e8m0 byte of a host scale array (numpy, uint8 / float8_e8m0fnu) as an int, for
    ``QuantizedTensor.scale_max``; None for float scales or an empty array."""
    s = np.asarray(scales)
    if s.size == 0 or not (s.dtype == np.uint8 or s.dtype == ml_dtypes.float8_e8m0fnu):
        return None
    return int(as_uint8(s).max())


def _scale_exponent(scales: jax.Array):
    """(int32 exponent, None) for e8m0 bytes, or (None, float32 multipliers) for float scales."""
    if scales.dtype == jnp.uint8:
        return scales.astype(jnp.int32) - E8M0_BIAS, None
    return None, scales.astype(jnp.float32)


def dequantize(qt: QuantizedTensor, dtype=jnp.float32) -> jax.Array:
    """Exact dequantisation on device (jittable): integer exponent arithmetic, one final rounding to ``dtype``."""
    return _dequantize(qt, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1,))
def _dequantize(qt: QuantizedTensor, dtype) -> jax.Array:
    v = qt.values
    if qt.fmt == N.FP4_ROWS:
        codes = jnp.stack([v & 0x0F, v >> 4], axis=-1).reshape(v.shape[:-1] + (2 * v.shape[-1],))
        x = jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]
        bo, bi = 1, N.FP4_BLOCK
    else:
        x = jax.lax.bitcast_convert_type(v, jnp.float8_e4m3fn).astype(jnp.float32)
        bo, bi = (1, N.ENGRAM_BLOCK) if qt.fmt == N.ENGRAM_ROWS else qt.block
    k, mult = _scale_exponent(qt.scales)
    s = k if k is not None else mult
    s = jnp.repeat(jnp.repeat(s, bo, axis=-2), bi, axis=-1)[..., : x.shape[-2], : x.shape[-1]]
    if k is not None:
        y = jnp.where(s == 255 - E8M0_BIAS, jnp.float32(jnp.nan), Q._ldexp_exact(x, s))  # e8m0 0xFF is NaN
    else:
        y = x * s
    return y.astype(dtype)


__all__ = ["QuantizedTensor", "dequantize", "scale_byte_max", "dequant_fp8_block", "dequant_fp4_rows",
           "dequant_engram_rows", "quantize_fp8_block", "quantize_fp4_rows", "quantize_engram_rows", "unpack_fp4_codes",
           "pack_fp4_codes", "e8m0_to_f32", "e4m3_to_f32", "E2M1_VALUES", "QuantFormatError"]
