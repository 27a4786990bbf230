"""The golden PartitionSpec table of a config under a mesh preset: one line per parameter (layers with identical
shape, axes and spec grouped), checked in as ``tests/golden/partition_specs_<preset>.txt`` and compared in CI."""

from __future__ import annotations

import re

import jax
from jax.sharding import AbstractMesh, PartitionSpec as P

from dsv41_jax.model.params import flat_specs
from dsv41_jax.parallel.api import _is_engram_table, padded_rows, param_partition_specs
from dsv41_jax.parallel.mesh import AXES, get_preset
from dsv41_jax.parallel.rules import get_rules

_LAYER = re.compile(r"^(layers|dspark/blocks)/(\d+)/")


def _ranges(ids: list[int]) -> str:
    ids = sorted(ids)
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def abstract_mesh(preset) -> AbstractMesh:
    p = get_preset(preset) if isinstance(preset, str) else preset
    return AbstractMesh(tuple(p.shape[a] for a in AXES), AXES)


def partition_spec_table(config, preset: str, *, include_dspark: bool = True) -> str:
    p = get_preset(preset)
    mesh = abstract_mesh(p)
    rules = get_rules(p.rules)
    specs = jax.tree.leaves(param_partition_specs(config, mesh, rules, include_dspark=include_dspark),
                            is_leaf=lambda x: isinstance(x, P))
    groups: dict[tuple, list[int]] = {}
    order: list[tuple] = []
    for (path, s), spec in zip(flat_specs(config, include_dspark=include_dspark), specs):
        shape = s.shape
        if _is_engram_table(path):
            shape = f"{s.shape} padded to {padded_rows(s.shape[0], mesh, rules)} rows"
        m = _LAYER.match(path)
        key_path, layer = (f"{m.group(1)}/{{}}/{path[m.end():]}", int(m.group(2))) if m else (path, None)
        key = (key_path, str(shape), str(tuple(s.axes)), str(spec))
        if key not in groups:
            groups[key] = []
            order.append(key)
        if layer is not None:
            groups[key].append(layer)
    lines = [f"# dsv41_jax parameter PartitionSpecs: config {config.name}, preset {p.name} "
             f"(mesh {' x '.join(f'{a}={p.shape[a]}' for a in AXES)}, rules {rules.name})",
             "# path | shape | logical axes | PartitionSpec"]
    for key in order:
        path = key[0].format("[" + _ranges(groups[key]) + "]") if "{}" in key[0] else key[0]
        lines.append(f"{path} | {key[1]} | {key[2]} | {key[3]}")
    return "\n".join(lines) + "\n"
