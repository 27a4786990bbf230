"""Pallas TPU (Mosaic) kernels for CSA2 sparse attention and the indexer.

* ``attention_fwd``: grid (batch, query). Scalar prefetch (SMEM): query positions, window starts, floors and — when
  they fit (decode) — the top-k indices themselves; larger index lists (prefill) arrive as a per-query SMEM block.
  The query's window rows and its selected compressed rows come in with one DMA PER ROW from HBM
  (``memory_space=pl.ANY``; window rows into one VMEM block, selected rows into a double-buffered block of
  ``block_k`` rows), so gathered rows never exist in HBM. HBM arrays are (8, 128)-tiled, so a row DMA needs the
  row on an untiled axis: caches are viewed as [B, N, 1, D] (XLA lays that out (1, 128)-tiled; an engine that
  stores its cache in that shape avoids the relayout this wrapper otherwise pays). 16-bit caches are viewed as uint32 pairs (a 32-bit row DMA never lands on half a packed sublane) and
  unpacked in VMEM into the even / odd feature halves; q is split the same way by the wrapper, which re-interleaves
  the output. Online softmax with the sink as the initial running max / denominator, fp32 accumulation in VMEM.
* ``score_pool``: streams key tiles through the BlockSpec pipeline and writes only per-block / per-superblock score
  maxima (``hier_topk``); the block structure is read with strided sublane loads (no lane reshapes). The rest of
  the hierarchical top-k (small candidate sets: O(k) per query) runs in XLA.

Backward on TPU: reference-recompute (the VJP of the plain-JAX reference), labelled as such in the dispatch.
Tested in TPU interpret mode on CPU and compiled ahead of time for v5p / v6e topologies (tests/test_kernels_tpu_aot.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG_INF = float("-inf")
PREFETCH_MAX_INDICES = 1 << 16  # top-k indices kept in SMEM via scalar prefetch (decode); above: per-query SMEM block


def _interp(interpret):
    if interpret is True:
        return pltpu.InterpretParams(dma_execution_mode="on_wait", out_of_bounds_reads="raise")
    return interpret or False


def _as_rows32(x):
    """[B, R, D] -> ([B, R, D'] 32-bit rows, parts). 16-bit: uint32 pairs (parts 2: even, odd features)."""
    if jnp.dtype(x.dtype).itemsize == 4:
        return x, 1
    if jnp.dtype(x.dtype).itemsize != 2:
        raise TypeError(f"unsupported KV dtype {x.dtype}")
    b, r, d = x.shape
    return jax.lax.bitcast_convert_type(x.reshape(b, r, d // 2, 2), jnp.uint32), 2


def _unpack(x32, parts, dtype):
    """32-bit rows -> list of `parts` float32 feature blocks (exact for bf16 / f16 stored values)."""
    if parts == 1:
        return [x32.astype(jnp.float32)]
    lo = jax.lax.bitcast_convert_type(x32 << 16, jnp.float32)
    hi = jax.lax.bitcast_convert_type(x32 & jnp.uint32(0xFFFF0000), jnp.float32)
    if jnp.dtype(dtype) == jnp.float16:  # f16 halves: widen through the 16-bit type
        lo = jax.lax.bitcast_convert_type((x32 & 0xFFFF).astype(jnp.uint16), jnp.float16).astype(jnp.float32)
        hi = jax.lax.bitcast_convert_type((x32 >> 16).astype(jnp.uint16), jnp.float16).astype(jnp.float32)
    return [lo, hi]


def _prec(a):
    # explicit either way: a global jax_default_matmul_precision="highest" must not reach 16-bit MXU operands
    return jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def _nt(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=_prec(a))


def _nn(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=_prec(a))


@functools.partial(jax.jit, static_argnames=("window", "scale", "wspan", "block_k", "interpret"))
def attention_fwd(q, q_pos, wkv, wpos, wstart, floor, ckv, topk, sink, qseg=None, wseg=None, *, window: int,
                  scale: float, wspan: int, block_k: int = 128, interpret=False):
    """Same contract as ``pallas_gpu.attention_fwd`` (returns only the output)."""
    b, c, h, d = q.shape
    has_cmp = ckv is not None and topk is not None and topk.shape[-1] > 0
    if not has_cmp:
        ckv = jnp.zeros((b, 1, d), wkv.dtype)
        topk = jnp.full((b, c, 1), -1, jnp.int32)
    n, kk = ckv.shape[1], topk.shape[-1]
    s_len = wkv.shape[1]
    span = -(-max(wspan, 8) // 8) * 8
    bk = min(block_k, -(-kk // 8) * 8)
    n_c = -(-kk // bk) if has_cmp else 0
    kp = max(n_c, 1) * bk
    topk = topk.astype(jnp.int32)
    topk_p = jnp.pad(topk, ((0, 0), (0, 0), (0, kp - kk)), constant_values=-1)
    wstart = wstart.astype(jnp.int32)
    # positions of each query's window rows (-1 outside [wstart, wstart + wspan) or the array)
    rows = wstart[..., None] + jnp.arange(span, dtype=jnp.int32)
    in_rng = (rows >= 0) & (rows < s_len) & (jnp.arange(span) < wspan)
    safe_rows = jnp.clip(rows, 0, s_len - 1)
    wpos_q = jnp.where(in_rng, jnp.take_along_axis(wpos.astype(jnp.int32)[:, None, :], safe_rows, axis=2), -1)
    if qseg is not None:  # other documents' window rows: folded into the positions as empty slots
        kseg = jnp.take_along_axis(wseg.astype(jnp.int32)[:, None, :], safe_rows, axis=2)
        wpos_q = jnp.where(kseg == qseg.astype(jnp.int32)[..., None], wpos_q, -1)
    w32, parts = _as_rows32(wkv)
    c32, _ = _as_rows32(ckv)
    dr = w32.shape[-1]
    # one row per (untiled) leading index: a row DMA may start at any row (a [N, D] HBM array is (8, 128)-tiled)
    w32 = w32.reshape(b, s_len, 1, dr)
    c32 = c32.reshape(b, n, 1, dr)
    qf = q.reshape(b, c, h, dr, parts)
    q_parts = [qf[..., i] for i in range(parts)]  # even / odd features for 16-bit
    prefetch_topk = b * c * kp <= PREFETCH_MAX_INDICES
    cdt = q.dtype if parts == 2 else jnp.float32

    def kernel(qpos_s, wst_s, floor_s, topk_s, *refs):
        q_refs = refs[:parts]
        wpos_v, topk_v, sink_ref, w_hbm, c_hbm = refs[parts:parts + 5]
        rest = refs[parts + 5:]
        if not prefetch_topk:
            idx_blk, rest = rest[0], rest[1:]
        o_refs = rest[:parts]
        wbuf, cbuf, sems, m_sc, l_sc, acc_sc = rest[parts:]
        bi = pl.program_id(0)
        ci = pl.program_id(1)
        r = bi * c + ci
        qp = qpos_s[r]
        ws = wst_s[r]
        fl = floor_s[bi]

        def idx_at(t):
            return topk_s[r * kp + t] if prefetch_topk else idx_blk[0, t]

        def win_copy(j):
            row = jnp.clip(ws + j, 0, s_len - 1)
            return pltpu.make_async_copy(w_hbm.at[bi, row], wbuf.at[pl.ds(j, 1)], sems.at[2])

        def row_copy(slot, blk, j):
            row = jnp.clip(idx_at(blk * bk + j), 0, n - 1)
            return pltpu.make_async_copy(c_hbm.at[bi, row], cbuf.at[slot, pl.ds(j, 1)], sems.at[slot])

        def start_block(blk):
            for j in range(bk):
                row_copy(blk % 2, blk, j).start()

        def wait_block(blk):
            for j in range(bk):
                row_copy(blk % 2, blk, j).wait()

        for j in range(span):
            win_copy(j).start()
        if n_c:
            start_block(0)
        m_sc[...] = sink_ref[...].astype(jnp.float32)
        l_sc[...] = jnp.ones_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)
        qs = [qr[...].astype(cdt) for qr in q_refs]

        def step(rows32, valid):
            feats = _unpack(rows32, parts, wkv.dtype)
            s = sum(_nt(qv, f.astype(cdt)) for qv, f in zip(qs, feats)) * scale  # [h, rows]
            s = jnp.where(valid, s, NEG_INF)
            m_old = m_sc[...]
            m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_old - m_new)
            p = jnp.exp(s - m_new)
            l_sc[...] = l_sc[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
            pv = jnp.concatenate([_nn(p.astype(cdt), f.astype(cdt)) for f in feats], axis=1)
            acc_sc[...] = acc_sc[...] * alpha + pv
            m_sc[...] = m_new

        for j in range(span):
            win_copy(j).wait()
        kpos = wpos_v[...]  # [1, span]
        valid = (kpos >= 0) & (kpos <= qp) & (kpos > qp - window) & (kpos >= fl)
        step(wbuf[...], valid)

        if n_c:
            def body(blk, _):
                @pl.when(blk + 1 < n_c)
                def _():
                    start_block(blk + 1)

                wait_block(blk)
                ids = topk_v[:, pl.ds(pl.multiple_of(blk * bk, bk), bk)]
                step(cbuf[blk % 2], ids >= 0)
                return 0

            jax.lax.fori_loop(0, n_c, body, 0)
        out = acc_sc[...] / l_sc[...]
        for i, o_ref in enumerate(o_refs):
            o_ref[...] = out[:, i * dr:(i + 1) * dr].astype(o_ref.dtype)

    qspec = pl.BlockSpec((None, None, h, dr), lambda bi, ci, *_: (bi, ci, 0, 0))
    in_specs = [qspec] * parts + [
        pl.BlockSpec((None, None, 1, span), lambda bi, ci, *_: (bi, ci, 0, 0)),  # window positions
        pl.BlockSpec((None, None, 1, kp), lambda bi, ci, *_: (bi, ci, 0, 0)),  # indices as a vector (masks)
        pl.BlockSpec((h, 1), lambda bi, ci, *_: (0, 0)),
        pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
    ]
    args = list(q_parts) + [wpos_q[:, :, None, :], topk_p[:, :, None, :], sink.reshape(h, 1).astype(jnp.float32),
                            w32, c32]
    if not prefetch_topk:
        in_specs.append(pl.BlockSpec((None, None, 1, kp), lambda bi, ci, *_: (bi, ci, 0, 0),
                                     memory_space=pltpu.SMEM))
        args.append(topk_p[:, :, None, :])
    scalars = (q_pos.reshape(-1).astype(jnp.int32), wstart.reshape(-1),
               jnp.broadcast_to(jnp.asarray(floor, jnp.int32), (b,)),
               topk_p.reshape(-1) if prefetch_topk else jnp.zeros((1,), jnp.int32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(b, c), in_specs=in_specs,
        out_specs=[qspec] * parts,
        scratch_shapes=[pltpu.VMEM((span, dr), w32.dtype), pltpu.VMEM((2, bk, dr), c32.dtype),
                        pltpu.SemaphoreType.DMA((3,)),
                        pltpu.VMEM((h, 1), jnp.float32), pltpu.VMEM((h, 1), jnp.float32),
                        pltpu.VMEM((h, dr * parts), jnp.float32)])
    outs = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, c, h, dr), q.dtype)] * parts,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interp(interpret), name="csa2_sparse_attention_fwd_tpu",
    )(*scalars, *args)
    if parts == 1:
        return outs[0]
    return jnp.stack(outs, axis=-1).reshape(b, c, h, d)


@functools.partial(jax.jit, static_argnames=("g1", "g2", "block_q", "tile", "interpret"))
def score_pool(q, w, keys, vis, *, g1: int, g2: int = 8, block_q: int = 8, tile: int | None = None,
               interpret=False):
    """Same contract as ``pallas_gpu.score_pool``: (bmax [B, C, ceil(N/g1)], smax [B, C, ceil(N/(g1·g2))])."""
    b, c, hi, di = q.shape
    n = keys.shape[1]
    sup = g1 * g2
    nb, ns = -(-n // g1), -(-n // sup)
    ts = max(8, (tile or 128 * sup) // sup)  # superblocks per tile (lane width of the per-tile maxima)
    tn = ts * sup
    n_tiles = -(-n // tn)
    bq = min(block_q, c)
    cp = -(-c // bq) * bq
    if cp != c:
        q = jnp.pad(q, ((0, 0), (0, cp - c), (0, 0), (0, 0)))
        w = jnp.pad(w, ((0, 0), (0, cp - c), (0, 0)))
        vis = jnp.pad(vis, ((0, 0), (0, cp - c)))
    scale = di ** -0.5
    k32, parts = _as_rows32(keys)  # strided sublane loads need 32-bit rows: 16-bit keys as uint32 pairs
    dr = k32.shape[-1]
    qf = q.reshape(b, cp * hi, dr, parts)
    q_parts = [qf[..., i] for i in range(parts)]
    cdt = q.dtype if parts == 2 else jnp.float32

    def kernel(*refs):
        q_refs = refs[:parts]
        w_ref, vis_ref, k_ref, bmax_ref, smax_ref = refs[parts:]
        t = pl.program_id(2)
        qms = [qr[...].astype(cdt) for qr in q_refs]  # [bq·hi, di/parts] each
        wrow = w_ref[...].astype(jnp.float32) * scale  # [1, bq·hi]
        # head-sum as a matmul: sel[q, q·hi + h] = w[q, h]·di^-½
        rq = jax.lax.broadcasted_iota(jnp.int32, (bq, bq * hi), 0)
        cq = jax.lax.broadcasted_iota(jnp.int32, (bq, bq * hi), 1) // hi
        sel = jnp.where(rq == cq, wrow, 0.0)
        vv = vis_ref[...]  # [bq, 1]
        sm = None
        for jj in range(g2):  # block jj of every superblock in the tile
            bm = None
            for j in range(g1):  # entry j of that block
                kj = k_ref[pl.ds(jj * g1 + j, ts, stride=sup), :]  # [ts, di/parts] (32-bit rows)
                feats = _unpack(kj, parts, keys.dtype)
                dots = jnp.maximum(sum(_nt(qv, f.astype(cdt)) for qv, f in zip(qms, feats)), 0.0)  # [bq·hi, ts]
                s = jax.lax.dot_general(sel, dots, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                                        precision=jax.lax.Precision.HIGHEST)  # [bq, ts]
                entry = t * tn + jax.lax.broadcasted_iota(jnp.int32, (bq, ts), 1) * sup + (jj * g1 + j)
                s = jnp.where(entry < vv, s, NEG_INF)
                bm = s if bm is None else jnp.maximum(bm, s)
            bmax_ref[:, jj, :] = bm
            sm = bm if sm is None else jnp.maximum(sm, bm)
        smax_ref[...] = sm

    bmax, smax = pl.pallas_call(
        kernel, grid=(b, cp // bq, n_tiles),
        in_specs=[pl.BlockSpec((None, bq * hi, dr), lambda bi, qi, t: (bi, qi, 0))] * parts + [
                  pl.BlockSpec((None, None, 1, bq * hi), lambda bi, qi, t: (bi, qi, 0, 0)),
                  pl.BlockSpec((None, bq, 1), lambda bi, qi, t: (bi, qi, 0)),
                  pl.BlockSpec((None, tn, dr), lambda bi, qi, t: (bi, t, 0))],
        out_specs=[pl.BlockSpec((None, bq, None, g2, ts), lambda bi, qi, t: (bi, qi, t, 0, 0)),
                   pl.BlockSpec((None, bq, ts), lambda bi, qi, t: (bi, qi, t))],
        out_shape=[jax.ShapeDtypeStruct((b, cp, n_tiles, g2, ts), jnp.float32),
                   jax.ShapeDtypeStruct((b, cp, n_tiles * ts), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=_interp(interpret), name="indexer_score_pool_tpu",
    )(*q_parts, w.reshape(b, cp // bq, 1, bq * hi), vis.astype(jnp.int32)[..., None], k32)
    bmax = jnp.swapaxes(bmax, -1, -2).reshape(b, cp, n_tiles * ts * g2)  # natural block order
    return bmax[:, :c, :nb], smax[:, :c, :ns]


def gather_score(q, w, keys, vis, cand):
    """Leaf / pool scoring on TPU: an XLA gather of the O(k) (or ≤16,384 pooled) candidate rows."""
    di = q.shape[-1]
    rows = jax.vmap(lambda kb, cb: kb[jnp.maximum(cb, 0)])(keys, cand)  # [B, C, M, di]
    dots = jnp.einsum("bchd,bcmd->bchm", q.astype(jnp.float32), rows.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    s = jnp.einsum("bchm,bch->bcm", jnp.maximum(dots, 0.0) * di ** -0.5, w.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return jnp.where((cand >= 0) & (cand < vis[..., None]), s, NEG_INF)
