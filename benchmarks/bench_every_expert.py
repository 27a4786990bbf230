"""A decode batch's release FP4 routed experts as every expert on every token vs the grouped FP4 kernel path, and the
GEMM-input FP8 rounding as one Pallas kernel vs XLA's two, at the 40-layer bench model's shapes, same process.

    PYTHONUNBUFFERED=1 python benchmarks/bench_every_expert.py --out DIR [--budget-s 120]
    python benchmarks/bench_every_expert.py --smoke      # CPU: tiny sizes, interpret mode, no timing

Parts:
  ceilings  copy (read + write) and read-only bandwidth of a 4 GiB int32 buffer, device time (``ceilings.py``).
  experts   the routed experts of ``batch`` tokens (top-6 of 16 experts of 2304 x 5120, FP4 e2m1 + ue8m0 per 32,
            uniform random picks; bf16 x): ``ops.moe.routed_ragged`` on the grouped kernel (the release path before:
            input rounding, sort, tile table, three grouped GEMMs, FP8 rounding of the activations, scatter-add) and
            ``inference.moe.routed_fp4_every_expert`` (dense routing weights, the gate / up kernel with the SwiGLU and
            the activations' FP8 rounding in its epilogue, the down kernel). Each call runs R distinct expert
            stacks with their own routings (> the 50 MB L2); device µs of the whole call / R, of the FP4 kernels
            alone, launches per call / R; bytes = the used experts' packed bytes + scales; % of this process's
            read-only bandwidth and of 4.8 TB/s. Checked: the two paths' outputs (bf16 inputs; rel err).
  round     ``fake_quant_gemm_input_fp8(x, 32)`` (XLA: block amax + rounding) vs ``quant_gemm.fp8_round`` (one Pallas
            kernel) on the decode step's GEMM inputs ([M, 5120], [M, 2304], [M, 8192], [M, 1280] at M = 32 and 1),
            R distinct inputs a call: device µs per rounding, launches; bit-for-bit check ON THE GPU on inputs spanning
            the float32 exponent range with zeros, huge values and inf blocks (NaN blocks reported apart).
Output: DIR/bench_every_expert.json (written after each part), the tables on stdout.
"""

from __future__ import annotations

import argparse
import datetime
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import bench_quant_gemm as B  # noqa: E402  (random_fp4, _routing, device_time, rel_err)
from ceilings import copy_and_read_bandwidth  # noqa: E402
from dsv41_jax.inference.moe import routed_fp4_every_expert  # noqa: E402
from dsv41_jax.kernels import quant_gemm as QG  # noqa: E402
from dsv41_jax.ops.linear import Fp8GemmInput  # noqa: E402
from dsv41_jax.ops.moe import routed_ragged  # noqa: E402
from dsv41_jax.ops.quant import fake_quant_gemm_input_fp8  # noqa: E402

DATASHEET_BW = 4.8e12
BE = "pallas_gpu_interpret" if SMOKE else "pallas_gpu"
E_, F_, D_, TOPK, LIMIT = (8, 64, 96, 2, 10.0) if SMOKE else (16, 2304, 5120, 6, 10.0)
R = 2 if SMOKE else 4
# (gate / up, down) tilings of the every-expert kernels tried at the first batch (the defaults: 64-row blocks, 256-wide
# K steps, 4 warps, 3 stages): more programs per multiprocessor, more warps, deeper pipelines
EVERY_TUNINGS = [] if SMOKE else [(dict(block_n=32), dict(block_n=32)), (dict(num_warps=8), dict(num_warps=8)),
                                  (dict(block_k=128, num_stages=4), dict(block_k=128, num_stages=4)),
                                  (dict(block_n=32, block_k=512, num_stages=2), dict(block_n=32))]
OUT: dict = {"meta": {}, "ceilings": {}, "experts": [], "round": [], "checks": [], "errors": []}
T0 = time.time()


def log(*a):
    print(*a, flush=True)


def device(fn, args):
    """(total µs, {kernel name: µs}) of one call; NaN / {} on CPU."""
    jax.block_until_ready(fn(*args))
    if SMOKE:
        return float("nan"), {}
    tot, by_name = B.device_time(fn, *args)
    return tot * 1e6, {k: v * 1e6 for k, v in by_name.items()}


