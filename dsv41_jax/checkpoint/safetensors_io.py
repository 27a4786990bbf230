"""Lazy safetensors reading and streaming writing, numpy + ml_dtypes only (no torch).

We parse the header ourselves: it is a length-prefixed JSON table of ``name -> dtype, shape, data_offsets``, so every
dtype the release uses (``F8_E4M3``, ``F8_E8M0``, packed ``I8`` / ``F4``) is readable whatever the installed
``safetensors`` knows (its numpy loader raises a bare AttributeError for float8), and a file shorter than its header
says is caught before any read. Tensors are read on demand, whole or by a range of leading-axis rows, with one
``pread`` into a fresh buffer: nothing is memory-mapped, so host memory holds only what was asked for.

A checkpoint directory is ``*.safetensors`` shards, optionally with ``model.safetensors.index.json`` (``weight_map``:
tensor -> shard); with an index, every listed shard must exist and hold the tensors the index assigns to it.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import struct

import ml_dtypes
import numpy as np

from dsv41_jax.checkpoint.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
# "F4" (float4_e2m1fn_x2): two e2m1 values per byte; read as packed uint8 bytes.
PACKED_F4 = "F4"
_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(CheckpointError):
    """A malformed, truncated or missing shard; the message names the file and the tensor."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]  # as stored (for F4: the header's shape)
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """The shape of the bytes as a numpy array (F4 is exposed as packed uint8 bytes, two values per byte)."""
        if self.dtype != PACKED_F4:
            return self.shape
        n = math.prod(self.shape)
        if self.nbytes == n:  # float4_e2m1fn_x2 convention: shape counts bytes already
            return self.shape
        return self.shape[:-1] + (self.shape[-1] // 2,)

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.dtype == PACKED_F4 else DTYPES[self.dtype]


def read_header(path: str) -> tuple[dict, int]:
    """(header dict, data start). Raises SafetensorsError for a short or malformed header."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SafetensorsError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 1 << 30:
                raise SafetensorsError(f"{path}: truncated safetensors file (header of {n} bytes, file {size} bytes)")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path}: cannot read the safetensors header: {e}") from e
    return header, 8 + n


def scan_file(path: str) -> dict[str, TensorInfo]:
    header, start = read_header(path)
    size = os.path.getsize(path)
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = meta.get("dtype")
        if dtype not in DTYPES and dtype != PACKED_F4:
            raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {dtype!r}")
        b, e = (int(x) for x in meta["data_offsets"])
        info = TensorInfo(name, path, dtype, tuple(int(s) for s in meta["shape"]), start + b, start + e)
        want = math.prod(info.storage_shape) * info.np_dtype.itemsize
        if info.nbytes != want:
            raise SafetensorsError(f"{path}: tensor {name} ({dtype} {list(info.shape)}) spans {info.nbytes} bytes, "
                                   f"expected {want}")
        if info.end > size:
            raise SafetensorsError(f"{path}: truncated file: tensor {name} ends at byte {info.end} but the file has "
                                   f"{size} bytes")
        out[name] = info
    return out


class SafetensorsDir:
    """All tensors of a checkpoint directory, headers only; :meth:`read` fetches data on demand."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        index_path = os.path.join(self.directory, INDEX_FILE)
        self.tensors: dict[str, TensorInfo] = {}
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise SafetensorsError(f"{index_path}: cannot read the weight_map: {e}") from e
            by_file: dict[str, list[str]] = {}
            for name, fname in weight_map.items():
                by_file.setdefault(fname, []).append(name)
            for fname, names in sorted(by_file.items()):
                path = os.path.join(self.directory, fname)
                if not os.path.exists(path):
                    raise SafetensorsError(f"shard {fname} is listed in {INDEX_FILE} (for {len(names)} tensors, e.g. "
                                           f"{sorted(names)[0]}) but is absent from {self.directory}")
                infos = scan_file(path)
                for name in names:
                    if name not in infos:
                        raise SafetensorsError(f"{INDEX_FILE} puts tensor {name} in {fname}, which does not hold it")
                self._add(infos)
            self.files = sorted(os.path.join(self.directory, f) for f in by_file)
        else:
            self.files = sorted(glob.glob(os.path.join(self.directory, "*.safetensors")))
            for path in self.files:
                self._add(scan_file(path))
        if not self.files:
            raise SafetensorsError(f"no *.safetensors files in {self.directory}")

    def _add(self, infos: dict[str, TensorInfo]) -> None:
        for name, info in infos.items():
            if name in self.tensors and self.tensors[name].file != info.file:
                raise SafetensorsError(f"tensor {name} appears in more than one file ({self.tensors[name].file}, "
                                       f"{info.file})")
            self.tensors[name] = info

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor (or rows ``[r0, r1)`` of its leading axis) as a numpy array of its storage dtype."""
        return read_tensor(self.tensors[name], rows)


def read_tensor(info: TensorInfo, rows: tuple[int, int] | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """The tensor (or rows ``[r0, r1)`` of its leading axis) in its storage dtype; ``out`` (C-contiguous, same
    number of bytes) receives the data without an intermediate copy."""
    shape = info.storage_shape
    dtype = info.np_dtype
    if rows is None or not shape:
        r0, r1, begin = 0, None, info.begin
        out_shape = shape
    else:
        r0, r1 = rows
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        begin = info.begin + r0 * row_bytes
        out_shape = (r1 - r0,) + tuple(shape[1:])
    if out is None:
        out = np.empty(out_shape, dtype)
    elif out.nbytes != math.prod(out_shape) * dtype.itemsize or not out.flags.c_contiguous:
        raise SafetensorsError(f"read of {info.name}: output buffer does not match {out_shape} {dtype}")
    buf = memoryview(out.reshape(-1).view(np.uint8))
    with open(info.file, "rb", buffering=0) as f:
        f.seek(begin)
        got = 0
        while got < len(buf):
            n = f.readinto(buf[got:])
            if not n:
                raise SafetensorsError(f"{info.file}: truncated file while reading tensor {info.name}")
            got += n
    return out


# ----------------------------------------------------------------------------------------------------------------
# writing (tests, benchmarks, conversion staging): header first, then tensors streamed one at a time
# ----------------------------------------------------------------------------------------------------------------

def dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype not in _NAMES:
        raise SafetensorsError(f"no safetensors dtype for {dtype}")
    return _NAMES[dtype]


class StreamingWriter:
    """Write one shard: declare every tensor (name, dtype string, shape) first, then :meth:`write` each in order
    of declaration. Only the tensor being written is in memory."""

    def __init__(self, path: str, entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict | None = None):
        self.path = path
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self._order = []
        for name, dtype, shape in entries:
            item = 1 if dtype == PACKED_F4 else DTYPES[dtype].itemsize
            n = math.prod(shape) * item
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._order.append((name, n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0

    def write(self, name: str, array: np.ndarray) -> None:
        want, n = self._order[self._next]
        if name != want:
            raise SafetensorsError(f"{self.path}: expected tensor {want} next, got {name}")
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if data.size != n:
            raise SafetensorsError(f"{self.path}: tensor {name} has {data.size} bytes, declared {n}")
        self._f.write(memoryview(data))
        self._next += 1

    def write_chunks(self, name: str, chunks, nbytes: int) -> None:
        """Write one tensor from an iterable of arrays whose bytes concatenate to it (constant memory)."""
        want, n = self._order[self._next]
        if name != want or n != nbytes:
            raise SafetensorsError(f"{self.path}: expected tensor {want} ({n} bytes) next, got {name} ({nbytes})")
        done = 0
        for c in chunks:
            data = np.ascontiguousarray(c).reshape(-1).view(np.uint8)
            self._f.write(memoryview(data))
            done += data.size
        if done != n:
            raise SafetensorsError(f"{self.path}: tensor {name} got {done} bytes, declared {n}")
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            self._f.close()
            raise SafetensorsError(f"{self.path}: {len(self._order) - self._next} declared tensors were not written")
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        else:
            self._f.close()


def save(path: str, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write a dict of numpy arrays (any dtype in :data:`DTYPES`) as one safetensors file."""
    entries = [(k, dtype_name(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    with StreamingWriter(path, entries, metadata) as w:
        for k, v in tensors.items():
            w.write(k, v)


__all__ = ["SafetensorsDir", "SafetensorsError", "TensorInfo", "StreamingWriter", "read_header", "read_tensor",
           "scan_file", "save", "dtype_name", "INDEX_FILE", "DTYPES", "PACKED_F4"]
