"""Compile time and step time of the Engine's decode programs per (batch, options, XLA GEMM autotuning level).

    python benchmarks/bench_decode_compile.py --cases 32:at0:host,1:at0:host,32:at0:onepass,32:default \
        --deadline-s 250 --out DIR

On a GPU, XLA turns a dot with one token (M = 1: a vector times a matrix) whose matrix is small into a multiply and
a reduction (``DotStrengthReduction``: below 10 M elements, or when Triton cannot take it), but every dot of a
32-token step is a GEMM fusion, and each distinct GEMM fusion is autotuned: XLA compiles its candidate Triton
tilings and times them on the device. This script measures how much of a decode program's compile that is, and
whether the autotuned tilings make the step faster.

A case is ``BATCH:LEVEL[:FLAG...]``: LEVEL ``default`` (XLA's autotuning) or ``atN`` (``xla_gpu_autotune_level=N``;
0 = no autotuning: each GEMM fusion gets XLA's default tiling); FLAGs: ``host`` (also the host loop's program,
``decode_and_sample``), ``cublas`` (``xla_gpu_enable_triton_gemm=false``: GEMMs by cuBLAS), ``onepass``
(``InferenceOptions.mhc_one_pass`` + ``router_one_pass``), ``mhc``, ``router`` (one of them), ``nonorm``
(``InferenceOptions.norm_kernel=False``: each site's collapse + RMS norm as XLA's kernels), ``greedy`` (the device
loop with ``sampler="greedy"``: no vocabulary sort, as ``Engine.generate`` runs a greedy batch), ``ctxN`` / ``ctxNk``
(this case's context: N tokens, or N x 1024; default ``--context``). Per case: the device
loop's program (``decode_chain``, the step ``Engine.generate`` runs) and the host loop's are lowered and compiled
concurrently (their compile seconds and, for autotuned compiles, the number of fusions XLA autotuned are recorded),
then timed as ``profile_decode.py --loops`` times them (bf16 parameters and cache, ``--context`` tokens per
slot; the host loop reads the tokens back, hashes them on the host and sends the rows every step; the device loop
reads back every k steps, driven as ``Engine.generate`` drives it, ``decode.run_device_loop``: unpipelined — each
run dispatched after the previous one is read back — and pipelined — the next run dispatched first, the Engine's
default), and ``--profile-steps`` device loop steps in runs of ``--profile-every`` are profiled, unpipelined and
pipelined (launches per layer, device->host copies, kernel time over the wall and over the device's span). The floor
is ``profile_decode.step_bytes`` over a read-only kernel's bandwidth in the same process.

Cases run in order; the programs are called as the compiled executables (``jax.stages.Compiled``), so each case's
compiler options apply to exactly its programs. XLA keeps autotuning results for the process, so a later autotuned
compile reuses the fusions an earlier one tuned (the order is part of the result). With ``--deadline-s`` a compile
that would end past the deadline is abandoned (reported as "not finished after N s") and the process ends after
writing what it has. With ``--ahead`` every case is set up and lowered first and all programs compile concurrently
(the contexts and batches of one model in one call, e.g. ``--model bench40 --ahead --cases
1:default:greedy:ctx8k,1:default:greedy:ctx128k,32:default:greedy:ctx32k``). Prints a Markdown table; writes ``DIR/bench_decode_compile.json`` after every case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import shutil
import tempfile
import threading
import time

T_START = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(1, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import profile_decode as pd  # noqa: E402  (its argument parser reads nothing when imported)
from ceilings import read_bandwidth  # noqa: E402
from dsv41_jax.inference.decode import (_decode_opts, _decode_sample, decode_chain_program,  # noqa: E402
                                       run_device_loop)
from dsv41_jax.inference.step import InferenceOptions, jit_for  # noqa: E402

FLAGS = {"onepass": ("mhc_one_pass", "router_one_pass"), "mhc": ("mhc_one_pass",), "router": ("router_one_pass",),
         "nonorm": ("norm_kernel=0",)}  # name (True) or name=0 (False): InferenceOptions booleans


def _args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="12L", choices=sorted(pd.MODELS))
    ap.add_argument("--cases", default="32:at0:host,1:at0:host,32:default")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--profile-every", type=int, default=8, help="the profiled loop's steps per read-back")
    ap.add_argument("--readback", default="1,8,32")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="seconds from the start after which no compile "
                    "is waited for")
    ap.add_argument("--reserve-s", type=float, default=20.0, help="seconds kept after a compile for timing it")
    ap.add_argument("--floor-gib", type=float, default=4.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ahead", action="store_true", help="set up every case, compile all their programs "
                    "concurrently, then time them in turn (see run_ahead)")
    ap.add_argument("--setup-until-s", type=float, default=None, help="with --ahead: seconds from the start after "
                    "which no further case is set up (default: half of --deadline-s)")
    return ap.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    level: int | None  # xla_gpu_autotune_level; None = XLA's default
    flags: tuple
    host: bool
    cublas: bool = False  # xla_gpu_enable_triton_gemm=false
    greedy: bool = False  # the device loop with sampler="greedy" (no vocabulary sort), as Engine.generate runs greedy
    context: int | None = None  # tokens per slot; None = --context

    @property
    def name(self) -> str:
        lvl = "default autotuning" if self.level is None else f"autotune level {self.level}"
        return (f"B{self.batch} {lvl}" + " cuBLAS GEMMs" * self.cublas + "".join(f" +{f}" for f in self.flags)
                + " greedy sampler" * self.greedy + (f" context {self.context}" if self.context else ""))


def parse_cases(spec: str) -> list:
    out = []
    for item in spec.split(","):
        parts = item.split(":")
        if len(parts) < 2 or not parts[0].isdigit() or not (parts[1] == "default" or parts[1].startswith("at")):
            raise SystemExit(f"--cases: {item!r} is not BATCH:default|atN[:host|cublas|onepass|mhc|router...]")
        level = None if parts[1] == "default" else int(parts[1][2:])
        flags, host, cublas, greedy, context = [], False, False, False, None
        for f in parts[2:]:
            if f.startswith("ctx") and f[3:].rstrip("k").isdigit():
                context = int(f[3:].rstrip("k")) * (1024 if f.endswith("k") else 1)
            elif f == "host":
                host = True
            elif f == "cublas":
                cublas = True
            elif f == "greedy":
                greedy = True
            elif f in FLAGS:
                flags += FLAGS[f]
            else:
                raise SystemExit(f"--cases: unknown flag {f!r} in {item!r} (host, cublas, greedy, ctxN, ctxNk, "
                                 f"{', '.join(FLAGS)})")
        out.append(Case(int(parts[0]), level, tuple(dict.fromkeys(flags)), host, cublas, greedy, context))
    return out


def lower_programs(config, params, opts, s, case: Case) -> tuple:
    """({name: lowered}, lowering seconds) of the case's programs, kept in LOWERED for a case that differs only in
    its compiler options."""
    dopts = _decode_opts(opts)
    b = s["batch"]
    lowered = {}
    t0 = time.perf_counter()
    key = (b, case.flags, case.greedy, case.context)  # a case that differs only in its compiler options reuses it
    if "device loop" not in LOWERED.get(key, {}):
        chain = decode_chain_program(dopts).jitted
        LOWERED.setdefault(key, {})["device loop"] = chain.lower(
            params, s["cache"], s["state"], s["tables"], *s["samp"], *s["limits"], config=config, opts=dopts,
            sampler="greedy" if case.greedy else "filtered")
    lowered["device loop"] = LOWERED[key]["device loop"]
    if case.host:
        if "host loop" not in LOWERED[key]:
            host = jit_for(_decode_sample, dopts, static=("config", "opts", "return_logits")).jitted
            LOWERED[key]["host loop"] = host.lower(
                params, s["cache"], jnp.asarray(np.full((b,), 5, np.int32)), s["host_eids"], s["act"], *s["samp"],
                jnp.full((b,), 1, jnp.int32), config=config, opts=dopts, return_logits=False)
        lowered["host loop"] = LOWERED[key]["host loop"]
    return lowered, time.perf_counter() - t0


def compile_programs(config, params, opts, s, case: Case, dump_dir: str) -> tuple:
    """({name: compiled}, {name: stats}): the case's programs lowered, then compiled concurrently in threads."""
    copts = {} if case.level is None else {"xla_gpu_autotune_level": case.level}
    if case.cublas:
        copts["xla_gpu_enable_triton_gemm"] = False
    lowered, lower_s = lower_programs(config, params, opts, s, case)
    stats = {"lower_s": lower_s}
    compiled = {}

    def work(name):
        o = dict(copts)
        dump = None
        if case.level is None or case.level > 0:  # which fusions XLA autotuned
            dump = os.path.join(dump_dir, f"autotune_{case.batch}_{name.replace(' ', '_')}_{time.time_ns()}.txt")
            o["xla_gpu_dump_autotune_results_to"] = dump
        t = time.perf_counter()
        try:
            compiled[name] = lowered[name].compile(compiler_options=o or None)
            stats[f"{name} compile_s"] = time.perf_counter() - t
            if dump and os.path.exists(dump):
                with open(dump) as f:
                    stats[f"{name} autotuned_fusions"] = f.read().count("results {")
                shutil.copy(dump, os.path.join(OUT_DIR, os.path.basename(dump)))  # which fusions, which tilings
        except Exception as e:  # noqa: BLE001 - reported in the row
            stats[f"{name} error"] = repr(e)[:300]

    threads = [threading.Thread(target=work, args=(n,), daemon=True) for n in lowered]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, DEADLINE - (time.perf_counter() - T_START)))
    if any(t.is_alive() for t in threads):
        stats["unfinished"] = [n for n in lowered if n not in compiled and f"{n} error" not in stats]
        for n in stats["unfinished"]:
            stats[f"{n} compile_s"] = f"not finished after {time.perf_counter() - t0:.0f} s"
    return compiled, stats


