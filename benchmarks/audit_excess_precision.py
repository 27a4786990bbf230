"""Which narrowing roundings does XLA:GPU drop from our programs? (deviceless H200 compiles, no GPU needed)

XLA:GPU's ``xla_allow_excess_precision`` (on by default) lets the compiler remove a pair ``f32 -> bf16 -> f32`` (or
through any narrower float) when it judges the extra precision harmless. Where the model *means* that rounding —
the release's FP8 GEMM-input rounding was one such place, written as an f32 -> f8e4m3fn -> f32 pair and silently
dropped on the GPU until the quantiser rounded on the float32 bits instead — the GPU then computes something more
precise than the reference, not what the reference computes.

This script compiles the same program twice for an NVIDIA H200 (``benchmarks/deviceless_gpu.py``): as the Engine
compiles it, and with ``xla_allow_excess_precision=False``; it counts, per JAX source location (the ``op_name`` /
``source_file:line`` metadata), the float-narrowing ``convert`` instructions left in each optimised program. A
location with fewer narrowing converts under the default than with the option off is a rounding the default
dropped. Programs: the bf16 decode step (``decode_chain``, the Engine's device loop) and the bf16 training
forward + backward of a small config with every layer role.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \\
        python benchmarks/audit_excess_precision.py [--programs decode,train] [--platform h200|cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(1, HERE)

_NARROW = ("bf16", "f16", "f8e4m3fn", "f8e5m2", "f8e4m3", "f8e5m2fnuz", "f8e4m3fnuz")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\(?(\w+)\[")  # "%name = TYPE[dims]... op(...)"
_CONVERT = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(\w+)\[[^\]]*\](?:\{[^}]*\})?\s+convert\(%([\w.\-]+)\)")
_FRAME = re.compile(r"stack_frame_id=(\d+)")


def _tables(text: str) -> dict:
    """stack frame id -> "file:line" (the module's FileNames / FileLocations / StackFrames tables)."""
    section, files, locs, frames = None, {}, {}, {}
    for line in text.splitlines():
        head = line.strip()
        if head in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = head
            continue
        m = re.match(r"^(\d+) (.*)$", head)
        if not m or section is None:
            if head and not m:
                section = None
            continue
        i, rest = int(m.group(1)), m.group(2)
        if section == "FileNames":
            files[i] = os.path.relpath(rest.strip('"'), os.path.dirname(HERE))
        elif section == "FileLocations":
            f, ln = re.search(r"file_name_id=(\d+)", rest), re.search(r"line=(\d+)", rest)
            locs[i] = (int(f.group(1)), int(ln.group(1)))
        elif section == "StackFrames":
            frames[i] = int(re.search(r"file_location_id=(\d+)", rest).group(1))
    return {i: f"{files.get(locs[l][0], '?')}:{locs[l][1]}" for i, l in frames.items() if l in locs}


def narrowing_converts(hlo_text: str) -> collections.Counter:
    """{(source location, narrow type): number of f32 -> narrower-float convert instructions} in an optimised HLO
    module's text (inside fusions too): the roundings the model asks for that the compiled program still does."""
    types = {}
    for line in hlo_text.splitlines():
        m = _DEF.match(line)
        if m:
            types[m.group(1)] = m.group(2)
    where = _tables(hlo_text)
    counts = collections.Counter()
    for line in hlo_text.splitlines():
        m = _CONVERT.match(line)
        if not m or m.group(1) not in _NARROW or types.get(m.group(2)) != "f32":
            continue
        f = _FRAME.search(line)
        counts[(where.get(int(f.group(1)), "?") if f else "?", m.group(1))] += 1
    return counts


def _decode(device, on_device, backend):
    import jax

    from bench_inference import synthetic_hasher
    from dsv41_jax.inference.audit import decode_program
    from dsv41_jax.inference.decode import _decode_opts
    from dsv41_jax.inference.step import InferenceOptions
    from dsv41_jax.train.testing import every_role_config

    config = every_role_config()
    opts = _decode_opts(InferenceOptions(kernel_backend=backend))
    fn, fargs = decode_program(config, 4, 512, opts=opts, chained=True, hasher=synthetic_hasher(config))
    base = dict(opts.compiler_options)

    def compiled(extra):
        return jax.jit(fn, donate_argnums=(1,), compiler_options=dict(base, **extra) or None).lower(
            *on_device(fargs, device)).compile().as_text() or ""

    return compiled


def _train(device, on_device, backend):
    import jax
    import jax.numpy as jnp

    import numpy as np

    from dsv41_jax.model.forward import ForwardOptions, forward
    from dsv41_jax.model.hasher import default_hasher
    from dsv41_jax.model.params import abstract_params
    from dsv41_jax.train.testing import every_role_config

    config = every_role_config()
    params = abstract_params(config, jnp.bfloat16)
    tokens = np.zeros((2, 64), np.int32)
    engram = default_hasher(config).row_ids(tokens) if config.engram_layer_ids else None
    args = (params, jax.ShapeDtypeStruct(tokens.shape, jnp.int32),
            None if engram is None else jax.ShapeDtypeStruct(engram.shape, jnp.int32))
    options = ForwardOptions(kernel_backend=backend)

    def loss(p, tokens, engram_ids):
        logits = forward(p, tokens, config=config, engram_ids=engram_ids, options=options)
        return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))

    fn = jax.value_and_grad(loss)

    def compiled(extra):
        return jax.jit(fn, compiler_options=extra or None).lower(*on_device(args, device)).compile().as_text() or ""

    return compiled


PROGRAMS = {"decode": _decode, "train": _train}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default="decode,train")
    ap.add_argument("--platform", default="h200", choices=("h200", "cpu"),
                    help="h200: XLA:GPU for an NVIDIA H200, deviceless (Pallas GPU kernels); cpu: XLA:CPU (reference "
                    "kernels), where the golden-fixture tests run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from deviceless_gpu import h200_device, on_device

    if args.platform == "h200":
        device, backend = h200_device(), "pallas_gpu"
    else:
        import jax

        device, backend = jax.devices("cpu")[0], "reference"
    report = {}
    for name in filter(None, args.programs.split(",")):
        if name not in PROGRAMS:
            raise SystemExit(f"unknown program {name!r}; choose from {sorted(PROGRAMS)}")
        compile_with = PROGRAMS[name](device, on_device, backend)
        default = narrowing_converts(compile_with({}))
        strict = narrowing_converts(compile_with({"xla_allow_excess_precision": False}))
        dropped = {k: strict[k] - default.get(k, 0) for k in strict if strict[k] > default.get(k, 0)}
        print(f"\n## {name} ({args.platform}): {sum(default.values())} narrowing converts as compiled, "
              f"{sum(strict.values())} with xla_allow_excess_precision=False; "
              f"{len(dropped)} source locations lose roundings")
        print("| source | to | kept | without excess precision |\n|---|---|---:|---:|")
        for k in sorted(dropped, key=lambda k: -dropped[k]):
            print(f"| {k[0]} | {k[1]} | {default.get(k, 0)} | {strict[k]} |")
        report[name] = dict(default=sum(default.values()), strict=sum(strict.values()),
                            dropped=[dict(source=k[0], to=k[1], kept=default.get(k, 0), strict=strict[k])
                                     for k in dropped])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"audit_excess_precision_{args.platform}.json"), "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
