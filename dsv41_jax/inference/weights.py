"""Random weights drawn on the host with numpy: no per-shape kernel compiles, so a CPU session (CLI, tests,
benchmarks) has a random model in well under a second. Same shapes and constants as ``init_params``; different
random values (numpy's generator, not JAX's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.params import FP32, is_spec, param_specs


def host_random_params(config: ModelConfig, seed: int = 0, *, std: float = 0.02, dtype=jnp.float32,
                       perturb_constants: float = 0.0, include_dspark: bool = False) -> dict:
    """normal(0, std) matrices; ones / zeros for norm weights, sinks, biases, mHC base/scale, Engram q/k weights —
    plus ``perturb_constants`` x normal noise on those when given (tests: exercise the paths constants hide)."""
    rng = np.random.default_rng(seed)

    def make(spec):
        base = {"ones": 1.0, "zeros": 0.0}.get(spec.init)
        noise = rng.standard_normal(spec.shape, dtype=np.float32)
        if base is None:
            value = std * noise
        else:
            value = base + perturb_constants * noise if perturb_constants else np.full(spec.shape, base, np.float32)
        return jnp.asarray(value, jnp.float32 if spec.dtype == FP32 else dtype)

    return jax.tree.map(make, param_specs(config, include_dspark=include_dspark), is_leaf=is_spec)


__all__ = ["host_random_params"]
