"""One reader for safetensors checkpoints in both namings — the release's (official module tree, FP8 / FP4
block-scaled) and HF transformers' (``model.`` prefix, float or quantised) — streamed onto any mesh.

    ckpt = ReleaseCheckpoint(directory)              # headers + config.json only; naming detected from the names
    config, params = ckpt.load(dtype=jnp.bfloat16, mesh=mesh, rules="tp")   # or shardings=..., or one device
    print(ckpt.report.describe())                    # naming, formats, skipped (DSpark, vision) and ignored tensors

How it streams. Every parameter is planned from headers first (names, shapes, dtypes, scale shapes — all errors
reported together, naming the tensor and its file). Then parameters are placed one at a time: for each distinct shard
index of the parameter's target ``NamedSharding`` on this process's devices, the rows that index covers are read
(one ``pread`` per tensor, and for stacked experts only the experts it covers), in slices of at most
:data:`CHUNK_BYTES` (on the device) along the leading axis, each slice dequantised exactly (on the device by default,
or in float32 numpy on the host), cast to the caller's dtype and written in place into the device block before the
next slice is read. So the host holds one slice of one parameter (plus its stored bytes) at a time, and on a pod
each process reads only the rows its devices own (tensors split along a later axis are read as whole rows); the
quantised path (``keep_quantized``) reads its values and scales the same way.

Engram tables are padded to the row-shard multiple of the mesh (as :func:`dsv41_jax.parallel.shard_params` does).
``keep_quantized=True`` returns :class:`~dsv41_jax.checkpoint.quantized.QuantizedTensor` leaves (values + scales)
for the FP8 / FP4 tensors instead of dequantising them.

Scales: an FP8 / FP4 tensor needs its ``.scale`` sibling and a ``quantization_config`` in ``config.json``. A
float Engram table's ``scale`` is not applied (the HF reference ignores it for float tables) and is listed under
``ignored``; an FP8 table's scale is always applied.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from dsv41_jax.checkpoint import names as N
from dsv41_jax.checkpoint import quantized as QZ
from dsv41_jax.checkpoint.errors import CheckpointError
from dsv41_jax.checkpoint.safetensors_io import PACKED_F4, SafetensorsDir, SafetensorsError, TensorInfo, read_tensor
from dsv41_jax.config import ModelConfig, ceil_div
from dsv41_jax.model.params import FP32, ParamSpec, flat_specs, is_spec, param_specs


_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_FP8 = "F8_E4M3"
_PACKED = ("I8", "U8", PACKED_F4)
_LAYER = re.compile(r"^layers\.(\d+)\.")
_RECENT_BYTES = 4 << 20  # reads kept for devices that share scale-block rows (ReleaseCheckpoint._read)


@dataclasses.dataclass
class Source:
    """Where one parameter comes from."""

    path: str  # parameter tree path, e.g. layers/3/attn/wq_a
    spec: ParamSpec
    infos: list[TensorInfo]  # one, or one per expert (stacked on axis 0)
    scales: list[TensorInfo] | None
    fmt: str  # names.FP8_BLOCK / FP4_ROWS / ENGRAM_ROWS / FLOAT (from the stored dtype)

    @property
    def stacked(self) -> bool:
        return "{e}" in self.spec.hf_name

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.infos) + sum(i.nbytes for i in self.scales or [])


@dataclasses.dataclass
class LoadReport:
    directory: str
    naming: str
    n_tensors: int = 0
    loaded: int = 0
    formats: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # tensor -> reason
    ignored: dict[str, str] = dataclasses.field(default_factory=dict)
    bytes_read: int = 0
    bytes_read_by_tensor: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def skipped_summary(self) -> dict[str, int]:
        return dict(collections.Counter(self.skipped.values()))

    def describe(self) -> str:
        lines = [f"{self.directory}: {self.naming} naming, {self.n_tensors} tensors, {self.loaded} parameters loaded "
                 f"({', '.join(f'{k}: {v}' for k, v in sorted(self.formats.items()))})"]
        lines += ["  " + line for line in self.left_out_lines()]
        return "\n".join(lines)

    def left_out_lines(self) -> list[str]:
        """What the load left out: skipped tensors counted by reason, ignored tensors by name."""
        return ([f"skipped {n} tensors: {reason}" for reason, n in sorted(self.skipped_summary().items())]
                + [f"ignored {name}: {why}" for name, why in sorted(self.ignored.items())])


def _rel(path: str, directory: str) -> str:
    return os.path.relpath(path, directory)


def quantization_config(raw: dict | None) -> dict | None:
    if not raw:
        return None
    q = raw.get("quantization_config")
    if q is None and isinstance(raw.get("text_config"), dict):
        q = raw["text_config"].get("quantization_config")
    return q


class ReleaseCheckpoint:
    """A safetensors checkpoint directory (release or HF naming), planned from headers; :meth:`load` streams it."""

    def __init__(self, directory: str, *, config: ModelConfig | None = None, include_dspark: bool = False):
        self.directory = os.path.abspath(os.fspath(directory))
        try:
            self.files = SafetensorsDir(self.directory)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from e
        cfg_path = os.path.join(self.directory, "config.json")
        self.raw_config = None
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                self.raw_config = json.load(f)
        if config is None:
            if self.raw_config is None:
                raise CheckpointError(f"{self.directory} has no config.json (pass config=...)")
            config = ModelConfig.from_json_file(cfg_path)
        self.config = config
        self.include_dspark = include_dspark
        self.quant = quantization_config(self.raw_config)
        block = (self.quant or {}).get("weight_block_size") or [32, 32]
        self.fp8_block = (int(block[0]), int(block[1]))
        try:
            self.naming = N.detect_naming(self.files.names())
        except ValueError as e:
            raise CheckpointError(f"{self.directory}: {e}") from e
        # canonical spelling -> stored name
        self.stored = {N.canonical(n): n for n in self.files.names()}
        self.report = LoadReport(self.directory, self.naming, n_tensors=len(self.stored))
        self._recent: collections.OrderedDict = collections.OrderedDict()  # (tensor, rows) -> array (see _read)
        self.sources = self._plan()

    # ------------------------------------------------------------------------------------------------------------
    # planning (headers only)
    # ------------------------------------------------------------------------------------------------------------
    def _name(self, hf_name: str) -> str:
        return N.in_naming(hf_name, self.naming)

    def _info(self, name: str) -> TensorInfo | None:
        stored = self.stored.get(name)
        return None if stored is None else self.files.tensors[stored]

    def _plan(self) -> list[Source]:
        problems: list[str] = []
        used: set[str] = set()
        sources = []
        specs = flat_specs(self.config, include_dspark=self.include_dspark)
        for path, spec in specs:
            src = self._plan_one(path, spec, problems, used)
            if src is not None:
                sources.append(src)
        unknown = []
        for canon in self.stored:
            if canon in used:
                continue
            release = N.to_release(canon)
            reason = N.skip_reason(release, self.include_dspark, self.config.num_nextn_predict_layers > 0)
            if reason is not None:
                self.report.skipped[canon] = reason
            else:
                unknown.append(canon)
        if unknown:
            shown = ", ".join(f"{n} ({_rel(self._info(n).file, self.directory)})" for n in sorted(unknown)[:10])
            problems.append(f"unknown tensors: [{shown}]{' ...' if len(unknown) > 10 else ''}")
        if problems:
            hint = self._layer_hint()
            raise CheckpointError(f"checkpoint {self.directory} ({self.naming} naming) does not match the config:\n  "
                                  + "\n  ".join(problems) + (f"\n  {hint}" if hint else ""))
        self.report.loaded = len(sources)
        return sources

    def _layer_hint(self) -> str:
        layers = {int(m.group(1)) for n in self.stored if (m := _LAYER.match(N.to_release(n)))}
        if layers and max(layers) + 1 != self.config.num_hidden_layers:
            return (f"the checkpoint has layers 0-{max(layers)} but the config says num_hidden_layers="
                    f"{self.config.num_hidden_layers}")
        return ""

    def _plan_one(self, path: str, spec: ParamSpec, problems: list[str], used: set[str]) -> Source | None:
        stacked = "{e}" in spec.hf_name
        hf_names = [spec.hf_name.format(e=e) for e in range(spec.shape[0])] if stacked else [spec.hf_name]
        names = [self._name(n) for n in hf_names]
        shape = spec.shape[1:] if stacked else spec.shape
        missing = [n for n in names if n not in self.stored]
        if missing:
            problems.append(f"missing tensor {missing[0]}" + (f" (+{len(missing) - 1} more experts)"
                                                              if len(missing) > 1 else f" {spec.shape}"))
            return None
        infos = [self._info(n) for n in names]
        used.update(names)
        fmts = set()
        scales = []
        for name, info in zip(names, infos):
            fmt, scale = self._check_tensor(name, info, shape, problems, used)
            fmts.add(fmt)
            if scale is not None:
                scales.append(scale)
        if len(fmts) != 1 or None in fmts:
            if None not in fmts:
                problems.append(f"tensors of {spec.hf_name} mix storage formats {sorted(fmts)}")
            return None
        fmt = fmts.pop()
        self.report.formats[fmt] += 1
        return Source(path, spec, infos, scales if fmt != N.FLOAT else None, fmt)

    def _check_tensor(self, name: str, info: TensorInfo, shape: tuple, problems: list[str], used: set[str]):
        where = _rel(info.file, self.directory)
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        scale_name = module + ".scale"
        scale = self._info(scale_name) if scale_name != name else None
        release_fmt = N.storage_format(N.to_release(module))
        if info.dtype in _FLOAT_DTYPES:
            if tuple(info.shape) != tuple(shape):
                problems.append(f"tensor {name} has shape {tuple(info.shape)}, expected {tuple(shape)} from the config "
                                f"(in {where})")
                return None, None
            if scale is not None:
                used.add(scale_name)
                self.report.ignored[scale_name] = (f"scale beside the float tensor {name} is not applied (float "
                                                  "weights are already dequantised; HF reference semantics)")
            return N.FLOAT, None
        if info.dtype == _FP8:
            fmt = N.ENGRAM_ROWS if release_fmt == N.ENGRAM_ROWS else N.FP8_BLOCK
        elif info.dtype in _PACKED:
            fmt = N.FP4_ROWS
        else:
            problems.append(f"tensor {name} has dtype {info.dtype}, which is neither a float nor a known quantised "
                            f"format (in {where})")
            return None, None
        if self.quant is None:
            problems.append(f"tensor {name} is stored {info.dtype} (in {where}) but config.json has no "
                            "quantization_config: cannot tell how to dequantise it")
            return None, None
        if scale is None:
            problems.append(f"quantised tensor {name} ({info.dtype}, in {where}) has no {scale_name}")
            return None, None
        used.add(scale_name)
        if len(shape) != 2:
            problems.append(f"quantised tensor {name} ({info.dtype}, in {where}) is expected to be a vector {shape}")
            return None, None
        out, inp = shape
        if fmt == N.FP8_BLOCK:
            bo, bi = self.fp8_block
            want, want_scale = (out, inp), (ceil_div(out, bo), ceil_div(inp, bi))
        elif fmt == N.ENGRAM_ROWS:
            want, want_scale = (out, inp), (out, ceil_div(inp, N.ENGRAM_BLOCK))
        else:
            want, want_scale = (out, inp // 2), (out, ceil_div(inp, N.FP4_BLOCK))
            if inp % N.FP4_BLOCK:
                problems.append(f"FP4 tensor {name}: input dim {inp} is not a multiple of {N.FP4_BLOCK}")
                return None, None
        if tuple(info.storage_shape) != want:
            problems.append(f"tensor {name} has shape {tuple(info.storage_shape)} ({info.dtype}), expected {want} for "
                            f"logical {tuple(shape)} from the config (in {where})")
            return None, None
        if tuple(scale.shape) != want_scale:
            problems.append(f"scale {scale_name} has shape {tuple(scale.shape)}, expected {want_scale} for "
                            f"{name} {tuple(shape)} ({fmt}; in {_rel(scale.file, self.directory)})")
            return None, None
        if scale.dtype not in ("F8_E8M0", "U8", "F32", "BF16"):
            problems.append(f"scale {scale_name} has dtype {scale.dtype}; expected F8_E8M0 (or F32)")
            return None, None
        return fmt, scale

    # ------------------------------------------------------------------------------------------------------------
    # reading
    # ------------------------------------------------------------------------------------------------------------
    def _read(self, info: TensorInfo, rows=None, out=None) -> np.ndarray:
        """Rows of a tensor, as stored. The last two small reads (a weight's rows and its scale's, up to
        :data:`_RECENT_BYTES` each) are kept until the next reads or the end of the parameter: devices whose blocks
        are narrower than a scale block (e.g. 8 rows of a 32-row FP8 block each) need the same stored rows, which are
        then read from the file once."""
        key = (info.name, None if rows is None else tuple(rows))
        a = self._recent.get(key)
        if a is not None:
            if out is None:
                return a
            out[...] = a.reshape(out.shape)
            return out
        a = read_tensor(info, rows, out)
        self.report.bytes_read += a.nbytes
        self.report.bytes_read_by_tensor[info.name] += a.nbytes
        if a.nbytes <= _RECENT_BYTES:
            self._recent[key] = a
        while len(self._recent) > 2:
            self._recent.popitem(last=False)
        return a

    def _rows_2d(self, src: Source, k: int, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of tensor ``k`` of ``src`` (k = expert index for stacked sources): float32 for quantised
        tensors, the stored dtype for float ones (cast once, by the caller, to the target dtype)."""
        info = src.infos[k]
        if src.fmt == N.FLOAT:
            return self._read(info, (r0, r1))
        scale = src.scales[k]
        v = self._read(info, (r0, r1))
        if src.fmt == N.FP8_BLOCK:
            bo, bi = self.fp8_block
            s = self._read(scale, (r0 // bo, (r1 - 1) // bo + 1))
            return QZ.dequant_fp8_block(v, s, (bo, bi), row0=r0)
        s = self._read(scale, (r0, r1))
        if src.fmt == N.FP4_ROWS:
            return QZ.dequant_fp4_rows(v, s)
        return QZ.dequant_engram_rows(v, s)

    def read_block(self, src: Source, index: tuple, dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The block ``index`` (slices over ``shape``, which may pad an Engram table's rows) in ``dtype``."""
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        bounds = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
        if len(shape) == 0:
            return QZ.cast(self._read(src.infos[0]), dtype)
        if len(shape) == 1:  # only the elements of the block
            return QZ.cast(self._read(src.infos[0], bounds[0]), dtype)
        if src.stacked:
            (e0, e1), (r0, r1), (c0, c1) = bounds
            out = np.empty((e1 - e0, r1 - r0, c1 - c0), dtype)
            for j, e in enumerate(range(e0, e1)):
                out[j] = QZ.cast(self._rows_2d(src, e, r0, r1)[:, c0:c1], dtype)
            return out
        (r0, r1), (c0, c1) = bounds
        real = src.spec.shape[0]
        out = np.zeros((r1 - r0, c1 - c0), dtype) if r1 > real else None
        hi = min(r1, real)
        if hi <= r0:
            return out
        block = QZ.cast(self._rows_2d(src, 0, r0, hi)[:, c0:c1], dtype)
        if out is None:
            return block
        out[: hi - r0] = block
        return out

    def read_raw_block(self, src: Source, index: tuple, shape: tuple[int, ...]):
        """The stored bytes covering block ``index`` of a quantised source, for dequantisation on the device:
        ``(values, scales, rows, cols, out_rows)`` where values / scales cover whole scale blocks of rows
        (``[e, r, ...]`` for stacked experts), ``rows`` / ``cols`` are the slices to cut from the dequantised
        block and ``out_rows`` the block's row count (Engram padding rows beyond the table are zeros)."""
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        bounds = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
        (r0, r1), (c0, c1) = bounds[-2:]
        real = src.spec.shape[-2]
        hi = min(r1, real)
        bo = self.fp8_block[0] if src.fmt == N.FP8_BLOCK else 1
        a0, a1 = (r0 // bo) * bo, min(-(-hi // bo) * bo, real)
        out_rows = r1 - r0
        if hi <= r0:  # a slice of Engram padding rows only: nothing stored to read
            r0 = hi = a0 = a1 = 0
        experts = list(range(*bounds[0])) if src.stacked else [0]
        s_rows = (a0 // bo, -(-a1 // bo))
        vinfo, sinfo = src.infos[experts[0]], src.scales[experts[0]]
        values = np.empty((len(experts), a1 - a0) + tuple(vinfo.storage_shape[1:]), np.uint8)
        scale_float = sinfo.dtype not in ("F8_E8M0", "U8")
        scales = np.empty((len(experts), s_rows[1] - s_rows[0]) + tuple(sinfo.shape[1:]), sinfo.np_dtype)
        for j, e in enumerate(experts):  # read straight into the stacked buffers (no per-expert copies)
            self._read(src.infos[e], (a0, a1), out=values[j].view(src.infos[e].np_dtype))
            self._read(src.scales[e], s_rows, out=scales[j])
        scales = scales.astype(np.float32) if scale_float else scales.view(np.uint8)
        if not src.stacked:
            values, scales = values[0], scales[0]
        return values, scales, slice(r0 - a0, hi - a0), slice(c0, c1), out_rows

    def _stored_layout(self, src: Source, shape) -> tuple[tuple, tuple, int, int]:
        """(values shape, scales shape, rows per scale row, columns per scale column) of the stored bytes of a
        quantised source of logical ``shape`` (which may pad an Engram table's rows)."""
        bo, bi = (self.fp8_block if src.fmt == N.FP8_BLOCK else (1, N.FP4_BLOCK if src.fmt == N.FP4_ROWS
                                                                   else N.ENGRAM_BLOCK))
        rows, cols = shape[-2], shape[-1]
        vshape = tuple(shape[:-1]) + ((cols // 2) if src.fmt == N.FP4_ROWS else cols,)
        sshape = tuple(shape[:-2]) + (ceil_div(rows, bo), ceil_div(cols, bi))
        return vshape, sshape, bo, bi

    def _stored_reader(self, src: Source, kind: str, full: tuple, rows_per: int):
        """``read(index)`` for blocks of the stored values (``kind="v"``, as uint8 bytes) or scales (``"s"``: e8m0
        bytes, float scales as float32) laid out as ``full`` (stacked ``[e, rows, width]`` for experts). Rows past
        the stored tensor (Engram padding) read as zero values / unit scales. Only the experts and rows of the
        block are read, straight into one buffer; a column slice is cut from whole rows."""
        real = ceil_div(src.spec.shape[-2], rows_per)
        infos = src.infos if kind == "v" else src.scales

        def read(index):
            index = tuple(index) + (slice(None),) * (len(full) - len(index))
            r0, r1 = index[-2].indices(full[-2])[:2]
            lo, hi = r0, min(r1, real)
            experts = list(range(*index[0].indices(full[0])[:2])) if src.stacked else [0]
            stored = infos[experts[0]].np_dtype
            as_bytes = stored.itemsize == 1
            buf = np.empty((len(experts), r1 - r0, full[-1]), np.uint8 if as_bytes else stored)
            if r1 > hi:  # Engram padding rows: zero values, unit scales
                buf[:, max(hi, lo) - r0:] = QZ.E8M0_BIAS if (kind == "s" and as_bytes) else 0
            for j, k in enumerate(experts):  # straight into one buffer, no per-expert copies
                if hi > lo:
                    self._read(infos[k], (lo, hi), out=buf[j, : hi - lo].view(stored))
            c = index[-1]
            out = buf[..., c] if c != slice(None) else buf
            out = out if as_bytes else out.astype(np.float32)
            return out if src.stacked else out[0]
        return read

    def _place_dequant_spmd(self, src: Source, shape, sharding, dtype):
        """Stored bytes placed with the target's PartitionSpec (values and scales alike), dequantised by one jitted
        SPMD program with the target sharding as output: one compile per shape for the whole mesh, each device
        dequantising only its own block. None when a shard boundary would split a scale block."""
        if not isinstance(sharding, NamedSharding) or len(sharding.device_set) == 1:
            return None
        vshape, sshape, bo, bi = self._stored_layout(src, shape)
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        mesh = sharding.mesh
        for d, axes in enumerate(spec):
            if axes is None:
                continue
            n = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))
            if vshape[d] % n or sshape[d] % n or shape[d] % n:
                return None
            if d >= len(shape) - 2 and (shape[d] // n) % (bo if d == len(shape) - 2 else bi):
                return None
        values = place(vshape, sharding, self._stored_reader(src, "v", vshape, 1), itemsize=1)
        scales = place(sshape, sharding, self._stored_reader(src, "s", sshape, bo), itemsize=4)
        qt = QZ.QuantizedTensor(values, scales, src.fmt, tuple(shape), self.fp8_block)
        return _spmd_dequant(qt, dtype, sharding)

    # ------------------------------------------------------------------------------------------------------------
    # placement
    # ------------------------------------------------------------------------------------------------------------
    def load(self, dtype=jnp.float32, *, mesh=None, rules="tp", shardings=None, keep_quantized: bool = False,
             dequantize_on: str = "auto", on_param: Callable[[Source, int, int], None] | None = None):
        """(config, params). Placement: ``mesh`` (+ ``rules``) -> the partition rules' NamedShardings (Engram tables
        padded to the row-shard multiple); or ``shardings`` (a tree like the parameters); or the first device.
        ``dequantize_on``: ``"device"`` sends the stored FP8 / FP4 bytes and dequantises on the target device (exact,
        jitted; the host then holds only raw bytes), ``"host"`` dequantises with numpy on the host, ``"auto"`` =
        device. ``on_param(source, i, n)`` is called after each parameter (progress)."""
        from dsv41_jax.parallel import api as par_api

        specs = param_specs(self.config, include_dspark=self.include_dspark)
        leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
        if mesh is not None:
            shardings = par_api.param_shardings(self.config, mesh, rules, include_dspark=self.include_dspark)
        flat_sh = (jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
                   if shardings is not None else [None] * len(leaves))
        if len(flat_sh) != len(leaves):
            raise CheckpointError(f"shardings tree has {len(flat_sh)} leaves, the parameters {len(leaves)}")
        by_path = {s.path: s for s in self.sources}
        paths = [p for p, _ in flat_specs(self.config, include_dspark=self.include_dspark)]
        device = jax.devices()[0]
        out = []
        fp8_rows = self.fp8_block[0]
        for i, (path, spec, sh) in enumerate(zip(paths, leaves, flat_sh)):
            src = by_path[path]
            target = jnp.float32 if spec.dtype == FP32 else dtype
            align = fp8_rows if src.fmt == N.FP8_BLOCK and not src.stacked else 1  # slices of whole scale blocks
            shape = spec.shape
            if mesh is not None:
                shape = par_api._padded_shape(path, spec.shape, mesh, rules)
            sh = sh if sh is not None else SingleDeviceSharding(device)
            if keep_quantized and src.fmt != N.FLOAT:
                out.append(self._place_quantized(src, shape, sh, mesh, rules))
            elif src.fmt != N.FLOAT and _dequant_on_device(dequantize_on, sh):
                arr = self._place_dequant_spmd(src, shape, sh, jnp.dtype(target))
                if arr is None:  # shards not aligned to scale blocks: per-device blocks
                    arr = place(shape, sh, lambda index, s=src, sh_=shape: self.read_raw_block(s, index, sh_),
                                finish=functools.partial(_device_dequant, fmt=src.fmt, block=self.fp8_block,
                                                         dtype=jnp.dtype(target)),
                                cut=_raw_cols, itemsize=jnp.dtype(target).itemsize, align=align)
                out.append(arr)
            else:
                np_dtype = np.dtype(jnp.dtype(target))
                out.append(place(shape, sh, lambda index, s=src, sh_=shape: self.read_block(s, index, np_dtype, sh_),
                                 itemsize=max(4, np_dtype.itemsize), align=align))
            self._recent.clear()
            if on_param is not None:
                on_param(src, i, len(leaves))
        return self.config, jax.tree.unflatten(treedef, out)

    def _place_quantized(self, src: Source, shape, sh, mesh, rules) -> QZ.QuantizedTensor:
        """Values + scales placed as stored (Engram rows padded for the mesh), each device's block read on its own:
        on a pod a process reads only the experts / rows its devices hold."""
        from dsv41_jax.parallel.rules import get_rules, logical_to_spec

        vshape, sshape, bo, _ = self._stored_layout(src, shape)

        def sharding_for(full):
            if mesh is None:
                return sh
            return NamedSharding(mesh, logical_to_spec(src.spec.axes, mesh, get_rules(rules), full, strict=False))

        v = place(vshape, sharding_for(vshape), self._stored_reader(src, "v", vshape, 1), itemsize=1)
        read_scales = self._stored_reader(src, "s", sshape, bo)
        seen = []  # the largest scale byte of every block read (FP4 experts: QuantizedTensor.scale_max)

        def read_and_note(index):
            block = read_scales(index)
            seen.append(QZ.scale_byte_max(block))
            return block

        fp4 = src.fmt == N.FP4_ROWS
        s = place(sshape, sharding_for(sshape), read_and_note if fp4 else read_scales, itemsize=4)
        # one process reads every block of the tensor (its devices hold them all); on a pod each process reads only
        # its own, and a per-process maximum would give the processes different programs: unknown there
        whole = fp4 and seen and None not in seen and jax.process_count() == 1
        scale_max = max(seen) if whole else None
        block = self.fp8_block if src.fmt == N.FP8_BLOCK else (1, 32)
        return QZ.QuantizedTensor(v, s, src.fmt, tuple(src.spec.shape), block, scale_max)


def _dequant_on_device(mode: str, sharding) -> bool:
    if mode not in ("auto", "device", "host"):
        raise ValueError(f"dequantize_on must be 'auto', 'device' or 'host', got {mode!r}")
    # measured on the CPU too (benchmarks/RESULTS.md): XLA's dequantisation beats numpy's, so "auto" is the device
    return mode != "host"


@functools.partial(jax.jit, static_argnums=(1, 2))
def _spmd_dequant_jit(qt, dtype, sharding):
    return jax.lax.with_sharding_constraint(QZ.dequantize(qt, dtype), sharding)


def _spmd_dequant(qt, dtype, sharding):
    return _spmd_dequant_jit(qt, dtype, sharding)


def _raw_cols(raw, lo: int, cols: tuple[int, int]):
    """A block of :meth:`ReleaseCheckpoint.read_raw_block` (whole stored rows) for columns ``cols`` only: the
    columns to cut after dequantising."""
    values, scales, rows, _, out_rows = raw
    return values, scales, rows, slice(*cols), out_rows


def _device_dequant(raw, dev, *, fmt, block, dtype):
    """Put the stored bytes of one block on ``dev`` and dequantise there (exact; see quantized.dequantize)."""
    values, scales, rows, cols, out_rows = raw
    logical = values.shape[:-1] + (values.shape[-1] * 2 if fmt == N.FP4_ROWS else values.shape[-1],)
    qt = QZ.QuantizedTensor(jax.device_put(values, dev), jax.device_put(scales, dev), fmt, logical, block)
    return _cut(QZ.dequantize(qt, dtype), rows.start, rows.stop, cols.start, cols.stop, out_rows)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _cut(x, r0, r1, c0, c1, out_rows):
    y = x[..., r0:r1, c0:c1]
    if out_rows > r1 - r0:  # Engram padding rows
        pad = [(0, 0)] * (y.ndim - 2) + [(0, out_rows - (r1 - r0)), (0, 0)]
        y = jnp.pad(y, pad)
    return y


# A device block is read and sent in slices of its leading axis of at most this many bytes (on the device), so the
# host holds one slice (plus its stored bytes) at a time, and so does a GPU runtime that stages host-to-device copies
# through pinned host buffers (which it keeps for reuse: one slice's worth instead of the largest parameter's).
CHUNK_BYTES = 64 << 20


def _chunks(r0: int, r1: int, row_bytes: int, align: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """[r0, r1) cut at absolute multiples of a step (a multiple of ``align`` rows) of about ``chunk_bytes``."""
    step = max(align, (chunk_bytes // max(1, row_bytes)) // align * align)
    out, b = [], r0
    while b < r1:
        e = min(r1, (b // step + 1) * step)
        out.append((b, e))
        b = e
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _write_rows(block, part, start):
    """``block[start : start + len(part)] = part`` in place (the block's buffer is donated)."""
    return jax.lax.dynamic_update_slice_in_dim(block, part.astype(block.dtype), start, axis=0)


def _host_cols(host, lo: int, cols: tuple[int, int]):
    """Columns ``cols`` (absolute) of a host block whose last axis starts at column ``lo``."""
    return host[..., cols[0] - lo: cols[1] - lo]


def place(shape, sharding, read: Callable[[tuple], object], finish=None, *, cut=_host_cols, itemsize: int = 4,
          align: int = 1, chunk_bytes: int | None = None) -> jax.Array:
    """Build a global array on ``sharding`` from host blocks read with ``read(index)``, put on this process's
    devices one block at a time. ``finish(block, device)`` (optional) turns what ``read`` returned into the device
    array (e.g. dequantises stored bytes there).

    Reads are shared: devices whose blocks are equal get one read; blocks that differ only in their last axis
    (columns split over devices) get one read of the rows they cover, over the union of their columns, from which
    ``cut(host, lo, (c0, c1))`` takes each block's columns. A read of more than ``chunk_bytes`` (``itemsize`` bytes
    per element on the device) is done in slices of the leading axis (cut at multiples of ``align`` rows, e.g. a
    scale block), each written into the device blocks in place before the next slice is read."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    shape = tuple(int(s) for s in shape)
    idx_map = sharding.addressable_devices_indices_map(shape)
    row_groups: dict[tuple, dict[tuple, list]] = {}  # bounds but the last axis -> last-axis bounds -> devices
    for dev, index in idx_map.items():
        b = tuple(sl.indices(n)[:2] for sl, n in zip(index, shape)) if shape else ()
        head, last = (b[:-1], b[-1]) if len(b) >= 2 else (b, None)
        row_groups.setdefault(head, {}).setdefault(last, []).append(dev)
    placed = {}
    for head, col_groups in row_groups.items():
        lo = hi = None
        if None not in col_groups:
            lo, hi = min(c[0] for c in col_groups), max(c[1] for c in col_groups)
        full = head + (((lo, hi),) if lo is not None else ())
        if full:
            row_bytes = int(np.prod([b - a for a, b in full[1:]], dtype=np.int64)) * itemsize
            pieces = _chunks(*full[0], row_bytes, align, chunk_bytes)
        else:
            pieces = [None]
        whole = len(pieces) <= 1
        for piece in pieces:
            bounds = full if whole else (piece,) + full[1:]
            host = read(tuple(slice(a, b) for a, b in bounds))
            for cols, devices in col_groups.items():
                block = host if len(col_groups) == 1 else cut(host, lo, cols)
                for d in devices:
                    part = jax.device_put(block, d) if finish is None else finish(block, d)
                    if whole:
                        placed[d] = part
                        continue
                    if d not in placed:
                        block_shape = tuple(b - a for a, b in head) + ((cols[1] - cols[0],) if cols else ())
                        placed[d] = jnp.zeros(block_shape, part.dtype, device=d)
                    placed[d] = _write_rows(placed[d], part, piece[0] - full[0][0])
                    del part
                del block
            jax.block_until_ready([placed[d] for devices in col_groups.values() for d in devices])
            del host
    arrays = [placed[d] for d in idx_map]
    if isinstance(sharding, SingleDeviceSharding) and len(arrays) == 1:
        return arrays[0]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def load_safetensors_checkpoint(directory: str, *, dtype=jnp.float32, config: ModelConfig | None = None,
                                include_dspark: bool = False, mesh=None, rules="tp", shardings=None,
                                keep_quantized: bool = False, dequantize_on: str = "auto",
                                return_report: bool = False):
    ckpt = ReleaseCheckpoint(directory, config=config, include_dspark=include_dspark)
    config, params = ckpt.load(dtype, mesh=mesh, rules=rules, shardings=shardings, keep_quantized=keep_quantized,
                               dequantize_on=dequantize_on)
    return (config, params, ckpt.report) if return_report else (config, params)


__all__ = ["ReleaseCheckpoint", "LoadReport", "Source", "CheckpointError", "load_safetensors_checkpoint", "place",
           "quantization_config"]
