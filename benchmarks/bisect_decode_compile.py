"""Which part of the decode step is slow to compile, and under which XLA GEMM settings: compile-only, on abstract
shapes (no parameters or cache are allocated), each program in its own process with a time limit.

    python benchmarks/bisect_decode_compile.py --batches 1,32 --parts step,roles,moe,head \
        --variants at0,cublas --flags ,onepass --timeout-s 60 --deadline-s 400 --out DIR
    python benchmarks/bisect_decode_compile.py --jobs step:32:cublas_at0,roles:32:at0,moe:32:at0 --parallel 3 ...

Parts (``bench-h200-12L`` shapes unless ``--model``; bf16; cache of ``--context`` + 512 tokens per slot):

* ``step``: the whole device-loop step (``decode_chain``, the program ``Engine.generate`` runs);
* ``roles``: one layer of each role of the plan (``run_layers`` over [i, i + 1) for the first layer of each
  (mode, compression ratio, Engram) kind), so a slow layer kind shows;
* ``moe``: one layer's MoE (router, routed experts, shared expert) on the step's tokens;
* ``head``: the final norm, the head and the sampler.

Variants (XLA compiler options of the compile): ``default``; ``atN`` (``xla_gpu_autotune_level=N``: 0 = no
autotuning); ``cublas`` (``xla_gpu_enable_triton_gemm=false``: GEMMs by cuBLAS, not Triton); ``cublas_at0``.
Flags: ``onepass`` (``InferenceOptions.mhc_one_pass`` + ``router_one_pass``) or empty. Every combination is one job:
a child process that lowers and compiles the program and prints its seconds and the compiled program's counts (Triton
GEMM fusions, cuBLAS calls, fusions); a job past ``--timeout-s`` is killed and reported as such. Jobs run
``--parallel`` at a time (default 1: a compile's time is then its own). Prints a Markdown table; writes
``DIR/bisect_decode_compile.json`` after every job.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {"default": {}, "cublas": {"xla_gpu_enable_triton_gemm": False},
            "cublas_at0": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}}
FLAGS = {"": (), "onepass": ("mhc_one_pass", "router_one_pass")}


def variant_options(name: str) -> dict:
    if name in VARIANTS:
        return dict(VARIANTS[name])
    if name.startswith("at") and name[2:].isdigit():
        return {"xla_gpu_autotune_level": int(name[2:])}
    raise SystemExit(f"unknown variant {name!r}: default, atN, cublas, cublas_at0")


# ----------------------------------------------------------------------------------------------------------------
# One job (child process)
# ----------------------------------------------------------------------------------------------------------------

def _programs(config, part: str, batch: int, max_len: int, opts):
    """[(name, function, abstract args, donate_argnums)] of a part."""
    import jax
    import jax.numpy as jnp

    from bench_inference import synthetic_hasher
    from dsv41_jax.inference.audit import decode_program
    from dsv41_jax.inference.cache import abstract_cache
    from dsv41_jax.inference.moe import moe_inference
    from dsv41_jax.inference.sampling import sample
    from dsv41_jax.inference.step import head, run_layers
    from dsv41_jax.model.params import abstract_params
    from dsv41_jax.plan import REINDEX

    c = config
    dt = jnp.bfloat16
    sds = jax.ShapeDtypeStruct
    vec = lambda d: sds((batch,), d)  # noqa: E731
    if part == "step":
        fn, args = decode_program(c, batch, max_len, opts=opts, chained=True, hasher=synthetic_hasher(c))
        return [("step", fn, args, (1,))]
    params = abstract_params(c, dt)
    streams = sds((batch, 1, c.hc_mult, c.hidden_size), dt)
    pre_mix = sds((batch, 1, c.hc_mult), jnp.float32)
    if part == "roles":
        cache = abstract_cache(c, batch, max_len, dt)
        eids = sds((batch, 1, len(c.engram_layer_ids), c.n_hash_cols), jnp.int32) if c.engram_layer_ids else None
        seen, out = set(), []
        for s in c.plan.layers:
            kind = (s.mode, s.ratio, s.engram_slot is not None)
            if kind in seen:
                continue
            seen.add(kind)

            # a Reindex layer scores the pool its candidate source published earlier in the same pass
            lo = c.candidate_source_layer_id if s.mode == REINDEX else s.index

            def fn(params, cache, streams, pre_mix, pos0, n_valid, eids, lo=lo, hi=s.index + 1):
                return run_layers(params, cache, streams, pre_mix, pos0, n_valid, eids, config=c, lo=lo, hi=hi,
                                  opts=opts)

            name = f"layer {s.index} ({s.mode}, ratio {s.ratio}{', Engram' if s.engram_slot is not None else ''})"
            if lo != s.index:
                name = f"layers {lo}-{s.index} (… {s.mode}, ratio {s.ratio})"
            out.append((name, fn, (params, cache, streams, pre_mix, vec(jnp.int32), vec(jnp.int32), eids), (1,)))
        return out
    if part == "moe":
        ffn = params["layers"][0]["ffn"]

        def moe_fn(ffn, h):
            return moe_inference(h, ffn, top_k=c.num_experts_per_tok, temp=c.gate_temp,
                                 scaling=c.routed_scaling_factor, limit=c.swiglu_limit, normalize=c.norm_topk_prob,
                                 backend=opts.kernel_backend, router_one_pass=opts.router_one_pass)

        return [("moe", moe_fn, (ffn, sds((batch, 1, c.hidden_size), dt)), ())]
    if part == "head":
        def head_fn(params, streams, pre_mix, temperature, top_k, top_p, seeds, steps):
            logits = head(params, streams, pre_mix, c)[:, 0]
            return sample(logits, temperature, top_k, top_p, seeds, steps)

        return [("head + sampling", head_fn, (params, streams, pre_mix, vec(jnp.float32), vec(jnp.int32),
                                              vec(jnp.float32), vec(jnp.int32), vec(jnp.int32)), ())]
    raise SystemExit(f"unknown part {part!r}: step, roles, moe, head")


def compiled_counts(text: str) -> dict:
    import re

    return dict(triton_gemm_fusions=len(re.findall(r'"kind":"__triton[a-z_]*gemm', text)),
                cublas_calls=text.count('custom_call_target="__cublas$gemm"')
                + text.count('custom_call_target="__cublas$lt$matmul"'),
                fusions=text.count(" fusion("), custom_calls=text.count(" custom-call("), hlo_chars=len(text))


def run_job(job: dict) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(1, HERE)
    device = None
    if job.get("deviceless"):
        from deviceless_gpu import h200_device, on_device

        device = h200_device()
    import jax

    from bench_inference import h200_config
    from dsv41_jax.inference.decode import _decode_opts
    from dsv41_jax.inference.step import InferenceOptions

    models = {"12L": h200_config}
    if job["model"] == "smoke":
        from profile_decode import smoke
        models["smoke"] = smoke
    config = models[job["model"]]()
    opts = _decode_opts(InferenceOptions(quant_sim=False, index_block_elems=1 << 28,
                                         kernel_backend=job["kernel_backend"], **{f: True for f in job["flags"]}))
    copts = variant_options(job["variant"])
    for name, fn, args, donate in _programs(config, job["part"], job["batch"], job["max_len"], opts):
        if job.get("only") and name != job["only"]:
            continue
        t0 = time.perf_counter()
        if device is not None:
            args = on_device(args, device)
        lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
        t1 = time.perf_counter()
        print(json.dumps(dict(program=name, lower_s=t1 - t0, started=True)), flush=True)
        compiled = lowered.compile(compiler_options=copts or None)
        t2 = time.perf_counter()
        print(json.dumps(dict(program=name, lower_s=t1 - t0, compile_s=t2 - t1,
                              **compiled_counts(compiled.as_text() or ""))), flush=True)


# ----------------------------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------------------------

def _args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="12L", choices=["12L", "smoke"])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--parts", default="step,roles,moe,head")
    ap.add_argument("--variants", default="at0,cublas")
    ap.add_argument("--flags", default=",onepass", help="comma-separated: '' (defaults), onepass")
    ap.add_argument("--jobs", default="", help="instead of the product of the lists above: PART:BATCH:VARIANT[:FLAG]"
                    ",... (e.g. step:32:cublas_at0,roles:32:at0:onepass)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--kernel-backend", default="auto")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="per job (one part's programs)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="start no job after this many seconds")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--deviceless", action="store_true",
                    help="compile for an NVIDIA H200 on this machine, no GPU (benchmarks/deviceless_gpu.py; needs the "
                         "CUDA plugin importable, JAX_PLATFORMS=cpu; GEMM autotuning skipped)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def jobs_of(args) -> list:
    out = []
    if args.jobs:
        for item in args.jobs.split(","):
            part, batch, variant, *flag = item.split(":")
            variant_options(variant)
            flag = flag[0] if flag else ""
            if flag not in FLAGS or not batch.isdigit():
                raise SystemExit(f"--jobs: {item!r} is not PART:BATCH:VARIANT[:onepass]")
            out.append(dict(model=args.model, part=part, batch=int(batch), variant=variant, flags=list(FLAGS[flag]),
                            max_len=args.context + 512, kernel_backend=args.kernel_backend,
                            deviceless=args.deviceless))
        return out
    for part in args.parts.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            for variant in args.variants.split(","):
                variant_options(variant)
                for flag in args.flags.split(","):
                    if flag not in FLAGS:
                        raise SystemExit(f"unknown flag {flag!r}: '' or onepass")
                    out.append(dict(model=args.model, part=part, batch=b, variant=variant, flags=list(FLAGS[flag]),
                                    max_len=args.context + 512, kernel_backend=args.kernel_backend,
                                    deviceless=args.deviceless))
    return out


def main(argv=None):
    args = _args(argv)
    if args.job:
        run_job(json.loads(args.job))
        return
    out_dir = args.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()
    pending = jobs_of(args)
    rows, running = [], []
    path = os.path.join(out_dir, "bisect_decode_compile.json")
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                command="python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]))

    def finish(job, proc, t0, timed_out):
        try:
            text = proc.communicate(timeout=5)[0]  # the child was killed on a timeout: what it printed so far
        except subprocess.TimeoutExpired:
            text = ""
        progs = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        done = {p["program"]: p for p in progs if "compile_s" in p}
        started = [p["program"] for p in progs if p.get("started") and p["program"] not in done]
        row = dict(job, wall_s=time.perf_counter() - t0, programs=list(done.values()))
        if timed_out:
            row["timed_out_in"] = started or ["lowering"]
        elif proc.returncode:
            row["error"] = "\n".join(text.splitlines()[-5:])[-600:]
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(path, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)

    while pending or running:
        while pending and len(running) < args.parallel and time.perf_counter() - t_start < args.deadline_s:
            job = pending.pop(0)
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--job", json.dumps(job)],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            running.append((job, proc, time.perf_counter()))
        if pending and time.perf_counter() - t_start >= args.deadline_s and not running:
            rows.extend(dict(j, skipped="deadline") for j in pending)
            pending = []
        for item in list(running):
            job, proc, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                finish(job, proc, t0, False)
            elif time.perf_counter() - t0 > args.timeout_s:
                proc.kill()
                running.remove(item)
                finish(job, proc, t0, True)
        time.sleep(0.2)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("\n| part | batch | variant | flags | program | lower s | compile s | Triton GEMM fusions | cuBLAS calls |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        head = f"| {r['part']} | {r['batch']} | {r['variant']} | {'+'.join(r['flags']) or '-'} |"
        if "skipped" in r:
            print(f"{head} (skipped: deadline) | | | | |")
            continue
        for p in r["programs"]:
            print(f"{head} {p['program']} | {p['lower_s']:.1f} | {p['compile_s']:.1f} | {p['triton_gemm_fusions']} | "
                  f"{p['cublas_calls']} |")
        if "timed_out_in" in r:
            print(f"{head} {', '.join(r['timed_out_in'])} | | > {args.timeout_s:.0f} (killed) | | |")
        if "error" in r:
            print(f"{head} error: {r['error'][-200:]!r} | | | | |")


if __name__ == "__main__":
    main()
