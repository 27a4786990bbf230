"""GEMMs that read the release's quantised weights directly, behind one ``backend=`` switch.

Backends (the attention kernels' convention, :mod:`dsv41_jax.kernels`)
  ``"reference"``             plain JAX: dequantise exactly (``checkpoint.quantized.dequantize``), then the GEMM —
                              the definition of correct.
  ``"pallas_gpu"``            Pallas, Triton lowering (:mod:`.quant_gemm_gpu`): e4m3 / e2m1 decoded in registers.
  ``"pallas_tpu"``            Pallas Mosaic TPU (:mod:`.quant_gemm_tpu`): in-kernel integer dequantisation.
  ``"pallas_gpu_interpret"`` / ``"pallas_tpu_interpret"``: the same kernels in Pallas interpret mode (CPU tests).
  ``"auto"``                  pallas_gpu on GPU, pallas_tpu on TPU, reference elsewhere.

Operations
  ``fp8_linear(x, w)``: ``x [..., K] · wᵀ`` for an FP8 32 x 32 block-scaled ``QuantizedTensor`` w [N, K] -> [..., N]
  in x.dtype (float32 accumulation).
  ``fp8_linear_fused(x, (w_0, w_1, ...))``: several such projections of one input, one kernel launch on GPUs.
  ``fp4_grouped(x, group_sizes, w)``: rows of x [A, K] sorted by expert, ``group_sizes`` [E] int, stacked FP4
  experts w [E, N, K] -> [A, N] in x.dtype; rows past ``sum(group_sizes)`` are 0.
  ``fp4_slot_swiglu(x, slot_expert, slot_wts, w1, w3)`` / ``fp4_slot_down(act, slot_expert, w2)``: ONE token's
  routed experts (its top-k picks as slots; decode at batch 1): the clamped SwiGLU of every pick [S, F] in x.dtype,
  then the picks' down projections summed [D] float32 — only the picked experts' packed bytes are read.
  ``fp4_every_swiglu(x, wts, used, w1, w3)`` / ``fp4_every_down(act, used, w2)``: a decode batch x [M <= 64, K] through
  EVERY expert (dense routing weights wts [E, M], 0 where a token did not pick an expert; unused experts not read):
  act [E, M, F] (optionally FP8-rounded for the down projection in the kernel), then the experts' down projections
  summed [M, D] float32 — the routed experts without sort, tile table or scatter.
  ``fp8_round(x)``: the release's GEMM-input FP8 rounding (``ops.quant.fake_quant_gemm_input_fp8``, bit for bit) as
  one kernel on the GPU (XLA: two).

The activations are taken as given: the release's FP8 rounding of a GEMM's input (``ops.linear.Fp8GemmInput``)
happens before (a few KB at decode: in XLA, or on the GPU by ``fp8_round``, or in ``fp4_every_swiglu``'s epilogue),
so the kernels see FP8-grid values in bf16 / float32 — products are exact and only the float32 accumulation order
differs from the reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsv41_jax.checkpoint import names as N
from dsv41_jax.kernels import BACKENDS  # the attention kernels' names: one selection convention
from dsv41_jax.kernels import resolve_backend as _resolve_kernel_backend
from dsv41_jax.ops.linear import matmul_precision


class QuantGemmError(ValueError):
    pass


def resolve_backend(backend: str = "auto") -> str:
    """The attention kernels' resolution (``kernels.resolve_backend``), failing with this module's error type."""
    if backend not in BACKENDS:
        raise QuantGemmError(f"unknown quantized_gemm backend {backend!r}; choose one of {BACKENDS}")
    return _resolve_kernel_backend(backend)


def takes_fp8(w) -> bool:
    """Whether ``fp8_linear``'s kernels take this weight (FP8 32 x 32 blocks, e8m0 byte scales, one matrix)."""
    return (getattr(w, "fmt", None) == N.FP8_BLOCK and len(w.shape) == 2 and tuple(w.block) == (32, 32)
            and w.scales.dtype == jnp.uint8)


