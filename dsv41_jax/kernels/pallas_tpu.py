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
  ``return_lse`` also writes the log-sum-exp (sink included) for the backward. The per-query row streaming is one
  skeleton (``_query_stream``) shared with the dQ backward kernel.
* ``attention_bwd``: the backward, the design of the GPU one (``pallas_gpu.attention_bwd``, ``dkv="by_key"``) in
  Mosaic terms. dQ: per query, the same row stream, the probabilities recomputed from the saved log-sum-exp, dQ
  summed in float32 in its output block. dKV (K = V) key-centric, no atomics (``_dkv_by_key``): one program per block
  of 128 rows (a plain BlockSpec tile: the table's own rows are contiguous) loops over the queries that read the
  block — for window rows the contiguous range of queries whose window spans it, for selected rows a per-block list
  of readers (``_block_readers``, from one sort of the top-k lists) read from SMEM — DMAs each reader's q, dO and
  (lse, delta) from HBM, double-buffered, and sums the block's gradient in float32 in registers / VMEM, written
  once. A reader's pick counts per row come from its top-k list (duplicates count, as in the forward's softmax).
  The scores are formed transposed ([rows, heads]) so per-row masks and counts are columns. The sink's gradient
  comes from the log-sum-exp in JAX.
* ``score_pool``: streams key tiles through the BlockSpec pipeline and writes only per-block / per-superblock score
  maxima (``hier_topk``); the block structure is read with strided sublane loads (no lane reshapes). The rest of
  the hierarchical top-k (small candidate sets: O(k) per query) runs in XLA.

Tested in TPU interpret mode on CPU (tests/test_kernels.py, tests/test_kernels_tpu_bwd.py: bf16 gradients against
float32 on upcast inputs) and compiled ahead of time for v5p / v6e topologies (tests/test_kernels_tpu_aot.py; the
backward on v5p). Not yet run on TPU hardware: its speed is unmeasured.
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


def _parts(dtype) -> int:
    """32-bit words per feature pair: 16-bit rows travel as uint32 pairs (2 parts: even / odd features)."""
    return 2 if jnp.dtype(dtype).itemsize == 2 else 1


def _prec(a):
    # explicit either way: a global jax_default_matmul_precision="highest" must not reach 16-bit MXU operands
    return jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def _nt(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=_prec(a))


def _nn(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=_prec(a))