def time_case(config, params, compiled, s, steps, profile_steps, readback, profile_every) -> dict:
    """The loops of ``profile_decode.profile_loops``, on the compiled executables; the device loop both
    unpipelined and pipelined."""
    b, samp, act, hasher, tables = s["batch"], s["samp"], s["act"], s["hasher"], s["tables"]
    cache, state = s.pop("cache"), s.pop("state")
    out = {}
    if "host loop" in compiled:
        fn = compiled["host loop"]
        hist = hasher.empty_history(b) if hasher else None
        tok = np.full((b,), 5, np.int32)
        ts = []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            eids = None
            if hasher is not None:
                rows, hist = hasher.step(tok[:, None], hist)
                eids = jnp.asarray(rows[:, 0])
            nxt, cache = fn(params, cache, jnp.asarray(tok), eids, act, *samp,
                            jnp.full((b,), i + 1, jnp.int32))
            tok = np.asarray(nxt)
            ts.append(time.perf_counter() - t0)
        out["host_loop_step_ms"] = statistics.median(ts[2:]) * 1e3
    fn = compiled["device loop"]
    carry = [cache, state]
    del cache, state

    def loop(steps, k, pipeline):
        """``steps`` device loop steps in runs of ``k``, each run read back once, driven as ``Engine.generate``
        drives them (``decode.run_device_loop``; pipelined: the next run dispatched before this one is read back)."""
        def dispatch(first, n):
            for _ in range(n):
                _t, carry[1], carry[0] = fn(params, carry[0], carry[1], tables, *samp, *s["limits"])
            return carry[1]["readback"]

        def consume(buf, first, n):
            np.asarray(buf)  # the run's one transfer
            return True

        run_device_loop(dispatch, lambda read, queued: min(k, steps - queued), consume, pipeline=pipeline)

    loop(3, 3, False)
    for k in readback:
        n = -(-max(2 * k, steps) // k) * k  # at least two runs
        for pipeline in (False, True):
            t0 = time.perf_counter()
            loop(n, k, pipeline)
            out[f"device_loop_k{k}{'' if pipeline else '_unpipelined'}_step_ms"] = \
                (time.perf_counter() - t0) / n * 1e3
    jax.block_until_ready(carry[0])
    # the profile: --profile-steps steps in runs of --profile-every, unpipelined and pipelined (the Engine's default)
    for pipeline in (False, True):
        log_dir = tempfile.mkdtemp(prefix="decode_trace_")
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            t0 = time.perf_counter()
            loop(profile_steps, profile_every, pipeline)
            wall = (time.perf_counter() - t0) / profile_steps
        summary = pd.summarize_trace(log_dir, profile_steps, config.num_hidden_layers)
        summary.pop("events", None)
        if not pipeline:
            summary = {f"{key}_unpipelined": v for key, v in summary.items() if not isinstance(v, (dict, list))}
        out.update({f"profiled_wall_ms{'' if pipeline else '_unpipelined'}": wall * 1e3}, **summary)
        shutil.rmtree(log_dir, ignore_errors=True)
    out.update(profile_steps=profile_steps, profile_every=profile_every)
    del carry
    return out


DEADLINE = 1e9
OUT_DIR = "."
LOWERED: dict = {}


def main(argv=None):
    global DEADLINE, OUT_DIR
    args = _args(argv)
    DEADLINE = args.deadline_s
    out_dir = args.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    OUT_DIR = out_dir
    dump_dir = tempfile.mkdtemp(prefix="autotune_")
    cases = parse_cases(args.cases)
    ks = [int(x) for x in args.readback.split(",")]
    config = pd.MODELS[args.model]()
    bw = read_bandwidth(args.floor_gib)
    params = init_params_bf16(config)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), jax=jax.__version__, device=jax.devices()[0].device_kind,
                model=config.name, context=args.context, read_bandwidth_tb_s=bw / 1e12,
                command="python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]))
    print(json.dumps(meta), flush=True)
    rows = []
    path = os.path.join(out_dir, "bench_decode_compile.json")

    def save():
        with open(path, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)

    if args.ahead:
        run_ahead(args, config, params, bw, cases, ks, dump_dir, rows, save)
    for case in [] if args.ahead else cases:
        if time.perf_counter() - T_START > DEADLINE - args.reserve_s:
            rows.append(dict(case=case.name, skipped="deadline"))
            continue
        opts, s, row = setup_case(args, config, params, bw, case, ks)
        compiled, stats = compile_programs(config, params, opts, s, case, dump_dir)
        row["compile"] = stats
        print(json.dumps(row), flush=True)
        if stats.get("unfinished"):
            rows.append(row)
            save()
            break  # a compile thread still runs: leave (its work would disturb any later timing)
        if "device loop" in compiled:
            try:
                row.update(time_case(config, params, compiled, s, args.steps, args.profile_steps, ks,
                                     args.profile_every))
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:400]
        s.clear()
        del compiled
        rows.append(row)
        save()
        print(json.dumps(row), flush=True)
    save()
    print_table(meta, rows, ks)
    sys.stdout.flush()
    os._exit(0)  # an abandoned compile thread must not keep the process alive


