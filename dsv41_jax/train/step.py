"""The train step: a pure function ``(state, batch, lr) -> (state, metrics)``, jitted (and sharded over a mesh).

State (a plain pytree, what checkpoints hold)::

    {"step": int32 [], "params": float32 master weights, "opt_state": optax state (float32), "rng": uint32 [2]}

(with ``TrainConfig.compute_copy`` also ``"compute"``: the masters cast to the compute dtype, written by each update
and read by the next step's forward; checkpoints do not hold it, :func:`place_state` rebuilds it.)

Per step: cast the master weights to the compute dtype (bf16 by default; the parameters the model keeps in float32 —
mHC, sinks, router biases — stay float32), run the forward (segment ids passed through for packed documents,
optionally under a ``jax.checkpoint`` rematerialisation policy, around the whole forward or each decoder layer), masked next-token cross-entropy (+ optional
sequence-wise balance loss, + optional indexer KL), gradients into the float32 masters, the optax update scaled by
the scheduled learning rate, then DeepSeekMoE's noaux bias update from this step's expert loads.

Batch (host numpy, built by :mod:`dsv41_jax.train.data`)::

    tokens [B, T] int32, targets [B, T] int32, loss_mask [B, T] float32, valid [B, T] bool (real input tokens),
    engram_ids [B, T, n_engram_layers, cols] int32 (configs with Engram), segment_ids [B, T] int32 (packed rows)
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

_global_norm = optax.tree.norm if hasattr(optax, "tree") and hasattr(optax.tree, "norm") else optax.global_norm

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.forward import ForwardOptions, forward, remat_policy
from dsv41_jax.model.params import FP32, flat_specs, init_params
from dsv41_jax.ops.rope import rope_tables
from dsv41_jax.train.config import TrainConfig
from dsv41_jax.train.loss import (balance_loss, cross_entropy, expert_load, indexer_kl_loss, load_balance_stats,
                                  noaux_bias_update)
from dsv41_jax.train.optimizer import build_optimizer, check_selection, map_with_path

class TrainError(ValueError):
    pass


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Document-relative positions of packed rows (each run of equal ids restarts at 0)."""
    b, t = segment_ids.shape
    idx = jnp.arange(t, dtype=jnp.int32)[None, :]
    starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def fp32_only_mask(config: ModelConfig):
    """True for parameters the model keeps in float32 whatever the compute dtype (mHC, sinks, router bias)."""
    specs = dict(flat_specs(config))
    tree = init_params_shapes(config)
    return map_with_path(lambda p, _: specs[p].dtype == FP32, tree)


@functools.lru_cache(maxsize=8)
def init_params_shapes(config: ModelConfig):
    return jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))


def _bias_selected(path: str, tc: TrainConfig) -> bool:
    if tc.trainable and not any(re.search(p, path) for p in tc.trainable):
        return False
    return not any(re.search(p, path) for p in tc.frozen)


def _key_name(k) -> str:
    return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def map_param_leaves(tree, param_paths, fn, other=lambda x: x):
    """Map over an optimiser-state-like tree: ``fn(leaf, param_path)`` on leaves that mirror a parameter (their key
    path ends with a parameter path, e.g. Adam's ``mu`` / ``nu``), ``other(leaf)`` elsewhere (counters)."""
    known = set(param_paths)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for path, leaf in leaves:
        names = [_key_name(k) for k in path]
        match = None
        for i in range(len(names)):
            cand = "/".join(names[i:])
            if cand in known:
                match = cand
                break
        out.append(fn(leaf, match) if match is not None else other(leaf))
    return jax.tree.unflatten(treedef, out)


