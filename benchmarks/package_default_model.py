"""Copy a trained export into the package as the embedded default model: bf16 weights (the float32-only parameters
— mHC, sinks, router biases — stay float32), HF-style config.json carrying our full config, model.safetensors.

    python benchmarks/package_default_model.py out/default_model [dsv41_jax/assets/default_model]
    python benchmarks/package_default_model.py --drafter out_drafter/model [dsv41_jax/assets/default_model]

``--drafter``: copy only the DSpark drafter (``mtp.*``, from a ``dsv41 train --dspark`` export) into
``drafter.safetensors`` beside the model, with the same precision rule; ``model.safetensors`` is left as it is.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np


def main(argv=None) -> int:
    from safetensors.numpy import save_file

    from dsv41_jax.checkpoint.hf import hf_tensors_from_params
    from dsv41_jax.checkpoint.orbax_ckpt import load_checkpoint, write_config_json
    from dsv41_jax.default_model import DEFAULT_MODEL_DIR
    from dsv41_jax.model.params import FP32, flat_specs

    argv = sys.argv[1:] if argv is None else argv
    drafter = "--drafter" in argv
    argv = [a for a in argv if a != "--drafter"]
    src = argv[0]
    dst = argv[1] if len(argv) > 1 else DEFAULT_MODEL_DIR
    config, params = load_checkpoint(src, include_dspark=drafter)
    specs = [s for _, s in flat_specs(config, include_dspark=drafter)]
    leaves, treedef = jax.tree.flatten(params)
    params = jax.tree.unflatten(treedef, [x if s.dtype == FP32 else x.astype(jnp.bfloat16)
                                          for x, s in zip(leaves, specs)])
    os.makedirs(dst, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v) for k, v in hf_tensors_from_params(params, config).items()}
    name = "drafter.safetensors" if drafter else "model.safetensors"
    if drafter:
        tensors = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    save_file(tensors, os.path.join(dst, name), metadata={"format": "pt", "source": "dsv41 train"})
    write_config_json(dst, config)
    os.chmod(os.path.join(dst, name), 0o644)
    size = os.path.getsize(os.path.join(dst, name))
    print(f"wrote {dst}/{name}: {len(tensors)} tensors, {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
