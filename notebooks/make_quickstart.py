"""Writes notebooks/quickstart.ipynb from the cells below (the notebook is generated so that its code is plain,
reviewable Python; tests/test_notebooks.py executes these cells)."""

import json
import os

CELLS = [
    ("markdown", """# dsv41_jax quickstart

The embedded default model (a 2.9 M-parameter DeepSeek-V4.1-architecture model trained on the Python standard
library, `dsv41_jax/assets/default_model/TRAINING.md`) on CPU: the layer plan, a forward pass and what the sparse
indexer selected, batched generation with the cached engine, and a few fine-tuning steps with optax."""),
    ("code", """import jax
import jax.numpy as jnp
import numpy as np

import dsv41_jax
from dsv41_jax.model.model import default_hasher

config, params, tokenizer = dsv41_jax.default_model()
print(config.plan.table())"""),
    ("markdown", """## Forward pass and the indexer's choices

`forward` is a pure function. With `return_topk=True` it also returns, for every layer that runs an indexer, the
compressed entries each query attends to besides its sliding window (−1 = empty slot)."""),
    ("code", """text = "import os\\nimport sys\\n\\n\\ndef main(argv):\\n    path = os.path.join(argv[0], 'data')\\n    return path\\n"
tokens = np.asarray([tokenizer.encode(text, add_bos=True)])
hasher = default_hasher(config, tokenizer)  # Engram row ids are hashed on the host
forward = jax.jit(dsv41_jax.forward, static_argnames=("config", "return_topk"))  # one compiled program
logits, aux = forward(params, jnp.asarray(tokens), config=config, engram_ids=hasher.row_ids(tokens), return_topk=True)
logp = jax.nn.log_softmax(logits[0, :-1])
nll = -jnp.take_along_axis(logp, jnp.asarray(tokens[0, 1:, None]), axis=-1).mean()
print(f"{tokens.shape[1]} tokens, {float(nll):.3f} nats/byte on this snippet")
for layer, topk in sorted(aux["topk"].items()):
    picked = np.asarray(topk[0, -1])
    print(f"layer {layer}: the last query attends to compressed entries {picked[picked >= 0].tolist()}")"""),
    ("markdown", """## Generation

`Engine` prefills prompts of different lengths in one batch (CED: the encoder over the prompt, the decoder over
its last 128 tokens) and decodes them together, one jitted step per token."""),
    ("code", """engine = dsv41_jax.Engine(config, params, max_batch=2, max_len=256, tokenizer=tokenizer)
results = engine.generate(["import os\\n", "class Config:\\n    def "], max_new_tokens=48, temperature=0.8,
                          top_p=0.95, seed=0)
for prompt, r in zip(["import os\\n", "class Config:\\n    def "], results):
    print(repr(prompt + r.text), r.finish_reason)
print(engine.footprint().describe())"""),
    ("markdown", """## Fine-tuning

`make_train_step` returns a pure, jitted step over float32 master weights and optax state. A few AdamW steps on
one snippet (every parameter trainable; `TrainConfig(trainable=..., frozen=...)` select by path regexes)."""),
    ("code", """from dsv41_jax.train import TrainConfig, make_train_step

seq, rows = 128, 4  # the shapes of the fine-tuning notebook (one compiled program serves both)
ids = np.asarray(tokenizer.encode(text * 8, add_bos=True)[: rows * seq + 1])
tokens_in, targets = ids[:-1].reshape(rows, seq), ids[1:].reshape(rows, seq)
batch = {"tokens": tokens_in, "targets": targets, "loss_mask": np.ones((rows, seq), np.float32),
         "valid": np.ones((rows, seq), bool), "engram_ids": hasher.row_ids(tokens_in)}
tc = TrainConfig(seq_len=seq, batch_size=rows, steps=5, lr=1e-3, warmup_steps=0, compute_dtype="float32")
step = make_train_step(config, tc)
state = step.init_state(params)
for i in range(5):
    state, metrics = step(state, batch, 1e-3)
    print(i, f"loss {float(metrics['loss']):.4f}")"""),
]


def build() -> dict:
    def cell(kind, src):
        c = {"cell_type": kind, "metadata": {}, "source": src.splitlines(keepends=True)}
        if kind == "code":
            c.update(execution_count=None, outputs=[])
        return c

    return {"cells": [cell(k, s) for k, s in CELLS], "metadata": {"kernelspec": {"display_name": "Python 3",
            "language": "python", "name": "python3"}, "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quickstart.ipynb")
    with open(path, "w") as f:
        json.dump(build(), f, indent=1)
        f.write("\n")
    print("wrote", path)
