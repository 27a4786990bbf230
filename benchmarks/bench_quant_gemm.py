"""GEMMs on the release's stored FP8 / FP4 weights at decode shapes: the Pallas GPU kernels
(``dsv41_jax.kernels.quant_gemm``) vs the plain-JAX dequantise-then-GEMM vs a bf16 GEMM of the same shape, same run.

    PYTHONUNBUFFERED=1 python benchmarks/bench_quant_gemm.py --out DIR     # on the GPU
    python benchmarks/bench_quant_gemm.py --smoke                          # CPU: tiny sizes, interpret mode
    ... --baseline-module OLD/quant_gemm_gpu.py    # also time an earlier version of the kernels ("before")
    ... --quick                                    # fewer shapes, kernels only (no plain-JAX / bf16 baselines)

Sections (each guarded: a failing section is reported and the rest still runs):
  ceiling  measured HBM copy bandwidth (read + write bytes of a 4 GiB copy): the denominator of every % below
           (the datasheet's 4.8 TB/s is printed beside it).
  check    kernels vs the reference ON THE GPU (bf16 activations; FP8 dense and FP4 grouped, ragged / empty groups).
  dense    FP8 32x32-block weights [N, K] at M = 1, 8, 32, 64 tokens, the release's projection shapes
           (wq_a 1280x5120, wq_b 32768x1280, shared expert w1 2304x5120 / w2 5120x2304).
  grouped  FP4 routed experts (256 experts, width 2304, hidden 5120, top-6 of random routing) at M = 1..64: the
           kernel reads only the experts that received rows; baselines: the engine's plain-JAX path (gather the
           used experts' stored bytes, dequantise, batched GEMM over expert slots) and the same with bf16 experts.
  tune     a few block configurations of each kernel at decode shapes.
Order run: ceiling, check, grouped, dense, tune (``--sections``); ``--ms`` picks the token counts.
Bytes counted = bytes the GEMM must read (weights + scales of what it uses, activations) + output written.
Timing: each jitted call runs R independent GEMMs on R distinct weight sets (together larger than the 50 MB L2),
divided by R. The tables' µs are DEVICE time: one call traced with ``jax.profiler.trace``, the durations of every
kernel on the device's streams summed (the GEMM kernel plus the small XLA ops around it; launch gaps not counted);
the host-clock median of 5 calls is kept as ``wall_us`` ("kernel wall µs"). Every row also checks the kernel's
result against float32 (``rel_err``). Results: DIR/results.json, written after each section (and the tables on
stdout).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

SMOKE = "--smoke" in sys.argv
QUICK = "--quick" in sys.argv  # a short re-measurement: fewer shapes, no plain-JAX / bf16 baselines
if SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsv41_jax.checkpoint import names as N  # noqa: E402
from dsv41_jax.checkpoint.quantized import QuantizedTensor  # noqa: E402
from dsv41_jax.kernels import quant_gemm as QG  # noqa: E402

BE = "pallas_gpu_interpret" if SMOKE else "pallas_gpu"
RESULTS: dict = {"rows": [], "errors": [], "checks": [], "tune": []}
BF = jnp.bfloat16
DATASHEET_BW = 4.8e12
MS = (1, 8, 32, 64)  # decode tokens per step (--ms)


def log(*a):
    print(*a, flush=True)


def timeit(fn, *args, reps=5):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


PROFILE = not SMOKE  # device time from a profile of one call (GPU); the smoke run on CPU has no device events
_TRACE_N = [0]


def device_time(fn, *args):
    """(total, by kernel name) device seconds of one call of ``fn``, summed over the device's stream events of a
    ``jax.profiler.trace`` (kernels only: the launch gaps between them are not counted)."""
    import glob
    import shutil
    import tempfile

    from jax.profiler import ProfileData

    jax.block_until_ready(fn(*args))
    d = tempfile.mkdtemp(prefix="qg_trace_")
    try:
        with jax.profiler.trace(d):
            jax.block_until_ready(fn(*args))
        path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
        pd = ProfileData.from_file(path)
        by_name: dict = {}
        for plane in pd.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if not line.name.startswith("Stream"):  # "XLA Ops" / "XLA Modules" lines repeat the same time
                    continue
                for ev in line.events:
                    by_name[ev.name] = by_name.get(ev.name, 0.0) + ev.duration_ns * 1e-9
        return sum(by_name.values()), by_name
    finally:
        shutil.rmtree(d, ignore_errors=True)


def measure(fn, args, r, kernel_names=()):
    """Per-GEMM times of ``fn`` (R GEMMs per call): wall (host clock around the call, median of 5; includes the
    launch gaps) and device (all kernels of the call) / R, plus the named kernels' share."""
    out = dict(wall_us=timeit(fn, *args) / r * 1e6)
    if PROFILE:
        try:
            tot, by_name = device_time(fn, *args)
            out["dev_us"] = tot / r * 1e6
            out["kernel_dev_us"] = sum(t for nm, t in by_name.items()
                                       if any(k in nm for k in kernel_names)) / r * 1e6
            out["top_events"] = sorted(((round(t / r * 1e6, 2), nm[:80]) for nm, t in by_name.items()),
                                       reverse=True)[:4]
        except Exception as e:  # a profile that fails leaves the wall time
            out["profile_error"] = f"{type(e).__name__}: {e}"[:300]
    out["us"] = out.get("dev_us", out["wall_us"])
    return out


