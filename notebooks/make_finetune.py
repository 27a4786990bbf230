"""Writes notebooks/finetune.ipynb (executed, with its figures) from the cells below: ``python notebooks/make_finetune.py``.
tests/test_notebooks.py executes the same cells and checks that the loss fell and the checkpoint restores exactly."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _nbgen  # noqa: E402

CELLS = [
    ("markdown", """# Fine-tuning the default model

The embedded default model was trained on the Python standard library. Here we fine-tune **all** of its parameters
(`dsv41_jax.train.train`, the loop behind `dsv41 train`: AdamW on float32 master weights, orbax checkpoints) on a
small corpus it has never seen — this package's own `ops/` sources, JAX code — and look at the loss curve, the
held-out loss, greedy samples before and after, and an orbax checkpoint restored exactly.

LoRA does not exist in dsv41_jax yet; this is full fine-tuning. A subset of parameters can be trained with
`TrainConfig(trainable=(regex, ...), frozen=(regex, ...))` over parameter paths such as `layers/3/attn/wq_a`.
It runs 16 steps at sequence length 128; `DSV41_NOTEBOOK_SCALE=4` trains 4× longer, `0.5` half as long (the test
suite's setting: the steps, run unoptimised there, are most of its time)."""),
    ("code", """import glob
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import dsv41_jax
from dsv41_jax.default_model import DEFAULT_MODEL_DIR
from dsv41_jax.model.model import default_hasher
from dsv41_jax.train import TrainConfig
from dsv41_jax.train.trainer import train

SCALE = float(os.environ.get("DSV41_NOTEBOOK_SCALE", "1"))  # a multiple of the 16 steps; fractions too
config, params, tokenizer = dsv41_jax.default_model()
hasher = default_hasher(config, tokenizer)

package = os.path.dirname(os.path.abspath(dsv41_jax.__file__))
work = tempfile.mkdtemp(prefix="dsv41_finetune_")
corpus = os.path.join(work, "corpus")
os.makedirs(corpus)
for path in sorted(glob.glob(os.path.join(package, "ops", "*.py"))):
    if not path.endswith("__init__.py"):
        shutil.copy(path, corpus)
held_out = open(os.path.join(package, "analysis.py")).read()  # JAX code of the same package, not trained on
print(f"corpus: {len(os.listdir(corpus))} files, {sum(os.path.getsize(os.path.join(corpus, f)) for f in os.listdir(corpus)):,} bytes")"""),
    ("markdown", """## Before

The held-out loss (nats per byte over the first 512 bytes of `dsv41_jax/analysis.py`, as 4 rows of 128), the loss on
16 fixed rows of the training corpus, and greedy samples. One jitted forward over [4, 128] tokens serves both: generation writes each new token into a fixed
128-token buffer (the model is causal, so what lies after a position never changes its logits). The cached
`dsv41_jax.Engine` does this incrementally (see the quickstart); here one compiled program keeps the notebook quick."""),
    ("code", """WIDTH = 128
EVAL = np.asarray(tokenizer.encode(held_out, add_bos=True)[: 4 * WIDTH]).reshape(4, WIDTH)


@jax.jit
def logits_fn(params, tokens, ids):
    return dsv41_jax.forward(params, tokens, config=config, engram_ids=ids)


def eval_nll(params, rows=EVAL):
    logp = jax.nn.log_softmax(logits_fn(params, rows, hasher.row_ids(rows))[:, :-1])
    return float(-jnp.take_along_axis(logp, jnp.asarray(rows[:, 1:, None]), -1).mean())


# the training loss on fixed data: 16 rows of 128 spread evenly over the corpus, 4 at a time (one compiled shape);
# the per-step losses of the curve below are each on another batch, so they move with the batch as much as with
# the training
corpus_ids = tokenizer.encode("".join(open(os.path.join(corpus, f)).read() for f in sorted(os.listdir(corpus))),
                              add_bos=True)
TRAIN = np.asarray([corpus_ids[s: s + WIDTH] for s in np.linspace(0, len(corpus_ids) - WIDTH, 16).astype(int)])


def train_nll(params):
    return float(np.mean([eval_nll(params, TRAIN[i: i + 4]) for i in range(0, len(TRAIN), 4)]))


PROMPTS = ["import jax\\nimport jax.numpy as jnp\\n\\n\\ndef ", "    x = jnp.", "class ", "    return "]


def samples(params, new_tokens=24):
    buf = np.full((len(PROMPTS), WIDTH), config.pad_token_id, np.int64)
    ends = []
    for i, p in enumerate(PROMPTS):
        ids = tokenizer.encode(p, add_bos=True)
        buf[i, : len(ids)] = ids
        ends.append(len(ids))
    for _ in range(new_tokens):
        logits = np.asarray(logits_fn(params, buf, hasher.row_ids(buf)))
        for i, end in enumerate(ends):
            if end < WIDTH:
                buf[i, end] = logits[i, end - 1].argmax()
                ends[i] += 1
    return [tokenizer.decode(buf[i, 1:end].tolist()) for i, end in enumerate(ends)]


nll_before, train_before = eval_nll(params), train_nll(params)
before = samples(params)
print(f"held-out loss before: {nll_before:.4f} nats/byte; on the training corpus: {train_before:.4f}")
for s in before:
    print("---\\n" + s)"""),
    ("markdown", """## Fine-tune

`train` loads the default model as the starting point (`init_from`), streams the corpus in 128-byte rows, logs every
step and writes an orbax checkpoint at the end."""),
    ("code", """steps = max(2, round(16 * SCALE))
tc = TrainConfig(seq_len=128, batch_size=4, steps=steps, lr=1e-3, warmup_steps=2, schedule="cosine",
                 compute_dtype="float32", seed=0)
ckpt_dir = os.path.join(work, "ckpt")
result = train(config, tc, [corpus], tokenizer=tokenizer, glob="*.py", ckpt_dir=ckpt_dir, save_every=steps,
               log_every=1, progress=False, init_from=DEFAULT_MODEL_DIR, async_save=False)
curve = [(s, m["ce"]) for s, m in result.history]
print(f"{result.step} steps; per-batch training loss {curve[0][1]:.4f} -> {curve[-1][1]:.4f} (each step sees "
      "another batch; the loss on fixed rows of the corpus is measured after the restore below)")

fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(*zip(*curve), "o-", markersize=3)
ax.set_xlabel("step"), ax.set_ylabel("training loss (nats/byte)"), ax.set_title("full fine-tuning on dsv41_jax/ops")
fig.tight_layout()
plt.show()"""),
    ("markdown", """## Restore the checkpoint, and after

`dsv41_jax.load_checkpoint` reads the training checkpoint directory (the latest step) back as inference parameters;
they are the trained parameters bit for bit."""),
    ("code", """restored_config, restored = dsv41_jax.load_checkpoint(ckpt_dir)
# placed as the model's parameters are (committed to their device), so the compiled forward is reused
restored = jax.tree.map(lambda r, p: jax.device_put(r, p.sharding), restored, params)
trained = jax.device_get(result.state["params"])
same = jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), trained, restored))
print(f"checkpoint steps {os.listdir(ckpt_dir)}; restored == trained: {same}; config unchanged: "
      f"{restored_config.to_dict() == config.to_dict()}")

nll_after, train_after = eval_nll(restored), train_nll(restored)
after = samples(restored)
print(f"held-out loss: {nll_before:.4f} -> {nll_after:.4f} nats/byte; on the training corpus: "
      f"{train_before:.4f} -> {train_after:.4f}")
for b, a in zip(before, after):
    print(f"--- before ---\\n{b}\\n--- after ---\\n{a}")
shutil.rmtree(work)"""),
]


def build() -> dict:
    return _nbgen.build(CELLS)


if __name__ == "__main__":
    _nbgen.write(CELLS, "finetune.ipynb")
