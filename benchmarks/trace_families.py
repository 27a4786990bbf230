#!/usr/bin/env python
"""Where a profiled train step's device time goes, by kernel family: read from the optimised HLO and the device
trace that ``bench_train_ablation.py --profile`` (or ``profile_train.py``) writes (no device needed).

    python benchmarks/trace_families.py --hlo hlo_VARIANT.txt.gz --trace trace_VARIANT.json.gz [--steps 2]

Kernels are named after their fusions in the HLO (or after the fusion whose code they share,
``deduplicated_name``); a fusion's ``op_name`` says whether it belongs to the forward (``jvp(...)``), the backward
(``transpose(...)``) or the optimiser update (the step's top level), and whether it runs inside a loop body
(``/while/``). Library and Pallas / Mosaic kernels are grouped by name. Printed per step: device busy time (union of
the kernels' intervals) against the span of the profiled steps, each family's time and launches, and the largest
fusions of each fusion family with their HLO op and output shape.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trace_events import read_text, stream_kernels, union_length  # noqa: E402


def hlo_fusions(text: str) -> dict:
    """kernel name -> (op_name, result shape) for every fusion / custom call of the optimised HLO."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*?) (fusion|custom-call)\(", line)
        if not m:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        info = (op.group(1) if op else "", m.group(2)[:80])
        out.setdefault(m.group(1).replace(".", "_"), info)
        dedup = re.search(r'deduplicated_name="([^"]*)"', line)
        if dedup:
            out.setdefault(dedup.group(1).replace(".", "_"), info)
    return out


def family(name: str, op_name: str) -> str:
    low = name.lower()
    if "mosaic" in low:
        return "Mosaic GPU expert GEMMs"
    if low.startswith("csa2_sparse_attention_bwd_dq"):
        return "attention bwd dQ (Pallas)"
    if low.startswith("csa2_sparse_attention_bwd_dkv"):
        return "attention bwd dKV (Pallas)"
    if low.startswith("csa2_sparse_attention_fwd"):
        return "attention fwd (Pallas)"
    if low.startswith("narrow_dx"):
        return "narrow float32 projections' input gradient (Pallas)"
    if low.startswith(("indexer", "topk_select")):
        return "indexer / top-k (Pallas)"
    if "nvjet" in low or ("gemm" in low and "bf16" in low):
        return "cuBLAS bf16 GEMMs"
    if "f32f32" in low or "sgemm" in low:
        return "cuBLAS float32 GEMMs"
    if "memcpy" in low or "memset" in low or low.startswith("copy"):
        return "copies / memsets"
    if not op_name:
        return "other (no HLO op)"
    where = "loop body " if "/while/" in op_name else ""
    parts = op_name.split("/")
    if len(parts) > 1 and "transpose(" in parts[1]:
        return f"{where}backward fusions"
    if len(parts) > 1 and "jvp(" in parts[1]:
        return f"{where}forward fusions"
    return f"{where}optimizer update / step-level fusions"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hlo", required=True)
    p.add_argument("--trace", required=True)
    p.add_argument("--steps", type=int, default=2, help="steps the trace holds")
    p.add_argument("--top", type=int, default=6, help="largest fusions shown per fusion family")
    args = p.parse_args(argv)
    fusions = hlo_fusions(read_text(args.hlo))
    fam = collections.defaultdict(lambda: [0.0, 0])
    kernels = collections.defaultdict(lambda: [0.0, 0])
    intervals = []
    for e in stream_kernels(args.trace):
        dur = float(e.get("dur", 0.0))
        intervals.append((float(e["ts"]), float(e["ts"]) + dur))
        kernels[e["name"]][0] += dur
        kernels[e["name"]][1] += 1
    for name, (us, n) in kernels.items():
        f = fam[family(name, fusions.get(name, ("", ""))[0])]
        f[0] += us
        f[1] += n
    s = args.steps
    busy, span = union_length(intervals), max(b for _, b in intervals) - min(a for a, _ in intervals)
    total = sum(v[0] for v in fam.values())
    print(f"per step: device busy {busy / s / 1e3:.1f} ms of a {span / s / 1e3:.1f} ms span "
          f"({len(intervals) / s:.0f} kernels)")
    print("| family | ms / step | share | launches / step |")
    print("|---|---:|---:|---:|")
    for k, (us, n) in sorted(fam.items(), key=lambda kv: -kv[1][0]):
        print(f"| {k} | {us / s / 1e3:.2f} | {us / total:.1%} | {n / s:.0f} |")
    for k in sorted(fam, key=lambda k: -fam[k][0]):
        if "fusions" not in k:
            continue
        rows = [(us, n, name) for name, (us, n) in kernels.items()
                if family(name, fusions.get(name, ("", ""))[0]) == k]
        print(f"\n{k}: largest")
        for us, n, name in sorted(rows, reverse=True)[:args.top]:
            op, shape = fusions.get(name, ("", ""))
            print(f"  {us / s / 1e3:6.2f} ms x{n / s:<4.0f} {name[:34]:34s} {op[-60:]:60s} {shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
