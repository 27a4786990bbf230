"""Optimisers (optax), learning-rate schedules and parameter selection by path.

* ``build_optimizer(config, train_config, params)`` -> an ``optax.GradientTransformation`` whose learning rate is
  1: the train step multiplies its updates by the scheduled rate (``lr_at(step)``), so the schedule, and the total
  number of steps, can change without recompiling, and AdamW's decoupled decay is still ``lr · wd · w``.
* AdamW by default; ``optimizer="muon"`` uses ``optax.contrib.muon`` on every linear weight (2-D ``[out, in]`` and
  stacked experts ``[E, out, in]``), AdamW on embeddings, the LM head, Engram tables, norms, sinks and mHC.
* Parameters are selected by regexes over their paths (``layers/3/attn/wq_a``): ``trainable`` / ``frozen``.
  Frozen parameters get no update and no optimiser state; the router biases are never touched by the optimiser
  (they move by the noaux balance rule in the train step).
* Gradient clipping by global norm is computed over the trainable parameters only.
"""

from __future__ import annotations

import math
import re

import jax
import optax

_global_norm = optax.tree.norm if hasattr(optax, "tree") and hasattr(optax.tree, "norm") else optax.global_norm

from dsv41_jax.model.params import flat_specs
from dsv41_jax.train.config import TrainConfig

ROUTER_BIAS = re.compile(r"(^|/)ffn/gate/bias$")
# Parameters Muon must not orthogonalise (tables, head, vectors, mHC mixing).
_NON_MATRIX = re.compile(r"(^embed$|^lm_head$|/engram/embed$|/hc_(attn|ffn)/|/engram/(q|k)_weight$)")


_NORM_LIKE = re.compile(r"/engram/(q|k)_weight$")


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def map_with_path(fn, tree):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree.unflatten(treedef, [fn(path_str(p), x) for p, x in leaves])


def is_trainable(path: str, tc: TrainConfig) -> bool:
    if ROUTER_BIAS.search(path):
        return False
    if tc.trainable and not any(re.search(p, path) for p in tc.trainable):
        return False
    return not any(re.search(p, path) for p in tc.frozen)


def trainable_mask(params, tc: TrainConfig):
    """A pytree of bools like ``params``: True where the optimiser updates the parameter."""
    return map_with_path(lambda p, _: is_trainable(p, tc), params)


def check_selection(config, tc: TrainConfig) -> list[str]:
    """Paths that train under ``tc``; raises if the selection matches nothing (a typo in a regex)."""
    paths = [p for p, _ in flat_specs(config)]
    for name in ("trainable", "frozen"):
        for pattern in getattr(tc, name):
            if not any(re.search(pattern, p) for p in paths):
                raise ValueError(f"train config field `{name}`: regex {pattern!r} matches no parameter path "
                                 f"(paths look like {paths[3]!r})")
    chosen = [p for p in paths if is_trainable(p, tc)]
    if not chosen:
        raise ValueError("no parameter is trainable with this `trainable` / `frozen` selection")
    return chosen


def lr_at(step: int, tc: TrainConfig, total_steps: int | None = None) -> float:
    """The learning rate used for update number ``step`` (0-based), computed on the host."""
    total = max(1, int(total_steps or tc.steps))
    peak, floor = tc.lr, tc.lr * tc.min_lr_ratio
    if tc.warmup_steps and step < tc.warmup_steps:
        return peak * (step + 1) / tc.warmup_steps
    if tc.schedule == "constant":
        return peak
    span = max(1, total - tc.warmup_steps)
    frac = min(1.0, max(0.0, (step - tc.warmup_steps) / span))
    if tc.schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * frac))
    if tc.schedule == "linear":
        return peak + (floor - peak) * frac
    # wsd: constant, then a linear decay over the last `decay_frac` of the steps
    start = 1.0 - tc.decay_frac
    if frac <= start or tc.decay_frac == 0:
        return peak
    return peak + (floor - peak) * (frac - start) / tc.decay_frac


def _decay_mask(params):
    """Decoupled weight decay on weight matrices and tables only (not norms, sinks, biases, mHC base / scale, or
    the Engram q / k weights, which are norm-like vectors per stream)."""
    return map_with_path(lambda p, x: getattr(x, "ndim", 0) >= 2 and not _NORM_LIKE.search(p), params)


def _muon_dims(params):
    """Muon dimension numbers: linear weights are [out, in] (reduction = last axis); experts [E, out, in]."""
    def one(path, x):
        if _NON_MATRIX.search(path) or getattr(x, "ndim", 0) < 2:
            return None
        return optax.contrib.MuonDimensionNumbers(reduction_axis=x.ndim - 1, output_axis=x.ndim - 2)
    return map_with_path(one, params)


def build_optimizer(tc: TrainConfig, params) -> optax.GradientTransformation:
    """The unit-learning-rate optimiser for the trainable parameters (frozen ones get ``set_to_zero``)."""
    if tc.optimizer == "adamw":
        inner = optax.adamw(1.0, b1=tc.b1, b2=tc.b2, eps=tc.eps, weight_decay=tc.weight_decay, mask=_decay_mask)
    else:
        inner = optax.contrib.muon(1.0, beta=tc.b1 if tc.b1 > 0 else 0.95, eps=tc.eps, weight_decay=tc.weight_decay,
                                   weight_decay_mask=_decay_mask, adam_b1=tc.b1, adam_b2=tc.b2,
                                   adam_weight_decay=tc.weight_decay, muon_weight_dimension_numbers=_muon_dims)
    if tc.grad_clip > 0:
        inner = optax.chain(optax.clip_by_global_norm(tc.grad_clip), inner)
    labels = map_with_path(lambda p, _: "train" if is_trainable(p, tc) else "frozen", params)
    return optax.multi_transform({"train": inner, "frozen": optax.set_to_zero()}, labels)


def global_norm(tree) -> jax.Array:
    return _global_norm(tree)


__all__ = ["build_optimizer", "lr_at", "trainable_mask", "is_trainable", "check_selection", "path_str",
           "map_with_path", "ROUTER_BIAS", "global_norm"]
