"""``dsv41 convert`` (release or HF safetensors -> the project's orbax parameter export) and ``dsv41 inspect``.

Convert streams one parameter at a time: read + dequantise (:class:`~dsv41_jax.checkpoint.release.ReleaseCheckpoint`,
on the host, in blocks of leading rows / experts of at most 256 MiB, so host memory stays bounded even for an Engram
table), stage it as ``<DST>.tmp-convert/staging/<path>.npy`` (bf16 staged as its uint16 bits) with its shape, dtype
and sha256 in a manifest that is rewritten atomically after each parameter, then write the orbax tree from the staged (memory-mapped) files, re-read every
parameter from the orbax checkpoint and compare shape, dtype and checksum, and only then rename the temporary
directory to ``DST``. An interrupted convert leaves only ``<DST>.tmp-convert`` (nothing at ``DST`` loads); running the
same command again resumes: staged parameters whose checksum still matches are kept, the rest are redone.

Disk: the staging area holds the dequantised model once more until the orbax write is verified (about 2 × the
output's size in all). The output is a parameter export (:func:`dsv41_jax.checkpoint.orbax_ckpt.export_params` layout: ``config.json``,
``params/``, ``dsv41_export.json``), which ``dsv41_jax.load_checkpoint`` reads onto any mesh.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41_jax.checkpoint import names as N
from dsv41_jax.checkpoint.errors import CheckpointError
from dsv41_jax.checkpoint.release import ReleaseCheckpoint
from dsv41_jax.checkpoint.safetensors_io import SafetensorsDir
from dsv41_jax.config import ModelConfig

GIB = float(1 << 30)
MANIFEST = "manifest.json"


def sha256(a: np.ndarray) -> str:
    h = hashlib.sha256()
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    step = 64 << 20
    for i in range(0, flat.size, step):
        h.update(memoryview(flat[i:i + step]))
    return h.hexdigest()


def _staged_file(path: str) -> str:
    return path.replace("/", "__") + ".npy"


STAGE_BLOCK_BYTES = 256 << 20  # host memory per staging step (a parameter is staged in blocks of leading rows)


def _stage(ckpt, src, fname: str, target: np.dtype) -> np.ndarray:
    """Dequantise ``src`` into a memory-mapped ``.npy`` block by block along its leading axis (experts, or rows),
    so a parameter larger than host memory (an Engram table) converts in bounded memory."""
    shape = src.spec.shape
    disk_dtype = np.dtype(np.uint16) if target == ml_dtypes.bfloat16 else target
    out = np.lib.format.open_memmap(fname, mode="w+", dtype=disk_dtype, shape=shape)
    if not shape:
        out[...] = ckpt.read_block(src, (), target, shape).view(disk_dtype)
    else:
        row_bytes = max(1, int(np.prod(shape[1:])) * target.itemsize)
        step = max(1, STAGE_BLOCK_BYTES // row_bytes) if len(shape) > 1 else shape[0]
        for r0 in range(0, shape[0], step):
            index = (slice(r0, min(r0 + step, shape[0])),) + tuple(slice(0, d) for d in shape[1:])
            out[index[0]] = ckpt.read_block(src, index, target, shape).view(disk_dtype)
    out.flush()
    del out
    return _load_staged(fname, target.name)


def _load_staged(fname: str, dtype_name: str) -> np.ndarray:
    a = np.load(fname, mmap_mode="r")
    return a.view(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else a


def _write_json_atomic(path: str, obj) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def convert(src: str, dst: str, *, dtype: str = "bfloat16", config: ModelConfig | None = None,
            overwrite: bool = False, log: Callable[[str], None] | None = None) -> dict:
    """Convert ``src`` (release or HF safetensors) into an orbax parameter export at ``dst``; returns a summary."""
    from dsv41_jax.checkpoint.orbax_ckpt import EXPORT_MARKER, _ocp, write_config_json
    from dsv41_jax.model.params import FP32

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    dst = os.path.abspath(dst)
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)) and not overwrite:
        raise CheckpointError(f"destination {dst} exists and is not empty (pass --overwrite)")
    np_dtype = np.dtype(jnp.dtype(dtype))
    ckpt = ReleaseCheckpoint(src, config=config)
    tmp = dst + ".tmp-convert"
    staging = os.path.join(tmp, "staging")
    os.makedirs(staging, exist_ok=True)
    manifest_path = os.path.join(staging, MANIFEST)
    manifest = {}
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("_dtype") != np_dtype.name or manifest.get("_source") != ckpt.directory:
            manifest = {}  # staged for another source / dtype: start over
    manifest["_dtype"], manifest["_source"] = np_dtype.name, ckpt.directory

    total = sum(int(np.prod(s.spec.shape)) * (4 if s.spec.dtype == FP32 else np_dtype.itemsize)
                for s in ckpt.sources)
    done_bytes, resumed, t0 = 0, 0, time.time()
    n = len(ckpt.sources)
    for i, src_ in enumerate(ckpt.sources):
        target = np.dtype(np.float32) if src_.spec.dtype == FP32 else np_dtype
        fname = os.path.join(staging, _staged_file(src_.path))
        entry = manifest.get(src_.path)
        nbytes = int(np.prod(src_.spec.shape)) * target.itemsize
        if entry and os.path.exists(fname):
            staged = _load_staged(fname, entry["dtype"])
            if list(staged.shape) == entry["shape"] and staged.dtype.name == entry["dtype"] and \
                    sha256(staged) == entry["sha256"]:
                done_bytes += nbytes
                resumed += 1
                continue
        arr = _stage(ckpt, src_, fname, target)
        manifest[src_.path] = {"shape": list(arr.shape), "dtype": target.name, "sha256": sha256(arr),
                               "source": [os.path.relpath(x.file, ckpt.directory) for x in src_.infos[:1]]}
        _write_json_atomic(manifest_path, manifest)
        done_bytes += nbytes
        del arr
        log(f"convert: [{i + 1}/{n} tensors] {done_bytes / GIB:.3f}/{total / GIB:.3f} GiB "
            f"{time.time() - t0:.1f}s  {src_.path}")
    if resumed:
        log(f"convert: resumed, {resumed} staged parameters kept (checksums verified)")

    # the orbax tree, written from memory-mapped staged files
    from dsv41_jax.parallel.api import _tree_from_flat

    flat = {s.path: _load_staged(os.path.join(staging, _staged_file(s.path)), manifest[s.path]["dtype"])
            for s in ckpt.sources}
    tree = _tree_from_flat(ckpt.config, flat, False)
    params_dir = os.path.join(tmp, "params")
    shutil.rmtree(params_dir, ignore_errors=True)
    ocp = _ocp()
    log("convert: writing the orbax checkpoint")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(params_dir, tree)
    # verify every parameter from what orbax wrote
    log("convert: verifying shapes, dtypes and checksums")
    reader = ocp.PyTreeCheckpointer()
    bad = []
    paths = [x.path for x in ckpt.sources]
    for group in _groups(paths, flat, VERIFY_GROUP_BYTES):
        wanted = set(group)
        item = _map_paths(tree, lambda p, x: np.zeros(x.shape, x.dtype) if p in wanted else ocp.PLACEHOLDER)
        args = _map_paths(tree, lambda p, x: ocp.RestoreArgs(restore_type=np.ndarray) if p in wanted else None)
        got_tree = reader.restore(params_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=args))
        for p in group:
            got, want = _get(got_tree, p), manifest[p]
            if list(got.shape) != want["shape"] or got.dtype.name != want["dtype"] or sha256(got) != want["sha256"]:
                bad.append(f"{p}: wrote {got.dtype} {list(got.shape)}, expected {want['dtype']} {want['shape']} "
                           "(or the checksum differs)")
        del got_tree
    if bad:
        raise CheckpointError("orbax checkpoint verification failed:\n  " + "\n  ".join(bad[:10]))
    write_config_json(tmp, ckpt.config)
    sums = {k: v for k, v in manifest.items() if not k.startswith("_")}
    with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
        json.dump({"format": "orbax", "converted_from": ckpt.directory, "naming": ckpt.naming,
                   "dtype": np_dtype.name, "skipped": ckpt.report.skipped_summary(), "checksums": sums}, f, indent=1)
    del flat, tree
    shutil.rmtree(staging)
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    summary = {"parameters": n, "bytes": total, "resumed": resumed, "seconds": time.time() - t0,
               "naming": ckpt.naming, "skipped": ckpt.report.skipped_summary()}
    log(f"convert: done: {n} parameters, {total / GIB:.3f} GiB in {summary['seconds']:.1f}s -> {dst}")
    return summary


VERIFY_GROUP_BYTES = 1 << 30  # parameters re-read from orbax per verification step


def _groups(paths, flat, limit):
    group, size = [], 0
    for p in paths:
        n = flat[p].nbytes
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append(p)
        size += n
    if group:
        yield group


def _map_paths(tree, fn):
    """``tree`` with each leaf replaced by ``fn(path, leaf)`` (paths like ``layers/3/attn/wq_a``)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for kp, leaf in leaves:
        p = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp)
        out.append(fn(p, leaf))
    return jax.tree_util.tree_unflatten(treedef, out)


