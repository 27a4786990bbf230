#!/usr/bin/env python
"""Full-size fine-tuning plan for TPU v5p slices: per-chip memory of the flash train step, and the smallest slice
where each mode fits — compiled ahead of time on a CPU host with libtpu, plus a shapes-only estimate.

Modes:
  full          full fine-tuning: float32 master weights (parameter rules), AdamW moments sharded further over the
                batch axes (ZeRO-1: each moment is split over the ``data`` x ``expert`` axes its parameter is
                replicated on), float32 gradients, bf16 compute. ``--zero 3`` (``TrainConfig.zero = 3``): the
                masters and gradients split the same way, each layer's weights all-gathered inside the layer
                (inside its checkpoint with ``--remat-scope layer``) and the gradients reduce-scattered back —
                compiled, like ZeRO-1.
  lora          LoRA (``dsv41_jax.train.lora``, default targets, ``--rank``) on the frozen base held in bf16.
  lora-release  the same on the base in the release's storage (FP8 / FP4 / Engram-row QuantizedTensors).

Two measurements (both printed; ``benchmarks/RESULTS.md`` says which is which):

* ``compile`` (``--layers N``): the real train step of a depth-N twin of the config (full width, all 384 experts,
  no Engram) compiled for the slice's topology; per-chip bytes from ``compiled.memory_analysis()``. A full-depth
  compile of the train step takes far longer than this host allows (the 40-layer *decode* step alone took 17 min
  on 2 cores, benchmarks/aot/v5p-128.log), so the full depth is covered by:
* ``estimate`` (shapes only, full depth): the state each chip holds — master weights / frozen base, optimiser
  state, transient gradients and the bf16 compute copy — computed exactly from the parameter shapes and their
  shardings on the slice's mesh, plus the step's other temporaries (activations, collectives) taken per layer
  from the depth-N compile (``(temp(N) - its own parameter-sized transients) / N`` per layer); Engram's two tables
  are counted analytically (full: a float32 gradient of each table shard). Labelled an estimate everywhere.

    python launch/train_plan.py --modes full,lora,lora-release --batch 8 --seq 4096                # estimate only
    python launch/train_plan.py --modes lora --compile v5p-64 --layers 2 --batch 8 --seq 4096      # + AOT compile
    python launch/train_plan.py --modes full --zero 3 --temp-per-layer 16.04 --batch 8 --seq 4096  # measured temps
    python launch/train_plan.py --modes full --compile v5p-64 --layers 2 --remat-scope layer         # per-layer remat
    python launch/train_plan.py --modes full --zero 3 --layer-remat-temp 26.07 --layers 2 ...       # its estimate
    python launch/train_plan.py --modes full --zero 3 --kernels pallas_tpu --compile v5p-64 --layers 2 \
        --remat-scope layer --batch 8 --seq 4096                     # ZeRO-3 + the Mosaic attention kernels

Attention (``--kernels``): ``reference`` (the plain-JAX sparse attention / indexer; what ``auto`` resolves to on
this CPU host) or ``pallas_tpu``: the Mosaic TPU kernels (attention forward + fused backward, the indexer's
score-pool kernel), each run per shard inside ``shard_map`` over the batch and head axes
(``dsv41_jax.kernels._per_shard``; XLA cannot partition a Mosaic call), lowered under the topology's mesh so that
Mosaic targets the v5p chip.

Rematerialisation (``--remat`` policy, ``--remat-scope``): around the whole forward (every layer's residuals are
alive at once in the backward, so the other temporaries scale with the depth: ``--temp-per-layer``), or around
each decoder layer (one layer's working set + every layer's saved inputs: the depth-N compile's temporaries plus
(L - N) x ``saved_bytes_per_layer_seq``, ``--layer-remat-temp``).

Meshes: ``tensor`` = 4, ``expert`` = chips / 4 up to 32 (the ``pod`` rules split the 384 experts over
``expert`` x ``tensor``, so at most 128-way), ``data`` = the rest. The batch is split over ``data`` x ``expert``: a slice
with more batch shards than ``--batch`` sequences needs one sequence per shard (its row says so); the other
temporaries scale with the sequences per shard, which the estimate takes from the compile as measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from aot_compile import GIB, HBM_PER_CHIP, _parse_override  # noqa: E402

# v5p-N: N TensorCores = N / 2 chips
V5P_TOPOLOGIES = {"v5p-8": "v5p:2x2x1", "v5p-16": "v5p:2x2x2", "v5p-32": "v5p:2x2x4", "v5p-64": "v5p:2x4x4",
                  "v5p-128": "v5p:4x4x4", "v5p-256": "v5p:4x4x8", "v5p-512": "v5p:4x8x8",
                  "v5p-1024": "v5p:8x8x8", "v5p-2048": "v5p:8x8x16"}
MODES = ("full", "lora", "lora-release")
_T0 = time.time()


def log(msg: str) -> None:
    print(f"[plan {time.time() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def chips(slice_name: str) -> int:
    return math.prod(int(x) for x in V5P_TOPOLOGIES[slice_name].split(":")[1].split("x"))


def mesh_shape(n: int) -> dict:
    tensor = 4 if n >= 4 else n
    expert = min(n // tensor, 32)
    return {"data": n // (tensor * expert), "expert": expert, "tensor": tensor}


class _FakeMesh:
    """Axis sizes only (the shapes-only estimate needs no devices)."""

    def __init__(self, shape: dict):
        self.shape = dict(shape)
        self.axis_names = tuple(shape)


def _axis_size(mesh_shape_: dict, entry) -> int:
    if entry is None:
        return 1
    return math.prod(mesh_shape_[a] for a in ((entry,) if isinstance(entry, str) else entry))


def zero_spec(spec, shape, mesh_shape_: dict, batch_axes=("data", "expert")):
    """The ZeRO split of a parameter's spec (``dsv41_jax.parallel.api.zero_spec``): its spec with the batch axes
    the parameter is replicated on added to the first dim that divides evenly; the parameter's spec if none does."""
    from dsv41_jax.parallel.api import zero_spec as _zero_spec

    return _zero_spec(spec, shape, mesh_shape_, batch_axes)


