"""Release fake quantisation of DeepSeek-V4.1 (SPEC §5, reference notes §8.5).

The released model was trained with quantisation-aware training, and the HF reference
(`modeling_deepseek_v41.py`) always rounds three activations onto low-precision grids and
straight back to the compute dtype ("fake quantisation": there is no low-precision matmul):

==========================================  ==========================================================
where (in the model)                        call / format
==========================================  ==========================================================
window (SWA) KV, every layer, after RoPE,   ``fake_quant_fp8_e4m3_block(kv, 32)``: FP8 e4m3, one ue8m0
the whole vector (RoPE tail included)       (power-of-two) scale per 32, ``2^ceil(log2(max(amax, 1e-4)
                                            * float32(1/448)))``
compressed KV latent after RoPE (the        ``fake_quant_fp4_e2m1_block(c, 16, scale_format="e4m3")``:
stored compressed KV; the indexer keys are  FP4 e2m1, one e4m3 scale per 16, ``e4m3(max(amax, 6*2^-9)
derived from the latent BEFORE this RoPE    / 6)``
and rounding)
indexer queries and indexer keys, after     ``fake_quant_fp4_e2m1_block(q, 32, scale_format="ue8m0")``:
RoPE                                        FP4 e2m1, one ue8m0 scale per 32, ``2^ceil(log2(max(amax,
                                            6*2^-126) * float32(1/6)))``
optional extra, not in the HF reference:    ``fake_quant_gemm_input_fp8(x, 32)``: the window-KV
inputs of the GEMMs whose weights are       quantiser itself (1x32 blocks, ue8m0 scale, amax floor
stored FP8/FP4 (official ``act_quant``)     1e-4)
==========================================  ==========================================================

Everything else (wo_a, compressor, indexer wk and weights projection, router, mHC, head,
confidence head) runs unrounded.

Numerics (bit-exact with the reference on CPU float32; checked against recorded pairs)
--------------------------------------------------------------------------------------
* All arithmetic is float32 whatever the input dtype (the reference does ``x.float()``);
  the result is cast back to the input dtype (exact for bf16/fp32: every output has at most
  7 significant bits).
* amax floors: 1e-4 (FP8, as float32), 6*2^-9 (FP4/e4m3), 6*2^-126 (FP4/ue8m0).
* ue8m0 scale: ``t = amax * float32(1/448)`` (or ``* float32(1/6)``), a float32 multiply by
  the rounded reciprocal exactly like torch's ``tensor * python_float``; then
  ``k = ceil(log2 t)`` read off the float32 bits (exponent, +1 if any mantissa bit), never
  through ``log2``.  ``k >= 128`` (t = inf or NaN, i.e. an inf/NaN in the block) makes the
  reference's scale ``exp2(k) = inf`` and its whole block NaN; we reproduce that.
* Divisions are TRUE float32 divisions, as torch CPU does them: ``a / 6`` for the e4m3 scale
  and ``x / scale`` by the per-block e4m3 scale.  XLA rewrites ``x / 6.0`` and
  ``x / broadcast(scale)`` into multiplications by a rounded reciprocal (last-bit errors for
  about 1/3 of all inputs, e.g. 9.375 / 1.875 -> 5.0000005, which flips the FP4 tie at 5), so
  both are done by an exact integer long division (``_div_exact``).
* torch's float32 -> float8_e4m3fn cast (torch 2.13, the fixture generator's version) rounds
  to nearest-even and SATURATES: every finite |v| > 448 and +-inf become +-448, NaN stays NaN
  (ml_dtypes and the OCP spec give NaN above 464 instead; ``round_to_fp8_e4m3(saturate=False)``).
  It only matters for the e4m3 scale (the FP8 path clamps to +-448 before its cast): a block
  with amax > 2784 gets scale 448 and its large values clamp to +-2688.
* FP4 scaling by a power of two (x / 2^k and back) is done by exponent arithmetic on the bits
  with round-to-nearest-even into the float32 subnormal range: XLA:CPU runs with
  flush-to-zero / denormals-are-zero, so a float multiply would turn e.g. the reference's
  output ``0.5 * 2^-126 = 2^-127`` into 0 and read a subnormal input as 0.
* The FP8 block quantiser needs none of that and runs on plain float ops (a quarter of the
  XLA ops; the GEMM-input rounding sits before every quantised GEMM, so a release-precision
  decode program compiles in 0.56x the time on CPU): its 1e-4 amax floor keeps the scale 2^k at
  k >= -22, so every nonzero output (>= 2^-9 * 2^-22) and both scale factors are normal
  floats and the multiplications by 2^-k and 2^k are exact; a product that flushes to zero
  (or a subnormal input read as zero) is below 2^-10 and rounds to the same signed zero in
  e4m3. The rounding is the native float32 -> float8_e4m3fn conversion (nearest-even,
  subnormal step 2^-9, sign kept, so negative values that round to zero give -0.0 as the
  reference's fp8 cast does); the clamp to +-448 before it is the saturation. It is done on
  the bits (``_e4m3_round_trip``): XLA:GPU removes a float32 -> float8 -> float32 conversion
  pair as excess precision, which made the rounding a no-op there.
  ``round_to_fp8_e4m3`` (the e4m3 scales of the FP4 path, any input) rounds on the bits.
* FP4 rounding follows the reference's thresholds on |q|: > 0.25, >= 0.75, > 1.25, >= 1.75,
  > 2.5, >= 3.5, > 5 (nearest, ties to the even code), sign from the sign bit, and the
  reference's value table maps every negative value that rounds to zero (and -0.0) to
  **+0.0**: the FP4 path never outputs -0.0, unlike the FP8 path.

Gradients: the bit manipulation itself has no derivative (``jax.grad`` through it would
silently give zero), so the public quantisers carry a straight-through estimator
(``jax.custom_jvp``): the forward value is the bit-exact quantised one, the derivative is the
identity.  This is what quantisation-aware training uses (the default for ``dsv41 train`` with
``quant_sim`` on).  The reference's own autograd differs and is odd (checked on torch 2.13): FP8
is straight-through inside the clamp, but gradient * scale passes a float8 cast, so small
gradients underflow to 0; FP4/ue8m0 has no gradient at all (the output does not require
grad); FP4/e4m3 passes gradient only to the block's amax element, through the scale.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "FP8_E4M3_MAX",
    "FP4_E2M1_MAX",
    "round_to_fp8_e4m3",
    "round_to_fp4_e2m1",
    "fake_quant_fp8_e4m3_block",
    "fake_quant_fp4_e2m1_block",
    "fake_quant_gemm_input_fp8",
    "fp8_e4m3_block_codes",
]

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0

_F32 = jnp.float32
_U32 = jnp.uint32
_I32 = jnp.int32

_SIGN = np.uint32(0x80000000)
_ABS = np.uint32(0x7FFFFFFF)
_MANT = np.uint32(0x007FFFFF)
_HIDDEN = np.uint32(0x00800000)
_INF_BITS = np.uint32(0x7F800000)
_QNAN_BITS = np.uint32(0x7FC00000)
_E4M3_MAX_BITS = np.uint32(0x43E00000)  # 448.0 = 1.75 * 2^8
_E4M3_MIN_NORMAL_BITS = np.uint32(0x3C800000)  # 2^-6

# Constants rounded to float32 exactly as torch rounds a Python float operand of a float32 op.
_FP8_AMAX_FLOOR = np.float32(1e-4)
_INV_448 = np.float32(1.0 / 448.0)
_INV_6 = np.float32(1.0 / 6.0)
_FP4_E4M3_AMAX_FLOOR = np.float32(6.0 * 2.0**-9)
_FP4_UE8M0_AMAX_FLOOR = np.float32(6.0 * 2.0**-126)


# --------------------------------------------------------------------------------------
# bit-level helpers (float32 <-> uint32), all integer arithmetic: immune to FTZ/DAZ
# --------------------------------------------------------------------------------------
def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x.astype(_F32), _U32)


def _float(u: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(u.astype(_U32), _F32)


def _shift_right_rne(u: jax.Array, s: jax.Array, sticky: jax.Array | None = None) -> jax.Array:
    """round_to_nearest_even(u / 2^s) for uint32 ``u`` and shift ``s`` (clamped to [1, 31]);
    ``sticky`` marks a nonzero remainder below ``u`` (from an earlier integer division)."""
    s = jnp.clip(s, 1, 31).astype(_U32)
    q = lax.shift_right_logical(u, s)
    rem = u & (lax.shift_left(_U32(1), s) - _U32(1))
    half = lax.shift_left(_U32(1), s - _U32(1))
    tie_up = (q & _U32(1)) == _U32(1)
    if sticky is not None:
        tie_up = tie_up | sticky
    up = (rem > half) | ((rem == half) & tie_up)
    return q + up.astype(_U32)


def _unpack(x: jax.Array):
    """float32 -> (sign bits, |bits|, 24-bit significand normalised to bit 23, biased exponent)
    so that |x| = f * 2^(exp - 150) also for subnormal x (then exp < 1).  f = 0 for zeros."""
    b = _bits(x)
    sign = b & _SIGN
    mag = b & _ABS
    e = lax.shift_right_logical(mag, _U32(23)).astype(_I32)
    m = mag & _MANT
    sub = e == 0
    f = jnp.where(sub, m, m | _HIDDEN)
    exp = jnp.where(sub, 1, e)
    lz = jnp.clip(lax.clz(f).astype(_I32) - 8, 0, 23)
    return sign, mag, lax.shift_left(f, lz.astype(_U32)), exp - lz


def _ldexp_exact(x: jax.Array, n: jax.Array) -> jax.Array:
    """``x * 2^n`` for float32 ``x`` and int32 ``n``, correctly rounded (nearest-even) into the
    subnormal range and to +-inf on overflow: what IEEE multiplication by a power of two gives
    without flush-to-zero.  Zeros keep their sign; inf/NaN pass through."""
    sign, mag, f, exp = _unpack(x)
    new_exp = exp + n.astype(_I32)
    normal = lax.shift_left(jnp.clip(new_exp, 1, 254).astype(_U32), _U32(23)) | (f & _MANT)
    subnormal = _shift_right_rne(f, 1 - new_exp)  # a carry to 2^23 is the smallest normal: correct
    out = jnp.where(new_exp >= 1, normal, subnormal)
    out = jnp.where(new_exp >= 255, _INF_BITS, out)
    out = jnp.where(mag == 0, _U32(0), out)
    out = jnp.where(mag >= _INF_BITS, mag, out)
    return _float(sign | out)


def _pow2_ceil_exponent(t: jax.Array) -> jax.Array:
    """``ceil(log2 t)`` (int32) of a positive normal float32 from its bits: unbiased exponent,
    plus one if any mantissa bit is set.  inf gives 128, NaN 129 (as the reference)."""
    b = _bits(t)
    e = (lax.shift_right_logical(b, _U32(23)) & _U32(0xFF)).astype(_I32)
    return e - 127 + ((b & _MANT) != 0).astype(_I32)


def _exp2(k: jax.Array) -> jax.Array:
    """``2^k`` as a float32 for int32 ``k``, built from its exponent bits; exact for k in [-126, 127] (k is clipped
    to that range: callers replace the results of larger k)."""
    return _float(lax.shift_left((jnp.clip(k, -126, 127) + 127).astype(_U32), _U32(23)))


def _div_exact(x: jax.Array, d: jax.Array) -> jax.Array:
    """Correctly rounded float32 ``x / d`` (IEEE division, nearest-even, subnormal results
    included, no flush-to-zero) for any float32 ``x`` and a positive normal float32 divisor
    ``d`` with at most 3 fraction bits (every e4m3 value, and 6.0); NaN ``d`` gives NaN.

    XLA rewrites ``x / c`` (constant c) and ``x / broadcast(d)`` into multiplications by a
    rounded reciprocal, which is not the reference's true division (torch CPU divides): e.g.
    9.375 / 1.875 becomes 5.0000005 instead of the FP4 tie 5.0.  So divide on integers:
    |x| = f * 2^(ex-150) with a 24-bit f, d = D * 2^(ed-130) with D in [8, 15];
    |x| / d = ((32 f) / D) * 2^(ex-ed-25), the quotient having 25 or 26 bits.
    """
    sign, mag, f, ex = _unpack(x)
    db = _bits(d)
    ed = lax.shift_right_logical(db, _U32(23)).astype(_I32)
    dsig = lax.shift_right_logical((db & _MANT) | _HIDDEN, _U32(20))  # D in [8, 15]
    num = lax.shift_left(f, _U32(5))  # [2^28, 2^29)
    quo = num // dsig  # [2^24.09, 2^26)
    sticky = (num % dsig) != 0
    sh = jnp.where(quo >= _U32(1 << 25), 2, 1)  # drop to a 24-bit significand
    new_exp = sh + ex - ed + 125  # biased exponent of the result
    # one rounding, at the normal or (new_exp < 1) at the subnormal position
    sig = _shift_right_rne(quo, jnp.where(new_exp >= 1, sh, sh + 1 - new_exp), sticky)
    normal = lax.shift_left(jnp.clip(new_exp, 1, 254).astype(_U32), _U32(23)) + sig - _HIDDEN
    out = jnp.where(new_exp >= 1, normal, sig)  # sig carrying to 2^23 bumps the exponent: correct
    out = jnp.where(new_exp >= 255, _INF_BITS, out)
    out = jnp.where(mag == 0, _U32(0), out)
    out = jnp.where(mag >= _INF_BITS, mag, out)  # inf / d = inf, NaN stays NaN
    out = jnp.where(jnp.isnan(d), _QNAN_BITS, out)
    return _float(sign | out)


# --------------------------------------------------------------------------------------
# element-wise rounding onto the low-precision grids
# --------------------------------------------------------------------------------------
def round_to_fp8_e4m3(x: jax.Array, saturate: bool = True) -> jax.Array:
    """Round to the nearest float8_e4m3fn value (ties to even) and return it in ``x.dtype``
    (float32 arithmetic; e4m3 values are exact in bf16/fp16/fp32).

    ``saturate=True`` (default) is torch's CPU ``float32 -> float8_e4m3fn`` cast as used by
    the reference (torch 2.13): finite |x| > 448 and +-inf give +-448.  ``saturate=False`` is
    the OCP / ml_dtypes behaviour: |x| > 464 (beyond the tie with the NaN code) and +-inf give
    NaN.  NaN stays NaN.  Zeros and values that round to zero keep their sign."""
    dtype = x.dtype
    b = _bits(x)
    sign = b & _SIGN
    mag = b & _ABS
    # normal e4m3 range (|x| >= 2^-6): keep 3 mantissa bits, nearest-even on the bits
    lsb = lax.shift_right_logical(mag, _U32(20)) & _U32(1)
    normal = (mag + _U32(0x7FFFF) + lsb) & _U32(0xFFF00000)
    # subnormal e4m3 range (|x| < 2^-6): nearest-even multiple of 2^-9
    e = lax.shift_right_logical(mag, _U32(23)).astype(_I32)
    full = jnp.where(e == 0, mag & _MANT, (mag & _MANT) | _HIDDEN)
    units = _shift_right_rne(full, 141 - jnp.maximum(e, 1))  # |x| / 2^-9, in [0, 8]
    subnormal = _bits(units.astype(_F32) * np.float32(2.0**-9))
    out = jnp.where(mag >= _E4M3_MIN_NORMAL_BITS, normal, subnormal)
    overflow = _E4M3_MAX_BITS if saturate else _QNAN_BITS
    out = jnp.where((out > _E4M3_MAX_BITS) & (mag <= _INF_BITS), overflow, out)
    out = jnp.where(mag > _INF_BITS, _QNAN_BITS, out)
    return _float(sign | out).astype(dtype)


def round_to_fp4_e2m1(q: jax.Array) -> jax.Array:
    """The reference's e2m1 rounding of already-scaled, clamped values: nearest e2m1 value
    (0, .5, 1, 1.5, 2, 3, 4, 6), ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2,
    2.5->2, 3.5->4, 5->4), sign from the sign bit; every zero result is +0.0.
    Returns float32."""
    q = q.astype(_F32)
    a = jnp.abs(q)
    half = np.float32(0.5)
    one = np.float32(1.0)
    v = (jnp.where(a > np.float32(0.25), half, 0)
         + jnp.where(a >= np.float32(0.75), half, 0)
         + jnp.where(a > np.float32(1.25), half, 0)
         + jnp.where(a >= np.float32(1.75), half, 0)
         + jnp.where(a > np.float32(2.5), one, 0)
         + jnp.where(a >= np.float32(3.5), one, 0)
         + jnp.where(a > np.float32(5.0), np.float32(2.0), 0)).astype(_F32)
    # negative zero maps to +0 (reference LUT entry 8 is +0.0): negate non-zero values only
    return jnp.where(jnp.signbit(q) & (v > 0), -v, v)


# --------------------------------------------------------------------------------------
# block fake-quantisers
# --------------------------------------------------------------------------------------
def _blocks(x: jax.Array, block: int, name: str) -> jax.Array:
    n = x.shape[-1]
    if block <= 0 or n % block:
        # The reference silently skips quantisation when the last dim is not a multiple of the
        # block; the config refuses such shapes while quant_sim is on, so reaching this is a
        # caller bug (use quant_sim=False for such shapes).
        raise ValueError(f"{name}: last dim {n} is not a multiple of block {block}")
    return x.astype(_F32).reshape(x.shape[:-1] + (n // block, block))


def _block_amax(xb: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(xb), axis=-1, keepdims=True)


def _e4m3_native(q: jax.Array) -> jax.Array:
    """The native float32 -> float8_e4m3fn -> float32 conversion pair: the oracle :func:`_e4m3_on_bits` is tested
    against (on the CPU, which keeps the pair), not used by the model."""
    return q.astype(jnp.float8_e4m3fn).astype(_F32)


def _e4m3_round_trip(q: jax.Array) -> jax.Array:
    """float32 ``q`` (|q| <= 448 or NaN) rounded to the nearest e4m3 value (ties to even), float32, on every platform
    by :func:`_e4m3_on_bits`. Not the native conversion pair (:func:`_e4m3_native`): XLA:GPU removes such a pair as
    "excess precision" (``xla_allow_excess_precision``, on by default: seen in the H200 compile, 2026-12-03, where the
    GEMM-input rounding had become a no-op). The bit form gives the same values (tested on every e4m3 value, tie and
    neighbour) and no simplification can drop it; one form for every platform keeps a conditional out of the
    programs (a ``lax.platform_dependent`` choice is a ``cond`` in the decode step's graph)."""
    return _e4m3_on_bits(q)


def _e4m3_on_bits(q: jax.Array) -> jax.Array:
    """:func:`_e4m3_native` for float32 |q| <= 448 (or NaN) without a float8 type: the normal range (|q| >= 2^-6)
    keeps 3 mantissa bits, nearest-even on the bits; below it the nearest-even multiple of 2^-9 (an exact scaling by
    2^9, an integer rounding, and back). A few integer ops where :func:`round_to_fp8_e4m3` (any input) takes many."""
    b = _bits(q)
    sign, mag = b & _SIGN, b & _ABS
    lsb = lax.shift_right_logical(mag, _U32(20)) & _U32(1)
    normal = (mag + _U32(0x7FFFF) + lsb) & _U32(0xFFF00000)
    sub = _bits(lax.round(_float(mag) * np.float32(512.0), lax.RoundingMethod.TO_NEAREST_EVEN)
                * np.float32(2.0 ** -9))
    return _float(sign | jnp.where(mag >= _E4M3_MIN_NORMAL_BITS, normal, sub))


def _fake_quant_fp8_e4m3_block(x: jax.Array, block: int = 32) -> jax.Array:
    """Quantise-dequantise to FP8 e4m3 with one power-of-two (ue8m0) scale per ``block``
    values of the last axis (reference ``_fake_quant_fp8_block``).

    scale = 2^ceil(log2(max(amax, 1e-4) * float32(1/448))); q = clamp(x / scale, +-448)
    rounded to e4m3 (nearest-even; the clamp is the saturation); out = q * scale, in
    ``x.dtype``.  Any leading shape; float32 or bfloat16 (or float16) input."""
    xb = _blocks(x, block, "fake_quant_fp8_e4m3_block")
    amax = jnp.maximum(_block_amax(xb), _FP8_AMAX_FLOOR)
    k = _pow2_ceil_exponent(amax * _INV_448)
    q = jnp.clip(xb * _exp2(-k), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    y = _e4m3_round_trip(q) * _exp2(k)
    y = jnp.where(k >= 128, np.float32(np.nan), y)  # inf/NaN in the block: reference scale = inf
    return y.reshape(x.shape).astype(x.dtype)


def fp8_e4m3_block_codes(x: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """The FP8 block quantisation of :func:`_fake_quant_fp8_e4m3_block` as its parts: (e4m3 codes float8_e4m3fn
    [..., K], float32 scales 2^k [..., K / block]) with ``codes * scale`` = the fake-quantised ``x`` (NaN scale for
    a block holding an inf / NaN, as there). For a GEMM on FP8 tensor cores: when ``x`` is already FP8-rounded
    (the release's GEMM inputs) the codes are exact, ``codes * scale == x``."""
    xb = _blocks(x, block, "fp8_e4m3_block_codes")
    amax = jnp.maximum(_block_amax(xb), _FP8_AMAX_FLOOR)
    k = _pow2_ceil_exponent(amax * _INV_448)
    q = jnp.clip(xb * _exp2(-k), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    # rounded on the bits first: the cast below then only changes the type (exact), on every platform
    codes = _e4m3_round_trip(q).astype(jnp.float8_e4m3fn).reshape(x.shape)
    scale = jnp.where(k >= 128, np.float32(np.nan), _exp2(k))[..., 0]
    return codes, scale


def _fake_quant_fp4_e2m1_block(x: jax.Array, block: int | None = None, scale_format: str = "ue8m0") -> jax.Array:
    """Quantise-dequantise to FP4 e2m1 with one scale per ``block`` values of the last axis
    (reference ``_fake_quant_fp4_block``).

    ``scale_format="e4m3"`` (released: block 16, the compressed KV):
        scale = e4m3(max(amax, 6*2^-9) / 6)   (true division; saturating e4m3 cast)
    ``scale_format="ue8m0"`` (released: block 32, the indexer q and k):
        scale = 2^ceil(log2(max(amax, 6*2^-126) * float32(1/6)))
    q = clamp(x / scale, +-6) rounded by :func:`round_to_fp4_e2m1`; out = q * scale in
    ``x.dtype``.  ``block=None`` picks the released block of the scale format."""
    if scale_format not in ("e4m3", "ue8m0"):
        raise ValueError(f"scale_format must be 'e4m3' or 'ue8m0', got {scale_format!r}")
    if block is None:
        block = 16 if scale_format == "e4m3" else 32
    xb = _blocks(x, block, "fake_quant_fp4_e2m1_block")
    amax = _block_amax(xb)
    if scale_format == "e4m3":
        a = jnp.maximum(amax, _FP4_E4M3_AMAX_FLOOR)
        scale = round_to_fp8_e4m3(_div_exact(a, jnp.full_like(a, FP4_E2M1_MAX)))
        q = jnp.clip(_div_exact(xb, scale), -FP4_E2M1_MAX, FP4_E2M1_MAX)
        y = round_to_fp4_e2m1(q) * scale  # exact: scale >= 2^-9, values have <= 6 significant bits
    else:
        k = _pow2_ceil_exponent(jnp.maximum(amax, _FP4_UE8M0_AMAX_FLOOR) * _INV_6)
        q = jnp.clip(_ldexp_exact(xb, -k), -FP4_E2M1_MAX, FP4_E2M1_MAX)
        y = _ldexp_exact(round_to_fp4_e2m1(q), k)  # may be subnormal (0.5 * 2^-126)
        y = jnp.where(k >= 128, np.float32(np.nan), y)
    return y.reshape(x.shape).astype(x.dtype)


# --------------------------------------------------------------------------------------
# public quantisers: bit-exact forward, straight-through (identity) derivative
# --------------------------------------------------------------------------------------
@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def fake_quant_fp8_e4m3_block(x: jax.Array, block: int = 32) -> jax.Array:
    return _fake_quant_fp8_e4m3_block(x, block)


@fake_quant_fp8_e4m3_block.defjvp
def _fp8_ste(block, primals, tangents):
    (x,), (t,) = primals, tangents
    return fake_quant_fp8_e4m3_block(x, block), t


fake_quant_fp8_e4m3_block.__doc__ = _fake_quant_fp8_e4m3_block.__doc__


def fake_quant_fp4_e2m1_block(x: jax.Array, block: int | None = None, scale_format: str = "ue8m0") -> jax.Array:
    if scale_format not in ("e4m3", "ue8m0"):
        raise ValueError(f"scale_format must be 'e4m3' or 'ue8m0', got {scale_format!r}")
    return _fp4_ste(x, block, scale_format)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _fp4_ste(x, block, scale_format):
    return _fake_quant_fp4_e2m1_block(x, block, scale_format)


@_fp4_ste.defjvp
def _fp4_ste_jvp(block, scale_format, primals, tangents):
    (x,), (t,) = primals, tangents
    return _fp4_ste(x, block, scale_format), t


fake_quant_fp4_e2m1_block.__doc__ = _fake_quant_fp4_e2m1_block.__doc__

# Optional extra (SPEC §5): the official inference code rounds the input of every GEMM whose
# weight is stored FP8/FP4 with act_quant(x, 32, "ue8m0"): 1x32 blocks, amax floor 1e-4,
# power-of-two scale, e4m3 round-trip -- the same function as the window-KV quantiser.
fake_quant_gemm_input_fp8 = fake_quant_fp8_e4m3_block
