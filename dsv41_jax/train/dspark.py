"""DSpark's training objective (the drafter against a frozen target; DSpark paper §3.3, SPEC §9).

Per draft slot k (0-based) of every anchor, with weight w_k = exp(-k / decay):

* cross-entropy of the drafter's Markov-corrected distribution p_d against the target's token (the label);
* total variation ||p_d - p_t||_1 against the target's distribution p_t at the same position (one-hot of the label
  when no target logits are given);
* binary cross-entropy of the confidence head against c* = 1 - ||p_d - p_t||_1 / 2 (the probability that the
  draft is accepted, detached).

Each term is a weighted mean over the valid slots; total = ce_weight * CE + tv_weight * TV + conf_weight * BCE
(defaults 0.1 / 0.9 / 1.0 and decay 4, the public DSpark training code's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def anchor_targets(target_logits: jax.Array, anchors: jax.Array, block_size: int) -> jax.Array:
    """The target's logits for every draft slot: slot k of anchor p predicts position p + k + 1, which the target's
    logits at position p + k give. target_logits [B, T, V], anchors [B, A] -> [B, A, S, V] (clipped at the end;
    those slots are invalid anyway)."""
    b, t, v = target_logits.shape
    pos = jnp.clip(anchors[..., None] + jnp.arange(block_size), 0, t - 1)  # [B, A, S]
    a = anchors.shape[1]
    out = jnp.take_along_axis(target_logits, pos.reshape(b, a * block_size)[..., None], axis=1)
    return out.reshape(b, a, block_size, v)


def dspark_loss(logits: jax.Array, confidence: jax.Array, labels: jax.Array, valid: jax.Array,
                target_logits: jax.Array | None = None, *, decay: float = 4.0, ce_weight: float = 0.1,
                tv_weight: float = 0.9, conf_weight: float = 1.0):
    """logits [..., S, V] (Markov-corrected), confidence [..., S] logits, labels / valid [..., S], target_logits
    [..., S, V] or None. Returns (loss, metrics dict)."""
    s, v = logits.shape[-2:]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p_d = jnp.exp(logp)
    if target_logits is None:
        p_t = jax.nn.one_hot(labels, v, dtype=jnp.float32)
    else:
        p_t = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    w = jnp.exp(-jnp.arange(s, dtype=jnp.float32) / decay) * valid.astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(w), 1e-9)
    mean = lambda x: jnp.sum(w * x) / denom  # noqa: E731
    ce = mean(-jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0])
    tv = jnp.sum(jnp.abs(p_d - p_t), axis=-1)
    accept = jax.lax.stop_gradient(1.0 - 0.5 * tv)
    c = confidence.astype(jnp.float32)
    bce = jnp.maximum(c, 0) - c * accept + jnp.log1p(jnp.exp(-jnp.abs(c)))  # BCE with logits, stable
    loss = ce_weight * ce + tv_weight * mean(tv) + conf_weight * mean(bce)
    return loss, {"ce": ce, "tv": mean(tv), "conf_bce": mean(bce), "accept_rate": mean(accept)}


__all__ = ["anchor_targets", "dspark_loss"]
