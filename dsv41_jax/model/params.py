"""The parameter tree: shapes, dtypes, logical axes, initialisers and checkpoint names, from the config alone.

Everything about parameters has this one home. ``param_specs(config)`` returns a nested dict (the same structure
as the parameter pytree) whose leaves are :class:`ParamSpec`; from it we derive abstract shapes (for counting and
ahead-of-time compilation, no allocation), random initialisation, sharding (via the logical axes) and the mapping
to the released / HF tensor names.

Linear weights keep the checkpoint layout ``[out, in]``: loading is a rename, and einsums contract the last axis.
Routed experts are stacked on a leading ``experts`` axis (the checkpoint stores one tensor per expert).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.ops.linear import Fp8GemmInput, LoraWeight
from dsv41_jax.plan import FULL, REINDEX

FP32 = "float32"
PARAM = "param"  # placeholder: the caller's parameter dtype


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, one per dim
    init: str  # "normal" | "ones" | "zeros"
    hf_name: str  # checkpoint name; "{e}" marks a per-expert tensor stacked on axis 0
    dtype: str = PARAM  # PARAM -> the model's param dtype; FP32 -> always float32 (mHC, sinks, router bias)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _w(shape, axes, hf, init="normal", dtype=PARAM):
    return ParamSpec(tuple(int(s) for s in shape), tuple(axes), init, hf, dtype)


def _attention_specs(c: ModelConfig, spec, prefix: str) -> dict:
    h, hd, d = c.num_attention_heads, c.head_dim, c.hidden_size
    p = {
        "wq_a": _w((c.q_lora_rank, d), ("q_lora", "embed"), f"{prefix}.wq_a.weight"),
        "q_norm": _w((c.q_lora_rank,), ("q_lora",), f"{prefix}.q_norm.weight", "ones"),
        "wq_b": _w((h * hd, c.q_lora_rank), ("q_heads", "q_lora"), f"{prefix}.wq_b.weight"),
        "wkv": _w((hd, d), ("kv_latent", "embed"), f"{prefix}.wkv.weight"),
        "kv_norm": _w((hd,), ("kv_latent",), f"{prefix}.kv_norm.weight", "ones"),
        "wo_a": _w((c.o_groups * c.o_lora_rank, h * hd // c.o_groups), ("o_groups_rank", "o_group_in"),
                   f"{prefix}.wo_a.weight"),
        "wo_b": _w((d, c.o_groups * c.o_lora_rank), ("embed", "o_groups_rank"), f"{prefix}.wo_b.weight"),
        "attn_sink": _w((h,), ("heads",), f"{prefix}.attn_sink", "zeros", FP32),
    }
    if spec is not None and spec.mode == FULL:
        comp = {
            "wkv": _w((hd, d), ("kv_latent", "embed"), f"{prefix}.compressor.wkv.weight"),
            "norm": _w((hd,), ("kv_latent",), f"{prefix}.compressor.norm.weight", "ones"),
        }
        if spec.ratio > 1:
            comp["wgate"] = _w((hd, d), ("kv_latent", "embed"), f"{prefix}.compressor.wgate.weight")
        p["compressor"] = comp
    if spec is not None and spec.mode in (FULL, REINDEX):
        hi, di = c.index_n_heads, c.index_head_dim
        idx = {
            "wq_b": _w((hi * di, c.q_lora_rank), ("index_heads", "q_lora"), f"{prefix}.indexer.wq_b.weight"),
            "weights_proj": _w((hi, d), ("index_heads_w", "embed"), f"{prefix}.indexer.weights_proj.weight"),
        }
        if spec.mode == FULL:
            idx["wk"] = _w((di, hd), ("index_dim", "kv_latent"), f"{prefix}.indexer.wk.weight")
            idx["k_norm"] = _w((di,), ("index_dim",), f"{prefix}.indexer.k_norm.weight", "ones")
        p["indexer"] = idx
    return p


def _moe_specs(c: ModelConfig, prefix: str, n_experts: int) -> dict:
    d, f = c.hidden_size, c.moe_intermediate_size
    return {
        "gate": {
            "weight": _w((n_experts, d), ("experts_r", "embed"), f"{prefix}.gate.weight"),
            "bias": _w((n_experts,), ("experts_r",), f"{prefix}.gate.bias", "zeros", FP32),
        },
        "experts": {
            "w1": _w((n_experts, f, d), ("experts", "expert_mlp", "embed"), f"{prefix}.experts.{{e}}.w1.weight"),
            "w2": _w((n_experts, d, f), ("experts", "embed", "expert_mlp"), f"{prefix}.experts.{{e}}.w2.weight"),
            "w3": _w((n_experts, f, d), ("experts", "expert_mlp", "embed"), f"{prefix}.experts.{{e}}.w3.weight"),
        },
        "shared_experts": {
            "w1": _w((f, d), ("mlp", "embed"), f"{prefix}.shared_experts.w1.weight"),
            "w2": _w((d, f), ("embed", "mlp"), f"{prefix}.shared_experts.w2.weight"),
            "w3": _w((f, d), ("mlp", "embed"), f"{prefix}.shared_experts.w3.weight"),
        },
    }


def _hc_specs(c: ModelConfig, prefix: str, site: str) -> dict:
    hc = c.hc_mult
    mix = (2 + hc) * hc
    return {
        "fn": _w((mix, hc * c.hidden_size), (None, "hc_embed"), f"{prefix}.hc_{site}_fn", "normal", FP32),
        "base": _w((mix,), (None,), f"{prefix}.hc_{site}_base", "zeros", FP32),
        "scale": _w((3,), (None,), f"{prefix}.hc_{site}_scale", "ones", FP32),
    }


def _block_specs(c: ModelConfig, spec, prefix: str, n_experts: int, engram_slot: int | None) -> dict:
    d = c.hidden_size
    p = {
        "attn_norm": _w((d,), ("embed",), f"{prefix}.attn_norm.weight", "ones"),
        "ffn_norm": _w((d,), ("embed",), f"{prefix}.ffn_norm.weight", "ones"),
        "hc_attn": _hc_specs(c, prefix, "attn"),
        "hc_ffn": _hc_specs(c, prefix, "ffn"),
        "attn": _attention_specs(c, spec, f"{prefix}.attn"),
        "ffn": _moe_specs(c, f"{prefix}.ffn", n_experts),
    }
    if engram_slot is not None:
        rows = c.engram_num_embeddings[engram_slot]
        cols = c.n_hash_cols * c.engram_head_dim
        p["engram"] = {
            "embed": _w((rows, c.engram_head_dim), ("engram_rows", None), f"{prefix}.engram.embed.weight"),
            "wkv": _w((d * (c.hc_mult + 1), cols), ("engram_kv", None), f"{prefix}.engram.wkv.weight"),
            "q_weight": _w((c.hc_mult, d), (None, "embed"), f"{prefix}.engram.q_weight", "ones"),
            "k_weight": _w((c.hc_mult, d), (None, "embed"), f"{prefix}.engram.k_weight", "ones"),
        }
    return p


def _dspark_specs(c: ModelConfig) -> dict:
    """The DSpark draft blocks (3 in the release: SWA-only V4.1 blocks with their own MoE), the context projection,
    the Markov and confidence heads, under the released names ``mtp.{i}.*`` of the official ``inference/model.py``
    (``DSparkBlock``: ``main_proj`` / ``main_norm`` on block 0; ``norm``, ``markov_head.{embed,head}`` and
    ``confidence_head.proj`` on the last block). The embedding and the LM head are the target's (shared). The
    confidence projection is kept in float32 like the official code (stored bf16 in the checkpoint)."""
    d, r = c.hidden_size, c.dspark_markov_rank
    n_targets = len(c.dspark_target_layer_ids)
    blocks = [_block_specs(c, None, f"mtp.{i}", c.dspark_n_routed_experts, None)
              for i in range(c.num_nextn_predict_layers)]
    last = f"mtp.{c.num_nextn_predict_layers - 1}"
    return {
        "blocks": blocks,
        "main_proj": _w((d, n_targets * d), ("embed", "dspark_ctx"), "mtp.0.main_proj.weight"),
        "main_norm": _w((d,), ("embed",), "mtp.0.main_norm.weight", "ones"),
        "norm": _w((d,), ("embed",), f"{last}.norm.weight", "ones"),
        "markov_embed": _w((c.vocab_size, r), ("vocab", None), f"{last}.markov_head.embed.weight"),
        "markov_head": _w((c.vocab_size, r), ("vocab", None), f"{last}.markov_head.head.weight"),
        "confidence": _w((1, d + r), (None, None), f"{last}.confidence_head.proj.weight", dtype=FP32),
    }


def param_specs(config: ModelConfig, *, include_dspark: bool = False) -> dict:
    c = config
    d = c.hidden_size
    specs: dict[str, Any] = {
        "embed": _w((c.vocab_size, d), ("vocab", "embed"), "model.embed.weight"),
        "norm": _w((d,), ("embed",), "model.norm.weight", "ones"),
        "lm_head": _w((c.vocab_size, d), ("vocab", "embed"), "lm_head.weight"),
        "layers": [_block_specs(c, spec, f"model.layers.{spec.index}", c.n_routed_experts, spec.engram_slot)
                   for spec in c.plan],
    }
    if include_dspark and c.num_nextn_predict_layers > 0:
        specs["dspark"] = _dspark_specs(c)
    return specs


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def _dtype(spec: ParamSpec, param_dtype) -> Any:
    return jnp.float32 if spec.dtype == FP32 else param_dtype


def abstract_params(config: ModelConfig, dtype=jnp.float32, *, include_dspark: bool = False):
    """ShapeDtypeStructs of every parameter (no allocation)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, _dtype(s, dtype)),
                        param_specs(config, include_dspark=include_dspark), is_leaf=is_spec)


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32, *, std: float = 0.02,
                include_dspark: bool = False) -> dict:
    """Random parameters (normal(0, std) matrices, ones for norm weights, zeros for sinks / biases / mHC base)."""
    return init_from_specs(param_specs(config, include_dspark=include_dspark), key, dtype, std=std)


