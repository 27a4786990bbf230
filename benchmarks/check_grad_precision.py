"""bf16 gradients of CSA2 sparse attention against float32 gradients on the same (upcast) inputs, per backward.

    python benchmarks/check_grad_precision.py [--seq 4096] [--heads 64] [--dim 512] [--topk 512] [--window 128]
        [--label after] [--json OUT.json]

Prefill / training shape: B = 1, T queries, compressed N = T (ratio 1), every query picks ``topk`` of its visible
entries (random), window ``window``, sink per head. Decode shape: 64 sequences x 1 query, 32,768 cache entries.
Losses: ``sum`` (loss = sum of outputs: same-sign contributions, the worst case for a stalled sum) and ``random``
(a random normal cotangent). Columns: relative L2 error of each gradient vs the float32 reference backward, and
the fwd + bwd time (ms, median of 5). Backwards: ``reference`` (plain JAX, jax.grad), ``recompute`` (the kernel
forward with the reference-recompute backward), ``fused`` (the Pallas GPU backward, its default dKV modes), ``atomic``
and ``by_key`` (the same with every dKV by fp32 atomic scatter-add / by key block); ``--backwards`` picks them.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import kernels

GRADS = ("dq", "dkv", "dckv", "dsink")


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _timed(fn, *args, reps=5):
    out = jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return out, 1e3 * float(np.median(ts))


def prefill_case(t, h, d, k, seed=0):
    kq, kk, kc, ks, kt, kg = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(kq, (1, t, h, d), jnp.float32).astype(jnp.bfloat16)
    kv = jax.random.normal(kk, (1, t, d), jnp.float32).astype(jnp.bfloat16)
    ckv = jax.random.normal(kc, (1, t, d), jnp.float32).astype(jnp.bfloat16)
    sink = jax.random.normal(ks, (h,), jnp.float32)
    vis = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]  # ratio 1: entry s visible to query t iff s <= t
    score = jnp.where(vis, jax.random.uniform(kt, (t, t)), -1.0)
    val, idx = jax.lax.top_k(score, min(k, t))
    topk = jnp.sort(jnp.where(val >= 0, idx, t), axis=-1)
    topk = jnp.where(topk >= t, -1, topk).astype(jnp.int32)[None]
    cot = jax.random.normal(kg, (1, t, h, d), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    return (q, kv, ckv, sink), topk, pos, cot


def decode_case(b, n, h, d, k, window, seed=1):
    kq, kk, kc, ks, kt, kg = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(kq, (b, 1, h, d), jnp.float32).astype(jnp.bfloat16)
    win = jax.random.normal(kk, (b, window, d), jnp.float32).astype(jnp.bfloat16)
    ckv = jax.random.normal(kc, (b, n, d), jnp.float32).astype(jnp.bfloat16)
    sink = jax.random.normal(ks, (h,), jnp.float32)
    topk = jnp.sort(jax.vmap(lambda kr: jax.random.choice(kr, n, (k,), replace=False))(jax.random.split(kt, b)),
                    axis=-1).astype(jnp.int32)[:, None]
    q_pos = jnp.full((b, 1), n * 2, jnp.int32)
    win_pos = jnp.broadcast_to(n * 2 - jnp.arange(window, dtype=jnp.int32)[::-1], (b, window))
    cot = jax.random.normal(kg, (b, 1, h, d), jnp.float32)
    return (q, win, ckv, sink), topk, q_pos, win_pos, cot


LOSSES = ("sum", "random")


def grad_fn(attn, cot):
    def loss(q, kv, ckv, sink, which):
        out = attn(q, kv, ckv, sink).astype(jnp.float32)
        return jnp.sum(out) if which == "sum" else jnp.sum(out * cot)

    return {w: jax.jit(jax.grad(lambda *a, w=w: loss(*a, w), argnums=(0, 1, 2, 3))) for w in LOSSES}


def run(args):
    rows = []
    up = lambda xs: tuple(x.astype(jnp.float32) for x in xs)  # noqa: E731
    on_gpu = jax.default_backend() == "gpu" or args.backend.endswith("interpret")
    be = args.backend

    # -- prefill / training shape ---------------------------------------------------------------------------------
    xs, topk, pos, cot = prefill_case(args.seq, args.heads, args.dim, args.topk)

    def seq_attn(backend, tuning=None):
        return lambda q, kv, ckv, sink: kernels.sequence_sparse_attention(
            q, kv, pos, ckv, topk, sink, window=args.window, chunk=256, backend=backend, tuning=tuning)

    truth = {w: f(*up(xs)) for w, f in grad_fn(seq_attn("reference"), cot).items()}
    known = {"reference": lambda: seq_attn("reference"), "recompute": lambda: seq_attn(be, {"fused_bwd": False}),
             "fused": lambda: seq_attn(be, {"fused_bwd": True}),
             "atomic": lambda: seq_attn(be, {"fused_bwd": True, "bwd_dkv": "atomic", "bwd_dkv_selected": "atomic"}),
             "by_key": lambda: seq_attn(be, {"fused_bwd": True, "bwd_dkv": "by_key", "bwd_dkv_selected": "by_key"})}
    wanted = [w for w in args.backwards.split(",") if w]
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise SystemExit(f"--backwards: unknown {unknown}; choose among {sorted(known)}")
    variants = [(w, known[w]()) for w in wanted if w == "reference" or on_gpu]
    for name, attn in variants:
        for w, f in grad_fn(attn, cot).items():
            try:
                g, ms = _timed(f, *xs)
                errs = {k: _rel(a, b) for k, a, b in zip(GRADS, g, truth[w])}
                rows.append({"shape": f"prefill T={args.seq}", "backward": name, "loss": w, **errs, "ms": ms})
            except Exception as e:  # noqa: BLE001  (report, keep going)
                rows.append({"shape": f"prefill T={args.seq}", "backward": name, "loss": w,
                             "error": f"{type(e).__name__}: {str(e)[:160]}"})
            print(json.dumps(rows[-1]), flush=True)

    # -- decode shape -------------------------------------------------------------------------------------------
    if on_gpu and not args.no_decode:
        xs, topk_d, q_pos, win_pos, cot = decode_case(args.decode_batch, args.decode_entries, args.heads, args.dim,
                                                      args.topk, args.window)
        dshape = f"decode B={args.decode_batch} N={args.decode_entries}"

        def dec_attn(backend, tuning=None):
            return lambda q, kv, ckv, sink: kernels.sparse_attention(
                q, q_pos, kv, win_pos, ckv, topk_d, sink, window=args.window, backend=backend, tuning=tuning)

        truth = {w: f(*up(xs)) for w, f in grad_fn(dec_attn("reference"), cot).items()}
        for name, attn in [("reference", dec_attn("reference")), ("fused", dec_attn(be, {"fused_bwd": True}))]:
            for w, f in grad_fn(attn, cot).items():
                try:
                    g, ms = _timed(f, *xs)
                    errs = {k: _rel(a, b) for k, a, b in zip(GRADS, g, truth[w])}
                    rows.append({"shape": dshape, "backward": name, "loss": w, **errs, "ms": ms})
                except Exception as e:  # noqa: BLE001
                    rows.append({"shape": dshape, "backward": name, "loss": w,
                                 "error": f"{type(e).__name__}: {str(e)[:160]}"})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows, label) -> str:
    lines = [f"bf16 gradient vs float32 on upcast inputs ({label}; jax {jax.__version__}, {jax.devices()[0].device_kind})",
             "| shape | backward | loss | dq | dkv | dckv | dsink | fwd+bwd ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['backward']} | {r['loss']} | {r['error']} | | | | |")
        else:
            lines.append(f"| {r['shape']} | {r['backward']} | {r['loss']} | " +
                         " | ".join(f"{r[k]:.2e}" for k in GRADS) + f" | {r['ms']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--decode-entries", type=int, default=32768)
    ap.add_argument("--backend", default="pallas_gpu", help="kernel backend (pallas_gpu_interpret: a CPU smoke run)")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--loss", choices=("sum", "random", "both"), default="both",
                    help="one loss halves the compilations (the float32 truth and every backward)")
    ap.add_argument("--backwards", default="reference,recompute,fused",
                    help="prefill backwards, comma-separated: reference, recompute, fused (the default GPU "
                         "backward), atomic / by_key (the fused backward with every dKV by fp32 atomics / by key "
                         "block)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode shape")
    a = ap.parse_args()
    if a.loss != "both":
        LOSSES = (a.loss,)
    rows = run(a)
    print(table(rows, a.label))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"label": a.label, "jax": jax.__version__, "args": vars(a), "rows": rows}, f, indent=1)
