"""Pallas GPU kernel (Triton lowering): mHC's ``comb`` coefficients — a row softmax of each token's hc x hc logits,
then Sinkhorn normalisation — in one kernel.

``ops.mhc.mhc_coefficients`` computes ``comb`` in float32 as softmax over j, + eps, a column normalisation, and
``sinkhorn_iters - 1`` (row, column) normalisation pairs. Written in XLA, every normalisation of the tiny hc x hc
matrix is a reduction that XLA does not chain with the next one, so a decode step launched about eight small
reduction kernels per mHC site (measured on an H200: ``input_reduce_fusion``, 201 launches per batch-1 step of the
12-layer bench model, 24 sites). Here each program holds a block of tokens' hc * hc entries as hc * hc vectors in
registers, and every sum over a row or column is a chain of adds: one launch per site, the same float32 maths.
Sums run left to right over the hc entries, so results can differ from XLA's reduction order in the last bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

BLOCK_TOKENS = 128


def _sum(vs):
    out = vs[0]
    for v in vs[1:]:
        out = out + v
    return out


def _normalize_rows(c, hc, eps):
    out = list(c)
    for i in range(hc):
        s = _sum(c[i * hc:(i + 1) * hc]) + eps
        for j in range(hc):
            out[i * hc + j] = c[i * hc + j] / s
    return out


def _normalize_cols(c, hc, eps):
    out = list(c)
    for j in range(hc):
        s = _sum(c[j::hc]) + eps
        for i in range(hc):
            out[i * hc + j] = c[i * hc + j] / s
    return out


@functools.partial(jax.jit, static_argnames=("hc", "eps", "iters", "block", "interpret"))
def sinkhorn_comb(logits, *, hc: int, eps: float, iters: int, block: int = BLOCK_TOKENS, interpret: bool = False):
    """logits float32 [N, hc * hc] (row i, column j at i * hc + j) -> comb float32 [N, hc * hc]."""
    n, m = logits.shape
    if m != hc * hc:
        raise ValueError(f"sinkhorn_comb: logits must be [tokens, {hc * hc}] for hc = {hc}, got {logits.shape}")
    if iters < 1:
        raise ValueError(f"sinkhorn_comb: iters must be >= 1, got {iters}")
    logits = logits.astype(jnp.float32)

    def kernel(x_ref, o_ref):
        rows = pl.program_id(0) * block + jnp.arange(block)
        ok = rows < n
        safe = jnp.minimum(rows, n - 1)
        x = [pltr.load(x_ref.at[safe, k], mask=ok, other=0.0) for k in range(m)]
        c = []
        for i in range(hc):  # softmax over j, + eps
            row = x[i * hc:(i + 1) * hc]
            mx = row[0]
            for v in row[1:]:
                mx = jnp.maximum(mx, v)
            e = [jnp.exp(v - mx) for v in row]
            s = _sum(e)
            c += [v / s + eps for v in e]
        c = _normalize_cols(c, hc, eps)

        def body(_, cc):
            return tuple(_normalize_cols(_normalize_rows(list(cc), hc, eps), hc, eps))

        c = jax.lax.fori_loop(0, iters - 1, body, tuple(c))
        for k in range(m):
            pltr.store(o_ref.at[rows, k], c[k], mask=ok)

    return pl.pallas_call(
        kernel, grid=(pl.cdiv(n, block),),
        out_shape=jax.ShapeDtypeStruct((n, m), jnp.float32),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1), interpret=interpret, name="mhc_sinkhorn",
    )(logits)


__all__ = ["sinkhorn_comb"]
