"""Weights in the release's precision as a parameter form (SPEC §5, §12).

The release stores attention, shared-expert, indexer-query and Engram projections FP8 (e4m3, 32 x 32 blocks, ue8m0
scales), routed experts FP4 (e2m1, ue8m0 scale per 32 along K) and Engram tables FP8 (one scale per 32 of a row);
the official inference code rounds the input of every FP8 / FP4 GEMM to FP8 per 32 (``act_quant``). Here:

* :func:`quantize_params` turns float parameters into :class:`~dsv41_jax.checkpoint.quantized.QuantizedTensor`
  leaves in those formats (``load_checkpoint(..., keep_quantized=True)`` produces the same leaves from a release
  checkpoint); :func:`dequantize_params` is the exact inverse view (the "dequantised weights").
* :func:`mark_fp8_gemm_inputs` wraps the weights of exactly the release's FP8 / FP4 GEMMs in
  :class:`~dsv41_jax.ops.linear.Fp8GemmInput`, so :func:`~dsv41_jax.ops.linear.linear` rounds their inputs —
  whether the weight is a float array (the fake-quantised reference) or a QuantizedTensor (release serving).
  ``wo_a`` is stored FP8 but the official code dequantises it to bf16 at load: its GEMM is not an FP8 GEMM.
* :func:`dequantize_wo_a` is that load-time step, the one home of the release's *serving* form of ``wo_a``:
  ``Engine(weights="release")`` serves it (the official inference code declares ``wo_a`` a bf16
  ``ColumnParallelLinear`` in ``inference/model.py`` and its ``convert.py`` writes it as the FP8 values times their
  block scales in float32, cast once to bf16; its GEMM has no FP8 input rounding). The
  per-step dequantisation of a QuantizedTensor ``wo_a`` (``ops.attention.attention_output``) computes the same
  values, but inside every step: one XLA reduce fusion per layer at 9 % of the H200's bandwidth (RESULTS.md).
* :func:`release_shardings` places QuantizedTensor leaves by the parameters' logical-axis rules; the spec is
  derived from the scale grid and used for values and scales alike, so a shard always holds whole scale blocks
  (and whole bytes of packed FP4 pairs) — packing along K is never split.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from dsv41_jax.checkpoint import names as N
from dsv41_jax.checkpoint import quantized as QZ
from dsv41_jax.config import ModelConfig
from dsv41_jax.model.params import flat_specs
from dsv41_jax.ops.linear import Fp8GemmInput, LoraWeight

WEIGHT_FORMS = ("bf16", "release")


def _is_leaf(x) -> bool:
    return isinstance(x, (QZ.QuantizedTensor, Fp8GemmInput, LoraWeight))


def storage_formats(config: ModelConfig, *, include_dspark: bool = True) -> dict[str, str]:
    """Parameter path ('layers/3/attn/wq_a', 'dspark/blocks/0/attn/wkv') -> the release's storage format
    (``names.FP8_BLOCK`` ...); the DSpark drafter's paths too when the config has it."""
    out = {}
    for path, spec in flat_specs(config, include_dspark=include_dspark):
        module = N.to_release(spec.hf_name.replace("{e}", "0"))
        module = module[: -len(".weight")] if module.endswith(".weight") else module
        out[path] = N.storage_format(module)
    return out


def served_in_float(path: str) -> bool:
    """A tensor the release stores quantised but serves in float (dequantised once, at load): the attention's grouped
    output projection ``wo_a`` (main layers, MTP and DSpark blocks alike)."""
    return path.endswith("/attn/wo_a")


def fp8_gemm_paths(config: ModelConfig) -> frozenset[str]:
    """Paths of the weights whose GEMM the release runs in FP8 / FP4 (its input rounded to FP8 per 32)."""
    return frozenset(p for p, f in storage_formats(config).items()
                     if f in (N.FP8_BLOCK, N.FP4_ROWS) and not served_in_float(p))