def setup_case(args, config, params, bw, case, ks):
    """(options, loop setup with a filled cache, the row with its floor) of one case."""
    context = case.context or args.context
    flags = {f.partition("=")[0]: f.partition("=")[2] != "0" for f in case.flags}
    opts = InferenceOptions(quant_sim=False, index_block_elems=1 << 28, **flags)
    s = pd.loop_setup(config, case.batch, context, opts, ks, args.profile_steps, case.host)
    parts = pd.step_bytes(config, params, case.batch, context)
    row = dict(case=case.name, batch=case.batch, context=context, autotune_level=case.level, flags=list(case.flags),
               floor_ms=sum(parts.values()) / bw * 1e3, step_gb=sum(parts.values()) / 1e9,
               floor_parts_gb={k: v / 1e9 for k, v in parts.items()}, started_s=time.perf_counter() - T_START)
    return opts, s, row


def run_ahead(args, config, params, bw, cases, ks, dump_dir, rows, save):
    """--ahead: every case's cache is allocated and filled and its programs lowered first, then all the programs
    compile at once in threads (XLA's compiles release the GIL; the device machine's cores run them side by side,
    so the compile phase costs about the longest compile instead of their sum), then each case is timed in turn
    on its own cache (freed after it). Every case's cache is resident during the compiles: the cases must fit the
    device together beside the parameters. Cases not set up by ``--setup-until-s`` are skipped; compiles are waited
    for until ``--reserve-s`` before the deadline, and the cases compiled by then are timed (a row records how many
    compiles still ran while it was timed: they share the host's cores, not the device, as long as none autotunes)."""
    setups = []
    setup_until = args.setup_until_s if args.setup_until_s is not None else DEADLINE / 2
    for case in cases:
        if time.perf_counter() - T_START > setup_until:
            rows.append(dict(case=case.name, skipped=f"not set up: past --setup-until-s {setup_until:.0f}"))
            continue
        opts, s, row = setup_case(args, config, params, bw, case, ks)
        _, row["lower_s"] = lower_programs(config, params, opts, s, case)  # tracing holds the GIL: one by one
        setups.append((case, opts, s, row))
        print(json.dumps(dict(case=case.name, set_up_and_lowered_s=time.perf_counter() - T_START)), flush=True)
    results = [None] * len(setups)

    def work(i):
        case, opts, s, _ = setups[i]
        results[i] = compile_programs(config, params, opts, s, case, dump_dir)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(setups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, DEADLINE - args.reserve_s - (time.perf_counter() - T_START)))
    compile_wall = time.perf_counter() - t0
    print(json.dumps(dict(all_compiles_wall_s=compile_wall, done_s=time.perf_counter() - T_START)), flush=True)
    for i, (case, opts, s, row) in enumerate(setups):
        if results[i] is None:
            row.update(compile={"device loop compile_s": f"not finished after {compile_wall:.0f} s"},
                       skipped="compile not finished")
            rows.append(row)
            s.clear()
            continue
        compiled, stats = results[i]
        stats["all cases' compiles, wall s"] = compile_wall
        row["compile"] = stats
        if "device loop" in compiled and time.perf_counter() - T_START < DEADLINE - args.reserve_s / 2:
            row["compiles_running_while_timed"] = sum(t.is_alive() for t in threads)
            try:
                row.update(time_case(config, params, compiled, s, args.steps, args.profile_steps, ks,
                                     args.profile_every))
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:400]
        elif "device loop" in compiled:
            row["skipped"] = "deadline"
        s.clear()
        results[i] = None
        rows.append(row)
        save()
        print(json.dumps(row), flush=True)


