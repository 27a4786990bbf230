"""The routed experts' grouped GEMM on Hopper GPUs through JAX's own Pallas Mosaic GPU ragged-dot kernels
(``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`` / ``transposed_ragged_dot_mgpu``: persistent, TMA-fed
warpgroup MMA kernels that read each group's weight in place), wrapped as one differentiable product:

* forward  ``y = x · w[g]ᵀ``   — ``ragged_dot(x, w, transpose_rhs=True)``      (x [M, K], w [G, N, K] -> [M, N])
* dX       ``dx = dy · w[g]``  — ``ragged_dot(dy, w, transpose_rhs=False)``     ([M, N] -> [M, K])
* dW       ``dw[g] = dy_gᵀ · x_g`` — ``transposed_ragged_dot(dy, x)``           (-> [G, N, K])

The rows are sorted by group with no padding (the kernels mask the rows of a block that belong to another group).
These kernels exist only for Hopper (``sm_90a``) and have no interpret mode, so on CPU the same VJP runs with the
``jax.lax`` ragged products in their place (``impl="reference"``): the tests check the wiring of the VJP there, and
the device benchmark checks the kernels' values against float32 (benchmarks/bench_grouped_gemm.py). Tiles: the
``MGPU_TILES`` entry per product (read at trace time).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# 128 x 128 x 64 tiles, 4 stages: first guesses (benchmarks/bench_grouped_gemm.py sweeps them). ``grid_block_n`` is
# the widest band of output column tiles the persistent loop walks before stepping to the next row tiles
# (``planar_snake``'s tile width): a ceiling, lowered per product and shape by :func:`product_tiles` until it divides
# that product's output columns. A ceiling of 4 instead of 1 (giving 2 or 4 at the fullwidth4 shapes) took the
# train step from 173.8 to 167.2 ms on an H200 with bit-identical first-step loss and gradient norm
# (benchmarks/RESULTS.md, 2026-12-02 12:33).
MGPU_TILES = {
    "fwd": {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 4},
    "dx": {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 4},
    "dw": {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 4},
}


def output_columns(kind: str, k: int, n: int) -> int:
    """The output dimension a product's kernel tiles by ``block_n`` (and bands by ``grid_block_n``), for
    x [M, k] and w [G, n, k]: the forward's y [M, n]; dX's [M, k]; dW's [G, n, k], whose kernel
    (``transposed_ragged_dot``) computes each group's [n, k] block with n as its rows."""
    if kind not in ("fwd", "dx", "dw"):
        raise ValueError(f"grouped_gemm_mgpu: product kind must be fwd, dx or dw, got {kind!r}")
    return n if kind == "fwd" else k


def product_tiles(kind: str, k: int, n: int, tiles: dict | None = None) -> dict:
    """``tiles[kind]`` with ``grid_block_n`` lowered (halved, down to 1) until ``grid_block_n x block_n`` divides the
    product's output columns (:func:`output_columns`). JAX's own tile search for these kernels skips bands that do
    not divide the columns, so only dividing bands are used: e.g. a ceiling of 4 gives 4 for 5120 columns
    (40 tiles of 128) and 2 for 2304 (18 tiles)."""
    cols = output_columns(kind, k, n)
    t = dict((tiles or MGPU_TILES)[kind])
    band = max(1, int(t.get("grid_block_n", 1)))
    while band > 1 and cols % (band * t["block_n"]):
        band //= 2
    t["grid_block_n"] = band
    return t


MAX_GROUPS = 64  # the forward kernel finds a block's group by a loop over the groups unrolled into the kernel


def mgpu_fits(m: int, k: int, n: int, groups: int = 16, tiles: dict | None = None) -> bool:
    """Whether the products of x [m, k] and w [groups, n, k] suit the kernels: their tiles divide (each ragged
    dot's contraction a multiple of block_k; each product's output columns a multiple of block_n x its
    ``grid_block_n`` from :func:`product_tiles`; the dW rows a multiple of block_m), and at most ``MAX_GROUPS``
    groups (the release's 384 experts would unroll 384 steps into every tile's prologue)."""
    t = tiles or MGPU_TILES
    if groups > MAX_GROUPS or k % t["fwd"]["block_k"] or n % t["dx"]["block_k"] or n % t["dw"]["block_m"]:
        return False
    for kind in ("fwd", "dx", "dw"):
        pt = product_tiles(kind, k, n, t)
        if output_columns(kind, k, n) % (pt["block_n"] * pt["grid_block_n"]):
            return False
    return True


def _products(impl: str, tiles: dict):
    if impl == "reference":
        def fwd(x, w, gs):
            return jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), gs, preferred_element_type=jnp.float32
                                      ).astype(x.dtype)

        def dx(dy, w, gs):
            return jax.lax.ragged_dot(dy, w, gs, preferred_element_type=jnp.float32).astype(dy.dtype)

        def dw(dy, x, gs):
            dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                                     lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
            return jax.lax.ragged_dot_general(dy, x, gs, dims, preferred_element_type=jnp.float32)
        return fwd, dx, dw
    if impl != "mgpu":
        raise ValueError(f"grouped_gemm_mgpu: impl must be 'mgpu' or 'reference', got {impl!r}")
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    def checked(kind, k, n):
        t = product_tiles(kind, k, n, tiles)
        if output_columns(kind, k, n) % (t["block_n"] * t["grid_block_n"]):
            raise ValueError(f"grouped_gemm_mgpu: {kind} output columns {output_columns(kind, k, n)} are not a "
                             f"multiple of block_n {t['block_n']} (x [M, {k}], w [G, {n}, {k}]); check mgpu_fits")
        return t

    def fwd(x, w, gs):
        return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=gs, transpose_rhs=True,
                                          **checked("fwd", w.shape[2], w.shape[1]))

    def dx(dy, w, gs):
        return ragged_dot_mgpu.ragged_dot(dy, w, group_sizes=gs, transpose_rhs=False,
                                          **checked("dx", w.shape[2], w.shape[1]))

    def dw(dy, x, gs):
        return transposed_ragged_dot_mgpu.transposed_ragged_dot(dy, x, group_sizes=gs,
                                                                **checked("dw", x.shape[1], dy.shape[1]))
    return fwd, dx, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def ragged_gemm(x, w, group_sizes, impl: str, tiles: tuple):
    """``x`` [M, K] sorted by group (``group_sizes`` [G] int32, summing to M) times its group's ``w`` [G, N, K]
    transposed -> [M, N] in x.dtype (float32 accumulation). ``tiles``: :func:`tiles_key` of a ``MGPU_TILES``-like
    dict."""
    return _products(impl, _untuple(tiles))[0](x, w, group_sizes)


def _fwd(x, w, group_sizes, impl, tiles):
    return ragged_gemm(x, w, group_sizes, impl, tiles), (x, w, group_sizes)


def _bwd(impl, tiles, res, g):
    x, w, group_sizes = res
    _, dx, dw = _products(impl, _untuple(tiles))
    g = g.astype(x.dtype)
    return dx(g, w, group_sizes), dw(g, x, group_sizes).astype(w.dtype), None


ragged_gemm.defvjp(_fwd, _bwd)


def tiles_key(tiles: dict) -> tuple:
    return tuple((k, tuple(sorted(v.items()))) for k, v in sorted(tiles.items()))


def _untuple(key: tuple) -> dict:
    return {k: dict(v) for k, v in key}


__all__ = ["MGPU_TILES", "mgpu_fits", "output_columns", "product_tiles", "ragged_gemm", "tiles_key"]
