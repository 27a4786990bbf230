"""Writes notebooks/engram.ipynb (executed, with its figures) from the cells below: ``python notebooks/make_engram.py``.
tests/test_notebooks.py executes the same cells and checks the hashing, the gates and the ablation."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _nbgen  # noqa: E402

CELLS = [
    ("markdown", """# Engram on a real prompt: what is hashed, how much is let in, what it changes

Engram (SPEC §7) adds a memory lookup before the attention site of some layers (the default model: layers 1 and 3).
For every token the host hashes the suffix n-grams (orders 2–4) of *compressed* token ids (case and whitespace
variants merged) into rows of a big table, several heads per order with different primes; the device reads those
rows, projects them to one key per residual stream and one shared value, and adds `gate · value` to each of the 4
mHC streams with a per-stream gate in (0, 1). This notebook shows the n-grams and rows for a real prompt, the gates
per token and stream, and which predictions change when the memory is removed (its tables zeroed, which makes the
Engram write exactly zero). `DSV41_NOTEBOOK_SCALE=4` uses a 4× longer prompt."""),
    ("code", """import inspect
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import dsv41_jax
from dsv41_jax.model.model import default_hasher
from dsv41_jax.ops.engram import engram_gates, engram_write

SCALE = int(os.environ.get("DSV41_NOTEBOOK_SCALE", "1"))
config, params, tokenizer = dsv41_jax.default_model()
hasher = default_hasher(config, tokenizer)
text = inspect.getsource(dsv41_jax.default_model)[: 192 * SCALE - 1]
tokens = np.asarray([tokenizer.encode(text, add_bos=True)[: 192 * SCALE]])
T = tokens.shape[1]
row_ids = hasher.row_ids(tokens)  # [1, T, Engram layers, (orders) × heads] int32, computed on the host
compressed = hasher.token_map[tokens[0]]
print(f"{T} tokens, Engram layers {config.engram_layer_ids}, {row_ids.shape[-1]} rows per token and layer "
      f"({config.engram_max_ngram_size - 1} orders × {config.engram_n_heads} heads), compressed vocabulary "
      f"{config.engram_compressed_vocab_size} of {config.vocab_size} ids")"""),
    ("markdown", """## The n-grams hashed

For the last tokens of the prompt: the suffix n-grams that end at each token (as text; ∅ = before the start, read as
the pad id) and, for the first Engram layer, the table row each (order, head) reads. Identical compressed n-grams
read identical rows wherever they occur — the memory is keyed by local context only."""),
    ("code", """def piece(ids):
    return "".join("∅" if i < 0 else tokenizer.decode([int(i)]) for i in ids)


H = config.engram_n_heads
ORDERS = range(2, config.engram_max_ngram_size + 1)
print(f"{'t':>4} {'token':>6} " + " ".join(f"{f'{n}-gram':>8}" for n in ORDERS) + "   rows of layer "
      f"{config.engram_layer_ids[0]} (order-major, {H} heads each)")
for t in range(T - 10, T):
    grams = [repr(piece([tokens[0, t - j] if t - j >= 0 else -1 for j in range(n - 1, -1, -1)])) for n in ORDERS]
    print(f"{t:>4} {tokenizer.decode([int(tokens[0, t])])!r:>6} " + " ".join(f"{g:>8}" for g in grams) + "   "
          + " ".join(str(r) for r in row_ids[0, t, 0]))

# the same compressed bigram anywhere in the prompt reads the same order-2 rows
bigram = {}
for t in range(1, T):
    bigram.setdefault((compressed[t - 1], compressed[t]), set()).add(tuple(row_ids[0, t, 0, :H]))
repeats = {k: v for k, v in bigram.items() if len(v) == 1}
print(f"{len(bigram)} distinct compressed bigrams; every one reads a single set of order-2 rows: "
      f"{len(repeats) == len(bigram)}")"""),
    ("markdown", """## The gate per token and stream