def _get(tree, path: str):
    node = tree
    for k in path.split("/"):
        node = node[int(k)] if isinstance(node, list) else node[k]
    return np.asarray(node)


# ----------------------------------------------------------------------------------------------------------------
# inspect
# ----------------------------------------------------------------------------------------------------------------

def inspect(directory: str, config: ModelConfig | str | None = None) -> str:
    """A report on a safetensors checkpoint: naming, dtypes, bytes by component, and whether it matches a config
    (what is missing / unknown / skipped), from headers only."""
    from dsv41_jax.checkpoint.release import quantization_config
    from dsv41_jax.config import load_config

    files = SafetensorsDir(directory)
    lines = [f"# {os.path.abspath(directory)}: {len(files.files)} shard(s), {len(files.tensors)} tensors"]
    try:
        naming = N.detect_naming(files.names())
    except ValueError as e:
        naming = f"unknown ({e})"
    lines.append(f"naming: {naming}")
    raw = None
    if os.path.exists(os.path.join(directory, "config.json")):
        with open(os.path.join(directory, "config.json")) as f:
            raw = json.load(f)
    q = quantization_config(raw)
    lines.append(f"quantization_config: {json.dumps(q) if q else 'none'}"
                 + (f"; expert_dtype {raw.get('expert_dtype')}" if raw and raw.get("expert_dtype") else ""))
    by_dtype: dict = collections.defaultdict(lambda: [0, 0])
    by_comp: dict = collections.defaultdict(int)
    for name, info in files.tensors.items():
        by_dtype[info.dtype][0] += 1
        by_dtype[info.dtype][1] += info.nbytes
        by_comp[N.component(N.to_release(N.canonical(name)))] += info.nbytes
    total = sum(v[1] for v in by_dtype.values())
    lines += ["", "| dtype | tensors | GiB |", "|---|---|---|"]
    lines += [f"| {k} | {v[0]} | {v[1] / GIB:.3f} |" for k, v in sorted(by_dtype.items())]
    lines += ["", "| component | GiB | share |", "|---|---|---|"]
    lines += [f"| {k} | {v / GIB:.3f} | {v / max(total, 1):.1%} |" for k, v in sorted(by_comp.items(), key=lambda x: -x[1])]
    lines.append(f"| total | {total / GIB:.3f} | |")
    if isinstance(config, str):
        config = load_config(config)
    label = "the given config" if config is not None else "its config.json"
    try:
        ckpt = ReleaseCheckpoint(directory, config=config)
    except CheckpointError as e:
        lines += ["", f"does NOT match {label}:", str(e)]
        return "\n".join(lines)
    rep = ckpt.report
    lines += ["", f"matches {label} ({ckpt.config.name}): {rep.loaded} parameters "
              f"({', '.join(f'{k}: {v}' for k, v in sorted(rep.formats.items()))})"]
    lines += rep.left_out_lines()
    return "\n".join(lines)


__all__ = ["convert", "inspect", "sha256"]
