"""The embedded default model: a tiny V4.1-architecture model trained on the Python standard library's sources,
shipped in the package (``dsv41_jax/assets/default_model/``: HF-style ``config.json`` + ``model.safetensors``), so
``dsv41 generate`` produces recognisable text on any machine without downloading anything.

How it was trained (command, steps, final loss): ``dsv41_jax/assets/default_model/TRAINING.md``.
"""

from __future__ import annotations

import os

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "default_model")
# The rows it was trained on: `--seq-len 512` byte tokens (TRAINING.md, "Command"). Longer prompts run (the
# architecture has no such limit) but are outside what the model saw; `dsv41 generate` warns.
TRAINED_SEQ_LEN = 512


def default_model_available() -> bool:
    return os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "model.safetensors"))


def default_model(dtype=None, *, include_dspark: bool = False):
    """(config, params, tokenizer) of the embedded default model (byte-level tokenizer); ``include_dspark``: with
    its trained DSpark drafter (``params["dspark"]``, the ``mtp.*`` tensors)."""
    import jax.numpy as jnp

    from dsv41_jax.checkpoint.hf import CheckpointError, load_hf_checkpoint
    from dsv41_jax.tokenizer import ByteTokenizer

    if not default_model_available():
        raise CheckpointError(f"the embedded default model is missing: no model.safetensors in {DEFAULT_MODEL_DIR}")
    try:
        config, params = load_hf_checkpoint(DEFAULT_MODEL_DIR, dtype=jnp.float32 if dtype is None else dtype,
                                            include_dspark=include_dspark)
    except CheckpointError as e:
        if include_dspark and "missing tensor mtp." in str(e):
            raise CheckpointError(f"the embedded default model has no trained DSpark drafter (no mtp.* tensors in "
                                  f"{DEFAULT_MODEL_DIR})") from e
        raise
    return config, params, ByteTokenizer(model_vocab_size=config.vocab_size)
