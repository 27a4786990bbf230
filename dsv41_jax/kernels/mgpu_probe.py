"""Mosaic GPU probe used to choose the Pallas GPU lowering (not part of the dispatch).

The CSA2 kernels are dominated by a row gather: each query reads 512 arbitrary 1 KB rows of the compressed cache.
On sm90, Mosaic GPU moves GMEM -> SMEM with TMA only (the hardware gather TMA is sm100+), so a row gather is one
TMA issue per row. This probe measures exactly that: per program, ``rows_per_step`` single-row TMA copies into
shared memory (one barrier each; a TMA box spans at most 256 elements per dimension, so a 512-wide row takes two
issues), then one TMA store of the staged block -> ``out[p] = table[idx[p]]``.
``benchmarks/bench_kernels.py`` times it against the same gather-copy written with the Triton lowering
(``triton_gather_copy``) on the same data, and reports both in the results table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


@functools.partial(jax.jit, static_argnames=("rows_per_step",))
def mgpu_gather_copy(table, idx, *, rows_per_step: int = 16):
    """table [R, D] (bf16), idx [P, K] int32 (valid rows) -> [P, K, D] = table[idx] via per-row TMA."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    r, d = table.shape
    p, k = idx.shape
    bk = rows_per_step
    steps = k // bk
    assert k % bk == 0
    cw = min(d, 256)
    nc = d // cw

    def body(idx_gmem, table_gmem, out_gmem, smem, bars):
        pid = jax.lax.axis_index("p")

        def step(s, carry):
            for j in range(bk):
                row = idx_gmem[pid, s * bk + j]
                for c in range(nc):  # a TMA box spans <= 256 elements per dimension
                    plgpu.copy_gmem_to_smem(table_gmem.at[pl.ds(row, 1), pl.ds(c * cw, cw)],
                                            smem.at[pl.ds(j, 1), pl.ds(c * cw, cw)], bars.at[j * nc + c])
            for j in range(bk * nc):
                plgpu.barrier_wait(bars.at[j])
            plgpu.copy_smem_to_gmem(smem, out_gmem.at[pid, pl.ds(s * bk, bk)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            return carry

        jax.lax.fori_loop(0, steps, step, 0)
        plgpu.wait_smem_to_gmem(0)

    kern = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((p, k, d), table.dtype),
        grid=(p,), grid_names=("p",),
        scratch_types=[plgpu.SMEM((bk, d), table.dtype), plgpu.Barrier(num_arrivals=1, num_barriers=bk * nc)],
    )
    return kern(idx, table)


@functools.partial(jax.jit, static_argnames=("rows_per_step", "num_warps", "interpret"))
def triton_gather_copy(table, idx, *, rows_per_step: int = 32, num_warps: int = 4, interpret: bool = False):
    """The same gather-copy with the Triton lowering (pointer-tensor gather, masked-free)."""
    from jax.experimental.pallas import triton as pltr

    r, d = table.shape
    p, k = idx.shape
    bk = rows_per_step

    def kernel(idx_ref, t_ref, o_ref):
        pid = pl.program_id(0)

        def step(s, carry):
            rows = idx_ref[pid, pl.ds(s * bk, bk)]
            x = pltr.load(t_ref.at[rows[:, None], jnp.arange(d)[None, :]])
            o_ref[pid, pl.ds(s * bk, bk), :] = x
            return carry

        jax.lax.fori_loop(0, k // bk, step, jnp.int32(0))

    return pl.pallas_call(kernel, grid=(p,), out_shape=jax.ShapeDtypeStruct((p, k, d), table.dtype),
                          compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=2),
                          interpret=interpret)(idx, table)