def _param_table(tree) -> dict:
    return {"/".join(_key_name(k) for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@dataclasses.dataclass
class TrainStep:
    """A compiled train step for one (model config, train config[, mesh]); call ``step(state, batch, lr)``."""

    config: ModelConfig
    train_config: TrainConfig
    optimizer: optax.GradientTransformation
    mesh: object = None
    rules: str = "tp"

    def __post_init__(self):
        c, tc = self.config, self.train_config
        if tc.seq_len > c.max_position_embeddings:
            raise TrainError(f"seq_len {tc.seq_len} exceeds the model's max_position_embeddings "
                             f"{c.max_position_embeddings}")
        if tc.indexer_loss != "off" and not any(s.runs_indexer for s in c.plan):
            raise TrainError("indexer_loss is on but this config has no indexer layer")
        check_selection(c, tc)
        self._fp32 = fp32_only_mask(c)
        self._dtype = jnp.bfloat16 if tc.compute_dtype == "bfloat16" else jnp.float32
        self._quant = c.quant_sim if tc.quant_sim is None else tc.quant_sim
        per_layer = tc.remat_scope == "layer" and tc.remat != "none"
        self._options = ForwardOptions(quant_sim=self._quant, moe_impl=tc.moe_impl, query_chunk=tc.query_chunk,
                                       remat_layers=tc.remat if per_layer else "none",
                                       kernel_backend=tc.kernel_backend,
                                       gather_params=tc.zero == 3 and self.mesh is not None and not tc.lora)
        self._rope = {k: np.asarray(v) for k, v in rope_tables(c).items()}
        paths = [p for p, _ in flat_specs(c)]
        self._bias_layers = [i for i in range(c.num_hidden_layers)
                             if f"layers/{i}/ffn/gate/bias" in paths and _bias_selected(f"layers/{i}/ffn/gate/bias", tc)]
        self._jitted = None
        self._shardings = None

    # ------------------------------------------------------------------------------------------------------------
    def init_state(self, params: dict | None = None, key: jax.Array | None = None, *, seed: int | None = None):
        """A fresh state from ``params`` (or random init with ``key``/``seed``): float32 masters, optimiser state."""
        seed = self.train_config.seed if seed is None else seed
        key = jax.random.PRNGKey(seed) if key is None else key
        pkey, rkey = jax.random.split(key)
        if params is None:
            params = init_params(self.config, pkey)
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": None,
                 "rng": jax.random.key_data(rkey) if jnp.issubdtype(rkey.dtype, jax.dtypes.prng_key) else rkey}
        if self.mesh is not None:
            from dsv41_jax.parallel.api import shard_params

            state["params"] = shard_params(params, self.config, self.mesh, self.rules)
            sh = self.state_shardings()
            if self.train_config.zero == 3:  # the masters split over the batch axes too
                state["params"] = jax.device_put(state["params"], sh["params"])
            state["opt_state"] = jax.jit(self.optimizer.init, out_shardings=sh["opt_state"])(state["params"])
            state["step"] = jax.device_put(state["step"], sh["step"])
            state["rng"] = jax.device_put(state["rng"], sh["rng"])
        else:
            state["opt_state"] = jax.jit(self.optimizer.init)(params)
            # committed to the default device, as every later step's output state is once any input was committed
            # (loaded parameters are): a state of mixed placement would compile the step a second time at step 2
            device = jax.config.jax_default_device
            device = device if isinstance(device, jax.Device) else jax.devices()[0]
            state = jax.device_put(state, jax.sharding.SingleDeviceSharding(device))
        return self.attach_compute_copy(state)

    def compute_params(self, master: dict) -> dict:
        """The masters in the compute dtype (the float32-only parameters stay float32)."""
        return jax.tree.map(lambda x, keep: x if keep else x.astype(self._dtype), master, self._fp32)

    def attach_compute_copy(self, state: dict) -> dict:
        """``state`` with its ``"compute"`` copy (``TrainConfig.compute_copy``; a no-op otherwise or if present)."""
        if not self.train_config.compute_copy or "compute" in state:
            return state
        sh = self.state_shardings()
        cast = jax.jit(self.compute_params, out_shardings=None if sh is None else sh["compute"])
        return {**state, "compute": cast(state["params"])}

    def abstract_state(self):
        """ShapeDtypeStructs of the (unsharded, unpadded) state: the restore target of a checkpoint."""
        params = init_params_shapes(self.config)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params)
        return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
                "opt_state": jax.eval_shape(self.optimizer.init, params),
                "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}

    def state_shardings(self):
        """NamedShardings of the state on the mesh (parameters by the logical-axis rules; optimiser moments like
        their parameters, or ZeRO-split over the batch axes: ``TrainConfig.zero`` 1 the moments, 3 the masters too;
        counters replicated). None without a mesh."""
        if self.mesh is None:
            return None
        if self._shardings is None:
            from jax.sharding import NamedSharding, PartitionSpec as P

            from dsv41_jax.parallel.api import abstract_sharded_params, param_shardings, zero_param_shardings

            zero = self.train_config.zero
            p_sh = param_shardings(self.config, self.mesh, self.rules)
            z_sh = zero_param_shardings(self.config, self.mesh, self.rules) if zero else p_sh
            if zero == 3:
                p_sh = z_sh
            abstract_p = abstract_sharded_params(self.config, self.mesh, self.rules, jnp.float32)
            abstract_o = jax.eval_shape(self.optimizer.init, abstract_p)
            abstract_p_table = _param_table(abstract_p)
            rep = NamedSharding(self.mesh, P())
            table = _param_table(z_sh)
            o_sh = map_param_leaves(abstract_o, table, lambda a, p: table[p] if a.shape == abstract_p_table[p].shape
                                    else rep, lambda _: rep)
            self._shardings = {"step": rep, "params": p_sh, "opt_state": o_sh, "rng": rep}
            if self.train_config.compute_copy:
                self._shardings["compute"] = p_sh
        return self._shardings

    # ------------------------------------------------------------------------------------------------------------
    def _forward(self, params, batch):
        c = self.config
        kwargs = dict(config=c, engram_ids=batch.get("engram_ids"), options=self._options, return_router=True)
        seg = batch.get("segment_ids")
        if seg is not None:
            kwargs["segment_ids"] = seg
            kwargs["positions"] = segment_positions(seg)
        if self.train_config.indexer_loss != "off":
            kwargs["return_attn_inputs"] = True
            kwargs["return_topk"] = self.train_config.indexer_loss == "sparse"
        fn = lambda p, t: forward(p, t, **kwargs)  # noqa: E731
        if self.train_config.remat != "none" and self.train_config.remat_scope == "forward":
            fn = jax.checkpoint(fn, policy=remat_policy(self.train_config.remat))
        return fn(params, batch["tokens"])

    def loss_fn(self, master: dict, batch: dict):
        return self.compute_loss_fn(self.compute_params(master), batch)

    def compute_loss_fn(self, params: dict, batch: dict):
        """``loss_fn`` of the compute-dtype copy (``compute_params(master)``, padded like the masters)."""
        if self.mesh is not None:
            from dsv41_jax.parallel.api import unpad_params

            params = unpad_params(params, self.config)
        return self.model_loss(params, batch)

    def model_loss(self, params: dict, batch: dict):
        """(loss, (metrics, expert loads)) of the compute-dtype ``params`` (any weight forms) on ``batch``."""
        c, tc = self.config, self.train_config
        logits, aux = self._forward(params, batch)
        ce_sum, n_tok = cross_entropy(logits, batch["targets"], batch["loss_mask"])
        ce = ce_sum / jnp.maximum(n_tok, 1.0)
        loss = ce
        valid = batch["valid"]
        loads = jnp.stack([expert_load(r["indices"], valid.reshape(-1), c.n_routed_experts) for r in aux["router"]])
        metrics = {"ce": ce, "tokens": n_tok}
        if tc.aux_loss_coef > 0:
            bal = jnp.mean(jnp.stack([balance_loss(r["scores"], r["indices"], valid, c.num_experts_per_tok)
                                      for r in aux["router"]]))
            loss = loss + tc.aux_loss_coef * bal
            metrics["aux_loss"] = bal
        if tc.indexer_loss != "off":
            seg = batch.get("segment_ids")
            positions = (segment_positions(seg) if seg is not None
                         else jnp.broadcast_to(jnp.arange(logits.shape[1], dtype=jnp.int32), logits.shape[:2]))
            kl, _ = indexer_kl_loss(params, aux["attn_inputs"], aux.get("topk"), c, positions,
                                    {k: jnp.asarray(v) for k, v in self._rope.items()}, mode=tc.indexer_loss,
                                    quant_on=self._quant, weight=valid.astype(jnp.float32), chunk=tc.query_chunk,
                                    segments=seg)
            loss = loss + tc.indexer_loss_coef * kl
            metrics["indexer_kl"] = kl
        metrics["loss"] = loss
        return loss, (metrics, loads)

    def step_fn(self, state: dict, batch: dict, lr):
        tc = self.train_config
        rng, _ = jax.random.split(state["rng"])
        if tc.compute_copy:
            # the gradient of the copy, upcast: the same values as the masters' gradient (the transpose of the
            # cast), which the update fuses in as it fuses the cast's transpose otherwise
            (_, (metrics, loads)), grads = jax.value_and_grad(self.compute_loss_fn, has_aux=True)(
                state["compute"], batch)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])
        else:
            (_, (metrics, loads)), grads = jax.value_and_grad(self.loss_fn, has_aux=True)(state["params"], batch)
        if tc.zero == 3 and self.mesh is not None:  # each gradient reduce-scattered to its master's split
            grads = jax.lax.with_sharding_constraint(grads, self.state_shardings()["params"])
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        lr = jnp.asarray(lr, jnp.float32)
        updates = jax.tree.map(lambda u: (lr * u).astype(u.dtype), updates)
        params = optax.apply_updates(state["params"], updates)
        if tc.bias_update_rate > 0 and self._bias_layers:
            layers = list(params["layers"])
            for i in self._bias_layers:
                lp = dict(layers[i])
                ffn = dict(lp["ffn"])
                gate = dict(ffn["gate"])
                gate["bias"] = noaux_bias_update(gate["bias"], loads[i], tc.bias_update_rate)
                ffn["gate"] = gate
                lp["ffn"] = ffn
                layers[i] = lp
            params = {**params, "layers": layers}
        metrics = dict(metrics)
        metrics["grad_norm"] = _global_norm(grads)
        metrics["lr"] = lr
        metrics.update(load_balance_stats(loads))
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "rng": rng}
        if tc.compute_copy:
            new_state["compute"] = self.compute_params(params)
        return new_state, metrics

    # ------------------------------------------------------------------------------------------------------------
    def batch_shardings(self, batch: dict):
        from dsv41_jax.parallel.api import batch_sharding

        return {k: batch_sharding(self.mesh, self.rules, v.shape) for k, v in batch.items()}

    def jitted(self, batch: dict):
        """The jitted step (built once; with a mesh, in/out shardings and the rules context)."""
        if self._jitted is None:
            sh = None if self.mesh is None else self.state_shardings()
            self._jitted = jit_step(self.step_fn, self.mesh, self.rules,
                                    None if sh is None else (sh, self.batch_shardings(batch), None), sh)
        return self._jitted

    def __call__(self, state: dict, batch: dict, lr: float):
        return self.jitted(batch)(state, batch, np.float32(lr))

    def lower(self, state, batch, lr=0.0):
        """AOT lowering (cost / memory analysis in benchmarks)."""
        return self.jitted(batch).lower(state, batch, np.float32(lr))