def _shard_elems(shape, spec, mesh_shape_: dict) -> int:
    n = 1
    for d, size in enumerate(shape):
        e = spec[d] if d < len(spec) else None
        n *= -(-size // _axis_size(mesh_shape_, e))
    return n


# ----------------------------------------------------------------------------------------------------------------
# shapes-only state bytes per chip (full depth)
# ----------------------------------------------------------------------------------------------------------------

def state_bytes(config, mode: str, mesh_shape_: dict, rules_name: str, rank: int, zero: int = 1) -> dict:
    """Per-chip bytes of what the step holds or creates in proportion to the parameters (the largest shard).
    ``zero=3`` (full fine-tuning): the float32 masters, their gradients and bf16 cast split like the moments too."""
    from dsv41_jax.model import release_weights as RW
    from dsv41_jax.model.params import FP32, flat_specs
    from dsv41_jax.parallel.api import _padded_shape
    from dsv41_jax.parallel.rules import get_rules, logical_to_spec
    from dsv41_jax.train.lora import LoraConfig, lora_targets

    rules = get_rules(rules_name)
    mesh = _FakeMesh(mesh_shape_)
    out = {"params_f32": 0, "opt_state": 0, "grads_f32": 0, "compute_copy": 0, "base": 0, "adapters": 0,
           "engram_grad": 0}
    formats = RW.storage_formats(config) if mode == "lora-release" else {}
    for path, s in flat_specs(config):
        shape = _padded_shape(path, tuple(s.shape), mesh, rules)
        spec = logical_to_spec(s.axes, mesh, rules, shape, strict=False)
        elems = _shard_elems(shape, spec, mesh_shape_)
        if mode == "full":
            zspec = zero_spec(spec, shape, mesh_shape_)
            z_elems = _shard_elems(shape, zspec, mesh_shape_)
            out["params_f32"] += 4 * (z_elems if zero == 3 else elems)
            out["grads_f32"] += 4 * (z_elems if zero == 3 else elems)
            if s.dtype != FP32:  # the bf16 cast of the masters (ZeRO-3: of the split; the per-layer gather is
                out["compute_copy"] += 2 * (z_elems if zero == 3 else elems)  # in the temporaries)
            out["opt_state"] += 2 * 4 * z_elems
            if path.endswith("/engram/embed"):
                out["engram_grad"] += 4 * elems
        elif mode == "lora" or formats.get(path, "float") == "float":
            out["base"] += (4 if s.dtype == FP32 else 2) * elems
        else:  # release storage: stored bytes split like the weight (whole scale blocks per shard)
            total = RW.stored_bytes(tuple(s.shape), formats[path])
            out["base"] += total * elems // max(1, math.prod(s.shape))
    if mode != "full":
        lc = LoraConfig(rank=rank, alpha=2.0 * rank)
        n = sum(rank * (o + i) for o, i in lora_targets(config, lc).values())
        out["adapters"] = 4 * n * 3 + 4 * n  # float32 adapters + AdamW moments (replicated) + their gradients
    return out


# ----------------------------------------------------------------------------------------------------------------
# the AOT compile of the reduced-depth train step
# ----------------------------------------------------------------------------------------------------------------

def reduced_config(config, layers: int):
    """A depth-``layers`` twin of ``config`` (full width, every expert; Full layers of ratio 2 then 1, no Engram,
    no MTP / DSpark layers)."""
    ratios = tuple((2, 1)[i % 2] for i in range(layers))
    return config.replace(name=f"{config.name}-L{layers}", num_hidden_layers=layers,
                          compress_ratios=ratios + (0,) * config.num_nextn_predict_layers,
                          kv_source_layer_ids=tuple(range(layers)), index_source_layer_ids=tuple(range(layers)),
                          candidate_source_layer_id=layers - 1 if layers > 1 else 0, engram_layer_ids=(),
                          engram_num_embeddings=(), dspark_target_layer_ids=tuple(range(min(3, layers))))


def compile_step(config, mode: str, topology: str, mesh_shape_: dict, rules: str, batch: int, seq: int,
                 rank: int, query_chunk: int, remat: str, remat_scope: str = "forward", zero: int = 1,
                 kernels: str = "reference") -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    from dsv41_jax import parallel as par
    from dsv41_jax.model.params import FP32, flat_specs
    from dsv41_jax.train.config import TrainConfig
    from dsv41_jax.train.step import make_train_step

    devices = topologies.get_topology_desc(topology, "tpu").devices
    mesh = par.make_mesh(mesh_shape_, devices=devices)
    tc = TrainConfig(seq_len=seq, batch_size=batch, steps=1000, compute_dtype="bfloat16", lora=mode != "full",
                     lora_rank=rank, lora_alpha=2.0 * rank, query_chunk=query_chunk, remat=remat,
                     remat_scope=remat_scope, moe_impl="expert_parallel", kernel_backend=kernels,
                     zero=zero if mode == "full" else 0)
    step = make_train_step(config, tc, mesh=mesh, rules=rules)
    abstract = step.abstract_state()
    sh = step.state_shardings()  # full: ZeRO-1 (moments split over the batch axes) or ZeRO-3 (masters too)
    if mode == "full":
        padded = par.abstract_sharded_params(config, mesh, rules, jnp.float32)
        abstract = {**abstract, "params": padded, "opt_state": jax.eval_shape(step.optimizer.init, padded)}
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, sh)
    b_abs = {"tokens": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
             "targets": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
             "loss_mask": jax.ShapeDtypeStruct((batch, seq), jnp.float32),
             "valid": jax.ShapeDtypeStruct((batch, seq), jnp.bool_)}
    b_sh = step.batch_shardings(b_abs)
    b_abs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=b_sh[k]) for k, v in b_abs.items()}
    t0 = time.time()
    # lowered under the topology's mesh: Mosaic kernels read the target chip (not this CPU host) from its devices
    mesh_cm = jax.set_mesh(mesh)
    mesh_cm.__enter__()
    if mode == "full":
        lowered = step.jitted(b_abs).lower(state, b_abs, np.float32(0.0))
    else:
        fp32 = {p for p, s in flat_specs(config) if s.dtype == FP32}
        padded = par.abstract_sharded_params(config, mesh, rules, jnp.bfloat16)
        p_sh = par.param_shardings(config, mesh, rules)
        from dsv41_jax.train.optimizer import map_with_path

        base = map_with_path(lambda p, a: jax.ShapeDtypeStruct(a.shape, jnp.float32 if p in fp32 else a.dtype,
                                                               sharding=a.sharding), padded)
        step.base = base
        step.base_shardings = lambda _b: p_sh
        lowered = step.jitted(b_abs).lower(state, base, b_abs, np.float32(0.0))
    mesh_cm.__exit__(None, None, None)
    t_lower = time.time() - t0
    t0 = time.time()
    try:
        compiled = lowered.compile()
    except Exception as e:  # the TPU compiler refuses programs whose temporaries exceed HBM, and says how much
        import re

        found = re.search(r"HLO temporaries \(([\d.]+)G\)", str(e))
        if not found:
            raise
        need = float(found.group(1)) * 1e9  # the compiler's "G" is 10^9 bytes
        log(f"the compiler refused the program: temporaries {need / GIB:.1f} GiB exceed the chip's HBM")
        return {"lower_s": round(t_lower, 1), "compile_s": round(time.time() - t0, 1), "refused": True,
                "argument_size_in_bytes": None, "output_size_in_bytes": None, "alias_size_in_bytes": None,
                "temp_size_in_bytes": int(need), "generated_code_size_in_bytes": None, "peak_bytes": None}
    t_compile = time.time() - t0
    m = compiled.memory_analysis()
    row = {"lower_s": round(t_lower, 1), "compile_s": round(t_compile, 1), "refused": False}
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                  "generated_code_size_in_bytes"):
        row[field] = int(getattr(m, field, 0) or 0)
    row["peak_bytes"] = (row["argument_size_in_bytes"] + row["output_size_in_bytes"] - row["alias_size_in_bytes"]
                         + row["temp_size_in_bytes"] + row["generated_code_size_in_bytes"])
    return row