def pct(nbytes, us, bw):
    rate = nbytes / (us * 1e-6)
    return dict(tb_s=rate / 1e12, pct_read=100 * rate / bw.get("read_bw", DATASHEET_BW),
                pct_datasheet=100 * rate / DATASHEET_BW)


def experts_part(bw, batches):
    key = jax.random.PRNGKey(3)
    stacks = []
    for i in range(R):
        k = jax.random.fold_in(key, i)
        w1, w3 = B.random_fp4(jax.random.fold_in(k, 1), E_, F_, D_), B.random_fp4(jax.random.fold_in(k, 3), E_, F_, D_)
        w2 = B.random_fp4(jax.random.fold_in(k, 2), E_, D_, F_)
        stacks.append(tuple(Fp8GemmInput(w, BE) for w in (w1, w2, w3)))
    per_expert = 3 * F_ * D_ * (1 / 2 + 1 / 32)
    for m in batches:
        xs, wts, idxs, used = [], [], [], []
        for i in range(R):
            k = jax.random.fold_in(key, 1000 * m + i)
            xs.append(jax.random.normal(k, (m, D_), jnp.float32).astype(jnp.bfloat16) * 2)
            logits = jax.random.normal(jax.random.fold_in(k, 1), (m, E_))
            w, ix = jax.lax.top_k(logits, TOPK)
            wts.append(jax.nn.softmax(w, axis=-1))
            idxs.append(ix.astype(jnp.int32))
            used.append(len(np.unique(np.asarray(ix))))
        nbytes = float(np.mean(used)) * per_expert

        def grouped(xs, wts, idxs, stacks):
            return [routed_ragged(x, w, ix, *s, LIMIT) for x, w, ix, s in zip(xs, wts, idxs, stacks)]

        def every(up=None, down=None):
            def fn(xs, wts, idxs, stacks):
                return [routed_fp4_every_expert(x, w, ix, *s, LIMIT, BE, up_tuning=up, down_tuning=down)
                        for x, w, ix, s in zip(xs, wts, idxs, stacks)]
            return fn

        base = None
        for label, fn, pat in ([("grouped FP4 kernel path (before)", grouped, "fp4_grouped"),
                                ("every expert on every token", every(), "fp4_every")] +
                               [(f"every expert, up {u} / down {d}", every(u, d), "fp4_every")
                                for u, d in (EVERY_TUNINGS if m == batches[0] else [])] +
                               [("grouped FP4 kernel path, again", grouped, "fp4_grouped")]):
            if time.time() - T0 > BUDGET:
                OUT["errors"].append(f"experts batch {m} {label}: skipped, budget")
                continue
            try:
                f = jax.jit(fn)
                out = jax.block_until_ready(f(xs, wts, idxs, stacks))
                if base is None:
                    ref = out
                err = B.rel_err(out[0], ref[0])
                tot, by = device(f, (xs, wts, idxs, stacks))
                kern = sum(v for n, v in by.items() if pat in n)
                launches = None
                if not SMOKE:
                    text = f.lower(xs, wts, idxs, stacks).compile().as_text()
                    launches = text.count("fusion(") + text.count("custom-call(")  # a rough per-call count
            except Exception as e:  # noqa: BLE001
                OUT["errors"].append(f"experts batch {m} {label}: {type(e).__name__}: {str(e)[:400]}")
                log(f"experts batch {m} {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            row = dict(batch=m, variant=label, used_experts=float(np.mean(used)), bytes=nbytes, call_us=tot / R,
                       kernel_us=kern / R, rel_err_vs_grouped=err, hlo_launch_ops=launches,
                       kernels={n: v / R for n, v in sorted(by.items(), key=lambda t: -t[1])[:12]})
            if bw:
                row.update(call=pct(nbytes, tot / R, bw), kernel=pct(nbytes, kern / R, bw))
            base = base or row
            row["x_grouped_call"] = base["call_us"] / row["call_us"] if row["call_us"] == row["call_us"] else None
            OUT["experts"].append(row)
            OUT["checks"].append(dict(what=f"experts batch {m} {label} vs grouped path, bf16", rel_err=err))
            log(f"| {m} | {label} | call {row['call_us']:.1f} µs ({row.get('call', {}).get('pct_read', 0):.0f}% of "
                f"read-only) | FP4 kernels {row['kernel_us']:.1f} µs ({row.get('kernel', {}).get('pct_read', 0):.0f}%)"
                f" | x {row['x_grouped_call'] or 0:.2f} | err {err:.1e} |")
            save()


