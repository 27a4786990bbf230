"""Generation by full-forward recompute: every step re-runs the training forward over the whole sequence.

O(T²) and slow, but it has no cache to get wrong, so it is the oracle the cached engine is tested against and a
fallback that works for any config.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model.forward import ForwardOptions, forward


def sample_token(logits: np.ndarray, rng: np.random.Generator, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0) -> int:
    """Greedy for temperature 0; otherwise temperature / top-k / top-p sampling on the host (float64)."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"invalid sampling parameters: temperature={temperature}, top_k={top_k}, top_p={top_p}")
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits / temperature
    if top_k:
        kth = np.sort(z)[-min(top_k, z.size)]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p) + 1)]
        mask = np.zeros_like(p, bool)
        mask[keep] = True
        p = np.where(mask, p, 0)
        p /= p.sum()
    return int(rng.choice(p.size, p=p))


def generate_by_recompute(params: dict, config, prompt: Sequence[int], *, max_new_tokens: int, hasher=None,
                          temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                          stop_tokens: Sequence[int] = (), on_token: Callable[[int], None] | None = None,
                          options: ForwardOptions = ForwardOptions()) -> list[int]:
    if len(prompt) == 0:
        raise ValueError("empty prompt")
    if len(prompt) + max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_position_embeddings ({config.max_position_embeddings})")
    fwd = jax.jit(lambda p, t, e: forward(p, t, config=config, engram_ids=e, options=options))
    rng = np.random.default_rng(seed)
    tokens = list(int(t) for t in prompt)
    out: list[int] = []
    # One compiled shape: right-pad to the final length. Causality makes the padding invisible to the
    # positions we read.
    total = len(tokens) + max_new_tokens
    for _ in range(max_new_tokens):
        n = len(tokens)
        arr = np.full((1, total), config.pad_token_id, np.int32)
        arr[0, :n] = tokens
        eids = None if hasher is None else jnp.asarray(hasher.row_ids(arr))
        logits = np.asarray(fwd(params, jnp.asarray(arr), eids)[0, n - 1])
        nxt = sample_token(logits, rng, temperature=temperature, top_k=top_k, top_p=top_p)
        out.append(nxt)
        tokens.append(nxt)
        if on_token is not None:
            on_token(nxt)
        if nxt in stop_tokens:
            break
    return out
