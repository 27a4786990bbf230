"""The programs behind ``bench_dspark_h200.py``'s decode rows, lowered without parameters (abstract shapes), with
their size: HLO operations, GEMMs (``dot_general``) and their distinct shapes, loops, kernels (custom calls) —
and optionally their compile time on this machine's backend. Shows which program is large and why, before any
device time is spent compiling it.

    python benchmarks/dspark_programs.py                      # spec-h200 sizes, batch 1, lowering only
    python benchmarks/dspark_programs.py --batches 1,16 --compile --platform cpu
    python benchmarks/dspark_programs.py --kernels pallas_gpu --platform cuda   # the GPU path's lowering

A program's GPU compile time grows with its GEMMs of distinct shapes (XLA's GEMM autotuner compiles and times
candidate kernels for every new GEMM fusion) and with its fusions; the CPU compile time shows the size of the
rest. Prints one table row per program.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_dspark_h200 import target_config  # noqa: E402
from dsv41_jax.inference import speculative as S  # noqa: E402
from dsv41_jax.inference.cache import abstract_cache  # noqa: E402
from dsv41_jax.inference.decode import _decode_chain, _decode_opts  # noqa: E402
from dsv41_jax.inference.prefill import _full_chunk, chunk_bucket  # noqa: E402
from dsv41_jax.inference.step import InferenceOptions  # noqa: E402
from dsv41_jax.model.params import abstract_params  # noqa: E402

_DOT = re.compile(r"stablehlo\.dot_general.*?:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)")


def hlo_stats(text: str) -> dict:
    """Counts over a lowered module's StableHLO text."""
    ops = collections.Counter(m.group(1) for m in re.finditer(r"=\s*\"?([a-z_]+\.[a-z_0-9]+)", text))
    dots = [m.groups() for m in _DOT.finditer(text)]
    return dict(ops=sum(ops.values()), dots=len(dots), dot_shapes=len(set(dots)),
                whiles=ops.get("stablehlo.while", 0), conds=ops.get("stablehlo.case", 0) + ops.get("stablehlo.if", 0),
                custom_calls=ops.get("stablehlo.custom_call", 0), funcs=text.count("func.func"),
                chars=len(text))


