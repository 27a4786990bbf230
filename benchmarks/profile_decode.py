"""Profile the engine's decode step on a GPU and compare it with the weight-streaming floor, in one process.

    python benchmarks/profile_decode.py --models 12L,bench40 --batches 1,32 --context 32768 [--out DIR]
    python benchmarks/profile_decode.py --code /path/to/other/checkout ...   # profile another version's code
    python benchmarks/profile_decode.py --loops --readback 1,8,32 ...      # the Engine's decode loops (see --loops)

With ``--loops`` every batch's programs (the device loop's ``decode_chain`` and, for ``--host-loop-batches``, the
host loop's ``decode_and_sample``) are lowered and compiled first, concurrently, with the arguments of their first
call (their compile times and optimised-program sizes are reported); ``--diagnose-compile`` compiles a batch's
device-loop program again alone with XLA's GEMM autotuning off.

For every (model, batch): bf16 parameters and cache, the cache filled with random entries at ``--context`` tokens
per slot; the step is the Engine's (``decode_and_sample``: decode + sampling, cache donated), timed over
``--steps`` steps with a host sync after each (what a serving loop does), then ``--profile-steps`` steps under
``jax.profiler.trace``. The trace's device events are summed by name and kind:

* busy: the union of the device's kernel / copy intervals, against the steps' wall time;
* launches per step (device events) and per layer; device->host / host->device / device->device copies per step;
* the top events by device time;
* the queued step: ``--steps`` steps dispatched back to back without reading the tokens back (max of host and
  device time per step; against the synced step it shows how much of the step is host time).

XLA runs a command buffer (a CUDA graph) as separate launches while a profiler session is active, so the profile's
launch count and busy time are those of the ungraphed step; the timed steps are not profiled.

Floor: the bytes one step must read (``step_bytes``: every weight the step touches — attention, indexer and
compressor, mHC, norms, shared expert, the expected number of distinct routed experts the batch selects, the
embedding rows, Engram rows, the head — plus the KV it reads: SWA rings, the top-k compressed entries, the indexer
keys the Full layers scan and the HSI pool the Reindex layers score), divided by the bandwidth of a read-only
kernel (a bf16 sum over a 4 GiB buffer) measured in the same process.
Prints a Markdown table; writes ``DIR/profile_decode.json``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time


def _args(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="12L", help="comma-separated: 12L (bench-h200-12L), bench40, smoke")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--code", default=None, help="import dsv41_jax from this checkout (default: this one)")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    ap.add_argument("--mhc-kernel", action="store_true", help="InferenceOptions(mhc_kernel=True)")
    ap.add_argument("--options", default="", help="InferenceOptions boolean fields set for every program, "
                    "comma-separated: name (True) or name=0 (e.g. mhc_one_pass=0,router_one_pass=0)")
    ap.add_argument("--floor-gib", type=float, default=4.0, help="buffer size of the read-only bandwidth kernel")
    ap.add_argument("--loops", action="store_true",
                    help="time the Engine's decode loops instead: the device loop (decode_chain: Engram hash and "
                         "token feed on the device, tokens read back every k steps, for each --readback k; the "
                         "profile is of one run of --profile-steps steps) and, for the --host-loop-batches, the "
                         "host loop (tokens read back and hashed on the host every step) as the baseline")
    ap.add_argument("--readback", default="1,8,32", help="with --loops: the read-back intervals k to time")
    ap.add_argument("--host-loop-batches", default="1", help="with --loops: batches that also time the host loop")
    ap.add_argument("--profile-batches", default="all", help="with --loops: batches whose device loop is profiled")
    ap.add_argument("--no-precompile", action="store_true",
                    help="with --loops: compile each program at its first call (default: every batch's programs "
                         "are compiled first, concurrently, and their compile times reported)")
    ap.add_argument("--variant", default="", help="with --loops: InferenceOptions boolean fields, comma-separated "
                    "(e.g. mhc_one_pass,router_one_pass), whose device loop is also timed and profiled, set, at "
                    "--variant-batches")
    ap.add_argument("--variant-batches", default="1")
    ap.add_argument("--diagnose-compile", default="",
                    help="with --loops: batches whose device-loop program is compiled again at the end, alone, "
                         "with XLA's GEMM autotuning off (how much of its compile time is autotuning)")
    ap.add_argument("--diagnose-before-s", type=float, default=1e9,
                    help="skip the --diagnose-compile compiles once this many seconds have passed")
    return ap.parse_args(argv)


ARGS = _args(None if __name__ == "__main__" else [])
HERE = os.path.dirname(os.path.abspath(__file__))
CODE = os.path.abspath(ARGS.code) if ARGS.code else os.path.dirname(HERE)
sys.path.insert(0, CODE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dsv41_jax  # noqa: E402,F401  (first: the version under --code wins over this directory's)

sys.path.insert(1, HERE)
from bench_inference import decode_inputs, fill_cache_program, h200_config, synthetic_hasher  # noqa: E402
from ceilings import read_bandwidth  # noqa: E402
from trace_events import load_trace, newest_trace, union_length  # noqa: E402
from dsv41_jax.config import ModelConfig  # noqa: E402
from dsv41_jax.inference.cache import init_cache  # noqa: E402
from dsv41_jax.inference.decode import decode_and_sample  # noqa: E402
from dsv41_jax.inference.step import InferenceOptions  # noqa: E402
from dsv41_jax.model.counting import expected_distinct_experts  # noqa: E402
from dsv41_jax.model.params import init_params  # noqa: E402
from dsv41_jax.plan import FULL, REINDEX  # noqa: E402


def bench40() -> ModelConfig:
    """configs/bench40.py, read from this checkout (the profiled code may predate it)."""
    from dsv41_jax.presets import from_config_dict
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench40_cfg", os.path.join(os.path.dirname(HERE), "configs",
                                                                            "bench40.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return from_config_dict(mod.get_config())


def smoke() -> ModelConfig:
    return h200_config(engram_vocab=500, hidden_size=128, num_attention_heads=4, head_dim=64, q_lora_rank=64,
                       o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32, index_topk=16,
                       candidate_topk_blocks=8, num_experts_per_tok=2, moe_intermediate_size=64,
                       qk_rope_head_dim=16, vocab_size=1000, engram_head_dim=32, name="smoke")


MODELS = {"12L": h200_config, "bench40": bench40, "smoke": smoke}


# ----------------------------------------------------------------------------------------------------------------
# The floor
# ----------------------------------------------------------------------------------------------------------------

def step_bytes(config: ModelConfig, params, batch: int, context: int, cache: str = "bf16") -> dict:
    """Bytes one decode step must read, by part (see the module docstring). ``params`` may hold the release's
    QuantizedTensor leaves (their bytes + scales count); ``cache``: "bf16" or "release" (the packed formats of
    ``inference.packed_cache``: value bytes + scale bytes per vector)."""
    from dsv41_jax.inference import packed_cache as PC

    if cache not in ("bf16", "release"):
        raise ValueError(f"step_bytes: cache must be 'bf16' or 'release', got {cache!r}")
    c = config
    n_exp, k = c.n_routed_experts, c.num_experts_per_tok
    used = expected_distinct_experts(n_exp, k, batch)  # expected distinct routed experts per layer
    parts = collections.Counter()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = jax.tree_util.keystr(path)
        nbytes = leaf.size * leaf.dtype.itemsize
        if "['experts']" in key:
            parts["routed experts"] += nbytes * used / n_exp
        elif key == "['embed']":
            parts["embedding rows"] += batch * leaf.shape[-1] * leaf.dtype.itemsize
        elif "['engram']['embed']" in key:
            parts["engram rows"] += batch * c.n_hash_cols * leaf.shape[-1] * leaf.dtype.itemsize
        elif "['lm_head']" in key:
            parts["head"] += nbytes
        elif "shared_experts" in key:
            parts["shared expert"] += nbytes
        else:
            parts["attention, indexer, mHC, norms, router"] += nbytes
    def per_value(fmt):  # bytes per cached value: bf16, or the packed format's value + scale bytes
        block, per_byte = PC.FORMATS[fmt]
        return 2.0 if cache == "bf16" else 1 / per_byte + 1 / block

    win, kv, keys = per_value(PC.FP8_UE8M0_32), per_value(PC.FP4_E4M3_16), per_value(PC.FP4_UE8M0_32)
    for s in c.plan.layers:
        parts["KV: SWA rings"] += batch * c.sliding_window * c.head_dim * win
        if s.ratio > 0:
            visible = context // s.ratio
            parts["KV: top-k entries"] += batch * min(c.index_topk, visible) * c.head_dim * kv
            if s.mode == FULL:
                parts["KV: indexer keys (Full)"] += batch * visible * c.index_head_dim * keys
            elif s.mode == REINDEX:
                pool = min(visible, c.candidate_topk_blocks * c.candidate_block_size)
                parts["KV: indexer keys (HSI pool)"] += batch * pool * c.index_head_dim * keys
    return dict(parts)


# ----------------------------------------------------------------------------------------------------------------
# The trace
# ----------------------------------------------------------------------------------------------------------------

def _kind(name: str) -> str:
    n = name.lower().replace(" ", "")
    if "memcpy" in n or "memcpy" in n or n.startswith("copy") and "d2" in n:
        if re.search(r"dtoh|d2h|devicetohost", n):
            return "copy D2H"
        if re.search(r"htod|h2d|hosttodevice", n):
            return "copy H2D"
        if re.search(r"dtod|d2d|devicetodevice|peer", n):
            return "copy D2D"
        return "copy other"
    if "memset" in n:
        return "memset"
    return "kernel"


def summarize_trace(log_dir: str, steps: int, layers: int) -> dict:
    path = newest_trace(log_dir)
    if path is None:
        return {"error": f"no *.trace.json.gz under {log_dir}"}
    events, pname, tname = load_trace(path)
    dev_pids = {p for p, n in pname.items() if re.search(r"/device:(GPU|gpu)|GPU", n) and "host" not in n.lower()}
    by_name = collections.defaultdict(lambda: [0, 0.0])
    kinds = collections.Counter()
    intervals = []
    streams = collections.Counter()
    host_d2h = 0
    for e in events:
        if e.get("ph") != "X":
            continue
        name = e.get("name", "")
        if e["pid"] in dev_pids:
            thread = tname.get((e["pid"], e.get("tid")), "")
            if not re.search(r"stream", thread, re.I):  # per-stream rows only (not the XLA-op / module rows)
                continue
            dur = float(e.get("dur", 0))
            by_name[name][0] += 1
            by_name[name][1] += dur
            kinds[_kind(name)] += 1
            streams[thread] += 1
            intervals.append((float(e["ts"]), float(e["ts"]) + dur))
        elif re.search(r"memcpy.*(dtoh|d2h)|cuMemcpyDtoH|cudaMemcpy.*DeviceToHost", name, re.I):
            host_d2h += 1
    if not intervals:
        return {"error": "no device events in the trace", "processes": sorted(set(pname.values()))[:20],
                "threads": sorted(set(tname.values()))[:40]}
    busy_us = union_length(intervals)
    span_us = max(e for _, e in intervals) - min(s for s, _ in intervals)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    top = ranked[:15]
    return dict(device_events_per_step=sum(kinds.values()) / steps,
                launches_per_layer=kinds["kernel"] / steps / layers,
                d2h_per_step=kinds["copy D2H"] / steps, h2d_per_step=kinds["copy H2D"] / steps,
                d2d_per_step=kinds["copy D2D"] / steps, memset_per_step=kinds["memset"] / steps,
                host_d2h_calls_per_step=host_d2h / steps,
                busy_ms_per_step=busy_us / 1e3 / steps, device_span_ms_per_step=span_us / 1e3 / steps,
                streams=dict(streams),
                top=[dict(name=n[:90], count_per_step=v[0] / steps, ms_per_step=v[1] / 1e3 / steps) for n, v in top],
                # every event name (up to 400): which kernels a step launches, for the fusion work
                events=[[n[:90], v[0] / steps, round(v[1] / 1e3 / steps, 4)] for n, v in ranked[:400]])


# ----------------------------------------------------------------------------------------------------------------

def time_steps(step, cache, steps):
    """``step(cache, i, read_back=True) -> cache`` after its first call: one warm call, then ``steps`` synced calls
    (tokens read back, each timed), then ``steps`` queued back to back without read-back — the host runs ahead while
    the device works, so that is max(host time, device time) per step, close to the device time when the synced step
    is host-bound. Returns (cache, synced seconds per step, queued ms per step)."""
    cache = step(cache, 1)
    ts = []
    for i in range(steps):
        t0 = time.perf_counter()
        cache = step(cache, 2 + i)
        ts.append(time.perf_counter() - t0)
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    for i in range(steps):
        cache = step(cache, 50 + i, read_back=False)
    jax.block_until_ready(cache)
    return cache, ts, (time.perf_counter() - t0) / steps * 1e3


def profile_one(config, params, batch, context, opts, steps, profile_steps, out_dir):
    cache = init_cache(config, batch, context + 64, jnp.bfloat16)
    cache = fill_cache_program(cache, context, jax.random.PRNGKey(1))
    samp, eids, tok, act = decode_inputs(config, batch)

    def step(cache, i, read_back=True):
        nxt, cache = decode_and_sample(params, cache, tok, eids, act, *samp, jnp.full((batch,), i, jnp.int32),
                                       config=config, opts=opts)
        if read_back:
            np.asarray(nxt)  # the serving loop reads the tokens back every step
        return cache

    t0 = time.perf_counter()
    cache = step(cache, 0)
    compile_s = time.perf_counter() - t0
    cache, ts, queued_ms = time_steps(step, cache, steps)
    log_dir = tempfile.mkdtemp(prefix="decode_trace_")  # traces stay on the machine; the summary is returned
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        t0 = time.perf_counter()
        for i in range(profile_steps):
            with jax.profiler.StepTraceAnnotation("decode", step_num=i):
                cache = step(cache, 100 + i)
        wall = (time.perf_counter() - t0) / profile_steps
    del cache
    summary = summarize_trace(log_dir, profile_steps, config.num_hidden_layers)
    return dict(step_ms=statistics.median(ts) * 1e3, step_ms_min=min(ts) * 1e3, queued_step_ms=queued_ms,
                compile_s=compile_s,
                profiled_wall_ms=wall * 1e3, **summary)


def check_device_hash(config, hasher, batch=256, steps=6) -> dict:
    """The device hash against the host hasher on this device: random tokens over random look-backs."""
    from dsv41_jax.ops.engram_hash import device_history, engram_row_ids_step, engram_row_ids_step_device

    rng = np.random.default_rng(0)
    tables = hasher.device_tables()
    ids = rng.integers(0, config.vocab_size, (batch, 5))
    _, hist = engram_row_ids_step(ids, hasher.empty_history(batch), hasher.token_map, hasher.layout,
                                  valid=rng.random((batch, 5)) > 0.2)
    dev = jnp.asarray(device_history(hist))
    fn = jax.jit(engram_row_ids_step_device)
    equal = 0
    for _ in range(steps):
        new = rng.integers(0, config.vocab_size, batch)
        want, hist = hasher.step(new[:, None], hist)
        got, dev = fn(tables, dev, jnp.asarray(new, jnp.int32))
        equal += int(np.array_equal(np.asarray(got), want[:, 0]))
    return dict(device_hash_equal_steps=equal, device_hash_steps=steps, device_hash_rows=batch)


def loop_setup(config, batch, context, opts, readback, profile_steps, host_loop, packed=False) -> dict:
    """The inputs of the two decode loops at one batch size (see --loops): a filled cache (``packed``: in the
    release's packed formats), the device loop's state and limits, the host loop's first inputs."""
    from dsv41_jax.ops.engram_hash import device_history

    cache = init_cache(config, batch, context + 512, jnp.bfloat16, packed=packed)
    # committed to the device like every later step's cache (a step's output; the state below is committed too):
    # an uncommitted first cache gives the first call other input shardings than the second, so jit compiled the
    # 40-layer program twice, the second time inside the timed loop's warm-up (20-60 s a form on an H200)
    cache = jax.device_put(fill_cache_program(cache, context, jax.random.PRNGKey(1)), jax.devices()[0])
    samp, _, tok, act = decode_inputs(config, batch)
    hasher = synthetic_hasher(config)
    ring = max(max(readback), profile_steps, 2)  # decode_chain's readback rows: a run of <= ring steps
    state = {"tokens": tok, "active": act, "generated": jnp.zeros((batch,), jnp.int32),
             "step": jnp.zeros((), jnp.int32), "readback": jnp.zeros((ring + 1, batch), jnp.int32)}
    tables = None
    if hasher is not None:
        tables = hasher.device_tables()
        state["engram_history"] = jnp.asarray(device_history(hasher.empty_history(batch)))
    host_eids = None
    if hasher is not None:  # the host loop's first rows (the shapes and placement of every later step's rows)
        host_eids = jnp.asarray(hasher.step(np.full((batch, 1), 5), hasher.empty_history(batch))[0][:, 0])
    # the device loop: nothing comes back between steps; greedy, no stops, limits far away
    never = jnp.full((batch, 1), -2, jnp.int32)
    far = jnp.full((batch,), 1 << 30, jnp.int32)
    return dict(batch=batch, cache=cache, samp=samp, act=act, hasher=hasher, tables=tables, host_loop=host_loop,
                state=jax.device_put(state, jax.devices()[0]), limits=(never, far, far), host_eids=host_eids)


def loop_programs(config, params, opts, s) -> dict:
    """{name: thunk} lowering and compiling each program the loops of setup ``s`` run, with exactly the arguments
    (shapes, placement, donation) of their first call, so that the call finds the compiled program in jit's
    cache. Each thunk returns its lowering / compile seconds and the size of the optimised program."""
    from dsv41_jax.inference.decode import _decode_opts, _decode_sample, decode_chain_program
    from dsv41_jax.inference.step import jit_for

    dopts = _decode_opts(opts)
    b = s["batch"]
    jobs = {}

    def job(lower):
        def run():
            t0 = time.perf_counter()
            lowered = lower()
            t1 = time.perf_counter()
            compiled = lowered.compile()
            t2 = time.perf_counter()
            text = compiled.as_text() or ""
            return dict(lower_s=t1 - t0, compile_s=t2 - t1, hlo_chars=len(text), hlo_fusions=text.count(" fusion("),
                        hlo_custom_calls=text.count(" custom-call("), hlo_while=text.count(" while("))
        return run

    chain = decode_chain_program(dopts).jitted
    jobs[f"B{b} device loop (decode_chain)"] = job(lambda: chain.lower(
        params, s["cache"], s["state"], s["tables"], *s["samp"], *s["limits"], config=config, opts=dopts))
    if s["host_loop"]:
        host = jit_for(_decode_sample, dopts, static=("config", "opts", "return_logits")).jitted
        jobs[f"B{b} host loop (decode_and_sample)"] = job(lambda: host.lower(
            params, s["cache"], jnp.asarray(np.full((b,), 5, np.int32)), s["host_eids"], s["act"], *s["samp"],
            jnp.full((b,), 1, jnp.int32), config=config, opts=dopts, return_logits=False))
    return jobs


def precompile(jobs: dict) -> dict:
    """Run the compile thunks concurrently (XLA compiles release the GIL); {name: stats or error}."""
    import concurrent.futures

    def guarded(fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - report; the timed call then compiles (or fails) itself
            return dict(error=repr(e)[:300])

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, len(jobs))) as ex:
        out = dict(zip(jobs, ex.map(guarded, jobs.values())))
    out["all programs (concurrently), s"] = time.perf_counter() - t0
    return out


