"""DSpark's training objective and train step (the drafter against a frozen target; DSpark paper §3.3, SPEC §9).

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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsv41_jax.config import ModelConfig
from dsv41_jax.model import dspark as D
from dsv41_jax.model.forward import ForwardOptions, forward
from dsv41_jax.model.params import FP32, abstract_params, flat_specs, init_from_specs, param_specs
from dsv41_jax.train.config import TrainConfig
from dsv41_jax.train.optimizer import build_optimizer, global_norm


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
    [..., S, V] or None. Returns (loss, metrics dict): the three terms, ``accept_rate`` (the weighted mean of
    1 - TV / 2) and ``accept_{k}`` per slot k (its unweighted mean over the valid slots k: teacher-forced, the
    expected acceptance of slot k's sampled draft given that the drafts before it were the labels — where the
    drafter loses its acceptance along the block)."""
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
    ok = valid.astype(jnp.float32).reshape(-1, s)
    per_slot = jnp.sum(accept.reshape(-1, s) * ok, axis=0) / jnp.maximum(jnp.sum(ok, axis=0), 1.0)
    return loss, {"ce": ce, "tv": mean(tv), "conf_bce": mean(bce), "accept_rate": mean(accept),
                  **{f"accept_{k}": per_slot[k] for k in range(s)}}



# ----------------------------------------------------------------------------------------------------------------
# The drafter's train step (``dsv41 train --dspark``): the same interface as ``train.step.TrainStep``, so the
# normal training loop, its checkpoints and resuming drive it
# ----------------------------------------------------------------------------------------------------------------

LABELS = ("target", "data")
DRAFTER_INITS = ("random", "target")


