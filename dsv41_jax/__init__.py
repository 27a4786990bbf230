"""dsv41_jax: DeepSeek-V4.1-Flash in JAX.

Public API (pure functions over explicit pytrees):
  * ``load_config(name_or_path)`` -> ``ModelConfig`` (frozen, validated; ``config.plan`` is the unrolled layer plan)
  * ``init_params(config, key)``, ``abstract_params(config)``, ``param_specs(config)``
  * ``forward(params, tokens, config=..., engram_ids=...)`` -> float32 logits
  * ``load_checkpoint(dir)`` -> (config, params) for HF-named safetensors checkpoints, orbax parameter
    exports and ``dsv41 train`` checkpoint directories
  * ``default_model()`` -> (config, params, tokenizer) of the embedded tiny model
  * ``Engine(config, params, max_batch=..., max_len=...)`` -> cached batched generation (``generate``,
    ``prefill``, ``decode_step``) and continuous batching (``serve``, ``batcher``) of ``Request``s; lower
    levels in ``dsv41_jax.inference``
  * ``dsv41_jax.kernels`` (Pallas / reference dispatch), ``dsv41_jax.parallel`` (meshes, rules, expert
    parallelism), ``dsv41_jax.train`` (train step, loop, data)
  * ``dsv41_jax.model.model``: ``EngramHasher`` (host-side Engram row ids) and the ``DeepseekV41`` NNX owner
"""

from dsv41_jax.config import ConfigError, ModelConfig, load_config
from dsv41_jax.model.forward import ForwardError, ForwardOptions, forward
from dsv41_jax.model.params import ParamError, abstract_params, init_params, param_specs
from dsv41_jax.checkpoint.hf import CheckpointError
from dsv41_jax.checkpoint.orbax_ckpt import load_checkpoint  # HF safetensors, orbax exports, training checkpoints
from dsv41_jax.default_model import default_model  # the embedded tiny model (dsv41_jax/assets/default_model)
from dsv41_jax.inference.engine import Engine, Request  # cached batched generation, continuous batching

__all__ = [
    "ConfigError", "ModelConfig", "load_config", "ForwardError", "ForwardOptions", "forward", "ParamError",
    "abstract_params", "init_params", "param_specs", "CheckpointError", "load_checkpoint", "default_model",
    "Engine", "Request",
]
__version__ = "0.1.0"
