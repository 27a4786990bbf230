"""Which large tensors a DSpark bench program's kernels read, from its deviceless H200 compile (no GPU): every
top-level kernel (fusion / custom call) of the optimised HLO with an operand of >= 4 MB, the operand's shape and
the kernel kind. Shows weights read whole where a part would do (the routed experts' batched GEMM over every
expert), weights copied before use (a concatenation of projections), or a dynamic-slice copy of an expert.

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=$PWD:<CUDA plugin dir> \\
        python benchmarks/hlo_weight_reads.py --batch 1 --programs "decode step,speculative step" --out DIR

(benchmarks/deviceless_gpu.py: the CUDA plugin of the same jax version importable.) "auto" kernel backends are
resolved as on the device (``pallas_gpu``), not as on this CPU. A stacked expert weight counts whole here; the slot
kernels read only the picked experts' slices of it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPE_BYTES = {"bf16": 2, "f32": 4, "s32": 4, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "u32": 4,
               "f8e4m3fn": 1}
SKIP = {"get-tuple-element", "tuple", "parameter", "bitcast", "copy-start", "copy-done", "while", "conditional",
        "call", "constant"}


def nbytes(shape: str) -> int:
    total = 0
    for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
        if dt in DTYPE_BYTES:
            n = 1
            for d in dims.split(","):
                n *= int(d) if d else 1
            total += n * DTYPE_BYTES[dt]
    return total


def large_reads(hlo: str, threshold: int = 4 << 20) -> list[tuple[int, str, str, str]]:
    """(bytes, operand shape, kernel, kind) for every large operand of a top-level instruction."""
    out = []
    for comp in re.split(r"\n(?=(?:ENTRY )?%?[\w.\-]+ \(.*\) -> .* \{)", hlo):
        head = comp.split("\n", 1)[0]
        if not head.startswith("ENTRY") and ("fused" in head.split("(")[0] or "fusion" in head.split("(")[0]):
            continue  # a fusion's body: its reads are the fusion's operands
        shapes = {}
        for line in comp.split("\n"):
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) (\w[\w\-]*)\((.*)", line)
            if not m:
                continue
            name, shape, op, rest = m.groups()
            shapes[name] = shape
            if op in SKIP:
                continue
            for o in set(re.findall(r"%([\w.\-]+)", rest.split("),")[0])):
                if o in shapes and nbytes(shapes[o]) >= threshold:
                    kind = re.search(r'kind=(\w+)|custom_call_target="([^"]+)"', line)
                    out.append((nbytes(shapes[o]), shapes[o].split("{")[0], name,
                                next((g for g in kind.groups() if g), "") if kind else op))
    return sorted(out, reverse=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--programs", default="decode step,speculative step")
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--out", default=".")
    ap.add_argument("--save-hlo", action="store_true", help="also write each program's optimised HLO to OUT")
    args = ap.parse_args(argv)
    from benchmarks.deviceless_gpu import h200_device, on_device

    dev = h200_device()
    from dsv41_jax import kernels

    resolve = kernels.resolve_backend
    kernels.resolve_backend = lambda b="auto": "pallas_gpu" if b == "auto" else resolve(b)  # as on the device
    from benchmarks.bench_dspark_h200 import target_config
    from benchmarks.dspark_programs import programs
    from dsv41_jax.inference.step import InferenceOptions

    config = target_config(False, args.block_size)
    progs = programs(config, args.batch, 512, 97, InferenceOptions(ced=False, kernel_backend="pallas_gpu"))
    os.makedirs(args.out, exist_ok=True)
    for name in args.programs.split(","):
        fn, a, kw = progs[name]
        hlo = fn.trace(*on_device(a, dev), **kw).lower().compile().as_text()
        if args.save_hlo:
            with open(os.path.join(args.out, f"b{args.batch}_{name.replace(' ', '_')}.hlo.txt"), "w") as f:
                f.write(hlo)
        reads = large_reads(hlo)
        print(f"# {config.name} batch {args.batch}, {name}: {len(reads)} large operands, "
              f"{sum(r[0] for r in reads) / 1e9:.3f} GB (stacked experts counted whole)")
        for b, shape, kernel, kind in reads:
            print(f"{b / 1e6:9.1f} MB  {shape:28s} {kind:28s} {kernel}")


if __name__ == "__main__":
    main()
