"""Engram tables in host memory (serving).

The release's Engram tables are ≈ 200 GB of FP8 rows: with them on the devices the model needs 8 × H200, without
them 4 (benchmarks/RESULTS.md). A decode step reads a few KB of them per token. ``tables_to_host`` places every
Engram table (``.../engram/embed``: a float array or a release-format QuantizedTensor's values and scales) in host
memory with its sharding otherwise unchanged; ``ops.engram.table_rows`` then sees the host memory space under jit
and fetches only the step's rows (``ops.gather.take_rows_from_host``): on one CUDA GPU a kernel reads them from the
pinned host memory itself (``kernels.rows_gpu``), elsewhere XLA gathers them on the host and moves them over.
Inference only: a host table has no gradient path."""

from __future__ import annotations

import jax

from dsv41_jax.model.release_weights import _map_with_path

ENGRAM_TABLE = ("engram", "embed")  # the (parent, name) of Engram row tables in the parameter tree
PLACEMENTS = ("device", "host")
DEVICE_HEADROOM = 1.0  # "auto" moves the tables only where weights + cache cannot fit at all: a placement that
# could have run on the device is never changed. On an H200 the host tables cost +0.1 % / +0.5 % of the 40-layer
# bench model's batch-32 / batch-1 step with the GPU reading the rows (2026-12-03 13:30 UTC); the host gathers inside
# the step ("host" form, still the one off a single CUDA GPU) cost 15 % / 35 % of the 12-layer step
# (benchmarks/RESULTS.md, 09:55 UTC)


def is_engram_table(path: str) -> bool:
    return tuple(path.split("/")[-2:]) == ENGRAM_TABLE


def _to_memory(x, memory_kind: str):
    sharding = getattr(x, "sharding", None)
    if sharding is None:  # not yet on a device: the default device
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.device_put(x, sharding.with_memory_kind(memory_kind))


def place_engram_tables(params: dict, placement: str = "host", memory_kind: str = "pinned_host") -> dict:
    """``params`` with every Engram table in host memory (``placement="host"``, as ``memory_kind``) or in device
    memory (``"device"``); every other leaf is returned as is."""
    from dsv41_jax.checkpoint.quantized import QuantizedTensor

    if placement not in PLACEMENTS:
        raise ValueError(f"Engram table placement must be one of {PLACEMENTS}, got {placement!r}")
    kind = memory_kind if placement == "host" else "device"

    def place(path, leaf):
        if not is_engram_table(path):
            return leaf
        inner = getattr(leaf, "weight", None)  # an Fp8GemmInput mark keeps its table inside
        if inner is not None:
            import dataclasses

            return dataclasses.replace(leaf, weight=place(path, inner))
        if isinstance(leaf, QuantizedTensor):
            import dataclasses

            return dataclasses.replace(leaf, values=_to_memory(leaf.values, kind), scales=_to_memory(leaf.scales,
                                                                                                     kind))
        return _to_memory(leaf, kind)

    return _map_with_path(place, params)


def engram_table_bytes(params: dict) -> dict:
    """{"host": bytes of Engram tables in host memory, "device": in device memory}."""
    from dsv41_jax.ops.gather import in_host_memory

    out = {"host": 0, "device": 0}

    def count(path, leaf):
        if is_engram_table(path):
            inner = getattr(leaf, "weight", leaf)
            for a in (inner.values, inner.scales) if hasattr(inner, "values") else (inner,):
                out["host" if in_host_memory(a) else "device"] += int(a.size * a.dtype.itemsize)
        return leaf

    _map_with_path(count, params)
    return out


def per_device_bytes(tree) -> int:
    """Bytes of ``tree``'s arrays held by one device: a committed array's first shard (its whole size if it is
    unsharded or not yet placed)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shards = getattr(x, "addressable_shards", None)
        total += int(shards[0].data.nbytes) if shards else int(x.size * x.dtype.itemsize)
    return total


def choose_placement(param_bytes: int, table_bytes: int, cache_bytes: int, device_bytes: int | None,
                     headroom: float = DEVICE_HEADROOM) -> str:
    """``"host"`` when weights + cache (per device) exceed ``headroom`` of the device's memory with the Engram
    tables on it, else ``"device"``; an unknown device memory (``None``: e.g. the CPU backend) gives ``"device"``.
    ``param_bytes`` includes the tables' ``table_bytes``."""
    if device_bytes is None or table_bytes == 0:
        return "device"
    return "host" if param_bytes + cache_bytes > headroom * device_bytes else "device"


def device_memory_bytes(device=None) -> int | None:
    """The allocator's limit on ``device`` (default: the first device), or None where the backend reports none."""
    stats = (device or jax.devices()[0]).memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None