def _inputs(rng, m, k):
    x = rng.standard_normal((m, k)).astype(np.float32) * np.exp2(rng.integers(-60, 60, (m, k)))
    x[0, :32] = 0.0
    x[0, 32:64] = -0.0
    x[-1, 64:96] = np.float32(3e38) * np.sign(rng.standard_normal(32))
    x[-1, 100] = np.inf
    return x


def round_part(bw):
    rng = np.random.default_rng(5)
    for m in (32, 1):
        for k in (5120, 2304, 8192, 1280):
            if time.time() - T0 > BUDGET:
                OUT["errors"].append(f"round {m}x{k}: skipped, budget")
                continue
            try:
                xs = [jnp.asarray(_inputs(rng, m, k)).astype(jnp.bfloat16) for _ in range(8)]
                xla = jax.jit(lambda xs: [fake_quant_gemm_input_fp8(x, 32) for x in xs])
                ker = jax.jit(lambda xs: [QG.fp8_round(x, backend=BE) for x in xs])
                a, b = jax.block_until_ready(xla(xs)), jax.block_until_ready(ker(xs))
                same = all(np.array_equal(np.asarray(p.astype(jnp.float32)).view(np.uint32),
                                          np.asarray(q.astype(jnp.float32)).view(np.uint32)) for p, q in zip(a, b))
                xn = xs[0].at[0, 200].set(jnp.nan)  # a NaN block: both NaN throughout where XLA propagates NaN
                na, nb = np.asarray(fake_quant_gemm_input_fp8(xn, 32), np.float32), \
                    np.asarray(QG.fp8_round(xn, backend=BE), np.float32)
                nan_same = bool(np.array_equal(np.isnan(na), np.isnan(nb)))
                t_x, by_x = device(xla, (xs,))
                t_k, by_k = device(ker, (xs,))
            except Exception as e:  # noqa: BLE001
                OUT["errors"].append(f"round {m}x{k}: {type(e).__name__}: {str(e)[:400]}")
                log(f"round {m}x{k}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            row = dict(m=m, k=k, xla_us=t_x / 8, kernel_us=t_k / 8, xla_kernels=len(by_x), kernel_kernels=len(by_k),
                       bit_exact=same, nan_blocks_same=nan_same, x_xla=t_x / t_k if t_k == t_k else None)
            OUT["round"].append(row)
            OUT["checks"].append(dict(what=f"round {m}x{k} kernel vs XLA on the GPU", bit_exact=same,
                                      nan_blocks_same=nan_same))
            log(f"| round {m} x {k} | XLA {row['xla_us']:.2f} µs | kernel {row['kernel_us']:.2f} µs | x "
                f"{row['x_xla'] or 0:.2f} | bit exact {same} | NaN blocks same {nan_same} |")
            save()


def save():
    if ARGS.out:
        os.makedirs(ARGS.out, exist_ok=True)
        with open(os.path.join(ARGS.out, "bench_every_expert.json"), "w") as f:
            json.dump(OUT, f, indent=1, default=str)


def main():
    global ARGS, BUDGET
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=120.0, help="rows started after this many seconds skip")
    ap.add_argument("--batches", default="32,8", help="experts: token counts")
    ARGS = ap.parse_args()
    BUDGET = ARGS.budget_s
    OUT["meta"] = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       device=str(jax.devices()[0]), jax=jax.__version__, argv=sys.argv[1:],
                       experts=E_, f=F_, d=D_, top_k=TOPK, r=R)
    log(OUT["meta"])
    bw = {}
    if not SMOKE:
        bw = copy_and_read_bandwidth(lambda fn, a: device(fn, a)[0])
        OUT["ceilings"] = bw
        log(f"ceilings: copy {bw['copy_bw'] / 1e12:.2f} TB/s, read-only {bw['read_bw'] / 1e12:.2f} TB/s")
    experts_part(bw, [int(b) for b in ARGS.batches.split(",")])
    round_part(bw)
    save()
    log(f"done in {time.time() - T0:.0f} s; errors: {OUT['errors']}")


ARGS = None
BUDGET = 120.0

if __name__ == "__main__":
    main()
