"""Writes notebooks/layer_plan.ipynb (executed, with its figures) from the cells below:
``python notebooks/make_layer_plan.py``. tests/test_notebooks.py executes the same cells and checks the release's
facts (SPEC §1–§2, §10)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _nbgen  # noqa: E402

CELLS = [
    ("markdown", """# The layer plan of DeepSeek-V4.1-Flash, from its config

What every one of the 40 layers does (role, where its KV and its top-k come from, the HSI candidate source, Engram,
encoder / decoder), what each layer costs in parameters and active parameters, what the KV cache costs per token in
each storage format, and how much compute CED prefill saves against running every layer over the whole prompt.
Nothing here is typed in: the plan is `config.plan` (derived from `compress_ratios`, `kv_source_layer_ids`,
`index_source_layer_ids`, `candidate_source_layer_id`, `engram_layer_ids`), the counts come from the abstract
parameter shapes (`dsv41_jax.model.counting`) and the cache from `dsv41_jax.inference.cache.cache_footprint`. No
parameter is allocated; the whole notebook runs in seconds on a CPU."""),
    ("code", """import matplotlib.pyplot as plt
import numpy as np

import dsv41_jax
from dsv41_jax.inference.cache import cache_footprint
from dsv41_jax.model.counting import COMPONENTS, count_params, per_layer_params, prefill_flops

flash = dsv41_jax.load_config("flash")
plan = flash.plan
print(plan.table())"""),
    ("markdown", """## The unrolled plan

Boxes are layers coloured by CSA2 mode; arcs above join each CSA2 layer to the layer whose top-k it uses, arcs below
to the KV source whose compressed entries (and indexer keys) it reads. ★ marks the HSI candidate source, **E** the
Engram layers; the shading splits the causal encoder from the decoder (CED)."""),
    ("code", """COLORS = {"swa": "0.75", "full": "tab:blue", "reuse": "lightsteelblue", "reindex": "tab:orange"}
fig, ax = plt.subplots(figsize=(15, 4.2))
ax.axvspan(-0.6, plan.decoder_start - 0.5, color="tab:green", alpha=0.06)
ax.axvspan(plan.decoder_start - 0.5, len(plan) - 0.4, color="tab:purple", alpha=0.06)
ax.text(plan.decoder_start / 2, 2.25, f"encoder: layers 0–{plan.decoder_start - 1} (every prompt token)",
        ha="center", fontsize=9)
ax.text((plan.decoder_start + len(plan)) / 2, 2.25,
        f"decoder: layers {plan.decoder_start}–{len(plan) - 1} (CED: the last {flash.sliding_window} prompt tokens)",
        ha="center", fontsize=9)
for spec in plan:
    i = spec.index
    ax.add_patch(plt.Rectangle((i - 0.42, -0.3), 0.84, 0.6, color=COLORS[spec.mode]))
    ax.text(i, 0, str(spec.ratio) if spec.ratio else "", ha="center", va="center", fontsize=7)
    if spec.candidate_source:
        ax.plot(i, 0.55, "*", color="crimson", markersize=13)
    if spec.engram_slot is not None:
        ax.text(i, -0.6, "E", ha="center", va="center", color="tab:green", fontweight="bold")
    for src, sign, color in ((spec.index_source, 1, "tab:orange"), (spec.kv_source, -1, "tab:blue")):
        if src is not None and src != i:
            xs = np.linspace(src, i, 30)
            h = 0.3 + 0.06 * (i - src)
            ax.plot(xs, sign * (0.3 + h * np.sin(np.pi * (xs - src) / (i - src))), color=color, lw=0.7, alpha=0.7)
for mode, color in COLORS.items():
    ax.add_patch(plt.Rectangle((0, 0), 0, 0, color=color, label=mode))
ax.plot([], [], color="tab:orange", label="top-k from (above)"), ax.plot([], [], color="tab:blue", label="KV from (below)")
ax.plot([], [], "*", color="crimson", label="HSI candidate source")
ax.set_xlim(-0.8, len(plan) - 0.2), ax.set_ylim(-2.5, 2.5), ax.set_yticks([])
ax.set_xticks(range(len(plan))), ax.tick_params(labelsize=7)
ax.set_xlabel("layer (box label: compress ratio)"), ax.legend(ncol=7, fontsize=8, loc="lower center")
fig.tight_layout()
plt.show()"""),
    ("markdown", """## Parameters per layer

