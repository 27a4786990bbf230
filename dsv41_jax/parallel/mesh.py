"""Device meshes: named axes and deployment presets as data.

Every mesh has the three named axes ``data``, ``expert`` and ``tensor`` (size 1 when unused), so one rules table
(:mod:`dsv41_jax.parallel.rules`) serves every deployment:

* ``data``   — batch (and, with the ``pod`` rules, part of the Engram table rows); parameters are replicated over it.
* ``expert`` — routed experts (expert parallelism); outside the MoE it also splits the batch ("EP as DP").
* ``tensor`` — attention heads, indexer heads, q LoRA, output-projection groups, expert / shared-MLP width, vocab.

A :class:`MeshPreset` pairs axis sizes with the name of a rules preset; ``PRESETS`` holds the single-device, one
8-GPU host and TPU pod layouts used by the launcher, the AOT compiler and the golden PartitionSpec tables.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "expert", "tensor")


class MeshError(ValueError):
    """A mesh that does not fit the devices, the model or the batch; the message names the axis and dimension."""


@dataclasses.dataclass(frozen=True)
class MeshPreset:
    name: str
    data: int = 1
    expert: int = 1
    tensor: int = 1
    rules: str = "tp"  # a key of dsv41_jax.parallel.rules.RULES
    topology: str | None = None  # TPU topology for AOT compilation, e.g. "v5p:4x4x4"
    description: str = ""

    @property
    def shape(self) -> dict[str, int]:
        return {"data": self.data, "expert": self.expert, "tensor": self.tensor}

    @property
    def size(self) -> int:
        return self.data * self.expert * self.tensor


PRESETS: dict[str, MeshPreset] = {p.name: p for p in (
    MeshPreset("single", description="one device; every rule resolves to replication"),
    MeshPreset("gpu8", expert=8, rules="tp",
               description="one 8-GPU host: 8-way expert parallelism, batch split 8 ways outside the MoE"),
    MeshPreset("gpu8_tp", expert=4, tensor=2, rules="tp",
               description="one 8-GPU host: 4-way EP x 2-way TP (heads, expert width)"),
    MeshPreset("v5p-128", expert=16, tensor=4, rules="pod", topology="v5p:4x4x4",
               description="64 v5p chips: experts over expert x tensor (64-way), heads over tensor=4"),
    MeshPreset("v5p-256", expert=32, tensor=4, rules="pod", topology="v5p:4x4x8",
               description="128 v5p chips: experts over expert x tensor (128-way), heads over tensor=4"),
    MeshPreset("v6e-256", data=2, expert=32, tensor=4, rules="pod", topology="v6e:16x16",
               description="256 v6e chips: experts 128-way, Engram rows 256-way, 2 data replicas"),
)}


def get_preset(name: str) -> MeshPreset:
    if name not in PRESETS:
        raise MeshError(f"unknown mesh preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name]


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,expert=2,tensor=2"`` (any subset; missing axes are 1) -> axis sizes."""
    shape = {a: 1 for a in AXES}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise MeshError(f"mesh spec {text!r}: expected axis=size items, got {part!r}")
        k, v = (s.strip() for s in part.split("=", 1))
        if k not in AXES:
            raise MeshError(f"mesh spec {text!r}: unknown axis {k!r}; axes are {AXES}")
        if not v.isdigit() or int(v) < 1:
            raise MeshError(f"mesh spec {text!r}: axis {k!r} needs a positive size, got {v!r}")
        shape[k] = int(v)
    return shape


def make_mesh(shape: dict[str, int] | MeshPreset | str | None = None, *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``Mesh`` with axes (data, expert, tensor) from sizes, a preset, a preset name or ``"data=2,..."``.

    ``None`` puts every device on ``expert``. Devices default to ``jax.devices()`` (all processes). With exactly
    as many devices as the mesh needs, the order comes from ``jax.make_mesh`` (topology-aware on TPU).
    """
    if isinstance(shape, str):
        shape = PRESETS[shape].shape if shape in PRESETS else parse_mesh(shape)
    elif isinstance(shape, MeshPreset):
        shape = shape.shape
    devices = list(jax.devices() if devices is None else devices)
    if shape is None:
        shape = {"data": 1, "expert": len(devices), "tensor": 1}
    unknown = set(shape) - set(AXES)
    if unknown:
        raise MeshError(f"unknown mesh axes {sorted(unknown)}; axes are {AXES}")
    sizes = tuple(int(shape.get(a, 1)) for a in AXES)
    need = math.prod(sizes)
    if need != len(devices):
        raise MeshError(f"mesh {dict(zip(AXES, sizes))} needs {need} devices but {len(devices)} are available "
                        f"(process count {jax.process_count()})")
    try:
        return jax.make_mesh(sizes, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
    except Exception:  # pragma: no cover - exotic device sets: plain row-major order
        return Mesh(np.asarray(devices).reshape(sizes), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def axis_size(mesh, axes: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def describe(mesh) -> str:
    return " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
