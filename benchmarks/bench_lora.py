"""LoRA step vs full fine-tuning step on one accelerator: tokens/s and device memory, measured in the same run.

    python benchmarks/bench_lora.py --preset fullwidth4 --batch 4 --seq 1024 --steps 5

Each mode runs in its own fresh process (so the device's peak-memory counter belongs to that mode alone):

* ``full`` — full fine-tuning: float32 master weights, AdamW moments for every parameter, bf16 compute.
* ``lora`` — LoRA (``dsv41_jax.train.lora``) on the frozen base held in bf16: float32 adapters (default targets:
  attention ``wq_a``, ``wq_b``, ``wkv``, ``wo_b``; ``--rank``) and their AdamW moments only.

Reported per mode: median step time over ``--steps`` timed steps (after ``--warmup``), tokens/s, the peak device
bytes in use (``memory_stats()["peak_bytes_in_use"]``, whole process: parameters + optimiser state + the step's
temporaries), XLA's ``memory_analysis()`` of the compiled step (arguments, temporaries) and the trainable / stored
parameter bytes. Presets and the model-FLOP count are those of ``benchmarks/bench_train.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GIB = 1024 ** 3


def _one(args) -> dict:
    import jax
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_train import PEAK_MEASURED, model_flops_per_token, preset

    from dsv41_jax.model.model import default_hasher
    from dsv41_jax.train.testing import random_batch
    from dsv41_jax.train.config import TrainConfig
    from dsv41_jax.train.step import make_train_step

    config = preset(args.preset)
    lora = args.mode == "lora"
    tc = TrainConfig(seq_len=args.seq, batch_size=args.batch, steps=1000, warmup_steps=10, lr=1e-4,
                     compute_dtype="bfloat16", lora=lora, lora_rank=args.rank, lora_alpha=2.0 * args.rank)
    step = make_train_step(config, tc)
    t0 = time.perf_counter()
    state = step.init_state(seed=0)
    jax.block_until_ready(state)
    t_init = time.perf_counter() - t0
    batch = jax.device_put(random_batch(config, args.batch, args.seq, seed=0, hasher=default_hasher(config)))
    t0 = time.perf_counter()
    compiled = step.lower(state, batch, 1e-4).compile()
    t_compile = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    call = (lambda s: compiled(s, step.base, batch, np.float32(1e-4))) if lora else \
        (lambda s: compiled(s, batch, np.float32(1e-4)))
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, m = call(state)
        jax.block_until_ready(state["step"])
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    stats = jax.devices()[0].memory_stats() or {}
    nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))  # noqa: E731
    tps = args.batch * args.seq / med
    return {
        "mode": args.mode, "preset": args.preset, "device": jax.devices()[0].device_kind, "batch": args.batch,
        "seq": args.seq, "rank": args.rank if lora else None, "init_s": t_init, "compile_s": t_compile,
        "step_ms_median": med * 1e3, "step_ms_min": min(times) * 1e3, "tokens_per_s": tps,
        "mfu_measured_peak": model_flops_per_token(config, args.seq)["total"] * tps / PEAK_MEASURED,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit"),
        "trainable_bytes": nbytes(state["params"]), "opt_state_bytes": nbytes(state["opt_state"]),
        "frozen_base_bytes": nbytes(step.base) if lora else 0,
        "xla_argument_bytes": getattr(mem, "argument_size_in_bytes", None),
        "xla_temp_bytes": getattr(mem, "temp_size_in_bytes", None),
        "last_loss": float(m["ce"]),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="fullwidth4")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--modes", default="full,lora")
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # one mode, in this process
    p.add_argument("--json", default=None, help="append each mode's result as a JSON line here")
    args = p.parse_args(argv)
    if args.mode:
        print("RESULT " + json.dumps(_one(args)), flush=True)
        return 0
    rows = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode] + [
            a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--modes")]
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            print(f"# {mode} failed (exit {out.returncode}):\n{out.stderr[-4000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(lines[-1][7:]))
    print("| mode | batch x seq | step ms | tokens/s | MFU (780) | peak device memory | trainable | optimiser state | "
          "frozen base | XLA args / temp |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    g = lambda b: f"{b / GIB:.2f} GiB" if b is not None else "n/a"  # noqa: E731
    for r in rows:
        name = r["mode"] + (f" (rank {r['rank']})" if r["rank"] else "")
        print(f"| {name} | {r['batch']}x{r['seq']} | {r['step_ms_median']:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{r['mfu_measured_peak']:.1%} | {g(r['peak_bytes_in_use'])} | {g(r['trainable_bytes'])} | "
              f"{g(r['opt_state_bytes'])} | {g(r['frozen_base_bytes'])} | {g(r['xla_argument_bytes'])} / "
              f"{g(r['xla_temp_bytes'])} |")
    for r in rows:
        print(json.dumps(r))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
