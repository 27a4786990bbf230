"""LoRA fine-tuning: low-rank adapters on chosen projections of a frozen base model (pure functions + a train step).

For a target weight ``W`` [out, in] (PyTorch layout, ``y = x·Wᵀ``) the adapter is ``a`` [in, r], ``b`` [r, out] and

    y = x·Wᵀ + (alpha / r) · (dropout(x)·a)·b

``b`` starts at zero, so a fresh adapter leaves the model's output exactly unchanged; ``a`` starts uniform in
``±1/sqrt(in)`` (the usual Kaiming-uniform choice). The adapter is added to the base GEMM's *output*
(:class:`dsv41_jax.ops.linear.LoraWeight`): the base is never rewritten, so it may stay bf16, float32 or in the
release's FP8 / FP4 storage (QuantizedTensor leaves), and it is frozen — no gradient, no optimiser state.

* Targets: a regex over parameter paths (``layers/3/attn/wq_a``). Default :data:`DEFAULT_TARGETS`: the attention
  projections that are plain GEMMs — queries (``wq_a``, ``wq_b``), the K=V latent (``wkv``) and the output's
  second projection (``wo_b``). Only weights whose GEMM is ``ops.linear.linear`` can carry an adapter
  (:data:`LORA_CAPABLE`): the grouped ``wo_a`` (one matrix per head group), stacked routed experts, the compressor,
  the router, embeddings, the head and mHC are refused by name.
* Adapters: a flat dict ``{param_path: {"a", "b"}}`` of float32 masters; :func:`attach` puts them on the base tree,
  :func:`merge` folds them into a plain float32 parameter tree (what ``dsv41 generate`` loads).
* :class:`LoraTrainStep`: the train step over adapters only (``state["params"]`` = adapters, the optimiser state is
  the adapters'), the frozen base passed to the jitted step as a separate, non-donated argument. The router's
  noaux bias is frozen with the rest of the base.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.params import FP32, flat_specs, init_params
from dsv41_jax.ops.linear import Fp8GemmInput, LoraWeight, weight_array
from dsv41_jax.train.config import DEFAULT_LORA_TARGETS as DEFAULT_TARGETS
from dsv41_jax.train.step import jit_step

# Weights whose every use is ops.linear.linear (so the adapter is added wherever the weight is read).
LORA_CAPABLE = re.compile(r"(/attn/(wq_a|wq_b|wkv|wo_b)|/attn/indexer/(wq_b|wk|weights_proj)"
                          r"|/ffn/shared_experts/w[123]|/engram/wkv)$")


class LoraError(ValueError):
    """Invalid LoRA settings or adapters; the message names the field or the tensor."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0  # on the adapter's input, training only
    targets: str = DEFAULT_TARGETS

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise LoraError(f"lora rank must be a positive integer, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0 and math.isfinite(self.alpha)):
            raise LoraError(f"lora alpha must be a positive number, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise LoraError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
        try:
            re.compile(self.targets)
        except re.error as e:
            raise LoraError(f"lora targets: invalid regex {self.targets!r}: {e}") from None

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    @classmethod
    def from_train_config(cls, tc) -> "LoraConfig":
        return cls(rank=tc.lora_rank, alpha=tc.lora_alpha, dropout=tc.lora_dropout, targets=tc.lora_targets)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def lora_targets(config: ModelConfig, lc: LoraConfig) -> dict[str, tuple[int, int]]:
    """``{path: (out, in)}`` of the weights ``lc.targets`` selects, validated: the regex must match, every match must
    be a LoRA-capable 2-D weight and the rank at most ``min(in, out)``."""
    specs = list(flat_specs(config))
    chosen = [(p, s) for p, s in specs if re.search(lc.targets, p)]
    if not chosen:
        raise LoraError(f"lora targets regex {lc.targets!r} matches no parameter path (paths look like "
                        f"'layers/0/attn/wq_a'; the default is {DEFAULT_TARGETS!r})")
    out = {}
    for path, spec in chosen:
        if len(spec.shape) != 2:
            what = "a stack of expert matrices [E, out, in]" if len(spec.shape) == 3 else "not a matrix"
            raise LoraError(f"lora target {path} has shape {tuple(spec.shape)}: {what}; LoRA needs a 2-D "
                            f"[out, in] projection weight (narrow --lora-targets)")
        if not LORA_CAPABLE.search(path):
            raise LoraError(f"lora target {path} {tuple(spec.shape)} is a matrix but not a plain projection x·Wᵀ "
                            f"(grouped, table, router, compressor or mixing weight); LoRA-capable weights match "
                            f"{LORA_CAPABLE.pattern!r}")
        o, i = spec.shape
        if lc.rank > min(o, i):
            raise LoraError(f"lora rank {lc.rank} exceeds min(out, in) = {min(o, i)} of {path} {(o, i)}: a "
                            f"low-rank adapter needs rank <= {min(o, i)}")
        out[path] = (int(o), int(i))
    return out


def init_adapters(config: ModelConfig, lc: LoraConfig, key: jax.Array) -> dict:
    """Fresh float32 adapters: ``a`` uniform in ±1/sqrt(in), ``b`` zero (the adapted model equals the base)."""
    targets = lora_targets(config, lc)
    out = {}
    for n, (path, (o, i)) in enumerate(sorted(targets.items())):
        bound = 1.0 / math.sqrt(i)
        a = jax.random.uniform(jax.random.fold_in(key, n), (i, lc.rank), jnp.float32, -bound, bound)
        out[path] = {"a": a, "b": jnp.zeros((lc.rank, o), jnp.float32)}
    return out


def abstract_adapters(config: ModelConfig, lc: LoraConfig) -> dict:
    return {p: {"a": jax.ShapeDtypeStruct((i, lc.rank), jnp.float32),
                "b": jax.ShapeDtypeStruct((lc.rank, o), jnp.float32)}
            for p, (o, i) in sorted(lora_targets(config, lc).items())}


def _key_name(k) -> str:
    return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def _is_quantized(x) -> bool:
    return hasattr(x, "fmt") and hasattr(x, "scales")


def _is_weight(x) -> bool:
    return _is_quantized(x) or isinstance(x, (LoraWeight, Fp8GemmInput))


def _map_params(fn, params):
    """``fn(path, leaf)`` over a parameter tree whose leaves may be QuantizedTensor / marked weights."""
    return jax.tree_util.tree_map_with_path(lambda p, x: fn("/".join(_key_name(k) for k in p), x), params,
                                            is_leaf=_is_weight)


def check_adapters(params, adapters: dict) -> None:
    """Every adapter names a parameter of ``params`` and has shapes [in, r] / [r, out] that fit it."""
    shapes = {}
    _map_params(lambda p, w: shapes.__setitem__(p, tuple(w.shape)), params)
    for path, ab in adapters.items():
        if path not in shapes:
            raise LoraError(f"adapter {path!r} names no parameter of the base model")
        if set(ab) != {"a", "b"}:
            raise LoraError(f"adapter {path}: expected keys a and b, got {sorted(ab)}")
        o, i = shapes[path]
        (ai, r), (rb, bo) = ab["a"].shape, ab["b"].shape
        if (ai, bo, rb) != (i, o, r):
            raise LoraError(f"adapter {path}: a {tuple(ab['a'].shape)} / b {tuple(ab['b'].shape)} do not fit the "
                            f"weight [out, in] = {(o, i)} (expected a [in, r], b [r, out])")


def attach(params, adapters: dict, lc: LoraConfig, *, dropout_key: jax.Array | None = None):
    """The parameter tree with every adapted weight replaced by a :class:`LoraWeight` (base, a, b) — what the
    forward consumes. ``dropout_key`` turns on adapter-input dropout (training); None = off."""
    index = {p: n for n, p in enumerate(sorted(adapters))}

    def one(path, w):
        if path not in adapters:
            return w
        key = None
        if dropout_key is not None and lc.dropout > 0:
            key = jax.random.fold_in(dropout_key, index[path])
        return LoraWeight(w, adapters[path]["a"], adapters[path]["b"], key, scale=lc.scale, dropout_rate=lc.dropout)

    return _map_params(one, params)


def merge(params, adapters: dict, lc: LoraConfig, dtype=jnp.float32):
    """A plain parameter tree with the adapters folded in: ``W + scale·(a·b)ᵀ``, computed in float32 (a
    QuantizedTensor base is dequantised exactly first), returned in ``dtype``; every other parameter is a float
    array in ``dtype`` (float32-only parameters stay float32)."""
    check_adapters(params, adapters)

    def one(path, w):
        base = weight_array(w, jnp.float32).astype(jnp.float32)
        if path not in adapters:
            return base if base.dtype == jnp.float32 and dtype == jnp.float32 else base.astype(dtype)
        a = jnp.asarray(adapters[path]["a"], jnp.float32)
        b = jnp.asarray(adapters[path]["b"], jnp.float32)
        delta = jnp.einsum("ir,ro->oi", a, b, precision=jax.lax.Precision.HIGHEST)
        return (base + lc.scale * delta).astype(dtype)

    return _map_params(one, params)


def frozen_base(params, config: ModelConfig, dtype) -> dict:
    """The base as the LoRA step holds it: float weights in the compute ``dtype`` (float32-only parameters — mHC,
    sinks, router bias — stay float32), QuantizedTensor leaves as they are (dequantised at each GEMM)."""
    specs = dict(flat_specs(config))

    def one(path, w):
        if _is_weight(w):
            return w
        return jnp.asarray(w, jnp.float32 if specs[path].dtype == FP32 else dtype)

    return _map_params(one, params)


def base_reference(init_from: str | None) -> str | None:
    """How a LoRA checkpoint names its frozen base: ``"default"``, an absolute checkpoint path, or None (a random
    base rebuilt from the run's seed)."""
    import os

    if init_from is None or (init_from == "default" and not os.path.exists(init_from)):
        return init_from
    return os.path.abspath(init_from)


def check_resume_base(meta: dict, now: dict, ckpt_dir: str) -> None:
    """Refuse to resume LoRA adapters over another base or with other adapter settings."""
    saved = meta.get("lora")
    if not saved:
        raise LoraError(f"checkpoint {ckpt_dir} holds full fine-tuning state, not LoRA adapters; drop --lora or "
                        "use another --ckpt-dir")
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs now {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k) and not (k == "seed" and now.get("base") is not None)]
    if diff:
        raise LoraError(f"checkpoint {ckpt_dir} holds LoRA adapters of another setup:\n  " + "\n  ".join(diff))


def load_merged_checkpoint(ckpt, step: int, meta: dict, config: ModelConfig, shardings=None):
    """(config, float32 params) of a LoRA training checkpoint: its base (``meta["lora"]["base"]``) with the
    saved adapters folded in — so ``dsv41 generate --checkpoint`` reads a LoRA run like any other."""
    import orbax.checkpoint as ocp

    info = meta["lora"]
    lc = LoraConfig(rank=info["rank"], alpha=info["alpha"], dropout=info["dropout"], targets=info["targets"])
    if info.get("base") is None:
        base = init_params(config, jax.random.split(jax.random.PRNGKey(int(info.get("seed", 0))), 3)[0])
    else:
        from dsv41_jax.train.trainer import load_init_params

        base = load_init_params(info["base"], config)
    abstract = abstract_adapters(config, lc)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), abstract)
    adapters = ckpt.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(target)))["params"]
    params = merge(base, adapters, lc)
    if shardings is not None:
        params = jax.device_put(params, shardings)
    return config, params