def jit_step(step_fn, mesh, rules: str, in_shardings, state_shardings):
    """``step_fn(state, ..., lr) -> (state, metrics)`` jitted: the state donated (not on CPU, where donation only
    warns); on a mesh with ``in_shardings`` / the state's shardings and traced under the sharding rules' context."""
    donate = (0,) if jax.default_backend() != "cpu" else ()
    if mesh is None:
        return jax.jit(step_fn, donate_argnums=donate)
    from dsv41_jax.parallel.rules import sharding_context

    def traced(*args):
        with sharding_context(mesh, rules):
            return step_fn(*args)

    return jax.jit(traced, in_shardings=in_shardings, out_shardings=(state_shardings, None), donate_argnums=donate)


@functools.lru_cache(maxsize=16)
def _cached_step(config: ModelConfig, tc: TrainConfig) -> TrainStep:
    params = init_params_shapes(config)
    return TrainStep(config, tc, build_optimizer(tc, params))


def make_train_step(config: ModelConfig, tc: TrainConfig, *, mesh=None, rules: str = "tp") -> TrainStep:
    """The train step for ``config`` / ``tc``. Unsharded steps are cached per (config, train config), so two
    trainers with the same configs share one compiled program. ``tc.lora``: a
    :class:`~dsv41_jax.train.lora.LoraTrainStep` (never cached: it holds its frozen base)."""
    if tc.lora:
        from dsv41_jax.train.lora import make_lora_train_step

        return make_lora_train_step(config, tc, mesh=mesh, rules=rules)
    if mesh is None:
        return _cached_step(config, tc)
    params = init_params_shapes(config)
    return TrainStep(config, tc, build_optimizer(tc, params), mesh=mesh, rules=rules)


