"""Training losses: masked next-token cross-entropy, DeepSeekMoE balance terms, and the indexer KL objective.

Indexer objective (DeepSeek-V3.2's, adapted to CSA2): for every layer that runs an indexer (Full and Reindex),
the target is that layer's main attention distribution — per head, ONE softmax over the sliding-window keys, the
candidate compressed entries and the sink, exactly as the attention computes it — restricted to the candidate
entries, summed over heads and L1-normalised; the indexer is trained to match it with ``KL(p_t || softmax(I_t))``:

* ``dense`` (warm-up): the candidates are every entry visible to query t (causal, same document), i.e. the target
  is the dense attention's distribution;
* ``sparse``: the candidates are the top-k the forward actually selected for t (the attention the forward ran).

A query whose heads put most of their mass on the window or the sink still yields a normalised target, but heads
that attend to the compressed entries weigh more in the sum over heads — the V3.2 definition (a per-head softmax
over the candidates alone would give every head the same weight).

Reuse layers: a Reuse layer attends with its index source's top-k but has no indexer of its own. The target of an
index source is its OWN attention only; the Reuse layers that consume its selection do not add to it (their
attention inputs would have to be kept for the loss as well). This is a choice, not a V3.2 rule (V3.2 has an
indexer in every layer).

The indexer input is detached: the target, the attention-site input, the query latent, the compressed latent and
(in Reindex layers) the shared indexer keys are ``stop_gradient``-ed, so the KL trains only the indexer's own
weights (``wq_b``, ``weights_proj`` and, in Full layers, ``wk`` / ``k_norm``) and the LM loss never reaches them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.config import ModelConfig
from dsv41_jax.ops import quant
from dsv41_jax.ops.attention import attention_inputs, sequence_window_lse
from dsv41_jax.ops.compressor import compress_sequence
from dsv41_jax.ops.gather import take_rows_batched
from dsv41_jax.ops.indexer import indexer_queries, indexer_scores
from dsv41_jax.ops.linear import linear
from dsv41_jax.ops.norms import rms_norm
from dsv41_jax.ops.query_blocks import sum_query_blocks
from dsv41_jax.ops.rope import apply_rope, cos_sin
from dsv41_jax.plan import FULL

_HI = jax.lax.Precision.HIGHEST
_NEG = -1e30  # finite "minus infinity": keeps empty rows NaN-free in both directions


# ----------------------------------------------------------------------------------------------------------------
# language-model loss
# ----------------------------------------------------------------------------------------------------------------

def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Masked next-token cross-entropy. logits [B, T, V] (any float), targets [B, T] int, mask [B, T].

    Returns (sum of per-token losses, number of counted tokens), both float32 scalars.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    m = mask.astype(jnp.float32)
    return jnp.sum((lse - tgt) * m), jnp.sum(m)


# ----------------------------------------------------------------------------------------------------------------
# MoE balance
# ----------------------------------------------------------------------------------------------------------------

def expert_load(indices: jax.Array, valid: jax.Array, n_experts: int) -> jax.Array:
    """Tokens routed to each expert: indices [M, k] int, valid [M] -> [E] float32."""
    w = jnp.broadcast_to(valid.reshape(-1, 1).astype(jnp.float32), indices.shape)
    return jnp.zeros((n_experts,), jnp.float32).at[indices.reshape(-1)].add(w.reshape(-1))


def noaux_bias_update(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """DeepSeekMoE's auxiliary-loss-free balancing: raise the selection bias of under-loaded experts and lower it
    for over-loaded ones by ``rate`` (the sign of the load error)."""
    mean = jnp.mean(load)
    return (bias.astype(jnp.float32) + rate * jnp.sign(mean - load)).astype(bias.dtype)


def balance_loss(scores: jax.Array, indices: jax.Array, valid: jax.Array, top_k: int) -> jax.Array:
    """Sequence-wise balance loss (DeepSeek-V3 form), 1.0 when perfectly balanced.

    scores [B·T, E] router affinities (differentiable), indices [B·T, k], valid [B, T].
    L = mean_b Σ_e f_e P_e with f_e = E/(k·T_b) Σ_t 1[e ∈ topk(t)], P_e = 1/T_b Σ_t s_{t,e} / Σ_e' s_{t,e'}.
    """
    b, t = valid.shape
    e = scores.shape[-1]
    v = valid.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(v, axis=1), 1.0)  # [B]
    s = scores.astype(jnp.float32).reshape(b, t, e)
    s = s / (jnp.sum(s, axis=-1, keepdims=True) + 1e-20)
    p = jnp.sum(s * v[..., None], axis=1) / n[:, None]  # [B, E]
    onehot = jax.nn.one_hot(indices.reshape(b, t, -1), e, dtype=jnp.float32).sum(axis=2)  # [B, T, E]
    f = jnp.sum(onehot * v[..., None], axis=1) * (e / (top_k * n[:, None]))
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * p, axis=-1))


def load_balance_stats(loads: jax.Array) -> dict:
    """loads [L, E] -> max/mean ratio per layer, averaged ("balance": 1.0 = perfect) and worst over layers."""
    ratio = jnp.max(loads, axis=-1) / jnp.maximum(jnp.mean(loads, axis=-1), 1e-9)
    return {"balance": jnp.mean(ratio), "balance_worst": jnp.max(ratio)}


# ----------------------------------------------------------------------------------------------------------------
# indexer KL
# ----------------------------------------------------------------------------------------------------------------

def kl_target(cmp_logits: jax.Array, cand: jax.Array, outside_lse: jax.Array) -> jax.Array:
    """The indexer KL target (V3.2): cmp_logits [B, C, H, K] main attention logits of the candidate entries, cand
    [B, C, K] bool, outside_lse [B, C, H] the log-sum-exp of the rest of the attention's softmax (window keys and
    sink, ``ops.attention.sequence_window_lse``) -> p [B, C, K]: the attention probabilities of the candidates
    (softmax over window + candidates + sink per head), summed over heads, L1-normalised (all zero without a
    candidate)."""
    masked = jnp.where(cand[:, :, None, :], cmp_logits.astype(jnp.float32), _NEG)
    lse = jnp.logaddexp(jax.nn.logsumexp(masked, axis=-1), outside_lse.astype(jnp.float32))  # [B, C, H]
    probs = jnp.where(cand[:, :, None, :], jnp.exp(masked - lse[..., None]), 0.0)
    p = jnp.sum(probs, axis=2)
    return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)


def _kl_rows(p_logits: jax.Array, i_scores: jax.Array, cand: jax.Array, weight: jax.Array, outside_lse: jax.Array):
    """p_logits [B, C, H, K] main attention logits, i_scores [B, C, K] indexer scores, cand [B, C, K] bool
    candidate set, weight [B, C] query weights, outside_lse [B, C, H] (see ``kl_target``) -> (Σ weight · KL,
    Σ weight over rows with a candidate)."""
    p = jax.lax.stop_gradient(kl_target(p_logits, cand, outside_lse))
    log_q = jax.nn.log_softmax(jnp.where(cand, i_scores, _NEG), axis=-1)
    kl = jnp.sum(jax.scipy.special.xlogy(p, p) - jnp.where(cand, p * log_q, 0.0), axis=-1)
    w = weight * jnp.any(cand, axis=-1)
    return jnp.sum(kl * w), jnp.sum(w)


def indexer_kl_sum(q, kv, outside_lse, qi, w, keys, weight, positions, *, ratio: int, mode: str, topk=None,
                   chunk: int = 256, segments=None, entries=None):
    """One indexer layer's Σ weight · KL over its queries (in query blocks of ``chunk``) and Σ weight.

    q [B, T, H, D] main queries, kv [B, N, D] rotated compressed entries, outside_lse [B, T, H]
    (``ops.attention.sequence_window_lse``) — the detached target side; qi [B, T, Hi, di], w [B, T, Hi] and keys
    [B, N, di] — the indexer side the gradient reaches; weight [B, T]; ``topk`` [B, T, K] (sparse mode);
    ``segments`` / ``entries`` for packed rows (dense mode)."""
    n_entries = keys.shape[1]
    scale = q.shape[-1] ** -0.5
    index_dim = qi.shape[-1]
    # Every query block reads the keys: they enter the query-block map in float32 so that their gradient (each key
    # is scored by many queries) is summed in float32, not in a bf16 carry (ops.gather).
    keys, kv = keys.astype(jnp.float32), kv.astype(jnp.float32)
    t = q.shape[1]
    if mode == "dense":
        def one(qc, qic, wc, pc, wtc, oc, *seg):
            scores = indexer_scores(qic, wc, keys)  # [B, C, N]
            logits = jnp.einsum("bchd,bnd->bchn", qc.astype(jnp.float32), kv, precision=_HI) * scale
            ent = jnp.arange(n_entries)
            if entries is None:
                cand = ent[None, None, :] < ((pc + 1) // ratio)[..., None]
            else:
                cand = (entries["valid"][:, None, :] & (entries["segments"][:, None, :] == seg[0][:, :, None])
                        & (entries["rank"][:, None, :] < ((pc + 1) // ratio)[..., None]))
            return _kl_rows(logits, scores, cand, wtc, oc)

        args = (q, qi, w, positions, weight, outside_lse) + ((segments,) if segments is not None else ())
    else:
        def one(qc, qic, wc, selc, wtc, oc):
            safe = jnp.clip(selc, 0, n_entries - 1)
            k_sel = take_rows_batched(keys, safe)  # [B, C, K, di]
            c_sel = take_rows_batched(kv, safe)  # [B, C, K, hd]
            dots = jnp.einsum("bchd,bckd->bchk", qic.astype(jnp.float32), k_sel, precision=_HI)
            scores = jnp.einsum("bchk,bch->bck", jax.nn.relu(dots) * (index_dim ** -0.5), wc.astype(jnp.float32),
                                precision=_HI)
            logits = jnp.einsum("bchd,bckd->bchk", qc.astype(jnp.float32), c_sel, precision=_HI) * scale
            return _kl_rows(logits, scores, selc >= 0, wtc, oc)

        args = (q, qi, w, topk, weight, outside_lse)
    return sum_query_blocks(one, t, chunk, *args)


def indexer_kl_loss(params: dict, attn_inputs: dict, topk: dict | None, config: ModelConfig, positions: jax.Array,
                    rope: dict, *, mode: str, quant_on: bool, weight: jax.Array, chunk: int = 256,
                    segments: jax.Array | None = None):
    """Mean KL over every indexer layer. ``attn_inputs[l]`` is layer l's normalised attention-site input [B, T, d]
    (from the forward), ``topk[l]`` its selection (``sparse`` mode). Returns (loss, {layer: kl})."""
    if segments is not None:
        from dsv41_jax.ops.compressor import compress_packed
        from dsv41_jax.ops.indexer import packed_entry_layout
    c = config
    sg = jax.lax.stop_gradient
    per_layer = {}
    total = jnp.zeros((), jnp.float32)
    n_layers = 0
    for spec in c.plan:
        if not spec.runs_indexer:
            continue
        src = spec.kv_source
        p_src = params["layers"][src]["attn"]
        x_src = sg(attn_inputs[src])
        if segments is None:
            latent = compress_sequence(x_src, sg(p_src["compressor"]), spec.ratio, c.rms_norm_eps)
            entry_pos = (jnp.arange(latent.shape[1]) * spec.ratio)[None, :]
            entries = None
        else:
            latent, valid = compress_packed(x_src, sg(p_src["compressor"]), spec.ratio, c.rms_norm_eps, positions,
                                            segments)
            entry_pos = positions
            entries = packed_entry_layout(positions, segments, valid, spec.ratio, c.candidate_block_size)
        n_entries = latent.shape[1]
        if n_entries == 0:
            continue
        ccos, csin = cos_sin(rope["compress"], entry_pos)
        ip_src = p_src["indexer"] if spec.mode == FULL else sg(p_src["indexer"])
        keys = apply_rope(rms_norm(linear(latent, ip_src["wk"]), ip_src["k_norm"], c.rms_norm_eps), ccos, csin)
        kv = sg(apply_rope(latent, ccos, csin))
        if quant_on:
            keys = quant.fake_quant_fp4_e2m1_block(keys, 32, scale_format="ue8m0")
            kv = sg(quant.fake_quant_fp4_e2m1_block(kv, 16, scale_format="e4m3"))
        pa = sg({k: v for k, v in params["layers"][spec.index]["attn"].items() if k != "indexer"})
        ip = params["layers"][spec.index]["attn"]["indexer"]
        x = sg(attn_inputs[spec.index])
        cos, sin = cos_sin(rope[spec.rope], positions)
        q_res, q, win_kv = sg(attention_inputs(pa, x, cos, sin, c, quant_on))
        # the window keys and the sink share each head's softmax with the compressed entries (kl_target)
        outside = sequence_window_lse(q, win_kv, positions, pa["attn_sink"], window=c.sliding_window, chunk=chunk,
                                      segments=segments)
        qi, w = indexer_queries(ip, x, q_res, cos, sin, n_heads=c.index_n_heads, head_dim=c.index_head_dim,
                                quant_on=quant_on)
        sel = None
        if mode == "sparse":
            sel = topk[spec.index]  # [B, T, K]
            if sel.shape[-1] == 0:
                continue
        s, n = indexer_kl_sum(q, kv, outside, qi, w, keys, weight, positions, ratio=spec.ratio, mode=mode, topk=sel,
                              chunk=chunk, segments=segments, entries=entries)
        kl = s / jnp.maximum(n, 1.0)
        per_layer[spec.index] = kl
        total = total + kl
        n_layers += 1
    return total / max(n_layers, 1), per_layer
