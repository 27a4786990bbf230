"""Writes notebooks/selection_atlas.ipynb (executed, with its figures) from the cells below:
``python notebooks/make_selection_atlas.py``. tests/test_notebooks.py executes the same cells and checks the
selections against the rules of SPEC §5."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _nbgen  # noqa: E402

CELLS = [
    ("markdown", """# The selection atlas: which compressed entries each CSA2 layer reads

Every CSA2 layer attends to its sliding window plus `index_topk` compressed entries. **Full** layers pick them with
their own indexer, **Reuse** layers inherit the picks of the latest index source, **Reindex** layers run their own
indexer but only inside the **HSI** pool of blocks that the candidate source kept. This notebook rebuilds the
publication's toy with the real code, then looks at the embedded default model on a real prompt: per-layer selection
maps, how much a Reuse layer loses by inheriting, and how HSI recall falls as the pool shrinks.

Everything is computed by `dsv41_jax.forward` and `dsv41_jax.analysis` (which re-applies `ops.indexer` /
`ops.compressor` / `ops.attention` to the per-layer inputs the forward returns, and is checked to reproduce the
forward's selections). Set `DSV41_NOTEBOOK_SCALE=4` for a 4× longer prompt."""),
    ("code", """import inspect
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import dsv41_jax
from dsv41_jax import analysis
from dsv41_jax.model.model import default_hasher
from dsv41_jax.ops.indexer import restrict_to_pool, select_topk

SCALE = int(os.environ.get("DSV41_NOTEBOOK_SCALE", "1"))  # 1: the sizes CI runs; larger: longer prompts"""),
    ("markdown", """## 1. The toy, from a real config

The publication's toy: 16 tokens, the query at position 15, top-3 instead of 512, a 4-token window instead of 128,
HSI blocks of 2 entries instead of 8 and a 4-block pool instead of 2,048. We build it as a real `ModelConfig` (the
`tiny` test config with those sizes and a five-layer plan that has every mode), random weights, and run the forward.
Layers 0–1 are the ratio-2 encoder (one entry per 2 tokens), layers 2–4 the ratio-1 decoder (one entry per token):
2 is Full and the HSI candidate source, 3 Reuse, 4 Reindex."""),
    ("code", """toy = dsv41_jax.load_config("tiny").replace(
    name="toy", num_hidden_layers=5, compress_ratios=[2, 2, 1, 1, 1], kv_source_layer_ids=[0, 2],
    index_source_layer_ids=[0, 2, 4], candidate_source_layer_id=2, engram_layer_ids=[], engram_num_embeddings=[],
    dspark_target_layer_ids=[2, 3, 4],
    sliding_window=4, index_topk=3, candidate_block_size=2, candidate_topk_blocks=4)
print(toy.plan.table())

toy_params = jax.jit(lambda key: dsv41_jax.init_params(toy, key))(jax.random.key(0, impl="rbg"))  # rbg: quick to compile
toy_tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 16), 3, toy.vocab_size)


QUERY, FULL, REUSE, REINDEX = 15, 2, 3, 4


@jax.jit
def toy_pass(params, tokens):
    _, aux = dsv41_jax.forward(params, tokens, config=toy, return_topk=True, return_site_inputs=True)
    sel = analysis.selections(params, toy, aux["site_inputs"])
    # what the attention of each layer really reads for the query: the keys its output depends on (by differentiation)
    read = {l: analysis.attended(params, toy, aux["site_inputs"], l, sel[l]["topk"], QUERY) for l in (FULL, REUSE, REINDEX)}
    return aux, sel, read


toy_aux, toy_sel, toy_read = toy_pass(toy_params, toy_tokens)
for layer, topk in toy_aux["topk"].items():  # the re-derived selections are the forward's own
    assert np.array_equal(np.asarray(topk), np.asarray(toy_sel[layer]["topk"])), layer
for l in (FULL, REUSE, REINDEX):
    window, entries = (np.flatnonzero(np.asarray(a)).tolist() for a in toy_read[l])
    print(f"layer {l} ({toy.plan[l].mode:7s}): window tokens {window}, compressed entries {entries}")"""),
    ("code", """def draw_toy_row(ax, layer, title):
    spec, sel = toy.plan[layer], toy_sel[layer]
    n = 16 // spec.ratio
    picked = set(np.asarray(sel["topk"][0, QUERY]).tolist()) - {-1}
    window, entries = (np.asarray(a) for a in toy_read[layer])
    scores = None if sel["scores"] is None else np.asarray(sel["scores"][0, QUERY])
    pool = None if sel["pool"] is None else np.asarray(sel["pool"][0, QUERY])
    finite = np.isfinite(scores) if scores is not None else None
    lo, hi = (scores[finite].min(), scores[finite].max()) if scores is not None else (0, 1)
    for s in range(n):
        if scores is not None and finite[s]:
            color = plt.cm.Blues(0.15 + 0.7 * (scores[s] - lo) / max(hi - lo, 1e-12))
        else:
            color = "0.85"
        hatch = "//" if pool is not None and not pool[s // toy.candidate_block_size] else None
        ax.add_patch(plt.Rectangle((s, 0), 0.95, 0.95, facecolor=color, hatch=hatch, edgecolor="0.5"))
        if s in picked:
            ax.add_patch(plt.Rectangle((s, 0), 0.95, 0.95, fill=False, edgecolor="crimson", linewidth=3))
            ax.text(s + 0.47, 0.45, "top-k", ha="center", va="center", fontsize=7, color="crimson")
    if pool is not None:
        for b in np.flatnonzero(pool):
            w = toy.candidate_block_size
            ax.add_patch(plt.Rectangle((b * w - 0.05, -0.08), w, 1.11, fill=False, edgecolor="tab:green",
                                       linewidth=2, linestyle="--"))
    for t in np.flatnonzero(window):  # window keys are tokens: drawn under the entries that cover them
        ax.add_patch(plt.Rectangle((t / spec.ratio, -0.45), 0.95 / spec.ratio, 0.3, facecolor="tab:orange"))
    ax.set_xlim(-0.3, 16.2), ax.set_ylim(-0.6, 1.1), ax.set_yticks([])
    ax.set_xticks(np.arange(n) + 0.47), ax.set_xticklabels(range(n), fontsize=8)
    ax.set_title(title, fontsize=10, loc="left")


fig, axes = plt.subplots(3, 1, figsize=(10, 5.4))
draw_toy_row(axes[0], FULL, "Full (layer 2): its own indexer over every visible entry; it also publishes the HSI pool")
draw_toy_row(axes[1], REUSE, "Reuse (layer 3): no indexer, the same entries as layer 2")
draw_toy_row(axes[2], REINDEX, "Reindex (layer 4): its own indexer, only inside the pool (dashed green; hatched = outside)")
axes[2].set_xlabel("compressed entry = token (ratio 1)")
fig.suptitle("Query at position 15: blue = indexer score, red = top-3, orange = the 4-token window, green = HSI pool",
             fontsize=10)
fig.tight_layout()
plt.show()"""),
    ("markdown", """Every query, not only 15: the entries each layer reads (dark), the entries it could see but did not pick (light),
and those it may not see yet (white: entry *s* covers tokens *s·m … s·m+m−1* and is visible to query *t* iff
*s < (t+1)//m*, so the ratio-2 layers see a coarser, later-arriving set)."""),
    ("code", """fig, axes = plt.subplots(1, 5, figsize=(14, 3.2))
for layer, ax in zip(range(5), axes):
    spec = toy.plan[layer]
    n = 16 // spec.ratio
    img = np.zeros((16, n))
    for t in range(16):
        img[t, : (t + 1) // spec.ratio] = 0.25
        for s in np.asarray(toy_sel[layer]["topk"][0, t]):
            if s >= 0:
                img[t, s] = 1.0
    ax.imshow(img, cmap="Greys", vmin=0, vmax=1, aspect="auto")
    ax.set_title(f"layer {layer}: {spec.mode}, ratio {spec.ratio}", fontsize=9)
    ax.set_xlabel("entry"), ax.set_ylabel("query t" if layer == 0 else "")
fig.tight_layout()
plt.show()"""),
    ("markdown", """## 2. The default model on a real prompt

The embedded default model (8 layers: 2 ratio-2 Full, 3–4 Reuse, 5 ratio-1 Full and HSI candidate source, 6 Reindex,
7 Reuse; top-32, HSI 8 blocks of 8) reads the source of `dsv41_jax/plan.py`. One jitted function runs the forward,
re-derives every selection, the attention mass of every CSA2 layer (below) and the HSI pools of several sizes."""),
    ("code", """config, params, tokenizer = dsv41_jax.default_model()
hasher = default_hasher(config, tokenizer)
text = inspect.getsource(dsv41_jax.plan)[: 256 * SCALE - 1]
tokens = np.asarray([tokenizer.encode(text, add_bos=True)])
T, K = tokens.shape[1], config.index_topk
CAND = config.candidate_source_layer_id
REINDEX_LAYERS = [s.index for s in config.plan if s.mode == "reindex"]
CSA2 = [s.index for s in config.plan if s.ratio > 0]
n_blocks = -(-T // (config.plan[CAND].ratio * config.candidate_block_size))
POOL_SIZES = sorted({2 ** i for i in range(n_blocks.bit_length()) if 2 ** i < n_blocks} | {n_blocks,
                    config.candidate_topk_blocks})


@jax.jit
def atlas(params, tokens, engram_ids):
    _, aux = dsv41_jax.forward(params, tokens, config=config, engram_ids=engram_ids, return_topk=True,
                               return_site_inputs=True)
    sel = analysis.selections(params, config, aux["site_inputs"])
    mass = {l: analysis.attention_mass(params, config, aux["site_inputs"], l) for l in CSA2}
    pools = {n: analysis.hsi_pool(sel[CAND]["scores"], config, topk_blocks=n) for n in POOL_SIZES}
    return aux["topk"], sel, mass, pools


fwd_topk, sel, mass, pools = jax.tree.map(np.asarray, atlas(params, tokens, hasher.row_ids(tokens)))
for layer, topk in fwd_topk.items():
    assert np.array_equal(topk, sel[layer]["topk"]), layer
print(f"{T} tokens; CSA2 layers {CSA2}; HSI pool sizes studied (blocks): {POOL_SIZES}")"""),
    ("markdown", """### Per-layer selection maps

Row *t* is query *t*, column *s* compressed entry *s*; black = read by the layer, grey = visible but not picked.
Reuse layers show their source's map, by construction; the window (the last 128 tokens) is read in addition."""),
    ("code", """fig, axes = plt.subplots(1, len(CSA2), figsize=(3 * len(CSA2), 3.4))
for layer, ax in zip(CSA2, axes):
    spec = config.plan[layer]
    img = np.zeros((T, T // spec.ratio))
    for t in range(T):
        img[t, : (t + 1) // spec.ratio] = 0.2
        picks = sel[layer]["topk"][0, t]
        img[t, picks[picks >= 0]] = 1.0
    ax.imshow(img, cmap="Greys", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    src = "" if spec.index_source == layer else f" ← {spec.index_source}"
    ax.set_title(f"L{layer} {spec.mode}{src} (m={spec.ratio})", fontsize=9)
    ax.set_xlabel("entry")
axes[0].set_ylabel("query t")
fig.tight_layout()
plt.show()"""),
    ("markdown", """### How much does Reuse lose?

A Reuse layer has no indexer, so "the top-k its own indexer would pick" needs a definition. We use the one the
indexer is trained towards: the layer's **own attention** — its own queries against every visible compressed entry
of its group, a softmax per head, summed over heads and normalised (the dense target of
`train.loss.indexer_kl_loss`; `analysis.attention_mass`). An indexer fitted to the layer aims at the top-k of that
distribution; for Reuse we call it the layer's *own* top-k. (Scoring a Reuse layer's input with its source's
indexer weights would not be its own: those weights were fitted to the source's attention.)

For every CSA2 layer and every query that sees more than k entries we report the overlap of the entries it reads with
that own top-k, and the share of its own attention mass (restricted to compressed entries) that the read entries
carry, relative to the best possible k. For Full / Reindex layers this measures the indexer itself — the baseline
a Reuse layer is compared with; *chance* is k / visible."""),
    ("code", """def own_topk(layer):
    spec = config.plan[layer]
    visible = np.arange(T // spec.ratio)[None, :] < ((np.arange(T) + 1) // spec.ratio)[:, None]
    return np.asarray(select_topk(jnp.where(visible, mass[layer][0], -jnp.inf)[None], K))[0], visible


reuse_rows = []
for layer in CSA2:
    spec = config.plan[layer]
    own, visible = own_topk(layer)
    n_vis = visible.sum(-1)
    rows = n_vis > K
    used = sel[layer]["topk"][0]
    overlap, captured = [], []
    for t in np.flatnonzero(rows):
        u, o = set(used[t][used[t] >= 0]), set(own[t][own[t] >= 0])
        overlap.append(len(u & o) / K)
        m = mass[layer][0, t]
        captured.append(m[list(u)].sum() / m[list(o)].sum())
    reuse_rows.append((layer, spec.mode, spec.index_source, float(np.mean(overlap)), float(np.mean(captured)),
                       float(np.mean(K / n_vis[rows]))))
print(f"{'layer':>5} {'mode':>8} {'top-k of':>8} {'overlap with own top-k':>23} {'own mass captured':>18} {'chance':>7}")
for layer, mode, src, ov, cap, chance in reuse_rows:
    print(f"{layer:>5} {mode:>8} {src:>8} {ov:>23.3f} {cap:>18.3f} {chance:>7.3f}")

fig, ax = plt.subplots(figsize=(7, 3))
x = np.arange(len(reuse_rows))
ax.bar(x - 0.2, [r[3] for r in reuse_rows], 0.4, label="overlap with own top-k")
ax.bar(x + 0.2, [r[4] for r in reuse_rows], 0.4, label="own attention mass captured")
ax.plot(x, [r[5] for r in reuse_rows], "k_", markersize=20, label="chance overlap (k / visible)")
ax.set_xticks(x, [f"L{r[0]}\\n{r[1]}" + ("" if r[2] == r[0] else f" ←{r[2]}") for r in reuse_rows], fontsize=8)
ax.set_ylim(0, 1.05), ax.legend(fontsize=8, loc="lower right"), ax.set_title("What each CSA2 layer reads vs. its own attention")
fig.tight_layout()
plt.show()"""),
    ("markdown", """### HSI recall as the pool shrinks

The Reindex layer's exact top-k (its own indexer over every visible entry) against its top-k inside HSI pools of
fewer and fewer blocks, built by the candidate source (`analysis.hsi_pool` = `ops.indexer.candidate_blocks`).
Because pools of different sizes are nested, recall = the share of the exact top-k that lies inside the pool. Averaged
over the queries whose visible entries the pool does not cover; the config's pool size is marked."""),
    ("code", """recall = {}
for layer in REINDEX_LAYERS:
    scores = jnp.asarray(sel[layer]["scores"])
    exact = np.asarray(select_topk(scores, K))[0]
    n_vis = (np.arange(T) + 1) // config.plan[layer].ratio
    for n in POOL_SIZES:
        hsi = np.asarray(select_topk(restrict_to_pool(scores, jnp.asarray(pools[n]), config.candidate_block_size), K))[0]
        rows = [t for t in range(T) if n_vis[t] > K]
        rec = [len(set(hsi[t][hsi[t] >= 0]) & set(exact[t][exact[t] >= 0])) / min(K, n_vis[t]) for t in rows]
        partial = [r for t, r in zip(rows, rec) if n_vis[t] > n * config.candidate_block_size]
        recall[layer, n] = (float(np.mean(rec)), float(np.mean(partial)) if partial else float("nan"))
        print(f"layer {layer}: pool {n:3d} blocks ({n * config.candidate_block_size:4d} entries): recall "
              f"{recall[layer, n][0]:.3f} over all queries, {recall[layer, n][1]:.3f} where the pool does not cover "
              f"everything")

fig, ax = plt.subplots(figsize=(6, 3))
for layer in REINDEX_LAYERS:
    ax.plot([n * config.candidate_block_size for n in POOL_SIZES], [recall[layer, n][0] for n in POOL_SIZES], "o-",
            label=f"layer {layer}, all queries with > k visible")
    ax.plot([n * config.candidate_block_size for n in POOL_SIZES], [recall[layer, n][1] for n in POOL_SIZES], "s--",
            label=f"layer {layer}, queries the pool does not cover")
ax.axvline(config.candidate_topk_blocks * config.candidate_block_size, color="0.5", linestyle=":", label="config")
ax.set_xscale("log", base=2), ax.set_ylim(0, 1.05)
ax.set_xlabel("HSI pool size (entries)"), ax.set_ylabel("recall of the exact top-k"), ax.legend(fontsize=8)
fig.tight_layout()
plt.show()"""),
]


def build() -> dict:
    return _nbgen.build(CELLS)


if __name__ == "__main__":
    _nbgen.write(CELLS, "selection_atlas.ipynb")
