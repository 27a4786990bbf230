"""CED prefill of one long prompt: time, model FLOPs utilisation against a matmul probe, and where the time goes.

    python benchmarks/bench_prefill.py --model 12L --tokens 32768 [--moe-impls engine,tiled] [--full engine] [--out DIR]
    python benchmarks/bench_prefill.py --model 12L --tokens 32768 --moe-impls engine --chunks 512,1024,2048,4096 \
        --full engine --full-chunks 512,2048,4096      # a chunk-size sweep against one probe (the first: baseline)
    python benchmarks/bench_prefill.py --smoke            # the same code path on the CPU at toy size (seconds)

In one process:
  1. a bf16 matmul probe (``profile_train.matmul_probe``: the best of large bf16 GEMMs, FLOP/s) — the MFU
     denominator measured on the same chip in the same run;
  2. CED prefill (``inference.prefill``) of one prompt of ``--tokens`` tokens (batch 1, random token ids, bf16
     parameters and cache, fake quantisation off) in chunks of ``--chunk`` tokens (default 512, the Engine's
     ``prefill_chunk``): median of ``--reps`` runs after a compiling run, for every MoE variant of ``--moe-impls``
     (an A/B switch: ``engine`` the default options — on a Hopper GPU the prefill chunks' routed experts run the
     Mosaic GPU grouped GEMM, ``InferenceOptions.grouped_prefill_moe`` —, ``tiled`` the tiled expert loop,
     ``grouped_mgpu`` / ``grouped`` the training step's grouped GEMM kernels through ``ops.moe``), and for every
     chunk length of ``--chunks`` (a sweep: the same prompt, probe and parameters; each chunk length its own
     compiled chunk program, whose buffer bytes are read from XLA's memory-usage report);
  3. the FLOPs of that prefill counted from the config (``model.counting.prefill_flops``, whose docstring states
     the rules): GEMM FLOPs = 2 x the active matrix parameters of every layer a token passes — the encoder layers for
     every prompt token, the decoder's KV source's compressor and indexer keys for every prompt token, every decoder
     layer for the last ``replay_len`` tokens — routed experts at top-k / n_experts, the indexer key projection per
     compressed entry, the head for the last token only; attention = 4 x heads x head_dim per (query, key) for the
     window plus the min(top-k, visible) compressed entries; indexer = 2 x index heads x (index dim + 1) per
     (query, scored entry). MFU is reported on the GEMM FLOPs alone and on all three;
  4. one prefill per implementation under ``jax.profiler.trace``: device kernels summed by name and grouped into
     families (expert GEMMs, dense GEMMs, sparse attention, indexer, top-k / sort, mHC, copies, other fusions) from
     the kernel names and, for XLA's fusions and library calls, the source file of the HLO instruction that launched
     them (the optimised HLO is dumped for the prefill programs); busy time (the union of kernel intervals) vs wall;
  5. with ``--full VARIANTS``: full replay (every layer over every token) of the same prompt, for the CED speed-up
     (at the same chunk length; ``--full-chunks`` picks which of the sweep's chunk lengths, default all).
Prints a Markdown table; writes ``DIR/bench_prefill.json``.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import concurrent.futures
import dataclasses
import glob
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time


def _args(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("12L", "bench40"), default="12L")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (the Engine's prefill_chunk default: 512)")
    ap.add_argument("--chunks", default="",
                    help="comma-separated chunk lengths to sweep in one process (default: --chunk alone); the first "
                         "is the baseline of the table's ratio column")
    ap.add_argument("--full-chunks", default="", help="the chunk lengths at which --full runs (default: all)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--moe-impls", default="engine,tiled",
                    help="comma-separated MoE variants, each measured (A/B): engine (the default InferenceOptions), "
                         "mapped_attn (the defaults, a chunk's attention mapped over query blocks), tiled (the "
                         "tiled expert loop: moe_impl='tiled', grouped_prefill_moe=False) or an ops.moe impl "
                         "(moe_impl=NAME, e.g. grouped_mgpu)")
    ap.add_argument("--full", default="", help="comma-separated MoE impls for which full replay is timed too")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--probe-shapes", default="8192x8192x8192,16384x8192x8192",
                    help="bf16 GEMMs MxNxK of the matmul probe")
    ap.add_argument("--kernel-backend", default="auto")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (a quick check of the code path)")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


ARGS = _args(None if __name__ == "__main__" else [])
OUT = ARGS.out or os.environ.get("OUT") or "."
HLO_DIR = os.path.join(tempfile.gettempdir(), f"prefill_hlo_{os.getpid()}")
if not ARGS.no_profile:
    # the optimised HLO of the prefill programs, read to name the kernels' sources (set before JAX starts)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={HLO_DIR} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_module_re=.*(ced_chunk|ced_decoder|full_chunk).*").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_inference import BENCH_MODELS, device_params, h200_config, peak_memory, synthetic_hasher, \
    time_prefill  # noqa: E402
from trace_events import load_trace, newest_trace, union_length  # noqa: E402

from dsv41_jax.inference.cache import tree_bytes  # noqa: E402
from dsv41_jax.inference.step import FAST_COMPILE, InferenceOptions  # noqa: E402
from dsv41_jax.model.counting import prefill_flops  # noqa: E402

_T0 = time.perf_counter()


def log(msg: str) -> None:
    line = f"[{time.perf_counter() - _T0:7.1f}s] {msg}"
    print(line, flush=True)
    with open(os.path.join(OUT, "bench_prefill.log"), "a") as f:
        f.write(line + "\n")


def smoke_config():
    return h200_config(engram_vocab=500, hidden_size=128, num_attention_heads=4, head_dim=64, q_lora_rank=64,
                       o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32, index_topk=16,
                       candidate_topk_blocks=8, num_experts_per_tok=2, moe_intermediate_size=64,
                       qk_rope_head_dim=16, vocab_size=1000, engram_head_dim=32, name="smoke")


def probe(shapes, smoke: bool) -> dict:
    if smoke:  # the CPU: one small GEMM, only to exercise the code
        from profile_train import _gemm_rate

        r = _gemm_rate((256, 256, 256), 2, 2, 0.0)
        return {"best": r, "by_shape": {"256x256x256": r}}
    from profile_train import matmul_probe

    return matmul_probe(tuple(tuple(int(v) for v in s.split("x")) for s in shapes.split(",")))


# ---------------------------------------------------------------------------------------------------------------
# Kernel families
# ---------------------------------------------------------------------------------------------------------------

# What a kernel computes, from the innermost function of its HLO instruction's Python stack that names a part of the
# model (searched leaf first): the component it is reported under
COMPONENT_OF_FUNCTION = {
    "_swiglu_expert": "routed experts", "routed_tiled": "routed experts", "routed_slots": "routed experts",
    "routed_ragged": "routed experts", "_swiglu_every_expert": "routed experts", "ragged_gemm": "routed experts",
    "blocked_grouped_matmul": "routed experts", "swiglu": "shared expert", "expert_mlp": "shared expert",
    "route": "router", "moe_inference": "MoE (other)", "moe": "MoE (other)",
    "mhc_coefficients": "mHC", "expand": "mHC", "collapse_rms_norm": "mHC", "collapse": "mHC",
    "run_indexer": "indexer", "indexer_queries": "indexer", "streaming_select": "indexer", "indexer_topk": "indexer",
    "pooled_topk": "indexer", "candidate_block_ids": "indexer",
    "emit_entries": "compressor", "emit_decoder_source": "compressor", "project_compressor_inputs": "compressor",
    "compressed_entries": "compressor", "pool_groups": "compressor",
    "chunk_attention": "sparse attention", "sparse_attention": "sparse attention",
    "attention_inputs": "attention projections", "attention_output": "attention projections",
    "engram_write": "Engram", "ring_read": "SWA ring", "ring_write": "SWA ring", "head": "head", "embed": "embedding",
    "ring_write_stash": "CED stash",
}


def _stack_tables(lines) -> dict:
    """frame id -> function names leaf first, from an HLO module's FileNames / FunctionNames / FileLocations /
    StackFrames tables (a frame's ``parent_frame_id`` is the parent's id + 1; 0: none)."""
    sec, funcs, locs, frames = None, {}, {}, {}
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            sec = line
            continue
        m = re.match(r"^(\d+) (.*)$", line)
        if sec is None or m is None:
            sec = None
            continue
        i, rest = int(m.group(1)), m.group(2)
        if sec == "FunctionNames":
            funcs[i] = rest.strip('"')
        elif sec == "FileLocations":
            locs[i] = int(re.search(r"function_name_id=(\d+)", rest).group(1))
        elif sec == "StackFrames":
            frames[i] = (int(re.search(r"file_location_id=(\d+)", rest).group(1)),
                         int(re.search(r"parent_frame_id=(\d+)", rest).group(1)) - 1)
    chains = {}
    for fid in frames:
        out, seen, f = [], set(), fid
        while f in frames and f not in seen:
            seen.add(f)
            loc, f = frames[f]
            out.append(funcs.get(locs.get(loc), "?"))
        chains[fid] = tuple(out)
    return chains


def component_of(chain) -> str:
    for fn in chain:
        if fn in COMPONENT_OF_FUNCTION:
            return COMPONENT_OF_FUNCTION[fn]
    return "other"


def hlo_sources(hlo_dir: str) -> dict:
    """{module "name(id)": {"base": name, "instr": {instruction: info}, "kernel": {kernel-style name: info}}} of the
    dumped optimised HLO, info = (component, op_name, opcode, result shape); XLA names a fusion's kernel after the
    instruction with dots turned into underscores."""
    out = {}
    for path in glob.glob(os.path.join(hlo_dir, "*after_optimizations.txt")):
        base = os.path.basename(path)
        num = re.match(r"module_(\d+)\.", base)
        module = re.sub(r"^module_\d+\.", "", base).split(".")[0]
        mod = out.setdefault(f"{module}({int(num.group(1))})" if num else module,
                             {"base": module, "instr": {}, "kernel": {}})
        with open(path) as f:
            lines = f.read().splitlines()
        chains = _stack_tables(lines)
        for line in lines:
            m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+(?: \S+)?) (\S+?)\(", line)
            if not m:
                continue
            op = re.search(r'op_name="([^"]*)"', line)
            fr = re.search(r"stack_frame_id=(\d+)", line)
            chain = chains.get(int(fr.group(1)), ()) if fr else ()
            info = (component_of(chain), op.group(1) if op else "", m.group(3), m.group(2)[:60])
            mod["instr"].setdefault(m.group(1), info)
            mod["kernel"].setdefault(m.group(1).replace(".", "_"), info)
    return out


def kernel_lookup(hlo: dict, names: set, bases: tuple) -> dict:
    """kernel name -> info from the dumped module of each program name in ``bases`` that holds the most of the
    profiled kernel ``names`` (variants of one program — another MoE implementation — share fusion names)."""
    out = {}
    for b in bases:
        cands = [m for m in hlo.values() if m["base"] == b]
        if cands:
            best = max(cands, key=lambda m: len(names & m["kernel"].keys()))
            for k, v in best["kernel"].items():
                out.setdefault(k, v)
    return out


def kernel_kind(kernel: str) -> str:
    low = kernel.lower()
    if any(s in low for s in ("gemm", "nvjet", "xmma", "cutlass", "cublas")) and not low.startswith("gemm_fusion"):
        return "cuBLAS float32 GEMM" if ("f32f32" in low or "sgemm" in low) else "cuBLAS GEMM"
    if low.startswith("gemm_fusion"):
        return "Triton GEMM fusion"
    if low.startswith("topk_select"):
        return "topk_select (Pallas)"
    if low.startswith(("csa2_sparse_attention", "indexer", "mhc", "collapse_rms_norm", "slot_")):
        return "Pallas kernel"
    if "mosaic" in low or "ragged" in low:
        return "Mosaic GPU kernel"
    if "memcpy" in low or "memset" in low:
        return "copy / memset"
    if "sort" in low or "topk" in low or "top_k" in low:
        return "sort"
    return "XLA fusion"


# the project's Pallas kernels by name (kernels.pallas_gpu, mhc_gpu, expert_gemm_gpu)
PALLAS_COMPONENTS = (("csa2_sparse_attention", "sparse attention"), ("indexer", "indexer"), ("topk_select", "indexer"),
                     ("mhc", "mHC"), ("collapse_rms_norm", "mHC"), ("slot_", "routed experts"),
                     ("body_mosaic_gpu", "routed experts"))  # the Mosaic GPU grouped GEMM (kernels.grouped_gemm_mgpu)


def family(kernel: str, info, nxt=None) -> str:
    """'component: kind' of a kernel: the component from its HLO instruction's Python stack (``COMPONENT_OF_FUNCTION``)
    or, for a library GEMM whose instruction the trace does not name, from the next kernel whose instruction is known
    (its consumer, usually: the SwiGLU after an expert GEMM, the norm after a projection) — an approximation; the kind
    from the kernel's name (cuBLAS, Pallas, XLA fusion, ...). A kernel inside a while loop of the MoE (the tiled
    expert loop) is marked so."""
    kind = "sort" if info is not None and info[2] == "sort" else kernel_kind(kernel)
    low = kernel.lower()
    by_name = next((c for prefix, c in PALLAS_COMPONENTS if low.startswith(prefix)), None)
    if by_name is not None:
        return f"{by_name}: {kind}"
    where = info if info is not None else (nxt if kind.startswith(("cuBLAS", "Triton", "Mosaic")) else None)
    comp = where[0] if where else "unattributed"
    if comp == "routed experts" and where and "/while/" in where[1]:
        comp = "routed experts (tiled loop)"
    return f"{comp}: {kind}" + ("" if info is not None or where is None else " (attributed by its consumer)")


def coarse(fam: str) -> str:
    """The issue's families from a 'component: kind' family: library / kernel GEMMs by kind first (the trace names
    a GEMM after its library, so the component of a cuBLAS GEMM is only approximate), then the model's parts."""
    comp, kind = fam.split(": ", 1)
    if kind.startswith("Mosaic"):
        return "expert GEMMs (Mosaic GPU grouped GEMM)"
    if kind.startswith("cuBLAS float32"):
        return "float32 GEMMs (cuBLAS: mHC projections, compressor, router)"
    if kind.startswith(("cuBLAS", "Triton")):
        return "expert GEMMs (cuBLAS, tiled loop)" if comp.startswith("routed experts (tiled") else \
            "dense bf16 GEMMs (cuBLAS: projections, shared expert, Engram, head)"
    if comp == "routed experts (tiled loop)":
        return "tiled expert loop: weight slices, searchsorted, updates"
    if kind == "copy / memset":
        return "copies / memsets"
    if kind in ("sort", "topk_select (Pallas)"):
        return "top-k / sort"
    if comp in ("sparse attention", "indexer", "mHC"):
        return f"{comp} (kernels + XLA fusions)"
    if comp.startswith("routed experts") or comp in ("router", "shared expert", "MoE (other)"):
        return "MoE routing / gather / scatter / SwiGLU (non-GEMM)"
    return "other fusions"