def _map_with_path(fn, params):
    def visit(path, leaf):
        return fn("/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), leaf)

    return jax.tree_util.tree_map_with_path(visit, params, is_leaf=_is_leaf)


def mark_fp8_gemm_inputs(params: dict, config: ModelConfig, gemm: str = "reference", tuning: tuple = (),
                         round_kernel: bool = False) -> dict:
    """The same parameters with the release's FP8 / FP4 GEMM weights wrapped in ``Fp8GemmInput`` (free under jit:
    a pytree restructure). ``gemm``: how their QuantizedTensor GEMMs run (``Fp8GemmInput.gemm``: "reference" or a
    ``kernels.quant_gemm`` backend); ``tuning``: the FP8 dense kernel's (name, value) pairs
    (``Fp8GemmInput.tuning``); ``round_kernel``: their inputs rounded by one Pallas kernel on the GPU
    (``Fp8GemmInput.round_kernel``)."""
    from dsv41_jax.kernels.quant_gemm import resolve_backend

    resolve_backend(gemm)  # an unknown name fails here, not deep in a trace
    paths = fp8_gemm_paths(config)

    def mark(w):
        if isinstance(w, LoraWeight):  # the release's rounding belongs to the base GEMM; the adapter reads x as is
            return dataclasses.replace(w, base=mark(w.base))
        return Fp8GemmInput(w.weight if isinstance(w, Fp8GemmInput) else w, gemm, tuple(tuning), bool(round_kernel))

    return _map_with_path(lambda p, w: mark(w) if p in paths else w, params)


def _quantize(w: np.ndarray, fmt: str) -> QZ.QuantizedTensor:
    w = np.asarray(w, np.float32)
    lead, (o, i) = w.shape[:-2], w.shape[-2:]
    if fmt == N.FP8_BLOCK:  # 32 x 32 blocks: one matrix at a time
        parts = [QZ.quantize_fp8_block(m) for m in w.reshape((-1, o, i))]
        values, scales = np.stack([QZ.as_uint8(v) for v, _ in parts]), np.stack([QZ.as_uint8(s) for _, s in parts])
        block = QZ.FP8_BLOCK_SHAPE
    else:  # one scale per 32 of a row: stacked experts quantise as one [E * out, in] matrix
        quantizer = QZ.quantize_fp4_rows if fmt == N.FP4_ROWS else QZ.quantize_engram_rows
        values, scales = (QZ.as_uint8(a) for a in quantizer(w.reshape(-1, i)))
        block = (1, N.FP4_BLOCK if fmt == N.FP4_ROWS else N.ENGRAM_BLOCK)
    values = values.reshape(lead + (o, -1))
    scales = scales.reshape(lead + (scales.shape[-2] if fmt == N.FP8_BLOCK else o, -1))
    # the FP4 experts' largest scale byte, on the host once (the grouped FP4 GEMM picks its decode by it)
    scale_max = QZ.scale_byte_max(scales) if fmt == N.FP4_ROWS else None
    return QZ.QuantizedTensor(jnp.asarray(values), jnp.asarray(scales), fmt, tuple(w.shape), block, scale_max)


def quantize_params(params: dict, config: ModelConfig) -> dict:
    """Float parameters -> the release's storage forms (QuantizedTensor leaves for its FP8 / FP4 tensors; every
    other parameter unchanged). Host-side, once, before serving."""
    formats = storage_formats(config)
    shapes = {p: tuple(s.shape) for p, s in flat_specs(config, include_dspark=True)}

    def one(path, w):
        fmt = formats.get(path, N.FLOAT)
        if fmt == N.FLOAT or isinstance(w, QZ.QuantizedTensor):
            return w
        if tuple(w.shape) != shapes[path]:
            raise ValueError(f"parameter {path}: shape {tuple(w.shape)} (padded?) cannot be quantised; quantise "
                             "before padding / sharding")
        return _quantize(np.asarray(jax.device_get(w), np.float32), fmt)

    return _map_with_path(one, params)


def dequantize_params(params: dict, dtype=jnp.float32) -> dict:
    """QuantizedTensor leaves -> exact float arrays in ``dtype`` (markers dropped; other leaves unchanged)."""
    def one(_, w):
        if isinstance(w, Fp8GemmInput):
            w = w.weight
        return QZ.dequantize(w, dtype) if isinstance(w, QZ.QuantizedTensor) else w

    return _map_with_path(one, params)


def exact_scale_exponents(dtype) -> tuple[int, int]:
    """The e8m0 scale exponents ``k`` for which every product ``e4m3 * 2^k`` is a normal ``dtype`` number or zero,
    i.e. exact: an e4m3 value has at most 4 significant bits (normals 1.xxx * 2^-6..2^8, subnormals m * 2^-9 with
    m < 8), ``dtype`` keeps >= 4 (bf16 8, float32 24), so the product is exact unless its smallest bit 2^(k-9) falls
    below ``dtype``'s smallest normal or 448 * 2^k overflows. bf16 and float32: k in [-117, 119]."""
    f = jnp.finfo(dtype)
    if f.nmant < 3:
        raise ValueError(f"{jnp.dtype(dtype)} has {f.nmant} mantissa bits: e4m3 values are not exact in it")
    return f.minexp + 9, f.maxexp - 1 - 8


def dequantize_served(qt: QZ.QuantizedTensor, dtype=jnp.bfloat16, *, what: str = "wo_a") -> jax.Array:
    """An FP8 block-scaled weight as the official code serves it: values times block scales in float32, one cast to
    ``dtype`` (round to nearest even). With e8m0 scales (powers of two) inside :func:`exact_scale_exponents` — every
    released ``wo_a`` — the result is exact, and computed on device by the same jittable ``QuantizedTensor.dequantize``
    the per-step path runs (so serving from load changes no bit of the forward). Otherwise (float scales of
    V4-Flash-Base style, or exponents whose products are subnormal / overflow in ``dtype``) the product is rounded
    once, on the host (numpy keeps subnormals; ml_dtypes rounds as torch's ``.bfloat16()``), where XLA may flush
    subnormals; the result keeps the values' placement."""
    if not isinstance(qt, QZ.QuantizedTensor) or qt.fmt != N.FP8_BLOCK or len(qt.shape) != 2:
        got = f"{qt.fmt} {qt.shape}" if isinstance(qt, QZ.QuantizedTensor) else type(qt).__name__
        raise ValueError(f"{what}: expected a 2-D FP8 block-scaled QuantizedTensor, got {got}")
    dtype = jnp.dtype(dtype)
    if qt.scales.dtype == jnp.uint8:
        lo, hi = exact_scale_exponents(dtype)
        k = np.asarray(jax.device_get(qt.scales)).astype(np.int32) - QZ.E8M0_BIAS  # 1/1024 of the values' bytes
        if k.size == 0 or (k.min() >= lo and k.max() <= hi):
            return QZ.dequantize(qt, dtype)
    host = QZ.cast(QZ.dequant_fp8_block(np.asarray(jax.device_get(qt.values)), np.asarray(jax.device_get(qt.scales)),
                                        qt.block), dtype)
    sharding = getattr(qt.values, "sharding", None)
    return jax.device_put(host, sharding) if isinstance(sharding, NamedSharding) else jnp.asarray(host)


def dequantize_wo_a(params: dict, dtype=jnp.bfloat16) -> dict:
    """The release's serving form: every ``wo_a`` QuantizedTensor (:func:`served_in_float`) replaced, once, by its
    dequantised ``dtype`` array (:func:`dequantize_served`); every other leaf unchanged. ``dtype``: bf16 as the
    official code (a float32 model keeps float32: the same values, exact in both). Device bytes of ``wo_a`` go from
    1 + 1/1024 per weight (FP8 + e8m0 scales) to 2 (bf16): +33.5 MB per layer of the full release."""
    return _map_with_path(lambda p, w: dequantize_served(w, dtype, what=p)
                          if served_in_float(p) and isinstance(w, QZ.QuantizedTensor) else w, params)


def weight_bytes(params) -> int:
    """Bytes the parameters hold (values + scales of QuantizedTensor leaves)."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(params)))


def stored_bytes(shape: tuple[int, ...], fmt: str, float_itemsize: int = 2) -> int:
    """Bytes one parameter holds in a storage format (values + scales; ``float_itemsize`` for FLOAT)."""
    lead = int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) > 2 else 1
    if fmt == N.FLOAT:
        return int(np.prod(shape, dtype=np.int64)) * float_itemsize
    o, i = shape[-2:]
    if fmt == N.FP8_BLOCK:
        bo, bi = QZ.FP8_BLOCK_SHAPE
        return lead * (o * i + -(-o // bo) * -(-i // bi))
    if fmt == N.FP4_ROWS:
        return lead * (o * i // 2 + o * i // N.FP4_BLOCK)
    return lead * (o * i + o * i // N.ENGRAM_BLOCK)  # ENGRAM_ROWS


def weight_footprint(config: ModelConfig, weights: str = "release", dtype=jnp.bfloat16) -> dict[str, int]:
    """Bytes of the parameters by component (``names.COMPONENTS``) from shapes alone: ``weights="release"`` — the
    release's serving forms (what ``Engine(weights="release")`` holds): FP8 / FP4, but ``wo_a`` in ``dtype`` as it is
    dequantised at load (:func:`dequantize_wo_a`), other tensors in ``dtype`` (float32 ones stay float32);
    ``"bf16"`` — all ``dtype``."""
    if weights not in WEIGHT_FORMS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMS}, got {weights!r}")
    from dsv41_jax.model.params import FP32

    formats = storage_formats(config)
    out: dict[str, int] = {}
    for path, spec in flat_specs(config):
        fmt = formats[path] if weights == "release" and not served_in_float(path) else N.FLOAT
        item = 4 if spec.dtype == FP32 else jnp.dtype(dtype).itemsize
        comp = N.component(N.to_release(spec.hf_name.replace("{e}", "0")))
        out[comp] = out.get(comp, 0) + stored_bytes(spec.shape, fmt, item)
    return out


def quantized_partition_spec(qt: QZ.QuantizedTensor, axes, mesh, rules):
    """One PartitionSpec for a QuantizedTensor's values and scales, from its logical axes and its scale grid: a
    dim is split only where the mesh divides the number of scale blocks, so every shard holds whole blocks."""
    from dsv41_jax.parallel.rules import get_rules, logical_to_spec

    return logical_to_spec(axes, mesh, get_rules(rules), qt.scales.shape, strict=False,
                           what=f"quantised {qt.fmt} {qt.shape}")


def release_shardings(params: dict, config: ModelConfig, mesh, rules="tp") -> dict:
    """A sharding tree for parameters that hold QuantizedTensor leaves (float leaves: the usual rules)."""
    from dsv41_jax.parallel.api import param_shardings

    float_sh = {p: s for p, s in _flat(param_shardings(config, mesh, rules))}
    axes = dict((p, s.axes) for p, s in flat_specs(config))

    def one(path, w):
        if isinstance(w, QZ.QuantizedTensor):
            sh = NamedSharding(mesh, quantized_partition_spec(w, axes[path], mesh, rules))
            return dataclasses.replace(w, values=sh, scales=sh)  # the static fields (scale_max) as the params
        return float_sh[path]

    return _map_with_path(one, params)


def _flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
    return [("/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), leaf) for path, leaf in leaves]


__all__ = ["WEIGHT_FORMS", "storage_formats", "served_in_float", "fp8_gemm_paths", "mark_fp8_gemm_inputs",
           "quantize_params", "dequantize_params", "exact_scale_exponents", "dequantize_served", "dequantize_wo_a",
           "weight_bytes", "stored_bytes", "weight_footprint", "quantized_partition_spec", "release_shardings"]
