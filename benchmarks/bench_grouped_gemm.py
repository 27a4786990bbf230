#!/usr/bin/env python
"""The routed experts' grouped GEMMs at the train step's shapes: the XLA blocked form (each block's expert weight
gathered, one batched cuBLAS GEMM, per-block weight gradients summed by a one-hot GEMM) against the Pallas grouped
kernels that read the weights in place (``kernels.grouped_gemm_gpu``), forward and both backward GEMMs, and a sweep
of the kernels' tiles; likewise JAX's Mosaic GPU ragged-dot kernels (``kernels.grouped_gemm_mgpu``, Hopper only).
One process, against the bf16 matmul rate measured first.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/bench_grouped_gemm.py --out DIR --deadline-s 60
    python benchmarks/bench_grouped_gemm.py --smoke --out DIR        # CPU, interpret mode, tiny shapes

Shapes (``fullwidth4`` at batch 4 x 1024, top-6 of 16 experts): M = 24,576 routed rows, routing drawn at random
(uneven groups), w1 / w3 [16, 2304, 5120] and w2 [16, 5120, 2304]. First, per projection shape, each implementation's
forward + both backward GEMMs through autodiff (host-timed, median of ``--reps`` calls after a warm-up) and its
errors against float32 on the same upcast inputs (the XLA blocked form in float32 at HIGHEST precision, tested equal
to ``ragged_dot`` on CPU): output, dX, dW. Then each kernel alone over candidate tiles (``--deadline-s`` stops the
sweep; the first part alone took ≈ 40 s per shape on an H200, mostly compiles). The best tile configuration per
kernel (by the summed time over both projection shapes) is written to DIR/grouped_tiles_best.json (and
DIR/mgpu_tiles_best.json), which ``bench_train_ablation.py --grouped-tiles`` (``--mgpu-tiles``) reads. Rows go to
DIR/bench_grouped_gemm.jsonl as they are measured.
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
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_train import matmul_rate  # noqa: E402

from dsv41_jax.kernels import grouped_gemm_gpu as gg  # noqa: E402
from dsv41_jax.kernels import grouped_gemm_mgpu as gm  # noqa: E402
from dsv41_jax.ops.moe import blocked_grouped_matmul  # noqa: E402

_T0 = time.time()

# candidates per kernel kind (block_m is shared: the layout); the first entry of each is GROUPED_TILES' default
CANDIDATES = {
    "fwd": [dict(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
            dict(block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
            dict(block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4),
            dict(block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=2),
            dict(block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4)],
    "dx": [dict(block_n=64, block_k=128, group_m=8, num_warps=8, num_stages=3),
           dict(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
           dict(block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
           dict(block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4),
           dict(block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4)],
    "dw": [dict(block_n=128, block_k=128, block_r=64, num_warps=8, num_stages=3),
           dict(block_n=128, block_k=128, block_r=32, num_warps=8, num_stages=4),
           dict(block_n=64, block_k=128, block_r=64, num_warps=4, num_stages=3),
           dict(block_n=128, block_k=256, block_r=32, num_warps=8, num_stages=3),
           dict(block_n=64, block_k=64, block_r=64, num_warps=4, num_stages=3)],
}


# JAX's Mosaic GPU ragged-dot kernels (kernels.grouped_gemm_mgpu): candidates per product, the first the default
MGPU_CANDIDATES = [dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1),
                   dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=4),
                   dict(block_m=128, block_n=256, block_k=64, max_concurrent_steps=3, grid_block_n=1),
                   dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=5, grid_block_n=2)]


def log(msg: str) -> None:
    print(f"[grouped {time.time() - _T0:6.1f}s] {msg}", flush=True)


def timed(fn, *args, reps: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def layout(sizes, m: int, g: int, block: int):
    """The padded block layout of ``ops.moe.blocked_grouped_matmul`` for ``sizes`` (host numpy)."""
    padded = -(-sizes // block) * block
    ends = np.cumsum(padded)
    n_blocks = -(-m // block) + g
    block_group = np.minimum(np.searchsorted(ends, np.arange(n_blocks) * block, side="right"), g - 1)
    return (jnp.asarray(block_group, jnp.int32), jnp.asarray(ends[-1:] // block, jnp.int32),
            jnp.asarray(ends - padded, jnp.int32), jnp.asarray(padded, jnp.int32), n_blocks)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--rows", type=int, default=24576)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--d", type=int, default=5120)
    p.add_argument("--f", type=int, default=2304)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--deadline-s", type=float, default=60.0, help="no candidate starts after this")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    smoke = SMOKE or args.smoke
    if smoke:
        args.rows, args.experts, args.d, args.f, args.reps = 256, 4, 256, 256, 1
    interpret = jax.default_backend() == "cpu"
    os.makedirs(args.out, exist_ok=True)
    sink = os.path.join(args.out, "bench_grouped_gemm.jsonl")

    def emit(rec):
        with open(sink, "a") as f:
            f.write(json.dumps(rec) + "\n")

    dev = jax.devices()[0]
    peak = matmul_rate(512 if smoke else 8192)
    emit({"device": dev.device_kind, "jax": jax.__version__, "rows": args.rows, "experts": args.experts,
          "d": args.d, "f": args.f, "matmul_bf16_flops_measured": peak, "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())})
    log(f"{dev.device_kind}: bf16 matmul {peak / 1e12:.1f} TFLOP/s")

    rng = np.random.default_rng(0)
    m, g = args.rows, args.experts
    # uneven routing: expert popularity from a Dirichlet draw
    sizes = np.bincount(rng.choice(g, size=m, p=rng.dirichlet(np.full(g, 4.0))), minlength=g).astype(np.int32)
    group_sizes = jnp.asarray(sizes)
    bm = gg.GROUPED_TILES["block_m"]
    block_group, n_live, row_start, row_count, n_blocks = layout(sizes, m, g, bm)
    mp = n_blocks * bm
    best = {"block_m": bm}
    shapes = {"w13": (args.f, args.d), "w2": (args.d, args.f)}  # (N, K)
    ops = {}
    for name, (n, k) in shapes.items():
        kx, kw, kc = jax.random.split(jax.random.PRNGKey(hash(name) % 2 ** 31), 3)
        rows = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (g, n, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        ct = jax.random.normal(kc, (m, n), jnp.bfloat16)
        # the padded operands the kernels see (rows at the start of each group's run, zeros elsewhere)
        dest = np.concatenate([np.arange(s) + st for s, st in zip(sizes, np.asarray(row_start))]).astype(np.int32)
        buf = jnp.zeros((mp, k), jnp.bfloat16).at[dest].set(rows)
        dbuf = jnp.zeros((mp, n), jnp.bfloat16).at[dest].set(ct)
        ops[name] = dict(n=n, k=k, rows=rows, w=w, ct=ct, buf=buf, dbuf=dbuf)
        flops = 2 * m * n * k
        # the XLA blocked form, fwd + both backward GEMMs through autodiff (as in the step)
        f_blocked = jax.jit(jax.value_and_grad(
            lambda r, w_: jnp.sum(blocked_grouped_matmul(r, w_, group_sizes, block=512).astype(jnp.float32)
                                  * ct.astype(jnp.float32)), (0, 1)))
        f_kernel = jax.jit(jax.value_and_grad(
            lambda r, w_: jnp.sum(blocked_grouped_matmul(r, w_, group_sizes, kernel="interpret" if interpret
                                                         else "gpu").astype(jnp.float32)
                                  * ct.astype(jnp.float32)), (0, 1)))
        f_ref = jax.jit(jax.value_and_grad(
            lambda r, w_: jnp.sum(blocked_grouped_matmul(r, w_, group_sizes, block=512,
                                                         precision=jax.lax.Precision.HIGHEST)
                                  * ct.astype(jnp.float32)), (0, 1)))
        f_mgpu = jax.jit(jax.value_and_grad(
            lambda r, w_: jnp.sum(gm.ragged_gemm(r, w_, group_sizes, "reference" if interpret else "mgpu",
                                                 gm.tiles_key(gm.MGPU_TILES)).astype(jnp.float32)
                                  * ct.astype(jnp.float32)), (0, 1)))
        row = {"what": "fwd+bwd", "shape": name, "N": n, "K": k, "flops_fwd_bwd": 3 * flops}
        ref = f_ref(rows.astype(jnp.float32), w.astype(jnp.float32))
        y_ref = blocked_grouped_matmul(rows.astype(jnp.float32), w.astype(jnp.float32), group_sizes, block=512,
                                       precision=jax.lax.Precision.HIGHEST)
        forwards = {"blocked_xla": lambda r, w_: blocked_grouped_matmul(r, w_, group_sizes, block=512),
                    "grouped_kernel": lambda r, w_: blocked_grouped_matmul(
                        r, w_, group_sizes, kernel="interpret" if interpret else "gpu"),
                    "mgpu_ragged": lambda r, w_: gm.ragged_gemm(r, w_, group_sizes,
                                                                "reference" if interpret else "mgpu",
                                                                gm.tiles_key(gm.MGPU_TILES))}
        for label, fn in (("blocked_xla", f_blocked), ("grouped_kernel", f_kernel), ("mgpu_ragged", f_mgpu)):
            try:
                t = timed(fn, rows, w, reps=args.reps)
                got = fn(rows, w)
                row[label] = {"ms": t * 1e3, "tflops": 3 * flops / t / 1e12, "of_matmul": 3 * flops / t / peak,
                              "rel_err_y": rel(jax.jit(forwards[label])(rows, w), y_ref),
                              "rel_err_drows": rel(got[1][0], ref[1][0]),
                              "rel_err_dw": rel(got[1][1], ref[1][1])}
            except Exception as e:
                row[label] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
        del ref, y_ref
        emit(row)
        log(json.dumps(row))

    def sweep(what: str, kind: str, candidates, product) -> dict | None:
        """Time each candidate tile set of one product over both shapes (``product(cfg, o)`` -> (jitted fn, its
        arguments)); a row per candidate; the fastest set by the summed time, or None if none ran."""
        results = []
        for cfg in candidates:
            if time.time() - _T0 > args.deadline_s:
                emit({"what": what, "kind": kind, "cfg": cfg, "error": "skipped: deadline"})
                continue
            row = {"what": what, "kind": kind, "cfg": cfg, "ms": {}}
            try:
                total = 0.0
                for name, o in ops.items():
                    fn, a = product(cfg, o)
                    t = timed(fn, *a, reps=args.reps)
                    row["ms"][name] = t * 1e3
                    row.setdefault("tflops", {})[name] = 2 * m * o["n"] * o["k"] / t / 1e12
                    total += t
                row["total_ms"] = total * 1e3
                results.append((total, cfg))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:800]}"
            emit(row)
            log(json.dumps(row))
        return min(results, key=lambda r: r[0])[1] if results else None

    # per-kernel tile sweep (each kernel alone, both shapes)
    def grouped_product(kind):
        def product(cfg, o):
            c = dict(cfg)
            if kind == "dw":
                c["block_n"] = min(c["block_n"], o["n"])
                return jax.jit(lambda dy, x: gg.grouped_gemm_dw(
                    dy, x, row_start, row_count, n_groups=g, **c, interpret=interpret)), (o["dbuf"], o["buf"])
            if kind == "fwd":
                return jax.jit(lambda x, w_: gg.grouped_gemm_fwd(
                    x, w_, block_group, n_live, block_m=bm, **c, interpret=interpret)), (o["buf"], o["w"])
            return jax.jit(lambda dy, w_: gg.grouped_gemm_dx(
                dy, w_, block_group, n_live, block_m=bm, **c, interpret=interpret)), (o["dbuf"], o["w"])
        return product

    for kind in ("fwd", "dx", "dw"):
        best[kind] = sweep("sweep", kind, CANDIDATES[kind], grouped_product(kind)) or dict(gg.GROUPED_TILES[kind])

    # the Mosaic GPU kernels alone, per product (GPU only: no interpret mode)
    def mgpu_product(kind):
        def product(cfg, o):  # the import inside: where Mosaic GPU is missing, each row records the error
            from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

            if kind == "fwd":
                return jax.jit(lambda x, w_: ragged_dot_mgpu.ragged_dot(
                    x, w_, group_sizes=group_sizes, transpose_rhs=True, **cfg)), (o["rows"], o["w"])
            if kind == "dx":
                return jax.jit(lambda dy, w_: ragged_dot_mgpu.ragged_dot(
                    dy, w_, group_sizes=group_sizes, transpose_rhs=False, **cfg)), (o["ct"], o["w"])
            return jax.jit(lambda dy, x: transposed_ragged_dot_mgpu.transposed_ragged_dot(
                dy, x, group_sizes=group_sizes, **cfg)), (o["ct"], o["rows"])
        return product

    best_mgpu = {}
    for kind in ("fwd", "dx", "dw") if not interpret else ():
        best_mgpu[kind] = sweep("sweep_mgpu", kind, MGPU_CANDIDATES, mgpu_product(kind)) or dict(gm.MGPU_TILES[kind])
    if best_mgpu:
        with open(os.path.join(args.out, "mgpu_tiles_best.json"), "w") as f:
            json.dump(best_mgpu, f)
        emit({"what": "best_mgpu", "tiles": best_mgpu})
        log(f"best mgpu tiles: {best_mgpu}")
    with open(os.path.join(args.out, "grouped_tiles_best.json"), "w") as f:
        json.dump(best, f)
    emit({"what": "best", "tiles": best})
    log(f"best tiles: {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
