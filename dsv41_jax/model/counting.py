"""Parameter counts from abstract shapes (no allocation): total, backbone, Engram, DSpark, and the parameters
active per token in CED prefill and in decode."""

from __future__ import annotations

import dataclasses

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