@dataclasses.dataclass(frozen=True)
class DSparkTrainOptions:
    """What the drafter is trained on. ``labels``: ``"target"`` — slot k learns the frozen target's greedy token
    (what greedy speculative decoding accepts), ``"data"`` — the text's own next tokens; the TV term always
    compares with the target's full distribution. ``anchors``: block starts sampled per row and step.
    ``drafter_init``: a fresh drafter's starting values — ``"random"`` (the parameter specs' initialisers) or
    ``"target"`` (:func:`drafter_from_target`: the target's last layers' weights)."""

    anchors: int = 64
    labels: str = "target"
    drafter_init: str = "random"
    decay: float = 4.0
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0

    def __post_init__(self):
        if self.anchors < 1:
            raise ValueError(f"DSpark anchors per row must be >= 1, got {self.anchors}")
        if self.labels not in LABELS:
            raise ValueError(f"DSpark labels must be one of {LABELS}, got {self.labels!r}")
        if self.drafter_init not in DRAFTER_INITS:
            raise ValueError(f"DSpark drafter init must be one of {DRAFTER_INITS}, got {self.drafter_init!r}")
        if self.decay <= 0:
            raise ValueError(f"DSpark loss decay must be > 0, got {self.decay}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class DSparkTrainError(ValueError):
    pass


# ----------------------------------------------------------------------------------------------------------------
# The drafter started from the target (``drafter_init="target"``)
# ----------------------------------------------------------------------------------------------------------------

# a draft block's tensors that a target layer holds under the same path with the same shape (a target layer may
# hold more: the compressor / indexer of its compressed attention, an Engram — the SWA-only draft block has none)
_ATTN_COPIED = ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b", "attn_sink")
_BLOCK_COPIED = (("attn_norm",), ("ffn_norm",), *(("hc_attn", k) for k in ("fn", "base", "scale")),
                 *(("hc_ffn", k) for k in ("fn", "base", "scale")), *(("attn", k) for k in _ATTN_COPIED),
                 *(("ffn", "shared_experts", k) for k in ("w1", "w2", "w3")))
_EXPERTS_COPIED = (("ffn", "experts", "w1"), ("ffn", "experts", "w2"), ("ffn", "experts", "w3"),
                   ("ffn", "gate", "weight"), ("ffn", "gate", "bias"))  # the first n_d rows of the target's


def _at(tree, path: tuple, where: str):
    for k in path:
        if not isinstance(tree, dict) or k not in tree:
            raise DSparkTrainError(f"--drafter-init target: the target's {where} has no {'/'.join(path)}")
        tree = tree[k]
    if not hasattr(tree, "shape"):
        raise DSparkTrainError(f"--drafter-init target: the target's {where}/{'/'.join(path)} is a "
                               f"{type(tree).__name__}, not a plain array (pass the training parameters, not the "
                               "quantised inference form)")
    return tree


def target_init_sources(config: ModelConfig, target_params: dict) -> list[tuple[str, str, tuple]]:
    """What :func:`drafter_from_target` copies, checked against the drafter's specs without touching values:
    [(drafter path, target path, slice)] with clear errors where the target cannot supply a tensor. Draft block i
    of n copies target layer L - n + i (the last layers, in order); its routed experts and router rows are the
    target's first ``dspark_n_routed_experts``."""
    c = config
    specs = param_specs(c, include_dspark=True)["dspark"]
    layers = target_params.get("layers") if isinstance(target_params, dict) else None
    if not isinstance(layers, (list, tuple)) or not layers:
        raise DSparkTrainError("--drafter-init target: the target parameters have no `layers`")
    n, nl = c.num_nextn_predict_layers, len(layers)
    if n > nl:
        raise DSparkTrainError(f"--drafter-init target: {n} draft blocks but the target has only {nl} layers")
    if c.dspark_n_routed_experts > c.n_routed_experts:
        raise DSparkTrainError(f"--drafter-init target: the drafter has {c.dspark_n_routed_experts} routed experts, "
                               f"the target only {c.n_routed_experts} to copy them from")
    out = []
    for i in range(n):
        li = nl - n + i
        for path, rows in [(p, None) for p in _BLOCK_COPIED] + [(p, c.dspark_n_routed_experts)
                                                                  for p in _EXPERTS_COPIED]:
            src = _at(layers[li], path, f"layer {li}")
            want = _at(specs["blocks"][i], path, "drafter").shape
            got = tuple(src.shape) if rows is None else (min(rows, src.shape[0]), *src.shape[1:])
            if got != tuple(want):
                raise DSparkTrainError(f"--drafter-init target: drafter block {i}'s {'/'.join(path)} has shape "
                                       f"{tuple(want)}, the target's layer {li} gives {got} (target parameters of "
                                       "another config?)")
            out.append((f"blocks/{i}/" + "/".join(path), f"layers/{li}/" + "/".join(path), rows))
    norm = _at(target_params, ("norm",), "model")
    if tuple(norm.shape) != tuple(specs["norm"].shape):
        raise DSparkTrainError(f"--drafter-init target: the target's norm has shape {tuple(norm.shape)}, the "
                               f"drafter's {tuple(specs['norm'].shape)}")
    return out + [("norm", "norm", None), ("main_norm", f"layers/{nl - n}/attn_norm", None)]


def drafter_from_target(config: ModelConfig, target_params: dict, key: jax.Array, dtype=jnp.float32) -> dict:
    """A fresh drafter that starts as near as the shapes allow to "the target's last layer over the captured
    features" (``--drafter-init target``; clear errors where it cannot, see :func:`target_init_sources`):

    * every draft block's norms, mHC coefficients (``hc_attn`` / ``hc_ffn``), attention (SWA part: wq / wkv / wo /
      norms / sink) and shared expert are the target's layer L - n + i's; its ``dspark_n_routed_experts`` routed
      experts and router rows (weight, bias) are that layer's first ones (the drafter picks top
      ``dspark_num_experts_per_tok`` among them);
    * ``main_proj`` (d x n_targets d) is the identity on the last captured layer's features and zero on the others,
      ``main_norm`` the first copied layer's ``attn_norm``: the context latents start as ``wkv`` / ``kv_norm`` of
      that layer applied to RMSNorm(mean over streams of its input) x attn_norm — the layer's own K=V latents up to
      the mean in place of its learned stream mix (exactly the copied layer's input where the last captured layer
      is the target's last, as in the benchmarks' 4-layer target with captures 1-3);
    * the final ``norm`` is the target's;
    * not copied (no counterpart in the target): the compressor / indexer / Engram of the target's layer (the
      draft block is SWA-only), the Markov heads and the confidence head — these keep the random initialisers.

    What still differs from the target's last layer: the block's queries and its residual start from the embeddings
    of ``[x_p, noise ...]``, not from the target's residual at p; the RoPE is the main one."""
    specs = param_specs(config, include_dspark=True)["dspark"]
    dp = init_from_specs(specs, key, dtype)
    flat = {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): x
            for p, x in jax.tree_util.tree_flatten_with_path(dp)[0]}
    d, nt = config.hidden_size, len(config.dspark_target_layer_ids)

    def get(tree, path):
        for k in path.split("/"):
            tree = tree[int(k)] if isinstance(tree, (list, tuple)) else tree[k]
        return tree

    for dst, src, rows in target_init_sources(config, target_params):
        x = jnp.asarray(get(target_params, src))
        flat[dst] = (x if rows is None else x[:rows]).astype(flat[dst].dtype)
    flat["main_proj"] = jnp.zeros((d, nt * d), flat["main_proj"].dtype).at[:, (nt - 1) * d:].set(
        jnp.eye(d, dtype=flat["main_proj"].dtype))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(dp)
    return jax.tree.unflatten(treedef, [flat["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p)]
                                        for p, _ in leaves])


def check_trainable(config: ModelConfig, tc: TrainConfig) -> None:
    """Clear errors for settings the drafter's training does not support."""
    D.check_dspark({"dspark": {"blocks": [None] * config.num_nextn_predict_layers}}, config)
    if tc.packing == "segments":
        raise DSparkTrainError("--dspark trains on rows packed 'concat' or 'pad' (the drafter's context window does "
                               "not restart at segment boundaries)")
    if tc.indexer_loss != "off" or tc.aux_loss_coef > 0:
        raise DSparkTrainError("--dspark trains the drafter only: the indexer / balance losses of the target do not "
                               "apply (leave --indexer-loss off and --aux-loss 0)")
    if tc.trainable or tc.frozen:
        raise DSparkTrainError("--dspark trains every drafter parameter; --train-only / --freeze are not supported")


class DSparkTrainStep:
    """``(state, batch, lr) -> (state, metrics)`` for the DSpark drafter against a frozen target.

    State as ``TrainStep``'s, with ``params = {"dspark": float32 drafter masters}``; the target's parameters are
    held by the step (an input like the data, never updated or checkpointed). Per step: the target's forward over
    the rows gives its logits and the DSpark features (mean over the mHC streams of the residual entering each
    target layer); ``anchors`` block starts are drawn per row; ``model.dspark.train_forward`` runs the drafter at
    every anchor exactly as a drafting step with that token pending; :func:`dspark_loss` is minimised. Metrics:
    ``ce`` (of the drafter's labels), ``tv``, ``conf_bce``, ``accept_rate`` (mean 1 - TV / 2, the expected
    acceptance of a sampled draft) and ``top1`` (the drafter's argmax equals the label: greedy acceptance per
    slot, teacher-forced); ``accept_{k}`` / ``top1_{k}``: the same per draft slot k."""

    mesh = None
    rules = "tp"
    objective = "dspark"

    def __init__(self, config: ModelConfig, tc: TrainConfig, target_params: dict,
                 options: DSparkTrainOptions = DSparkTrainOptions()):
        check_trainable(config, tc)
        self.config, self.train_config, self.options = config, tc, options
        self._dtype = jnp.bfloat16 if tc.compute_dtype == "bfloat16" else jnp.float32
        self._quant = config.quant_sim if tc.quant_sim is None else tc.quant_sim
        self._fwd = ForwardOptions(quant_sim=self._quant, moe_impl=tc.moe_impl, query_chunk=tc.query_chunk)
        self._specs = param_specs(config, include_dspark=True)["dspark"]
        self._fp32 = jax.tree.map(lambda s: s.dtype == FP32, self._specs, is_leaf=lambda x: hasattr(x, "axes"))
        abstract = {"dspark": abstract_params(config, jnp.float32, include_dspark=True)["dspark"]}
        self.optimizer = build_optimizer(tc, abstract)
        cast = lambda x, keep: x if keep else jnp.asarray(x, self._dtype)  # noqa: E731
        fp32 = {p: s.dtype == FP32 for p, s in flat_specs(config)}
        flat, treedef = jax.tree_util.tree_flatten_with_path(
            {k: v for k, v in target_params.items() if k != "dspark"})
        paths = ["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p) for p, _ in flat]
        self.target = jax.tree.unflatten(treedef, [cast(x, fp32.get(p, False)) for p, (_, x) in zip(paths, flat)])
        self._target_as_given = {k: v for k, v in target_params.items() if k != "dspark"}  # exported unchanged
        if options.drafter_init == "target":
            target_init_sources(config, self._target_as_given)  # a clear error now, not at the first init_state
        self._jitted = None

    # -- state ------------------------------------------------------------------------------------------------
    def init_state(self, params: dict | None = None, key: jax.Array | None = None, *, seed: int | None = None):
        seed = self.train_config.seed if seed is None else seed
        key = jax.random.PRNGKey(seed) if key is None else key
        pkey, rkey = jax.random.split(key)
        if params is not None:
            dp = params["dspark"]
        elif self.options.drafter_init == "target":
            dp = drafter_from_target(self.config, self._target_as_given, pkey)
        else:
            dp = init_from_specs(self._specs, pkey)
        params = {"dspark": jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), dp)}
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": jax.jit(self.optimizer.init)(params),
                 "rng": jax.random.key_data(rkey) if jnp.issubdtype(rkey.dtype, jax.dtypes.prng_key) else rkey}
        # committed to the default device like every later step's output state (TrainStep.init_state): a fresh,
        # uncommitted state would compile the step a second time at step 2
        device = jax.config.jax_default_device
        device = device if isinstance(device, jax.Device) else jax.devices()[0]
        return jax.device_put(state, jax.sharding.SingleDeviceSharding(device))

    def abstract_state(self):
        params = {"dspark": abstract_params(self.config, jnp.float32, include_dspark=True)["dspark"]}
        return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
                "opt_state": jax.eval_shape(self.optimizer.init, params),
                "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}

    def state_shardings(self):
        return None

    def export_params(self, params: dict) -> dict:
        """The inference parameters: the target's exactly as given (not the compute-dtype copy) with the trained
        drafter."""
        return {**jax.device_get(self._target_as_given), "dspark": jax.device_get(params["dspark"])}

    # -- the step ---------------------------------------------------------------------------------------------
    def loss_fn(self, master: dict, target: dict, batch: dict, key: jax.Array):
        c, o = self.config, self.options
        tokens, valid = batch["tokens"], batch["valid"]
        b, t = tokens.shape
        logits, aux = forward(target, tokens, config=c, engram_ids=batch.get("engram_ids"), options=self._fwd,
                              return_dspark_features=True)
        logits = jax.lax.stop_gradient(logits)
        feats = jax.lax.stop_gradient(aux["dspark_features"])
        dp = jax.tree.map(lambda x, keep: x if keep else x.astype(self._dtype), master["dspark"], self._fp32)
        params = {"embed": target["embed"], "lm_head": target["lm_head"], "dspark": dp}
        anchors = jax.random.randint(key, (b, o.anchors), 0, max(t - 1, 1), jnp.int32)
        label_tokens = None
        if o.labels == "target":  # position i's label: the target's greedy token after positions < i
            greedy = jnp.argmax(logits, axis=-1).astype(tokens.dtype)
            label_tokens = jnp.concatenate([tokens[:, :1], greedy[:, :-1]], axis=1)
        lg, cf, labels, ok = D.train_forward(params, feats, tokens, anchors, config=c, quant_on=self._quant,
                                             moe_impl="dense", label_tokens=label_tokens)
        s = c.dspark_block_size
        label_pos = jnp.clip(anchors[..., None] + 1 + jnp.arange(s), 0, t - 1)
        real = jnp.take_along_axis(valid, label_pos.reshape(b, -1), axis=1).reshape(b, -1, s)
        real = real & jnp.take_along_axis(valid, anchors, axis=1)[..., None]
        ok = ok & real
        tgt = anchor_targets(logits, anchors, s)
        loss, m = dspark_loss(lg, cf, labels, ok, tgt, decay=o.decay, ce_weight=o.ce_weight, tv_weight=o.tv_weight,
                              conf_weight=o.conf_weight)
        hit = (jnp.argmax(lg, axis=-1) == labels) & ok
        # per slot k, teacher-forced: the greedy draft at slot k equals the label (given the labels before it)
        hit_k = jnp.sum(hit.reshape(-1, s), axis=0) / jnp.maximum(jnp.sum(ok.reshape(-1, s), axis=0), 1)
        m = dict(m, loss=loss, tokens=jnp.sum(ok.astype(jnp.float32)),
                 top1=jnp.sum(hit) / jnp.maximum(jnp.sum(ok), 1), **{f"top1_{k}": hit_k[k] for k in range(s)})
        return loss, m

    def step_fn(self, state: dict, target: dict, batch: dict, lr):
        rng, key = jax.random.split(state["rng"])
        (_, metrics), grads = jax.value_and_grad(self.loss_fn, has_aux=True)(state["params"], target, batch, key)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        lr = jnp.asarray(lr, jnp.float32)
        updates = jax.tree.map(lambda u: (lr * u).astype(u.dtype), updates)
        params = optax.apply_updates(state["params"], updates)
        metrics = dict(metrics, grad_norm=global_norm(grads), lr=lr)
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "rng": rng}, metrics

    def __call__(self, state: dict, batch: dict, lr: float):
        if self._jitted is None:
            donate = (0,) if jax.default_backend() != "cpu" else ()
            self._jitted = jax.jit(self.step_fn, donate_argnums=donate)
        return self._jitted(state, self.target, batch, np.float32(lr))


__all__ = ["anchor_targets", "dspark_loss", "DSparkTrainOptions", "DSparkTrainStep", "DSparkTrainError",
           "DRAFTER_INITS", "target_init_sources", "drafter_from_target",
           "check_trainable"]
