"""Expert-parallel routed experts: ``shard_map`` + all-to-all token dispatch (SPEC §6 maths, unchanged).

Layout (from the active :func:`dsv41_jax.parallel.rules.sharding_context`):

* tokens ``[M, d]`` are split over the ``tokens`` mesh axes (the batch axes);
* routed experts ``[E, F, d]`` over the ``experts`` mesh axes (the EP group, size ``n_ep``), their width ``F``
  over the ``expert_mlp`` axes (tensor parallel inside each expert, partial sums reduced with ``psum``).

Per device: the router's picks (computed outside, per token, exactly as in the unsharded MoE) give each token the
set of EP peers that own one of its experts. Each token is sent ONCE to each such peer (not once per expert), with
its ``k`` (local expert id, weight) slots, in fixed-size chunks ``[n_ep, C, d]`` through one ``all_to_all``. The
receiver runs its local experts with grouped matmuls (``jax.lax.ragged_dot``, the same ops as
``dsv41_jax.ops.moe.routed_ragged``), sums its experts' weighted outputs per received token, and a second
``all_to_all`` returns one row per (token, peer); the sender adds them up. Only the order of the final sums differs
from the unsharded MoE.

* **dropless** (``capacity_factor=None``): ``C`` = the local token count, the worst case (every local token routed
  to one peer), so nothing is ever dropped. The receiver's grouped-matmul buffer holds n_ep x C x min(k, E/n_ep)
  (token, expert) rows = the balanced load (C x k) x min(n_ep, E/k): the price of never dropping.
* **capacity** (``capacity_factor=f``): ``C = ceil(f · tokens · k / n_ep)`` rows per (source, peer) chunk; a token
  that does not fit loses its experts on that peer (its other experts and the shared expert still apply). The
  number of dropped (token, expert) assignments is returned per token (``dropped``) so callers report it.

EP axes that do not split the tokens (e.g. ``tensor`` under the ``pod`` rules, where tokens are replicated over it)
first split the local tokens among themselves and all-gather the results afterwards, so no token is sent twice.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsv41_jax.parallel.mesh import MeshError
from dsv41_jax.parallel.rules import current

_HI = jax.lax.Precision.HIGHEST


def _linear_index(axes, mesh):
    """Linear index of this device over ``axes`` (major to minor), inside shard_map."""
    idx = jnp.int32(0)
    for a in axes:
        idx = idx * mesh.shape[a] + jax.lax.axis_index(a)
    return idx


def _spec(axes):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def capacity(tokens: int, top_k: int, n_ep: int, capacity_factor: float | None) -> int:
    """Rows per (source, destination) chunk: ``tokens`` when dropless, else ``ceil(f · tokens · k / n_ep)``."""
    if capacity_factor is None:
        return tokens
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for dropless), got {capacity_factor}")
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / n_ep)))


def _local_experts(xr, ids, wr, w1, w2, w3, limit, n_local):
    """Grouped matmuls over the received rows. xr [R, d]; ids/wr [R, k] (ids == n_local: no expert here).

    Same op sequence as ``routed_ragged``: gather rows sorted by expert, gate/up ragged_dot, clamp, silu·up·weight,
    down ragged_dot, scatter-add per row in float32. Returns [R, d] float32 (a partial sum over this device's
    slice of the expert width).
    """
    r, k = ids.shape
    # HIGHEST for float32 (tests); bf16 operands are exact at default precision (and TPU's grouped-matmul kernel
    # rejects an fp32 contract precision on bf16 inputs).
    prec = _HI if xr.dtype == jnp.float32 else None
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    row_of = order // k
    xs = xr[row_of]
    group_sizes = jnp.bincount(flat_ids, length=n_local).astype(jnp.int32)  # ids == n_local fall outside
    gate = jax.lax.ragged_dot(xs, jnp.swapaxes(w1, 1, 2), group_sizes, precision=prec).astype(jnp.float32)
    up = jax.lax.ragged_dot(xs, jnp.swapaxes(w3, 1, 2), group_sizes, precision=prec).astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    w_sorted = wr.reshape(-1)[order]
    act = jax.nn.silu(gate) * up * w_sorted[:, None]
    act = jnp.where((flat_ids[order] < n_local)[:, None], act, 0.0)  # rows past the last group: no expert
    out = jax.lax.ragged_dot(act.astype(xr.dtype), jnp.swapaxes(w2, 1, 2), group_sizes, precision=prec)
    return jnp.zeros((r, xr.shape[-1]), jnp.float32).at[row_of].add(out.astype(jnp.float32))


def routed_expert_parallel(x, weights, idx, w1, w2, w3, limit, *, capacity_factor: float | None = None):
    """Routed-expert output of flattened tokens under the active sharding context.

    x [M, d]; weights [M, k] float32 (already normalised and scaled); idx [M, k] int32 global expert ids;
    w1/w3 [E, F, d], w2 [E, d, F]. Returns (y [M, d] float32, {"dropped": [M] int32}).
    """
    ctx = current()
    if ctx is None:
        raise MeshError("moe_impl='expert_parallel' needs an active mesh: trace the forward inside "
                        "dsv41_jax.parallel.sharding_context(mesh, rules) (sharded_jit / sharded_forward do this)")
    mesh = ctx.mesh
    tok_axes = ctx.axes("tokens")
    ep_axes = ctx.axes("experts")
    tp_axes = ctx.axes("expert_mlp")
    if set(tp_axes) & set(ep_axes):
        raise MeshError(f"rules {ctx.rules.name!r}: expert_mlp axes {tp_axes} overlap the experts axes {ep_axes}")
    if set(tp_axes) & set(tok_axes):
        raise MeshError(f"rules {ctx.rules.name!r}: expert_mlp axes {tp_axes} also split the tokens {tok_axes}; "
                        "tensor-parallel experts need the tokens replicated over those axes")
    m, d = x.shape
    k = idx.shape[1]
    n_exp, f_dim = w1.shape[0], w1.shape[1]
    n_ep = math.prod(mesh.shape[a] for a in ep_axes)
    n_tp = math.prod(mesh.shape[a] for a in tp_axes)
    n_tok = math.prod(mesh.shape[a] for a in tok_axes)
    if n_exp % n_ep:
        raise MeshError(f"mesh axes {ep_axes} (total {n_ep}) do not divide the {n_exp} routed experts")
    if f_dim % n_tp:
        raise MeshError(f"mesh axes {tp_axes} (total {n_tp}) do not divide the expert width {f_dim}")
    n_local = n_exp // n_ep
    extra = tuple(a for a in ep_axes if a not in tok_axes)  # EP axes over which the tokens are replicated
    n_extra = math.prod(mesh.shape[a] for a in extra)

    # Pad the token count so every token shard, then every extra-axis split, is whole. Pad rows route nowhere.
    unit = n_tok * n_extra
    m_pad = -(-m // unit) * unit
    valid = jnp.arange(m_pad) < m
    if m_pad != m:
        x = jnp.pad(x, ((0, m_pad - m), (0, 0)))
        weights = jnp.pad(weights, ((0, m_pad - m), (0, 0)))
        idx = jnp.pad(idx, ((0, m_pad - m), (0, 0)))
    m_loc = m_pad // n_tok // n_extra
    cap = capacity(m_loc, k, n_ep, capacity_factor)
    kk = min(k, n_local)  # expert slots per (token, peer)

    def body(x, weights, idx, valid, w1, w2, w3):
        if extra:  # split this device's tokens among the EP peers that hold the same tokens
            r = _linear_index(extra, mesh)
            x, weights, idx, valid = (jax.lax.dynamic_slice_in_dim(a, r * m_loc, m_loc, axis=0)
                                      for a in (x, weights, idx, valid))
        dest = jnp.where(valid[:, None], idx // n_local, -1)  # [m, k] owning peer of each pick
        peers = jnp.arange(n_ep)
        hit = jnp.any(dest[:, :, None] == peers, axis=1)  # [m, n_ep] token needs peer p
        pos = jnp.cumsum(hit, axis=0) - 1  # slot of the token in its chunk for peer p
        kept = hit & (pos < cap)
        # src[p, c] = local token in slot c of the chunk for peer p (m = empty slot)
        slot = jnp.where(kept, pos, cap)
        src = jnp.full((n_ep, cap + 1), m_loc, jnp.int32)
        src = src.at[jnp.broadcast_to(peers, (m_loc, n_ep)), slot].set(
            jnp.broadcast_to(jnp.arange(m_loc, dtype=jnp.int32)[:, None], (m_loc, n_ep)), mode="drop")[:, :cap]
        x_ext = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])
        dest_ext = jnp.concatenate([dest, jnp.full((1, k), -1, dest.dtype)])
        idx_ext = jnp.concatenate([idx, jnp.zeros((1, k), idx.dtype)])
        w_ext = jnp.concatenate([weights, jnp.zeros((1, k), weights.dtype)])
        send_x = x_ext[src]  # [n_ep, cap, d]
        mine = dest_ext[src] == peers[:, None, None]  # [n_ep, cap, k] slot j goes to an expert of peer p
        send_ids = jnp.where(mine, idx_ext[src] - peers[:, None, None] * n_local, n_local).astype(jnp.int32)
        send_w = jnp.where(mine, w_ext[src], 0.0).astype(jnp.float32)
        if kk < k:  # a token has at most n_local experts on one peer: send only that many slots, valid first
            first = jnp.argsort(~mine, axis=-1, stable=True)[..., :kk]
            send_ids = jnp.take_along_axis(send_ids, first, axis=-1)
            send_w = jnp.take_along_axis(send_w, first, axis=-1)

        def a2a(a):
            return jax.lax.all_to_all(a, ep_axes, 0, 0, tiled=True) if ep_axes else a

        recv_x, recv_ids, recv_w = a2a(send_x), a2a(send_ids), a2a(send_w)
        y_recv = _local_experts(recv_x.reshape(n_ep * cap, d), recv_ids.reshape(n_ep * cap, kk),
                                recv_w.reshape(n_ep * cap, kk), w1, w2, w3, limit, n_local)
        if tp_axes:
            y_recv = jax.lax.psum(y_recv, tp_axes)
        y_back = a2a(y_recv.reshape(n_ep, cap, d))
        y = jnp.zeros((m_loc + 1, d), jnp.float32).at[src.reshape(-1)].add(y_back.reshape(-1, d))[:m_loc]
        # dropped (token, expert) assignments: valid picks whose peer chunk was full
        pick_kept = jnp.take_along_axis(kept, jnp.clip(dest, 0, n_ep - 1), axis=1)
        dropped = jnp.sum((dest >= 0) & ~pick_kept, axis=1).astype(jnp.int32)
        if extra:
            y = jax.lax.all_gather(y, extra, axis=0, tiled=True)
            dropped = jax.lax.all_gather(dropped, extra, axis=0, tiled=True)
        return y, dropped

    tok = P(_spec(tok_axes))
    w_in = P(_spec(ep_axes), _spec(tp_axes), None)
    w_out = P(_spec(ep_axes), None, _spec(tp_axes))
    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, tok, w_in, w_out, w_in), out_specs=(tok, tok),
                       check_vma=False)
    y, dropped = fn(x, weights.astype(jnp.float32), idx.astype(jnp.int32), valid, w1, w2, w3)
    return y[:m], {"dropped": dropped[:m]}
