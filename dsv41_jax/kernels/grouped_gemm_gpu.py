"""Pallas GPU kernels (Triton lowering) for the train step's routed-expert GEMMs: a grouped GEMM that reads every
expert's weight in place, with both backward GEMMs.

The rows of the routed (token, slot) pairs are sorted by expert and each expert's run is padded to whole blocks of
``block_m`` rows (``ops.moe.blocked_grouped_matmul`` builds that layout), so every row block belongs to one expert.
The XLA form of that layout gathers each block's expert weight into a [blocks, N, K] copy before a batched GEMM and
sums the per-block weight gradients per expert afterwards (measured on an NVIDIA H200 as ≈ 19 ms of a 200 ms
`fullwidth4` step, benchmarks/RESULTS.md). Here the block's expert id is a scalar loaded in the kernel and used as
the leading index of the stacked weight, so no copy is made:

* ``grouped_gemm_fwd``:  ``out[block] = x[block] · w[e(block)]ᵀ``   (x [Mp, K], w [G, N, K] -> [Mp, N])
* ``grouped_gemm_dx``:   ``dx[block]  = dy[block] · w[e(block)]``   (dy [Mp, N] -> [Mp, K])
* ``grouped_gemm_dw``:   ``dw[g] = Σ_{blocks of g} dy[block]ᵀ · x[block]``  (-> [G, N, K] float32); one program per
  (g, N tile, K tile) loops over the group's blocks, so an empty group gets zeros and nothing is summed twice.

All three accumulate in float32 (IEEE float32 products for float32 operands, bf16 tensor-core products with float32
accumulation for 16-bit ones); fwd / dx store in the operands' dtype, as ``ragged_dot`` does. Blocks at or past
``n_live`` (the static bound on the number of blocks exceeds the blocks the groups use) write zeros and read nothing.
Programs run on a 1-D grid ordered so that neighbouring programs share operand tiles in L2 (``group_m`` row blocks
side by side over the output's column tiles, as a tiled GEMM's usual swizzle). The shapes must divide the tiles
(:func:`grouped_tiles` picks dividing power-of-two tiles or says None, and the caller keeps its XLA path).

Addressing: the Triton lowering uses 32-bit signed element offsets; operands of 2^31 elements or more are refused
by :func:`grouped_tiles`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from dsv41_jax.kernels.expert_gemm_gpu import _largest_pow2_divisor

# Tiles (read at trace time; a benchmark may set them around a trace). block_m is also the row-block size of the
# padded layout. First guesses, not swept: on an H200 the train step's forward ran at ≈ 595 TFLOP/s, dW ≈ 544 and dX
# ≈ 369 with these (benchmarks/RESULTS.md, 2026-12-02 11:24); benchmarks/bench_grouped_gemm.py sweeps them. Its first
# H200 sweep found the dX tile the weak one (128 x 64 or 256 x 64: 2.8 ms against 3.8 over both shapes); this kernel
# runs off Hopper, where no sweep has run, so the guesses stay until one does.
GROUPED_TILES = {
    "block_m": 128,
    "fwd": {"block_n": 128, "block_k": 64, "group_m": 8, "num_warps": 8, "num_stages": 3},
    "dx": {"block_n": 64, "block_k": 128, "group_m": 8, "num_warps": 8, "num_stages": 3},
    "dw": {"block_n": 128, "block_k": 128, "block_r": 64, "num_warps": 8, "num_stages": 3},
}


def grouped_tiles(k: int, n: int, n_elements: int, tiles: dict | None = None) -> dict | None:
    """The tiles (``GROUPED_TILES`` shrunk to powers of two that divide K and N) for a grouped GEMM of reduction
    ``k`` and ``n`` outputs whose largest operand has ``n_elements`` elements; None where no tile of ≥ 16 divides
    or the operands are too large for 32-bit offsets."""
    t = tiles or GROUPED_TILES
    if n_elements >= 2 ** 31:
        return None
    out = {"block_m": t["block_m"]}
    for kind, (dim_n, dim_k) in (("fwd", (n, k)), ("dx", (k, n)), ("dw", (n, k))):
        cfg = dict(t[kind])
        bn, bk = _largest_pow2_divisor(dim_n, cfg["block_n"]), _largest_pow2_divisor(dim_k, cfg["block_k"])
        if bn is None or bk is None:
            return None
        cfg.update(block_n=bn, block_k=bk)
        if kind == "dw":
            cfg["block_r"] = min(cfg["block_r"], t["block_m"])
        out[kind] = cfg
    return out


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def _dot(a, b, contract):
    """float32 product of two tiles contracting dims ``contract`` = (a's, b's)."""
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=_precision(a.dtype),
                               preferred_element_type=jnp.float32)


def _swizzle(pid, n_row_blocks: int, n_col_tiles: int, group_m: int):
    """1-D program id -> (row block, column tile): ``group_m`` row blocks side by side over all column tiles, so the
    programs running at once share their row blocks' and columns' tiles in L2."""
    per_group = group_m * n_col_tiles
    first = (pid // per_group) * group_m
    rows_here = jnp.minimum(n_row_blocks - first, group_m)
    local = pid % per_group
    return first + local % rows_here, local // rows_here


def _check(what: str, **dims):
    for name, (size, tile) in dims.items():
        if size % tile:
            raise ValueError(f"{what}: {name} {size} is not a multiple of its tile {tile} (grouped_tiles picks "
                             f"dividing tiles)")


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages",
                                             "interpret"))
def grouped_gemm_fwd(x, w, block_group, n_live, *, block_m: int, block_n: int, block_k: int, group_m: int = 8,
                     num_warps: int = 8, num_stages: int = 3, interpret: bool = False):
    """x [Mp, K] in blocks of ``block_m`` rows; w [G, N, K]; block_group int32 [Mp / block_m]; n_live int32 [1]
    -> [Mp, N] in x.dtype: row block b times w[block_group[b]]ᵀ."""
    mp, k = x.shape
    _, n, _ = w.shape
    bm, bn, bk = block_m, block_n, block_k
    _check("grouped_gemm_fwd", rows=(mp, bm), N=(n, bn), K=(k, bk))
    n_blocks, n_tiles, n_steps = mp // bm, n // bn, k // bk

    def kernel(bg_ref, live_ref, x_ref, w_ref, o_ref):
        b, j = _swizzle(pl.program_id(0), n_blocks, n_tiles, group_m)
        r0, n0 = pl.multiple_of(b * bm, bm), pl.multiple_of(j * bn, bn)

        @pl.when(b < live_ref[0])
        def _():
            e = bg_ref[b]

            def body(t, acc):
                k0 = pl.multiple_of(t * bk, bk)
                return acc + _dot(x_ref[pl.ds(r0, bm), pl.ds(k0, bk)], w_ref[e, pl.ds(n0, bn), pl.ds(k0, bk)], (1, 1))

            acc = jax.lax.fori_loop(0, n_steps, body, jnp.zeros((bm, bn), jnp.float32))
            o_ref[pl.ds(r0, bm), pl.ds(n0, bn)] = acc.astype(o_ref.dtype)

        @pl.when(b >= live_ref[0])
        def _():
            o_ref[pl.ds(r0, bm), pl.ds(n0, bn)] = jnp.zeros((bm, bn), o_ref.dtype)

    return pl.pallas_call(
        kernel, grid=(n_blocks * n_tiles,), out_shape=jax.ShapeDtypeStruct((mp, n), x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages), interpret=interpret,
        name="grouped_gemm_fwd",
    )(block_group, n_live, x, w)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages",
                                             "interpret"))
def grouped_gemm_dx(dy, w, block_group, n_live, *, block_m: int, block_n: int, block_k: int, group_m: int = 8,
                    num_warps: int = 8, num_stages: int = 3, interpret: bool = False):
    """dy [Mp, N]; w [G, N, K] -> [Mp, K] in dy.dtype: row block b times w[block_group[b]]. ``block_n`` tiles the
    output's K columns, ``block_k`` the loop over N."""
    mp, n = dy.shape
    _, _, k = w.shape
    bm, bn, bk = block_m, block_n, block_k
    _check("grouped_gemm_dx", rows=(mp, bm), K=(k, bn), N=(n, bk))
    n_blocks, n_tiles, n_steps = mp // bm, k // bn, n // bk

    def kernel(bg_ref, live_ref, dy_ref, w_ref, o_ref):
        b, j = _swizzle(pl.program_id(0), n_blocks, n_tiles, group_m)
        r0, c0 = pl.multiple_of(b * bm, bm), pl.multiple_of(j * bn, bn)

        @pl.when(b < live_ref[0])
        def _():
            e = bg_ref[b]

            def body(t, acc):
                n0 = pl.multiple_of(t * bk, bk)
                return acc + _dot(dy_ref[pl.ds(r0, bm), pl.ds(n0, bk)], w_ref[e, pl.ds(n0, bk), pl.ds(c0, bn)],
                                  (1, 0))

            acc = jax.lax.fori_loop(0, n_steps, body, jnp.zeros((bm, bn), jnp.float32))
            o_ref[pl.ds(r0, bm), pl.ds(c0, bn)] = acc.astype(o_ref.dtype)

        @pl.when(b >= live_ref[0])
        def _():
            o_ref[pl.ds(r0, bm), pl.ds(c0, bn)] = jnp.zeros((bm, bn), o_ref.dtype)

    return pl.pallas_call(
        kernel, grid=(n_blocks * n_tiles,), out_shape=jax.ShapeDtypeStruct((mp, k), dy.dtype),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages), interpret=interpret,
        name="grouped_gemm_dx",
    )(block_group, n_live, dy, w)


