"""Training checkpoints with orbax, parameter-only exports, and one loader for every checkpoint kind.

Layout of a training checkpoint directory (an ``orbax.checkpoint.CheckpointManager`` root)::

    ckpt_dir/
      <step>/params      float32 master weights (StandardSave; canonical, mesh-independent shapes)
      <step>/opt_state   optax state
      <step>/train       {"step", "rng"}
      <step>/data        JSON: the data position of the next batch and the data fingerprint
      <step>/meta        JSON: model config (``ModelConfig.to_dict``), train config, format version

Saves are asynchronous (orbax writes into a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous step as the latest complete checkpoint and a temporary directory orbax ignores and
removes on the next start); ``keep`` bounds how many steps are kept. Restores take target shardings, so a
checkpoint written on one mesh restores onto any other (or none).

A parameter export (:func:`export_params`) is a directory with ``config.json`` (HF fields plus our full config),
``params/`` (orbax) and ``dsv41_export.json``; :func:`load_checkpoint` reads it, a training checkpoint directory
(latest step) or one step of it, and HF-named safetensors directories.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.checkpoint.hf import CheckpointError, load_hf_checkpoint
from dsv41_jax.config import ModelConfig
from dsv41_jax.model.params import abstract_params, validate_params

FORMAT = "dsv41_jax.train.v1"
EXPORT_MARKER = "dsv41_export.json"
ITEMS = ("params", "opt_state", "train", "data", "meta")


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


def config_dict(config: ModelConfig) -> dict:
    d = config.to_dict()
    if d.get("compress_yarn") is not None:
        d["compress_yarn"] = dict(d["compress_yarn"])
    return d


def config_mismatch(saved: dict, config: ModelConfig) -> list[str]:
    """Fields that differ between a saved config dict and ``config`` (the name is ignored)."""
    now = config_dict(config)
    keys = sorted((set(saved) | set(now)) - {"name"})
    diff = []
    for k in keys:
        a, b = saved.get(k), now.get(k)
        if isinstance(a, list):
            a = [list(x) if isinstance(x, tuple) else x for x in a]
        if isinstance(b, (list, tuple)):
            b = list(b)
        if a != b:
            diff.append(f"{k}: checkpoint {a!r} vs config {b!r}")
    return diff


def _is_step_dir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "params")) and os.path.isdir(os.path.join(path, "meta"))


def is_training_checkpoint(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    return any(_is_step_dir(os.path.join(path, d)) for d in os.listdir(path) if d.isdigit())


def is_export(path: str) -> bool:
    return os.path.isfile(os.path.join(path, EXPORT_MARKER))


class TrainCheckpointer:
    """A ``CheckpointManager`` for train states: async saves, keep-last-N, save every N steps."""

    def __init__(self, directory: str, *, keep: int | None = 3, save_every: int = 1000, async_save: bool = True,
                 create: bool = True):
        ocp = _ocp()
        self.directory = os.path.abspath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint path {self.directory} exists and is not a directory")
        if os.path.isdir(self.directory) and os.listdir(self.directory) and not is_training_checkpoint(self.directory):
            stray = [d for d in os.listdir(self.directory) if not (d.isdigit() or ".orbax-checkpoint-tmp" in d)]
            if stray:
                raise CheckpointError(f"{self.directory} is not empty and holds no dsv41 training checkpoint "
                                      f"(found {sorted(stray)[:5]}); refusing to write there")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=max(1, save_every),
                                               enable_async_checkpointing=async_save, create=create,
                                               cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    # -- queries --------------------------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def meta(self, step: int | None = None) -> dict:
        step = self.latest_step() if step is None else step
        ocp = _ocp()
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def check_compatible(self, config: ModelConfig, step: int | None = None) -> None:
        """Raise a clear error if the checkpoint was written for another model config."""
        meta = self.meta(step)
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{self.directory}: unknown checkpoint format {meta.get('format')!r}")
        diff = config_mismatch(meta["model_config"], config)
        if diff:
            raise CheckpointError(f"checkpoint {self.directory} was written for another model config:\n  "
                                  + "\n  ".join(diff[:12]))

    # -- save / restore --------------------------------------------------------------------------------------------
    def save(self, step: int, state: dict, *, data_position: dict, model_config: ModelConfig, train_config=None,
             extra_meta: dict | None = None, force: bool = False) -> bool:
        ocp = _ocp()
        meta = {"format": FORMAT, "step": int(step), "model_config": config_dict(model_config),
                "train_config": None if train_config is None else train_config.to_dict(), **(extra_meta or {})}
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            opt_state=ocp.args.StandardSave(state["opt_state"]),
            train=ocp.args.StandardSave({"step": state["step"], "rng": state["rng"]}),
            data=ocp.args.JsonSave(dict(data_position)),
            meta=ocp.args.JsonSave(meta),
        )
        return self.manager.save(int(step), args=args, force=force)

    def restore(self, abstract_state: dict, step: int | None = None, *, shardings: dict | None = None):
        """(state, data_position, meta). ``abstract_state`` gives shapes / dtypes (``TrainStep.abstract_state``);
        ``shardings`` (a like-structured tree of ``Sharding`` or None) places the arrays — any mesh."""
        ocp = _ocp()
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")

        def target(tree, sh):
            if sh is None:
                dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
                return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), tree)
            return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, sh)

        sh = shardings or {}
        train_abs = {"step": abstract_state["step"], "rng": abstract_state["rng"]}
        train_sh = None if not sh else {"step": sh["step"], "rng": sh["rng"]}
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(target(abstract_state["params"], sh.get("params"))),
                opt_state=ocp.args.StandardRestore(target(abstract_state["opt_state"], sh.get("opt_state"))),
                train=ocp.args.StandardRestore(target(train_abs, train_sh)),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot restore step {step} from {self.directory}: {e}") from e
        state = {"step": out["train"]["step"], "params": out["params"], "opt_state": out["opt_state"],
                 "rng": out["train"]["rng"]}
        return state, dict(out["data"]), dict(out["meta"])

    def restore_params(self, config: ModelConfig | None = None, step: int | None = None, *, shardings=None,
                       dtype=jnp.float32):
        """(config, params) of one step (latest by default): only the ``params`` item is read."""
        ocp = _ocp()
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        meta = self.meta(step)
        saved = ModelConfig.from_dict(meta["model_config"])
        if config is not None:
            diff = config_mismatch(meta["model_config"], config)
            if diff:
                raise CheckpointError(f"checkpoint {self.directory} was written for another model config:\n  "
                                      + "\n  ".join(diff[:12]))
        else:
            config = saved
        if meta.get("lora"):  # LoRA adapters: fold them into the recorded base
            from dsv41_jax.train.lora import load_merged_checkpoint

            config, params = load_merged_checkpoint(self, step, meta, config, shardings)
            return config, _cast(params, config, dtype)
        params = _restore_params_item(lambda a: self.manager.restore(
            step, args=ocp.args.Composite(params=ocp.args.StandardRestore(a)))["params"], config, shardings)
        return config, _cast(params, config, dtype)

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


def _restore_params_item(restore, config: ModelConfig, shardings):
    abstract = abstract_params(config, jnp.float32)
    if shardings is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), abstract)
    else:
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    try:
        params = restore(target)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint parameters do not match the config: {e}") from e
    validate_params(params, config)
    return params


def _cast(params, config: ModelConfig, dtype):
    if dtype == jnp.float32:
        return params
    from dsv41_jax.model.params import FP32, flat_specs

    specs = [s for _, s in flat_specs(config)]
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, [x if s.dtype == FP32 else x.astype(dtype) for x, s in zip(leaves, specs)])


# ----------------------------------------------------------------------------------------------------------------
# parameter exports
# ----------------------------------------------------------------------------------------------------------------

def write_config_json(directory: str, config: ModelConfig) -> None:
    """HF-style ``config.json`` that also carries our full config (``dsv41_jax`` key, read first by
    ``ModelConfig.from_json_file``: keeps ``quant_sim`` and the name)."""
    d = config.to_hf_dict()
    d["dsv41_jax"] = config_dict(config)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(d, f, indent=1)


def export_params(directory: str, params: dict, config: ModelConfig, *, fmt: str = "orbax",
                  extra: dict | None = None, overwrite: bool = False) -> str:
    """Write inference parameters: ``fmt="orbax"`` (``params/`` orbax tree) or ``"safetensors"`` (HF names,
    ``model.safetensors``; ``dtype`` of the arrays as given). Refuses to overwrite a non-empty directory unless
    ``overwrite``."""
    validate_params(params, config)
    directory = os.path.abspath(directory)
    if os.path.isdir(directory) and os.listdir(directory) and not overwrite:
        raise CheckpointError(f"export directory {directory} is not empty (pass overwrite=True / --overwrite)")
    tmp = directory + ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if fmt == "orbax":
        ocp = _ocp()
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, "params"), jax.tree.map(np.asarray, params))
    elif fmt == "safetensors":
        from safetensors.numpy import save_file

        from dsv41_jax.checkpoint.hf import hf_tensors_from_params

        tensors = {k: np.ascontiguousarray(v) for k, v in hf_tensors_from_params(params, config).items()}
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
    else:
        raise CheckpointError(f"unknown export format {fmt!r} (orbax | safetensors)")
    write_config_json(tmp, config)
    with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
        json.dump({"format": fmt, **(extra or {})}, f, indent=1)
    if os.path.isdir(directory):
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def load_checkpoint(path: str, *, dtype=jnp.float32, config: ModelConfig | None = None, step: int | None = None,
                    shardings=None, include_dspark: bool = False, mesh=None, rules="tp",
                    keep_quantized: bool = False) -> tuple[ModelConfig, dict]:
    """(config, params) from any checkpoint kind: a safetensors directory in the release's naming (FP8 / FP4
    block-scaled, as published) or HF transformers' naming, a parameter export, a training checkpoint directory
    (``step`` or the latest), or one step directory of it.

    Safetensors directories are streamed (:mod:`dsv41_jax.checkpoint.release`): ``mesh`` + ``rules`` place every
    parameter straight onto its partition-rule sharding (each process reads only what its devices own),
    ``keep_quantized`` keeps FP8 / FP4 weights as ``QuantizedTensor`` leaves. ``shardings`` (a tree like the
    parameters) works for every kind."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    if os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path)):
        return load_hf_checkpoint(path, dtype=dtype, config=config, include_dspark=include_dspark, mesh=mesh,
                                  rules=rules, shardings=shardings, keep_quantized=keep_quantized)
    if is_export(path):
        saved = ModelConfig.from_json_file(os.path.join(path, "config.json"))
        if config is not None and config_mismatch(config_dict(saved), config):
            raise CheckpointError(f"{path} was exported for another model config:\n  "
                                  + "\n  ".join(config_mismatch(config_dict(saved), config)[:12]))
        config = config or saved
        ocp = _ocp()

        def restore(target):
            with ocp.StandardCheckpointer() as ckptr:
                return ckptr.restore(os.path.join(os.path.abspath(path), "params"), target)

        return config, _cast(_restore_params_item(restore, config, shardings), config, dtype)
    if is_training_checkpoint(path):
        ckpt = TrainCheckpointer(path, create=False, async_save=False)
        try:
            return ckpt.restore_params(config, step, shardings=shardings, dtype=dtype)
        finally:
            ckpt.close()
    if _is_step_dir(path):
        parent, name = os.path.split(os.path.abspath(path))
        if name.isdigit():
            return load_checkpoint(parent, dtype=dtype, config=config, step=int(name), shardings=shardings)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        raise CheckpointError(f"no *.safetensors files in {path}: it has a config.json but no weights")
    raise CheckpointError(f"{path} is not a checkpoint: expected config.json + *.safetensors, a dsv41 parameter "
                          "export, or a dsv41 training checkpoint directory")


__all__ = ["TrainCheckpointer", "export_params", "load_checkpoint", "is_training_checkpoint", "is_export",
           "config_mismatch", "write_config_json", "CheckpointError"]
