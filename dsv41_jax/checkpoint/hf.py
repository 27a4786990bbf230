"""HF-named tensor dicts <-> our parameter tree: ``params_from_hf_tensors`` (an in-memory dict) and the export
``hf_tensors_from_params`` / ``save_hf_checkpoint``. Loading a checkpoint directory (HF or release naming, float or
FP8 / FP4, streamed onto a mesh) is :mod:`dsv41_jax.checkpoint.release`; ``load_hf_checkpoint`` forwards there.

Every tensor is accounted for: unknown names, missing tensors and wrong shapes are reported by name. A few
tensors the float forward never reads are skipped knowingly (listed in ``IGNORED``).
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.checkpoint.errors import CheckpointError  # re-exported: dsv41_jax.CheckpointError
from dsv41_jax.checkpoint.names import TIED_DSPARK
from dsv41_jax.config import ModelConfig
from dsv41_jax.model.params import ParamSpec, flat_specs, is_spec, param_specs

# Tensors present in released / reference checkpoints that the float forward does not use.
IGNORED = (
    re.compile(r".*\.ffn\.gate\.bias_vl$"),  # vision-span router bias (no vision tower here)
    re.compile(r".*\.engram\.embed\.scale$"),  # FP8 row scales; the float tables are already dequantised
    re.compile(r"^(vision|aligner)\..*"),
    re.compile(r"^image_(start|end|newline)$"),
)
_DSPARK = re.compile(r"^mtp\..*")




def params_from_hf_tensors(tensors: dict[str, np.ndarray], config: ModelConfig, *, dtype=jnp.float32,
                           include_dspark: bool = False, strict: bool = True) -> dict:
    """Build our parameter tree from an HF-named tensor dict (names with the ``model.`` prefix)."""
    specs = param_specs(config, include_dspark=include_dspark)
    used: set[str] = set()
    problems: list[str] = []

    def fetch(spec: ParamSpec):
        target_dtype = jnp.float32 if spec.dtype == "float32" else dtype
        if "{e}" in spec.hf_name:
            names = [spec.hf_name.format(e=e) for e in range(spec.shape[0])]
            missing = [n for n in names if n not in tensors]
            if missing:
                problems.append(f"missing tensor {missing[0]}" + (f" (+{len(missing) - 1} more experts)" if len(missing) > 1 else ""))
                return None
            parts = [tensors[n] for n in names]
            used.update(names)
            arr = np.stack(parts)
        else:
            if spec.hf_name not in tensors:
                problems.append(f"missing tensor {spec.hf_name} {spec.shape}")
                return None
            arr = tensors[spec.hf_name]
            used.add(spec.hf_name)
        if tuple(arr.shape) != spec.shape:
            problems.append(f"tensor {spec.hf_name} has shape {tuple(arr.shape)}, expected {spec.shape}")
            return None
        if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name not in ("bfloat16",):
            problems.append(f"tensor {spec.hf_name} has non-float dtype {arr.dtype}")
            return None
        return jnp.asarray(arr, dtype=target_dtype)

    params = jax.tree.map(fetch, specs, is_leaf=is_spec)
    unknown = [k for k in tensors if k not in used and not any(p.match(k) for p in IGNORED)
               and not ((not include_dspark or config.num_nextn_predict_layers == 0) and _DSPARK.match(k))
               and not TIED_DSPARK.match(k)]  # the release's copies of the shared embed / head
    if unknown:
        problems.append(f"unknown tensors: {sorted(unknown)[:10]}{' ...' if len(unknown) > 10 else ''}")
    if problems and strict:
        raise CheckpointError("checkpoint does not match the config:\n  " + "\n  ".join(problems))
    return params


def load_hf_checkpoint(directory: str, *, dtype=jnp.float32, config: ModelConfig | None = None,
                       include_dspark: bool = False, **kwargs) -> tuple[ModelConfig, dict]:
    """A safetensors directory in either naming (HF or release; see :mod:`dsv41_jax.checkpoint.release`)."""
    from dsv41_jax.checkpoint.release import load_safetensors_checkpoint

    return load_safetensors_checkpoint(directory, dtype=dtype, config=config, include_dspark=include_dspark, **kwargs)


def hf_tensors_from_params(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse mapping (export in HF naming)."""
    out: dict[str, np.ndarray] = {}
    specs = dict(flat_specs(config, include_dspark="dspark" in params))
    flat = {"/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    for path, spec in specs.items():
        arr = np.asarray(flat[path])
        if "{e}" in spec.hf_name:
            for e in range(arr.shape[0]):
                out[spec.hf_name.format(e=e)] = arr[e]
        else:
            out[spec.hf_name] = arr
    return out


def save_hf_checkpoint(directory: str, params: dict, config: ModelConfig) -> None:
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(), f, indent=1)
    save_file({k: np.ascontiguousarray(v) for k, v in hf_tensors_from_params(params, config).items()},
              os.path.join(directory, "model.safetensors"))