def programs(config, batch: int, max_len: int, prompt: int, opts: InferenceOptions):
    """{name: (jitted function, abstract args, static kwargs)}: every program a plain and a speculative decode
    row of the bench compiles at ``batch`` (prefill, first sample, first draft, the step)."""
    sd = jax.ShapeDtypeStruct
    params = abstract_params(config, jnp.bfloat16, include_dspark=True)
    cache = abstract_cache(config, batch, max_len, jnp.bfloat16)
    i32 = lambda *s: sd(s, jnp.int32)  # noqa: E731
    chunk = chunk_bucket(prompt, None)
    b = batch
    k = config.dspark_block_size
    rings = jax.eval_shape(lambda: S.init_dspark_rings(config, b, jnp.bfloat16))
    n_t = len(config.dspark_target_layer_ids)
    dopts = _decode_opts(opts)
    spec_opts = InferenceOptions(**{**opts.__dict__, "ced": True, "replay_len": None})
    samp = (sd((b,), jnp.float32), i32(b), sd((b,), jnp.float32), i32(b))
    out = {}
    st = dict(config=config, opts=opts, all_logits=False)
    out["prefill"] = (jax.jit(_full_chunk, static_argnames=("config", "opts", "all_logits", "capture")),
                      (params, cache, i32(b, chunk), i32(b), None), dict(st, capture=()))
    out["prefill+capture"] = (jax.jit(_full_chunk, static_argnames=("config", "opts", "all_logits", "capture")),
                              (params, cache, i32(b, chunk), i32(b), None),
                              dict(st, capture=tuple(config.dspark_target_layer_ids)))
    state = {"tokens": i32(b), "active": sd((b,), jnp.bool_), "generated": i32(b), "step": i32(),
             "readback": i32(9, b)}
    out["decode step"] = (jax.jit(_decode_chain, static_argnames=("config", "opts")),
                          (params, cache, state, None, *samp, i32(b, 4), i32(b), i32(b)),
                          dict(config=config, opts=dopts))
    out["seed rings"] = (jax.jit(S.seed_rings, static_argnames=("config", "quant_on", "gemm_input_fp8")),
                         (params, rings, sd((b, chunk, n_t * config.hidden_size), jnp.bfloat16), i32(b), i32(b)),
                         dict(config=config, quant_on=False))
    out["first draft"] = (jax.jit(S.draft_from_rings,
                                  static_argnames=("config", "quant_on", "moe_impl", "gemm_input_fp8")),
                          (params, rings, i32(b), i32(b), i32(b)),
                          dict(config=config, quant_on=False, moe_impl=spec_opts.moe_impl))
    sstate = {"pending": i32(b), "drafts": i32(b, k), "active": sd((b,), jnp.bool_), "generated": i32(b),
              "max_new": i32(b), "n_prompt": i32(b), "stops": i32(b, 4), "max_len": i32(), "step": i32(),
              "out": i32(8, b, k + 1), "kept": i32(8, b), "valid": i32(8, b)}
    out["speculative step"] = (jax.jit(S.speculative_chain, static_argnames=("config", "opts")),
                               (params, cache, rings, sstate, None), dict(config=config, opts=spec_opts))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="the toy widths of bench_dspark_h200 --smoke")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--prompt", type=int, default=97, help="prompt tokens (the bench: 96 characters + BOS)")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--kernels", default="auto", help="InferenceOptions.kernel_backend")
    ap.add_argument("--platform", default=None, help="lower for this platform (e.g. cuda) instead of the default")
    ap.add_argument("--compile", action="store_true", help="also compile each program (this backend) and time it")
    ap.add_argument("--only", default="", help="comma-separated program names")
    ap.add_argument("--dump", default=None, help="directory for each program's StableHLO text")
    ap.add_argument("--deviceless", action="store_true",
                    help="lower and compile for an NVIDIA H200 on this machine, no GPU (benchmarks/deviceless_gpu.py: "
                         "the CUDA plugin importable, JAX_PLATFORMS=cpu; GEMM autotuning skipped)")
    ap.add_argument("--compiler-options", default="",
                    help="KEY=VALUE,... XLA options of the compile (e.g. xla_disable_hlo_passes=triton-softmax-rewriter)")
    args = ap.parse_args(argv)
    device = None
    if args.deviceless:
        from benchmarks.deviceless_gpu import h200_device, on_device

        device = h200_device()
    copts = dict(kv.split("=", 1) for kv in args.compiler_options.split(",") if kv) or None
    config = target_config(args.smoke)
    opts = InferenceOptions(ced=False, kernel_backend=args.kernels)
    print(f"# {config.name}, jax {jax.__version__}, backend {jax.default_backend()}, lowered for "
          f"{args.platform or jax.default_backend()}, kernels {args.kernels}")
    print("| batch | program | HLO ops | GEMMs | distinct GEMM shapes | while | cond | custom calls | lower s | "
          "compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    only = {s for s in args.only.split(",") if s}
    for b in (int(x) for x in args.batches.split(",")):
        for name, (fn, a, kw) in programs(config, b, args.max_len, args.prompt, opts).items():
            if only and name not in only:
                continue
            t0 = time.perf_counter()
            if device is not None:
                a = on_device(a, device)
            traced = fn.trace(*a, **kw)
            lowered = traced.lower(lowering_platforms=(args.platform,)) if args.platform else traced.lower()
            text = lowered.as_text()
            t_lower = time.perf_counter() - t0
            s = hlo_stats(text)
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                with open(os.path.join(args.dump, f"b{b}_{name.replace(' ', '_').replace('+', '_')}.mlir"), "w") as f:
                    f.write(text)
            t_comp = "—"
            if args.compile:
                t0 = time.perf_counter()
                lowered.compile(compiler_options=copts)
                t_comp = f"{time.perf_counter() - t0:.1f}"
            print(f"| {b} | {name} | {s['ops']:,} | {s['dots']} | {s['dot_shapes']} | {s['whiles']} | {s['conds']} | "
                  f"{s['custom_calls']} | {t_lower:.1f} | {t_comp} |", flush=True)


if __name__ == "__main__":
    main()
