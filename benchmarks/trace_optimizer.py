#!/usr/bin/env python
"""What the optimiser update costs inside a profiled train step: read from ``profile_train.py``'s optimised HLO and
device trace (no device needed).

    python benchmarks/trace_optimizer.py --hlo STEP_hlo.txt.gz --trace STEP_trace.json.gz [--steps 2]

The update's kernels are the ENTRY fusions whose ``op_name`` sits at the step's top level (``jit(step_fn)/add`` ...,
not under ``jvp`` / ``transpose``: the forward and backward). Each fusion's device time is its kernel's mean time in
the trace (kernels are named after the fusions, else after the fusion whose code they share: ``deduplicated_name``;
fusions with neither name in the trace are counted apart: the gradient-norm reductions, fused into their producers);
its bytes are its operands' and results' sizes (each read or written once). Printed: the number of such fusions,
their time per step, and the large ones (> 1 MB) with their bandwidth, against ``--copy-tbps`` (the device's copy
bandwidth, read + write).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trace_events import read_text, stream_kernels  # noqa: E402

_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


def shape_bytes(text: str) -> int:
    total = 0
    for dt, dims in re.findall(r"\b(f32|bf16|f16|s32|u32|pred|s8|u8|f64|s64)\[([\d,]*)\]", text):
        n = 1
        for d in dims.split(","):
            n *= int(d) if d else 1
        total += n * _BYTES[dt]
    return total


def optimizer_fusions(hlo: str) -> list[dict]:
    """ENTRY fusions at the step's top level: {name, kernel, op_name, bytes}."""
    signature = {}  # fused computation -> bytes of its parameters and results
    entry = False
    out = []
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?%(\S+) \((.*)\) -> (.*) \{$", line)
        if m:
            entry = bool(m.group(1))
            signature[m.group(2)] = shape_bytes(m.group(3)) + shape_bytes(m.group(4))
            continue
        if not entry or " fusion(" not in line:
            continue
        name = re.match(r"\s*%(\S+) = ", line)
        op = re.search(r'op_name="([^"]*)"', line)
        callee = re.search(r"calls=%([^,\s]+)", line)
        if not (name and op and callee):
            continue
        top = op.group(1).split("/")
        if len(top) < 2 or not top[0].startswith("jit(") or "jvp" in top[1] or "transpose" in top[1]:
            continue
        dedup = re.search(r'deduplicated_name="([^"]*)"', line)
        out.append({"name": name.group(1), "kernels": [n.replace(".", "_") for n in
                                                       (name.group(1), dedup.group(1) if dedup else None) if n],
                    "op_name": op.group(1), "bytes": signature.get(callee.group(1), 0)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hlo", required=True)
    p.add_argument("--trace", required=True)
    p.add_argument("--steps", type=int, default=2, help="steps the trace holds")
    p.add_argument("--copy-tbps", type=float, default=4.3, help="copy bandwidth, TB/s (read + write)")
    args = p.parse_args(argv)
    fusions = optimizer_fusions(read_text(args.hlo))
    times = collections.defaultdict(list)
    for e in stream_kernels(args.trace):
        times[e["name"]].append(float(e.get("dur", 0.0)))
    rows = []
    for fu in fusions:
        kernel = next((k for k in fu["kernels"] if k in times), fu["kernels"][0])
        t = times.get(kernel)
        rows.append({**fu, "kernel": kernel, "us": sum(t) / len(t) if t else 0.0, "seen": bool(t)})
    unseen = [r for r in rows if not r["seen"]]
    rows = [r for r in rows if r["seen"]]
    big = [r for r in rows if r["bytes"] > 1e6]
    small = [r for r in rows if r["bytes"] <= 1e6]
    tot = sum(r["us"] for r in rows) / 1e3
    print(f"optimiser update (top-level fusions of the step): {len(rows)} fusions run, {tot:.2f} ms per step "
          f"({len(unseen)} more fusions of the HLO with no kernel of their name in the trace: "
          f"{sum(r['bytes'] for r in unseen) / 1e6:.0f} MB of operands + results; by op: "
          f"{dict(collections.Counter(r['op_name'].split('/')[1] for r in unseen).most_common(4))})")
    b_big, t_big = sum(r["bytes"] for r in big), sum(r["us"] for r in big)
    print(f"  {len(big)} fusions over 1 MB: {t_big / 1e3:.2f} ms, {b_big / 1e9:.1f} GB moved, "
          f"{b_big / max(t_big, 1e-9) / 1e6:.2f} TB/s = {b_big / max(t_big, 1e-9) / 1e6 / args.copy_tbps:.0%} "
          f"of the copy bandwidth ({args.copy_tbps} TB/s); floor at that bandwidth {b_big / args.copy_tbps / 1e9:.2f} ms")
    print(f"  {len(small)} fusions up to 1 MB: {sum(r['us'] for r in small) / 1e3:.2f} ms")
    by_op = collections.defaultdict(lambda: [0, 0.0, 0])
    for r in rows:
        k = by_op[r["op_name"].split("/")[1]]
        k[0], k[1], k[2] = k[0] + 1, k[1] + r["us"], k[2] + r["bytes"]
    print("  by op: " + ", ".join(f"{op} {n} fusions {us / 1e3:.2f} ms {b / 1e9:.1f} GB"
                                  for op, (n, us, b) in sorted(by_op.items(), key=lambda kv: -kv[1][1])))
    print("| fusion | kernel | MB | us | TB/s |")
    print("|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: -r["us"])[:12]:
        print(f"| {r['name']} | {r['kernel']} | {r['bytes'] / 1e6:.1f} | {r['us']:.1f} | "
              f"{r['bytes'] / max(r['us'], 1e-9) / 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