def profile_loops(config, params, s, opts, steps, profile_steps, readback, profile=True):
    """The decode loops a serving Engine runs (see --loops), timed on setup ``s``'s cache."""
    from dsv41_jax.inference.decode import decode_chain

    batch, samp, act, hasher, tables = s["batch"], s["samp"], s["act"], s["hasher"], s["tables"]
    cache, state = s.pop("cache"), s.pop("state")
    out = {}
    if hasher is not None:
        out.update(check_device_hash(config, hasher))
    if s["host_loop"]:  # the previous per-step loop: read the tokens back, hash them on the host, send the rows
        hist = hasher.empty_history(batch) if hasher else None
        host_tok = np.full((batch,), 5, np.int32)
        ts = []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            eids = None
            if hasher is not None:
                rows, hist = hasher.step(host_tok[:, None], hist)
                eids = jnp.asarray(rows[:, 0])
            nxt, cache = decode_and_sample(params, cache, jnp.asarray(host_tok), eids, act, *samp,
                                           jnp.full((batch,), i + 1, jnp.int32), config=config, opts=opts)
            host_tok = np.asarray(nxt)
            ts.append(time.perf_counter() - t0)
        out.update(host_loop_step_ms=statistics.median(ts[2:]) * 1e3, host_loop_first_call_s=ts[0])

    def run(n):
        nonlocal cache, state
        for _ in range(n):
            _t, state, cache = decode_chain(params, cache, state, tables, *samp, *s["limits"], config=config,
                                            opts=opts)
        return np.asarray(state["readback"])  # one read-back per run, as the Engine does

    t0 = time.perf_counter()
    run(1)
    out["first_call_s"] = time.perf_counter() - t0  # the compile, unless precompiled
    run(2)
    for k in readback:
        n = max(2 * k, steps)  # at least two runs: the read-back of one overlaps nothing, of the next likewise
        n = -(-n // k) * k
        t0 = time.perf_counter()
        for _ in range(n // k):
            run(k)
        out[f"device_loop_k{k}_step_ms"] = (time.perf_counter() - t0) / n * 1e3
    jax.block_until_ready(cache)
    if profile:
        log_dir = tempfile.mkdtemp(prefix="decode_trace_")
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            t0 = time.perf_counter()
            run(profile_steps)  # one run: the tokens read back once, at its end
            wall = (time.perf_counter() - t0) / profile_steps
        out.update(profiled_wall_ms=wall * 1e3, **summarize_trace(log_dir, profile_steps, config.num_hidden_layers))
    del cache
    k_best = max(readback)
    out.update(step_ms=out[f"device_loop_k{k_best}_step_ms"], readback_every=k_best)
    return out


def diagnose_compile(config, params, opts, batch, context, readback, profile_steps) -> dict:
    """The device loop's program at ``batch`` compiled alone with XLA's GEMM autotuning off
    (``xla_gpu_autotune_level=0``; a new program: other compile options are another cache entry), against its
    compile with the default autotuning (the precompile): how much of the compile time is autotuning."""
    from dsv41_jax.inference.decode import _decode_opts, decode_chain_program

    s = loop_setup(config, batch, context, opts, readback, profile_steps, False)
    dopts = _decode_opts(opts)
    t0 = time.perf_counter()
    lowered = decode_chain_program(dopts).jitted.lower(params, s["cache"], s["state"], s["tables"], *s["samp"],
                                                        *s["limits"], config=config, opts=dopts)
    t1 = time.perf_counter()
    out = {f"B{batch} device loop lowering alone, s": t1 - t0}
    try:
        lowered.compile(compiler_options={"xla_gpu_autotune_level": 0})
        out[f"B{batch} device loop compile alone, autotune off, s"] = time.perf_counter() - t1
    except Exception as e:  # noqa: BLE001
        out[f"B{batch} device loop compile alone, autotune off"] = repr(e)[:200]
    return out


def print_loops(args, meta, bw, rows) -> None:
    ks = [int(x) for x in args.readback.split(",")]
    print(f"\n{args.label} — decode loops — JAX {jax.__version__}, {meta['device']}, context {args.context}, bf16, "
          f"read-only kernel {bw / 1e12:.2f} TB/s")
    head = ["model", "batch", "floor ms", "host loop ms (x floor)"] + [f"device loop k={k} ms (x floor)" for k in ks]
    head += ["profiled run busy ms/step", "busy %", "launches/layer", "D2H/step", "H2D/step",
             "device loop compile s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        if "step_ms" not in r:
            print(f"| {r['model']} | {r['batch']} | error: {r.get('error')} |")
            continue
        f = r["floor_ms"]
        host = f"{r['host_loop_step_ms']:.2f} ({r['host_loop_step_ms'] / f:.2f}x)" if "host_loop_step_ms" in r else "-"
        cells = [r["model"], str(r["batch"]), f"{f:.2f}", host]
        cells += [f"{r[f'device_loop_k{k}_step_ms']:.2f} ({r[f'device_loop_k{k}_step_ms'] / f:.2f}x)" for k in ks]
        if "busy_ms_per_step" in r:
            cells += [f"{r['busy_ms_per_step']:.2f}", f"{100 * r['busy_ms_per_step'] / r['profiled_wall_ms']:.0f}",
                      f"{r['launches_per_layer']:.1f}", f"{r['d2h_per_step']:.3f}", f"{r['h2d_per_step']:.3f}"]
        else:
            cells += ["-"] * 5
        compile_s = r.get("compile", {}).get("compile_s", r.get("first_call_s", float("nan")))
        cells += [f"{compile_s:.1f}"]
        print("| " + " | ".join(cells) + " |")
        if "device_hash_equal_steps" in r:
            print(f"  {r['model']} B={r['batch']}: device Engram hash == host hash in {r['device_hash_equal_steps']}"
                  f" / {r['device_hash_steps']} steps of {r['device_hash_rows']} rows")
    for r in rows:
        for t in r.get("top", [])[:8]:
            print(f"  {r['model']} B={r['batch']}: {t['ms_per_step']:.3f} ms/step x{t['count_per_step']:.0f} "
                  f"{t['name']}")
    for name, v in meta.get("compile", {}).items():
        print(f"  compile: {name}: {v if not isinstance(v, float) else round(v, 1)}")


def _flags(text: str) -> dict:
    """InferenceOptions booleans from "a,b=0,c=1": a name alone sets True, name=0 False."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        out[name] = value != "0"
    return out


def main():
    args = ARGS
    out = args.out or os.environ.get("OUT") or "."
    os.makedirs(out, exist_ok=True)
    bw = read_bandwidth(args.floor_gib)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), jax=jax.__version__, device=jax.devices()[0].device_kind,
                code=CODE, label=args.label, context=args.context, read_bandwidth_tb_s=bw / 1e12,
                options=args.options,
                command="python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]))
    print(json.dumps(meta), flush=True)
    rows = []
    opts = InferenceOptions(quant_sim=False, index_block_elems=1 << 28,
                            **(dict(mhc_kernel=True) if args.mhc_kernel else {}),
                            **_flags(args.options))
    t_start = time.perf_counter()
    ks = [int(x) for x in args.readback.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    for name in args.models.split(","):
        config = MODELS[name]()
        params = init_params(config, jax.random.PRNGKey(0), jnp.bfloat16)
        jax.block_until_ready(params)
        setups, vopts, vbatches = {}, None, []
        if args.loops:  # every batch's inputs first; each batch's programs compiled at once before it is timed
            host_batches = args.host_loop_batches.split(",")
            for b in batches:
                setups[b] = loop_setup(config, b, args.context, opts, ks, args.profile_steps, str(b) in host_batches)
            if args.variant:
                vopts = dataclasses.replace(opts, **_flags(args.variant))
                vbatches = [int(x) for x in args.variant_batches.split(",")]
                for b in vbatches:
                    setups[b, args.variant] = loop_setup(config, b, args.context, vopts, ks, args.profile_steps,
                                                         False)
        for b in batches:
            if args.loops and not args.no_precompile:  # (a batch's slow compile cannot hide the earlier rows)
                jobs = {f"{config.name} {k}": v for k, v in loop_programs(config, params, opts, setups[b]).items()}
                if b in vbatches:
                    jobs.update({f"{config.name} {k} {args.variant}": v for k, v in
                                 loop_programs(config, params, vopts, setups[b, args.variant]).items()})
                done = precompile(jobs)
                done[f"B{b} programs (concurrently), s"] = done.pop("all programs (concurrently), s")
                meta.setdefault("compile", {}).update(done)
                print(json.dumps({"compile": done}), flush=True)
            variants = [(opts, "", b)] + ([(vopts, args.variant, (b, args.variant))] if b in vbatches else [])
            for o, variant, key in variants if args.loops else [(opts, "", b)]:
                parts = step_bytes(config, params, b, args.context)
                floor_ms = sum(parts.values()) / bw * 1e3
                try:
                    if args.loops:
                        r = profile_loops(config, params, setups.pop(key), o, args.steps, args.profile_steps, ks,
                                          profile=args.profile_batches == "all"
                                          or str(b) in args.profile_batches.split(","))
                        r["compile"] = meta.get("compile", {}).get(
                            f"{config.name} B{b} device loop (decode_chain)" + (f" {variant}" if variant else ""), {})
                    else:
                        r = profile_one(config, params, b, args.context, opts, args.steps, args.profile_steps, out)
                except Exception as e:  # noqa: BLE001 - report and continue with the next size
                    r = dict(error=repr(e)[:400])
                r.update(model=config.name + (f" + {variant}" if variant else ""), batch=b, floor_ms=floor_ms,
                         step_gb=sum(parts.values()) / 1e9, bytes=parts)
                rows.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "events"}), flush=True)
                with open(os.path.join(out, f"profile_decode{('_' + args.label) if args.label else ''}.json"),
                          "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)  # after every row: a cut-off run keeps them
        for b in (int(x) for x in args.diagnose_compile.split(",") if x):
            if time.perf_counter() - t_start > args.diagnose_before_s:
                meta.setdefault("compile", {})[f"B{b} diagnosis"] = "skipped (time)"
                continue
            meta.setdefault("compile", {}).update(diagnose_compile(config, params, opts, b, args.context, ks,
                                                                   args.profile_steps))
            print(json.dumps({"compile": meta["compile"]}), flush=True)
        del params
    with open(os.path.join(out, f"profile_decode{('_' + args.label) if args.label else ''}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if args.loops:
        print_loops(args, meta, bw, rows)
        return
    print(f"\n{args.label} — JAX {jax.__version__}, {meta['device']}, context {args.context}, bf16, read-only "
          f"kernel {bw / 1e12:.2f} TB/s")
    print("| model | batch | step ms | floor ms | step / floor | queued step ms | busy ms | busy % | launches/step | "
          "per layer | D2H/step | D2D/step | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "busy_ms_per_step" not in r:
            print(f"| {r['model']} | {r['batch']} | error: {r.get('error')} |")
            continue
        print(f"| {r['model']} | {r['batch']} | {r['step_ms']:.2f} | {r['floor_ms']:.2f} | "
              f"{r['step_ms'] / r['floor_ms']:.2f} | {r['queued_step_ms']:.2f} | {r['busy_ms_per_step']:.2f} | "
              f"{100 * r['busy_ms_per_step'] / r['profiled_wall_ms']:.0f} | {r['device_events_per_step']:.0f} | "
              f"{r['launches_per_layer']:.0f} | {r['d2h_per_step']:.1f} | {r['d2d_per_step']:.1f} | "
              f"{r['compile_s']:.1f} |")
    for r in rows:
        for t in r.get("top", [])[:8]:
            print(f"  {r['model']} B={r['batch']}: {t['ms_per_step']:.3f} ms/step x{t['count_per_step']:.0f} "
                  f"{t['name']}")


if __name__ == "__main__":
    main()