BASELINE = None  # an earlier version of the GPU kernels module (--baseline-module), timed in the same run


def section(name):
    def deco(f):
        def run(*a, **k):
            log(f"\n## {name}")
            try:
                return f(*a, **k)
            except Exception as e:  # report and go on
                RESULTS["errors"].append(f"{name}: {type(e).__name__}: {e}")
                log(f"[{name}] FAILED: {type(e).__name__}: {e}")
                traceback.print_exc()
        return run
    return deco


def random_fp8(key, n, k):
    """A random FP8 32x32-block weight made on device (random e4m3 bytes, finite; scales near 2^-8)."""
    k1, k2 = jax.random.split(key)
    v = jax.random.randint(k1, (n, k), 0, 256, jnp.int32)
    v = jnp.where((v & 127) == 127, v - 1, v).astype(jnp.uint8)  # no NaN codes
    s = jax.random.randint(k2, (-(-n // 32), -(-k // 32)), 115, 122, jnp.int32).astype(jnp.uint8)
    return QuantizedTensor(v, s, N.FP8_BLOCK, (n, k), (32, 32))


def random_fp4(key, e, n, k):
    k1, k2 = jax.random.split(key)
    v = jax.random.randint(k1, (e, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    s = jax.random.randint(k2, (e, n, k // 32), 118, 124, jnp.int32).astype(jnp.uint8)
    return QuantizedTensor(v, s, N.FP4_ROWS, (e, n, k), (1, 32))


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@section("ceiling")
def ceiling():
    n = (1 << 20) if SMOKE else (1 << 30)  # float32 elements: 4 GiB
    x = jnp.ones((n,), jnp.float32) * 1.5
    f = jax.jit(lambda a: a * 1.0000001)
    t = timeit(f, x)
    bw = 2 * 4 * n / t
    RESULTS["copy_bw"] = bw
    log(f"copy bandwidth: {bw / 1e12:.2f} TB/s (read + write), datasheet {DATASHEET_BW / 1e12:.1f} TB/s")
    return bw


@section("check")
def check():
    key = jax.random.PRNGKey(0)
    shapes = [(1, 96, 160), (5, 300, 1000), (64, 256, 512)] if SMOKE else [(1, 2304, 5120), (7, 1000, 1312),
                                                                          (64, 5120, 2304), (33, 32768, 1280)]
    for m, n, k in shapes:
        w = random_fp8(jax.random.fold_in(key, n), n, k)
        x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.float32).astype(BF)
        want = jnp.einsum("mk,nk->mn", x.astype(jnp.float32), w.dequantize(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
        got = QG.fp8_linear(x, w, backend=BE)
        err = rel_err(got, want)
        ok = err < 8e-3 and bool(jnp.all(jnp.isfinite(got)))
        RESULTS["checks"].append(dict(kind="fp8", m=m, n=n, k=k, rel_err=err, ok=ok))
        log(f"fp8 dense M={m} N={n} K={k}: rel err vs float32 {err:.2e} {'ok' if ok else 'FAIL'}")
    e, n, k = (8, 96, 256) if SMOKE else (256, 2304, 5120)
    w = random_fp4(key, e, n, k)
    gs = jnp.array(([5, 0, 3, 0, 1, 2, 0, 1] if SMOKE else [0] * 10 + [3, 40, 1] + [0] * 50 + [17] + [0] * 191
                    + [2]), jnp.int32)  # the last expert's bytes start past 1.4 GB
    a = int(gs.sum()) + 3
    x = jax.random.normal(key, (a, k), jnp.float32).astype(BF)
    wd = w.dequantize(jnp.float32)
    want = jax.lax.ragged_dot(x.astype(jnp.float32), jnp.swapaxes(wd, 1, 2), gs, precision=jax.lax.Precision.HIGHEST)
    got = QG.fp4_grouped(x, gs, w, backend=BE)
    err = rel_err(got[:a - 3], want[:a - 3])
    ok = err < 8e-3 and bool(jnp.all(got[a - 3:] == 0)) and bool(jnp.all(jnp.isfinite(got)))
    RESULTS["checks"].append(dict(kind="fp4_grouped", rows=a, experts=e, n=n, k=k, rel_err=err, ok=ok))
    log(f"fp4 grouped rows={a} E={e} N={n} K={k}: rel err vs float32 {err:.2e} {'ok' if ok else 'FAIL'}")


def _reps(nbytes):
    return 2 if SMOKE else int(min(32, max(2, -(-(384 << 20) // nbytes))))


def _pct(nbytes, us, bw):
    return 100 * nbytes / (us * 1e-6) / bw


def dense_case(m, n, k, bw, tuning=None, baselines=True):
    key = jax.random.PRNGKey(m * 7 + n)
    wbytes = n * k + (-(-n // 32)) * (-(-k // 32))
    r = _reps(wbytes)
    ws = [random_fp8(jax.random.fold_in(key, i), n, k) for i in range(r)]
    x = jax.random.normal(key, (m, k), jnp.float32).astype(BF)
    nbytes = wbytes + m * k * 2 + m * n * 2
    row = dict(section="dense", m=m, n=n, k=k, bytes=nbytes, reps=r, tuning=tuning or {})

    def many(fn):
        return jax.jit(lambda x, ws: [fn(x, w) for w in ws])

    kt = measure(many(lambda x, w: QG.fp8_linear(x, w, backend=BE, tuning=tuning)), (x, ws), r, ("fp8_block_gemm",))
    row.update(kernel=kt, kernel_pct=_pct(nbytes, kt["us"], bw))
    want = jnp.einsum("mk,nk->mn", x.astype(jnp.float32), ws[0].dequantize(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    row["rel_err"] = rel_err(QG.fp8_linear(x, ws[0], backend=BE, tuning=tuning), want)  # every tiling is checked
    if baselines:
        if BASELINE is not None:
            bt = measure(many(lambda x, w: BASELINE.fp8_gemm(x, w.values, w.scales, interpret=SMOKE)), (x, ws), r,
                         ("fp8_block_gemm",))
            row.update(before=bt, before_pct=_pct(nbytes, bt["us"], bw))
        if QUICK:
            return row
        row.update(reference=measure(many(lambda x, w: QG.fp8_linear(x, w, backend="reference")), (x, ws), r))
        wb = [w.dequantize(BF) for w in ws]
        bt = measure(jax.jit(lambda x, ws: [x @ w.T for w in ws]), (x, wb), r)
        row.update(bf16=bt, bf16_pct=_pct(n * k * 2 + m * k * 2 + m * n * 2, bt["us"], bw))
        del wb
    return row


def _us(row, key):
    v = row.get(key)
    return v["us"] if v else float("nan")


@section("dense")
def dense(bw):
    shapes = [(96, 256), (300, 512)] if SMOKE else [(32768, 1280), (2304, 5120), (1280, 5120)]
    if QUICK:
        shapes = shapes[1:]
    ms = (1, 8) if SMOKE else MS
    log("| M | N x K | FP8 kernel µs | % of copy BW | before µs | before % BW | plain-JAX µs | bf16 GEMM µs | "
        "bf16 % BW | kernel vs bf16 | kernel vs plain-JAX | kernel wall µs |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, k in shapes:
        for m in ms:
            row = dense_case(m, n, k, bw)
            RESULTS["rows"].append(row)
            log(f"| {m} | {n}x{k} | {_us(row, 'kernel'):.1f} | {row['kernel_pct']:.0f}% | {_us(row, 'before'):.1f} | "
                f"{row.get('before_pct', float('nan')):.0f}% | {_us(row, 'reference'):.1f} | {_us(row, 'bf16'):.1f} | "
                f"{row.get('bf16_pct', float('nan')):.0f}% | {_us(row, 'bf16') / _us(row, 'kernel'):.2f}x | "
                f"{_us(row, 'reference') / _us(row, 'kernel'):.2f}x | {row['kernel']['wall_us']:.1f} |")


def _routing(key, m, e, topk):
    """Assignments sorted by expert: group sizes [E] of top-k distinct experts per token, uniform at random."""
    scores = jax.random.uniform(key, (m, e))
    idx = jax.lax.top_k(scores, topk)[1]
    return jnp.bincount(idx.reshape(-1), length=e).astype(jnp.int32)


def _slots_reference(x, gs, w, n_slots, rows, dtype=None):
    """The engine's plain-JAX decode path (inference.moe.routed_slots): one slot of ``rows`` rows per used expert,
    the expert's stored bytes gathered and dequantised (or bf16 experts gathered), batched GEMM."""
    used = jnp.argsort(gs == 0, stable=True)[:n_slots]
    start = jnp.cumsum(gs) - gs
    r = start[used][:, None] + jnp.arange(rows)[None, :]
    ok = jnp.arange(rows)[None, :] < gs[used][:, None]
    xs = jnp.where(ok[..., None], x[jnp.clip(r, 0, x.shape[0] - 1)], 0)
    if isinstance(w, QuantizedTensor):
        sel = QuantizedTensor(w.values[used], w.scales[used], w.fmt, (n_slots,) + w.shape[1:], w.block)
        wd = sel.dequantize(x.dtype)
    else:
        wd = w[used]
    return jnp.einsum("srk,snk->srn", xs, wd)


def grouped_case(m, e, n, k, bw, tuning=None, baselines=True):
    topk = 6
    key = jax.random.PRNGKey(m)
    w = random_fp4(key, e, n, k)
    r = 2 if SMOKE else 8
    gss = [_routing(jax.random.fold_in(key, i), m, e, topk) for i in range(r)]
    used = float(np.mean([int(jnp.sum(g > 0)) for g in gss]))
    a = m * topk
    x = jax.random.normal(key, (a, k), jnp.float32).astype(BF)
    per_expert = n * k // 2 + n * k // 32
    nbytes = used * per_expert + a * k * 2 + a * n * 2
    row = dict(section="grouped", m=m, experts=e, n=n, k=k, used_experts=used, bytes=nbytes, tuning=tuning or {})
    kt = measure(jax.jit(lambda x, gss, w: [QG.fp4_grouped(x, g, w, backend=BE, tuning=tuning) for g in gss]),
                 (x, gss, w), r, ("fp4_grouped_gemm",))
    row.update(kernel=kt, kernel_pct=_pct(nbytes, kt["us"], bw))
    g0, s0 = gss[0], int(jnp.sum(gss[0]))
    want = jax.lax.ragged_dot(x.astype(jnp.float32), jnp.swapaxes(w.dequantize(jnp.float32), 1, 2), g0,
                              precision=jax.lax.Precision.HIGHEST)
    row["rel_err"] = rel_err(QG.fp4_grouped(x, g0, w, backend=BE, tuning=tuning)[:s0], want[:s0])
    if baselines:
        if BASELINE is not None:
            bt = measure(jax.jit(lambda x, gss, w: [BASELINE.fp4_grouped_gemm(x, g, w.values, w.scales,
                                                                              interpret=SMOKE) for g in gss]),
                         (x, gss, w), r, ("fp4_grouped_gemm",))
            row.update(before=bt, before_pct=_pct(nbytes, bt["us"], bw))
        if QUICK:
            return row
        # the slots baselines gather min(E, rows) dequantised experts per routing: capped so that M = 64 fits
        n_slots = min(e, a, 256)
        rows = max(8, 1 << (m - 1).bit_length())
        f = jax.jit(lambda x, gss, w: [_slots_reference(x, g, w, n_slots, rows) for g in gss])
        rb = r if n_slots * n * k <= (1 << 31) else 2
        row.update(reference=measure(f, (x, gss[:rb], w), rb))
        wb = w.dequantize(BF)
        row.update(bf16=measure(f, (x, gss[:rb], wb), rb))
        row.update(bf16_pct=_pct(used * n * k * 2 + a * k * 2 + a * n * 2, row["bf16"]["us"], bw))
        del wb
    return row


@section("grouped")
def grouped(bw):
    # 256 experts: a 384-expert stack of these widths is 2.26 GB, in the 2-4 GiB range the Pallas GPU lowering
    # addresses wrong (refused by quant_gemm); the kernels' time depends on the experts used, not on E
    cases = [(8, 96, 256), (8, 256, 96)] if SMOKE else [(256, 2304, 5120), (256, 5120, 2304)]
    if QUICK:
        cases = cases[:1]
    ms = (1, 4) if SMOKE else MS
    log("| M (x6 rows) | E, N x K | used experts | FP4 kernel µs | % of copy BW | before µs | before % BW | "
        "plain-JAX slots µs | bf16 slots µs | bf16 % BW | kernel vs bf16 | kernel vs plain-JAX | kernel wall µs |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e, n, k in cases:
        for m in ms:
            row = grouped_case(m, e, n, k, bw)
            RESULTS["rows"].append(row)
            log(f"| {m} | {e}, {n}x{k} | {row['used_experts']:.1f} | {_us(row, 'kernel'):.1f} | "
                f"{row['kernel_pct']:.0f}% | {_us(row, 'before'):.1f} | {row.get('before_pct', float('nan')):.0f}% | "
                f"{_us(row, 'reference'):.1f} | {_us(row, 'bf16'):.1f} | {row.get('bf16_pct', float('nan')):.0f}% | "
                f"{_us(row, 'bf16') / _us(row, 'kernel'):.2f}x | {_us(row, 'reference') / _us(row, 'kernel'):.2f}x | "
                f"{row['kernel']['wall_us']:.1f} |")


@section("tune")
def tune(bw):
    dense_cfgs = [dict(block_n=16, split_k=4), dict(block_n=16, split_k=2), dict(block_n=32, split_k=4),
                  dict(block_n=16, split_k=1), dict(block_n=16, split_k=4, num_warps=2),
                  dict(block_n=16, block_k=512, split_k=2), dict(block_n=16, split_k=4, num_stages=4),
                  dict(block_n=32, split_k=8, num_warps=8)]
    group_cfgs = [dict(block_n=32, block_k=256), dict(block_n=16, block_k=256), dict(block_n=64, block_k=256),
                  dict(block_n=32, block_k=512), dict(block_n=32, block_k=128), dict(block_n=32, num_warps=2),
                  dict(block_n=64, block_k=256, num_warps=8), dict(block_n=32, num_stages=4)]
    if SMOKE:
        dense_cfgs, group_cfgs = dense_cfgs[:2], group_cfgs[:2]
    gshapes = [(1, 8, 96, 256)] if SMOKE else [(1, 384, 2304, 5120), (8, 384, 2304, 5120)]
    for m, e, n, k in gshapes:
        for cfg in group_cfgs:
            try:
                row = grouped_case(m, e, n, k, bw, tuning=cfg, baselines=False)
            except Exception as ex:
                log(f"grouped M={m} {n}x{k} {cfg}: {type(ex).__name__}: {str(ex)[:200]}")
                continue
            RESULTS["tune"].append(row)
            log(f"grouped M={m} {e}x{n}x{k} {cfg}: {row['kernel']['us']:.1f} µs {row['kernel_pct']:.0f}% "
                f"(wall {row['kernel']['wall_us']:.1f} µs; rel err {row['rel_err']:.1e})")
    dshapes = [(1, 96, 256)] if SMOKE else [(1, 2304, 5120), (1, 1280, 5120), (32, 2304, 5120)]
    for m, n, k in dshapes:
        for cfg in dense_cfgs:
            try:
                row = dense_case(m, n, k, bw, tuning=cfg, baselines=False)
            except Exception as ex:  # a config that does not compile is reported, not fatal
                log(f"dense M={m} {n}x{k} {cfg}: {type(ex).__name__}: {str(ex)[:200]}")
                continue
            RESULTS["tune"].append(row)
            log(f"dense M={m} {n}x{k} {cfg}: {row['kernel']['us']:.1f} µs {row['kernel_pct']:.0f}% "
                f"(wall {row['kernel']['wall_us']:.1f} µs; rel err {row['rel_err']:.1e})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (grouped 2304x5120, dense 2304x5120 and "
                    "1280x5120), the new and the earlier kernels only")
    ap.add_argument("--sections", default="ceiling,check,grouped,dense,tune")
    ap.add_argument("--ms", default="1,8,32,64", help="token counts M for the dense / grouped tables")
    ap.add_argument("--baseline-module", default=None,
                    help="path of an earlier quant_gemm_gpu.py: its kernels are timed in the same run ('before')")
    args = ap.parse_args()
    global MS, BASELINE
    MS = tuple(int(v) for v in args.ms.split(","))
    if args.baseline_module:
        import importlib.util

        spec = importlib.util.spec_from_file_location("quant_gemm_gpu_before", args.baseline_module)
        BASELINE = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(BASELINE)
    secs = args.sections.split(",")
    RESULTS["meta"] = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), jax=jax.__version__,
                           devices=[d.device_kind for d in jax.devices()], backend=BE)
    log(f"jax {jax.__version__} on {RESULTS['meta']['devices']}")

    def save():  # after every section: a run stopped by its time limit keeps what it measured
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(RESULTS, f, indent=1, default=str)

    bw = ceiling() if "ceiling" in secs else None
    bw = bw or DATASHEET_BW
    for name, fn in (("check", check), ("grouped", grouped), ("dense", dense), ("tune", tune)):
        if name in secs:
            fn() if name == "check" else fn(bw)
            save()
    log(f"\nerrors: {RESULTS['errors'] or 'none'}; checks ok: {all(c['ok'] for c in RESULTS['checks'])}")
    return 0 if not RESULTS["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