def takes_fp4_grouped(w) -> bool:
    """Whether ``fp4_grouped``'s kernels take this weight (stacked FP4 experts [E, N, K], e8m0 byte scales)."""
    return getattr(w, "fmt", None) == N.FP4_ROWS and len(w.shape) == 3 and w.scales.dtype == jnp.uint8


def _check_x(x, k: int, what: str):
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize < 2 or x.dtype == jnp.float16:
        raise QuantGemmError(f"{what}: activations must be bfloat16 or float32, got {x.dtype}")
    if x.shape[-1] != k:
        raise QuantGemmError(f"{what}: activations have {x.shape[-1]} features, the weight takes K = {k}")


def _check_fp8(w):
    if getattr(w, "fmt", None) != N.FP8_BLOCK:
        raise QuantGemmError(f"fp8_linear takes an FP8 block-scaled QuantizedTensor, got "
                             f"{getattr(w, 'fmt', type(w).__name__)}")
    if len(w.shape) != 2:
        raise QuantGemmError(f"fp8_linear: weight must be [N, K], got logical shape {w.shape}")
    nn, k = w.shape
    want_s = (-(-nn // w.block[0]), -(-k // w.block[1]))
    if tuple(w.block) != (32, 32):
        raise QuantGemmError(f"fp8_linear: block scales must be 32 x 32, got {w.block}")
    if w.values.dtype != jnp.uint8 or tuple(w.values.shape) != (nn, k):
        raise QuantGemmError(f"fp8_linear: values must be uint8 e4m3 bytes {(nn, k)}, got {w.values.dtype} "
                             f"{tuple(w.values.shape)}")
    if w.scales.dtype != jnp.uint8 or tuple(w.scales.shape) != want_s:
        raise QuantGemmError(f"fp8_linear: scales must be uint8 e8m0 bytes {want_s}, got {w.scales.dtype} "
                             f"{tuple(w.scales.shape)} (float scale tensors take the reference backend)")


def _check_fp4(w):
    if getattr(w, "fmt", None) != N.FP4_ROWS:
        raise QuantGemmError(f"fp4_grouped takes stacked FP4 experts (QuantizedTensor fmt {N.FP4_ROWS!r}), got "
                             f"{getattr(w, 'fmt', type(w).__name__)}")
    if len(w.shape) != 3:
        raise QuantGemmError(f"fp4_grouped: weight must be [E, N, K], got logical shape {w.shape}")
    e, nn, k = w.shape
    if k % N.FP4_BLOCK:
        raise QuantGemmError(f"fp4_grouped: K = {k} is not a multiple of the scale block {N.FP4_BLOCK}")
    if w.values.dtype != jnp.uint8 or tuple(w.values.shape) != (e, nn, k // 2):
        raise QuantGemmError(f"fp4_grouped: values must be uint8 [E, N, K/2] = {(e, nn, k // 2)}, got "
                             f"{w.values.dtype} {tuple(w.values.shape)}")
    if w.scales.dtype != jnp.uint8 or tuple(w.scales.shape) != (e, nn, k // N.FP4_BLOCK):
        raise QuantGemmError(f"fp4_grouped: scales must be uint8 e8m0 [E, N, K/32] = {(e, nn, k // 32)}, got "
                             f"{w.scales.dtype} {tuple(w.scales.shape)}")


def _check_gpu_addressing(what: str, *arrays):
    """The Pallas Triton lowering computes element offsets in 32-bit signed integers for arrays of at most 4 GiB
    (64-bit above): an array of 2-4 GiB is silently addressed wrong past its first 2 GiB (seen on an H200: the
    experts past 2^31 bytes of a 384-expert 2304 x 5120 FP4 stack read other bytes). Refuse it instead."""
    for a in arrays:
        nbytes = int(a.size) * jnp.dtype(a.dtype).itemsize
        if 2 ** 31 <= nbytes <= 2 ** 32:
            raise QuantGemmError(
                f"{what}: a {tuple(a.shape)} {a.dtype} operand of {nbytes / 2 ** 30:.2f} GiB lies in the 2-4 GiB "
                f"range that the Pallas GPU lowering addresses with 32-bit signed offsets (wrong results); keep "
                f"each device's stack under 2 GiB (e.g. shard the experts over more devices) or use "
                f"backend='reference'")


def fp8_linear(x: jax.Array, w, *, backend: str = "auto", tuning: dict | None = None) -> jax.Array:
    """x [..., K] · w [N, K]ᵀ -> [..., N] (x.dtype) for an FP8 32 x 32 block-scaled QuantizedTensor ``w``."""
    _check_fp8(w)
    _check_x(x, w.shape[1], "fp8_linear")
    be = resolve_backend(backend)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if be == "reference":
        wd = w.dequantize(x.dtype)
        y = jnp.einsum("mi,oi->mo", x2, wd, precision=matmul_precision(x2, wd))
    elif be.startswith("pallas_gpu"):
        from dsv41_jax.kernels import quant_gemm_gpu as G

        _check_gpu_addressing("fp8_linear", w.values, x2)
        y = G.fp8_gemm(x2, w.values, w.scales, interpret=be.endswith("interpret"), **(tuning or {}))
    else:
        from dsv41_jax.kernels import quant_gemm_tpu as T

        y = T.fp8_gemm(x2, w.values, w.scales, interpret=be.endswith("interpret"), **(tuning or {}))
    return y.reshape(lead + (w.shape[0],))


def fp8_linear_fused(x: jax.Array, ws, *, backend: str = "auto", tuning: dict | None = None) -> tuple:
    """Several FP8 projections of ONE input: x [..., K] and FP8 32 x 32 block-scaled QuantizedTensors
    (w_0 [N_0, K], w_1 [N_1, K], ...) -> (x · w_0ᵀ [..., N_0], ...) in x.dtype, each as ``fp8_linear`` computes it.

    On ``pallas_gpu`` one kernel launch streams all the weights (``quant_gemm_gpu.fp8_gemm_fused``: at decode a
    single projection is too short a stream to approach HBM bandwidth); ``reference`` dequantises each weight and
    runs one GEMM each; ``pallas_tpu`` has no fused kernel yet and runs its FP8 kernel once per weight."""
    ws = tuple(ws)
    if not ws:
        raise QuantGemmError("fp8_linear_fused: no weights given")
    for i, w in enumerate(ws):
        try:
            _check_fp8(w)
        except QuantGemmError as e:
            raise QuantGemmError(f"fp8_linear_fused weight {i}: {e}") from None
    k = ws[0].shape[1]
    other = [(i, w.shape) for i, w in enumerate(ws) if w.shape[1] != k]
    if other:
        raise QuantGemmError(f"fp8_linear_fused: the weights must share K (one input); weight 0 takes K = {k}, "
                             f"weights {[i for i, _ in other]} have shapes {[s for _, s in other]}")
    _check_x(x, k, "fp8_linear_fused")
    be = resolve_backend(backend)
    if not be.startswith("pallas_gpu"):
        return tuple(fp8_linear(x, w, backend=be, tuning=tuning) for w in ws)
    from dsv41_jax.kernels import quant_gemm_gpu as G

    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    _check_gpu_addressing("fp8_linear_fused", x2, *(w.values for w in ws))
    ys = G.fp8_gemm_fused(x2, tuple((w.values, w.scales) for w in ws), interpret=be.endswith("interpret"),
                          **(tuning or {}))
    return tuple(y.reshape(lead + (w.shape[0],)) for y, w in zip(ys, ws))


def fp4_grouped(x: jax.Array, group_sizes: jax.Array, w, *, backend: str = "auto",
                tuning: dict | None = None) -> jax.Array:
    """Grouped GEMM over stacked FP4 experts: x [A, K] sorted by expert, group_sizes [E] -> [A, N] (x.dtype).
    On ``pallas_gpu`` without a ``decode`` in ``tuning``, the "weights" form's decode follows ``w.scale_max``
    (``quant_gemm_gpu.fp4_grouped_decode``: "bf16x1" for weights whose scale bytes are known to be <= 128)."""
    _check_fp4(w)
    _check_x(x, w.shape[2], "fp4_grouped")
    if x.ndim != 2:
        raise QuantGemmError(f"fp4_grouped: x must be [rows, K], got shape {x.shape}")
    if group_sizes.ndim != 1 or group_sizes.shape[0] != w.shape[0] or not jnp.issubdtype(group_sizes.dtype,
                                                                                            jnp.integer):
        raise QuantGemmError(f"fp4_grouped: group_sizes must be an integer vector of {w.shape[0]} experts, got "
                             f"{group_sizes.dtype} {tuple(group_sizes.shape)}")
    be = resolve_backend(backend)
    gs = group_sizes.astype(jnp.int32)
    if be == "reference":
        wd = w.dequantize(x.dtype)
        y = jax.lax.ragged_dot(x, jnp.swapaxes(wd, 1, 2), gs, precision=matmul_precision(x, wd))
        return jnp.where((jnp.arange(x.shape[0]) < jnp.sum(gs))[:, None], y, jnp.zeros((), y.dtype))
    if be.startswith("pallas_gpu"):
        from dsv41_jax.kernels import quant_gemm_gpu as G

        _check_gpu_addressing("fp4_grouped", w.values, w.scales, x)
        tuning = dict(tuning or {})
        if tuning.get("mma") in (None, "bf16") and "decode" not in tuning:  # an asked-for decode wins
            # the one-multiply decode where the weights' recorded scale bytes allow it exactly, else the default
            tuning["decode"] = G.fp4_grouped_decode(getattr(w, "scale_max", None))
        return G.fp4_grouped_gemm(x, gs, w.values, w.scales, interpret=be.endswith("interpret"), **tuning)
    from dsv41_jax.kernels import quant_gemm_tpu as T

    return T.fp4_grouped_gemm(x, gs, w.values, w.scales, interpret=be.endswith("interpret"), **(tuning or {}))


def _check_slots(what: str, slot_expert, slot_wts=None):
    if slot_expert.ndim != 1 or not jnp.issubdtype(slot_expert.dtype, jnp.integer):
        raise QuantGemmError(f"{what}: slot_expert must be an integer vector (one expert id per slot), got "
                             f"{slot_expert.dtype} {tuple(slot_expert.shape)}")
    if slot_wts is not None and tuple(slot_wts.shape) != tuple(slot_expert.shape):
        raise QuantGemmError(f"{what}: slot_wts {tuple(slot_wts.shape)} must match slot_expert "
                             f"{tuple(slot_expert.shape)} (one routing weight per slot)")


def _slot_backend(what: str, backend: str) -> str:
    be = resolve_backend(backend)
    if be.startswith("pallas_tpu"):
        raise QuantGemmError(f"{what}: no TPU kernel for these FP4 expert kernels yet; use fp4_grouped (the grouped "
                             f"Mosaic kernel) or backend='reference'")
    return be


def _slot_tuning(tuning: dict | None) -> dict:
    """The slot kernels' tiling overrides with the decode form named (the module default when not given), so that
    programs traced under different defaults never share a cached kernel trace."""
    from dsv41_jax.kernels import quant_gemm_gpu as G

    t = dict(tuning or {})
    t.setdefault("decode", G.FP4_SLOT_DEFAULT_DECODE)
    return t


def _picked(w, slot_expert, dtype):
    """The picked experts of stacked FP4 experts, dequantised exactly: [S, N, K] in ``dtype``."""
    sub = dataclasses.replace(w, values=w.values[slot_expert], scales=w.scales[slot_expert],
                              shape=(int(slot_expert.shape[0]),) + tuple(w.shape[1:]))
    return sub.dequantize(dtype)


def _check_gate_up(what: str, w1, w3):
    """The gate / up experts of a SwiGLU kernel: both stacked FP4 experts of one shape."""
    for nm, w in (("w1", w1), ("w3", w3)):
        try:
            _check_fp4(w)
        except QuantGemmError as e:
            raise QuantGemmError(f"{what} {nm}: {e}") from None
    if tuple(w1.shape) != tuple(w3.shape):
        raise QuantGemmError(f"{what}: w1 {w1.shape} and w3 {w3.shape} must have one shape")


def fp4_slot_swiglu(x: jax.Array, slot_expert: jax.Array, slot_wts: jax.Array, w1, w3, *, limit: float,
                    backend: str = "auto", tuning: dict | None = None) -> jax.Array:
    """One token x [K] through its picked experts' gate / up projections: -> act [S, F] in x.dtype,
    ``silu(min(g, limit)) * clip(u, ±limit) * slot_wts[s]`` with g = x·w1[e_s]ᵀ, u = x·w3[e_s]ᵀ rounded to x.dtype
    (as ``fp4_grouped`` returns them). w1 / w3: stacked FP4 experts [E, F, K]."""
    _check_gate_up("fp4_slot_swiglu", w1, w3)
    if x.ndim != 1:
        raise QuantGemmError(f"fp4_slot_swiglu: x must be one token's features [K], got shape {x.shape}")
    _check_x(x, w1.shape[2], "fp4_slot_swiglu")
    _check_slots("fp4_slot_swiglu", slot_expert, slot_wts)
    be = _slot_backend("fp4_slot_swiglu", backend)
    if be == "reference":
        def proj(w):
            wd = _picked(w, slot_expert, x.dtype)
            y = jnp.einsum("i,soi->so", x, wd, precision=matmul_precision(x, wd))
            return y.astype(x.dtype).astype(jnp.float32)

        g, u = proj(w1), proj(w3)
        if limit > 0:
            u = jnp.clip(u, -limit, limit)
            g = jnp.minimum(g, limit)
        return (jax.nn.silu(g) * u * slot_wts.astype(jnp.float32)[:, None]).astype(x.dtype)
    from dsv41_jax.kernels import quant_gemm_gpu as G

    _check_gpu_addressing("fp4_slot_swiglu", w1.values, w1.scales, w3.values, w3.scales)
    return G.fp4_slot_swiglu(x, slot_expert, slot_wts, w1.values, w1.scales, w3.values, w3.scales,
                             limit=float(limit), interpret=be.endswith("interpret"), **_slot_tuning(tuning))


def fp4_slot_down(act: jax.Array, slot_expert: jax.Array, w2, *, backend: str = "auto",
                  tuning: dict | None = None) -> jax.Array:
    """The picked experts' down projections of one token, summed: act [S, F] (row s for expert slot_expert[s]),
    stacked FP4 experts w2 [E, D, F] -> [D] float32; each slot's product is rounded to act.dtype before the sum (as
    ``fp4_grouped`` returns its rows)."""
    _check_fp4(w2)
    if act.ndim != 2 or act.shape[0] != slot_expert.shape[0]:
        raise QuantGemmError(f"fp4_slot_down: act must be [slots, F] with one row per slot "
                             f"({tuple(slot_expert.shape)}), got shape {act.shape}")
    _check_x(act, w2.shape[2], "fp4_slot_down")
    _check_slots("fp4_slot_down", slot_expert)
    be = _slot_backend("fp4_slot_down", backend)
    if be == "reference":
        wd = _picked(w2, slot_expert, act.dtype)
        y = jnp.einsum("si,soi->so", act, wd, precision=matmul_precision(act, wd))
        return jnp.sum(y.astype(act.dtype).astype(jnp.float32), axis=0)
    from dsv41_jax.kernels import quant_gemm_gpu as G

    _check_gpu_addressing("fp4_slot_down", w2.values, w2.scales)
    return G.fp4_slot_down(act, slot_expert, w2.values, w2.scales, interpret=be.endswith("interpret"),
                           **_slot_tuning(tuning))


def _check_every(what: str, m: int, n_exp: int, wts=None, used=None):
    from dsv41_jax.kernels.quant_gemm_gpu import EVERY_EXPERT_MAX_TOKENS

    if not 1 <= m <= EVERY_EXPERT_MAX_TOKENS:
        raise QuantGemmError(f"{what}: takes 1..{EVERY_EXPERT_MAX_TOKENS} tokens (one token tile), got {m}")
    if wts is not None and tuple(wts.shape) != (n_exp, m):
        raise QuantGemmError(f"{what}: wts must be [E, M] = {(n_exp, m)} (one routing weight per expert and token, "
                             f"0 where the token did not pick the expert), got {tuple(wts.shape)}")
    if used is not None and (tuple(used.shape) != (n_exp,) or not jnp.issubdtype(used.dtype, jnp.integer)):
        raise QuantGemmError(f"{what}: used must be an integer vector of {n_exp} experts, got {used.dtype} "
                             f"{tuple(used.shape)}")


def fp4_every_swiglu(x: jax.Array, wts: jax.Array, used: jax.Array, w1, w3, *, limit: float, round_fp8: bool = False,
                     backend: str = "auto", tuning: dict | None = None) -> jax.Array:
    """Every expert's gate / up projections of a decode batch x [M, K] -> act [E, M, F] in x.dtype:
    ``silu(min(g, limit)) * clip(u, ±limit) * wts[e, t]`` with g = x·w1[e]ᵀ, u = x·w3[e]ᵀ rounded to x.dtype (as
    ``fp4_grouped`` returns them), exactly 0 where ``wts[e, t] = 0`` and for experts with ``used[e] = 0`` (not read
    on the GPU). wts float32 [E, M]: token t's routing weight for expert e; w1 / w3 stacked FP4 experts [E, F, K].
    ``round_fp8``: act then rounded to FP8 per 32 of F as the down projection's input (``ops.quant.
    fake_quant_gemm_input_fp8``, bit for bit; on the GPU in the kernel's epilogue)."""
    _check_gate_up("fp4_every_swiglu", w1, w3)
    if x.ndim != 2:
        raise QuantGemmError(f"fp4_every_swiglu: x must be [tokens, K], got shape {x.shape}")
    _check_x(x, w1.shape[2], "fp4_every_swiglu")
    _check_every("fp4_every_swiglu", x.shape[0], w1.shape[0], wts, used)
    be = _slot_backend("fp4_every_swiglu", backend)
    if be == "reference":
        def proj(w):
            wd = w.dequantize(x.dtype)
            y = jnp.einsum("mi,eoi->emo", x, wd, precision=matmul_precision(x, wd))
            return y.astype(x.dtype).astype(jnp.float32)

        g, u = proj(w1), proj(w3)
        if limit > 0:
            u = jnp.clip(u, -limit, limit)
            g = jnp.minimum(g, limit)
        wt = wts.astype(jnp.float32)[:, :, None]
        act = jnp.where((wt != 0) & (used[:, None, None] != 0), jax.nn.silu(g) * u * wt, 0.0).astype(x.dtype)
        if round_fp8:
            from dsv41_jax.ops.quant import fake_quant_gemm_input_fp8

            act = fake_quant_gemm_input_fp8(act, 32)
        return act
    from dsv41_jax.kernels import quant_gemm_gpu as G

    _check_gpu_addressing("fp4_every_swiglu", w1.values, w1.scales, w3.values, w3.scales)
    return G.fp4_every_swiglu(x, wts, used, w1.values, w1.scales, w3.values, w3.scales, limit=float(limit),
                              round_fp8=round_fp8, interpret=be.endswith("interpret"), **(tuning or {}))


def fp4_every_down(act: jax.Array, used: jax.Array, w2, *, backend: str = "auto",
                   tuning: dict | None = None) -> jax.Array:
    """Every used expert's down projection of a decode batch, summed: act [E, M, F] (expert e's activations of every
    token), used [E] int, stacked FP4 experts w2 [E, D, F] -> [M, D] float32; each expert's product rounded to
    act.dtype before the sum (as ``fp4_grouped`` returns its rows); unused experts add nothing (not read on the
    GPU). On the GPU the experts' products are added in no fixed order (float32 atomic adds)."""
    _check_fp4(w2)
    if act.ndim != 3 or act.shape[0] != w2.shape[0]:
        raise QuantGemmError(f"fp4_every_down: act must be [E, tokens, F] with E = {w2.shape[0]}, got shape "
                             f"{act.shape}")
    _check_x(act, w2.shape[2], "fp4_every_down")
    _check_every("fp4_every_down", act.shape[1], w2.shape[0], used=used)
    be = _slot_backend("fp4_every_down", backend)
    if be == "reference":
        wd = w2.dequantize(act.dtype)
        y = jnp.einsum("emi,eoi->emo", act, wd, precision=matmul_precision(act, wd))
        y = jnp.where(used[:, None, None] != 0, y.astype(act.dtype).astype(jnp.float32), 0.0)
        return jnp.sum(y, axis=0)
    from dsv41_jax.kernels import quant_gemm_gpu as G

    _check_gpu_addressing("fp4_every_down", w2.values, w2.scales)
    return G.fp4_every_down(act, used, w2.values, w2.scales, interpret=be.endswith("interpret"), **(tuning or {}))


def fp8_round(x: jax.Array, *, split: bool = False, backend: str = "auto"):
    """The release's GEMM-input rounding x [..., K] -> x.dtype (``ops.quant.fake_quant_gemm_input_fp8(x, 32)``, the
    same values bit for bit — blocks holding a NaN included where the reference's maximum propagates it, as XLA's
    GPU reduction does), on ``pallas_gpu`` as ONE kernel (``quant_gemm_gpu.fp8_round_rows``; XLA: two). ``split``:
    the (even, odd) columns [..., K/2] each instead (the FP4 weights-as-rows kernels' activation layout)."""
    from dsv41_jax.ops.quant import fake_quant_gemm_input_fp8

    be = resolve_backend(backend)
    if x.shape[-1] % 32 or x.dtype not in (jnp.bfloat16, jnp.float32):
        raise QuantGemmError(f"fp8_round: x must be bfloat16 / float32 with K a multiple of 32, got {x.dtype} "
                             f"{tuple(x.shape)}")
    if be.startswith("pallas_gpu"):
        from dsv41_jax.kernels import quant_gemm_gpu as G

        lead, k = x.shape[:-1], x.shape[-1]
        y = G.fp8_round_rows(x.reshape(-1, k), split=split, interpret=be.endswith("interpret"))
        return tuple(a.reshape(lead + (k // 2,)) for a in y) if split else y.reshape(x.shape)
    y = fake_quant_gemm_input_fp8(x, 32)
    return (y[..., 0::2], y[..., 1::2]) if split else y


__all__ = ["BACKENDS", "resolve_backend", "fp8_linear", "fp8_linear_fused", "fp4_grouped", "fp4_slot_swiglu",
           "fp4_slot_down", "fp4_every_swiglu", "fp4_every_down", "fp8_round", "takes_fp8", "takes_fp4_grouped",
           "QuantGemmError"]
