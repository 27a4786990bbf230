"""Engram's device-side part: table lookup, key/value projection and the gated per-stream write (SPEC §7).
Row ids come from the host (:mod:`dsv41_jax.ops.engram_hash`)."""

import dataclasses

import jax
import jax.numpy as jnp

from dsv41_jax.ops.gather import in_host_memory, take_rows, take_rows_from_host
from dsv41_jax.ops.linear import Fp8GemmInput, is_plain_weight, linear, matmul_precision


def engram_gates(streams: jax.Array, row_ids: jax.Array, params: dict, *, eps: float,
                 clamp: float = 1e-6, host_gather: str | None = None) -> tuple[jax.Array, jax.Array]:
    """What Engram would write: (gate [B, T, hc] float32, value [B, T, D] float32) for streams [B, T, hc, D] and
    row_ids [B, T, n_cols] (absolute rows of this layer's packed table). ``host_gather``: how a table in host memory
    is read (``ops.gather.take_rows_from_host``'s ``how``).

    e = concat of the looked-up rows; kv = e Wkvᵀ -> hc keys + one shared value; per stream
    gate = σ(sign(dot)·sqrt(max(|dot|, clamp))), dot = Σ_D h·(q_w·k_w)·key · rstd(h)·rstd(key) · D^-0.5.
    """
    b, t, hc, d = streams.shape
    # [B, T, cols, ehd]; shared rows: f32 gradient sum
    rows = table_rows(params["embed"], row_ids, streams.dtype, host_gather)
    wkv = params["wkv"]
    if is_plain_weight(wkv):
        e = rows.reshape(b, t, -1).astype(wkv.dtype)
        kv = jnp.einsum("btc,fc->btf", e, wkv, precision=matmul_precision(e, wkv))
    else:  # release-format and / or FP8-input weight (ops.linear)
        kv = linear(rows.reshape(b, t, -1).astype(streams.dtype), wkv)
    key = kv[..., : hc * d].astype(jnp.float32).reshape(b, t, hc, d)
    value = kv[..., hc * d:].astype(jnp.float32)
    weight = params["q_weight"].astype(jnp.float32) * params["k_weight"].astype(jnp.float32)  # [hc, D]
    h = streams.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(h * h, -1) + eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + eps)
    dot = jnp.sum(h * weight * key, -1) * rstd * (d ** -0.5)
    # copysign, not sign(): a dot of exactly +0 keeps the positive root, as in the reference.
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), clamp)), dot))
    return gate, value


def engram_write(streams: jax.Array, row_ids: jax.Array, params: dict, *, eps: float, live: jax.Array | None = None,
                 clamp: float = 1e-6, host_gather: str | None = None) -> jax.Array:
    """streams [B, T, hc, D] += gate · value per stream (:func:`engram_gates`); ``live`` [B, T] = False shuts the
    gate (padding)."""
    gate, value = engram_gates(streams, row_ids, params, eps=eps, clamp=clamp, host_gather=host_gather)
    if live is not None:
        gate = jnp.where(live[..., None], gate, 0.0)
    return (streams.astype(jnp.float32) + gate[..., None] * value[:, :, None, :]).astype(streams.dtype)


def table_rows(table, row_ids: jax.Array, dtype, host_gather: str | None = None) -> jax.Array:
    """``table[row_ids]`` (:func:`dsv41_jax.ops.gather.take_rows`: the gradient of a row many n-grams share is
    summed in float32); a release-format (FP8 rows + scales) table gathers the stored bytes of the needed rows
    only and dequantises them (to ``dtype``). A table in host memory (``inference.host_tables``) is gathered on the
    host or read by the GPU from host memory (``host_gather``: ``ops.gather.take_rows_from_host``): only the
    looked-up rows move to the device (inference only)."""
    if isinstance(table, Fp8GemmInput):
        table = table.weight
    if is_plain_weight(table):
        if in_host_memory(table):
            return take_rows_from_host(table, row_ids, host_gather)
        return take_rows(table, row_ids)
    if in_host_memory(table.values):
        def take(a, ids):
            return take_rows_from_host(a, ids, host_gather)
    else:
        def take(a, ids):
            return jnp.take(a, ids, axis=0)
    rows = dataclasses.replace(table, values=take(table.values, row_ids), scales=take(table.scales, row_ids),
                               shape=tuple(row_ids.shape) + tuple(table.shape[1:]))
    return rows.dequantize(dtype)
