"""Stand-alone reproducer (jax only) of XLA:GPU's slow priority fusion on an unrolled Sinkhorn normalisation.

    JAX_PLATFORMS=cpu python benchmarks/repro_sinkhorn_fusion.py [--tokens 1,8,32] [--iters 20] [--no-softmax-rewriter]

Compiles, for an NVIDIA H200 without a GPU (``deviceless_gpu.py``), the function below: each token's 4 x 4 matrix
is softmax-ed over rows and then normalised over columns and rows ``iters`` times, the loop unrolled. XLA:GPU's
``triton-softmax-rewriter`` turns every normalisation into a Triton "softmax" fusion; priority fusion then merges the
chain step by step and, at each step, searches the Triton tilings of the grown fusion
(``PriorityFusionQueue::CanFuseTriton`` -> ``TryFindBestTilingForFusion`` -> ``SymbolicTileAnalysis``), so the
compile time grows faster than linearly with ``iters`` and depends on the token count. Prints one line per token
count: compile seconds, fusions and Triton fusions of the compiled module.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def sinkhorn(logits, iters: int, eps: float = 1e-6):
    import jax
    import jax.numpy as jnp

    c = jax.nn.softmax(logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
    return c


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,32,64")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-softmax-rewriter", action="store_true",
                    help="compile with xla_disable_hlo_passes=triton-softmax-rewriter")
    args = ap.parse_args(argv)
    from deviceless_gpu import h200_device, on_device

    dev = h200_device()
    import jax
    import jax.numpy as jnp

    copts = {"xla_disable_hlo_passes": "triton-softmax-rewriter"} if args.no_softmax_rewriter else None
    for n in (int(x) for x in args.tokens.split(",")):
        arg = on_device(jax.ShapeDtypeStruct((n, 4, 4), jnp.float32), dev)
        lowered = jax.jit(lambda x: sinkhorn(x, args.iters)).lower(arg)
        t0 = time.perf_counter()
        text = lowered.compile(compiler_options=copts).as_text()
        print(f"tokens {n}, iters {args.iters}{', no softmax rewriter' if copts else ''}: compile "
              f"{time.perf_counter() - t0:.1f} s, {text.count(' fusion(')} fusions, "
              f"{text.count(chr(34) + '__triton' + chr(34))} Triton fusions", flush=True)


if __name__ == "__main__":
    main()
