"""Device time of two pieces of the decode step's glue around the real kernels, at the 40-layer bench model's widths
(d 5120, hc 4), by form, in one process: which form of each is cheaper on the GPU.

    PYTHONUNBUFFERED=1 python benchmarks/bench_decode_glue.py --out DIR [--batches 32,1] [--parts mhc,round]
        [--mhc-forms one_pass,kernel,...]
    python benchmarks/bench_decode_glue.py --smoke      # CPU: tiny sizes, no timing

Parts:
  mhc   one mHC site's coefficients from its streams [tokens, 4, 5120] float32 (``ops.mhc.mhc_coefficients`` with
        the Pallas coefficient kernel, as the decode step runs it): "one_pass" (the decode default: the projection
        and the sum of squares as ONE multiply-reduce over the 20,480-long contraction, which XLA emits as a
        reduction kernel — the profile's ``input_reduce_fusion`` of 20 µs a launch at batch 32), "two_pass" (RMS
        normalisation, then ``narrow_matmul_f32``'s split-K GEMM and its sum), "dot" (the projection as one float32
        ``dot`` at HIGHEST precision + the sum of squares, handed to the kernel with ``rms_k`` as the one-pass sums),
        "split_dot" (the same with ``narrow_matmul_f32``'s split-K GEMM for the raw products), "kernel" (the sums as
        P partials from one Pallas kernel, ``kernels.mhc_gpu.mhc_sums_kernel``, added by the coefficient kernel:
        ``projection="kernel"``), "kernel_pP_tT" (the same with P slices and token tiles of T, beside the default
        P = 128, T = 32), "one_pass_pP" (the one-pass reduce handing the kernel P partial sums per entry:
        ``partials=P``; the default hands 128 at one token, 1 above).
        Each call runs R = 8 sites (distinct weights and streams); µs per site = device time / R; distinct kernel
        names per site (≈ launches); each kernel's µs per site; the site's operands (streams + weight, float32) in
        MB and their read rate at the site's µs.
        Max abs difference of pre / post / comb against "one_pass".
  round the release's GEMM-input FP8 rounding (``ops.quant.fake_quant_gemm_input_fp8``, blocks of 32) of a
        [tokens, 5120] bf16 activation: µs and kernels per rounding (R = 8 per call).
Output: DIR/bench_decode_glue.json and the table on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from dsv41_jax.ops import mhc as M  # noqa: E402
from dsv41_jax.ops import quant as Q  # noqa: E402

D, HC, R = (64, 4, 2) if SMOKE else (5120, 4, 8)
N = (2 + HC) * HC
HC_EPS, RMS_EPS, ITERS = 1e-6, 1e-6, 20
COMB = "pallas_gpu_interpret" if SMOKE else "pallas_gpu"


def device_us(fn, args, by_name_out=None):
    """(µs, kernels) of one call: every device kernel of a traced call summed (``bench_quant_gemm.device_time``);
    ``by_name_out``: a dict given the µs of each kernel name."""
    jax.block_until_ready(fn(*args))
    if SMOKE:
        return float("nan"), 0
    import bench_quant_gemm as B

    tot, by_name = B.device_time(fn, *args)
    if by_name_out is not None:
        by_name_out.update({k: v * 1e6 for k, v in by_name.items()})
    return tot * 1e6, len(by_name)


def dot_form(streams, fn, base, scale, split=False):
    """The projection as one float32 dot (HIGHEST; ``split``: ``narrow_matmul_f32``'s split-K GEMM and the sum of
    its chunks) and the sum of squares, as the kernel's one-pass sums."""
    from dsv41_jax.ops.linear import narrow_matmul_f32

    flat = streams.reshape(streams.shape[0], -1).astype(jnp.float32)
    proj = (narrow_matmul_f32(flat, fn) if split else
            jnp.dot(flat, fn.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST))
    sums = jnp.concatenate([proj, jnp.sum(flat * flat, axis=-1, keepdims=True)], axis=-1)
    from dsv41_jax.kernels.mhc_gpu import mhc_coefficients_kernel

    pre, post, comb = mhc_coefficients_kernel(sums, scale, base, hc=HC, hc_eps=HC_EPS, iters=ITERS,
                                              rms_k=flat.shape[-1], rms_eps=RMS_EPS, interpret=SMOKE)
    return pre, post, comb.reshape(-1, HC, HC)


def kernel_form(streams, fn, base, scale, parts, max_tokens):
    """The sums kernel with ``parts`` slices and token tiles of ``max_tokens``, then the coefficient kernel."""
    from dsv41_jax.kernels.mhc_gpu import mhc_coefficients_kernel, mhc_sums_kernel

    flat = streams.reshape(streams.shape[0], -1)
    sums = mhc_sums_kernel(flat, fn, parts=parts, max_tokens=max_tokens, interpret=SMOKE)
    pre, post, comb = mhc_coefficients_kernel(sums, scale, base, hc=HC, hc_eps=HC_EPS, iters=ITERS,
                                              rms_k=flat.shape[-1], rms_eps=RMS_EPS, interpret=SMOKE)
    return pre, post, comb.reshape(-1, HC, HC)


