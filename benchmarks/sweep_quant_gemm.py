"""Tiling sweep of the FP8 dense GEMM kernel (``dsv41_jax.kernels.quant_gemm_gpu.fp8_gemm``) at decode shapes, with
the ceilings it is judged against, in one process on the GPU:

    PYTHONUNBUFFERED=1 python benchmarks/sweep_quant_gemm.py --out DIR [--budget-s 270]
        [--baseline-module OLD/quant_gemm_gpu.py] [--plan confirm]
    python benchmarks/sweep_quant_gemm.py --smoke        # CPU: tiny shapes, interpret mode, no timing

Ceilings (device time from a profile, like every row): the copy bandwidth (read + write of a 4 GiB array), the
read-only bandwidth (a row sum over a 4 GiB int32 array) and, per weight shape, the same read-only row sum over
arrays of exactly the weight's byte count (R distinct arrays, together > the 50 MB L2): what one XLA kernel that
reads that many bytes reaches, launch ramp included.

Rows: for each (M, N x K) the earlier kernel (``--baseline-module``, its default tiling) and the configurations of
``CONFIGS`` (round 1 for every shape first, then the FP4 grouped rows ``FP4_CONFIGS``, then round 2, while
``--budget-s`` lasts); ``--plan confirm``: the committed defaults and a few neighbours (``CONFIRM``), fewer weight
sets per call, the earlier kernel at M = 1 only, no FP4 rows. Each configuration's R GEMMs
run on R distinct weight sets; all configurations of one shape are traced in one ``jax.profiler.trace``, each with
its own kernel name: a configuration's time is its kernels plus the XLA ops that follow them on the stream (the
split-K sum) up to the next configuration's first kernel, / R. Each row checks the kernel's output against float32.
% of 4.8 TB/s and % of the measured read-only bandwidth use the bytes that must move (weights + scales, activations,
output). Output: DIR/sweep.json (after each shape) and a table on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import sys
import tempfile
import time

SMOKE = "--smoke" in sys.argv
CONFIRM_PLAN = "--plan=confirm" in sys.argv or "confirm" in sys.argv  # read before argparse: module constants
ATTENTION_PLAN = "--plan=attention" in sys.argv or "attention" in sys.argv
if SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_quant_gemm as B  # noqa: E402  (random weights, device_time, rel_err)
from ceilings import copy_and_read_bandwidth  # noqa: E402
from dsv41_jax.kernels import quant_gemm_gpu as G  # noqa: E402

DATASHEET_BW = 4.8e12
SHAPES = [(96, 256), (64, 640)] if SMOKE else [(2304, 5120), (1280, 5120)]
MS = (1, 5) if SMOKE else (1, 8, 64)
if ATTENTION_PLAN:  # the attention's two large single FP8 gemvs at decode: wq_b [32768, 1280] and wo_b [5120, 8192]
    SHAPES = [(256, 160), (64, 1024)] if SMOKE else [(32768, 1280), (5120, 8192)]
    MS = (1,)


def _c(**kw):
    return kw


# (round, configuration) per token count; keys are fp8_gemm's tiling arguments (unset: fp8_default_tiling)
CONFIGS = {
    1: [(1, _c()),
        (1, _c(gemv=True, block_n=16, block_k=256, split_k=1, prefetch=8)),
        (1, _c(gemv=True, block_n=16, block_k=256, split_k=1, prefetch=4)),
        (1, _c(gemv=True, block_n=16, block_k=256, split_k=1, prefetch=8, num_warps=8)),
        (1, _c(gemv=True, block_n=16, block_k=512, split_k=1, prefetch=4, num_warps=8)),
        (1, _c(gemv=True, block_n=8, block_k=256, split_k=1, prefetch=8)),
        (1, _c(gemv=True, block_n=16, block_k=256, split_k=2, prefetch=8)),
        (1, _c(gemv=True, block_n=16, block_k=256, split_k=1, prefetch=0, num_stages=4)),
        (1, _c(gemv=False, block_m=16, block_n=16, block_k=256, split_k=1, prefetch=8)),
        (1, _c(gemv=False, block_m=16, block_n=32, block_k=256, split_k=4, prefetch=0, scale_side="w")),
        (2, _c(gemv=True, block_n=32, block_k=256, split_k=1, prefetch=4, num_warps=8)),
        (2, _c(gemv=True, block_n=8, block_k=512, split_k=1, prefetch=4)),
        (2, _c(gemv=True, block_n=16, block_k=128, split_k=1, prefetch=16, num_warps=8)),
        (2, _c(gemv=True, block_n=16, block_k=1024, split_k=1, prefetch=2, num_warps=8)),
        (2, _c(gemv=True, block_n=16, block_k=256, split_k=1, prefetch=12, num_warps=8)),
        (2, _c(gemv=True, block_n=16, block_k=256, split_k=1, prefetch=8, num_warps=2)),
        (2, _c(gemv=True, block_n=8, block_k=256, split_k=2, prefetch=8)),
        (2, _c(gemv=True, block_n=16, block_k=256, split_k=4, prefetch=5))],
    8: [(1, _c()),
        (1, _c(block_n=16, block_k=256, split_k=1, prefetch=8)),
        (1, _c(block_n=16, block_k=256, split_k=1, prefetch=4)),
        (1, _c(block_n=16, block_k=256, split_k=1, prefetch=8, num_warps=8)),
        (1, _c(block_n=32, block_k=256, split_k=1, prefetch=4)),
        (1, _c(block_n=16, block_k=256, split_k=2, prefetch=8)),
        (1, _c(block_n=16, block_k=256, split_k=1, prefetch=8, scale_side="w")),
        (1, _c(block_n=16, block_k=256, split_k=1, prefetch=0, num_stages=4)),
        (1, _c(block_n=16, block_k=512, split_k=1, prefetch=4, num_warps=8)),
        (2, _c(block_n=32, block_k=256, split_k=2, prefetch=4)),
        (2, _c(block_n=32, block_k=256, split_k=1, prefetch=8, num_warps=8)),
        (2, _c(block_n=16, block_k=128, split_k=1, prefetch=16, num_warps=8)),
        (2, _c(block_n=32, block_k=256, split_k=4, prefetch=5)),
        (2, _c(block_n=16, block_k=256, split_k=1, prefetch=8, num_warps=2)),
        (2, _c(block_n=64, block_k=256, split_k=4, prefetch=5))],
    64: [(1, _c()),
         (1, _c(block_n=64, block_k=256, split_k=4, prefetch=5)),
         (1, _c(block_n=64, block_k=256, split_k=2, prefetch=4)),
         (1, _c(block_n=32, block_k=256, split_k=2, prefetch=4)),
         (1, _c(block_n=128, block_k=256, split_k=4, prefetch=5, num_warps=8)),
         (1, _c(block_n=64, block_k=256, split_k=4, prefetch=5, num_warps=8)),
         (1, _c(block_n=64, block_k=128, split_k=4, prefetch=10, num_warps=8)),
         (1, _c(block_n=64, block_k=256, split_k=4, prefetch=0, num_stages=3)),
         (2, _c(block_n=128, block_k=256, split_k=8, prefetch=3, num_warps=8)),
         (2, _c(block_n=32, block_k=256, split_k=1, prefetch=4)),
         (2, _c(block_n=64, block_k=256, split_k=4, prefetch=5, scale_side="w")),
         (2, _c(block_n=16, block_k=256, split_k=1, prefetch=8)),
         (2, _c(block_n=128, block_k=256, split_k=2, prefetch=4, num_warps=8))],
}
# --plan confirm (the second call): the defaults chosen from the wide plan, its best M = 1 rows and neighbours of them
CONFIRM = {
    1: [(1, _c()),
        (1, _c(gemv=True, block_n=8, block_k=256, split_k=1, prefetch=8, num_warps=2)),
        (1, _c(gemv=True, block_n=8, block_k=256, split_k=1, prefetch=16))],
    8: [(1, _c())],
    64: [(1, _c())],
}
# --plan attention: the gemv default against taller column blocks and longer K steps. Measured in the release decode
# step on an H200 (benchmarks/RESULTS.md, 2026-12-02 11:44 UTC) the default took 16.9-17.4 µs for each of these
# 41.9 MB weights (50-52 % of 4.8 TB/s): wq_b's K = 1280 gives each 8-row program only 10 KB to stream (4096
# programs), so fewer, taller programs may pay; wo_b's K = 8192 gives 640 programs of 64 KB.
ATTENTION = {
    1: [(1, _c()),
        (1, _c(gemv=True, block_n=16, block_k=256, split_k=1, prefetch=5)),
        (1, _c(gemv=True, block_n=32, block_k=256, split_k=1, prefetch=5, num_warps=8)),
        (1, _c(gemv=True, block_n=16, block_k=256, split_k=1, prefetch=5, num_warps=8)),
        (1, _c(gemv=True, block_n=8, block_k=512, split_k=1, prefetch=4, num_warps=8)),
        (1, _c(gemv=True, block_n=8, block_k=256, split_k=1, prefetch=8, num_warps=2)),
        (1, _c(gemv=True, block_n=8, block_k=256, split_k=1, prefetch=8, group_view=True)),
        (1, _c(gemv=True, block_n=4, block_k=512, split_k=1, prefetch=4))],
}
if CONFIRM_PLAN:
    CONFIGS = CONFIRM
if ATTENTION_PLAN:
    CONFIGS = ATTENTION
if SMOKE and 8 in CONFIGS:
    CONFIGS[5] = CONFIGS.pop(8)
    for m in CONFIGS:
        CONFIGS[m] = [(r, dict(c, **({"block_k": 128} if "block_k" in c else {}))) for r, c in CONFIGS[m][:4]]

# FP4 grouped kernel (256 experts, 2304 x 5120, top-6 of random routing): configurations per token count
FP4_CONFIGS = {m: [_c(), _c(block_n=64, prefetch=2), _c(block_n=64, prefetch=4, num_warps=8),
                   _c(block_n=32, prefetch=4), _c(block_n=64, prefetch=8, num_warps=8)] for m in (1, 8)}
if SMOKE:
    FP4_CONFIGS = {1: [_c(), _c(block_n=32, block_k=128, prefetch=2)]}

OUT = {"meta": {}, "ceilings": {}, "rows": [], "fp4_rows": [], "errors": []}
T0 = time.time()


def log(*a):
    print(*a, flush=True)


REPS_BYTES = 96 << 20 if CONFIRM_PLAN else 256 << 20  # the weight sets of one call: > the 50 MB L2


def reps(nbytes):
    return 2 if SMOKE else int(min(24, max(2, -(-REPS_BYTES // nbytes))))


def dev_us(fn, args, r):
    """Device µs of one call / r (all kernels of the call), or NaN on CPU."""
    if SMOKE:
        jax.block_until_ready(fn(*args))
        return float("nan")
    tot, _ = B.device_time(fn, *args)
    return tot / r * 1e6


def ceilings():
    OUT["ceilings"].update(copy_and_read_bandwidth(lambda fn, args: dev_us(fn, args, 1),
                                                   (1 << 16) if SMOKE else (1 << 30)))
    log(f"copy {OUT['ceilings']['copy_bw'] / 1e12:.2f} TB/s (read + write), read-only "
        f"{OUT['ceilings']['read_bw'] / 1e12:.2f} TB/s (4 GiB), datasheet {DATASHEET_BW / 1e12:.1f} TB/s")
    for n_, k_ in SHAPES:  # a read-only kernel over exactly the weight's bytes
        r = reps(n_ * k_)
        arrs = [jnp.full((n_, k_ // 4), i + 1, jnp.int32) for i in range(r)]
        us = dev_us(jax.jit(lambda vs: [jnp.sum(v, axis=1) for v in vs]), (arrs,), r)
        OUT["ceilings"][f"read_{n_}x{k_}"] = dict(us=us, bw=n_ * k_ / (us * 1e-6))
        log(f"read-only row sum of {n_}x{k_} bytes: {us:.2f} µs = {n_ * k_ / (us * 1e-6) / 1e12:.2f} TB/s")


def trace_configs(calls):
    """calls: [(tag, fn, args)] already compiled -> {tag: (all-op ns, kernel ns)} from one trace: every stream
    event goes to the configuration whose kernel ran last before it (kernel names carry the tag)."""
    from jax.profiler import ProfileData

    d = tempfile.mkdtemp(prefix="qg_sweep_")
    try:
        with jax.profiler.trace(d):
            for _, fn, args in calls:
                jax.block_until_ready(fn(*args))
        pd = ProfileData.from_file(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
        evs = []
        for plane in pd.planes:
            if plane.name.startswith("/device:GPU"):
                for line in plane.lines:
                    if line.name.startswith("Stream"):
                        evs += [(ev.start_ns, ev.duration_ns, ev.name) for ev in line.events]
        res = {tag: [0.0, 0.0] for tag, _, _ in calls}
        cur = None
        for _, dur, nm in sorted(evs):
            hit = [tag for tag in res if tag in nm]
            if hit:
                cur = hit[0]
                res[cur][1] += dur
            if cur is not None:
                res[cur][0] += dur
        return res
    finally:
        shutil.rmtree(d, ignore_errors=True)


def shape_case(m, n, k, rounds, baseline, budget_s):
    key = jax.random.PRNGKey(m * 7 + n)
    wbytes = n * k + (-(-n // 32)) * (-(-k // 32))
    r = reps(wbytes)
    ws = [B.random_fp8(jax.random.fold_in(key, i), n, k) for i in range(r)]
    x = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
    nbytes = wbytes + m * k * 2 + m * n * 2
    want = jnp.einsum("mk,nk->mn", x.astype(jnp.float32), ws[0].dequantize(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    read_bw = OUT["ceilings"].get("read_bw", DATASHEET_BW)
    rows = []
    if baseline is not None and 0 in rounds and (m == 1 or not CONFIRM_PLAN):
        fn = jax.jit(lambda x, ws: [baseline.fp8_gemm(x, w.values, w.scales, interpret=SMOKE) for w in ws])
        us = dev_us(fn, (x, ws), r)
        rows.append(dict(m=m, n=n, k=k, cfg="earlier kernel (main)", tiling={}, us=us, kernel_us=float("nan"),
                         rel_err=B.rel_err(fn(x, ws)[0], want)))
    calls, meta = [], []
    for i, (rd, cfg) in enumerate(CONFIGS[m]):
        if rd not in rounds:
            continue
        if time.time() - T0 > budget_s:
            log(f"(budget: skipping the rest of M={m} {n}x{k} round {rd})")
            break
        tag = f"qgs{m}x{n}c{i}z"
        try:
            tiling = G.fp8_default_tiling(m, n, k, **cfg)
            fn = jax.jit(lambda x, ws, cfg=cfg, tag=tag: [G.fp8_gemm(x, w.values, w.scales, name=tag,
                                                                     interpret=SMOKE, **cfg) for w in ws])
            out0 = fn(x, ws)[0]  # compiles; the first GEMM checked against float32
            err = B.rel_err(out0, want)
            calls.append((tag, fn, (x, ws)))
            meta.append((tag, rd, cfg, tiling, err))
        except Exception as e:  # a configuration that does not compile is reported, not fatal
            OUT["errors"].append(f"M={m} {n}x{k} {cfg}: {type(e).__name__}: {str(e)[:300]}")
            log(f"M={m} {n}x{k} {cfg}: {type(e).__name__}: {str(e)[:200]}")
    times = trace_configs(calls) if (calls and not SMOKE) else {}
    for tag, rd, cfg, tiling, err in meta:
        tot, kern = times.get(tag, (float("nan"), float("nan")))
        rows.append(dict(m=m, n=n, k=k, round=rd, cfg=cfg, tiling=tiling, us=tot / r * 1e-3,
                         kernel_us=kern / r * 1e-3, rel_err=err))
    for row in rows:
        row.update(bytes=nbytes, reps=r, pct_datasheet=100 * nbytes / (row["us"] * 1e-6) / DATASHEET_BW,
                   pct_read=100 * nbytes / (row["us"] * 1e-6) / read_bw)
        OUT["rows"].append(row)
        t = row["tiling"]
        desc = (row["cfg"] if isinstance(row["cfg"], str) else
                f"{'gemv' if t['gemv'] else 'dot'} bm{t['block_m']} bn{t['block_n']} bk{t['block_k']} "
                f"sk{t['split_k']} pf{t['prefetch']} w{t['num_warps']} st{t['num_stages']} {t['scale_side']}"
                + (" [default]" if not row["cfg"] else ""))
        log(f"| {m} | {n}x{k} | {desc} | {row['us']:.2f} | {row['kernel_us']:.2f} | {row['pct_datasheet']:.0f}% | "
            f"{row['pct_read']:.0f}% | {row['rel_err']:.1e} |")


def fp4_case(m, cfg):
    from dsv41_jax.kernels import quant_gemm as QG

    e, n, k = (8, 96, 256) if SMOKE else (256, 2304, 5120)
    key = jax.random.PRNGKey(m)
    w = B.random_fp4(key, e, n, k)
    r = 2 if SMOKE else 8
    gss = [B._routing(jax.random.fold_in(key, i), m, e, 6) for i in range(r)]
    used = float(np.mean([int(jnp.sum(g > 0)) for g in gss]))
    a = m * 6
    x = jax.random.normal(key, (a, k), jnp.float32).astype(jnp.bfloat16)
    nbytes = used * (n * k // 2 + n * k // 32) + a * k * 2 + a * n * 2
    be = "pallas_gpu_interpret" if SMOKE else "pallas_gpu"
    fn = jax.jit(lambda x, gss, w: [QG.fp4_grouped(x, g, w, backend=be, tuning=cfg) for g in gss])
    got0 = fn(x, gss, w)[0]
    s0 = int(jnp.sum(gss[0]))
    want = jax.lax.ragged_dot(x.astype(jnp.float32), jnp.swapaxes(w.dequantize(jnp.float32), 1, 2), gss[0],
                              precision=jax.lax.Precision.HIGHEST)
    err = B.rel_err(got0[:s0], want[:s0])
    us = dev_us(fn, (x, gss, w), r)
    row = dict(m=m, experts=e, n=n, k=k, used_experts=used, cfg=cfg, us=us, bytes=nbytes, rel_err=err,
               pct_datasheet=100 * nbytes / (us * 1e-6) / DATASHEET_BW,
               pct_read=100 * nbytes / (us * 1e-6) / OUT["ceilings"].get("read_bw", DATASHEET_BW))
    OUT["fp4_rows"].append(row)
    log(f"| {m} | {e}, {n}x{k} | {used:.1f} | {cfg or 'default'} | {us:.1f} | {row['pct_datasheet']:.0f}% | "
        f"{row['pct_read']:.0f}% | {err:.1e} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop adding configurations after this long")
    ap.add_argument("--baseline-module", default=None)
    ap.add_argument("--plan", default="wide", choices=("wide", "confirm", "attention"),
                    help="wide: CONFIGS, R GEMMs on 256 MB of weights, then the FP4 rows; confirm: CONFIRM, 96 MB, "
                         "baselines at M = 1 only, no FP4 rows; attention: ATTENTION at wq_b / wo_b's shapes, M = 1, "
                         "no FP4 rows")
    args = ap.parse_args()
    baseline = None
    if args.baseline_module:
        import importlib.util

        spec = importlib.util.spec_from_file_location("quant_gemm_gpu_before", args.baseline_module)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    OUT["meta"] = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), jax=jax.__version__,
                       devices=[d.device_kind for d in jax.devices()])
    log(f"jax {jax.__version__} on {OUT['meta']['devices']}")

    def save():
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "sweep.json"), "w") as f:
                json.dump(OUT, f, indent=1, default=str)

    try:
        ceilings()
    except Exception as e:
        OUT["errors"].append(f"ceilings: {type(e).__name__}: {e}")
        log(f"ceilings FAILED: {e}")
    save()
    log("| M | N x K | configuration | device µs (all ops) | kernel µs | % of 4.8 TB/s | % of read-only BW | "
        "rel err |\n|---|---|---|---:|---:|---:|---:|---:|")
    for rounds in ({0, 1}, {2}):
        if rounds == {2} and args.plan == "wide":  # the FP4 grouped kernel between the two dense rounds
            log("\n| M (x6 rows) | E, N x K | used experts | configuration | device µs (all ops) | % of 4.8 TB/s | "
                "% of read-only BW | rel err |\n|---|---|---:|---|---:|---:|---:|---:|")
            for m, cfgs in FP4_CONFIGS.items():
                for cfg in cfgs:
                    if time.time() - T0 > args.budget_s:
                        break
                    try:
                        fp4_case(m, cfg)
                    except Exception as e:
                        OUT["errors"].append(f"fp4 M={m} {cfg}: {type(e).__name__}: {str(e)[:300]}")
                        log(f"fp4 M={m} {cfg} FAILED: {type(e).__name__}: {str(e)[:200]}")
            save()
            log("")
        for n, k in SHAPES:
            for m in MS:
                try:
                    shape_case(m, n, k, rounds, baseline, args.budget_s)
                except Exception as e:
                    OUT["errors"].append(f"M={m} {n}x{k}: {type(e).__name__}: {e}")
                    log(f"M={m} {n}x{k} FAILED: {type(e).__name__}: {e}")
                save()
    bad = [r for r in OUT["rows"] + OUT["fp4_rows"] if not r["rel_err"] < 8e-3]
    log(f"\nerrors: {OUT['errors'] or 'none'}; rows over 8e-3 rel err: {len(bad)}; "
        f"elapsed {time.time() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