# ----------------------------------------------------------------------------------------------------------------

def saved_bytes_per_layer_seq(config, seq: int) -> int:
    """What a per-layer rematerialised step keeps per layer and per sequence for the backward: the layer's inputs
    (the float32 mHC streams [T, hc, d] and pre-mix weights [T, hc]) and its router scores [T, E] (float32; the
    balance statistics read them); the compressed-KV group state ([T / ratio] entries) is counted once per ratio-1
    entry as an upper bound."""
    c = config
    return 4 * seq * (c.hc_mult * c.hidden_size + c.hc_mult + c.n_routed_experts + c.head_dim + c.index_head_dim)


def estimate(config, mode, slice_name, rules, rank, temp_per_layer_seq: float | None, batch: int, seq: int,
             zero: int = 1, layer_remat: tuple[float, int] | None = None) -> dict:
    """Per-chip bytes at full depth on ``slice_name``. ``temp_per_layer_seq``: the compiled step's other temporaries
    per layer and per sequence of a batch shard (whole-forward remat: every layer's temporaries alive in the
    backward, so they scale with the depth). ``layer_remat`` = (temporaries per sequence, depth) of a compiled
    depth-N twin with per-layer remat (``--remat-scope layer``): then the step keeps one layer's working set plus
    every layer's saved inputs, and the full-depth figure is that compile + (L - N) x the saved inputs of a layer
    (``per_layer_remat_basis`` = "compiled"). Without it, ``per_layer_remat_projection`` is the earlier
    projection (one whole-forward layer's temporaries + the saved inputs; basis "projection")."""
    ms = mesh_shape(chips(slice_name))
    sb = state_bytes(config, mode, ms, rules, rank, zero)
    shards = ms["data"] * ms["expert"]
    per_shard = max(1, -(-batch // shards))  # sequences per batch shard (one each when shards > batch)
    held = sb["params_f32"] + sb["opt_state"] + sb["base"] + sb["adapters"]
    transient = sb["grads_f32"] + sb["compute_copy"] + sb["engram_grad"]
    layers = config.num_hidden_layers
    other = None if temp_per_layer_seq is None else temp_per_layer_seq * per_shard * layers
    total = held + transient + (other or 0)
    saved_seq = saved_bytes_per_layer_seq(config, seq)
    if layer_remat is not None:
        temp_seq, depth = layer_remat
        per_layer_remat = held + transient + per_shard * (temp_seq + max(0, layers - depth) * saved_seq)
        basis = "compiled"
    else:
        per_layer_remat = None if temp_per_layer_seq is None else \
            held + transient + per_shard * (temp_per_layer_seq + layers * saved_seq)
        basis = "projection"
    return {"slice": slice_name, "chips": chips(slice_name), "mesh": ms, "state": sb, "held": held,
            "batch": max(batch, shards), "seqs_per_shard": per_shard, "param_transients": transient,
            "other_temporaries": other, "total": total, "per_layer_remat_projection": per_layer_remat,
            "per_layer_remat_basis": basis, "saved_per_layer_per_seq": saved_seq}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="flash")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--modes", default="full,lora,lora-release")
    ap.add_argument("--batch", type=int, default=64, help="global batch (sequences per step)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    ap.add_argument("--rules", default="pod")
    ap.add_argument("--query-chunk", type=int, default=512)
    ap.add_argument("--remat", default="full", help="jax.checkpoint policy of the compiled step")
    ap.add_argument("--remat-scope", choices=("forward", "layer"), default="forward",
                    help="the policy around the whole forward, or around each decoder layer")
    ap.add_argument("--slices", default=",".join(V5P_TOPOLOGIES), help="candidate v5p slices, smallest first")
    ap.add_argument("--compile", default=None, metavar="SLICE", help="AOT-compile the depth-N step on this slice")
    ap.add_argument("--layers", type=int, default=2, help="depth of the compiled twin")
    ap.add_argument("--temp-per-layer", type=float, default=None, metavar="GIB",
                    help="other temporaries per layer and per sequence of a batch shard (GiB), from an earlier "
                         "compile, for the estimate")
    ap.add_argument("--layer-remat-temp", type=float, default=None, metavar="GIB",
                    help="temporaries per sequence of a batch shard (GiB, less the parameter-sized transients) of a "
                         "depth---layers twin compiled with --remat-scope layer, for the per-layer remat column")
    ap.add_argument("--zero", type=int, choices=(1, 3), default=1,
                    help="full fine-tuning (compile and estimate): 1 = moments split over the batch axes, 3 = "
                         "masters and gradients split the same way too, each layer's weights gathered for use")
    ap.add_argument("--kernels", default="reference", choices=("reference", "pallas_tpu"),
                    help="sparse attention / indexer in the compiled step: the plain-JAX reference, or the Mosaic "
                         "TPU kernels (forward + backward), run per shard under shard_map")
    ap.add_argument("--headroom", type=float, default=0.9, help="usable fraction of HBM")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    import dsv41_jax

    config = dsv41_jax.load_config(args.config)
    if args.set:
        config = config.replace(**dict(_parse_override(kv) for kv in args.set))
    hbm = HBM_PER_CHIP["v5p"]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {MODES}")
    results = {"config": config.name, "zero": args.zero, "kernels": args.kernels, "batch": args.batch, "seq": args.seq, "rank": args.rank, "rules": args.rules,
               "remat": args.remat, "remat_scope": args.remat_scope, "hbm_per_chip": hbm, "headroom": args.headroom,
               "modes": {}}
    for mode in modes:
        res = {"compile": None, "estimates": [], "smallest": None}
        temp_pl = None if args.temp_per_layer is None else args.temp_per_layer * GIB
        layer_remat = None if args.layer_remat_temp is None else (args.layer_remat_temp * GIB, args.layers)
        if args.compile:
            small = reduced_config(config, args.layers)
            ms = mesh_shape(chips(args.compile))
            log(f"{mode}: compiling the depth-{args.layers} step on {args.compile} {ms}, batch {args.batch} x "
                f"{args.seq} ...")
            row = compile_step(small, "full" if mode == "full" else "lora", V5P_TOPOLOGIES[args.compile], ms,
                               args.rules, args.batch, args.seq, args.rank, args.query_chunk, args.remat,
                               args.remat_scope, args.zero, args.kernels)
            sb = state_bytes(small, "full" if mode == "full" else "lora", ms, args.rules, args.rank, args.zero)
            own = sb["grads_f32"] + sb["compute_copy"]
            # the shapes-only state of the same twin: checks the estimate against the compiler's argument bytes
            row["estimated_state_bytes"] = sb["params_f32"] + sb["opt_state"] + sb["base"] + sb["adapters"]
            row["temp_minus_param_transients"] = max(0, row["temp_size_in_bytes"] - own)
            row["slice"], row["mesh"], row["layers"] = args.compile, ms, args.layers
            per_shard = max(1, -(-args.batch // (ms["data"] * ms["expert"])))
            row["remat_scope"] = args.remat_scope
            if args.remat_scope == "layer":  # one layer's working set + the saved inputs of args.layers layers
                layer_remat = (row["temp_minus_param_transients"] / per_shard, args.layers)
                row["temp_per_seq_layer_remat"] = layer_remat[0]
                row["temp_per_layer"] = row["temp_minus_param_transients"] / args.layers
            else:
                temp_pl = row["temp_minus_param_transients"] / args.layers / per_shard
                row["temp_per_layer"] = temp_pl * per_shard
                row["temp_per_layer_per_seq"] = temp_pl
            res["compile"] = row
            if not row["refused"]:
                log(f"{mode}: compiled in {row['compile_s']} s: arguments {row['argument_size_in_bytes'] / GIB:.2f} "
                    f"GiB, temporaries {row['temp_size_in_bytes'] / GIB:.2f} GiB, peak {row['peak_bytes'] / GIB:.2f} "
                    f"GiB/chip")
        for s in args.slices.split(","):
            ms = mesh_shape(chips(s))
            e = estimate(config, mode, s, args.rules, args.rank, temp_pl, args.batch, args.seq, args.zero,
                         layer_remat)
            # without the whole-forward temporaries (--temp-per-layer, or a compile with --remat-scope forward)
            # the total is the state alone: no verdict
            e["fits"] = None if e["other_temporaries"] is None else e["total"] <= args.headroom * hbm
            e["fits_with_per_layer_remat"] = (None if e["per_layer_remat_projection"] is None
                                              else e["per_layer_remat_projection"] <= args.headroom * hbm)
            res["estimates"].append(e)
            if e["fits"] and res["smallest"] is None:
                res["smallest"] = s
            if e["fits_with_per_layer_remat"] and res.get("smallest_with_per_layer_remat") is None:
                res["smallest_with_per_layer_remat"] = s
        res["per_layer_remat_basis"] = "compiled" if layer_remat is not None else "projection"
        results["modes"][mode] = res
    print(summary_markdown(results), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


def summary_markdown(r: dict) -> str:
    g = lambda b: "—" if b is None else f"{b / GIB:,.1f}"  # noqa: E731
    lines = [f"{r['config']}: batch {r['batch']} x {r['seq']} tokens, rules {r['rules']}, remat {r['remat']} "
             f"({r.get('remat_scope', 'forward')}), LoRA rank "
             f"{r['rank']}, full fine-tuning ZeRO-{r['zero']}, attention {r.get('kernels', 'reference')}; v5p HBM {r['hbm_per_chip'] / GIB:.0f} GiB/chip, usable {r['headroom']:.0%}", ""]
    for mode, res in r["modes"].items():
        c = res["compile"]
        if c:
            if c["refused"]:
                lines.append(f"**{mode}** — AOT compile of the depth-{c['layers']} twin on {c['slice']} {c['mesh']}: "
                             f"REFUSED by the TPU compiler after {c['compile_s']} s: temporaries "
                             f"{g(c['temp_size_in_bytes'])} GiB/chip exceed HBM; other temporaries "
                             f"{g(c['temp_per_layer'])} GiB per layer")
            else:
                lines.append(f"**{mode}** — AOT compile of the depth-{c['layers']} twin on {c['slice']} {c['mesh']} "
                         f"({c['compile_s']} s): arguments {g(c['argument_size_in_bytes'])} GiB, outputs "
                         f"{g(c['output_size_in_bytes'])} (aliased {g(c['alias_size_in_bytes'])}), temporaries "
                         f"{g(c['temp_size_in_bytes'])}, peak {g(c['peak_bytes'])} GiB/chip (shapes-only state of "
                         f"the twin: {g(c['estimated_state_bytes'])} GiB); other temporaries "
                         f"{g(c['temp_per_layer'])} GiB per layer")
        yn = lambda v: "—" if v is None else ("yes" if v else "no")  # noqa: E731
        lines += [f"**{mode}** — shapes-only estimate at full depth (GiB per chip):", "",
                  "| slice | chips | mesh (data, expert, tensor) | batch (seqs / shard) | weights / base | optimiser "
                  "state | gradients + compute copy | other temporaries (per layer x depth) | total | fits | "
                  f"with per-layer remat ({res.get('per_layer_remat_basis', 'projection')}) | fits |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for e in res["estimates"]:
            st = e["state"]
            lines.append(f"| {e['slice']} | {e['chips']} | {e['mesh']['data']}, {e['mesh']['expert']}, "
                         f"{e['mesh']['tensor']} | {e['batch']} ({e['seqs_per_shard']}) | "
                         f"{g(st['params_f32'] + st['base'] + st['adapters'])} | "
                         f"{g(st['opt_state'])} | {g(e['param_transients'])} | {g(e['other_temporaries'])} | "
                         f"{g(e['total'])} | {yn(e['fits'])} | {g(e['per_layer_remat_projection'])} | "
                         f"{yn(e['fits_with_per_layer_remat'])} |")
        whole = (res["smallest"] or "none of the candidates") if any(
            e["fits"] is not None for e in res["estimates"]) else "not evaluated (no whole-forward temporaries)"
        lines += ["", f"smallest slice for {mode}: {whole}; with per-layer "
                      f"remat ({res.get('per_layer_remat_basis', 'projection')}): "
                      f"{res.get('smallest_with_per_layer_remat') or 'none of the candidates'}",
                  ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
