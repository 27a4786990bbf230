"""The projection every layer uses: ``x @ w.T`` with PyTorch-layout weights [out, in], and the LM head."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dsv41_jax.ops.quant import fake_quant_gemm_input_fp8


def matmul_precision(*operands):
    """The matmul precision for these operands: HIGHEST when any is float32 (float32 parity with the reference),
    the backend default for 16-bit ones. Products of two bf16 values are exact in the float32 accumulator that every
    backend uses for 16-bit dots (MXU, tensor cores, XLA:CPU), so HIGHEST buys nothing there but can force
    multi-pass or float32 emulation (and Mosaic rejects it on a bf16 ragged_dot)."""
    wide = any(jnp.dtype(o.dtype).itemsize >= 4 for o in operands)
    return jax.lax.Precision.HIGHEST if wide else None


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] · w [out, in] -> [..., out] (precision: ``matmul_precision``).

    ``w`` may also be a release-format weight (:class:`~dsv41_jax.checkpoint.quantized.QuantizedTensor`) and / or
    marked :class:`Fp8GemmInput`: see :func:`gemm_operands`."""
    if isinstance(w, LoraWeight):
        return lora_linear(x, w)
    be = quantized_gemm_backend(w)
    if be is not None:
        from dsv41_jax.kernels import quant_gemm  # lazy: kernels import ops

        if quant_gemm.takes_fp8(w.weight):
            return quant_gemm.fp8_linear(gemm_input(x, w), w.weight, backend=be, tuning=dict(w.tuning) or None)
    x, w = gemm_operands(x, w)
    return jnp.einsum("...i,oi->...o", x, w, precision=matmul_precision(x, w))


def linear_many(x: jax.Array, ws) -> tuple:
    """``tuple(linear(x, w) for w in ws)`` for several projections of the same input, computed as one launch where
    a kernel can: release FP8 weights marked for a quantised-GEMM kernel (all with the same kernel backend and K)
    go through ``quant_gemm.fp8_linear_fused`` — one weight stream instead of one short launch per projection at
    decode; the input is rounded to FP8 once (the same rounding each GEMM would apply). Any other mix of weight
    forms runs ``linear`` once per weight. Same values either way (float32 accumulation-order noise)."""
    ws = tuple(ws)
    bes = {quantized_gemm_backend(w) for w in ws}
    if len(ws) > 1 and len(bes) == 1 and None not in bes and len({w.shape[-1] for w in ws}) == 1 and \
            len({w.tuning for w in ws}) == 1:
        from dsv41_jax.kernels import quant_gemm  # lazy: kernels import ops

        if all(quant_gemm.takes_fp8(w.weight) for w in ws):
            return quant_gemm.fp8_linear_fused(gemm_input(x, ws[0]), [w.weight for w in ws], backend=bes.pop(),
                                               tuning=dict(ws[0].tuning) or None)
    return tuple(linear(x, w) for w in ws)


def head_logits(h: jax.Array, w: jax.Array, *, hf_rounding: bool = False) -> jax.Array:
    """float32 logits h [..., d] · head [V, d]ᵀ.

    Official V4.1 numerics (the default): an fp32 head, ``x.float() @ head``. The products of two bf16 values are
    exact in float32, so this is the matmul of the stored operands with float32 accumulation and a float32 result
    (``preferred_element_type``) — no float32 copy of the [V, d] head. ``hf_rounding=True``: the HF port's order,
    ``lm_head(x).float()`` (the logits rounded to the compute dtype first). Identical for float32 inputs (the golden
    fixtures are float32)."""
    if hf_rounding:
        return linear(h, w).astype(jnp.float32)
    if jnp.dtype(h.dtype).itemsize < 4 and jnp.dtype(h.dtype) == jnp.dtype(w.dtype):
        return _head_16bit(h, w)
    return jnp.einsum("...i,oi->...o", h, w, precision=matmul_precision(h, w), preferred_element_type=jnp.float32)


