"""The model configuration: one frozen, validated object that *is* the architecture.

Field names follow the released / HF ``config.json`` (``DeepseekV41TextConfig``) so a released config loads
without a translation table. Everything structural (which layer compresses, which one owns an indexer, where the
HSI candidate pool comes from) is derived from these fields by :mod:`dsv41_jax.plan`; invalid combinations fail
here, at construction, with a message naming the offending field.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

RELEASED_COMPRESS_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
RELEASED_KV_SOURCES = (2, 8, 14, 20)
RELEASED_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)


class ConfigError(ValueError):
    """An invalid configuration; the message names the field."""


def _field_error(name: str, message: str) -> ConfigError:
    return ConfigError(f"config field `{name}`: {message}")


@dataclasses.dataclass(frozen=True)
class YarnConfig:
    """YaRN frequency interpolation for the compress rope (no mscale: attention factor is 1.0 in V4.1)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # --- embedding / trunk -------------------------------------------------------------------------
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    rms_norm_eps: float = 1e-20
    max_position_embeddings: int = 1048576
    # --- attention ---------------------------------------------------------------------------------
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1280
    qk_rope_head_dim: int = 64
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_yarn: YarnConfig | None = YarnConfig()
    # --- CSA2 / indexer / HSI ----------------------------------------------------------------------
    compress_ratios: tuple[int, ...] = RELEASED_COMPRESS_RATIOS
    kv_source_layer_ids: tuple[int, ...] = RELEASED_KV_SOURCES
    index_source_layer_ids: tuple[int, ...] = RELEASED_INDEX_SOURCES
    candidate_source_layer_id: int = 20  # < 0 disables the hierarchical (two-level) top-k
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    # --- MoE ---------------------------------------------------------------------------------------
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    routed_scaling_factor: float = 1.5
    gate_temp: float = 1.0
    swiglu_limit: float = 10.0
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    # --- mHC ---------------------------------------------------------------------------------------
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # --- Engram ------------------------------------------------------------------------------------
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_vocab_size: int = 16_000_000
    engram_num_embeddings: tuple[int, ...] = (384_006_168, 384_016_682)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # --- DSpark ------------------------------------------------------------------------------------
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # --- numerics ----------------------------------------------------------------------------------
    quant_sim: bool = True  # the release's fake quantisation (FP8 window KV, FP4 compressed KV / indexer)
    name: str = "custom"

    # ------------------------------------------------------------------------------------------------
    def __post_init__(self):
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                     "engram_num_embeddings", "dspark_target_layer_ids"):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)):
                raise _field_error(name, f"must be a sequence of ints, got {type(value).__name__}")
            object.__setattr__(self, name, tuple(int(v) for v in value))
        self._validate()

    # ------------------------------------------------------------------------------------------------
    def _validate(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "candidate_topk_blocks",
                    "candidate_block_size", "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
                    "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters",
                    "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise _field_error(name, f"must be a positive integer, got {value!r}")
        n = self.num_hidden_layers
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise _field_error("qk_rope_head_dim", f"must be even and in (0, head_dim={self.head_dim}], "
                               f"got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise _field_error("index_head_dim", f"({self.index_head_dim}) must hold the rope slice "
                               f"qk_rope_head_dim={self.qk_rope_head_dim}")
        if self.num_attention_heads % self.o_groups:
            raise _field_error("o_groups", f"({self.o_groups}) must divide num_attention_heads "
                               f"({self.num_attention_heads})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise _field_error("num_experts_per_tok", f"({self.num_experts_per_tok}) exceeds n_routed_experts "
                               f"({self.n_routed_experts})")
        if self.scoring_func != "sqrtsoftplus":
            raise _field_error("scoring_func", f"only 'sqrtsoftplus' (V4.1) is implemented, got {self.scoring_func!r}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "engram_pad_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise _field_error(name, f"({value}) must be a token id in [0, vocab_size={self.vocab_size})")
        if self.rms_norm_eps < 0 or self.hc_eps < 0:
            raise _field_error("rms_norm_eps" if self.rms_norm_eps < 0 else "hc_eps", "must be >= 0")

        # --- compress ratios and the CSA2 source schedule ---------------------------------------------
        ratios = self.compress_ratios
        if not n <= len(ratios) <= n + self.num_nextn_predict_layers:
            raise _field_error("compress_ratios", f"has {len(ratios)} entries; expected between num_hidden_layers "
                               f"({n}) and num_hidden_layers + num_nextn_predict_layers "
                               f"({n + self.num_nextn_predict_layers})")
        if any(r < 0 for r in ratios):
            raise _field_error("compress_ratios", f"entries must be >= 0 (0 = sliding window only), got {list(ratios)}")
        if any(r != 0 for r in ratios[n:]):
            raise _field_error("compress_ratios", "DSpark draft entries (after num_hidden_layers) must be 0")
        backbone = ratios[:n]
        kv, idx = self.kv_source_layer_ids, self.index_source_layer_ids
        for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", idx)):
            if list(ids) != sorted(set(ids)):
                raise _field_error(name, f"must be strictly increasing, got {list(ids)}")
            bad = [i for i in ids if not 0 <= i < n]
            if bad:
                raise _field_error(name, f"layer ids {bad} are outside [0, {n})")
            bad = [i for i in ids if backbone[i] == 0]
            if bad:
                raise _field_error(name, f"layers {bad} have compress_ratios 0 (sliding window only); a source "
                                   "needs a compressed branch")
        for layer in range(n):
            if backbone[layer] == 0:
                continue
            earlier = [s for s in kv if s <= layer]
            if not earlier:
                raise _field_error("kv_source_layer_ids", f"layer {layer} has compress ratio {backbone[layer]} "
                                   "but no KV source at or before it (a Reuse layer before any source)")
            source = earlier[-1]
            if backbone[source] != backbone[layer]:
                raise _field_error("compress_ratios", f"layer {layer} has ratio {backbone[layer]} but reads the "
                                   f"compressed KV of source layer {source} with ratio {backbone[source]}")
            if not [s for s in idx if source <= s <= layer]:
                raise _field_error("index_source_layer_ids", f"layer {layer} reads KV source {source} but no index "
                                   "source at or after that KV source precedes it; every KV source must also be "
                                   "an index source")
        missing = [s for s in kv if s not in idx]
        if missing:
            raise _field_error("index_source_layer_ids", f"KV sources {missing} must also be index sources "
                               "(otherwise their group would reuse another group's top-k)")
        if self.candidate_source_layer_id >= 0:
            cand = self.candidate_source_layer_id
            if cand not in idx:
                raise _field_error("candidate_source_layer_id", f"({cand}) must be one of index_source_layer_ids "
                                   f"{list(idx)}")
            cand_group = max(s for s in kv if s <= cand)
            for layer in idx:
                if layer > cand and max(s for s in kv if s <= layer) != cand_group:
                    raise _field_error("candidate_source_layer_id", f"index source {layer} follows the candidate "
                                       f"source {cand} but reads another KV group; the candidate pool is only "
                                       "defined over the candidate's own group")
        # --- quantisation block constraints (the reference silently skips them otherwise; we refuse) ---
        if self.quant_sim:
            for name, dim, block in (("head_dim", self.head_dim, 32), ("index_head_dim", self.index_head_dim, 32)):
                if dim % block:
                    raise _field_error(name, f"({dim}) must be a multiple of {block} when quant_sim is on "
                                       "(block-scaled fake quantisation); set quant_sim=False for other sizes")
        # --- Engram ------------------------------------------------------------------------------------
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise _field_error("engram_num_embeddings", f"has {len(self.engram_num_embeddings)} entries but "
                               f"engram_layer_ids has {len(self.engram_layer_ids)}")
        if list(self.engram_layer_ids) != sorted(set(self.engram_layer_ids)):
            raise _field_error("engram_layer_ids", f"must be strictly increasing, got {list(self.engram_layer_ids)}")
        bad = [i for i in self.engram_layer_ids if not 0 <= i < n]
        if bad:
            raise _field_error("engram_layer_ids", f"layer ids {bad} are outside [0, {n})")
        if self.engram_layer_ids:
            if self.engram_max_ngram_size < 2:
                raise _field_error("engram_max_ngram_size", f"must be >= 2, got {self.engram_max_ngram_size}")
            for name in ("engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size"):
                if getattr(self, name) <= 0:
                    raise _field_error(name, f"must be positive, got {getattr(self, name)}")
        # --- DSpark ------------------------------------------------------------------------------------
        bad = [i for i in self.dspark_target_layer_ids if not 0 <= i < n]
        if bad:
            raise _field_error("dspark_target_layer_ids", f"layer ids {bad} are outside [0, {n})")

    # ------------------------------------------------------------------------------------------------
    @property
    def n_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def plan(self):
        from dsv41_jax.plan import build_plan

        return build_plan(self)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    # ------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, strict: bool = False) -> "ModelConfig":
        """Build from our own ``to_dict`` output (round-trips)."""
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown and strict:
            raise ConfigError(f"unknown config fields: {unknown}")
        if isinstance(d.get("compress_yarn"), Mapping):
            d["compress_yarn"] = YarnConfig(**d["compress_yarn"])
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], *, name: str = "hf", yarn_factor: str = "config") -> "ModelConfig":
        """Build from a released / HF ``config.json`` (flat text config or composite with ``text_config``).

        ``yarn_factor``: "config" (official V4.1 inference: the YaRN ``factor`` field as written; when absent,
        max_position_embeddings / original_max_position_embeddings) or "hf" (the HF rope utilities: that ratio
        whenever ``original_max_position_embeddings`` is given, overriding ``factor``). They differ only for a
        config whose ``factor`` is not that ratio; the release (16 = 1048576 / 65536) and the golden fixtures agree
        under both."""
        if yarn_factor not in ("config", "hf"):
            raise ValueError(f"yarn_factor must be 'config' or 'hf', got {yarn_factor!r}")
        if isinstance(d.get("text_config"), Mapping):
            d = d["text_config"]
        d = dict(d)
        n = int(d.get("num_hidden_layers", 40))
        n_nextn = int(d.get("num_nextn_predict_layers", 3))
        out: dict[str, Any] = {"name": name}
        simple = [f.name for f in dataclasses.fields(cls) if f.name not in ("compress_yarn", "quant_sim", "name")]
        for key in simple:
            if key in d and d[key] is not None:
                out[key] = d[key]
        if isinstance(out.get("eos_token_id"), list):
            out["eos_token_id"] = out["eos_token_id"][0]
        # HF defaults for omitted schedules (configuration_deepseek_v41 __post_init__ semantics).
        ratios = d.get("compress_ratios")
        if ratios is None:
            if n == len(RELEASED_COMPRESS_RATIOS):
                ratios = list(RELEASED_COMPRESS_RATIOS)
            else:
                n_slide = min(2, n)
                n_enc = max(0, (n - n_slide + 1) // 2)
                ratios = [0] * n_slide + [2] * n_enc + [1] * max(0, n - n_slide - n_enc)
        ratios = list(ratios)[: n + n_nextn]
        out["compress_ratios"] = ratios
        if d.get("kv_source_layer_ids") is None:
            if tuple(ratios[:n]) == RELEASED_COMPRESS_RATIOS[:n]:
                out["kv_source_layer_ids"] = list(RELEASED_KV_SOURCES)
            else:
                out["kv_source_layer_ids"] = [i for i in range(n) if ratios[i] > 0 and (i == 0 or ratios[i - 1] != ratios[i])]
        if d.get("index_source_layer_ids") is None:
            kv = out["kv_source_layer_ids"]
            out["index_source_layer_ids"] = list(RELEASED_INDEX_SOURCES) if tuple(kv) == RELEASED_KV_SOURCES else list(kv)
        if d.get("candidate_source_layer_id") is None:
            out["candidate_source_layer_id"] = out["kv_source_layer_ids"][-1] if out["kv_source_layer_ids"] else -1
        for key, default in (("engram_layer_ids", []), ("dspark_target_layer_ids", None)):
            if d.get(key) is None:
                if key == "dspark_target_layer_ids":
                    out[key] = sorted([i for i in range(n) if i not in out["kv_source_layer_ids"]][-3:])
                else:
                    out[key] = default
        if d.get("engram_num_embeddings") is None:
            out["engram_num_embeddings"] = [0] * len(out["engram_layer_ids"])
        # Rope: yarn applies to the compress rope only; attention factor is forced to 1.0.
        rope = d.get("rope_parameters") or {}
        compress = rope.get("compress") if isinstance(rope.get("compress"), Mapping) else None
        main = rope.get("main") if isinstance(rope.get("main"), Mapping) else None
        if main is not None and "rope_theta" in main:
            out["rope_theta"] = main["rope_theta"]
        scaling = compress if compress is not None else (d.get("rope_scaling") or {})
        if compress is not None and "rope_theta" in compress:
            out["compress_rope_theta"] = compress["rope_theta"]
        if scaling.get("rope_type", scaling.get("type")) == "yarn":
            orig = scaling.get("original_max_position_embeddings", 65536)
            max_pos = int(d.get("max_position_embeddings", 1048576))
            ratio = max_pos / orig if orig else None
            if yarn_factor == "hf" and ratio is not None:
                factor = ratio  # HF overrides `factor` with max_position / original
            else:
                factor = scaling.get("factor", ratio if ratio is not None else 1.0)
            out["compress_yarn"] = YarnConfig(factor=float(factor), original_max_position_embeddings=int(orig),
                                              beta_fast=float(scaling.get("beta_fast", 32)),
                                              beta_slow=float(scaling.get("beta_slow", 1)))
        else:
            out["compress_yarn"] = None
        for float_key in ("rope_theta", "compress_rope_theta"):
            if float_key in out:
                out[float_key] = float(out[float_key])
        return cls(**out)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """A ``config.json`` (ours or HF's). A file that is not a JSON object, or whose fields are invalid, raises
        :class:`ConfigError` naming the file."""
        from dsv41_jax.jsonfile import read_json_object

        d = read_json_object(path, "a JSON object of model config fields (config.json)", ConfigError)
        try:
            if "dsv41_jax" in d:  # our own format
                return cls.from_dict(d["dsv41_jax"])
            return cls.from_hf_dict(d, name=os.path.basename(os.path.dirname(os.path.abspath(path))))
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        except (TypeError, ValueError, KeyError) as e:  # wrong value types deep inside the conversion
            raise ConfigError(f"{path}: invalid model config: {type(e).__name__}: {e}") from None

    def to_hf_dict(self) -> dict:
        """The HF-style ``config.json`` content (for exporting checkpoints the reference can read)."""
        d = {k: v for k, v in self.to_dict().items() if k not in ("compress_yarn", "quant_sim", "name")}
        d["model_type"] = "deepseek_v41_text"
        if self.compress_yarn is not None:
            y = self.compress_yarn
            d["rope_scaling"] = {"rope_type": "yarn", "factor": y.factor, "beta_fast": y.beta_fast,
                                 "beta_slow": y.beta_slow,
                                 "original_max_position_embeddings": y.original_max_position_embeddings}
        return d


def load_config(name_or_path: str) -> ModelConfig:
    """Resolve ``flash`` / ``tiny`` / ... (modules in ``configs/``) or a path to a ``config.json`` / directory."""
    if os.path.isdir(name_or_path):
        return ModelConfig.from_json_file(os.path.join(name_or_path, "config.json"))
    if name_or_path.endswith(".json") and os.path.exists(name_or_path):
        return ModelConfig.from_json_file(name_or_path)
    from dsv41_jax import presets

    return presets.get(name_or_path)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["ModelConfig", "YarnConfig", "ConfigError", "load_config", "ceil_div"]
