"""The matrix products of the GPU decode program, by shape, at each batch: lowered for CUDA on any machine.

    python benchmarks/decode_dot_inventory.py --batches 1,32 [--flags mhc_one_pass,router_one_pass] [--out DIR]

The device-loop step (``decode_chain``, Pallas GPU kernels, ``bench-h200-12L`` shapes unless ``--model smoke``) is
traced on abstract shapes and lowered for the ``cuda`` platform (no GPU needed: the StableHLO a GPU would compile,
Triton kernels included as custom calls). Every ``dot_general`` is listed with its operand shapes, precision and
the source line that made it, with the program's op counts. Why it matters: XLA's GPU compiler turns a product with
one row (M = 1: a vector times a matrix) into a multiply and a reduction when the matrix is small
(``DotStrengthReduction``) but makes every product of two matrices a GEMM (a Triton fusion that is compiled, and by
default autotuned, or a cuBLAS call), so the same program at batch 32 asks for more GEMM kernels than at batch 1.
Prints a Markdown table per batch; writes ``DIR/decode_dot_inventory.json``.
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

import jax  # noqa: E402

from bench_inference import h200_config, synthetic_hasher  # noqa: E402
from dsv41_jax.inference.audit import decode_program  # noqa: E402
from dsv41_jax.inference.step import InferenceOptions  # noqa: E402


def _source(line: str, aliases: dict) -> str:
    """The innermost dsv41_jax source lines of an op's location."""
    m = re.search(r"loc\((#loc\d+)\)\s*$", line)
    if not m:
        return ""
    files, seen, stack = [], set(), [aliases.get(m.group(1), "")]
    while stack:
        s = stack.pop()
        files += [f"{f.split('dsv41_jax/')[-1]}:{n}" for f, n in re.findall(r'"([^"]+\.py)":(\d+)', s)
                  if "dsv41_jax/" in f and "site-packages" not in f]
        for a in re.findall(r"#loc\d+", s):
            if a not in seen:
                seen.add(a)
                stack.append(aliases.get(a, ""))
    return " < ".join(dict.fromkeys(reversed(files[-3:])))


def inventory(config, batch: int, context: int, flags: tuple) -> dict:
    opts = InferenceOptions(quant_sim=False, index_block_elems=1 << 28, kernel_backend="pallas_gpu",
                            **{f: True for f in flags})
    fn, args = decode_program(config, batch, context + 512, opts=opts, chained=True, hasher=synthetic_hasher(config))
    t0 = time.perf_counter()
    lowered = jax.jit(fn, donate_argnums=(1,)).trace(*args).lower(lowering_platforms=("cuda",))
    lower_s = time.perf_counter() - t0
    text = lowered.as_text(debug_info=True)
    aliases = dict(re.findall(r"^(#loc\d+) = (loc\(.*\))$", text, re.M))
    ops = collections.Counter(re.findall(r"= (?:\"?)(stablehlo\.[a-z_]+)", text))
    dots = collections.Counter()
    for line in text.splitlines():
        if "stablehlo.dot_general" not in line:
            continue
        sig = line.split(" : ")[-1].split(" loc(")[0].strip()
        prec = re.search(r"precision = \[([^,\]]*)", line)
        dots[(sig, prec.group(1) if prec else "DEFAULT", _source(line, aliases))] += 1
    kernels = collections.Counter(re.findall(r"custom_call @([^\(]+)\(", text))
    return dict(batch=batch, flags=list(flags), lower_s=lower_s, ops=dict(ops.most_common()),
                custom_calls=dict(kernels),
                dots=[dict(count=n, shapes=s, precision=p, source=src) for (s, p, src), n in
                      sorted(dots.items(), key=lambda kv: (-kv[1], kv[0]))])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--flags", default="", help="InferenceOptions boolean fields, comma-separated")
    ap.add_argument("--model", default="12L", choices=["12L", "smoke"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.model == "smoke":
        from profile_decode import smoke as make
    else:
        make = h200_config
    config = make()
    flags = tuple(f for f in args.flags.split(",") if f)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        r = inventory(config, b, args.context, flags)
        rows.append(r)
        print(f"\n{config.name}, batch {b}{' + ' + '+'.join(flags) if flags else ''}: {sum(r['ops'].values())} ops, "
              f"{sum(d['count'] for d in r['dots'])} dot_general ({len(r['dots'])} distinct), sorts "
              f"{r['ops'].get('stablehlo.sort', 0)}, while {r['ops'].get('stablehlo.while', 0)}, kernels "
              f"{r['custom_calls']}")
        print("| count | operands -> result | precision | source |")
        print("|---|---|---|---|")
        for d in r["dots"]:
            print(f"| {d['count']} | `{d['shapes']}` | {d['precision']} | {d['source']} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_dot_inventory.json"), "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), jax=jax.__version__, model=config.name,
                           context=args.context, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