@jax.custom_vjp
def _head_16bit(h: jax.Array, w: jax.Array) -> jax.Array:
    """float32 logits of 16-bit ``h`` and ``w`` whose backward GEMMs run on 16-bit operands too. Left to autodiff,
    the float32 cotangent of the logits made both backward GEMMs float32 ones ([tokens, V] x [V, d] and its
    transpose: TF32 on the H200, 8.5 ms of a 240 ms train step, benchmarks/RESULTS.md). Here the cotangent is
    rounded once to the operands' dtype — as every other backward GEMM of a 16-bit step receives it — and the
    products accumulate in float32; the gradients come back in the operands' dtype as before."""
    return jnp.einsum("...i,oi->...o", h, w, preferred_element_type=jnp.float32)


def _head_16bit_fwd(h, w):
    return _head_16bit(h, w), (h, w)


def _head_16bit_bwd(res, g):
    h, w = res
    g = g.astype(h.dtype)
    dh = jnp.einsum("...o,oi->...i", g, w, preferred_element_type=jnp.float32).astype(h.dtype)
    lead = "".join(chr(ord("a") + i) for i in range(h.ndim - 1))
    dw = jnp.einsum(f"{lead}o,{lead}i->oi", g, h, preferred_element_type=jnp.float32).astype(w.dtype)
    return dh, dw


_head_16bit.defvjp(_head_16bit_fwd, _head_16bit_bwd)


def _chunks(n: int, piece: int) -> int:
    """How many equal chunks of at least ``piece`` a length ``n`` splits into (a power of two up to 16 dividing n;
    1 when n is short or odd)."""
    for c in (16, 8, 4, 2):
        if n % c == 0 and n // c >= piece:
            return c
    return 1


def narrow_matmul_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] · w [N, K]ᵀ -> [M, N] in float32 at full float32 precision, for a narrow ``w`` (few outputs N, a long
    contraction K: the mHC coefficient projection, the MoE router). One float32 dot of that shape runs on a GPU as
    a cuBLAS GEMM with one small tile per 32 rows looping over all of K (measured on the H200: 1.6 ms for a
    [4096, 20480] x [20480, 24] product, and as slow for its two gradients), so the products are arranged for
    parallelism (:func:`_narrow_matmul`); float32 arithmetic throughout, only the order of the additions differs
    from one long dot."""
    return _narrow_matmul(x.astype(jnp.float32), w.astype(jnp.float32))


def narrow_dot_one_pass(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] · w [N, K]ᵀ -> [..., N] float32 as ONE element-wise product and sum over K (for a few rows: a
    decode step's router logits / mHC projection). XLA emits it as a single reduction kernel, where
    :func:`narrow_matmul_f32` launches a split-K GEMM (autotuned when compiled) and a second kernel for the sum of
    its chunks; exact float32 arithmetic either way, only the order of the additions differs."""
    return jnp.sum(x.astype(jnp.float32)[..., None, :] * w.astype(jnp.float32), axis=-1)


# How _narrow_matmul's backward forms dx = g · w for N <= 32 outputs (read at trace time); the same float32 products,
# only the order of the N additions differs:
#   "auto" (default) — "dot" on a GPU (measured fastest there), "reduce" elsewhere (CPU / TPU results unchanged);
#   "reduce" — one sum over the N axis of the [M, N, K] products: XLA:GPU emits a reduction over a middle
#       axis, fused with the RMS norm's backward; at the fullwidth4 train step on an H200 each mHC site's took
#       0.755 ms for [4096, 24] x [24, 20480] (~4.7x the time of one read + one write of dx; benchmarks/RESULTS.md,
#       2026-12-02 14:29);
#   "terms" — the N products added one after another: measured 6.9 ms per step SLOWER there (XLA left the chain
#       in ~24 fusions per site, 1191 fusions against 999);
#   "minor" — the sum over a minor N axis of [M, K, N] products (a row reduction with w transposed once):
#       not measured yet;
#   "dot" — one float32 dot at Precision.HIGHEST (a GEMM with an N-long contraction: on a GPU a cuBLAS SGEMM on the
#       CUDA cores, no TF32; the RMS norm's backward then runs in fusions of its own): the fullwidth4 train step
#       1.8 ms faster than "reduce" on an H200 in one process (161.3 vs 163.1 ms; benchmarks/RESULTS.md, 2026-12-02
#       15:15);
#   "pallas_gpu" / "pallas_gpu_interpret" — the Pallas GPU kernel kernels.narrow_dx_gpu (one Triton dot at IEEE
#       float32 per tile of dx, N zero-padded to 32; the interpret form for CPU tests); XLA's "dot" form where no
#       tile divides dx: 161.5 ms in the same run, as fast as "dot" within the noise, so "dot" (no kernel) is the
#       GPU default.
NARROW_DX_FORMS = ("auto", "reduce", "terms", "minor", "dot", "pallas_gpu", "pallas_gpu_interpret")
NARROW_DX_FORM = "auto"


