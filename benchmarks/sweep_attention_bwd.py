#!/usr/bin/env python
"""Block configurations of the fused GPU sparse-attention backward at a train step's shape, timed in one process.

    python benchmarks/sweep_attention_bwd.py --out DIR                          # on the GPU
    python benchmarks/sweep_attention_bwd.py --case prefix,sparse --configs 0,3 --out DIR
    python benchmarks/sweep_attention_bwd.py --smoke              # CPU: tiny sizes, interpret mode

Shape (``fullwidth4``'s compressed layers at batch 4 x 1024): 64 heads x 512, window 128, a ratio-2 compressed
sequence (N = T / 2 entries) whose top-512 lists hold every visible entry (at T = 1024 every query sees at most 512
entries: the causal prefix, the case where neighbouring queries scatter-add into the same rows); ``--case sparse``:
N = T entries, each query's list min(visible, 512) distinct random visible entries (the ratio-1 layer). Per configuration
(``tuning`` keys of ``kernels.sequence_sparse_attention``; the first row is the default): forward + backward time
(``jax.grad`` of Σ out · ct; best of 3 trials of 5 calls), and the largest relative L2 difference of the four
gradients against the default configuration's. Rows go to DIR/sweep_attention_bwd.jsonl as they are measured.
Several cases (``--case prefix,sparse``) run in one process; ``--parallel N`` compiles N configurations at a time
in threads (the programs are lowered one by one, XLA compiles them concurrently; no GEMM autotuning is involved),
then times them one by one.
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
    {},  # the default (kernels.GPU_BWD_DEFAULTS): dQ per query, dKV by key block or atomics (pallas_gpu.BY_KEY_MIN_FILL)
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
    {"bwd_block_h": 32, "bwd_block_k": 32, "bwd_num_warps": 8},  # 11-: more dQ tiles
    {"bwd_block_h": 64, "bwd_block_k": 16, "bwd_num_warps": 8},
    {"bwd_block_h": 16, "bwd_block_k": 32, "bwd_num_warps": 4},
    {"bwd_block_h": 32, "bwd_block_k": 64, "bwd_num_warps": 8},
    {"bwd_block_h": 64, "bwd_block_k": 32, "bwd_num_warps": 4},
    {"bwd_key_block": 16},  # 16-: more dKV tiles
    {"bwd_key_block": 64, "bwd_key_block_h": 16},
    {"bwd_key_splits": 2},
    {"bwd_key_block_h": 64, "bwd_key_warps": 4},
)
DQ_KEYS = {"bwd_block_h", "bwd_block_k", "bwd_num_warps", "bwd_num_stages"}  # the dQ kernel's tiles
DKV_KEYS = {"bwd_key_block", "bwd_key_block_h", "bwd_key_warps", "bwd_key_splits", "bwd_key_stages"}  # dKV's


def make_inputs(case: str, batch: int, seq: int, smoke: bool):
    """(q, kv, ckv, ct, sink, pos, topk, window, sizes) of one case, drawn on the default device."""
    b, t, h, d, window, k = (1, 64, 4, 32, 16, 16) if smoke else (batch, seq, 64, 512, 128, 512)
    n = t // 2 if case == "prefix" else t
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    kq, kk_, kc, kt, ks = jax.random.split(jax.random.PRNGKey(0), 5)  # drawn on the device: seconds less per run
    q = jax.random.normal(kq, (b, t, h, d), bf)
    kv = jax.random.normal(kk_, (b, t, d), bf)
    ckv = jax.random.normal(kc, (b, n, d), bf)
    ct = jax.random.normal(kt, (b, t, h, d), bf)
    sink = jax.random.normal(ks, (h,), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if case == "prefix":
        visible = (np.arange(t) + 1) // 2  # entry e covers tokens 2e, 2e + 1: complete once 2e + 1 <= t
        slots = np.arange(k)
        topk = np.where(slots[None, :] < np.minimum(visible, k)[:, None], slots[None, :], -1).astype(np.int32)
        topk = jnp.asarray(np.broadcast_to(topk, (b, t, k)))
    elif case == "window":
        ckv = topk = None
    else:
        topk = np.full((b, t, k), -1, np.int32)
        for bi in range(b):
            for i in range(t):
                m = min(i + 1, k)
                topk[bi, i, :m] = np.sort(rng.choice(i + 1, m, replace=False))
        topk = jnp.asarray(topk)
    return (q, kv, ckv, ct, sink, pos, topk, window), dict(b=b, t=t, h=h, d=d, window=window, k=k, n=n)


def sweep(cases, configs, *, batch=4, seq=1024, smoke=False, parallel=1, sink_path=None, log=print):
    """Rows {config, case, compile_s, fwd_bwd_ms, max_rel_diff_vs_default | error} for every (case, config); the
    first config of ``configs`` is the reference of the differences (pass the default first)."""
    from concurrent.futures import ThreadPoolExecutor

    backend = "pallas_gpu_interpret" if smoke else "auto"
    rows = []
    for case in cases:
        (q, kv, ckv, ct, sink, pos, topk, window), sz = make_inputs(case, batch, seq, smoke)
        dev = jax.devices()[0].device_kind
        jobs = []
        for tun in configs:
            row = {"config": tun, "case": case, "batch": sz["b"], "seq": sz["t"], "device": dev}
            try:
                def loss(q_, kv_, c_, s_, tun=tun):
                    out = KN.sequence_sparse_attention(q_, kv_, pos, c_, topk, s_, window=window, backend=backend,
                                                       tuning=tun)
                    return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

                lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, kv, ckv, sink)
                jobs.append((row, lowered))
            except Exception as e:  # report and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                jobs.append((row, None))

        def compile_one(job):
            row, lowered = job
            if lowered is None:
                return None
            t0 = time.perf_counter()
            try:
                exe = lowered.compile()
            except Exception as e:  # a configuration may not fit shared memory
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                return None
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            return exe

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max(1, parallel)) as pool:
            exes = list(pool.map(compile_one, jobs))
        log(f"sweep {case}: {len(jobs)} configurations compiled in {time.perf_counter() - t0:.1f} s "
            f"({parallel} at a time)")
        base = None
        for (row, _), exe in zip(jobs, exes):
            if exe is not None:
                try:
                    grads = jax.block_until_ready(exe(q, kv, ckv, sink))
                    best = float("inf")
                    for _ in range(1 if smoke else 3):
                        t1 = time.perf_counter()
                        for _ in range(1 if smoke else 5):
                            out = exe(q, kv, ckv, sink)
                        jax.block_until_ready(out)
                        best = min(best, (time.perf_counter() - t1) / (1 if smoke else 5))
                    row["fwd_bwd_ms"] = best * 1e3
                    if base is None:
                        base = grads
                    row["max_rel_diff_vs_default"] = max(
                        float(jnp.linalg.norm((a.astype(jnp.float32) - c.astype(jnp.float32)).ravel())
                              / jnp.maximum(jnp.linalg.norm(c.astype(jnp.float32).ravel()), 1e-30))
                        for a, c in zip(grads, base) if a is not None)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            if sink_path:
                with open(sink_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
            log(json.dumps(row))
        del jobs, exes, base
    return rows


def pick_best(rows, weights: dict, max_rel_diff: float = 1e-2) -> dict:
    """The fastest dQ tiles and the fastest dKV tiles by the weighted sum of fwd+bwd times over the cases
    (``weights``: case -> layers of that kind in the step), each against the default's; a configuration counts
    only where it ran in every weighted case and its gradients stay within ``max_rel_diff`` of the default's.
    Returns {"tuning": merged bwd_* dict (empty = keep the default), "scores": {config json: weighted ms}}."""
    scores = {}
    for r in rows:
        if r["case"] not in weights:
            continue
        key = json.dumps(r["config"], sort_keys=True)
        ok = "error" not in r and r.get("max_rel_diff_vs_default", 1.0) <= max_rel_diff
        cur = scores.setdefault(key, [0.0, 0, True])
        cur[0] += weights[r["case"]] * r.get("fwd_bwd_ms", 0.0)
        cur[1] += 1
        cur[2] = cur[2] and ok
    valid = {k: v[0] for k, v in scores.items() if v[1] == len(weights) and v[2]}
    base = valid.get(json.dumps({}))
    tuning = {}
    if base is not None:
        for keys in (DQ_KEYS, DKV_KEYS):
            group = {k: v for k, v in valid.items() if json.loads(k) and set(json.loads(k)) <= keys}
            if group:
                k_best = min(group, key=group.get)
                if group[k_best] < base:
                    tuning.update(json.loads(k_best))
    return {"tuning": tuning, "scores": valid}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--case", default="prefix",
                   help="comma-separated cases. prefix: a ratio-2 sequence whose top-k lists hold every visible "
                        "entry; sparse: a ratio-1 sequence (N = T) whose lists hold min(visible, k) distinct random "
                        "visible entries, sorted (fullwidth4's last layer); window: no compressed entries (the "
                        "window-only layer)")
    p.add_argument("--configs", default="", help="comma-separated indices into CONFIGS (default: all)")
    p.add_argument("--parallel", type=int, default=1, help="configurations compiled at a time (threads)")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    cases = [c for c in args.case.split(",") if c]
    for c in cases:
        if c not in ("prefix", "sparse", "window"):
            raise SystemExit(f"--case: unknown case {c!r} (prefix, sparse, window)")
    os.makedirs(args.out, exist_ok=True)
    chosen = [CONFIGS[int(i)] for i in args.configs.split(",")] if args.configs else list(CONFIGS)
    rows = sweep(cases, chosen, batch=args.batch, seq=args.seq, smoke=SMOKE or args.smoke, parallel=args.parallel,
                 sink_path=os.path.join(args.out, "sweep_attention_bwd.jsonl"))
    print_table(rows)
    return 0


def print_table(rows) -> None:
    print("\nsparse-attention backward, fwd + bwd per configuration (64 heads x 512, window 128, top-512)")
    print("| case | config | fwd+bwd ms | max rel. diff vs default |")
    print("|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | {json.dumps(r['config'])} | error: {r['error'][:120]} | |")
        else:
            print(f"| {r['case']} | {json.dumps(r['config'])} | {r['fwd_bwd_ms']:.2f} | "
                  f"{r['max_rel_diff_vs_default']:.1e} |")


if __name__ == "__main__":
    sys.exit(main())
