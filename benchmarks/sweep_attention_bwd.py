#!/usr/bin/env python
"""Block configurations of the fused GPU sparse-attention backward at a train step's shape, timed in one process.

    python benchmarks/sweep_attention_bwd.py --out DIR            # on the GPU
    python benchmarks/sweep_attention_bwd.py --smoke              # CPU: tiny sizes, interpret mode

Shape (``fullwidth4``'s compressed layers at batch 4 x 1024): 64 heads x 512, window 128, a ratio-2 compressed
sequence (N = T / 2 entries) whose top-512 lists hold every visible entry (at T = 1024 every query sees at most 512
entries: the causal prefix, the case where neighbouring queries scatter-add into the same rows); ``--case sparse``:
N = T entries, each query's list min(visible, 512) distinct random visible entries (the ratio-1 layer). Per configuration
(``tuning`` keys of ``kernels.sequence_sparse_attention``; the first row is the default): forward + backward time
(``jax.grad`` of Σ out · ct; best of 3 trials of 5 calls), and the largest relative L2 difference of the four
gradients against the default configuration's. Rows go to DIR/sweep_attention_bwd.jsonl as they are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsv41_jax import kernels as KN  # noqa: E402

CONFIGS = (
    {},  # the default (kernels._gpu_tuning): dQ per query, dKV by key block or atomics (pallas_gpu.BY_KEY_MIN_FILL)
    {"bwd_dkv": "atomic", "bwd_dkv_selected": "atomic"},  # every (query, row) dKV scatter-added with fp32 atomics
    {"bwd_dkv": "by_key", "bwd_dkv_selected": "by_key"},
    {"bwd_block_h": 64, "bwd_block_k": 32, "bwd_num_warps": 8},  # dQ kernel tiles
    {"bwd_block_h": 64, "bwd_block_k": 64, "bwd_num_warps": 8},
    {"bwd_block_h": 32, "bwd_block_k": 32, "bwd_num_warps": 4},
    {"bwd_key_block": 64},  # key-centric dKV tiles
    {"bwd_key_block_h": 64},
    {"bwd_key_warps": 4},
    {"bwd_key_splits": 1},
    {"bwd_key_splits": 8},
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--case", choices=("prefix", "sparse", "window"), default="prefix",
                   help="prefix: a ratio-2 sequence whose top-k lists hold every visible entry; sparse: a ratio-1 "
                        "sequence (N = T) whose lists hold min(visible, k) distinct random visible entries, sorted "
                        "(fullwidth4's last layer); window: no compressed entries (the window-only layer)")
    p.add_argument("--configs", default="", help="comma-separated indices into CONFIGS (default: all)")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    b, t, h, d, window, k = (1, 64, 4, 32, 16, 16) if SMOKE else (args.batch, args.seq, 64, 512, 128, 512)
    backend = "pallas_gpu_interpret" if SMOKE else "auto"
    n = t // 2 if args.case == "prefix" else t
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    kq, kk_, kc, kt, ks = jax.random.split(jax.random.PRNGKey(0), 5)  # drawn on the device: seconds less per run
    q = jax.random.normal(kq, (b, t, h, d), bf)
    kv = jax.random.normal(kk_, (b, t, d), bf)
    ckv = jax.random.normal(kc, (b, n, d), bf)
    ct = jax.random.normal(kt, (b, t, h, d), bf)
    sink = jax.random.normal(ks, (h,), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if args.case == "prefix":
        visible = (np.arange(t) + 1) // 2  # entry e covers tokens 2e, 2e + 1: complete once 2e + 1 <= t
        slots = np.arange(k)
        topk = np.where(slots[None, :] < np.minimum(visible, k)[:, None], slots[None, :], -1).astype(np.int32)
        topk = jnp.asarray(np.broadcast_to(topk, (b, t, k)))
    elif args.case == "window":
        ckv = topk = None
    else:
        topk = np.full((b, t, k), -1, np.int32)
        for bi in range(b):
            for i in range(t):
                m = min(i + 1, k)
                topk[bi, i, :m] = np.sort(rng.choice(i + 1, m, replace=False))
        topk = jnp.asarray(topk)
    os.makedirs(args.out, exist_ok=True)
    sink_path = os.path.join(args.out, "sweep_attention_bwd.jsonl")
    base = None
    rows = []
    chosen = [CONFIGS[int(i)] for i in args.configs.split(",")] if args.configs else list(CONFIGS)
    for tun in chosen:
        row = {"config": tun, "case": args.case, "batch": b, "seq": t, "device": jax.devices()[0].device_kind}
        try:
            def loss(q_, kv_, c_, s_, tun=tun):
                out = KN.sequence_sparse_attention(q_, kv_, pos, c_, topk, s_, window=window, backend=backend,
                                                   tuning=tun)
                return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
            t0 = time.perf_counter()
            grads = jax.block_until_ready(g(q, kv, ckv, sink))
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            best = float("inf")
            for _ in range(1 if SMOKE else 3):
                t0 = time.perf_counter()
                for _ in range(1 if SMOKE else 5):
                    out = g(q, kv, ckv, sink)
                jax.block_until_ready(out)
                best = min(best, (time.perf_counter() - t0) / (1 if SMOKE else 5))
            row["fwd_bwd_ms"] = best * 1e3
            if base is None:
                base = grads
            row["max_rel_diff_vs_default"] = max(
                float(jnp.linalg.norm((a.astype(jnp.float32) - c.astype(jnp.float32)).ravel())
                      / jnp.maximum(jnp.linalg.norm(c.astype(jnp.float32).ravel()), 1e-30))
                for a, c in zip(grads, base) if a is not None)
        except Exception as e:  # report and go on (a config may not fit shared memory)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        with open(sink_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    print(f"\nsparse-attention backward ({args.case}), batch {b} x {t}, {h} x {d}, window {window}, "
          f"top-{k} of N = {n}")
    print("| config | fwd+bwd ms | max rel. diff vs default |")
    print("|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {json.dumps(r['config'])} | error: {r['error'][:120]} | |")
        else:
            print(f"| {json.dumps(r['config'])} | {r['fwd_bwd_ms']:.2f} | {r['max_rel_diff_vs_default']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
