"""The inference engine on the Pallas kernels vs the plain-JAX reference, on the accelerator at hand.

    python benchmarks/check_engine_kernels.py [--out DIR]

A small model with the full-width plan of the inference benchmark (bench_inference.py ``--smoke`` sizes: 12 layers,
SWA / ratio-2 encoder / ratio-1 decoder with Full, Reindex and Reuse layers, Engram), float32 and bfloat16: CED
prefill of a mixed-length batch (prompts long enough for top-k and the HSI pool to prune), then decode steps.
Reports, per dtype, the largest logit difference between ``kernel_backend="auto"`` (Pallas on a GPU / TPU) and
``"reference"`` and whether greedy tokens agree. Prints a Markdown table and writes ``DIR/check_engine_kernels.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_inference import h200_config, synthetic_hasher  # noqa: E402
from dsv41_jax.inference.cache import init_cache  # noqa: E402
from dsv41_jax.inference.decode import decode_step  # noqa: E402
from dsv41_jax.inference.prefill import prefill  # noqa: E402
from dsv41_jax.inference.step import InferenceOptions  # noqa: E402
from dsv41_jax.kernels import resolve_backend  # noqa: E402
from dsv41_jax.model.params import init_params  # noqa: E402


def small_config():
    return h200_config(engram_vocab=500, hidden_size=256, num_attention_heads=8, head_dim=128, q_lora_rank=128,
                       o_groups=2, o_lora_rank=64, index_n_heads=8, index_head_dim=64, index_topk=64,
                       candidate_topk_blocks=16, num_experts_per_tok=2, moe_intermediate_size=128,
                       qk_rope_head_dim=32, vocab_size=1000, engram_head_dim=32, name="check-engine")


def run(config, params, hasher, backend, dtype, prompts, n_steps, max_len):
    opts = InferenceOptions(quant_sim=False, kernel_backend=backend)
    b = len(prompts)
    width = max(len(p) for p in prompts)
    tokens = np.zeros((b, width), np.int32)
    lengths = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    eids = hasher.row_ids(tokens)
    cache = init_cache(config, b, max_len, dtype)
    last, cache = prefill(params, cache, tokens, lengths, eids, config=config, opts=opts, chunk=512)
    logits = [np.asarray(last, np.float32)]
    hist = hasher.empty_history(b)
    _, hist = hasher.step(tokens[:, -1:], hist)  # history content does not matter for the comparison
    tok = np.argmax(logits[-1], -1).astype(np.int32)
    greedy = [tok]
    for _ in range(n_steps):
        rows, hist = hasher.step(tok[:, None], hist)
        out, cache = decode_step(params, cache, tok, rows[:, 0], None, config=config, opts=opts)
        logits.append(np.asarray(out, np.float32))
        tok = np.argmax(logits[-1], -1).astype(np.int32)
        greedy.append(tok)
    return np.stack(logits, 1), np.stack(greedy, 1)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--backend", default="auto", help="kernel backend to check (auto: Pallas on GPU / TPU)")
    ap.add_argument("--lengths", default="37,300,1500,2900", help="prompt lengths")
    args = ap.parse_args(argv)
    config = small_config()
    hasher = synthetic_hasher(config)
    rng = np.random.default_rng(0)
    # prompts: past top-k (64 entries of ratio 1) and the HSI pool (16 blocks x 8) for the longer ones; mixed lengths
    prompts = [rng.integers(3, config.vocab_size, n).astype(np.int32) for n in map(int, args.lengths.split(","))]
    kernel = resolve_backend(args.backend)
    rows = []
    f32_logits = None
    for dtype in (jnp.float32, jnp.bfloat16):
        params = init_params(config, jax.random.PRNGKey(0), dtype)
        ref_logits, ref_tok = run(config, params, hasher, "reference", dtype, prompts, args.steps, 4096)
        ker_logits, ker_tok = run(config, params, hasher, kernel, dtype, prompts, args.steps, 4096)
        diff = np.abs(ker_logits - ref_logits)
        scale = np.abs(ref_logits).max()
        row = dict(dtype=str(jnp.dtype(dtype)), backend=kernel, max_abs=float(diff.max()),
                   max_rel=float(diff.max() / scale), greedy_agree=float((ker_tok == ref_tok).mean()),
                   positions=int(ref_logits.shape[0] * ref_logits.shape[1]))
        if f32_logits is None:
            f32_logits = ref_logits
        else:  # the bf16 noise floor: each bf16 run against the float32 reference (prefill logits, same inputs)
            row["ref_vs_f32_max_abs"] = float(np.abs(ref_logits[:, 0] - f32_logits[:, 0]).max())
            row["kernel_vs_f32_max_abs"] = float(np.abs(ker_logits[:, 0] - f32_logits[:, 0]).max())
        rows.append(row)
    lines = [f"engine on `{kernel}` vs `reference`, {jax.devices()[0].device_kind}, JAX {jax.__version__}, "
             f"model {config.name} ({config.num_hidden_layers} layers, d {config.hidden_size}), prompts "
             f"{[len(p) for p in prompts]} + {args.steps} decode steps", "",
             "| dtype | logits max abs diff | max rel (of max |logit|) | greedy tokens agree |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['max_abs']:.3g} | {r['max_rel']:.3g} | {100 * r['greedy_agree']:.1f}% |")
    for r in rows:
        if "ref_vs_f32_max_abs" in r:
            lines.append(f"\n{r['dtype']} noise floor (prefill logits vs the float32 reference): reference "
                         f"{r['ref_vs_f32_max_abs']:.3g}, kernels {r['kernel_vs_f32_max_abs']:.3g} max abs")
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "check_engine_kernels.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
