"""Parameter counts from abstract shapes (no allocation): total, backbone, Engram, DSpark, and the parameters
active per token in CED prefill and in decode."""

from __future__ import annotations

import dataclasses

import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.params import flat_specs


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    total: int
    backbone: int  # embed + layers (without Engram) + norm + head
    engram: int  # Engram tables + projections
    engram_tables: int
    dspark: int
    active_decode: int  # one generated token: all 40 layers
    active_prefill: int  # one prompt token under CED: encoder layers + the decoder KV source's compressor/indexer keys
    embedding: int  # the embedding table (a lookup: one row per token; not in the active counts)

    def table(self) -> str:
        rows = [("total (backbone + Engram + DSpark)", self.total), ("backbone", self.backbone),
                ("Engram (tables + projections)", self.engram), ("  of which hash tables", self.engram_tables),
                ("DSpark draft blocks + heads", self.dspark), ("embedding table", self.embedding),
                ("active per token, decode", self.active_decode), ("active per token, CED prefill", self.active_prefill)]
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{name:<{w}}  {n:>17,}  ({n / 1e9:8.2f} B)" for name, n in rows)


def count_params(config: ModelConfig) -> ParamCounts:
    c = config
    specs = flat_specs(c, include_dspark=c.num_nextn_predict_layers > 0)
    total = backbone = engram = tables = dspark = 0
    per_layer_active = [0] * c.num_hidden_layers
    head = 0
    decoder_source_prefill = 0
    kv20 = next((l.index for l in c.plan if l.stack == "decoder" and l.mode == "full"), None)
    for path, s in specs:
        n = s.size
        total += n
        parts = path.split("/")
        if parts[0] == "dspark":
            dspark += n
            continue
        if parts[0] == "layers" and parts[2] == "engram":
            engram += n
            if parts[3] == "embed":
                tables += n
                # one row per hash column is read per token
                per_layer_active[int(parts[1])] += c.n_hash_cols * c.engram_head_dim
            else:
                per_layer_active[int(parts[1])] += n
            continue
        backbone += n
        if parts[0] == "layers":
            layer = int(parts[1])
            if parts[2] == "ffn" and parts[3] == "experts":
                n_active = n * c.num_experts_per_tok // c.n_routed_experts
                per_layer_active[layer] += n_active
            else:
                per_layer_active[layer] += n
            if layer == kv20 and parts[2] == "attn" and (parts[3] == "compressor" or parts[-1] in ("wk", "k_norm")):
                decoder_source_prefill += n
        elif parts[0] in ("lm_head", "norm"):
            head += n
    embedding = c.vocab_size * c.hidden_size
    decoder_start = c.plan.decoder_start
    active_decode = sum(per_layer_active) + head
    active_prefill = sum(per_layer_active[:decoder_start]) + decoder_source_prefill
    return ParamCounts(total, backbone, engram, tables, dspark, active_decode, active_prefill, embedding)


def expected_distinct_experts(experts: int, topk: int, tokens: int) -> float:
    """Expected number of distinct routed experts ``tokens`` tokens pick, each its own ``topk`` of ``experts``
    under uniform routing: experts * (1 - (1 - topk / experts) ** tokens). The experts a decode batch of that many
    tokens — or a speculative verification chunk — must read per layer (a plain one-token step reads ``topk``)."""
    if not 0 < topk <= experts or tokens < 0:
        raise ValueError(f"expected_distinct_experts: need 0 < topk <= experts and tokens >= 0, got "
                         f"experts={experts}, topk={topk}, tokens={tokens}")
    return experts * (1 - (1 - topk / experts) ** tokens)


def _component(parts: list[str]) -> str:
    if parts[2] == "engram":
        return "Engram tables" if parts[3] == "embed" else "Engram projections"
    if parts[2] == "attn":
        return "compressor + indexer" if parts[3] in ("compressor", "indexer") else "attention"
    if parts[2] == "ffn":
        return "routed experts" if parts[3] == "experts" else "shared expert + router"
    return "mHC + norms"


COMPONENTS = ("attention", "compressor + indexer", "routed experts", "shared expert + router", "Engram projections",
              "Engram tables", "mHC + norms")


def per_layer_params(config: ModelConfig) -> list[dict[str, tuple[int, int]]]:
    """Per backbone layer: {component: (parameters, parameters active per token)} with the same rules as
    :func:`count_params` (routed experts × top-k / n_experts; one Engram row per hash column). The layer sums
    plus embedding, final norm and head give ``backbone + engram``."""
    c = config
    layers: list[dict[str, list[int]]] = [{k: [0, 0] for k in COMPONENTS} for _ in range(c.num_hidden_layers)]
    for path, s in flat_specs(c):
        parts = path.split("/")
        if parts[0] != "layers":
            continue
        comp = _component(parts)
        n = s.size
        if comp == "Engram tables":
            active = c.n_hash_cols * c.engram_head_dim
        elif comp == "routed experts":
            active = n * c.num_experts_per_tok // c.n_routed_experts
        else:
            active = n
        entry = layers[int(parts[1])][comp]
        entry[0] += n
        entry[1] += active
    return [{k: (v[0], v[1]) for k, v in layer.items()} for layer in layers]


# The GEMM groups a prefill's weight FLOPs are reported in (:func:`prefill_flops`' ``by_component``)
GEMM_COMPONENTS = ("q LoRA (wq_a, wq_b)", "KV projection (wkv)", "output LoRA (wo_a, wo_b)", "compressor",
                   "indexer projections", "router", "shared expert", "routed experts (top-k)", "mHC projections",
                   "Engram projections", "head")


