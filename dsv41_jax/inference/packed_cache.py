"""The KV cache in the release's packed formats (SPEC §5, §10): one byte (FP8) or half a byte (FP4) per value plus
one scale byte per block, instead of 2 or 4 bytes per value.

=================  ===========================================  =====================================
cache part         stored as                                    bytes per vector of ``dim`` values
=================  ===========================================  =====================================
window (SWA) KV    FP8 e4m3 + one ue8m0 scale per 32            ``dim + dim / 32``
compressed KV      FP4 e2m1 (2 per byte) + one e4m3 scale / 16  ``dim / 2 + dim / 16``
indexer keys       FP4 e2m1 (2 per byte) + one ue8m0 scale / 32 ``dim / 2 + dim / 32``
=================  ===========================================  =====================================

FP4 bytes hold element ``2j`` in the low nibble and ``2j + 1`` in the high nibble (the release's weight packing);
codes follow the e2m1 table of :mod:`dsv41_jax.checkpoint.quantized`.

Lossless by construction for the values the release's fake quantisation produces (``ops.quant``: the forward
rounds exactly these three tensors onto these grids before they are cached):

* ue8m0 formats store the SMALLEST power-of-two scale ``2^k`` with ``amax <= max_code * 2^k``. A value on the grid
  of scale ``2^k'`` (``k' >= k``) is on the grid of ``2^k`` too (multiplying an e4m3 / e2m1 value by ``2^(k'-k)``
  while staying within the format's maximum is exact), so unpacking gives the value back bit for bit, -0.0
  included (e4m3 keeps the sign of zero; the FP4 quantiser never outputs -0.0).
* the e4m3-scale FP4 format tries the scales ``amax / g`` for every e2m1 magnitude ``g`` and keeps one
  that is an e4m3 value and reproduces every value of the block exactly (``code * scale == value``,
  checked): the true scale of a fake-quantised block is one of them. Blocks off the grid (a forward without the
  fake quantisation) fall back to the release's own quantiser rule, i.e. they are quantised.

The reference and TPU paths unpack at read (plain JAX, :func:`read`). The GPU kernels read the packed buffers
directly (``kernels.pallas_gpu.load_packed_tile``: the rows they use, loaded as contiguous byte / scale tiles and
dequantised in registers to exactly the values :func:`unpack` gives; ``kernels.reads_packed_cache``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsv41_jax.ops import quant as Q

FP8_UE8M0_32 = "fp8_e4m3_ue8m0_32"  # window KV
FP4_E4M3_16 = "fp4_e2m1_e4m3_16"  # compressed KV
FP4_UE8M0_32 = "fp4_e2m1_ue8m0_32"  # indexer keys
FORMATS = {FP8_UE8M0_32: (32, 1), FP4_E4M3_16: (16, 2), FP4_UE8M0_32: (32, 2)}  # block, values per byte
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)  # magnitudes of codes 0..7
_BIAS = 127


class PackError(ValueError):
    pass


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedRows:
    """A cache buffer of vectors [..., dim] kept packed: ``values`` uint8 [..., dim / values_per_byte], ``scales``
    uint8 [..., dim / block]. ``dtype``: what :func:`read` unpacks to. ``shape`` is the logical shape."""

    values: jax.Array
    scales: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    dim: int = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[:-1]) + (self.dim,)

    @property
    def ndim(self) -> int:
        return self.values.ndim


def packed_shapes(shape: tuple[int, ...], fmt: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    block, per_byte = FORMATS[fmt]
    dim = shape[-1]
    if dim % block:
        raise PackError(f"{fmt}: vector size {dim} is not a multiple of the block {block}")
    return tuple(shape[:-1]) + (dim // per_byte,), tuple(shape[:-1]) + (dim // block,)


def zeros(shape: tuple[int, ...], fmt: str, dtype=jnp.float32) -> PackedRows:
    """An empty packed buffer (every byte 0 unpacks to +0.0 in all three formats)."""
    vshape, sshape = packed_shapes(tuple(shape), fmt)
    return PackedRows(jnp.zeros(vshape, jnp.uint8), jnp.zeros(sshape, jnp.uint8), fmt, int(shape[-1]),
                      str(jnp.dtype(dtype)))


# ----------------------------------------------------------------------------------------------------------------
# pack / unpack (jittable, bit-exact integer arithmetic from ops.quant: immune to flush-to-zero)
# ----------------------------------------------------------------------------------------------------------------

def _smallest_pow2_exponent(amax: jax.Array, top: float) -> jax.Array:
    """Smallest int k with ``amax <= top * 2^k`` (amax > 0, normal)."""
    k = Q._pow2_ceil_exponent(amax * np.float32(1.0 / top))  # within one of the answer (rounded reciprocal)
    topv = jnp.full_like(amax, top)
    k = jnp.where(amax <= Q._ldexp_exact(topv, k - 1), k - 1, k)
    return jnp.where(amax > Q._ldexp_exact(topv, k), k + 1, k)


def _fp4_codes(q: jax.Array) -> jax.Array:
    """e2m1 grid values (already rounded) -> 4-bit codes (sign in bit 3; zero is code 0)."""
    mag = jnp.searchsorted(jnp.asarray(_E2M1), jnp.abs(q)).astype(jnp.uint8)
    return mag + jnp.where((q < 0) & (mag > 0), jnp.uint8(8), jnp.uint8(0))


def _fp4_values(codes: jax.Array) -> jax.Array:
    mag = jnp.asarray(_E2M1)[(codes & 7).astype(jnp.int32)]
    return jnp.where(codes >= 8, -mag, mag)


def _pack_nibbles(codes: jax.Array) -> jax.Array:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(b: jax.Array) -> jax.Array:
    return jnp.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[:-1] + (2 * b.shape[-1],))


def pack(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """Vectors x [..., dim] -> (values uint8, scales uint8) in ``fmt``; lossless for values on the format's grid."""
    block, _ = FORMATS[fmt]
    packed_shapes(x.shape, fmt)
    xb = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    if fmt in (FP8_UE8M0_32, FP4_UE8M0_32):
        top, floor = (Q.FP8_E4M3_MAX, Q._FP8_AMAX_FLOOR) if fmt == FP8_UE8M0_32 else \
            (Q.FP4_E2M1_MAX, Q._FP4_UE8M0_AMAX_FLOOR)
        k = jnp.clip(_smallest_pow2_exponent(jnp.maximum(amax, floor), top), -_BIAS, 254 - _BIAS)
        q = jnp.clip(Q._ldexp_exact(xb, -k), -top, top)
        if fmt == FP8_UE8M0_32:
            codes = lax.bitcast_convert_type(Q.round_to_fp8_e4m3(q).astype(jnp.float8_e4m3fn), jnp.uint8)
        else:
            codes = _pack_nibbles(_fp4_codes(Q.round_to_fp4_e2m1(q)).reshape(x.shape))
        scales = (k + _BIAS).astype(jnp.uint8)
    elif fmt == FP4_E4M3_16:
        # the release's rule (also the fallback for blocks off the grid): scale = e4m3(max(amax, 6*2^-9) / 6)
        a = jnp.maximum(amax, Q._FP4_E4M3_AMAX_FLOOR)
        scale = Q.round_to_fp8_e4m3(Q._div_exact(a, jnp.full_like(a, Q.FP4_E2M1_MAX)))
        for g in _E2M1[1:]:  # scale = amax / g for each e2m1 magnitude g: any exact one makes the block lossless
            s = amax / np.float32(g)
            qs = Q.round_to_fp4_e2m1(jnp.clip(xb / s, -Q.FP4_E2M1_MAX, Q.FP4_E2M1_MAX))
            exact = (Q.round_to_fp8_e4m3(s) == s) & (s > 0) & jnp.all(qs * s == xb, axis=-1, keepdims=True)
            scale = jnp.where(exact, s, scale)
        q = Q.round_to_fp4_e2m1(jnp.clip(Q._div_exact(xb, scale), -Q.FP4_E2M1_MAX, Q.FP4_E2M1_MAX))
        codes = _pack_nibbles(_fp4_codes(q).reshape(x.shape))
        scales = lax.bitcast_convert_type(scale.astype(jnp.float8_e4m3fn), jnp.uint8)
    else:
        raise PackError(f"unknown packed format {fmt!r}")
    return codes.reshape(packed_shapes(x.shape, fmt)[0]), scales.reshape(packed_shapes(x.shape, fmt)[1])


