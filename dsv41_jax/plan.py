"""The unrolled layer plan: what every layer does, derived from the config (never hard-coded).

Roles (SPEC §2):
  * ``swa``     — sliding-window attention only (compress ratio 0).
  * ``full``    — a KV source: owns a compressor, indexer keys, its own indexer query and a fresh top-k.
  * ``reindex`` — an index source that is not a KV source: the group's KV and indexer keys, its own indexer
                  query, a fresh top-k (inside the HSI candidate pool when it follows the candidate source).
  * ``reuse``   — the group's KV and the latest index source's top-k.
The causal encoder is every layer before the first ratio-1 layer, the decoder the rest (the release: 0–19 / 20–39).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from dsv41_jax.config import ModelConfig

SWA, FULL, REINDEX, REUSE = "swa", "full", "reindex", "reuse"


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    index: int
    stack: str  # "encoder" | "decoder"
    ratio: int  # 0 = SWA only
    mode: str  # swa | full | reindex | reuse
    kv_source: int | None  # layer whose compressed KV / indexer keys this layer reads
    index_source: int | None  # layer whose top-k this layer uses (itself for full / reindex)
    candidate_source: bool  # publishes the HSI candidate pool
    uses_candidates: bool  # restricts its top-k to the HSI pool
    engram_slot: int | None  # position in engram_layer_ids, if this layer has Engram

    @property
    def has_compressed(self) -> bool:
        return self.ratio > 0

    @property
    def runs_indexer(self) -> bool:
        return self.mode in (FULL, REINDEX)

    @property
    def rope(self) -> str:
        return "compress" if self.ratio > 0 else "main"


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    layers: tuple[LayerSpec, ...]
    decoder_start: int  # first decoder layer (the CED split); == num layers when there is no decoder

    def __iter__(self):
        return iter(self.layers)

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    @property
    def kv_sources(self) -> tuple[int, ...]:
        return tuple(l.index for l in self.layers if l.mode == FULL)

    def table(self) -> str:
        """A printable table (``dsv41 plan``)."""
        header = ("layer", "stack", "attention", "ratio", "CSA2 mode", "KV from", "top-k from", "HSI", "Engram")
        rows = []
        for l in self.layers:
            attention = "SWA" if l.ratio == 0 else "SWA+CSA2"
            hsi = "candidate source" if l.candidate_source else ("pool-restricted" if l.uses_candidates else "")
            rows.append((str(l.index), l.stack, attention, str(l.ratio) if l.ratio else "-",
                         l.mode if l.ratio else "-",
                         "-" if l.kv_source is None else str(l.kv_source),
                         "-" if l.index_source is None else str(l.index_source), hsi,
                         "yes" if l.engram_slot is not None else ""))
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        fmt = " | ".join("{:<%d}" % w for w in widths)
        lines = [fmt.format(*header), "-+-".join("-" * w for w in widths)]
        lines += [fmt.format(*r) for r in rows]
        return "\n".join(lines)


def build_plan(config: "ModelConfig") -> LayerPlan:
    n = config.num_hidden_layers
    ratios = config.compress_ratios[:n]
    kv_sources = set(config.kv_source_layer_ids)
    index_sources = set(config.index_source_layer_ids)
    cand = config.candidate_source_layer_id
    decoder_start = next((i for i in range(n) if ratios[i] == 1), n)
    layers = []
    latest_kv = latest_index = None
    for i in range(n):
        ratio = ratios[i]
        if ratio == 0:
            mode, kv_src, idx_src = SWA, None, None
        else:
            if i in kv_sources:
                latest_kv = i
            if i in index_sources:
                latest_index = i
            kv_src, idx_src = latest_kv, latest_index
            mode = FULL if i in kv_sources else (REINDEX if i in index_sources else REUSE)
        layers.append(LayerSpec(
            index=i,
            stack="encoder" if i < decoder_start else "decoder",
            ratio=ratio,
            mode=mode,
            kv_source=kv_src,
            index_source=idx_src,
            candidate_source=(i == cand),
            uses_candidates=(mode in (FULL, REINDEX) and 0 <= cand < i),
            engram_slot=config.engram_layer_ids.index(i) if i in config.engram_layer_ids else None,
        ))
    return LayerPlan(tuple(layers), decoder_start)