# ----------------------------------------------------------------------------------------------------------------
# the train step
# ----------------------------------------------------------------------------------------------------------------

def _train_step_base():
    from dsv41_jax.train.step import TrainStep

    return TrainStep


def make_lora_train_step(config: ModelConfig, tc, *, mesh=None, rules: str = "tp"):
    """A :class:`LoraTrainStep` for ``tc`` (``tc.lora`` True). Call ``set_base(params)`` (or ``init_state(params)``)
    before stepping."""
    if mesh is None:  # one compiled program per (config, train config); the base is an argument, set per run
        return _cached_lora_step(config, tc)
    return _build_lora_step(config, tc, mesh, rules)


@functools.lru_cache(maxsize=8)
def _cached_lora_step(config: ModelConfig, tc):
    return _build_lora_step(config, tc, None, "tp")


def _build_lora_step(config: ModelConfig, tc, mesh, rules):
    from dsv41_jax.train.optimizer import build_optimizer

    lc = LoraConfig.from_train_config(tc)
    adapters = abstract_adapters(config, lc)
    # adapters are all trainable: the optimiser over them ignores the full-model selection fields
    opt = build_optimizer(tc.replace(trainable=(), frozen=()), adapters)
    return LoraTrainStep(config, tc, opt, mesh=mesh, rules=rules)