def _query_stream(q, q_pos, wkv, wpos, wstart, floor, ckv, topk, qseg, wseg, *, window: int, wspan: int,
                  block_k: int, interpret, name: str, inputs, outputs, scratch, init, step, finish):
    """One Mosaic program per (batch row, query) that streams the query's window rows and then its selected
    compressed rows through VMEM (one DMA per row from HBM, the selected rows double-buffered in blocks of
    ``block_k``) and hands each block to ``step``: the shared skeleton of the forward and of the dQ backward.

    ``inputs``: [(array, BlockSpec)] per-query operands after the stream's own; ``outputs``: [(ShapeDtypeStruct,
    BlockSpec)]; ``scratch``: extra scratch shapes. Callbacks run inside the kernel with ``refs`` = (input refs,
    output refs, scratch refs): ``init(refs)``, ``step(refs, rows32 [rows, D'], valid [1, rows])`` (rows as 32-bit
    words: ``_unpack`` gives the features), ``finish(refs)``. Returns the outputs of the ``pallas_call``."""
    b, c = q.shape[:2]
    has_cmp = ckv is not None and topk is not None and topk.shape[-1] > 0
    if not has_cmp:
        ckv = jnp.zeros((b, 1, wkv.shape[-1]), wkv.dtype)
        topk = jnp.full((b, c, 1), -1, jnp.int32)
    n, kk = ckv.shape[1], topk.shape[-1]
    s_len = wkv.shape[1]
    span = -(-max(wspan, 8) // 8) * 8
    bk = min(block_k, -(-kk // 8) * 8)
    n_c = -(-kk // bk) if has_cmp else 0
    kp = max(n_c, 1) * bk
    topk_p = jnp.pad(topk.astype(jnp.int32), ((0, 0), (0, 0), (0, kp - kk)), constant_values=-1)
    wstart = wstart.astype(jnp.int32)
    # positions of each query's window rows (-1 outside [wstart, wstart + wspan) or the array)
    rows = wstart[..., None] + jnp.arange(span, dtype=jnp.int32)
    in_rng = (rows >= 0) & (rows < s_len) & (jnp.arange(span) < wspan)
    safe_rows = jnp.clip(rows, 0, s_len - 1)
    wpos_q = jnp.where(in_rng, jnp.take_along_axis(wpos.astype(jnp.int32)[:, None, :], safe_rows, axis=2), -1)
    if qseg is not None:  # other documents' window rows: folded into the positions as empty slots
        kseg = jnp.take_along_axis(wseg.astype(jnp.int32)[:, None, :], safe_rows, axis=2)
        wpos_q = jnp.where(kseg == qseg.astype(jnp.int32)[..., None], wpos_q, -1)
    w32, _ = _as_rows32(wkv)
    c32, _ = _as_rows32(ckv)
    dr = w32.shape[-1]
    # one row per (untiled) leading index: a row DMA may start at any row (a [N, D] HBM array is (8, 128)-tiled)
    w32 = w32.reshape(b, s_len, 1, dr)
    c32 = c32.reshape(b, n, 1, dr)
    prefetch_topk = b * c * kp <= PREFETCH_MAX_INDICES
    n_in, n_out = len(inputs), len(outputs)

    def kernel(qpos_s, wst_s, floor_s, topk_s, *refs):
        wpos_v, topk_v, w_hbm, c_hbm = refs[:4]
        rest = refs[4:]
        if not prefetch_topk:
            idx_blk, rest = rest[0], rest[1:]
        in_refs, out_refs = rest[:n_in], rest[n_in:n_in + n_out]
        wbuf, cbuf, sems = rest[n_in + n_out:n_in + n_out + 3]
        user = (in_refs, out_refs, rest[n_in + n_out + 3:])
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
        init(user)
        for j in range(span):
            win_copy(j).wait()
        kpos = wpos_v[...]  # [1, span]
        step(user, wbuf[...], (kpos >= 0) & (kpos <= qp) & (kpos > qp - window) & (kpos >= fl))

        if n_c:
            def body(blk, _):
                @pl.when(blk + 1 < n_c)
                def _():
                    start_block(blk + 1)

                wait_block(blk)
                ids = topk_v[:, pl.ds(pl.multiple_of(blk * bk, bk), bk)]
                step(user, cbuf[blk % 2], ids >= 0)
                return 0

            jax.lax.fori_loop(0, n_c, body, 0)
        finish(user)

    in_specs = [
        pl.BlockSpec((None, None, 1, span), lambda bi, ci, *_: (bi, ci, 0, 0)),  # window positions
        pl.BlockSpec((None, None, 1, kp), lambda bi, ci, *_: (bi, ci, 0, 0)),  # indices as a vector (masks)
        pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
    ]
    args = [wpos_q[:, :, None, :], topk_p[:, :, None, :], w32, c32]
    if not prefetch_topk:
        in_specs.append(pl.BlockSpec((None, None, 1, kp), lambda bi, ci, *_: (bi, ci, 0, 0),
                                     memory_space=pltpu.SMEM))
        args.append(topk_p[:, :, None, :])
    in_specs += [s for _, s in inputs]
    args += [a for a, _ in inputs]
    scalars = (q_pos.reshape(-1).astype(jnp.int32), wstart.reshape(-1),
               jnp.broadcast_to(jnp.asarray(floor, jnp.int32), (b,)),
               topk_p.reshape(-1) if prefetch_topk else jnp.zeros((1,), jnp.int32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(b, c), in_specs=in_specs, out_specs=[s for _, s in outputs],
        scratch_shapes=[pltpu.VMEM((span, dr), w32.dtype), pltpu.VMEM((2, bk, dr), c32.dtype),
                        pltpu.SemaphoreType.DMA((3,))] + list(scratch))
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=[o for o, _ in outputs],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interp(interpret), name=name,
    )(*scalars, *args)


def _split_features(x, parts):
    """[B, C, H, D] -> `parts` arrays [B, C, H, D / parts] (16-bit: even / odd features, like ``_as_rows32``)."""
    b, c, h, d = x.shape
    xf = x.reshape(b, c, h, d // parts, parts)
    return [xf[..., i] for i in range(parts)]


def _merge_features(xs):
    if len(xs) == 1:
        return xs[0]
    b, c, h, dr = xs[0].shape
    return jnp.stack(xs, axis=-1).reshape(b, c, h, dr * len(xs))


def _head_spec(h, width):
    return pl.BlockSpec((None, None, h, width), lambda bi, ci, *_: (bi, ci, 0, 0))


@functools.partial(jax.jit, static_argnames=("window", "scale", "wspan", "block_k", "return_lse", "interpret"))
def attention_fwd(q, q_pos, wkv, wpos, wstart, floor, ckv, topk, sink, qseg=None, wseg=None, *, window: int,
                  scale: float, wspan: int, block_k: int = 128, return_lse: bool = False, interpret=False):
    """Same contract as ``pallas_gpu.attention_fwd``: the output, and with ``return_lse`` also the log-sum-exp
    [B, C, H] float32 (sink included) that the backward kernels read."""
    b, c, h, d = q.shape
    parts = _parts(wkv.dtype)
    dr = d // parts
    cdt = q.dtype if parts == 2 else jnp.float32

    def init(refs):
        ins, _, (m_sc, l_sc, acc_sc) = refs
        m_sc[...] = ins[parts][...].astype(jnp.float32)  # the sink: initial running max, denominator e^0
        l_sc[...] = jnp.ones_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)

    def step(refs, rows32, valid):
        ins, _, (m_sc, l_sc, acc_sc) = refs
        qs = [ins[i][...].astype(cdt) for i in range(parts)]
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

    def finish(refs):
        _, outs, (m_sc, l_sc, acc_sc) = refs
        out = acc_sc[...] / l_sc[...]
        for i in range(parts):
            outs[i][...] = out[:, i * dr:(i + 1) * dr].astype(outs[i].dtype)
        if return_lse:
            outs[parts][...] = m_sc[...] + jnp.log(l_sc[...])

    qspec = _head_spec(h, dr)
    outputs = [(jax.ShapeDtypeStruct((b, c, h, dr), q.dtype), qspec)] * parts
    if return_lse:
        outputs.append((jax.ShapeDtypeStruct((b, c, h, 1), jnp.float32), _head_spec(h, 1)))
    res = _query_stream(
        q, q_pos, wkv, wpos, wstart, floor, ckv, topk, qseg, wseg, window=window, wspan=wspan, block_k=block_k,
        interpret=interpret, name="csa2_sparse_attention_fwd_tpu",
        inputs=[(x, qspec) for x in _split_features(q, parts)] + [
            (sink.reshape(h, 1).astype(jnp.float32), pl.BlockSpec((h, 1), lambda bi, ci, *_: (0, 0)))],
        outputs=outputs,
        scratch=[pltpu.VMEM((h, 1), jnp.float32), pltpu.VMEM((h, 1), jnp.float32),
                 pltpu.VMEM((h, dr * parts), jnp.float32)],
        init=init, step=step, finish=finish)
    out = _merge_features(res[:parts])
    return (out, res[parts][..., 0]) if return_lse else out


# ----------------------------------------------------------------------------------------------------------------
# Sparse attention, backward
# ----------------------------------------------------------------------------------------------------------------

def _block_readers(topk, n: int, bk: int):
    """Which queries read each block of ``bk`` compressed entries: (readers [B, n_blocks, 1, C] int32 query ids,
    ascending, padded with 0; count [B, n_blocks] int32 of them). A query reads a block when its list holds any of
    the block's entries (ids clipped to [0, n) like the forward's row DMA; -1 = empty)."""
    b, c, _ = topk.shape
    nkb = -(-n // bk)
    blk = jnp.where(topk >= 0, jnp.clip(topk, 0, n - 1) // bk, nkb)  # nkb: the empty slots' dropped column
    reads = jnp.zeros((b, c, nkb + 1), jnp.int32).at[jnp.arange(b)[:, None, None], jnp.arange(c)[None, :, None],
                                                     blk].max(1)[..., :nkb]
    reads = jnp.swapaxes(reads, 1, 2)  # [B, n_blocks, C]
    order = jnp.where(reads > 0, jnp.arange(c, dtype=jnp.int32), c)
    readers = jnp.sort(order, axis=-1)
    return jnp.where(readers < c, readers, 0)[:, :, None, :], jnp.sum(reads, axis=-1, dtype=jnp.int32)


def _dkv_by_key(q, dout, stats, table, *, scale: float, bk: int, interpret, window_args=None, select_args=None):
    """dKV (= dK + dV, K = V) of a table of rows [B, R, D], key-centric and without atomics: one program per (batch
    row, block of ``bk`` rows) holds the block in VMEM and its dKV tile in float32, loops over the queries that read
    the block — their q, dO and (lse, delta) DMA'd from HBM, double-buffered — recomputing their probabilities from
    the saved log-sum-exp, and writes the tile once. Works in the transposed orientation ([rows, heads] scores) so
    that per-row masks and counts are columns and no transposes are needed.

    Window rows: ``window_args`` = (lo, hi, q_pos, wstart, qseg, floor, wpos, wseg, window, wspan): the contiguous
    query range [lo, hi) per block (``pallas_gpu._window_query_ranges``) and the forward's mask per (query, row).
    Selected rows: ``select_args`` = (readers, count, topk): the block's reader list (``_block_readers``) and each
    reader's top-k list, from which the kernel counts how often it picked each row of the block (duplicates count,
    as in the forward's softmax). Returns [B, R, D] float32."""
    b, c, h, d = q.shape
    r_len = table.shape[1]
    nkb = -(-r_len // bk)
    if nkb * bk != r_len:
        table = jnp.pad(table, ((0, 0), (0, nkb * bk - r_len), (0, 0)))
    is_window = window_args is not None
    cdt = q.dtype if jnp.dtype(q.dtype).itemsize == 2 else jnp.float32
    if is_window:
        lo, hi, q_pos, wstart, qseg, floor, wpos, wseg, window, wspan = window_args
        pad_rows = ((0, 0), (0, nkb * bk - r_len))
        scalars = [lo.reshape(-1), hi.reshape(-1), q_pos.reshape(-1), wstart.reshape(-1), qseg.reshape(-1),
                   jnp.broadcast_to(floor, (b,))]
        col = pl.BlockSpec((None, bk, 1), lambda bi, kb, *_: (bi, kb, 0))
        extra = [(jnp.pad(wpos, pad_rows, constant_values=-1)[..., None], col),
                 (jnp.pad(wseg, pad_rows, constant_values=-1)[..., None], col)]
    else:
        readers, count, topk = select_args
        kk = topk.shape[-1]
        scalars = [jnp.zeros((b * nkb,), jnp.int32), count.reshape(-1)]
        extra = [(readers, pl.BlockSpec((None, None, 1, c), lambda bi, kb, *_: (bi, kb, 0, 0),
                                        memory_space=pltpu.SMEM)),
                 (topk[:, :, None, :], pl.BlockSpec(memory_space=pl.ANY))]
    n_sc = len(scalars)

    def kernel(*refs):
        sc = refs[:n_sc]
        q_hbm, do_hbm, st_hbm, kv_ref = refs[n_sc:n_sc + 4]
        ex = refs[n_sc + 4:n_sc + 4 + len(extra)]
        out_ref, qbuf, dobuf, stbuf = refs[n_sc + 4 + len(extra):n_sc + 8 + len(extra)]
        tail = refs[n_sc + 8 + len(extra):]
        bi = pl.program_id(0)
        kb = pl.program_id(1)
        blk = bi * nkb + kb
        g_lo, g_hi = (sc[0][blk], sc[1][blk]) if is_window else (0, sc[1][blk])
        rows = kb * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)  # this block's row ids, a column
        if is_window:
            sems, = tail
        else:
            tkbuf, sems = tail

        def query(g):
            return g if is_window else ex[0][0, g]

        def copies(g, slot):
            ci = query(g)
            cps = [pltpu.make_async_copy(q_hbm.at[bi, ci], qbuf.at[slot], sems.at[slot, 0]),
                   pltpu.make_async_copy(do_hbm.at[bi, ci], dobuf.at[slot], sems.at[slot, 1]),
                   pltpu.make_async_copy(st_hbm.at[bi, ci], stbuf.at[slot], sems.at[slot, 2])]
            if not is_window:
                cps.append(pltpu.make_async_copy(ex[1].at[bi, ci], tkbuf.at[slot], sems.at[slot, 3]))
            return cps

        @pl.when(g_lo < g_hi)
        def _():
            for cp in copies(g_lo, 0):
                cp.start()

        kmat = kv_ref[...]  # [bk, D]

        def body(g, acc):
            slot = (g - g_lo) % 2

            @pl.when(g + 1 < g_hi)
            def _():
                for cp in copies(g + 1, 1 - slot):
                    cp.start()

            for cp in copies(g, slot):
                cp.wait()
            ci = query(g)
            if is_window:
                ws = sc[3][bi * c + ci]
                qp = sc[2][bi * c + ci]
                kp, ksg = ex[0][...], ex[1][...]  # [bk, 1]
                valid = ((rows >= ws) & (rows < ws + wspan) & (rows < r_len) & (kp >= 0) & (kp <= qp)
                         & (kp > qp - window) & (kp >= sc[5][bi]) & (ksg == sc[4][bi * c + ci]))
                cnt = valid.astype(jnp.float32)
            else:
                picks = tkbuf[slot]  # [1, K]
                cnt = jnp.sum((picks == rows).astype(jnp.float32), axis=1, keepdims=True)  # [bk, 1]
                valid = cnt > 0
            qv = qbuf[slot]  # [H, D]
            dov = dobuf[slot]
            st = stbuf[slot]  # [2, H]: log-sum-exp, delta
            s = _nt(kmat, qv) * scale  # [bk, H]
            # unread rows may score far above the log-sum-exp: masked before the exponential, never inf * 0
            p = jnp.where(valid, jnp.exp(jnp.where(valid, s, 0.0) - st[0:1, :]), 0.0) * cnt
            ds = p * (_nt(kmat, dov) - st[1:2, :])
            return acc + _nn(ds.astype(cdt), qv) * scale + _nn(p.astype(cdt), dov)

        out_ref[...] = jax.lax.fori_loop(g_lo, g_hi, body, jnp.zeros((bk, d), jnp.float32))

    scratch = [pltpu.VMEM((2, h, d), q.dtype), pltpu.VMEM((2, h, d), q.dtype), pltpu.VMEM((2, 2, h), jnp.float32)]
    if not is_window:
        scratch.append(pltpu.VMEM((2, 1, kk), jnp.int32))
    scratch.append(pltpu.SemaphoreType.DMA((2, 4)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=n_sc, grid=(b, nkb),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 3 + [pl.BlockSpec((None, bk, d), lambda bi, kb, *_: (bi, kb, 0))]
        + [s for _, s in extra],
        out_specs=pl.BlockSpec((None, bk, d), lambda bi, kb, *_: (bi, kb, 0)),
        scratch_shapes=scratch)
    out = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((b, nkb * bk, d), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_interp(interpret),
        name="csa2_sparse_attention_bwd_dkv_window_tpu" if is_window else "csa2_sparse_attention_bwd_dkv_selected_tpu",
    )(*scalars, q, dout, stats, table, *[a for a, _ in extra])
    return out[:, :r_len]


@functools.partial(jax.jit, static_argnames=("window", "scale", "wspan", "block_k", "key_block", "interpret"))
def attention_bwd(q, q_pos, wkv, wpos, wstart, floor, ckv, topk, sink, out, lse, dout, qseg=None, wseg=None, *,
                  window: int, scale: float, wspan: int, block_k: int = 128, key_block: int = 128, interpret=False):
    """Gradients (dq, dwkv, dckv, dsink) of ``attention_fwd``'s output, given its log-sum-exp ``lse`` [B, C, H].

    dQ: ``_query_stream`` again (one program per query, its window and selected rows DMA'd row by row as in the
    forward), dQ accumulated in float32 in the output block. dKV (K = V): ``_dkv_by_key`` per block of
    ``key_block`` window slots (the contiguous range of queries whose window spans it: ``wstart`` non-decreasing,
    true at both call sites) and per block of compressed entries (the queries whose top-k lists pick any of them),
    every row's gradient summed in float32 over its readers and written once — the design of
    ``pallas_gpu.attention_bwd``'s ``dkv="by_key"``, with DMAs in place of pointer gathers. The sink's gradient comes
    from the log-sum-exp in JAX. Matmul operands keep the input dtype (bf16 on the MXU), every sum is float32."""
    from dsv41_jax.kernels.pallas_gpu import _window_query_ranges  # plain JAX, shared with the GPU backward

    b, c, h, d = q.shape
    s_len = wkv.shape[1]
    parts = _parts(wkv.dtype)
    dr = d // parts
    cdt = q.dtype if parts == 2 else jnp.float32
    has_cmp = ckv is not None and topk is not None and topk.shape[-1] > 0
    i32 = jnp.int32
    wstart, q_pos, wpos, floor = (x.astype(i32) for x in (wstart, q_pos, wpos, jnp.asarray(floor)))
    floor = jnp.broadcast_to(floor, (b,))
    dout = dout.astype(q.dtype)
    delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)  # [B, C, H]
    lse = lse.astype(jnp.float32)
    # sink: out = sum p v / (sum p + e^{sink - m}) -> dsink_h = -sum_{b,c} e^{sink_h - lse} * (dO . O)
    dsink = -jnp.sum(jnp.exp(sink.astype(jnp.float32)[None, None, :] - lse) * delta, axis=(0, 1))

    def step(refs, rows32, valid):
        ins, dq_refs, _ = refs
        feats = [f.astype(cdt) for f in _unpack(rows32, parts, wkv.dtype)]
        qs = [ins[i][...].astype(cdt) for i in range(parts)]
        dos = [ins[parts + i][...].astype(cdt) for i in range(parts)]
        lse_c, dl_c = ins[2 * parts][...], ins[2 * parts + 1][...]  # [h, 1]
        s = sum(_nt(qv, f) for qv, f in zip(qs, feats)) * scale  # [h, rows]
        p = jnp.where(valid, jnp.exp(jnp.where(valid, s, 0.0) - lse_c), 0.0)
        ds = p * (sum(_nt(dv, f) for dv, f in zip(dos, feats)) - dl_c)
        for i, f in enumerate(feats):
            dq_refs[i][...] += _nn(ds.astype(cdt), f) * scale

    def init(refs):
        for r in refs[1]:
            r[...] = jnp.zeros_like(r)

    qspec = _head_spec(h, dr)
    colspec = _head_spec(h, 1)
    dq_parts = _query_stream(
        q, q_pos, wkv, wpos, wstart, floor, ckv, topk, qseg, wseg, window=window, wspan=wspan, block_k=block_k,
        interpret=interpret, name="csa2_sparse_attention_bwd_dq_tpu",
        inputs=[(x, qspec) for x in _split_features(q, parts) + _split_features(dout, parts)]
        + [(lse[..., None], colspec), (delta[..., None], colspec)],
        outputs=[(jax.ShapeDtypeStruct((b, c, h, dr), jnp.float32), qspec)] * parts, scratch=[],
        init=init, step=step, finish=lambda refs: None)
    dq = _merge_features(dq_parts)

    stats = jnp.stack([lse, delta], axis=2)  # [B, C, 2, H]
    common = dict(scale=scale, interpret=interpret)
    kbk = max(16, min(key_block, -(-max(s_len, 1) // 16) * 16))  # 16: a bf16 (16, 128) tile's rows
    lo, hi = _window_query_ranges(wstart, wspan, s_len, kbk)
    if qseg is None:
        qseg, wseg = jnp.zeros((b, c), i32), jnp.zeros((b, s_len), i32)
    dw = _dkv_by_key(q, dout, stats, wkv.astype(q.dtype), bk=kbk,
                     window_args=(lo, hi, q_pos, wstart, qseg.astype(i32), floor, wpos, wseg.astype(i32), window,
                                  wspan), **common)
    dc = None
    if has_cmp:
        n = ckv.shape[1]
        cbk = max(16, min(key_block, -(-n // 16) * 16))
        topk = topk.astype(i32)
        readers, count = _block_readers(topk, n, cbk)
        picks = jnp.where(topk >= 0, jnp.minimum(topk, n - 1), -1)
        dc = _dkv_by_key(q, dout, stats, ckv.astype(q.dtype), bk=cbk, select_args=(readers, count, picks),
                         **common).astype(ckv.dtype)
    elif ckv is not None:
        dc = jnp.zeros_like(ckv)
    return dq.astype(q.dtype), dw.astype(wkv.dtype), dc, dsink.astype(sink.dtype)


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
