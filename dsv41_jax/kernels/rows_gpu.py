"""A row gather that reads its table where it lies: the Engram tables in pinned host memory, read by the GPU itself.

Why: the release's Engram tables (≈ 200 GB FP8) live in host memory (``inference.host_tables``) and a decode step
needs a few KB of them per token. Gathered on the host inside the step (``ops.gather`` "host": XLA's host-compute
thunks) the rows cost the H200 ≈ 1 ms a step: XLA:GPU runs the host part on a thread pool after a device-to-host
copy that waits for the compute stream, and the matching "done" thunk blocks the thread that enqueues the step's
kernels until the host part has finished — so every step drains the device's queue twice and restarts it from an
idle device, whatever the schedule (benchmarks/RESULTS.md, 2026-12-03). Pinned host memory is mapped into the
GPU's address space (CUDA unified addressing), and XLA hands a host-memory-space operand to a custom call as its
host address (no copy in the H200 compile: ``benchmarks/engram_host_rows_hlo.py``), so one small kernel gathers
the rows over the host link with no host thread, no synchronisation and no copy of the table: ≈ 400 KB per step at
batch 32. On an H200 the 40-layer bench model's step then costs +0.1 % (batch 32) / +0.5 % (batch 1) over tables
in HBM, and the rows equal the HBM gather's bit for bit (benchmarks/RESULTS.md, 2026-12-03 13:30 UTC).

``take_rows``: table [N, W] (any dtype; in host or device memory), ids int [...] -> [..., W] in device memory,
ids clamped into [0, N) (as ``ops.gather.take_rows``). Bytes are copied unchanged, so the result equals the
device-memory gather bit for bit. Each program gathers a block of rows as one masked pointer-tensor load (all its
rows' reads in flight at once: the host link's latency is paid once per block, not per row).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def take_rows(table: jax.Array, ids: jax.Array, *, block_rows: int = 32, num_warps: int = 4,
              interpret: bool = False) -> jax.Array:
    """``table[clip(ids, 0, N - 1)]`` along axis 0 by a Pallas (Triton) kernel; see the module docstring."""
    if table.ndim != 2:
        raise ValueError(f"take_rows: table must be [rows, width], got shape {table.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"take_rows: ids must be integers, got {ids.dtype}")
    n, w = table.shape
    m = math.prod(ids.shape)
    flat = jnp.clip(ids.reshape(m).astype(jnp.int32), 0, n - 1)
    bn = min(_pow2(block_rows), _pow2(max(m, 1)))
    mp = -(-max(m, 1) // bn) * bn
    if mp != m:
        flat = jnp.pad(flat, (0, mp - m))  # row 0: a valid read, sliced off below
    wp = _pow2(w)

    def kernel(ids_ref, t_ref, o_ref):
        rows = ids_ref[pl.ds(pl.program_id(0) * bn, bn)]
        cols = jnp.arange(wp)
        inside = cols < w
        vals = pltr.load(t_ref.at[rows[:, None], cols[None, :]], mask=inside[None, :], other=0)
        o_ref[pl.ds(pl.program_id(0) * bn, bn), :] = vals

    out = pl.pallas_call(kernel, grid=(mp // bn,), out_shape=jax.ShapeDtypeStruct((mp, wp), table.dtype),
                         compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
                         interpret=interpret, name="engram_host_rows")(flat, table)
    return out[:m, :w].reshape(tuple(ids.shape) + (w,))