def _gemm_component(parts: list[str]) -> str:
    """The :data:`GEMM_COMPONENTS` entry of a layer's matrix parameter (path split at '/')."""
    if parts[2] == "attn":
        if parts[3] in ("wq_a", "wq_b"):
            return GEMM_COMPONENTS[0]
        if parts[3] == "wkv":
            return GEMM_COMPONENTS[1]
        if parts[3] in ("wo_a", "wo_b"):
            return GEMM_COMPONENTS[2]
        return {"compressor": GEMM_COMPONENTS[3], "indexer": GEMM_COMPONENTS[4]}[parts[3]]
    if parts[2] == "ffn":
        return {"gate": GEMM_COMPONENTS[5], "shared_experts": GEMM_COMPONENTS[6],
                "experts": GEMM_COMPONENTS[7]}[parts[3]]
    if parts[2] in ("hc_attn", "hc_ffn"):
        return GEMM_COMPONENTS[8]
    if parts[2] == "engram":
        return GEMM_COMPONENTS[9]
    raise ValueError(f"no GEMM component for parameter {'/'.join(parts)}")


def _matmul_flops_per_token(config: ModelConfig) -> tuple[list[dict], list[dict]]:
    """Per layer: ({component: 2 × active matrix parameters applied once per token}, the same for the KV source's
    compressor and indexer keys alone). Vectors (norms, sinks, biases) and the Engram table reads (lookups) are
    not FLOPs; the indexer key projection runs once per compressed entry (1 / ratio per token)."""
    c = config
    plan = c.plan
    per_layer = [dict.fromkeys(GEMM_COMPONENTS[:-1], 0.0) for _ in range(c.num_hidden_layers)]
    source_part = [dict.fromkeys(GEMM_COMPONENTS[:-1], 0.0) for _ in range(c.num_hidden_layers)]
    for path, s in flat_specs(c):
        parts = path.split("/")
        if parts[0] != "layers" or len(s.shape) < 2 or (parts[2] == "engram" and parts[3] == "embed"):
            continue
        layer = int(parts[1])
        n = float(s.size)
        if parts[2] == "ffn" and parts[3] == "experts":
            n = n * c.num_experts_per_tok / c.n_routed_experts
        if parts[2] == "attn" and parts[3] == "indexer" and parts[-1] == "wk":
            n = n / plan[layer].ratio
        comp = _gemm_component(parts)
        per_layer[layer][comp] += 2 * n
        if parts[2] == "attn" and (parts[3] == "compressor" or parts[-1] == "wk"):
            source_part[layer][comp] += 2 * n
    return per_layer, source_part


def prefill_flops(config: ModelConfig, prompt_len: int, *, ced: bool = True,
                  replay_len: int | None = None, by_component_out: bool = False) -> dict:
    """FLOPs to prefill one prompt of ``prompt_len`` tokens, counted from the config (multiply-add = 2 FLOPs):

    * ``weights``: 2 × the active matrix parameters of every layer a token passes (experts × top-k / n), plus the
      head once (only the last token's logits are needed);
    * ``attention``: per query and layer 4 · heads · head_dim per key read (scores and the weighted sum, V = K): its
      window (min(window, t + 1), truncated at the replay segment's start in the CED decoder) plus
      min(top-k, visible) compressed entries in CSA2 layers;
    * ``indexer``: per query of a layer that runs an indexer, 2 · index_heads · (index_dim + 1) per scored entry:
      every visible entry, or for pool-restricted layers at most candidate_topk_blocks × block entries (SPEC §5:
      "later indexers cost O(16K), not O(context)").

    ``ced=True`` (SPEC §8): the encoder over the whole prompt, the decoder's KV source compressor and indexer keys
    over the whole prompt, the decoder over the last min(replay_len, prompt_len) tokens only (replay_len defaults
    to the sliding window). ``ced=False``: every layer over every token (full replay). ``by_component_out``: also
    ``by_component``, the ``weights`` FLOPs split into :data:`GEMM_COMPONENTS` (they sum to ``weights``)."""
    c = config
    t_all = int(prompt_len)
    if t_all <= 0:
        raise ValueError(f"prompt_len must be positive, got {prompt_len}")
    replay = c.sliding_window if replay_len is None else replay_len
    plan = c.plan
    per_layer, source_part = _matmul_flops_per_token(c)
    head = 2.0 * c.hidden_size * c.vocab_size
    out = {"weights": head, "attention": 0.0, "indexer": 0.0}
    by_component = dict.fromkeys(GEMM_COMPONENTS, 0.0)
    by_component["head"] = head
    pool_cap = c.candidate_topk_blocks * c.candidate_block_size
    for spec in plan:
        decoder = spec.stack == "decoder"
        start = t_all - min(replay, t_all) if (ced and decoder) else 0
        q = np.arange(start, t_all, dtype=np.float64)  # the query positions this layer runs
        for comp, f in per_layer[spec.index].items():
            by_component[comp] += f * len(q)
            if ced and decoder:  # the KV source's compressor / keys see every token
                by_component[comp] += source_part[spec.index][comp] * (t_all - len(q))
        keys = np.minimum(c.sliding_window, q + 1 - start)
        if spec.ratio:
            visible = np.floor((q + 1) / spec.ratio)
            keys = keys + np.minimum(c.index_topk, visible)
            if spec.runs_indexer:
                scored = np.minimum(visible, pool_cap) if spec.uses_candidates else visible
                out["indexer"] += float(2 * c.index_n_heads * (c.index_head_dim + 1) * scored.sum())
        out["attention"] += float(4 * c.num_attention_heads * c.head_dim * keys.sum())
    out["weights"] = sum(by_component.values())
    out["total"] = out["weights"] + out["attention"] + out["indexer"]
    if by_component_out:
        out["by_component"] = by_component
    return out