def init_params_bf16(config):
    from dsv41_jax.model.params import init_params

    params = init_params(config, jax.random.PRNGKey(0), jnp.bfloat16)
    jax.block_until_ready(params)
    return params


def print_table(meta, rows, ks):
    print(f"\n{meta['model']}, context {meta['context']}, bf16, {meta['device']}, JAX {meta['jax']}, read-only "
          f"kernel {meta['read_bandwidth_tb_s']:.2f} TB/s; device loop unpipelined / pipelined "
          "(decode.run_device_loop)")
    head = ["case", "batch", "context", "floor ms", "host loop ms (x floor)"]
    head += [f"device loop k={k} ms unpipelined / pipelined (x floor)" for k in ks]
    head += ["launches/layer", "D2H/step", "busy % of wall unpipelined / pipelined",
             "busy % of device span unpipelined / pipelined", "device loop compile s", "host loop compile s",
             "autotuned fusions"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))

    def sec(v):
        return f"{v:.1f}" if isinstance(v, float) else (v or "-")

    for r in rows:
        if "floor_ms" not in r or r.get("skipped"):
            print(f"| {r['case']} | {r.get('skipped', r.get('error'))} |")
            continue
        f = r["floor_ms"]
        cells = [r["case"], str(r["batch"]), str(r.get("context", meta["context"])), f"{f:.2f}"]
        h = r.get("host_loop_step_ms")
        cells.append(f"{h:.2f} ({h / f:.2f}x)" if h else "-")
        for k in ks:
            u, v = r.get(f"device_loop_k{k}_unpipelined_step_ms"), r.get(f"device_loop_k{k}_step_ms")
            cells.append(f"{u:.2f} / {v:.2f} ({v / f:.2f}x)" if u and v else "-")
        if "launches_per_layer" in r:
            wall = [100 * r[f"busy_ms_per_step{x}"] / r[f"profiled_wall_ms{x}"] for x in ("_unpipelined", "")]
            span = [100 * r[f"busy_ms_per_step{x}"] / r[f"device_span_ms_per_step{x}"] for x in ("_unpipelined", "")]
            cells += [f"{r['launches_per_layer']:.1f}", f"{r['d2h_per_step']:.3f}", "{:.1f} / {:.1f}".format(*wall),
                      "{:.1f} / {:.1f}".format(*span)]
        else:
            cells += ["-"] * 4
        c = r["compile"]
        cells += [sec(c.get("device loop compile_s")), sec(c.get("host loop compile_s")),
                  str(c.get("device loop autotuned_fusions", "-"))]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