def _narrow_dx_form() -> str:
    if NARROW_DX_FORM not in NARROW_DX_FORMS:
        raise ValueError(f"ops.linear.NARROW_DX_FORM = {NARROW_DX_FORM!r}: want one of {NARROW_DX_FORMS}")
    if NARROW_DX_FORM == "auto":
        return "dot" if jax.default_backend() == "gpu" else "reduce"
    return NARROW_DX_FORM


@jax.custom_vjp
def _narrow_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] · w [N, K]ᵀ -> [M, N], float32 (N small, K long): the contraction split into up to 16 chunks, one
    batched float32 GEMM over them, the partial products summed (a split-K GEMM: 16x the thread blocks of one long
    dot)."""
    return _narrow_matmul_fwd(x, w)[0]


def _narrow_matmul_fwd(x, w):
    m, k = x.shape
    n = w.shape[0]
    s = _chunks(k, 512)
    parts = jnp.einsum("smk,snk->smn", jnp.swapaxes(x.reshape(m, s, k // s), 0, 1),
                       jnp.swapaxes(w.reshape(n, s, k // s), 0, 1), precision=jax.lax.Precision.HIGHEST)
    return jnp.sum(parts, axis=0), (x, w)


def _narrow_matmul_bwd(res, g):
    x, w = res
    m, k = x.shape
    n = w.shape[0]
    # dx [M, K] = g [M, N] · w [N, K]: a contraction over the few outputs; for N <= 32 a fused sum of products (an
    # elementwise pass over dx) rather than a GEMM whose contraction is N long. Its form: NARROW_DX_FORM.
    form = _narrow_dx_form()
    if n <= 32 and form.startswith("pallas_gpu"):
        from dsv41_jax.kernels import narrow_dx_gpu  # lazy: kernels import ops

        if narrow_dx_gpu.narrow_dx_tiles(m, k) is not None:
            dx = narrow_dx_gpu.narrow_dx(g, w, interpret=form.endswith("interpret"))
        else:
            dx = jnp.einsum("mn,nk->mk", g, w, precision=jax.lax.Precision.HIGHEST)
    elif n <= 32 and form == "terms":
        dx = g[:, 0, None] * w[None, 0, :]
        for i in range(1, n):
            dx = dx + g[:, i, None] * w[None, i, :]
    elif n <= 32 and form == "minor":
        dx = jnp.sum(g[:, None, :] * w.T[None, :, :], axis=-1)
    elif n <= 32 and form == "reduce":
        dx = jnp.sum(g[:, :, None] * w[None, :, :], axis=1)
    else:  # "dot", or N > 32
        dx = jnp.einsum("mn,nk->mk", g, w, precision=jax.lax.Precision.HIGHEST)
    # dw [N, K] = gᵀ x: the token axis (the contraction) split into chunks, one batched GEMM, summed
    s = _chunks(m, 256)
    dw = jnp.sum(jnp.einsum("smn,smk->snk", g.reshape(s, m // s, n), x.reshape(s, m // s, k),
                            precision=jax.lax.Precision.HIGHEST), axis=0)
    return dx, dw


_narrow_matmul.defvjp(_narrow_matmul_fwd, _narrow_matmul_bwd)


# ----------------------------------------------------------------------------------------------------------------
# Release-precision weights (SPEC §5, §12): the plain-JAX reference of the FP8 / FP4 GEMMs
# ----------------------------------------------------------------------------------------------------------------
# A weight reaching a GEMM is one of
#   * a float array (bf16 / fp32 serving, training);
#   * a QuantizedTensor (values + scales in the release's storage layout, kept on device): dequantised exactly
#     inside the jitted program at the point of use — the future Pallas kernels dequantise in-register instead;
#   * either of those wrapped in Fp8GemmInput: the release runs this GEMM on FP8 / FP4 weights, so its input is
#     first rounded to FP8 e4m3 with one ue8m0 scale per 32 (official ``act_quant(x, 32, "ue8m0")``).
# ``dsv41_jax.inference.release.mark_fp8_gemm_inputs`` applies the wrapper to exactly the release's FP8 / FP4 GEMMs.

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8GemmInput:
    """Marks a weight whose GEMM first rounds its input to FP8 (1 x 32 blocks, ue8m0 scale). A pytree node whose
    only child is the wrapped array / QuantizedTensor, so it jits, shards and donates like the weight itself.

    ``gemm`` (static): how a QuantizedTensor weight's GEMM runs — ``"reference"`` (dequantise in XLA, then the
    GEMM) or a :mod:`dsv41_jax.kernels.quant_gemm` backend (``"auto"``, ``"pallas_gpu"``, ``"pallas_tpu"``, their
    ``*_interpret`` forms): Pallas kernels that read the stored FP8 / FP4 bytes and dequantise in registers.
    ``tuning`` (static): (name, value) pairs passed to the FP8 dense kernel (``quant_gemm.fp8_linear`` /
    ``fp8_linear_fused``'s ``tuning``; empty: its defaults) — to measure one kernel form against another.
    ``round_kernel`` (static): with a ``pallas_gpu`` kernel backend, the input's rounding as one Pallas kernel
    (``kernels.quant_gemm.fp8_round``; the same values bit for bit) instead of XLA's two (block amax, rounding)."""

    weight: Any
    gemm: str = dataclasses.field(default="reference", metadata=dict(static=True))
    tuning: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    round_kernel: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self):
        return tuple(self.weight.shape)

    @property
    def dtype(self):
        return self.weight.dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """A frozen base weight [out, in] plus a low-rank adapter: ``linear(x, w) = x·baseᵀ + scale · (drop(x)·a)·b``
    with ``a`` [in, r], ``b`` [r, out] (``dsv41_jax.train.lora``). The adapter is added to the base GEMM's output,
    so ``base`` may stay in any weight form (float, QuantizedTensor, marked) and is never materialised with the
    adapter folded in. ``dropout_key`` (a PRNG key array, or None = no dropout) drops adapter inputs at
    ``dropout_rate`` (training only). A pytree node: base, a, b and the key are children; scale and rate static."""

    base: Any
    a: jax.Array
    b: jax.Array
    dropout_key: Any = None
    scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    dropout_rate: float = dataclasses.field(default=0.0, metadata=dict(static=True))

    @property
    def shape(self):
        return tuple(self.base.shape)

    @property
    def dtype(self):
        return self.base.dtype