class LoraTrainStep(_train_step_base()):
    """The train step of LoRA fine-tuning: ``state["params"]`` holds the float32 adapters, ``state["opt_state"]``
    their optimiser state; the frozen base (``set_base``) is an argument of the jitted step, never donated or
    updated. ``step(state, batch, lr)`` as for full fine-tuning."""

    is_lora = True

    def __post_init__(self):
        super().__post_init__()
        self.lora = LoraConfig.from_train_config(self.train_config)
        self.targets = lora_targets(self.config, self.lora)
        self.base = None
        self._base_shardings = None

    # -- the frozen base ------------------------------------------------------------------------------------------
    def set_base(self, params) -> None:
        """Freeze ``params`` (any float dtype or QuantizedTensor leaves) as the base: cast to the compute dtype and,
        on a mesh, placed by the parameter rules (QuantizedTensor leaves by ``release_shardings``)."""
        from dsv41_jax.model.params import validate_params

        validate_params(params, self.config)
        base = frozen_base(params, self.config, self._dtype)
        if self.mesh is not None:
            from dsv41_jax.parallel.api import pad_params

            base = pad_params(base, self.config, self.mesh, self.rules)
            base = jax.device_put(base, self.base_shardings(base))
        else:  # committed to the device, like a restored checkpoint: one compiled program for both
            base = jax.device_put(base, jax.devices()[0])
        self.base = base

    def random_base(self):
        """The random base of a LoRA run without ``--init-from``: rebuilt from the seed on resume."""
        return init_params(self.config, jax.random.split(jax.random.PRNGKey(self.train_config.seed), 3)[0])

    def base_shardings(self, base):
        if self.mesh is None:
            return None
        from dsv41_jax.model.release_weights import release_shardings

        return release_shardings(base, self.config, self.mesh, self.rules)

    # -- state ----------------------------------------------------------------------------------------------------
    def init_state(self, params=None, key=None, *, seed=None):
        """Fresh adapters and their optimiser state over the base ``params`` (random base when None: seeded, so a
        resumed run rebuilds the same one)."""
        seed = self.train_config.seed if seed is None else seed
        key = jax.random.PRNGKey(seed) if key is None else key
        pkey, akey, rkey = jax.random.split(key, 3)  # pkey: the random base (``random_base`` for the seed)
        if params is not None or self.base is None:
            self.set_base(params if params is not None else init_params(self.config, pkey))
        adapters = init_adapters(self.config, self.lora, akey)
        state = {"step": jnp.zeros((), jnp.int32), "params": adapters, "opt_state": None,
                 "rng": jax.random.key_data(rkey) if jnp.issubdtype(rkey.dtype, jax.dtypes.prng_key) else rkey}
        state["opt_state"] = jax.jit(self.optimizer.init)(adapters)
        # committed like a restored state (orbax places on a device), so a resumed run reuses the compiled step
        return jax.device_put(state, self.state_shardings() if self.mesh is not None else jax.devices()[0])

    def abstract_state(self):
        adapters = abstract_adapters(self.config, self.lora)
        return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": adapters,
                "opt_state": jax.eval_shape(self.optimizer.init, adapters),
                "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}

    def state_shardings(self):
        """Adapters, their optimiser state and the counters replicated (they are small: rank x (in + out) per
        target); the base keeps the parameters' shardings."""
        if self.mesh is None:
            return None
        if self._shardings is None:
            from jax.sharding import NamedSharding, PartitionSpec as P

            rep = NamedSharding(self.mesh, P())
            self._shardings = jax.tree.map(lambda _: rep, self.abstract_state())
        return self._shardings

    # -- the step -------------------------------------------------------------------------------------------------
    def adapted_params(self, adapters, base, dropout_key=None):
        """The compute parameters: the base (unpadded on a mesh) with the adapters, cast to the compute dtype."""
        if self.mesh is not None:
            from dsv41_jax.parallel.api import unpad_params

            base = unpad_params(base, self.config)
        adapters = jax.tree.map(lambda x: x.astype(self._dtype), adapters)
        return attach(base, adapters, self.lora, dropout_key=dropout_key)

    def lora_loss(self, adapters, base, batch, dropout_key=None):
        return self.model_loss(self.adapted_params(adapters, base, dropout_key), batch)

    def step_fn(self, state: dict, base, batch: dict, lr):
        rng, drop_key = jax.random.split(state["rng"])
        drop_key = drop_key if self.lora.dropout > 0 else None
        (_, (metrics, loads)), grads = jax.value_and_grad(self.lora_loss, has_aux=True)(
            state["params"], base, batch, drop_key)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        lr = jnp.asarray(lr, jnp.float32)
        updates = jax.tree.map(lambda u: (lr * u).astype(u.dtype), updates)
        params = optax.apply_updates(state["params"], updates)
        from dsv41_jax.train.loss import load_balance_stats
        from dsv41_jax.train.optimizer import global_norm

        metrics = dict(metrics)
        metrics["grad_norm"] = global_norm(grads)
        metrics["lr"] = lr
        metrics.update(load_balance_stats(loads))
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "rng": rng}, metrics

    def jitted(self, batch: dict):
        if self._jitted is None:
            sh = None if self.mesh is None else self.state_shardings()
            self._jitted = jit_step(self.step_fn, self.mesh, self.rules, None if sh is None else
                                    (sh, self.base_shardings(self.base), self.batch_shardings(batch), None), sh)
        return self._jitted

    def _need_base(self):
        if self.base is None:
            raise LoraError("the LoRA train step has no base model: call set_base(params) or init_state(params)")
        return self.base

    def __call__(self, state: dict, batch: dict, lr: float):
        return self.jitted(batch)(state, self._need_base(), batch, np.float32(lr))

    def lower(self, state, batch, lr=0.0, base=None):
        """AOT lowering; ``base`` may be ShapeDtypeStructs (compile-only plans)."""
        return self.jitted(batch).lower(state, self._need_base() if base is None else base, batch, np.float32(lr))

    def merged_params(self, adapters, dtype=jnp.float32):
        """The base with ``adapters`` folded in: a plain parameter tree (host-side export)."""
        base = self._need_base()
        if self.mesh is not None:
            from dsv41_jax.parallel.api import unpad_params

            base = unpad_params(base, self.config)
        return merge(base, adapters, self.lora, dtype)


__all__ = ["DEFAULT_TARGETS", "LORA_CAPABLE", "LoraConfig", "LoraError", "LoraTrainStep", "lora_targets",
           "init_adapters", "abstract_adapters", "attach", "merge", "check_adapters", "frozen_base",
           "make_lora_train_step", "base_reference", "check_resume_base", "load_merged_checkpoint"]
