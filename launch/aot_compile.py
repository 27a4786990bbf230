#!/usr/bin/env python
"""Ahead-of-time compile the sharded decode step and CED prefill for a TPU topology — on a CPU host, with libtpu.

Nothing is allocated: parameters and caches are ShapeDtypeStructs with NamedShardings on a mesh built from the
topology's devices; each program is lowered and compiled by the TPU compiler, and ``memory_analysis()`` gives the
per-chip bytes (arguments = this chip's shard of parameters + caches + inputs, outputs, temporaries). That is the
compile-proof that the sharded model fits.

    pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"       # libtpu (no TPU needed)
    python launch/aot_compile.py --config flash --preset v5p-128 --batch 16 --context 1048576
    python launch/aot_compile.py --config tiny --topology v5p:2x2x2 --mesh data=2,expert=2,tensor=2   # CI

Targets: ``decode`` (one token per slot through all layers against the caches), ``prefill`` (CED: the encoder
over one prompt chunk + the decoder source's compressed KV, then the decoder replay of the last
``sliding_window`` tokens — two programs), ``forward`` (the training-mode forward over ``--seq`` tokens).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no GCE metadata server: we are not on a TPU VM
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only; do not fight over the TPU lockfile
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the runtime backend stays the CPU; TPU is only a compile target
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 1024 ** 3
HBM_PER_CHIP = {"v4": 32 * GIB, "v5e": 16 * GIB, "v5litepod": 16 * GIB, "v5p": 95 * GIB, "v6e": 32 * GIB}

_T0 = time.time()


def log(msg: str) -> None:
    print(f"[aot {time.time() - _T0:7.1f}s] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="flash", help="config name or path (default: flash)")
    ap.add_argument("--preset", default=None, help="mesh preset (dsv41_jax.parallel.PRESETS), e.g. v5p-128")
    ap.add_argument("--topology", default=None, help="TPU topology, e.g. v5p:4x4x4 (default: the preset's)")
    ap.add_argument("--mesh", default=None, help="axis sizes, e.g. data=2,expert=2,tensor=2 (default: the preset's)")
    ap.add_argument("--rules", default=None, help="rules preset (default: the preset's, else tp)")
    ap.add_argument("--targets", default="decode,prefill", help="comma list of decode, prefill, forward")
    ap.add_argument("--batch", type=int, default=16, help="sequence slots (decode / prefill batch)")
    ap.add_argument("--context", type=int, default=65536, help="cache max_len (tokens per slot)")
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per CED encoder chunk")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length of the forward target")
    ap.add_argument("--dtype", default="bfloat16", help="parameter / activation / cache dtype")
    ap.add_argument("--moe-impl", default="expert_parallel", help="expert_parallel | ragged")
    ap.add_argument("--capacity-factor", type=float, default=None, help="EP capacity factor (default: dropless)")
    ap.add_argument("--quant-sim", choices=("on", "off"), default="on", help="release fake quantisation")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a config field, e.g. --set vocab_size=264 (repeatable)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    import dsv41_jax
    from dsv41_jax import parallel as par

    preset = par.get_preset(args.preset) if args.preset else None
    topo_name = args.topology or (preset.topology if preset else None)
    if not topo_name:
        raise SystemExit("give --topology (e.g. v5p:2x2x2) or a --preset that has one")
    rules = par.get_rules(args.rules or (preset.rules if preset else "tp"))
    dtype = jnp.dtype(args.dtype)
    config = dsv41_jax.load_config(args.config)
    if args.set:
        config = config.replace(**dict(_parse_override(kv) for kv in args.set))
    log(f"jax {jax.__version__}; config {config.name}; topology {topo_name}")
    topo = topologies.get_topology_desc(topo_name, "tpu")
    devices = topo.devices
    kind = getattr(devices[0], "device_kind", "?")
    log(f"{len(devices)} TPU devices ({kind})")
    shape = par.parse_mesh(args.mesh) if args.mesh else (preset.shape if preset else {"expert": len(devices)})
    mesh = par.make_mesh(shape, devices=devices)
    log(f"mesh {par.describe(mesh)}, rules {rules.name}")
    par.check_model(config, mesh, rules)
    par.check_batch(args.batch, mesh, rules)

    params = par.abstract_sharded_params(config, mesh, rules, dtype)
    param_bytes = sum(_shard_bytes(a) for a in jax.tree.leaves(params))
    log(f"parameters: {_gib(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params)))} total, "
        f"{_gib(param_bytes)} per chip (largest shard)")

    cache_mod = importlib.import_module("dsv41_jax.inference.cache")
    from dsv41_jax.inference.step import InferenceOptions

    opts = InferenceOptions(quant_sim=args.quant_sim == "on", moe_impl=args.moe_impl)
    b = args.batch
    cache = cache_mod.abstract_cache(config, b, args.context, dtype)
    cache_sh = par.cache_shardings(cache, mesh, rules)
    cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), cache, cache_sh)
    cache_bytes = sum(_shard_bytes(a) for a in jax.tree.leaves(cache))
    log(f"caches: batch {b} x context {args.context}: {_gib(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache)))}"
        f" total, {_gib(cache_bytes)} per chip")
    n_eng = len(config.engram_layer_ids)

    def arr(shape, dt, axes=None):
        sh = par.batch_sharding(mesh, rules, shape, axes=axes)
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dt), sharding=sh)

    def eng(t):
        return arr((b, t, n_eng, config.n_hash_cols), jnp.int32) if n_eng else None

    results = {"config": config.name, "topology": topo_name, "device_kind": kind, "n_devices": len(devices),
               "mesh": dict(mesh.shape), "rules": rules.name, "batch": b, "context": args.context,
               "dtype": str(dtype), "moe_impl": args.moe_impl, "capacity_factor": args.capacity_factor,
               "quant_sim": args.quant_sim, "jax": jax.__version__, "param_bytes_per_chip": param_bytes,
               "cache_bytes_per_chip": cache_bytes, "programs": {}}
    hbm = next((v for k, v in HBM_PER_CHIP.items() if topo_name.startswith(k)), None)
    results["hbm_per_chip"] = hbm
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    programs = []  # (name, jitted, abstract args)
    from dsv41_jax.parallel.serving import sharded_ced_prefill, sharded_decode_step

    if "decode" in targets:
        step = sharded_decode_step(config, mesh, rules, opts, cache)
        programs.append(("decode", step, (params, cache, arr((b,), jnp.int32),
                                          arr((b, n_eng, config.n_hash_cols), jnp.int32) if n_eng else None,
                                          arr((b,), bool))))
    if "prefill" in targets:
        c_len = args.prefill_chunk
        enc, dec_, stash = sharded_ced_prefill(config, mesh, rules, opts, cache, c_len)
        r = opts.resolved_replay(config)
        programs.append(("prefill_encoder_chunk", enc,
                         (params, cache, stash, arr((b, c_len), jnp.int32), arr((b,), jnp.int32), eng(c_len))))
        programs.append(("prefill_decoder_replay", dec_, (params, cache, stash, arr((b,), jnp.int32), eng(r))))
    if "forward" in targets:
        fopts = dsv41_jax.ForwardOptions(quant_sim=args.quant_sim == "on", moe_impl=args.moe_impl,
                                         moe_capacity_factor=args.capacity_factor)

        def forward_fn(params, tokens, engram_ids):
            return dsv41_jax.forward(params, tokens, config=config, engram_ids=engram_ids, options=fopts)[:, -1]

        programs.append(("forward", par.sharded_jit(forward_fn, mesh, rules, params_argnum=0, config=config),
                         (params, arr((b, args.seq), jnp.int32), eng(args.seq))))

    for name, jitted, in_args in programs:
        log(f"{name}: lowering ...")
        t0 = time.time()
        lowered = jitted.lower(*in_args)
        log(f"{name}: lowered in {time.time() - t0:.1f}s; compiling for {topo_name} ...")
        t0 = time.time()
        compiled = lowered.compile()
        secs = time.time() - t0
        m = compiled.memory_analysis()
        row = {"compile_s": round(secs, 1)}
        for field in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                      "generated_code_size_in_bytes"):
            row[field] = int(getattr(m, field, 0) or 0)
        row["peak_bytes"] = (row["argument_size_in_bytes"] + row["output_size_in_bytes"]
                             - row["alias_size_in_bytes"] + row["temp_size_in_bytes"]
                             + row["generated_code_size_in_bytes"])
        row["fits"] = None if hbm is None else row["peak_bytes"] <= hbm
        results["programs"][name] = row
        log(f"{name}: compiled in {secs:.1f}s — per chip: arguments {_gib(row['argument_size_in_bytes'])}, "
            f"outputs {_gib(row['output_size_in_bytes'])} (aliased {_gib(row['alias_size_in_bytes'])}), "
            f"temporaries {_gib(row['temp_size_in_bytes'])}, code {_gib(row['generated_code_size_in_bytes'])} "
            f"=> {_gib(row['peak_bytes'])}" + ("" if hbm is None else f" of {_gib(hbm)} HBM: "
                                                 f"{'FITS' if row['fits'] else 'DOES NOT FIT'}"))
    print(summary_markdown(results), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        log(f"wrote {args.out}")
    return results


def _parse_override(kv: str):
    if "=" not in kv:
        raise SystemExit(f"--set expects FIELD=VALUE, got {kv!r}")
    k, v = kv.split("=", 1)
    for cast in (int, float):
        try:
            return k, cast(v)
        except ValueError:
            pass
    return k, {"true": True, "false": False}.get(v.lower(), v)


def _shard_bytes(a) -> int:
    sh = getattr(a, "sharding", None)
    shape = sh.shard_shape(a.shape) if sh is not None else a.shape
    n = 1
    for s in shape:
        n *= s
    return n * a.dtype.itemsize


def _gib(n) -> str:
    return f"{n / GIB:.2f} GiB"


def summary_markdown(r: dict) -> str:
    lines = [f"AOT {r['config']} on {r['topology']} ({r['n_devices']} x {r['device_kind']}), mesh {r['mesh']}, "
             f"rules {r['rules']}, {r['dtype']}, batch {r['batch']} x context {r['context']}, "
             f"MoE {r['moe_impl']} (capacity {r['capacity_factor'] or 'dropless'}), quant_sim {r['quant_sim']}, "
             f"jax {r['jax']}",
             f"parameters {_gib(r['param_bytes_per_chip'])}/chip, caches {_gib(r['cache_bytes_per_chip'])}/chip",
             "",
             "| program | compile s | arguments | outputs | aliased | temporaries | peak / chip | fits |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in r["programs"].items():
        lines.append(f"| {name} | {row['compile_s']} | {_gib(row['argument_size_in_bytes'])} | "
                     f"{_gib(row['output_size_in_bytes'])} | {_gib(row['alias_size_in_bytes'])} | "
                     f"{_gib(row['temp_size_in_bytes'])} | {_gib(row['peak_bytes'])} | "
                     f"{'—' if row['fits'] is None else ('yes' if row['fits'] else 'NO')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
