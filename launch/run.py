#!/usr/bin/env python
"""Launch dsv41_jax on a mesh: one device, one multi-GPU host, or a multi-host TPU pod (one process per worker).

    python launch/run.py --mode single --config tiny                               # one device
    python launch/run.py --mode host --preset gpu8 --config tiny                   # all GPUs of this host
    python launch/run.py --mode pod --preset v5p-128 --tpu-name my-pod --zone us-east5-a --dry-run
    python launch/run.py --mode pod --coordinator 10.0.0.2:8476 --num-processes 16 --process-id 3 ...

``--mode pod`` calls ``jax.distributed.initialize`` (arguments auto-detected on Cloud TPU VMs, or given with
``--coordinator/--num-processes/--process-id``) before anything touches a device, then builds the global mesh.
``--dry-run`` prints exactly what would run — for a pod, the one command per worker (``gcloud ... ssh
--worker=i``, each with its process id) — plus the mesh, rules and per-chip parameter bytes, and exits without
touching a device. Meshes that do not divide the heads, experts, vocabulary or batch fail before any compile, with
the axis and dimension named.

The task run is a sharded forward over a random (or ``--prompt``) batch: it prints the logits' checksum and can
write process 0's gathered logits (``--out``, .npy) — the end-to-end check of the launch path.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("single", "host", "pod"), default="single")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="config override")
    ap.add_argument("--preset", default=None, help="mesh preset (single, gpu8, gpu8_tp, v5p-128, v5p-256, v6e-256)")
    ap.add_argument("--mesh", default=None, help="axis sizes, e.g. data=2,expert=2,tensor=2 (overrides the preset)")
    ap.add_argument("--rules", default=None, help="rules preset: tp | pod | dp_attention")
    ap.add_argument("--moe-impl", default="expert_parallel")
    ap.add_argument("--capacity-factor", type=float, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quant-sim", choices=("on", "off"), default="off")
    ap.add_argument("--out", default=None, help="process 0 writes the gathered logits here (.npy)")
    ap.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    # distributed
    ap.add_argument("--coordinator", default=None, help="host:port of process 0 (pod mode, off Cloud TPU)")
    ap.add_argument("--num-processes", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("--cpu-collectives", default=None, help="CPU multi-process collectives, e.g. gloo")
    # pod command generation (dry run)
    ap.add_argument("--tpu-name", default=None)
    ap.add_argument("--zone", default=None)
    ap.add_argument("--num-workers", type=int, default=None, help="TPU VM workers (default: from the preset)")
    ap.add_argument("--workdir", default="~/dsv41_jax")
    return ap.parse_args(argv)


def _preset_and_shape(args):
    from dsv41_jax.parallel.mesh import PRESETS, get_preset, parse_mesh

    preset = get_preset(args.preset) if args.preset else (PRESETS["gpu8"] if args.mode == "host" else None)
    shape = parse_mesh(args.mesh) if args.mesh else (preset.shape if preset else None)
    rules = args.rules or (preset.rules if preset else "tp")
    return preset, shape, rules


def _strip(argv, drop_flags=("--dry-run",), drop_values=("--tpu-name", "--zone", "--num-workers", "--workdir",
                                                           "--num-processes", "--process-id")) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        key = a.split("=", 1)[0]
        if key in drop_flags:
            continue
        if key in drop_values:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def worker_commands(args, argv) -> list[str]:
    """One shell command per TPU VM worker (4 chips per worker on v4 / v5p).

    With ``--coordinator`` every worker gets ``--num-processes N --process-id i`` explicitly; without it the
    processes find each other through the Cloud TPU metadata (``jax.distributed.initialize()`` with no arguments).
    """
    preset, shape, _ = _preset_and_shape(args)
    chips = math.prod(shape.values()) if shape else None
    workers = args.num_workers or (max(1, chips // 4) if chips else 1)
    forwarded = " ".join(shlex.quote(a) for a in _strip(argv))
    cmds = []
    for i in range(workers):
        inner = f"cd {args.workdir} && python launch/run.py {forwarded}"
        if args.coordinator:
            inner += f" --num-processes {workers} --process-id {i}"
        if args.tpu_name:
            cmds.append(f"gcloud compute tpus tpu-vm ssh {args.tpu_name}"
                        + (f" --zone {args.zone}" if args.zone else "")
                        + f" --worker={i} --command {shlex.quote(inner)}")
        else:
            cmds.append(f"# on worker {i}: {inner}")
    return cmds


def dry_run(args, argv) -> None:
    import jax

    from dsv41_jax import load_config
    from dsv41_jax.parallel import check_batch, check_model, get_rules, param_partition_specs

    preset, shape, rules = _preset_and_shape(args)
    config = _config(args, load_config)
    shape = shape or {"data": 1, "expert": 1, "tensor": 1}
    mesh = jax.sharding.AbstractMesh(tuple(shape[a] for a in ("data", "expert", "tensor")),
                                     ("data", "expert", "tensor"))
    print(f"# mode {args.mode}; preset {preset.name if preset else '-'}; mesh {shape}; rules {rules}")
    check_model(config, mesh, get_rules(rules))
    check_batch(args.batch, mesh, get_rules(rules))
    specs = param_partition_specs(config, mesh, rules)
    from dsv41_jax.model.params import flat_specs

    per_chip = 0
    for (path, s), spec in zip(flat_specs(config), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(
            x, jax.sharding.PartitionSpec))):
        n = s.size
        for ax in spec:
            for a in ((ax,) if isinstance(ax, str) else (ax or ())):
                n //= shape[a]
        per_chip += n
    total = sum(s.size for _, s in flat_specs(config))
    print(f"# config {config.name}: {_count(total)} parameters, ~{_count(per_chip)} per chip")
    if args.mode == "pod":
        print("# one command per worker:")
        for cmd in worker_commands(args, argv):
            print(cmd)
    else:
        print("python launch/run.py " + " ".join(shlex.quote(a) for a in argv if a != "--dry-run"))


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _config(args, load_config):
    config = load_config(args.config)
    if args.set:
        kv = {}
        for item in args.set:
            k, v = item.split("=", 1)
            try:
                kv[k] = int(v)
            except ValueError:
                kv[k] = float(v) if v.replace(".", "", 1).isdigit() else v
        config = config.replace(**kv)
    return config


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args, argv)
        return 0
    import jax

    if args.cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", args.cpu_collectives)
    if args.mode == "pod":
        kw = {}
        if args.coordinator:
            kw = dict(coordinator_address=args.coordinator, num_processes=args.num_processes,
                      process_id=args.process_id)
        jax.distributed.initialize(**kw)
    jax.config.update("jax_default_matmul_precision", "highest")
    import jax.numpy as jnp
    import numpy as np

    import dsv41_jax
    from dsv41_jax import parallel as par
    from dsv41_jax.model.model import default_hasher

    t0 = time.time()
    pid = jax.process_index()
    preset, shape, rules = _preset_and_shape(args)
    if args.mode == "single" and shape is None:
        shape = {"data": 1, "expert": 1, "tensor": 1}
    mesh = par.make_mesh(shape, devices=jax.devices()[:1] if args.mode == "single" else None)
    config = _config(args, dsv41_jax.load_config)
    par.check_model(config, mesh, rules)
    par.check_batch(args.batch, mesh, rules)
    print(f"[p{pid}] {jax.process_count()} processes, {len(jax.devices())} devices ({jax.devices()[0].platform}), "
          f"mesh {par.describe(mesh)}, rules {rules}", flush=True)
    dtype = jnp.dtype(args.dtype)
    params = dsv41_jax.init_params(config, jax.random.PRNGKey(args.seed), dtype)  # same seed on every process
    params = par.shard_params(params, config, mesh, rules)
    rng = np.random.RandomState(args.seed)
    tokens = rng.randint(3, min(config.vocab_size, 259), (args.batch, args.seq)).astype(np.int32)
    hasher = default_hasher(config.replace(vocab_size=259)) if config.engram_layer_ids and config.vocab_size >= 259 \
        else default_hasher(config)
    eids = None if hasher is None else np.asarray(hasher.row_ids(tokens), np.int32)
    tok_sh = par.batch_sharding(mesh, rules, tokens.shape)
    g_tokens = _global(tokens, tok_sh)
    g_eids = None if eids is None else _global(eids, par.batch_sharding(mesh, rules, eids.shape))
    opts = dsv41_jax.ForwardOptions(quant_sim=args.quant_sim == "on", moe_impl=args.moe_impl,
                                    moe_capacity_factor=args.capacity_factor)
    fwd = par.sharded_forward(config, mesh, rules, opts)
    logits = fwd(params, g_tokens, g_eids)
    from jax.experimental import multihost_utils

    full = np.asarray(multihost_utils.process_allgather(logits, tiled=True)) if jax.process_count() > 1 \
        else np.asarray(logits)
    print(f"[p{pid}] logits {full.shape} checksum {float(np.abs(full).sum()):.6f} "
          f"sharding {logits.sharding.spec} in {time.time() - t0:.1f}s", flush=True)
    if args.out and pid == 0:
        np.save(args.out, full)
    return 0


def _global(x, sharding):
    import jax

    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:  # MeshError / ConfigError: a clear message, no traceback
        if type(e).__name__ not in ("MeshError", "ConfigError"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
