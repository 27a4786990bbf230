"""Writes notebooks/mhc.ipynb (executed, with its figures) from the cells below: ``python notebooks/make_mhc.py``.
tests/test_notebooks.py executes the same cells and checks the coefficients' ranges, the mixing matrices' sums and
the streams' drift."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _nbgen  # noqa: E402

CELLS = [
    ("markdown", """# The residual streams: single-pass mHC on a real prompt

DeepSeek-V4.1 keeps **4 residual streams** per token instead of one (SPEC §3). The embedding is copied into all four;
each attention site and each FFN site then computes, from the flattened streams entering it, three sets of
coefficients (`ops.mhc.mhc_coefficients`):

* `pre` (4 values in (0, 1)): how much each stream contributes to the site's input (`collapse`);
* `post` (4 values in (0, 2)): how much of the site's output is written into each stream;
* `comb` (4 × 4): how the streams are mixed among themselves (`expand`: out[j] = post[j]·y + Σᵢ comb[i, j]·X[i]),
  a softmax made (nearly) doubly stochastic by 20 Sinkhorn normalisations that end on the columns.

**Single pass** (V4.1): a site collapses its input with the `pre` computed at the *previous* site — the first
attention site with stream 0 alone — so each site computes its coefficients once, from the streams it receives.
This notebook reads every site's coefficients from the forward itself (`forward(..., return_mhc=True)`) for the
embedded default model on a piece of this package's source, and follows the streams through the layers
(`return_hidden=True`). `DSV41_NOTEBOOK_SCALE=4` uses a 4× longer prompt."""),
    ("code", """import inspect
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import dsv41_jax
from dsv41_jax.model.forward import embed_tokens
from dsv41_jax.model.model import default_hasher

SCALE = int(os.environ.get("DSV41_NOTEBOOK_SCALE", "1"))
config, params, tokenizer = dsv41_jax.default_model()
hasher = default_hasher(config, tokenizer)
text = inspect.getsource(dsv41_jax.forward)[: 128 * SCALE - 1]
tokens = np.asarray([tokenizer.encode(text, add_bos=True)[: 128 * SCALE]])
T, HC, L = tokens.shape[1], config.hc_mult, config.num_hidden_layers


@jax.jit
def run(params, tokens, ids):
    return dsv41_jax.forward(params, tokens, config=config, engram_ids=ids, return_hidden=True, return_mhc=True)


logits, aux = run(params, tokens, hasher.row_ids(tokens))
SITES = [(layer, site) for layer in range(L) for site in ("attn", "ffn")]
pre = np.stack([np.asarray(aux["mhc"][l][s][0])[0] for l, s in SITES])  # [sites, T, 4]
post = np.stack([np.asarray(aux["mhc"][l][s][1])[0] for l, s in SITES])  # [sites, T, 4]
comb = np.stack([np.asarray(aux["mhc"][l][s][2])[0] for l, s in SITES])  # [sites, T, 4 in, 4 out]
print(f"{T} tokens, {L} layers x 2 sites, {HC} streams of width {config.hidden_size}; "
      f"pre in [{pre.min():.4f}, {pre.max():.4f}], post in [{post.min():.4f}, {post.max():.4f}]")"""),
    ("markdown", """## The mixing matrices

Each token gets its own `comb` at each site. Averaged over the prompt's tokens, for the first, a middle and the
last layer: row i is what stream i sends out, column j what stream j receives. The Sinkhorn loop ends on a column
normalisation, so every column sums to 1 (each output stream is a convex mixture of the inputs, up to `hc_eps`);
after 20 iterations the row sums are close to 1 but not exactly."""),
    ("code", """show = [0, L // 2, L - 1]
fig, axes = plt.subplots(2, len(show), figsize=(3.2 * len(show), 6))
for col, layer in enumerate(show):
    for row, site in enumerate(("attn", "ffn")):
        m = comb[SITES.index((layer, site))].mean(axis=0)
        ax = axes[row, col]
        im = ax.imshow(m, vmin=0, vmax=1, cmap="viridis")
        for i in range(HC):
            for j in range(HC):
                ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", color="w" if m[i, j] < 0.5 else "k",
                        fontsize=8)
        ax.set_title(f"layer {layer} {site}"), ax.set_xlabel("to stream j")
        if col == 0:
            ax.set_ylabel("from stream i")
