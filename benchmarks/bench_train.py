"""Train-step throughput and MFU of dsv41_jax on one accelerator.

    python benchmarks/bench_train.py --preset fullwidth4 --batch 8 --seq 1024 --steps 10

Presets (stated explicitly; sized for one H200):
  fullwidth4 — the release's layer width (d 5120, 64 heads x 512, q LoRA 1280, 8 x 1024 output groups, expert
               width 2304, 32 x 128 indexer heads, top-512, window 128, HSI 2048 x 8) with 4 layers
               [SWA, ratio-2 Full, ratio-2 Reuse, ratio-1 Full], 16 routed experts top-6 + 1 shared, vocabulary 32768,
               no Engram, no DSpark.
  default    — the embedded default model's config (configs/default.py).
  tiny       — configs/tiny.py (CPU smoke test of this script).

Reported: median step time over ``--steps`` timed steps (after ``--warmup`` steps that include compilation),
tokens/s, model FLOPs per token (6 x active matmul parameters + attention 12 x H x D x keys/query per layer +
indexer scoring 2 x Hi x di x visible entries per index layer), MFU against 989 TFLOP/s (H100/H200 dense bf16
datasheet) and against the 780 TFLOP/s matmul rate measured on this machine kind, and XLA's own FLOP count of
the compiled step (includes remat recomputation and elementwise work).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np

from dsv41_jax.config import load_config
from dsv41_jax.model.counting import count_params
from dsv41_jax.model.model import default_hasher
from dsv41_jax.train.testing import random_batch
from dsv41_jax.train.config import TrainConfig
from dsv41_jax.train.step import make_train_step

PEAK_DATASHEET = 989e12
PEAK_MEASURED = 780e12


def preset(name: str):
    if name == "fullwidth4":
        return load_config("flash").replace(
            name="fullwidth4", vocab_size=32768, num_hidden_layers=4, compress_ratios=(0, 2, 2, 1),
            kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3), candidate_source_layer_id=3,
            n_routed_experts=16, num_experts_per_tok=6, engram_layer_ids=(), engram_num_embeddings=(),
            num_nextn_predict_layers=0, dspark_target_layer_ids=(1, 2, 3))
    return load_config(name)


def model_flops_per_token(config, seq: int) -> dict:
    c = config
    active = count_params(c).active_decode
    matmul = 6 * active
    attn = idx = 0
    for spec in c.plan:
        keys = min(seq, c.sliding_window) / 2 if seq <= c.sliding_window else c.sliding_window
        if spec.ratio > 0:
            entries = seq / spec.ratio
            keys += min(c.index_topk, entries / 2)
            if spec.runs_indexer:
                idx += 2 * c.index_n_heads * c.index_head_dim * entries / 2  # forward only (no gradient)
        attn += 3 * 4 * c.num_attention_heads * c.head_dim * keys
    return {"matmul": matmul, "attention": attn, "indexer": idx, "total": matmul + attn + idx}


def run(args) -> dict:
    config = preset(args.preset)
    tc = TrainConfig(seq_len=args.seq, batch_size=args.batch, steps=1000, warmup_steps=10, lr=1e-4,
                     compute_dtype=args.dtype, remat=args.remat, quant_sim=None if args.quant == "config" else
                     args.quant == "on", indexer_loss=args.indexer_loss, query_chunk=args.query_chunk)
    step = make_train_step(config, tc)
    t0 = time.perf_counter()
    state = step.init_state(seed=0)
    jax.block_until_ready(state)
    t_init = time.perf_counter() - t0
    batch = jax.device_put(random_batch(config, args.batch, args.seq, seed=0, hasher=default_hasher(config)))
    t0 = time.perf_counter()
    donate = (0,) if jax.default_backend() != "cpu" else ()
    compiled = jax.jit(step.step_fn, donate_argnums=donate).lower(state, batch, np.float32(1e-4)).compile()
    t_compile = time.perf_counter() - t0
    try:
        xla_flops = float(compiled.cost_analysis().get("flops", float("nan")))
    except Exception:  # pragma: no cover - backend without cost analysis
        xla_flops = float("nan")
    times = []
    loss = None
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, m = compiled(state, batch, np.float32(1e-4))
        jax.block_until_ready(state["step"])
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
        loss = float(m["ce"])
    med = statistics.median(times)
    tokens = args.batch * args.seq
    flops = model_flops_per_token(config, args.seq)
    tps = tokens / med
    counts = count_params(config)
    out = {
        "preset": args.preset, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "params_total": counts.total, "params_active_per_token": counts.active_decode,
        "batch": args.batch, "seq": args.seq, "dtype": args.dtype, "remat": args.remat, "quant_sim": args.quant,
        "indexer_loss": args.indexer_loss, "init_s": t_init, "compile_s": t_compile,
        "step_ms_median": med * 1e3, "step_ms_min": min(times) * 1e3, "tokens_per_s": tps,
        "model_flops_per_token": flops["total"], "flops_breakdown": flops,
        "mfu_datasheet": flops["total"] * tps / PEAK_DATASHEET, "mfu_measured_peak": flops["total"] * tps / PEAK_MEASURED,
        "xla_flops_per_step": xla_flops, "xla_tflops_per_s": xla_flops / med / 1e12, "last_loss": loss,
    }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="fullwidth4")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--remat", default="none")
    p.add_argument("--quant", choices=("config", "on", "off"), default="config")
    p.add_argument("--indexer-loss", default="off")
    p.add_argument("--query-chunk", type=int, default=256)
    p.add_argument("--json", default=None, help="append the result as a JSON line here")
    args = p.parse_args(argv)
    out = run(args)
    print("| preset | batch x seq | step ms | tokens/s | model TFLOP/token-step | MFU (989) | MFU (780) | XLA TFLOP/s |")
    print(f"| {out['preset']} | {out['batch']}x{out['seq']} | {out['step_ms_median']:.1f} | {out['tokens_per_s']:,.0f} | "
          f"{out['model_flops_per_token'] / 1e12 * out['batch'] * out['seq']:.2f} | {out['mfu_datasheet']:.1%} | "
          f"{out['mfu_measured_peak']:.1%} | {out['xla_tflops_per_s']:.1f} |")
    print(json.dumps(out))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
