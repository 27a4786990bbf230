"""Write a model as a checkpoint in the release's exact format (test / benchmark utility).

Names of the official module tree, storage dtypes, scale shapes and packing as published (``names.FORMATS``):
FP8 e4m3 weights with e8m0 32×32 block scales, routed experts as int8 bytes holding two e2m1 codes (even element in
the low nibble) with e8m0 scales per 32 inputs, Engram tables e4m3 with e8m0 scales per 32 values of a row, bf16 for
the other weights and float32 for mHC, sinks and router biases; several ``model-0000k-of-0000N.safetensors`` shards
plus ``model.safetensors.index.json``; a composite ``config.json`` with ``quantization_config``.

:func:`write_release_checkpoint` quantises real parameters with the release's quantisers
(:mod:`dsv41_jax.checkpoint.quantized`) and returns the parameters a correct reader must produce, computed by an
independent route: FP4 and Engram tables through :mod:`dsv41_jax.ops.quant`'s fake quantisers (the official
activation-quantiser rules), FP8 blocks through the on-device :func:`~dsv41_jax.checkpoint.quantized.dequantize`.
:func:`write_synthetic_release` writes random valid codes for large benchmark checkpoints without any quantisation
work (constant memory: chunks cut at random offsets from one pool of random codes per dtype).
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41_jax.checkpoint import names as N
from dsv41_jax.checkpoint import quantized as QZ
from dsv41_jax.checkpoint.safetensors_io import INDEX_FILE, StreamingWriter
from dsv41_jax.config import ModelConfig, ceil_div
from dsv41_jax.model.params import FP32, ParamSpec, flat_specs
from dsv41_jax.ops import quant as ops_quant

QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
                       "weight_block_size": [32, 32]}


def release_config_json(config: ModelConfig, *, quantized: bool = True) -> dict:
    """The composite HF-style ``config.json`` of the release (``text_config`` + top-level ``quantization_config``)."""
    text = config.to_hf_dict()
    d = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
         "dtype": "bfloat16", "tie_word_embeddings": False}
    if quantized:
        d["quantization_config"] = dict(QUANTIZATION_CONFIG)
        d["expert_dtype"] = "fp4"
    return d


# ----------------------------------------------------------------------------------------------------------------
# one entry per stored tensor: (name, safetensors dtype, storage shape, producer of the array)
# ----------------------------------------------------------------------------------------------------------------

_fake_fp4 = jax.jit(lambda w: ops_quant.fake_quant_fp4_e2m1_block(w, N.FP4_BLOCK, "ue8m0"))
_fake_fp8_rows = jax.jit(lambda w: ops_quant.fake_quant_fp8_e4m3_block(w, N.ENGRAM_BLOCK))

Entry = tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]


def _module(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _entries_for(name: str, spec: ParamSpec, shape: tuple, get: Callable[[], np.ndarray], naming: str,
                 quantize: bool, reference: dict, ref_key) -> list[Entry]:
    """Stored tensors for one logical tensor ``name`` (release naming) of ``shape``; ``get`` returns float32 values.
    Fills ``reference[ref_key]`` with what a reader must produce (float32)."""
    fmt = N.storage_format(_module(name)) if quantize else N.FLOAT
    out_name = N.to_hf(name) if naming == N.HF else name
    module = _module(out_name)
    if fmt == N.FLOAT:
        def produce():
            w = get()
            if spec.dtype == FP32:
                reference[ref_key] = w.astype(np.float32)
                return w.astype(np.float32)
            b = w.astype(ml_dtypes.bfloat16)
            reference[ref_key] = b.astype(np.float32)
            return b
        return [(out_name, "F32" if spec.dtype == FP32 else "BF16", tuple(shape), produce)]
    cache: dict = {}

    def quantized():
        if not cache:
            w = np.asarray(get(), np.float32)
            if fmt == N.FP8_BLOCK:
                v, s = QZ.quantize_fp8_block(w)
                ref = QZ.dequantize(QZ.QuantizedTensor(jnp.asarray(v.view(np.uint8)), jnp.asarray(s.view(np.uint8)),
                                                       fmt, tuple(w.shape)))
            elif fmt == N.FP4_ROWS:
                v, s = QZ.quantize_fp4_rows(w)
                v = v.view(np.int8)  # the release stores the packed bytes as I8
                ref = _fake_fp4(jnp.asarray(w))
            else:
                v, s = QZ.quantize_engram_rows(w)
                ref = _fake_fp8_rows(jnp.asarray(w))
            reference[ref_key] = np.asarray(ref, np.float32)
            cache["v"], cache["s"] = v, s
        return cache

    out, inp = shape
    if fmt == N.FP8_BLOCK:
        vshape, vdtype, sshape = (out, inp), "F8_E4M3", (ceil_div(out, 32), ceil_div(inp, 32))
    elif fmt == N.FP4_ROWS:
        vshape, vdtype, sshape = (out, inp // 2), "I8", (out, inp // N.FP4_BLOCK)
    else:
        vshape, vdtype, sshape = (out, inp), "F8_E4M3", (out, inp // N.ENGRAM_BLOCK)
    # the weight is produced first, then its scale; each pops its part so nothing stays cached after both
    return [(module + ".weight", vdtype, vshape, lambda: quantized().pop("v")),
            (module + ".scale", "F8_E8M0", sshape, lambda: quantized().pop("s"))]


def _leaf(params, path: str):
    node = params
    for k in path.split("/"):
        node = node[int(k)] if isinstance(node, (list, tuple)) else node[k]
    return node


def _shard_plan(entries: list[Entry], n_shards: int | None, shard_bytes: int | None) -> list[list[Entry]]:
    sizes = [math.prod(e[2]) * (4 if e[1] == "F32" else 2 if e[1] == "BF16" else 1) for e in entries]
    total = sum(sizes)
    target = shard_bytes if shard_bytes else max(1, -(-total // max(1, n_shards or 1)))
    shards: list[list[Entry]] = [[]]
    acc = 0
    for e, n in zip(entries, sizes):
        # a weight and its scale stay together: only start a new shard at a weight
        if acc + n > target and shards[-1] and not e[0].endswith(".scale"):
            shards.append([])
            acc = 0
        shards[-1].append(e)
        acc += n
    return shards


def write_shards(directory: str, entries: list[Entry], config_json: dict, *, n_shards: int | None = 3,
                 shard_bytes: int | None = None) -> list[str]:
    """Write entries as ``model-0000k-of-0000N.safetensors`` + index + config.json; returns the shard paths."""
    os.makedirs(directory, exist_ok=True)
    shards = _shard_plan(entries, n_shards, shard_bytes)
    n = len(shards)
    weight_map, paths, total = {}, [], 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        path = os.path.join(directory, fname)
        with StreamingWriter(path, [(e[0], e[1], e[2]) for e in shard]) as w:
            for name, dtype, shape, produce in shard:
                a = produce()
                if isinstance(a, _Chunks):
                    w.write_chunks(name, a.it, a.nbytes)
                    total += a.nbytes
                else:
                    w.write(name, a)
                    total += a.nbytes
                weight_map[name] = fname
        paths.append(path)
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_json, f, indent=1)
    return paths


def release_entries(params, config: ModelConfig, *, naming: str = N.RELEASE, quantize: bool = True,
                    include_dspark: bool = False, reference: dict | None = None) -> list[Entry]:
    """Stored tensors of ``params`` in spec order (experts one tensor each), quantised as released."""
    reference = {} if reference is None else reference
    entries: list[Entry] = []
    for path, spec in flat_specs(config, include_dspark=include_dspark):
        if "{e}" in spec.hf_name:
            for e in range(spec.shape[0]):
                name = N.to_release(spec.hf_name.format(e=e))
                get = (lambda p=path, e=e: np.asarray(_leaf(params, p)[e], np.float32))
                entries += _entries_for(name, spec, spec.shape[1:], get, naming, quantize, reference, (path, e))
        else:
            name = N.to_release(spec.hf_name)
            get = (lambda p=path: np.asarray(_leaf(params, p), np.float32))
            entries += _entries_for(name, spec, spec.shape, get, naming, quantize, reference, (path, None))
    return entries


def reference_params(reference: dict, config: ModelConfig, *, include_dspark: bool = False):
    """Assemble the per-tensor reference values into a parameter tree (numpy float32)."""
    from dsv41_jax.parallel.api import _tree_from_flat

    flat = {}
    for path, spec in flat_specs(config, include_dspark=include_dspark):
        if "{e}" in spec.hf_name:
            flat[path] = np.stack([reference[(path, e)] for e in range(spec.shape[0])])
        else:
            flat[path] = reference[(path, None)]
    return _tree_from_flat(config, flat, include_dspark)


def write_release_checkpoint(directory: str, params, config: ModelConfig, *, n_shards: int = 3,
                             naming: str = N.RELEASE, include_dspark: bool = False,
                             extra_tensors: dict[str, np.ndarray] | None = None):
    """Quantise ``params`` as released and write them to ``directory``; returns the dequantised parameter tree (numpy
    float32) a correct reader must load. ``extra_tensors`` (e.g. ``mtp.*``, ``vision.*``) are appended verbatim."""
    from dsv41_jax.checkpoint.safetensors_io import dtype_name

    reference: dict = {}
    entries = release_entries(params, config, naming=naming, include_dspark=include_dspark, reference=reference)
    for name, a in (extra_tensors or {}).items():
        entries.append((name, dtype_name(a.dtype), tuple(a.shape), lambda a=a: a))
    write_shards(directory, entries, release_config_json(config), n_shards=n_shards)
    return reference_params(reference, config, include_dspark=include_dspark)


# ----------------------------------------------------------------------------------------------------------------
# synthetic checkpoints (benchmarks): random valid codes, constant memory
# ----------------------------------------------------------------------------------------------------------------

_POOL_BYTES = 64 << 20


def _random_values(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random valid codes / values of a stored dtype."""
    if dtype == "F8_E4M3":
        b = rng.integers(0, 256, n, dtype=np.uint8)
        b[(b & 0x7F) == 0x7F] = 0x38  # no NaN codes (0x7F / 0xFF): use 1.0
        return b
    if dtype == "F8_E8M0":
        return rng.integers(117, 128, n, dtype=np.uint8)  # scales 2^-10 .. 2^0
    if dtype == "I8":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if dtype == "BF16":
        return (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    return rng.standard_normal(n, dtype=np.float32) * 0.02


def _random_chunks(dtype: str, shape: tuple, rng: np.random.Generator, pools: dict,
                   chunk_bytes: int = 64 << 20) -> Iterable:
    """The tensor as chunks cut at random offsets from one pool of random values per dtype (generated once), so
    writing a large checkpoint costs I/O only."""
    rows = shape[0] if shape else 1
    row_items = math.prod(shape[1:]) if len(shape) > 1 else 1
    item = 4 if dtype == "F32" else 2 if dtype == "BF16" else 1
    step = max(1, chunk_bytes // max(1, row_items * item))
    if dtype not in pools:
        pools[dtype] = _random_values(dtype, _POOL_BYTES // item, rng)
    pool = pools[dtype]
    for r0 in range(0, rows, step):
        n = min(step, rows - r0) * row_items if shape else 1
        if n > pool.size:
            yield _random_values(dtype, n, rng)
        else:
            off = int(rng.integers(0, pool.size - n + 1))
            yield pool[off: off + n]


class _Chunks:
    """Marks a producer output as a stream of chunks (see StreamingWriter.write)."""

    def __init__(self, it, nbytes):
        self.it, self.nbytes = it, nbytes


def synthetic_entries(config: ModelConfig, seed: int = 0, *, include_dspark: bool = False) -> list[Entry]:
    rng = np.random.default_rng(seed)
    pools: dict = {}
    entries: list[Entry] = []
    for path, spec in flat_specs(config, include_dspark=include_dspark):
        count = spec.shape[0] if "{e}" in spec.hf_name else 1
        shape = spec.shape[1:] if "{e}" in spec.hf_name else spec.shape
        for e in range(count):
            name = N.to_release(spec.hf_name.format(e=e) if "{e}" in spec.hf_name else spec.hf_name)
            fmt = N.storage_format(_module(name))
            if fmt == N.FLOAT:
                stored = [(name, "F32" if spec.dtype == FP32 else "BF16", shape)]
            elif fmt == N.FP4_ROWS:
                stored = [(name, "I8", (shape[0], shape[1] // 2)), (_module(name) + ".scale", "F8_E8M0",
                                                                     (shape[0], shape[1] // N.FP4_BLOCK))]
            elif fmt == N.ENGRAM_ROWS:
                stored = [(name, "F8_E4M3", shape), (_module(name) + ".scale", "F8_E8M0",
                                                     (shape[0], shape[1] // N.ENGRAM_BLOCK))]
            else:
                stored = [(name, "F8_E4M3", shape), (_module(name) + ".scale", "F8_E8M0",
                                                     (ceil_div(shape[0], 32), ceil_div(shape[1], 32)))]
            for n, dt, sh in stored:
                item = 4 if dt == "F32" else 2 if dt == "BF16" else 1
                entries.append((n, dt, sh, lambda dt=dt, sh=sh, item=item: _Chunks(_random_chunks(dt, sh, rng, pools),
                                                                                   math.prod(sh) * item)))
    return entries


def write_synthetic_release(directory: str, config: ModelConfig, *, shard_bytes: int = 1 << 30, seed: int = 0,
                            include_dspark: bool = False) -> list[str]:
    """A release-format checkpoint of ``config`` with random valid codes (no quantisation work)."""
    return write_shards(directory, synthetic_entries(config, seed, include_dspark=include_dspark),
                        release_config_json(config), n_shards=None, shard_bytes=shard_bytes)


__all__ = ["write_release_checkpoint", "write_synthetic_release", "release_config_json", "release_entries",
           "reference_params", "write_shards", "QUANTIZATION_CONFIG"]
