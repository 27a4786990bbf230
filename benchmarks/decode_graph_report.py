"""What in the decode program can stall a GPU between kernels: a table per model and kernel path.

    python benchmarks/decode_graph_report.py [--models tiny,12L,bench40] [--batch 32] [--max-len 32768] [--hlo]

Traces the Engine's decode step (decode + sampling) on abstract shapes (nothing is allocated: the full-width models
run on a laptop) and counts, over its jaxpr (Pallas kernel bodies excluded, see ``dsv41_jax.inference.audit``):
loops with a data-dependent trip count (a device->host copy per iteration on a GPU), conditionals, host callbacks,
rolled loops with a static trip count (their iterations launch kernels one by one), concatenates / copies of
cache-sized buffers, and Pallas kernels. ``--hlo`` also compiles the program for this machine's backend (CPU here)
and counts HLO while loops (with / without a known trip count), copies, concatenates and the cache buffers aliased
to outputs (updated in place). Paths: ``gpu`` = the Pallas kernels (as on an H200; traced in interpret mode),
``reference`` = the plain-JAX CPU path.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

from bench_inference import h200_config  # noqa: E402
from dsv41_jax import load_config  # noqa: E402
from dsv41_jax.inference.audit import audit_decode_step, hlo_counts  # noqa: E402
from dsv41_jax.inference.step import FAST_COMPILE, InferenceOptions  # noqa: E402

MODELS = {"tiny": lambda: load_config("tiny"), "12L": h200_config, "bench40": lambda: load_config("bench40")}
PATHS = {"gpu": "pallas_gpu_interpret", "reference": "reference"}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,12L,bench40")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=32768)
    ap.add_argument("--hlo", action="store_true", help="also compile for the local backend and count HLO (slow)")
    args = ap.parse_args(argv)
    print(f"decode step (decode + sampling), batch {args.batch}, cache max_len {args.max_len}, bf16")
    print("| model | path | equations | data-dependent loops | conditionals | callbacks | rolled static loops "
          "(iterations) | unrolled loops | cache-sized concatenates | cache-sized copies | Pallas kernels |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        config = MODELS[name]()
        for path, backend in PATHS.items():
            a = audit_decode_step(config, args.batch, args.max_len, opts=InferenceOptions(kernel_backend=backend))
            s = a.summary()
            print(f"| {config.name} | {path} | {s['equations']} | {s['dynamic_while']} | {s['cond']} | "
                  f"{s['callbacks']} | {s['rolled_scans']} ({s['rolled_scan_iterations']}) | {s['unrolled_scans']} | "
                  f"{s['big_concatenates']} | {s['big_copies']} | {s['kernels']} |", flush=True)
    if args.hlo:
        print("\ncompiled for this machine's backend (reference path):")
        for name in args.models.split(","):
            config = MODELS[name]()
            h = hlo_counts(config, args.batch, args.max_len, opts=InferenceOptions(compiler_options=FAST_COMPILE))
            print(f"{config.name}: {h}", flush=True)


if __name__ == "__main__":
    main()