def summarize_trace(trace_dir: str, hlo: dict, bases: tuple) -> dict:
    path = newest_trace(trace_dir)
    if path is None:
        return {"error": f"no trace under {trace_dir}"}
    events, pnames, tnames = load_trace(path)
    kernels, ops, modules = [], [], []
    arg_keys = collections.Counter()
    for e in events:
        if e.get("ph") != "X":
            continue
        thread = tnames.get((e.get("pid"), e.get("tid")), "")
        low = thread.lower()
        if "xla ops" in low:
            ops.append(e)
        elif "xla modules" in low:
            modules.append(e)
        elif low.startswith("stream"):
            kernels.append(e)
            arg_keys.update((e.get("args") or {}).keys())
    if not kernels:
        return {"error": "no stream events", "threads": sorted(set(tnames.values()))[:40]}
    kernels.sort(key=lambda e: float(e["ts"]))
    ops.sort(key=lambda e: float(e["ts"]))
    modules.sort(key=lambda e: float(e["ts"]))
    by_kernel = kernel_lookup(hlo, {e["name"] for e in kernels}, bases)
    op_ts = [float(e["ts"]) for e in ops]
    mod_ts = [float(e["ts"]) for e in modules]

    def enclosing(seq, starts, ts):
        i = bisect.bisect_right(starts, ts) - 1
        for j in range(i, max(i - 64, -1), -1):  # the innermost recent event that covers ts
            if float(seq[j]["ts"]) + float(seq[j].get("dur", 0)) >= ts:
                return seq[j]["name"]
        return None

    infos = []
    for e in kernels:
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        args = e.get("args") or {}
        op = args.get("hlo_op") or enclosing(ops, op_ts, ts + dur / 2)
        mod = args.get("hlo_module") or enclosing(modules, mod_ts, ts + dur / 2) or ""
        info = hlo[mod]["instr"].get(op) if op and mod in hlo else None
        if info is None and op:  # the module named without its id: its instruction in the module kernel_lookup chose
            info = by_kernel.get(op.replace(".", "_"))
        infos.append(info if info is not None else by_kernel.get(e["name"]))
    by_name = collections.defaultdict(lambda: [0.0, 0, None])
    fam = collections.defaultdict(lambda: [0.0, 0])
    intervals = []
    nxt = None
    fams = [None] * len(kernels)
    for i in range(len(kernels) - 1, -1, -1):  # backwards: the next known kernel attributes a library GEMM
        fams[i] = family(kernels[i]["name"], infos[i], nxt)
        nxt = infos[i] if infos[i] is not None else nxt
    for e, info, f in zip(kernels, infos, fams):
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        intervals.append((ts, ts + dur))
        fam[f][0] += dur
        fam[f][1] += 1
        rec = by_name[(e["name"], f)]
        rec[0] += dur
        rec[1] += 1
        rec[2] = rec[2] or (f"{info[1][-80:]} {info[2]} {info[3]}" if info else None)
    matched = sum(i is not None for i in infos)
    groups = collections.defaultdict(lambda: [0.0, 0])
    for f, (us, n) in fam.items():
        groups[coarse(f)][0] += us
        groups[coarse(f)][1] += n
    busy = union_length(intervals)
    span = max(b for _, b in intervals) - min(a for a, _ in intervals)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    sample = {k: str(v)[:80] for k, v in (kernels[len(kernels) // 2].get("args") or {}).items()}
    return dict(kernels=len(kernels), kernels_matched_to_hlo=matched, busy_s=busy / 1e6, device_span_s=span / 1e6,
                xla_ops_events=len(ops), xla_module_events=len(modules),
                groups={k: dict(s=v[0] / 1e6, launches=v[1]) for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])},
                families={k: dict(s=v[0] / 1e6, launches=v[1]) for k, v in sorted(fam.items(), key=lambda kv: -kv[1][0])},
                top=[dict(name=n[:80], family=f, s=v[0] / 1e6, launches=v[1], source=v[2]) for (n, f), v in top[:60]],
                stream_event_arg_keys=dict(arg_keys.most_common(12)), sample_args=sample)


def profile_prefill(params, config, opts, hasher, tokens, chunk, max_len, dtype, hlo):
    bases = ("jit__ced_chunk", "jit__ced_decoder") if opts.ced else ("jit__full_chunk",)
    trace_dir = tempfile.mkdtemp(prefix="prefill_trace_")
    try:
        with jax.profiler.trace(trace_dir):
            t0 = time.perf_counter()
            time_prefill(params, config, opts, hasher, tokens, chunk, max_len, 0, dtype, lambda m: None)
            wall = time.perf_counter() - t0
        out = summarize_trace(trace_dir, hlo, bases)
        out["wall_s"] = wall
        return out
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------

def moe_variant(opts: InferenceOptions, name: str) -> InferenceOptions:
    """``--moe-impls`` entry -> options: "engine" the defaults; "mapped_attn" the defaults with a chunk's sparse
    attention mapped over query blocks (``banded_chunk_attention=False``: the form before the banded call); "tiled"
    the tiled expert loop (not the grouped GEMM a Hopper GPU takes for prefill chunks by default); any other name
    an ``ops.moe`` implementation."""
    if name == "engine":
        return opts
    if name == "mapped_attn":
        return dataclasses.replace(opts, banded_chunk_attention=False)
    if name == "tiled":
        return dataclasses.replace(opts, moe_impl="tiled", grouped_prefill_moe=False)
    return dataclasses.replace(opts, moe_impl=name)


class MemoHasher:
    """The Engram hasher with its row ids kept per prompt: every timed run of the sweep hashes the same prompt, so
    the host-side hashing (outside the timed region either way) runs once per prompt length, not once per run."""

    def __init__(self, hasher):
        self.hasher, self.memo = hasher, {}

    def row_ids(self, tokens):
        key = (tokens.shape, tokens.tobytes())
        if key not in self.memo:
            self.memo[key] = self.hasher.row_ids(tokens)
        return self.memo[key]


def chunk_temp_bytes(hlo_dir: str) -> dict:
    """{chunk length: buffer bytes} of the dumped CED chunk programs (``jit__ced_chunk``): the "Total bytes" of XLA's
    memory-usage report for the default memory space — the program's temporaries and those of its arguments the
    buffer assignment holds (it lists parameter allocations too), so the same argument bytes at every chunk length:
    compare chunk lengths by difference. The chunk length from the program's int32 [1, C] token parameter; empty
    where the dump lacks either."""
    out = {}
    for path in glob.glob(os.path.join(hlo_dir, "*jit__ced_chunk*after_optimizations-memory-usage-report.txt")):
        with open(path) as f:
            total = re.search(r"Total bytes:\s*(\d+)", f.read(100_000))
        hlo = path.replace("-memory-usage-report.txt", ".txt")
        chunk = None
        if os.path.exists(hlo):
            with open(hlo) as f:
                entry = next((ln for ln in f if ln.startswith("ENTRY")), "")
            m = re.search(r"s32\[1,(\d+)\]", entry)
            chunk = int(m.group(1)) if m else None
        if total and chunk:
            out[chunk] = max(out.get(chunk, 0), int(total.group(1)))
    return out


def main() -> int:
    args = ARGS
    os.makedirs(OUT, exist_ok=True)
    if args.smoke:
        config, dtype, tokens, chunk = smoke_config(), jnp.float32, 512, 256  # chunk 256: the tiled MoE loop
        opts = InferenceOptions(quant_sim=False, compiler_options=FAST_COMPILE)
    else:
        config, dtype, tokens, chunk = BENCH_MODELS[args.model](), jnp.bfloat16, args.tokens, args.chunk
        opts = InferenceOptions(quant_sim=False, index_block_elems=1 << 28)
    opts = dataclasses.replace(opts, kernel_backend=args.kernel_backend)
    impls = [s for s in args.moe_impls.split(",") if s]
    full = [s for s in args.full.split(",") if s]
    chunks = [int(c) for c in args.chunks.split(",") if c] or [chunk]
    full_chunks = [int(c) for c in args.full_chunks.split(",") if c] or chunks
    if any(c <= 0 for c in chunks) or not set(full_chunks) <= set(chunks):
        raise SystemExit(f"--chunks {chunks} must be positive and --full-chunks {full_chunks} among them")
    sweep = len(chunks) > 1

    def key(impl, c):  # a run's name: the variant, and its chunk length in a sweep
        return f"{impl}@{c}" if sweep else impl

    cases = [(impl, c) for c in chunks for impl in impls]
    full_cases = [(impl, c) for c in full_chunks for impl in full]
    max_len = tokens + 64
    dev = jax.devices()[0]
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z", time.gmtime()), jax=jax.__version__,
                device=str(dev.device_kind), backend=jax.default_backend(), cpus=os.cpu_count(),
                config=config.name, layers=config.num_hidden_layers, decoder_start=config.plan.decoder_start,
                hidden=config.hidden_size, experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                dtype=str(jnp.dtype(dtype)), tokens=tokens, chunk=chunks[0], chunks=chunks, full_chunks=full_chunks,
                replay_len=opts.resolved_replay(config), kernel_backend=args.kernel_backend, moe_impls=impls,
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                command="python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]))
    res = dict(meta=meta, runs={})

    def save():
        with open(os.path.join(OUT, "bench_prefill.json"), "w") as f:
            json.dump(res, f, indent=1)

    log(f"meta {json.dumps(meta)}")
    res["probe"] = probe(args.probe_shapes, args.smoke)
    rate = res["probe"]["best"]
    log(f"matmul probe: {rate / 1e12:.1f} TFLOP/s best; {res['probe']['by_shape']}")
    fl = prefill_flops(config, tokens, ced=True, replay_len=opts.replay_len, by_component_out=True)
    fl_full = prefill_flops(config, tokens, ced=False, replay_len=opts.replay_len)
    res["flops"], res["flops_full_replay"] = fl, fl_full
    log(f"counted CED FLOPs: GEMM {fl['weights'] / 1e12:.2f} T, attention {fl['attention'] / 1e12:.2f} T, indexer "
        f"{fl['indexer'] / 1e12:.2f} T; full replay total {fl_full['total'] / 1e12:.2f} T")
    params = device_params(config, dtype)
    jax.block_until_ready(params)
    log(f"params ready: {tree_bytes(params) / 2 ** 30:.2f} GiB [{peak_memory()}]")
    base_hasher = synthetic_hasher(config)
    hasher = None if base_hasher is None else MemoHasher(base_hasher)
    variants = {impl: moe_variant(opts, impl) for impl in impls}

    def timed(o, c, reps, label):
        """time_prefill of the long prompt, with every run's wall time logged (the first one compiles anything
        the chunk-length warm-up did not)."""
        runs = [time_prefill(params, config, o, hasher, tokens, c, max_len, 0, dtype, log) for _ in range(reps + 1)]
        t = statistics.median(runs[1:])
        log(f"  {label}: runs {', '.join(f'{x:.3f}' for x in runs)} s; median {t:.3f} s of all but the first")
        return t

    # compile (warm-up runs at the chunk length: the same programs as the long prompt), concurrently
    jobs = {f"ced:{key(i, c)}": (lambda o=variants[i], c=c: time_prefill(params, config, o, hasher, c, c, max_len,
                                                                          0, dtype, log)) for i, c in cases}
    jobs.update({f"full:{key(i, c)}": (lambda o=variants[i], c=c: time_prefill(
        params, config, dataclasses.replace(o, ced=False), hasher, c, c, max_len, 0, dtype, log))
        for i, c in full_cases})
    t0 = time.perf_counter()

    def guarded(fn):
        try:
            fn()
            return None
        except Exception as e:  # noqa: BLE001 - recorded, the other variants go on
            return repr(e)[:400]

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        errors = dict(zip(jobs, ex.map(guarded, jobs.values())))
    res["compile_s"], res["compile_errors"] = time.perf_counter() - t0, errors
    log(f"compiled in {res['compile_s']:.1f} s; errors {errors} [{peak_memory()}]")
    temp = chunk_temp_bytes(HLO_DIR) if not args.no_profile else {}
    res["ced_chunk_temp_bytes"] = temp
    log(f"CED chunk program buffers (XLA memory report): {({c: f'{b / 2 ** 30:.2f} GiB' for c, b in temp.items()})}")
    save()

    for impl, c in cases:
        k = key(impl, c)
        if errors.get(f"ced:{k}"):
            continue
        t = timed(variants[impl], c, args.reps, f"CED {k}")
        run = dict(impl=impl, chunk=c, ced_s=t, tok_s=tokens / t, gemm_tflops=fl["weights"] / t / 1e12,
                   mfu_gemm=fl["weights"] / t / rate, mfu_all=fl["total"] / t / rate, temp_bytes=temp.get(c))
        res["runs"][k] = run
        log(f"CED prefill {tokens} tokens, chunk {c}, moe {impl}: {t:.3f} s ({tokens / t:.0f} tok/s); MFU (GEMM "
            f"FLOPs) {run['mfu_gemm']:.1%}, (GEMM + attention + indexer) {run['mfu_all']:.1%} [{peak_memory()}]")
        save()
    for impl, c in full_cases:
        k = key(impl, c)
        if errors.get(f"full:{k}") or k not in res["runs"]:
            continue
        t = timed(dataclasses.replace(variants[impl], ced=False), c, args.reps, f"full replay {k}")
        r = res["runs"][k]
        r["full_s"], r["speedup"] = t, t / r["ced_s"]
        log(f"full replay {tokens} tokens, chunk {c}, moe {impl}: {t:.3f} s; CED speed-up {r['speedup']:.2f}x")
        save()
    hlo = hlo_sources(HLO_DIR) if not args.no_profile else {}
    res["hlo_instructions"] = len(hlo)
    done = [k for k in (key(*cs) for cs in cases) if k in res["runs"]]
    # the baseline and the fastest first (the profiles come last in the call: what a time limit may cut)
    order = sorted(done, key=lambda k: (k != done[0], res["runs"][k]["ced_s"])) if done else []
    for k in order:
        impl, c = res["runs"][k]["impl"], res["runs"][k]["chunk"]
        if args.no_profile:
            continue
        prof = profile_prefill(params, config, variants[impl], hasher, tokens, c, max_len, dtype, hlo)
        res["runs"][k]["profile"] = prof
        log(f"profile {k}: wall {prof.get('wall_s', 0):.3f} s, busy {prof.get('busy_s', 0):.3f} s, "
            f"{prof.get('kernels')} kernels ({prof.get('kernels_matched_to_hlo')} matched to HLO)")
        save()

    # --- table ---------------------------------------------------------------------------------------------------
    base = res["runs"].get(key(*cases[0]))
    lines = [f"### {meta['date']} — `{meta['command']}`",
             f"JAX {meta['jax']}, {meta['device']} ({meta['backend']}); {config.name}: {config.num_hidden_layers} "
             f"layers (decoder from {config.plan.decoder_start}), d={config.hidden_size}, {config.n_routed_experts} "
             f"routed experts top-{config.num_experts_per_tok}, {meta['dtype']}; one prompt of {tokens} tokens, "
             f"chunks {chunks}, replay {meta['replay_len']}; matmul probe {rate / 1e12:.1f} TFLOP/s",
             f"counted FLOPs (CED): GEMM {fl['weights'] / 1e12:.2f} T + attention {fl['attention'] / 1e12:.2f} T + "
             f"indexer {fl['indexer'] / 1e12:.2f} T = {fl['total'] / 1e12:.2f} T", "",
             "| MoE impl | chunk | CED prefill (s) | vs first row | tokens/s | GEMM TFLOP/s | MFU (GEMM) | MFU (all) | "
             "full replay (s) | CED speed-up | chunk program buffers (GiB) | busy / wall (profiled) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in res["runs"].items():
        p = r.get("profile", {})
        bw = f"{p['busy_s']:.3f} / {p['wall_s']:.3f}" if "busy_s" in p else "—"
        tb = f"{r['temp_bytes'] / 2 ** 30:.2f}" if r.get("temp_bytes") else "—"
        lines.append(f"| {r['impl']} | {r['chunk']} | {r['ced_s']:.3f} | {base['ced_s'] / r['ced_s']:.2f}x | "
                     f"{r['tok_s']:.0f} | {r['gemm_tflops']:.1f} | {r['mfu_gemm']:.1%} | {r['mfu_all']:.1%} | "
                     f"{r.get('full_s', float('nan')):.3f} | {r.get('speedup', float('nan')):.2f}x | {tb} | {bw} |")
    lines += ["", "| GEMM component | TFLOP |", "|---|---|"]
    lines += [f"| {k} | {v / 1e12:.3f} |" for k, v in fl["by_component"].items()]
    profiled = [(k, r["profile"]) for k, r in res["runs"].items() if "families" in r.get("profile", {})]
    if profiled:  # the coarse families side by side, one column pair per run
        names = list(dict.fromkeys(g for _, p in profiled for g in p["groups"]))
        lines += ["", "kernel families (device s / launches of one profiled prefill):", "",
                  "| family | " + " | ".join(k for k, _ in profiled) + " |", "|---" * (len(profiled) + 1) + "|"]
        for g in names:
            cells = [f"{p['groups'][g]['s']:.3f} / {p['groups'][g]['launches']}" if g in p["groups"] else "—"
                     for _, p in profiled]
            lines.append(f"| {g} | " + " | ".join(cells) + " |")
        lines.append("| **busy / wall (s)** | " + " | ".join(f"{p['busy_s']:.3f} / {p['wall_s']:.3f}"
                                                             for _, p in profiled) + " |")
    for k, p in profiled:
        lines += ["", f"top kernel families, {k} ({p['kernels']} kernels, busy {p['busy_s']:.3f} s of "
                  f"{p['wall_s']:.3f} s wall):", "", "| component: kernel kind | device s | share of busy | launches |",
                  "|---|---|---|---|"]
        lines += [f"| {f} | {v['s']:.3f} | {v['s'] / p['busy_s']:.1%} | {v['launches']} |"
                  for f, v in list(p["families"].items())[:15]]
    lines.append(f"\npeak memory {peak_memory()}; total {time.perf_counter() - _T0:.0f} s")
    table = "\n".join(lines)
    res["table"] = table
    save()
    print(table)
    if not args.smoke:
        shutil.rmtree(HLO_DIR, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