@functools.partial(jax.jit, static_argnames=("n_groups", "block_n", "block_k", "block_r", "num_warps",
                                             "num_stages", "interpret"))
def grouped_gemm_dw(dy, x, group_row_start, group_rows, *, n_groups: int, block_n: int, block_k: int,
                    block_r: int, num_warps: int = 8, num_stages: int = 3, interpret: bool = False):
    """dy [Mp, N], x [Mp, K]; group g's rows are [group_row_start[g], + group_rows[g]) (multiples of ``block_r``)
    -> dw [G, N, K] float32 = Σ over those rows of dyᵀ · x. Grid (K tile, N tile, group), the group slowest: one
    group's operands (its rows of dy and x) stay in L2 while all of its tiles run."""
    mp, n = dy.shape
    _, k = x.shape
    bn, bk, br = block_n, block_k, block_r
    _check("grouped_gemm_dw", rows=(mp, br), N=(n, bn), K=(k, bk))

    def kernel(start_ref, rows_ref, dy_ref, x_ref, o_ref):
        kt, nt, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        n0, k0 = pl.multiple_of(nt * bn, bn), pl.multiple_of(kt * bk, bk)
        start = start_ref[g]

        def body(t, acc):
            r0 = pl.multiple_of(start + t * br, br)
            return acc + _dot(dy_ref[pl.ds(r0, br), pl.ds(n0, bn)], x_ref[pl.ds(r0, br), pl.ds(k0, bk)], (0, 0))

        acc = jax.lax.fori_loop(0, rows_ref[g] // br, body, jnp.zeros((bn, bk), jnp.float32))
        o_ref[g, pl.ds(n0, bn), pl.ds(k0, bk)] = acc

    return pl.pallas_call(
        kernel, grid=(k // bk, n // bn, n_groups), out_shape=jax.ShapeDtypeStruct((n_groups, n, k), jnp.float32),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages), interpret=interpret,
        name="grouped_gemm_dw",
    )(group_row_start, group_rows, dy, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def grouped_gemm(x, w, block_group, n_live, group_row_start, group_rows, tiles, interpret):
    """Differentiable ``out[block] = x[block] · w[block_group[block]]ᵀ`` over the padded block layout (module
    docstring); ``tiles`` from :func:`grouped_tiles` as a tuple of items (hashable), gradients by the dx / dw
    kernels (dw summed in float32, returned in w.dtype)."""
    t = _untuple(tiles)
    return grouped_gemm_fwd(x, w, block_group, n_live, block_m=t["block_m"], **t["fwd"], interpret=interpret)


def _fwd(x, w, block_group, n_live, group_row_start, group_rows, tiles, interpret):
    out = grouped_gemm(x, w, block_group, n_live, group_row_start, group_rows, tiles, interpret)
    return out, (x, w, block_group, n_live, group_row_start, group_rows)


def _bwd(tiles, interpret, res, g):
    x, w, block_group, n_live, group_row_start, group_rows = res
    t = _untuple(tiles)
    g = g.astype(x.dtype)  # the product's cotangent in the operands' dtype (bf16 GEMMs for a bf16 step)
    dx = grouped_gemm_dx(g, w, block_group, n_live, block_m=t["block_m"], **t["dx"], interpret=interpret)
    dw = grouped_gemm_dw(g, x, group_row_start, group_rows, n_groups=w.shape[0], **t["dw"], interpret=interpret)
    return dx, dw.astype(w.dtype), None, None, None, None


grouped_gemm.defvjp(_fwd, _bwd)


def tiles_key(tiles: dict) -> tuple:
    """``tiles`` (from :func:`grouped_tiles`) as a hashable tuple for :func:`grouped_gemm`'s static argument."""
    return tuple((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in sorted(tiles.items()))


def _untuple(key: tuple) -> dict:
    return {k: dict(v) if isinstance(v, tuple) else v for k, v in key}


__all__ = ["GROUPED_TILES", "grouped_tiles", "grouped_gemm", "grouped_gemm_fwd", "grouped_gemm_dx",
           "grouped_gemm_dw", "tiles_key"]
