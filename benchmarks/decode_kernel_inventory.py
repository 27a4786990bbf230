"""The kernels of the decode step per layer, by kind, from its XLA:GPU program compiled for an NVIDIA H200 on this
machine (no GPU: ``benchmarks/deviceless_gpu.py``), so that glue between the real kernels can be found and cut
without device time.

    PYTHONPATH=$PWD:/path/to/cuda-plugin-links JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \\
        python benchmarks/decode_kernel_inventory.py --batches 1,32 [--model 12L|bench40] [--context 32768] [--out DIR]

The program is the one ``Engine.generate``'s device loop runs (``decode_chain``: decode, sampling, the Engram hash
on the device; ``bench-h200-12L``, bf16, ``kernel_backend="pallas_gpu"``). Every instruction of the optimised HLO
that becomes a kernel launch is counted (fusions, custom calls — cuBLAS, Triton / Pallas kernels —, copies, sorts,
scatters...; instructions inside command buffers are counted like the others: the profile launches them one by one),
and classified by kind and by the JAX source function its metadata names (``op_name``). Launches per layer = the
total over the number of layers (the head, the sampler and the hash included, as the device profile counts them).
The fusions' kinds say what glue is: ``loop`` / ``input`` fusions that only convert, copy, pad, concatenate or
update a slice, and small reductions.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(1, HERE)

# instructions that launch nothing (views, tuples, control flow whose bodies are counted instead)
NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "call", "while", "conditional",
             "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"}

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")


def computations(text: str) -> dict:
    """{name: [instruction lines]} of an HLO module's text."""
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?(%?[\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$", line)
        if m:
            cur = m.group(1).lstrip("%")
            comps[cur] = []
            if line.startswith("ENTRY"):
                comps["__entry__"] = cur
            continue
        if line.strip() == "}":
            cur = None
            continue
        if cur is not None:
            comps[cur].append(line)
    return comps


def launches(text: str) -> list[dict]:
    """One record per kernel-launching instruction reachable from the entry (through calls, command buffers,
    while bodies counted once per trip when the trip count is known, else once)."""
    comps = computations(text)
    out = []

    def walk(name: str, times: int, seen: tuple):
        if name in seen:
            return
        for line in comps.get(name, []):
            m = _INSTR.match(line)
            if not m:
                continue
            op = m.group(3)
            if op in ("call", "async-start") or op.endswith("-start") and "to_apply" in line:
                for callee in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", line):
                    walk(callee, times, seen + (name,))
                continue
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                walk(body, times * (int(trip.group(1)) if trip else 1), seen + (name,))
                continue
            if op == "conditional":
                for callee in re.findall(r"(?:branch_computations=\{|true_computation=|false_computation=)"
                                         r"%?([\w.\-,% ]+)", line):
                    for c in callee.replace("%", "").split(","):
                        walk(c.strip(), times, seen + (name,))
                continue
            if op in NO_LAUNCH or op.endswith("-done") or op.endswith("-update"):
                continue
            kind = op
            if op == "fusion":
                k = re.search(r"kind=(k\w+)", line)
                kind = "fusion:" + (k.group(1) if k else "?")
                backend = re.search(r'"kind":"([\w]+)"', line)
                if backend:
                    kind += ":" + backend.group(1)
            elif op == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', line)
                kind = "custom-call:" + (target.group(1) if target else "?")
            opname = re.search(r'op_name="([^"]*)"', line)
            out.append(dict(name=m.group(1).lstrip("%"), op=op, kind=kind, shape=m.group(2)[:80],
                            source=opname.group(1) if opname else "", times=times, line=line.strip()[:400]))

    walk(comps["__entry__"], 1, ())
    return out


def source_family(op_name: str) -> str:
    """The innermost project function a kernel comes from (jit(...)/jvp(...)/fn/... paths), coarse."""
    parts = [p for p in op_name.split("/") if p and not p.startswith(("jit(", "pjit", "jvp(", "transpose("))]
    keys = ("mhc", "sinkhorn", "rms", "norm", "rope", "attention", "csa2", "indexer", "topk", "compress", "moe",
            "router", "expert", "shared", "swiglu", "engram", "hash", "head", "sample", "embed", "ring", "window",
            "cache", "readback", "hsi", "reindex")
    for p in reversed(parts):
        low = p.lower()
        for k in keys:
            if k in low:
                return p
    return parts[-2] if len(parts) > 1 else (parts[-1] if parts else "?")


def classify_fusion(line: str) -> str:
    """What a fusion computes, from the called computation's name XLA gives it (e.g. ``convert_fusion``,
    ``dynamic_update_slice_fusion``, ``reduce_fusion``, ``concatenate_fusion``)."""
    m = re.search(r"calls=%?([\w.\-]+)", line)
    name = m.group(1) if m else ""
    base = re.sub(r"[._]\d+$", "", re.sub(r"^fused_", "", name))
    base = re.sub(r"(\.\d+)+$", "", base)
    return base or "?"


def release_abstract(config, params16):
    """Abstract release-format parameters of ``config`` (the bf16 tree ``params16``, abstract): the layout
    ``bench_fused_fp8.random_release_params`` makes, with ``wo_a`` dequantised to bf16 as the Engine serves it."""
    import jax
    import jax.numpy as jnp

    from bench_fused_fp8 import random_release_params
    from dsv41_jax.checkpoint.quantized import QuantizedTensor
    from dsv41_jax.model import release_weights as RW

    stored = jax.eval_shape(lambda p: random_release_params(config, p, jax.random.PRNGKey(0)), params16)
    # ``dequantize_wo_a`` reads the scales on the host: here only its result's shape (the logical shape, bf16)
    return RW._map_with_path(lambda p, w: jax.ShapeDtypeStruct(w.shape, jnp.bfloat16)
                             if RW.served_in_float(p) and isinstance(w, QuantizedTensor) else w, stored)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--flags", default="", help="comma-separated InferenceOptions booleans to set: name (True) or name=0, e.g. mhc_one_pass=0")
    ap.add_argument("--model", default="12L", choices=("12L", "bench40"), help="bench-h200-12L or configs/bench40.py")
    ap.add_argument("--sampler", default="filtered", help="decode_chain's sampler (greedy: as Engine.generate runs "
                    "a greedy batch)")
    ap.add_argument("--weights", default="bf16", choices=("bf16", "release"),
                    help="release: the release's weights as the Engine serves them (FP8 / FP4 / Engram-row bytes, "
                    "wo_a bf16 from load; GEMM inputs rounded to FP8, quantized_gemm=pallas_gpu, one-token FP4 "
                    "kernels at one token, the grouped FP4 kernel above) - profile_release_decode's release form")
    ap.add_argument("--cache", default="bf16", choices=("bf16", "release"),
                    help="release: the release's packed cache (FP8 window ring, FP4 compressed KV and keys), read by "
                    "the kernels (packed_cache_kernels)")
    ap.add_argument("--options", default="", help="JSON object of further InferenceOptions fields, e.g. "
                    "'{\"packed_attention\": \"gather\"}'")
    ap.add_argument("--out", default=None)
    ap.add_argument("--hlo", action="store_true", help="also write the optimised HLO text")
    args = ap.parse_args(argv)
    from deviceless_gpu import h200_device, on_device

    device = h200_device()
    import jax

    from bench_inference import h200_config, synthetic_hasher
    from dsv41_jax.inference.audit import decode_program
    from dsv41_jax.inference.decode import _decode_opts
    from dsv41_jax.inference.step import InferenceOptions

    if args.model == "bench40":
        from profile_decode import bench40  # (imported, it parses no arguments)

        config = bench40()
    else:
        config = h200_config()
    flags = {}
    for f in filter(None, args.flags.split(",")):  # name (True) or name=0 / name=1
        name, _, value = f.partition("=")
        flags[name] = value != "0"
    if args.weights == "release":  # profile_release_decode's release form (flags may override)
        flags = dict(dict(gemm_input_fp8=True, quantized_gemm="pallas_gpu", fp4_one_token=True), **flags)
    if args.cache == "release":
        flags = dict(dict(packed_cache_kernels=True), **flags)
    flags.update(json.loads(args.options) if args.options else {})
    opts = _decode_opts(InferenceOptions(quant_sim=False, index_block_elems=1 << 28, kernel_backend="pallas_gpu",
                                         **flags))
    layers = config.num_hidden_layers
    results = {}
    for b in (int(x) for x in args.batches.split(",")):
        fn, fargs = decode_program(config, b, args.context + 512, opts=opts, chained=True,
                                   hasher=synthetic_hasher(config), sampler=args.sampler,
                                   packed=args.cache == "release")
        if args.weights == "release":
            fargs = (release_abstract(config, fargs[0]),) + tuple(fargs[1:])
        t0 = time.perf_counter()
        # with the decode options' XLA options (``step.decode_compiler_options``), as the Engine's program has them
        compiled = jax.jit(fn, donate_argnums=(1,), compiler_options=dict(opts.compiler_options) or None).lower(
            *on_device(fargs, device)).compile()
        compile_s = time.perf_counter() - t0
        text = compiled.as_text() or ""
        recs = launches(text)
        total = sum(r["times"] for r in recs)
        by_kind = collections.Counter()
        by_what = collections.Counter()
        by_source = collections.Counter()
        for r in recs:
            by_kind[r["kind"]] += r["times"]
            what = classify_fusion(r["line"]) if r["op"] == "fusion" else r["kind"]
            by_what[what] += r["times"]
            by_source[source_family(r["source"])] += r["times"]
        results[b] = dict(batch=b, compile_s=compile_s, launches=total, launches_per_layer=total / layers,
                          by_kind=dict(by_kind.most_common()), by_what=dict(by_what.most_common()),
                          by_source=dict(by_source.most_common()))
        print(f"\nbatch {b}: {total} launches, {total / layers:.1f} per layer (compile {compile_s:.1f} s)")
        print("| kind | launches | per layer |\n|---|---|---|")
        for k, v in by_kind.most_common():
            print(f"| {k} | {v} | {v / layers:.2f} |")
        print("\n| fused computation (XLA's name) | launches |\n|---|---|")
        for k, v in by_what.most_common(40):
            print(f"| {k} | {v} |")
        print("\n| source function | launches |\n|---|---|")
        for k, v in by_source.most_common(40):
            print(f"| {k} | {v} |")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"decode_kernels_b{b}.jsonl"), "w") as f:
                for r in recs:
                    f.write(json.dumps(r) + "\n")
            if args.hlo:
                with open(os.path.join(args.out, f"decode_b{b}.hlo.txt"), "w") as f:
                    f.write(text)
    if args.out:
        with open(os.path.join(args.out, "decode_kernel_inventory.json"), "w") as f:
            json.dump(dict(config=config.name, context=args.context, weights=args.weights, cache=args.cache, flags=flags, sampler=args.sampler, results=results), f,
                      indent=1)
    return results


if __name__ == "__main__":
    main()
