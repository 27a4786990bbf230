"""Sharding for dsv41_jax: meshes and presets, the logical-axis rules table, expert parallelism and sharded
entry points. See the module docstrings of ``mesh``, ``rules``, ``expert_parallel`` and ``api``.

    from dsv41_jax import parallel as par
    mesh = par.make_mesh("data=2,expert=2,tensor=2")           # or a preset name: "gpu8", "v5p-128", ...
    params = par.shard_params(params, config, mesh, "tp")
    logits = par.sharded_forward(config, mesh, "tp", ForwardOptions(moe_impl="expert_parallel"))(params, tokens, ids)
"""

from dsv41_jax.parallel.mesh import AXES, PRESETS, MeshError, MeshPreset, describe, get_preset, make_mesh, parse_mesh
from dsv41_jax.parallel.rules import (RULES, Rules, ShardingContext, check_batch, check_model, constrain,
                                      current, get_rules, logical_to_spec, rules_table_markdown, sharding_context)
from dsv41_jax.parallel.api import (abstract_sharded_params, batch_sharding, cache_shardings, describe_shardings,
                                    pad_params, padded_rows, param_partition_specs, param_shardings, shard_params,
                                    sharded_forward, sharded_jit, unpad_params)
from dsv41_jax.parallel.serving import sharded_ced_prefill, sharded_decode_step

__all__ = [
    "AXES", "PRESETS", "MeshError", "MeshPreset", "describe", "get_preset", "make_mesh", "parse_mesh",
    "RULES", "Rules", "ShardingContext", "check_batch", "check_model", "constrain", "current", "get_rules",
    "logical_to_spec", "rules_table_markdown", "sharding_context",
    "abstract_sharded_params", "batch_sharding", "cache_shardings", "describe_shardings", "pad_params",
    "padded_rows", "param_partition_specs", "param_shardings", "shard_params", "sharded_forward", "sharded_jit",
    "unpad_params", "sharded_ced_prefill", "sharded_decode_step",
]