def unpack(values: jax.Array, scales: jax.Array, fmt: str, dtype=jnp.float32) -> jax.Array:
    """(values, scales) -> vectors [..., dim] in ``dtype`` (exact: every packed value is a float32 / bf16 value)."""
    block, _ = FORMATS[fmt]
    if fmt == FP8_UE8M0_32:
        x = lax.bitcast_convert_type(values, jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        x = _fp4_values(_unpack_nibbles(values))
    xb = x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    if fmt == FP4_E4M3_16:
        y = xb * lax.bitcast_convert_type(scales, jnp.float8_e4m3fn).astype(jnp.float32)[..., None]
    else:
        y = Q._ldexp_exact(xb, (scales.astype(jnp.int32) - _BIAS)[..., None])
    return y.reshape(x.shape).astype(dtype)


# ----------------------------------------------------------------------------------------------------------------
# cache buffer access: one call site each in the cached forward, whatever the layout
# ----------------------------------------------------------------------------------------------------------------

def read(buf) -> jax.Array:
    """A cache buffer as values: a packed buffer is unpacked (to its ``dtype``), an array returned as is."""
    if isinstance(buf, PackedRows):
        return unpack(buf.values, buf.scales, buf.fmt, buf.dtype)
    return buf


def set_rows(buf, index: tuple, vals: jax.Array):
    """``buf.at[index].set(vals, mode="drop")`` for either layout (a packed buffer packs ``vals`` first: each
    vector's blocks are independent, so rows pack on their own)."""
    if isinstance(buf, PackedRows):
        v, s = pack(vals, buf.fmt)
        return dataclasses.replace(buf, values=buf.values.at[index].set(v, mode="drop"),
                                   scales=buf.scales.at[index].set(s, mode="drop"))
    return buf.at[index].set(vals.astype(buf.dtype), mode="drop")


__all__ = ["PackedRows", "PackError", "FP8_UE8M0_32", "FP4_E4M3_16", "FP4_UE8M0_32", "FORMATS", "zeros", "pack",
           "unpack", "read", "set_rows", "packed_shapes"]