The gates come from `ops.engram.engram_gates` — the function `engram_write` (the forward's Engram step) calls —
applied to the residual streams that enter each Engram layer (`forward(..., return_hidden=True)`)."""),
    ("code", """@jax.jit
def run(params, tokens, ids):
    logits, aux = dsv41_jax.forward(params, tokens, config=config, engram_ids=ids, return_hidden=True)
    gates, values = {}, {}
    for slot, layer in enumerate(config.engram_layer_ids):
        streams_in = aux["hidden"][layer - 1]  # the streams after layer - 1 enter layer's Engram
        gates[layer], values[layer] = engram_gates(streams_in, ids[:, :, slot], params["layers"][layer]["engram"],
                                                   eps=config.rms_norm_eps)
    return logits, gates, values, aux["hidden"]


logits, gates, values, hidden = run(params, tokens, row_ids)
for layer in config.engram_layer_ids:
    g = np.asarray(gates[layer][0])
    print(f"layer {layer}: gate mean per stream {' '.join(f'{x:.3f}' for x in g.mean(0))}, min {g.min():.3f}, "
          f"max {g.max():.3f}; |value| mean {float(jnp.abs(values[layer]).mean()):.3f}")

SHOW = min(T, 96)
labels = [repr(tokenizer.decode([int(i)]))[1:-1] or "·" for i in tokens[0, T - SHOW:]]
fig, axes = plt.subplots(len(config.engram_layer_ids), 1, figsize=(16, 1.2 + 1.6 * len(config.engram_layer_ids)),
                         constrained_layout=True)
for ax, layer in zip(np.atleast_1d(axes), config.engram_layer_ids):
    im = ax.imshow(np.asarray(gates[layer][0, T - SHOW:]).T, aspect="auto", cmap="magma", vmin=0, vmax=1)
    ax.set_yticks(range(config.hc_mult), [f"stream {s}" for s in range(config.hc_mult)], fontsize=7)
    ax.set_xticks(range(SHOW), labels, fontsize=6, rotation=90)
    ax.set_title(f"Engram gate, layer {layer} (last {SHOW} tokens)", fontsize=9)
fig.colorbar(im, ax=axes, fraction=0.02)
plt.show()"""),
    ("markdown", """## What the memory changes

Ablation: the same forward with the Engram tables zeroed (all Engram layers, then each alone). A zero row gives a zero
value, so the write is exactly zero and everything else is unchanged. Per position: the change in log-probability of
the actual next token, and the KL divergence of the next-token distribution."""),
    ("code", """def ablate(params, layers):
    out = jax.tree.map(lambda x: x, params)
    for layer in layers:
        out["layers"][layer]["engram"] = dict(out["layers"][layer]["engram"],
                                              embed=jnp.zeros_like(params["layers"][layer]["engram"]["embed"]))
    return out


def next_token_stats(lg):
    logp = jax.nn.log_softmax(lg[0, :-1])
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(tokens[0, 1:, None]), -1)[:, 0]), logp


lp_full, logp_full = next_token_stats(logits)
nll = {"with Engram": -lp_full.mean()}
delta, kl = {}, {}
for name, layers in [("all", config.engram_layer_ids)] + [(f"layer {l}", [l]) for l in config.engram_layer_ids]:
    lg, *_ = run(ablate(params, layers), tokens, row_ids)
    lp, logp = next_token_stats(lg)
    nll[f"without Engram ({name})"] = -lp.mean()
    delta[name] = lp_full - lp
    kl[name] = np.asarray(jnp.sum(jnp.exp(logp_full) * (logp_full - logp), -1))
for k, v in nll.items():
    print(f"{k:>28}: {v:.4f} nats/token")

order = np.argsort(-np.abs(delta["all"]))[:10]
print("\\npositions where Engram changes the next-token log-probability most (context | next token):")
for t in order:
    ctx = tokenizer.decode([int(i) for i in tokens[0, max(1, t - 15): t + 1]])
    print(f"  t={t:4d}  Δ log p = {delta['all'][t]:+.3f}  KL = {kl['all'][t]:.3f}   {ctx!r} | "
          f"{tokenizer.decode([int(tokens[0, t + 1])])!r}")

fig, axes = plt.subplots(2, 1, figsize=(14, 5), sharex=True)
for name in delta:
    axes[0].plot(delta[name], lw=0.9, label=f"ablate {name}")
    axes[1].plot(kl[name], lw=0.9, label=f"ablate {name}")
axes[0].axhline(0, color="0.5", lw=0.5)
axes[0].set_ylabel("Δ log p(next)\\n(with − without)"), axes[1].set_ylabel("KL(with ‖ without)")
axes[1].set_xlabel("position t (predicting token t + 1)"), axes[0].legend(fontsize=8)
fig.tight_layout()
plt.show()"""),
]


def build() -> dict:
    return _nbgen.build(CELLS)


if __name__ == "__main__":
    _nbgen.write(CELLS, "engram.ipynb")
