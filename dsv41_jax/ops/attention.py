"""Sparse CSA2 attention, plain-JAX reference (the definition of correct; kernels are tested against it).

Each query attends to (a) its sliding window of K=V latents — key positions p with ``q_pos - window < p <= q_pos``
(and ``p >= floor`` under CED bounded replay) — and (b) the compressed entries its top-k selected (indices into the
compressed KV, ``-1`` = empty slot). One softmax over both, scale ``head_dim ** -0.5``, a per-head sink that only
adds to the denominator, and V = K. The selected rows are gathered per query; no dense [T, N] mask is built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.ops import quant
from dsv41_jax.ops.gather import take_rows_batched
from dsv41_jax.ops.linear import is_plain_weight, linear, linear_many, matmul_precision, weight_array
from dsv41_jax.ops.norms import rms_norm
from dsv41_jax.ops.rope import apply_rope

_HI = jax.lax.Precision.HIGHEST


def attention_inputs(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, config, quant_on: bool,
                     norm_kernel: str | None = None):
    """An attention site's projections of its normalised input x [B, T, d]: (q LoRA residual q_res [B, T, r_q],
    rotated queries q [B, T, H, D], the rotated K=V latent kv [B, T, D], FP8-rounded under fake quantisation).
    cos / sin [B, T, r/2] are the layer's RoPE tables at the tokens' positions. ``norm_kernel``: the q-LoRA norm
    in one Pallas kernel (``ops.norms.rms_norm``'s ``kernel``; a decode step)."""
    c = config
    b, t, _ = x.shape
    q_low, kv_low = linear_many(x, (p["wq_a"], p["wkv"]))  # one FP8 launch for both on the release's GPU path
    q_res = rms_norm(q_low, p["q_norm"], c.rms_norm_eps, kernel=norm_kernel)
    q = linear(q_res, p["wq_b"]).reshape(b, t, c.num_attention_heads, c.head_dim)
    q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    kv = apply_rope(rms_norm(kv_low, p["kv_norm"], c.rms_norm_eps), cos, sin)
    if quant_on:
        kv = quant.fake_quant_fp8_e4m3_block(kv, 32)
    return q_res, q, kv


def attention_output(p: dict, out: jax.Array, cos: jax.Array, sin: jax.Array, config) -> jax.Array:
    """Attention output [B, T, H, D] -> [B, T, d]: inverse RoPE, then the grouped low-rank output projection
    (``o_groups`` groups of heads, each through its own ``wo_a`` slice, then ``wo_b``)."""
    c = config
    b, t = out.shape[:2]
    out = apply_rope(out, cos[:, :, None], sin[:, :, None], inverse=True)
    grouped = out.reshape(b, t, c.o_groups, -1)
    # a QuantizedTensor (the release's stored FP8 form) is dequantised here, in every step; the engine serves wo_a
    # dequantised once, at load, as the official code does (release_weights.dequantize_wo_a): the same values
    wo_a = p["wo_a"] if is_plain_weight(p["wo_a"]) else weight_array(p["wo_a"], out.dtype)
    wo_a = wo_a.reshape(c.o_groups, c.o_lora_rank, -1)
    y = jnp.einsum("btgi,goi->btgo", grouped, wo_a, precision=matmul_precision(grouped, wo_a)).reshape(b, t, -1)
    return linear(y, p["wo_b"])


def _window_logits(qf, q_pos, wf, win_pos, window, floor, scale, q_seg, k_seg):
    """[B, H, C, L] float32 logits of the queries against their candidate window keys, -inf where invisible."""
    s_win = jnp.einsum("bchd,bld->bhcl", qf, wf, precision=_HI) * scale
    kp = win_pos[:, None, :]
    qp = q_pos[:, :, None]
    visible = (kp >= 0) & (kp <= qp) & (kp > qp - window) & (kp >= floor)
    if q_seg is not None:
        visible = visible & (k_seg[:, None, :] == q_seg[:, :, None])
    return jnp.where(visible[:, None], s_win, -jnp.inf)


def sparse_attention(q: jax.Array, q_pos: jax.Array, win_kv: jax.Array, win_pos: jax.Array,
                     compressed_kv: jax.Array | None, topk: jax.Array | None, sink: jax.Array, *, window: int,
                     floor: jax.Array | int = 0, scale: float | None = None, q_seg: jax.Array | None = None,
                     k_seg: jax.Array | None = None) -> jax.Array:
    """One block of queries against an explicit set of window keys plus gathered compressed entries.

    Args:
      q: [B, C, H, D] queries (rope already applied).
      q_pos: [B, C] absolute query positions (int).
      win_kv: [B, L, D] candidate window latents; win_pos: [B, L] their positions (< 0 = empty slot).
      compressed_kv: [B, N, D] or None; topk: [B, C, K] int32 indices into it, -1 = empty.
      sink: [H] per-head sink logits.
      window: the sliding window size; floor: [B] or scalar, keys before it are invisible (bounded replay).
      q_seg / k_seg: optional [B, C] / [B, L] document ids (packed rows): window keys of other documents are
        invisible. (Compressed picks are already per document.)
    Returns [B, C, H, D] in q's dtype (softmax and accumulation in float32).
    """
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    qf = q.astype(jnp.float32)
    floor = jnp.asarray(floor)
    floor = floor.reshape(-1, 1, 1) if floor.ndim == 1 else floor
    wf = win_kv.astype(jnp.float32)
    s_win = _window_logits(qf, q_pos, wf, win_pos, window, floor, scale, q_seg, k_seg)
    logits = [s_win]
    gathered = None
    if compressed_kv is not None and topk is not None and topk.shape[-1] > 0:
        safe = jnp.clip(topk, 0, compressed_kv.shape[1] - 1)
        # [B, C, K, D]; an entry picked by many queries gets its gradient summed in float32 (ops.gather)
        gathered = take_rows_batched(compressed_kv, safe, jnp.float32)
        s_cmp = jnp.einsum("bchd,bckd->bhck", qf, gathered, precision=_HI) * scale
        s_cmp = jnp.where((topk >= 0)[:, None], s_cmp, -jnp.inf)
        logits.append(s_cmp)
    all_logits = jnp.concatenate(logits, axis=-1)
    sink_b = sink.astype(jnp.float32)[None, :, None]
    m = jnp.maximum(jnp.max(all_logits, axis=-1), sink_b)  # the sink keeps every row finite
    p = jnp.exp(all_logits - m[..., None])
    denom = jnp.sum(p, axis=-1) + jnp.exp(sink_b - m)
    n_win = s_win.shape[-1]
    out = jnp.einsum("bhcl,bld->bchd", p[..., :n_win], wf, precision=_HI)
    if gathered is not None:
        out = out + jnp.einsum("bhck,bckd->bchd", p[..., n_win:], gathered, precision=_HI)
    out = out / jnp.moveaxis(denom, 1, 2)[..., None]
    return out.astype(q.dtype)


def sequence_sparse_attention(q: jax.Array, kv: jax.Array, positions: jax.Array, compressed_kv: jax.Array | None,
                              topk: jax.Array | None, sink: jax.Array, *, window: int, floor: jax.Array | int = 0,
                              chunk: int = 256, segments: jax.Array | None = None) -> jax.Array:
    """Causal sparse attention over a whole sequence whose window keys are the sequence itself.

    q [B, T, H, D]; kv [B, T, D] (the sequence's own latents, key t at positions[:, t]); topk [B, T, K].
    Queries are processed in chunks of ``chunk`` so memory is O(T · (chunk + window)), never O(T²).
    ``segments`` [B, T] (packed documents): positions are document-relative and windows stop at document starts.
    """
    if q.shape[1] <= chunk:
        return sparse_attention(q, positions, kv, positions, compressed_kv, topk, sink, window=window, floor=floor,
                                q_seg=segments, k_seg=segments)
    # The chunks share kv and compressed_kv: lax.map carries their cotangents across chunks in their own dtype, so
    # they enter the map in float32 (no head axis: cheap) and their gradients are summed in float32 (ops.gather).
    if compressed_kv is not None:
        compressed_kv = compressed_kv.astype(jnp.float32)

    def one(qc, pc, kc, kpc, tc, sq, sk):
        return sparse_attention(qc, pc, kc, kpc, compressed_kv, tc, sink, window=window, floor=floor, q_seg=sq,
                                k_seg=sk)

    return _map_query_chunks(one, q, kv.astype(jnp.float32), positions, topk, window=window, chunk=chunk,
                             segments=segments)


def sequence_window_lse(q: jax.Array, kv: jax.Array, positions: jax.Array, sink: jax.Array, *, window: int,
                        chunk: int = 256, segments: jax.Array | None = None) -> jax.Array:
    """Per query and head, the log-sum-exp of the attention logits outside the compressed entries: the visible
    sliding-window keys and the sink. [B, T, H] float32 (same windows, scale and chunking as
    ``sequence_sparse_attention``; no gradient is meant to flow through it)."""
    scale = q.shape[-1] ** -0.5

    def one(qc, pc, kc, kpc, tc, sq, sk):
        s_win = _window_logits(qc.astype(jnp.float32), pc, kc.astype(jnp.float32), kpc, window, 0, scale, sq, sk)
        sink_b = jnp.broadcast_to(sink.astype(jnp.float32)[None, :, None, None], s_win.shape[:3] + (1,))
        lse = jax.nn.logsumexp(jnp.concatenate([s_win, sink_b], axis=-1), axis=-1)  # [B, H, C]
        return jnp.moveaxis(lse, 1, 2)

    if q.shape[1] <= chunk:
        return one(q, positions, kv, positions, None, segments, segments)
    return _map_query_chunks(one, q, kv, positions, None, window=window, chunk=chunk, segments=segments)


def _map_query_chunks(one, q, kv, positions, topk, *, window: int, chunk: int, segments):
    """``one(q_chunk, q_pos, window_kv, window_pos, topk_chunk, q_seg, k_seg)`` over chunks of ``chunk`` queries,
    each with the ``chunk + window - 1`` keys its window can reach; outputs [B, chunk, ...] concatenated to T."""
    b, t = q.shape[:2]
    n_chunks = -(-t // chunk)
    pad = n_chunks * chunk - t
    lead = window - 1  # keys a chunk may need from before its first query
    kv_p = jnp.pad(kv, ((0, 0), (lead, pad), (0, 0)))
    pos_k = jnp.pad(positions, ((0, 0), (lead, pad)), constant_values=-1)
    q_p = jnp.pad(q, ((0, 0), (0, pad)) + ((0, 0),) * (q.ndim - 2))
    pos_q = jnp.pad(positions, ((0, 0), (0, pad)), constant_values=-1)
    topk_p = None if topk is None else jnp.pad(topk, ((0, 0), (0, pad), (0, 0)), constant_values=-1)
    seg_q = seg_k = None
    if segments is not None:
        seg_k = jnp.pad(segments, ((0, 0), (lead, pad)), constant_values=-1)
        seg_q = jnp.pad(segments, ((0, 0), (0, pad)), constant_values=-2)

    def body(c):
        start = c * chunk
        qc = jax.lax.dynamic_slice_in_dim(q_p, start, chunk, axis=1)
        pc = jax.lax.dynamic_slice_in_dim(pos_q, start, chunk, axis=1)
        kc = jax.lax.dynamic_slice_in_dim(kv_p, start, chunk + lead, axis=1)
        kpc = jax.lax.dynamic_slice_in_dim(pos_k, start, chunk + lead, axis=1)
        tc = None if topk_p is None else jax.lax.dynamic_slice_in_dim(topk_p, start, chunk, axis=1)
        sq = sk = None
        if seg_q is not None:
            sq = jax.lax.dynamic_slice_in_dim(seg_q, start, chunk, axis=1)
            sk = jax.lax.dynamic_slice_in_dim(seg_k, start, chunk + lead, axis=1)
        return one(qc, pc, kc, kpc, tc, sq, sk)

    out = jax.lax.map(body, jnp.arange(n_chunks))  # [n_chunks, B, chunk, ...]
    out = jnp.moveaxis(out, 0, 1)
    return out.reshape(b, n_chunks * chunk, *out.shape[3:])[:, :t]