def init_from_specs(specs, key: jax.Array, dtype=jnp.float32, *, std: float = 0.02):
    """Random values for any subtree of :func:`param_specs` (e.g. only the DSpark drafter's), as ``init_params``."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))

    def make(s: ParamSpec, k):
        dt = _dtype(s, dtype)
        if s.init == "ones":
            return jnp.ones(s.shape, dt)
        if s.init == "zeros":
            return jnp.zeros(s.shape, dt)
        return (std * jax.random.normal(k, s.shape, jnp.float32)).astype(dt)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys)])


def logical_axes(config: ModelConfig, *, include_dspark: bool = False):
    """The logical axis names of every parameter, as a pytree of tuples (for sharding rules)."""
    return jax.tree.map(lambda s: s.axes, param_specs(config, include_dspark=include_dspark), is_leaf=is_spec)


def flat_specs(config: ModelConfig, *, include_dspark: bool = False) -> list[tuple[str, ParamSpec]]:
    """(tree path, spec) pairs in a stable order; paths look like ``layers/3/attn/wq_a``."""
    specs = param_specs(config, include_dspark=include_dspark)
    out = []
    for path, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        out.append(("/".join(_key_str(p) for p in path), s))
    return out


def _key_str(p) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(p, attr):
            return str(getattr(p, attr))
    return str(p)


def count(config: ModelConfig, predicate: Callable[[str, ParamSpec], bool] = lambda p, s: True,
          include_dspark: bool = False) -> int:
    return sum(s.size for p, s in flat_specs(config, include_dspark=include_dspark) if predicate(p, s))


class ParamError(ValueError):
    pass


def _is_weight_form(x) -> bool:
    """A release-format weight (QuantizedTensor: values + scales) or a marked GEMM weight counts as one parameter."""
    return (hasattr(x, "fmt") and hasattr(x, "scales")) or isinstance(x, (Fp8GemmInput, LoraWeight))


def validate_params(params, config: ModelConfig, *, include_dspark: bool | None = None) -> None:
    """Check the parameter tree against the config: every tensor present, nothing extra, right shapes and float
    dtypes. Runs on shapes only, so it is free under ``jit``. Errors name the offending parameter."""
    if include_dspark is None:
        include_dspark = isinstance(params, dict) and "dspark" in params
    expected = dict(flat_specs(config, include_dspark=include_dspark))
    try:
        got = {"/".join(_key_str(p) for p in path): leaf
               for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_weight_form)[0]}
    except Exception as e:  # pragma: no cover - exotic containers
        raise ParamError(f"parameters are not a pytree of arrays: {e}") from e
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing:
        raise ParamError(f"missing parameters: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if extra:
        raise ParamError(f"unexpected parameters: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    for path, spec in expected.items():
        leaf = got[path]
        shape = tuple(getattr(leaf, "shape", ()))
        if shape != spec.shape:
            raise ParamError(f"parameter {path} ({spec.hf_name}) has shape {shape}, expected {spec.shape}")
        leaf = leaf.base if isinstance(leaf, LoraWeight) else leaf  # a LoRA-adapted weight: check its base
        leaf = leaf.weight if isinstance(leaf, Fp8GemmInput) else leaf
        if hasattr(leaf, "fmt") and hasattr(leaf, "scales"):  # QuantizedTensor: the release's storage form
            continue
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ParamError(f"parameter {path} ({spec.hf_name}) has dtype {dtype}, expected a float dtype")
