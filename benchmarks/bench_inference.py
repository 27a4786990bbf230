"""Inference benchmarks: CED prefill vs full replay, decode step time vs context, tokens/s at batch 1 and 32.

    python benchmarks/bench_inference.py --preset cpu  [--out DIR]     # tiny config on the CPU
    python benchmarks/bench_inference.py --preset h200 [--out DIR]     # full-width layers on one H200
    python benchmarks/bench_inference.py --preset h200 --model bench40  # the 40-layer plan (configs/bench40.py)

Model sizes:
  * cpu:  the tiny config (d=64, 12 layers: 6 encoder / 6 decoder, window 8), float32, quant_sim off.
  * h200: full-width V4.1 layers (d=5120, 64 heads x 512, q_lora 1280, o 8x1024, window 128, indexer 32x128
          top-512, HSI 2048 blocks of 8, vocab 129280, mHC 4, Engram at layers 1 and 4 with small tables) but
          12 layers (the tiny plan: 0-1 SWA, 2-5 ratio-2 encoder with sources 2 and 4, 6-11 ratio-1 decoder with
          source/HSI candidate 6 and Reindex 8, 10) and 16 routed experts (top-6, width 2304) + 1 shared; bf16
          parameters and caches, quant_sim off (fake quantisation is numerics emulation, not a storage format).
          ``--model bench40``: the release's 40-layer plan at full width with 16 routed experts
          (configs/bench40.py, 62.7 GB of bf16 parameters).

What is measured (same process, same run):
  1. prefill of one prompt of T tokens (chunks of ``--chunk``), CED (encoder over the prompt, decoder over the
     last replay_len tokens) vs full replay (every layer over the prompt); medians of ``--reps`` runs after a
     warm-up (compile) run;
  2. decode step time at batch 1 and 32 for contexts up to the cache size: one compile per batch size (the cache
     holds max_len tokens), the cache filled with random entries and its lengths set to the context — the step's
     work depends on the context (the indexers stream over visible entries only), not on max_len;
  3. tokens/s = batch / step time (decode only, sampling fused).
Results go to a Markdown table on stdout and ``DIR/bench_inference.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import platform
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv41_jax.config import ModelConfig  # noqa: E402
from dsv41_jax.inference.cache import cache_footprint, init_cache, tree_bytes  # noqa: E402
from dsv41_jax.inference.decode import decode_and_sample  # noqa: E402
from dsv41_jax.inference.prefill import prefill  # noqa: E402
from dsv41_jax.inference.step import FAST_COMPILE, InferenceOptions  # noqa: E402
from dsv41_jax.inference.weights import host_random_params  # noqa: E402
from dsv41_jax.model.model import EngramHasher  # noqa: E402
from dsv41_jax.ops.engram_hash import EngramHashLayout  # noqa: E402


def h200_config(engram_vocab: int = 40_000, **overrides) -> ModelConfig:
    base = ModelConfig()  # the released Flash sizes
    layout = EngramHashLayout.build((1, 4), 4, 8, engram_vocab, base.engram_compressed_vocab_size, 1)
    return base.replace(**overrides).replace(
        name="bench-h200-12L", num_hidden_layers=12, num_nextn_predict_layers=0,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1), kv_source_layer_ids=(2, 4, 6),
        index_source_layer_ids=(2, 4, 6, 8, 10), candidate_source_layer_id=6, n_routed_experts=16,
        engram_layer_ids=(1, 4), engram_vocab_size=engram_vocab,
        engram_num_embeddings=tuple(int(r) for r in layout.rows_per_layer), dspark_target_layer_ids=(9, 10, 11),
        quant_sim=False)


def bench40_config() -> ModelConfig:
    from dsv41_jax.config import load_config

    return load_config("bench40")


BENCH_MODELS = {"12L": h200_config, "bench40": bench40_config}


def cpu_config() -> ModelConfig:
    from dsv41_jax.config import load_config

    return load_config("tiny").replace(quant_sim=False)


def synthetic_hasher(config: ModelConfig):
    """Engram hashing with a synthetic token map (id mod compressed vocab): random ids, real hashing cost."""
    if not config.engram_layer_ids:
        return None
    return EngramHasher(config, np.arange(config.vocab_size) % config.engram_compressed_vocab_size)


def device_params(config: ModelConfig, dtype, seed=0):
    if jax.default_backend() == "cpu":
        return host_random_params(config, seed, std=0.02, dtype=dtype)
    from dsv41_jax.model.params import init_params

    return init_params(config, jax.random.PRNGKey(seed), dtype)


def peak_memory() -> str:
    if jax.default_backend() == "cpu":
        return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GiB RSS"
    stats = jax.devices()[0].memory_stats() or {}
    return f"{stats.get('peak_bytes_in_use', 0) / 2 ** 30:.1f} GiB device"


def time_prefill(params, config, opts, hasher, t, chunk, max_len, reps, dtype, log):
    tokens = np.random.default_rng(t).integers(3, config.vocab_size, (1, t)).astype(np.int32)
    eids = None if hasher is None else hasher.row_ids(tokens)
    times = []
    for r in range(reps + 1):
        # committed to the device, as the Engine's cache is: the chunk program's later calls get it back committed,
        # and jit keys its cache on that, so an uncommitted first cache compiled the chunk program a second time
        # inside the first timed prompt
        cache = jax.device_put(init_cache(config, 1, max_len, dtype), jax.devices()[0])
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        last, cache = prefill(params, cache, tokens, None, eids, config=config, opts=opts, chunk=chunk)
        jax.block_until_ready(last)
        dt = time.perf_counter() - t0
        if r > 0 or reps == 0:
            times.append(dt)
        del cache
    return statistics.median(times)


# random normals drawn per cache leaf, repeated to fill it (a prime count, so that rows do not repeat in step): the
# 40-layer model's batch-32 cache filled with one normal per entry compiled for 2 min on an H200 (jit_fill_cache,
# benchmarks/RESULTS.md), the whole set-up of a batch-1 cache in seconds
FILL_BLOCK = 1_000_003


def _random_fill(key, shape, dtype):
    n = int(np.prod(shape))
    if n <= FILL_BLOCK:
        return jax.random.normal(key, shape, dtype)
    return jnp.resize(jax.random.normal(key, (FILL_BLOCK,), dtype), shape)


def _random_packed_fill(key, buf):
    """A packed (release-format) cache buffer holding normals packed by ``packed_cache.pack``, so every code and
    scale byte is one the format produces (random bytes could be NaN codes); the packed rows repeat every
    ``FILL_BLOCK // dim`` rows, as ``_random_fill``'s normals do."""
    from dsv41_jax.inference import packed_cache as PC

    n_rows = int(np.prod(buf.shape[:-1]))
    rows = max(1, min(n_rows, FILL_BLOCK // buf.dim))
    values, scales = PC.pack(jax.random.normal(key, (rows, buf.dim), jnp.float32), buf.fmt)
    return dataclasses.replace(buf, values=jnp.resize(values, (n_rows, values.shape[-1])).reshape(buf.values.shape),
                               scales=jnp.resize(scales, (n_rows, scales.shape[-1])).reshape(buf.scales.shape))


def fill_cache(cache, length, key):
    """Random cache contents with every slot at ``length`` tokens (decode cost does not depend on the values; the
    normals of each leaf repeat every ``FILL_BLOCK`` entries); a packed cache (``init_cache(packed=True)``) gets
    packed normals."""
    from dsv41_jax.inference.packed_cache import PackedRows

    leaves, treedef = jax.tree.flatten(cache, is_leaf=lambda x: isinstance(x, PackedRows))
    keys = jax.random.split(key, len(leaves))
    out = [_random_packed_fill(k, x) if isinstance(x, PackedRows) else
           jnp.full_like(x, length) if x.dtype == jnp.int32 else _random_fill(k, x.shape, x.dtype)
           for x, k in zip(leaves, keys)]
    cache = jax.tree.unflatten(treedef, out)
    return dict(cache, floor=jnp.zeros_like(cache["floor"]))


def fill_cache_program(cache, length, key):
    """``fill_cache`` jitted (the cache donated) and run; on a GPU compiled without XLA's autotuning: it is set-up,
    and the slow compile above (2 min for the 40-layer model's batch-32 cache, seconds at batch 1) grew with the
    buffers' size as autotuning does (its candidates run on buffers of the real size), not with the program."""
    fn = jax.jit(fill_cache, static_argnums=(1,), donate_argnums=(0,))
    if jax.default_backend() != "gpu":
        return fn(cache, length, key)
    return fn.lower(cache, length, key).compile(compiler_options={"xla_gpu_autotune_level": 0})(cache, key)


def decode_inputs(config, batch):
    """Constant decode-step inputs for timing: (greedy sampling parameters, Engram ids or None, tokens, active)."""
    zeros = lambda dt: jnp.zeros((batch,), dt)  # noqa: E731
    samp = (zeros(jnp.float32), zeros(jnp.int32), jnp.ones((batch,), jnp.float32), zeros(jnp.int32))
    eids = None
    if config.engram_layer_ids:
        eids = jnp.zeros((batch, len(config.engram_layer_ids), config.n_hash_cols), jnp.int32)
    return samp, eids, jnp.full((batch,), 5, jnp.int32), jnp.ones((batch,), bool)


def time_decode(params, config, opts, batch, max_len, contexts, steps, dtype, log):
    cache = init_cache(config, batch, max_len, dtype)
    samp, eids, tok, act = decode_inputs(config, batch)
    fill = jax.jit(fill_cache, static_argnums=(1,), donate_argnums=(0,))
    rows = []
    for ctx in contexts:
        cache = fill(cache, ctx, jax.random.PRNGKey(ctx))
        ts = []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            nxt, cache = decode_and_sample(params, cache, tok, eids, act, *samp, jnp.full((batch,), i, jnp.int32),
                                           config=config, opts=opts)
            jax.block_until_ready(nxt)
            if i >= 2:
                ts.append(time.perf_counter() - t0)
        med = statistics.median(ts)
        rows.append(dict(batch=batch, context=ctx, max_len=max_len, step_ms=med * 1e3, tok_s=batch / med))
        log(f"decode B={batch} ctx={ctx}: {med * 1e3:.2f} ms/step, {batch / med:.1f} tok/s  [{peak_memory()}]")
    del cache
    return rows


def warm(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - report and continue
        return repr(e)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=("cpu", "h200"), default="cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", choices=sorted(BENCH_MODELS), default="12L",
                    help="h200 preset's model: 12L (bench-h200-12L) or bench40 (configs/bench40.py)")
    ap.add_argument("--lengths", default=None, help="comma-separated prompt lengths")
    ap.add_argument("--contexts", default=None, help="comma-separated decode contexts (batch 1)")
    ap.add_argument("--contexts32", default=None, help="comma-separated decode contexts (batch 32)")
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip-full-above", type=int, default=None, help="skip full replay above this length")
    ap.add_argument("--smoke", action="store_true", help="the preset's code path at toy sizes (a quick check)")
    ap.add_argument("--kernel-backend", default="auto",
                    help="dsv41_jax.kernels backend for sparse attention / indexer (auto = Pallas on GPU)")
    ap.add_argument("--moe-impl", default=None, help="MoE implementation (default: the engine's)")
    args = ap.parse_args(argv)
    out = args.out or os.environ.get("OUT") or "."
    os.makedirs(out, exist_ok=True)
    t_start = time.perf_counter()
    log_path = os.path.join(out, "bench_inference.log")

    def log(msg):
        line = f"[{time.perf_counter() - t_start:7.1f}s] {msg}"
        print(line, flush=True)
        with open(log_path, "a") as f:
            f.write(line + "\n")

    if args.preset == "cpu":
        config, dtype = cpu_config(), jnp.float32
        lengths = [1024, 4096, 16384, 32768]
        contexts, contexts32 = [1024, 8192, 32768, 131072], [1024, 8192, 32768]
        chunk = args.chunk or 1024
        opts = InferenceOptions(quant_sim=False, compiler_options=FAST_COMPILE, index_block_elems=1 << 24)
    else:
        config, dtype = BENCH_MODELS[args.model](), jnp.bfloat16
        lengths = [1024, 4096, 16384, 32768]
        contexts, contexts32 = [8192, 32768, 131072, 524288, 1048000], [8192, 32768, 131072]
        chunk = args.chunk or 1024
        opts = InferenceOptions(quant_sim=False, index_block_elems=1 << 28)
    if args.smoke:
        config = h200_config(engram_vocab=500, hidden_size=128, num_attention_heads=4, head_dim=64, q_lora_rank=64,
                             o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32, index_topk=16,
                             candidate_topk_blocks=8, num_experts_per_tok=2, moe_intermediate_size=64,
                             qk_rope_head_dim=16, vocab_size=1000, engram_head_dim=32, name="smoke")
        lengths, contexts, contexts32, chunk = [256, 512], [512, 2048], [512], 256
    opts = dataclasses.replace(opts, kernel_backend=args.kernel_backend,
                               **({"moe_impl": args.moe_impl} if args.moe_impl else {}))
    if args.lengths is not None:
        lengths = [int(x) for x in args.lengths.split(",") if x]
    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    if args.contexts32 is not None:
        contexts32 = [int(x) for x in args.contexts32.split(",") if x]
    full_opts = dataclasses.replace(opts, ced=False)
    dev = jax.devices()[0]
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), jax=jax.__version__, device=str(dev.device_kind),
                backend=jax.default_backend(), host=platform.node(), cpus=os.cpu_count(), preset=args.preset,
                config=config.name, layers=config.num_hidden_layers, hidden=config.hidden_size,
                experts=config.n_routed_experts, dtype=str(jnp.dtype(dtype)), chunk=chunk,
                kernel_backend=args.kernel_backend, moe_impl=opts.moe_impl,
                command="python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])))
    log(f"meta {json.dumps(meta)}")
    params = device_params(config, dtype)
    jax.block_until_ready(params)
    log(f"params ready: {tree_bytes(params) / 2 ** 30:.2f} GiB [{peak_memory()}]")
    hasher = synthetic_hasher(config)
    results = dict(meta=meta, prefill=[], decode=[], footprint={})
    for st in ("float32", "bfloat16", "release"):
        results["footprint"][st] = cache_footprint(config, st).per_token
    log(f"cache B/token: {results['footprint']}")
    prefill_len = max(lengths, default=chunk) + 8
    max1 = max(contexts) + 64
    max32 = (max(contexts32) + 64) if contexts32 else None

    def save():
        with open(os.path.join(out, "bench_inference.json"), "w") as f:
            json.dump(results, f, indent=1)

    # --- compile everything first, concurrently (XLA compiles release the GIL) ------------------------------
    t0 = time.perf_counter()
    jobs = {"decode1": lambda: time_decode(params, config, opts, 1, max1, [min(contexts)], 1, dtype, lambda m: None)}
    if lengths:
        jobs["ced"] = lambda: time_prefill(params, config, opts, hasher, chunk, chunk, prefill_len, 0, dtype, log)
        jobs["full"] = lambda: time_prefill(params, config, full_opts, hasher, chunk, chunk, prefill_len, 0, dtype,
                                            log)
    if max32:
        jobs["decode32"] = lambda: time_decode(params, config, opts, 32, max32, [min(contexts32)], 1, dtype,
                                               lambda m: None)
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        errors = dict(zip(jobs, ex.map(warm, jobs.values())))
    log(f"compiled (warm-up) in {time.perf_counter() - t0:.1f} s; errors: {errors}  [{peak_memory()}]")

    # --- 1. prefill: CED vs full replay ------------------------------------------------------------------------
    for t in lengths:
        row = dict(tokens=t)
        row["ced_s"] = time_prefill(params, config, opts, hasher, t, chunk, prefill_len, args.reps, dtype, log)
        if args.skip_full_above is None or t <= args.skip_full_above:
            row["full_s"] = time_prefill(params, config, full_opts, hasher, t, chunk, prefill_len, args.reps, dtype,
                                         log)
            row["speedup"] = row["full_s"] / row["ced_s"]
        results["prefill"].append(row)
        log(f"prefill T={t}: CED {row['ced_s']:.3f} s ({t / row['ced_s']:.0f} tok/s), full "
            f"{row.get('full_s', float('nan')):.3f} s, CED speed-up {row.get('speedup', float('nan')):.2f}x  "
            f"[{peak_memory()}]")
        save()
    # --- 2./3. decode ---------------------------------------------------------------------------------------------
    results["decode"] += time_decode(params, config, opts, 1, max1, contexts, args.steps, dtype, log)
    save()
    if max32:
        results["decode"] += time_decode(params, config, opts, 32, max32, contexts32, args.steps, dtype, log)
        save()

    # --- table ----------------------------------------------------------------------------------------------------
    lines = [f"### {meta['date']} — `{meta['command']}`",
             f"JAX {meta['jax']}, {meta['device']} ({meta['backend']}), model {config.name}: {config.num_hidden_layers} "
             f"layers, d={config.hidden_size}, {config.n_routed_experts} routed experts, {meta['dtype']}; kernels "
             f"{args.kernel_backend}, MoE {opts.moe_impl}; prefill "
             f"chunk {chunk}; cache {results['footprint']['bfloat16']:.0f} B/token bf16, "
             f"{results['footprint']['release']:.0f} B/token FP4/FP8 (release format)", "",
             "| prompt tokens | CED prefill (s) | full replay (s) | CED speed-up | CED tok/s |", "|---|---|---|---|---|"]
    for r in results["prefill"]:
        lines.append(f"| {r['tokens']} | {r['ced_s']:.3f} | {r.get('full_s', float('nan')):.3f} | "
                     f"{r.get('speedup', float('nan')):.2f}x | {r['tokens'] / r['ced_s']:.0f} |")
    lines += ["", "| batch | context | cache max_len | decode step (ms) | tokens/s |", "|---|---|---|---|---|"]
    for r in results["decode"]:
        lines.append(f"| {r['batch']} | {r['context']} | {r['max_len']} | {r['step_ms']:.2f} | {r['tok_s']:.1f} |")
    lines.append(f"\npeak memory: {peak_memory()}; total {time.perf_counter() - t_start:.0f} s")
    table = "\n".join(lines)
    with open(os.path.join(out, "bench_inference.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
