"""The kernels of a batch-1 DSpark speculative step against a plain decode step, from their XLA:GPU programs
compiled for an NVIDIA H200 on this machine (no GPU: ``benchmarks/deviceless_gpu.py``): launches by phase of the
step (target layers, head, acceptance, rollback, the DSpark rings, the drafter, the chain's bookkeeping), so that
what a verification step launches beyond the plain step is found without device time.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \\
        python benchmarks/dspark_step_inventory.py [--experts 8 --topk 6 --drafter-experts 4 --block-size 7] [--out DIR]

The programs are those ``bench_dspark_h200.py``'s device-loop rows run (``decode.decode_chain`` greedy and
``speculative.speculative_chain`` greedy; ``dspark_programs.programs``), bf16, ``pallas_gpu`` kernels. A launch's
phase is read from the JAX source path its metadata names (``op_name``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(1, HERE)

def phase(op_name: str) -> str:
    """A launch's phase: the speculative step's named scope (``speculative.SCOPES``) in its op_name, else the
    chain's bookkeeping (or, in the plain step, everything)."""
    from dsv41_jax.inference.speculative import SCOPES

    for name in SCOPES:
        if f"/{name}/" in op_name or op_name.endswith(f"/{name}"):
            return name
    return "chain / other"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--drafter-experts", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--only", default="decode step,speculative step")
    ap.add_argument("--compiler-options", default="", help="KEY=VALUE,... XLA options of the compiles (e.g. "
                    "xla_disable_hlo_passes=dot-merger)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from deviceless_gpu import h200_device, on_device

    # as on the device: cuBLAS GEMMs (bench_dspark_h200 sets this flag) and the Sinkhorn of the drafter's plain-JAX
    # mHC in its Pallas kernel (ops.mhc's "auto" form picks it when the default backend is a GPU, not here)
    if "xla_gpu_enable_triton_gemm" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false").strip()
    device = h200_device()
    import jax  # noqa: F401  (imported once XLA_FLAGS is final)

    from dsv41_jax.ops import mhc
    mhc.SINKHORN_FORM = "pallas_gpu"

    from bench_dspark_h200 import target_config
    from decode_kernel_inventory import classify_fusion, launches
    from dspark_programs import programs
    from dsv41_jax.inference.step import InferenceOptions

    config = target_config(False, block_size=args.block_size, experts=args.experts, topk=args.topk,
                           drafter_experts=args.drafter_experts)
    opts = InferenceOptions(ced=False, kernel_backend="pallas_gpu")
    progs = programs(config, args.batch, 512, 97, opts)
    results = {}
    for name in args.only.split(","):
        fn, a, kw = progs[name]
        copts = dict(kv.split("=", 1) for kv in args.compiler_options.split(",") if kv) or None
        compiled = fn.trace(*on_device(a, device), **kw).lower().compile(compiler_options=copts)
        text = compiled.as_text() or ""
        recs = launches(text)
        by_phase, by_phase_what = collections.Counter(), collections.Counter()
        for r in recs:
            ph = phase(r["source"])
            what = classify_fusion(r["line"]) if r["op"] == "fusion" else r["kind"]
            by_phase[ph] += r["times"]
            by_phase_what[(ph, what)] += r["times"]
        total = sum(r["times"] for r in recs)
        results[name] = dict(launches=total, by_phase=dict(by_phase.most_common()),
                             by_phase_what={f"{p} | {w}": v for (p, w), v in by_phase_what.most_common()})
        print(f"\n{name} (batch {args.batch}): {total} launches")
        print("| phase | launches |\n|---|---|")
        for k, v in by_phase.most_common():
            print(f"| {k} | {v} |")
        print("\n| phase | kernel (XLA's name / custom call) | launches |\n|---|---|---|")
        for (p, w), v in by_phase_what.most_common(60):
            print(f"| {p} | {w} | {v} |")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            tag = name.replace(" ", "_")
            with open(os.path.join(args.out, f"{tag}.hlo.txt"), "w") as f:
                f.write(text)
            with open(os.path.join(args.out, f"{tag}.jsonl"), "w") as f:
                for r in recs:
                    f.write(json.dumps(r) + "\n")
    if args.out:
        with open(os.path.join(args.out, "dspark_step_inventory.json"), "w") as f:
            json.dump(dict(config=config.name, args=vars(args), results=results), f, indent=1)
    return results


if __name__ == "__main__":
    main()
