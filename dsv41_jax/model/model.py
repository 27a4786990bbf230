"""The thin owners: ``EngramHasher`` (host-side Engram addressing for one tokenizer) and ``DeepseekV41``, a Flax NNX
module that owns the parameters (each an ``nnx.Param`` carrying its logical axis names) and calls the pure
:func:`dsv41_jax.model.forward.forward`. All maths lives in the pure functions; these classes hold state only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.forward import ForwardOptions, check_tokens, forward
from dsv41_jax.model.params import init_params, logical_axes, validate_params
from dsv41_jax.model.hasher import EngramHasher, default_hasher  # re-exported: their home is model/hasher.py



# One compiled program per (config, options, return flags, shapes) instead of op-by-op dispatch (≈ 5× faster on a
# CPU for the tiny preset, more for larger models).
_forward_jit = jax.jit(forward, static_argnames=("config", "options", "return_hidden", "return_topk", "return_router",
                                                 "return_attn_inputs", "return_site_inputs",
                                                 "return_dspark_features", "return_mhc"))

class DeepseekV41(nnx.Module):
    """Parameters of the V4.1 backbone as NNX state, plus the Engram hasher of its tokenizer.

    ``model(tokens)`` hashes Engram ids on the host and runs the pure forward. For jitted / sharded use, take
    ``model.param_tree()`` (a plain pytree) and call :func:`dsv41_jax.forward` directly.
    """

    def __init__(self, config: ModelConfig, params: dict | None = None, *, rngs: nnx.Rngs | None = None,
                 dtype=jnp.float32, hasher: EngramHasher | None = None, tokenizer=None):
        if params is None:
            rngs = rngs or nnx.Rngs(0)
            params = init_params(config, rngs.params(), dtype)
        validate_params(params, config)
        self.config = config
        axes = logical_axes(config, include_dspark="dspark" in params)
        # Logical axis names travel with each parameter (nnx sharding metadata).
        self.params = nnx.data(jax.tree.map(lambda a, ax: nnx.Param(a, sharding_names=ax, eager_sharding=False),
                                            params, axes))
        # (eager_sharding=False: placement is decided by dsv41_jax.parallel rules, not at construction.)
        self.hasher = hasher if hasher is not None else default_hasher(config, tokenizer)

    def param_tree(self) -> dict:
        return jax.tree.map(lambda v: v[...], self.params, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def engram_ids(self, tokens, **kw) -> jax.Array | None:
        if self.hasher is None:
            return None
        return jnp.asarray(self.hasher.row_ids(tokens, **kw))

    def __call__(self, tokens, *, options: ForwardOptions = ForwardOptions(), **kw) -> Any:
        tokens = jnp.asarray(tokens)
        check_tokens(tokens, self.config)  # on the concrete ids, before tracing: a clear error names a bad id
        return _forward_jit(self.param_tree(), tokens, config=self.config, engram_ids=self.engram_ids(tokens),
                            options=options, **kw)
