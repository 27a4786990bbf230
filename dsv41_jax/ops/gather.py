"""Row gathers whose gradient is accumulated in float32.

The transpose of a gather is a scatter-add into the table. When the table is bf16, a plain gather transposes to a
bf16 scatter-add: an embedding row read by thousands of tokens, a compressed KV entry picked by hundreds of queries
or an Engram row shared by many n-grams then sums hundreds of same-sign contributions in 8 mantissa bits, and the
sum stalls (relative errors of several percent to tens of percent, benchmarks/RESULTS.md). ``take_rows`` /
``take_rows_batched`` gather in the table's dtype (no full-table upcast in the forward) but scatter-add their
cotangent into a float32 buffer, rounding to the table's dtype once at the end.

The same stall happens to an array that ``lax.map`` / ``lax.scan`` closes over: its cotangent is carried across the
iterations in the array's own dtype. Callers therefore upcast such shared arrays (compressed KV, indexer keys) to
float32 before the map — cheap, they carry no head axis — and gather from the float32 copy inside.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _take(table: jax.Array, ids: jax.Array, out_dtype, batched: bool) -> jax.Array:
    if batched:
        rows = jax.vmap(lambda t_b, i_b: jnp.take(t_b, i_b, axis=0, mode="clip"))(table, ids)
    else:
        rows = jnp.take(table, ids, axis=0, mode="clip")
    return rows.astype(out_dtype)


def _take_fwd(table, ids, out_dtype, batched):
    # the table rides along only for its shape / dtype (it is live anyway: a parameter or a cached activation)
    return _take(table, ids, out_dtype, batched), (table, ids)


def _take_bwd(out_dtype, batched, res, g):
    table, ids = res
    acc = jnp.zeros(table.shape, jnp.float32)
    g = g.astype(jnp.float32)
    if batched:
        b_idx = jnp.arange(table.shape[0]).reshape((-1,) + (1,) * (ids.ndim - 1))
        acc = acc.at[b_idx, ids].add(g, mode="clip")
    else:
        acc = acc.at[ids].add(g, mode="clip")
    return acc.astype(table.dtype), None


_take.defvjp(_take_fwd, _take_bwd)


def take_rows(table: jax.Array, ids: jax.Array, dtype=None) -> jax.Array:
    """``table[ids]`` along axis 0 (indices clamped into [0, N)), as ``dtype`` (default: the
    table's); the gradient w.r.t. ``table`` is scatter-added in float32. table [N, ...], ids int [...]."""
    return _take(table, ids, jnp.dtype(table.dtype if dtype is None else dtype), False)


def take_rows_batched(table: jax.Array, ids: jax.Array, dtype=None) -> jax.Array:
    """Per batch row: table [B, N, ...], ids int [B, ...] -> [B, ..., *table.shape[2:]] (``table[b][ids[b]]``), as
    ``dtype``; the gradient w.r.t. ``table`` is scatter-added in float32."""
    return _take(table, ids, jnp.dtype(table.dtype if dtype is None else dtype), True)


def in_host_memory(x) -> bool:
    """Whether ``x`` (an array, or a tracer under jit) lives in host memory (a ``pinned_host`` / ``unpinned_host``
    sharding): XLA cannot gather from it in a device computation."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


HOST_GATHERS = ("kernel", "host")  # how a host-memory table's rows reach the device (take_rows_from_host)


def host_gather_default() -> str:
    """"kernel" on one CUDA GPU (the GPU reads the rows from pinned host memory itself), "host" elsewhere. Not on
    several devices: a table row-sharded over a mesh (``parallel.api``'s "engram_rows") would reach the kernel (a
    custom call, which the SPMD partitioner does not split) whole; the sharded form (each device's kernel reading
    its own rows, then a sum) is not built."""
    return "kernel" if jax.default_backend() in ("gpu", "cuda") and jax.device_count() == 1 else "host"


def take_rows_from_host(table: jax.Array, ids: jax.Array, how: str | None = None) -> jax.Array:
    """``table[ids]`` along axis 0 (indices clamped into [0, N)) for a table in host memory; only the looked-up
    rows move to the device — the table's bytes never do. Inference only (no gradient to a host table). table
    [N, ...], ids int [...] on the device -> [..., *table.shape[1:]] in the table's dtype, in device memory.

    ``how`` (``HOST_GATHERS``; None: ``host_gather_default()``):
    * ``"kernel"`` (CUDA GPUs; an unsharded table): a GPU kernel reads the rows straight from the pinned host memory
      over the host link (``kernels.rows_gpu.take_rows``): no host thread, no synchronisation inside the step.
    * ``"host"``: the ids move to the host, the rows are gathered there (``compute_on("device_host")``) and moved
      back. Any backend with host compute; on an H200 it cost ≈ 1 ms a step, because XLA:GPU's host-compute
      "done" blocks the thread that enqueues the step (``kernels.rows_gpu``; benchmarks/RESULTS.md).

    Why: the release's Engram tables (≈ 200 GB FP8) do not fit the devices' memory with the rest of the model; a
    decode step reads a few KB of them per token."""
    how = host_gather_default() if how is None else how
    if how not in HOST_GATHERS:
        raise ValueError(f"host-table gather must be one of {HOST_GATHERS}, got {how!r}")
    if how == "kernel":
        from dsv41_jax.kernels.rows_gpu import take_rows as gpu_take_rows

        flat = table.reshape(table.shape[0], -1) if table.ndim != 2 else table
        return gpu_take_rows(flat, ids).reshape(tuple(ids.shape) + tuple(table.shape[1:]))
    ids = jnp.clip(ids, 0, table.shape[0] - 1)  # clamped on the device: the host gather may then promise bounds
    ids_host = jax.device_put(ids, jax.memory.Space.Host)
    gather = _on_host(lambda t, i: t.at[i].get(mode="promise_in_bounds"))
    return jax.device_put(gather(table, ids_host), jax.memory.Space.Device)


def _on_host(fn):
    """``fn`` run on the host (XLA's ``_xla_compute_type = "host"``), its results left in host memory. The
    function form of JAX's ``compute_on``: named ``compute_on2`` in JAX 0.10 (whose ``compute_on`` is a context
    manager), ``compute_on`` itself in JAX 0.11 (found on an NVIDIA H200's JAX 0.11.2: the context-manager call
    failed there with a missing ``compute_type``)."""
    import inspect

    from jax.experimental import compute_on as C

    form = getattr(C, "compute_on2", None)
    if form is None:
        form = C.compute_on
        if "out_memory_spaces" not in inspect.signature(form).parameters:
            raise RuntimeError("this JAX's compute_on has neither the function form (compute_on2) nor "
                               "out_memory_spaces: host-memory gathers need JAX 0.10 or later")
    return form(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