def lora_linear(x: jax.Array, w: LoraWeight) -> jax.Array:
    """``linear`` for a :class:`LoraWeight`: the base GEMM (its own weight form and input rounding) plus the scaled
    adapter path, both in the input's dtype (float32 accumulation inside each dot)."""
    y = linear(x, w.base)
    h = x
    if w.dropout_key is not None and w.dropout_rate > 0:
        keep = jax.random.bernoulli(w.dropout_key, 1.0 - w.dropout_rate, x.shape)
        h = jnp.where(keep, x / (1.0 - w.dropout_rate), 0).astype(x.dtype)
    a, b = w.a.astype(x.dtype), w.b.astype(x.dtype)
    low = jnp.einsum("...i,ir->...r", h, a, precision=matmul_precision(h, a))
    delta = jnp.einsum("...r,ro->...o", low, b, precision=matmul_precision(low, b))
    return y + (w.scale * delta).astype(y.dtype)


def _is_quantized(w) -> bool:
    return hasattr(w, "fmt") and hasattr(w, "scales")  # a QuantizedTensor (duck-typed: ops stay checkpoint-free)


def is_plain_weight(w) -> bool:
    """A float array (not a QuantizedTensor, not marked, not a LoRA-adapted weight)."""
    return not isinstance(w, (Fp8GemmInput, LoraWeight)) and not _is_quantized(w)