fig.colorbar(im, ax=axes, shrink=0.6)
plt.show()
col_err = np.abs(comb.sum(axis=-2) - 1).max()
row_err = np.abs(comb.sum(axis=-1) - 1).max()
diag = np.einsum("stii->st", comb).mean(axis=1) / HC
print(f"over every token and site: column sums within {col_err:.1e} of 1, row sums within {row_err:.3f}; "
      f"the mean diagonal entry (a stream keeping itself) per site ranges {diag.min():.2f}-{diag.max():.2f}")"""),
    ("markdown", """## What each site reads and writes

`pre` (left) weights the streams a site reads — through the single pass, the *next* site reads with it — and
`post` (right) how strongly the site's output lands in each stream; mean over the tokens, one line per stream,
sites in order (attention, FFN, attention, ...)."""),
    ("code", """fig, axes = plt.subplots(1, 2, figsize=(11, 3.4), sharex=True)
x = np.arange(len(SITES))
for s in range(HC):
    axes[0].plot(x, pre[:, :, s].mean(axis=1), "o-", markersize=3, label=f"stream {s}")
    axes[1].plot(x, post[:, :, s].mean(axis=1), "o-", markersize=3, label=f"stream {s}")
axes[0].set_title("pre: read weight (used by the next site)"), axes[1].set_title("post: write weight")
for ax in axes:
    ax.set_xticks(x[::2], [f"L{l}" for l in range(L)]), ax.set_xlabel("layer (attention site; FFN site after it)")
axes[0].legend(fontsize=7)
fig.tight_layout()
plt.show()
# the single pass: the input each site collapses with is the previous site's pre (the first: stream 0)
reads = np.concatenate([np.eye(HC)[None, :1].repeat(T, 1), pre[:-1]])  # [sites, T, 4]
print("collapse weights of the first three sites (token 0):", *(np.round(reads[i, 0], 3) for i in range(3)))"""),
    ("markdown", """## The streams drift apart

All four streams start as copies of the embedding. Per layer (after it): each stream's RMS and the mean cosine
similarity between the streams of a token — how far the network uses the extra width."""),
    ("code", """hidden = np.asarray(aux["hidden"])[:, 0]  # [L, T, 4, d] streams after each layer
emb = np.asarray(embed_tokens(params["embed"], jnp.asarray(tokens)))[0]
states = np.concatenate([np.broadcast_to(emb[None, :, None], (1, T, HC, emb.shape[-1])), hidden])
rms = np.sqrt((states ** 2).mean(axis=-1)).mean(axis=1)  # [L + 1, 4]
unit = states / np.linalg.norm(states, axis=-1, keepdims=True)
cos = np.einsum("ltid,ltjd->ltij", unit, unit)
pair = cos[:, :, ~np.eye(HC, dtype=bool)].mean(axis=(1, 2))  # [L + 1]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
for s in range(HC):
    axes[0].plot(range(L + 1), rms[:, s], "o-", markersize=3, label=f"stream {s}")
axes[0].set_title("RMS of each stream"), axes[0].legend(fontsize=7)
axes[1].plot(range(L + 1), pair, "o-", markersize=3)
axes[1].set_title("mean cosine similarity between a token's streams"), axes[1].set_ylim(-0.05, 1.05)
for ax in axes:
    ax.set_xlabel("after layer (0 = the embedding)")
fig.tight_layout()
plt.show()
print(f"cosine similarity between streams: {pair[0]:.3f} at the embedding, {pair[1]:.3f} after layer 0, "
      f"{pair[-1]:.3f} after the last layer")"""),
]


def build() -> dict:
    return _nbgen.build(CELLS)


if __name__ == "__main__":
    _nbgen.write(CELLS, "mhc.ipynb")