# -- canonical (mesh-independent) checkpoint layout ------------------------------------------------------------

def canonical_state(step: TrainStep, state: dict) -> dict:
    """The state with Engram tables (and their optimiser moments) cut back to the config's row counts: what a
    checkpoint stores, independent of the mesh that trained it."""
    if step.mesh is None or getattr(step, "is_lora", False):  # LoRA: adapters are replicated, never padded
        return state
    from dsv41_jax.parallel.api import unpad_params

    want = _param_table(init_params_shapes(step.config))
    opt = map_param_leaves(state["opt_state"], want,
                           lambda x, p: x[: want[p].shape[0]] if x.shape != want[p].shape else x)
    return {**state, "params": jax.jit(lambda p: unpad_params(p, step.config))(state["params"]), "opt_state": opt}


def place_state(step: TrainStep, state: dict) -> dict:
    """Inverse of :func:`canonical_state`: pad Engram tables and place every leaf on the step's mesh."""
    if getattr(step, "is_lora", False):
        return state if step.mesh is None else jax.device_put(state, step.state_shardings())
    if step.mesh is None:  # (the DSpark drafter's step has no compute copy)
        return step.attach_compute_copy(state) if isinstance(step, TrainStep) else state
    from dsv41_jax.parallel.api import pad_params

    params = pad_params(state["params"], step.config, step.mesh, step.rules)

    table = _param_table(params)

    def pad_like(x, p):
        target = table[p].shape
        if x.shape == target:
            return x
        return jnp.pad(x, ((0, target[0] - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))

    opt = map_param_leaves(state["opt_state"], table, pad_like)
    out = {"step": state["step"], "params": params, "opt_state": opt, "rng": state["rng"]}
    sh = {k: v for k, v in step.state_shardings().items() if k in out}
    return step.attach_compute_copy(jax.device_put(out, sh))


def canonical_shardings(step: TrainStep, abstract_state: dict):
    """Shardings for restoring a canonical (unpadded) state onto the step's mesh: the training shardings where the
    shapes agree, replication for the (padded-on-this-mesh) Engram tables and their moments. None without a mesh."""
    if step.mesh is None:
        return None
    if getattr(step, "is_lora", False):
        return step.state_shardings()
    from jax.sharding import NamedSharding, PartitionSpec as P

    sh = step.state_shardings()
    rep = NamedSharding(step.mesh, P())
    from dsv41_jax.parallel.api import abstract_sharded_params

    padded = abstract_sharded_params(step.config, step.mesh, step.rules, jnp.float32)
    p_sh = jax.tree.map(lambda a, p, s: s if a.shape == p.shape else rep, abstract_state["params"], padded,
                        sh["params"])
    o_abs_padded = jax.eval_shape(step.optimizer.init, padded)
    o_sh = jax.tree.map(lambda a, p, s: s if a.shape == p.shape else rep, abstract_state["opt_state"],
                        o_abs_padded, sh["opt_state"])
    return {"step": rep, "params": p_sh, "opt_state": o_sh, "rng": rep}