def weight_array(w, dtype=None) -> jax.Array:
    """The weight as a float array: a QuantizedTensor is dequantised exactly (to ``dtype``, default float32), a
    marker unwrapped, an array returned as is (cast to ``dtype`` when given)."""
    if isinstance(w, LoraWeight):  # only `linear` knows to add the adapter: refuse rather than drop it silently
        raise TypeError("a LoRA-adapted weight reached an op that reads it as a plain array; LoRA targets must be "
                        "weights consumed by ops.linear.linear (dsv41_jax.train.lora.LORA_CAPABLE)")
    if isinstance(w, Fp8GemmInput):
        w = w.weight
    if _is_quantized(w):
        return w.dequantize(jnp.float32 if dtype is None else dtype)
    return w if dtype is None else w.astype(dtype)


def quantized_gemm_backend(w) -> str | None:
    """The kernel backend that runs ``w``'s GEMM on its stored bytes (``Fp8GemmInput.gemm`` resolved), or None for
    the plain-JAX dequantise-then-GEMM (float weights, ``gemm="reference"``, ``"auto"`` on CPU, float scale
    tensors, which the kernels do not take)."""
    if not isinstance(w, Fp8GemmInput) or w.gemm == "reference" or not _is_quantized(w.weight):
        return None
    from dsv41_jax.kernels.quant_gemm import resolve_backend  # lazy: kernels import ops

    be = resolve_backend(w.gemm)
    return None if be == "reference" or w.weight.scales.dtype != jnp.uint8 else be


def gemm_input(x: jax.Array, w) -> jax.Array:
    """``x`` as the GEMM with weight ``w`` consumes it: FP8-rounded per 32 (ue8m0) when ``w`` is marked
    :class:`Fp8GemmInput`, unchanged otherwise (one Pallas kernel where the marker asks for it, ``round_kernel``)."""
    if isinstance(w, Fp8GemmInput):
        be = quantized_gemm_backend(w) if w.round_kernel else None
        if be is not None and be.startswith("pallas_gpu") and x.shape[-1] % 32 == 0 and x.size and \
                x.dtype in (jnp.bfloat16, jnp.float32):
            from dsv41_jax.kernels import quant_gemm  # lazy: kernels import ops

            return quant_gemm.fp8_round(x, backend=be)
        return fake_quant_gemm_input_fp8(x, 32)
    return x


def gemm_operands(x: jax.Array, w) -> tuple[jax.Array, jax.Array]:
    """(the GEMM's input, its weight as an array in the input's dtype) for any weight form."""
    x = gemm_input(x, w)
    dtype = x.dtype if (isinstance(w, Fp8GemmInput) and _is_quantized(w.weight)) or _is_quantized(w) else None
    return x, weight_array(w, dtype)


def select_expert(w, e):
    """Expert ``e``'s weight [out, in] of stacked expert weights [E, out, in], in the same form (array,
    QuantizedTensor, marked): a QuantizedTensor gives the expert's own values and scales, so only that expert's
    packed bytes are read and dequantised."""
    if isinstance(w, Fp8GemmInput):
        return dataclasses.replace(w, weight=select_expert(w.weight, e))
    if _is_quantized(w):
        return dataclasses.replace(w, values=w.values[e], scales=w.scales[e], shape=tuple(w.shape[1:]))
    return w[e]


__all__ = ["linear", "linear_many", "narrow_matmul_f32", "LoraWeight", "lora_linear", "head_logits", "matmul_precision",
           "Fp8GemmInput", "is_plain_weight", "weight_array", "gemm_input", "gemm_operands", "select_expert", "quantized_gemm_backend"]