def mhc_part(batches, out, only=()):
    forms = {"one_pass": lambda s, f, b, sc: M.mhc_coefficients(s, f, b, sc, hc_eps=HC_EPS, rms_eps=RMS_EPS,
                                                                sinkhorn_iters=ITERS, unroll=True, comb_kernel=COMB,
                                                                one_pass=True),
             "two_pass": lambda s, f, b, sc: M.mhc_coefficients(s, f, b, sc, hc_eps=HC_EPS, rms_eps=RMS_EPS,
                                                                sinkhorn_iters=ITERS, unroll=True, comb_kernel=COMB,
                                                                one_pass=False),
             "dot": dot_form,
             "split_dot": lambda s, f, b, sc: dot_form(s, f, b, sc, split=True),
             "kernel": lambda s, f, b, sc: M.mhc_coefficients(s, f, b, sc, hc_eps=HC_EPS, rms_eps=RMS_EPS,
                                                              sinkhorn_iters=ITERS, unroll=True, comb_kernel=COMB,
                                                              one_pass=True, projection="kernel")}
    for parts in (64, 32, 16, 8):  # the one-pass reduce handing the coefficient kernel this many partial sums
        forms[f"one_pass_p{parts}"] = lambda s, f, b, sc, p=parts: M.mhc_coefficients(
            s, f, b, sc, hc_eps=HC_EPS, rms_eps=RMS_EPS, sinkhorn_iters=ITERS, unroll=True, comb_kernel=COMB,
            one_pass=True, partials=p)
    for parts, tile in ((64, 32), (32, 32), (64, 16)):
        forms[f"kernel_p{parts}_t{tile}"] = lambda s, f, b, sc, p=parts, t=tile: kernel_form(s, f, b, sc, p, t)
    forms["one_pass_again"] = forms["one_pass"]  # drift check: the baseline at the end of the run too
    unknown = set(only) - set(forms)
    if unknown:
        raise ValueError(f"--mhc-forms: unknown {sorted(unknown)}; choose from {list(forms)}")
    forms = {k: v for k, v in forms.items() if not only or k in only}
    for b in batches:
        key = jax.random.PRNGKey(b)
        ss = [jax.random.normal(jax.random.fold_in(key, i), (b, HC, D), jnp.float32) for i in range(R)]
        fns = [jax.random.normal(jax.random.fold_in(key, 100 + i), (N, HC * D), jnp.float32) * 0.01
               for i in range(R)]
        base = jax.random.normal(jax.random.fold_in(key, 7), (N,), jnp.float32) * 0.1
        scale = jnp.asarray([0.5, 0.7, 0.9], jnp.float32)
        ref = None
        for name, form in forms.items():
            f = jax.jit(lambda ss, fns, base, scale, form=form: [form(s, w, base, scale) for s, w in zip(ss, fns)])
            try:
                got = f(ss, fns, base, scale)
                by_name = {}
                us, nk = device_us(f, (ss, fns, base, scale), by_name)
            except Exception as ex:  # noqa: BLE001 - a failing form is reported, the others still run
                out["errors"].append(f"mhc {name} b{b}: {type(ex).__name__}: {str(ex)[:300]}")
                print(f"mhc | {b} | {name} | FAILED {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                continue
            ref = ref or got
            diff = max(float(jnp.max(jnp.abs(g.reshape(-1) - r.reshape(-1)))) for gs, rs in zip(got, ref)
                       for g, r in zip(gs, rs))
            mb = (b + N) * HC * D * 4 / 1e6  # the site's float32 operands: streams [b, hc * d] + weight [N, hc * d]
            row = dict(part="mhc", batch=b, form=name, us_per_site=us / R, kernels_per_site=nk / R,
                       max_abs_diff_vs_one_pass=diff, operand_mb=mb, read_tb_s=mb / (us / R) if us else None,
                       kernel_us_per_site={k: round(v / R, 3) for k, v in
                                           sorted(by_name.items(), key=lambda kv: -kv[1])})
            out["rows"].append(row)
            print(f"mhc | {b} | {name} | {us / R:.2f} µs / site | {nk / R:.1f} kernels / site | diff {diff:.1e} | "
                  f"{row['kernel_us_per_site']}", flush=True)


def round_part(batches, out):
    for b in batches:
        key = jax.random.PRNGKey(1000 + b)
        xs = [jax.random.normal(jax.random.fold_in(key, i), (b, D), jnp.float32).astype(jnp.bfloat16)
              for i in range(R)]
        f = jax.jit(lambda xs: [Q.fake_quant_gemm_input_fp8(x, 32) for x in xs])
        us, nk = device_us(f, (xs,))
        row = dict(part="round", batch=b, us_per_rounding=us / R, kernels_per_rounding=nk / R)
        out["rows"].append(row)
        print(f"round | {b} | {us / R:.2f} µs / rounding | {nk / R:.1f} kernels / rounding", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batches", default="32,1")
    ap.add_argument("--parts", default="mhc,round", help="which parts run (mhc, round)")
    ap.add_argument("--mhc-forms", default="", help="mhc: only these forms (default: every form)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    out = dict(meta=dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                         device=str(jax.devices()[0]), jax=jax.__version__, argv=sys.argv[1:]), rows=[], errors=[])
    print(out["meta"], flush=True)
    parts = args.parts.split(",")
    if "mhc" in parts:
        mhc_part(batches, out, tuple(filter(None, args.mhc_forms.split(","))))
    if "round" in parts:
        round_part(batches, out)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_decode_glue.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(f"errors: {out['errors']}", flush=True)


if __name__ == "__main__":
    main()