All parameters, and those one token touches (routed experts × 6 / 384; one row per Engram hash column, 24 × 256 of
each Engram table). Engram's tables dominate the two Engram layers' storage, the routed experts every layer's."""),
    ("code", """counts = count_params(flash)
layers = per_layer_params(flash)
print(counts.table())
head_and_embedding = 2 * flash.vocab_size * flash.hidden_size + flash.hidden_size
assert sum(n for layer in layers for n, _ in layer.values()) + head_and_embedding == counts.backbone + counts.engram
assert sum(a for layer in layers for _, a in layer.values()) + head_and_embedding - counts.embedding == counts.active_decode

fig, axes = plt.subplots(2, 1, figsize=(14, 6), sharex=True)
for ax, which, title in ((axes[0], 0, "parameters (B)"), (axes[1], 1, "active per token (M)")):
    bottom = np.zeros(len(layers))
    scale = 1e9 if which == 0 else 1e6
    for comp in COMPONENTS:
        vals = np.array([layer[comp][which] for layer in layers]) / scale
        if vals.any():
            ax.bar(range(len(layers)), vals, bottom=bottom, label=comp)
            bottom += vals
    ax.set_ylabel(title)
axes[1].legend(fontsize=8, ncol=4), axes[1].set_xlabel("layer"), axes[1].set_xticks(range(len(layers)))
fig.tight_layout()
plt.show()"""),
    ("markdown", """## KV cache bytes per token

Per context token, each KV source stores one compressed entry per `ratio` tokens: the 512-d main entry and the
128-d indexer key. `release` is the released storage (FP4 e2m1 entries with an e4m3 scale per 16, FP4 keys with a
ue8m0 scale per 32); the sliding-window rings are a fixed cost per sequence, not per token."""),
    ("code", """STORAGES = ("float32", "bfloat16", "release")
foot = {s: cache_footprint(flash, s) for s in STORAGES}
for s in STORAGES:
    print(foot[s].describe())
fig, ax = plt.subplots(figsize=(8, 3.4))
for j, s in enumerate(STORAGES):
    left = 0.0
    for k, (layer, (m, main, keys)) in enumerate(foot[s].per_source.items()):
        for part, b, alpha in (("entry", main / m, 0.9), ("indexer key", keys / m, 0.45)):
            ax.barh(j, b, left=left, color=plt.cm.tab10(k), alpha=alpha,
                    label=f"L{layer} (ratio {m}) {part}" if j == 0 else None)
            left += b
    ax.text(left, j, f" {left:,.0f} B/token", va="center", fontsize=9)
ax.set_yticks(range(len(STORAGES)), STORAGES), ax.set_xlabel("bytes per context token")
ax.set_xlim(0, 1.2 * foot["float32"].per_token), ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
fig.tight_layout()
plt.show()"""),
    ("markdown", """## CED prefill against full replay

`dsv41_jax.model.counting.prefill_flops` counts from the config (its docstring says exactly what): weight matmuls
(2 × active matrix parameters per token and layer), attention (4 · heads · head_dim per key read: the window plus the
top-k entries) and the indexers (every visible entry for Full layers, at most the 16,384-entry HSI pool for Reindex).
CED runs the encoder over the prompt, layer 20's compressor and indexer keys over the prompt, and the decoder over the
last 128 tokens; full replay runs all 40 layers over every token. The count is of arithmetic, not of time."""),
    ("code", """lengths = [2 ** i for i in range(6, 21)]
ced = [prefill_flops(flash, t) for t in lengths]
full = [prefill_flops(flash, t, ced=False) for t in lengths]
for t, a, b in zip(lengths, ced, full):
    if t in (64, 128, 1024, 32768, 1048576):
        print(f"{t:>8} tokens: CED {a['total'] / t / 1e9:6.2f} GFLOP/token, full replay {b['total'] / t / 1e9:6.2f} "
              f"GFLOP/token, ratio {a['total'] / b['total']:.3f}  (indexer share of CED: {a['indexer'] / a['total']:.1%})")
fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
for name, rows, style in (("CED", ced, "-"), ("full replay", full, "--")):
    for part, color in (("total", "k"), ("weights", "tab:blue"), ("attention", "tab:orange"), ("indexer", "tab:green")):
        axes[0].plot(lengths, [r[part] / t for r, t in zip(rows, lengths)], style, color=color,
                     label=f"{name}: {part}")
axes[0].set_xscale("log", base=2), axes[0].set_yscale("log"), axes[0].set_xlabel("prompt tokens")
axes[0].set_ylabel("FLOPs per prompt token"), axes[0].legend(fontsize=7, ncol=2)
axes[1].plot(lengths, [a["total"] / b["total"] for a, b in zip(ced, full)], "o-")
axes[1].set_xscale("log", base=2), axes[1].set_ylim(0, 1.05), axes[1].set_xlabel("prompt tokens")
axes[1].set_ylabel("CED / full replay FLOPs")
fig.tight_layout()
plt.show()"""),
]


def build() -> dict:
    return _nbgen.build(CELLS)


if __name__ == "__main__":
    _nbgen.write(CELLS, "layer_plan.ipynb")
