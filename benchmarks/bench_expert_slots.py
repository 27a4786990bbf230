"""The decode step's routed experts when fewer experts are used than exist (batch 1: top-6 of 16), ways compared.

    PYTHONUNBUFFERED=1 python benchmarks/bench_expert_slots.py --out DIR     # on the GPU (bench-h200-12L sizes)
    python benchmarks/bench_expert_slots.py --smoke                          # CPU: tiny sizes, interpret mode

One jitted call runs the routed experts of ``--layers`` layers (each its own stacked bf16 weights [E, F, d] /
[E, d, F], together far larger than the 50 MB L2) for one token with its own top-k picks per layer; the host-clock
median of ``--reps`` calls (each waited for) against the floor: the used experts' bytes (layers x top-k x 3 x F x d x
2) over the bandwidth of a read-only kernel measured in the same process. Ways:

* ``xla_slot_loop``: ``inference.moe.routed_slots`` on the reference backend (a static loop over the slots, XLA
  GEMMs on ``w[e]`` — the path the engine took on a GPU before the slot kernels);
* ``take_batched``: the picked experts' weights gathered (``jnp.take``) and one batched GEMM per projection;
* ``ragged_dot``: ``jax.lax.ragged_dot`` over the rows sorted by expert (group sizes over every expert);
* ``kernel bn/bk/warps/stages``: the slot kernels (``kernels.expert_gemm_gpu``) at a few block configurations
  (the first is the engine's default, ``slot_blocks``).
Every way is checked against the float32 maths on the same bf16 inputs (``rel_err``: max |err| / max |ref|).
Prints a table; writes DIR/expert_slots.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsv41_jax.inference.moe import routed_slots  # noqa: E402
from dsv41_jax.kernels import expert_gemm_gpu as EG  # noqa: E402

sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
from ceilings import read_bandwidth  # noqa: E402


def _args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--layers", type=int, default=2 if SMOKE else 12)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=128 if SMOKE else 5120)
    ap.add_argument("--width", type=int, default=64 if SMOKE else 2304)
    ap.add_argument("--reps", type=int, default=3 if SMOKE else 20)
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def swiglu_rows(rows, w1, w2, w3, limit):
    """rows [S, R, d] through weights [S, F, d] / [S, d, F] (float32 out)."""
    g = jnp.einsum("sri,soi->sro", rows, w1, preferred_element_type=jnp.float32)
    u = jnp.einsum("sri,soi->sro", rows, w3, preferred_element_type=jnp.float32)
    u = jnp.clip(u, -limit, limit)
    g = jnp.minimum(g, limit)
    act = (jax.nn.silu(g) * u).astype(rows.dtype)
    return jnp.einsum("sri,soi->sro", act, w2, preferred_element_type=jnp.float32)


def main():
    a = _args()
    limit = 10.0
    key = jax.random.PRNGKey(0)
    e, f, d, k, n_layers = a.experts, a.width, a.hidden, a.topk, a.layers
    layers = []
    for i in range(n_layers):
        k1, k2, k3, k4, k5, key = jax.random.split(key, 6)
        w1 = (0.02 * jax.random.normal(k1, (e, f, d))).astype(jnp.bfloat16)
        w3 = (0.02 * jax.random.normal(k2, (e, f, d))).astype(jnp.bfloat16)
        w2 = (0.02 * jax.random.normal(k3, (e, d, f))).astype(jnp.bfloat16)
        idx = jax.random.permutation(k4, e)[:k][None].astype(jnp.int32)  # one token's distinct picks
        wts = jax.nn.softmax(jax.random.normal(k5, (1, k)))
        layers.append((w1, w2, w3, idx, wts))
    x = jax.random.normal(key, (1, d)).astype(jnp.bfloat16)
    jax.block_until_ready(layers)
    bw = 2e11 if SMOKE else read_bandwidth(4.0)
    floor_s = n_layers * k * 3 * f * d * 2 / bw
    backend = "pallas_gpu_interpret" if SMOKE else "pallas_gpu"

    def reference(x, lay):  # float32 maths on the same bf16 values
        out = []
        for w1, w2, w3, idx, wts in lay:
            ys = swiglu_rows(jnp.broadcast_to(x.astype(jnp.float32), (k, 1, d)), *(w.astype(jnp.float32)[idx[0]]
                             for w in (w1, w2, w3)), limit)
            out.append(jnp.sum(ys[:, 0] * wts[0][:, None], axis=0))
        return jnp.stack(out)

    def xla_slot_loop(x, lay):
        return jnp.stack([routed_slots(x, wts, idx, w1, w2, w3, limit, "reference")[0]
                          for w1, w2, w3, idx, wts in lay])

    def take_batched(x, lay):
        out = []
        for w1, w2, w3, idx, wts in lay:
            ws = [jnp.take(w, idx[0], axis=0) for w in (w1, w2, w3)]
            ys = swiglu_rows(jnp.broadcast_to(x, (k, 1, d)), *ws, limit)
            out.append(jnp.sum(ys[:, 0] * wts[0][:, None], axis=0))
        return jnp.stack(out)

    def ragged(x, lay):
        out = []
        for w1, w2, w3, idx, wts in lay:
            gs = jnp.bincount(idx[0], length=e).astype(jnp.int32)
            order = jnp.argsort(idx[0])
            rows = jnp.broadcast_to(x, (k, d))
            g = jax.lax.ragged_dot(rows, jnp.swapaxes(w1, 1, 2), gs, preferred_element_type=jnp.float32)
            u = jax.lax.ragged_dot(rows, jnp.swapaxes(w3, 1, 2), gs, preferred_element_type=jnp.float32)
            act = (jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)).astype(x.dtype)
            y = jax.lax.ragged_dot(act, jnp.swapaxes(w2, 1, 2), gs, preferred_element_type=jnp.float32)
            out.append(jnp.sum(y * wts[0][order][:, None], axis=0))
        return jnp.stack(out)

    def kernel(bn_up, bk_up, bn_dn, bk_dn, warps, stages):
        def run(x, lay):
            out = []
            for w1, w2, w3, idx, wts in lay:
                xs = jnp.broadcast_to(x[0], (k, EG.MIN_ROWS, d))
                sw = jnp.zeros((k, EG.MIN_ROWS), jnp.float32).at[:, 0].set(wts[0])
                live = jnp.ones((k,), jnp.int32)
                act = EG.slot_swiglu(xs, idx[0], live, sw, w1, w3, limit=limit, block_n=bn_up, block_k=bk_up,
                                     num_warps=warps, num_stages=stages, interpret=SMOKE)
                ys = EG.slot_down(act, idx[0], live, w2, block_n=bn_dn, block_k=bk_dn, num_warps=warps,
                                  num_stages=stages, interpret=SMOKE)
                out.append(jnp.sum(ys[:, 0], axis=0))
            return jnp.stack(out)
        return run

    def engine(x, lay):  # the engine's path on this backend (routed_slots -> the slot kernels)
        return jnp.stack([routed_slots(x, wts, idx, w1, w2, w3, limit, backend)[0] for w1, w2, w3, idx, wts in lay])

    (bnu, bku), (bnd, bkd) = EG.slot_blocks(EG.MIN_ROWS, d, f, e * f * d), EG.slot_blocks(EG.MIN_ROWS, f, d, e * f * d)
    ways = {"engine (slot kernels)": engine, "xla_slot_loop": xla_slot_loop, "take_batched": take_batched,
            "ragged_dot": ragged}
    configs = [(bnu, bku, bnd, bkd, 4, 3), (16, 256, 16, 256, 4, 4), (64, 128, 64, 128, 4, 3),
               (32, 512, 32, 256, 4, 2), (32, 256, 32, 256, 8, 3), (64, 256, 64, 256, 8, 3)]
    if SMOKE:
        configs = [(bnu, bku, bnd, bkd, 4, 3), (16, 32, 16, 32, 4, 2)]
    for c in configs:
        ways["kernel %d/%d %d/%d w%d s%d" % c] = kernel(*c)
    want = jax.jit(reference)(x, layers)
    rows = []
    for name, fn in ways.items():
        try:
            jf = jax.jit(fn)
            t0 = time.perf_counter()
            got = jf(x, layers).block_until_ready()
            compile_s = time.perf_counter() - t0
            ts = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                jf(x, layers).block_until_ready()
                ts.append(time.perf_counter() - t0)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
            r = dict(way=name, ms=statistics.median(ts) * 1e3, ms_min=min(ts) * 1e3, compile_s=compile_s,
                     rel_err=err)
            r["x_floor"] = r["ms"] / (floor_s * 1e3)
            r["tb_s"] = floor_s * bw / (r["ms"] / 1e3) / 1e12
        except Exception as ex:  # noqa: BLE001 - report and go on with the next way
            r = dict(way=name, error=repr(ex)[:400])
        rows.append(r)
        print(json.dumps(r), flush=True)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), jax=jax.__version__,
                device=jax.devices()[0].device_kind, layers=n_layers, experts=e, topk=k, hidden=d, width=f,
                read_bandwidth_tb_s=bw / 1e12, floor_ms=floor_s * 1e3)
    print(f"\n{meta['device']}, JAX {jax.__version__}: routed experts of {n_layers} layers, 1 token, top-{k} of {e}, "
          f"{f} x {d} bf16; floor {floor_s * 1e3:.3f} ms (read-only kernel {bw / 1e12:.2f} TB/s)")
    print("| way | ms | × floor | TB/s | rel. err vs float32 | compile s |\n|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['way']} | error: {r['error'][:120]} |")
        else:
            print(f"| {r['way']} | {r['ms']:.3f} | {r['x_floor']:.2f} | {r['tb_s']:.2f} | {r['rel_err']:.1e} | "
                  f"{r['compile_s']:.1f} |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "expert_slots.json"), "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
