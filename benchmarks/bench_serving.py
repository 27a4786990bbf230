"""Serving load generator: continuous batching (``Engine.serve``'s batcher) against static full batches.

N requests (default 256) with mixed prompt and output lengths (uniform in the given ranges, greedy, no stop token,
so both modes generate exactly the same tokens) are served twice in the same process, by the same engine:

* **static**: the requests in submission order, ``max_batch`` at a time, through ``Engine.generate`` (a batch
  starts when the previous one has finished; every request is there at time 0, the baseline's best case);
* **continuous**: a ``ContinuousBatcher`` fed by Poisson arrivals (``--rate`` requests/s; default ``--load`` x the
  static run's request rate, i.e. a saturated server), one refill chunk (the admitted requests together, its rows
  bucketed to them) and one run of up to ``--decode-run`` decode steps per iteration (``inference.batching``);
  once per admission policy in ``--refill-min`` (a comma list: each value a run of the same arrivals, in the
  same process, after the static run; the ratio is reported for each).

Reported per mode: output tokens/s over the whole run, requests/s, p50 / p99 time to first token (from the
request's arrival) and inter-token latency (every gap between consecutive tokens of a request), decode steps and
the mean decode-batch occupancy (tokens per decode step / max_batch). Every program is compiled before timing
(a warm-up serves and generates prompts of every chunk bucket). Prints a table and writes JSON.

    python benchmarks/bench_serving.py --model tiny --n 24 --max-batch 4          # CPU smoke test
    python benchmarks/bench_serving.py --model default --n 256 --max-batch 32     # the embedded model
    python benchmarks/bench_serving.py --model 12L --n 256 --max-batch 32         # bench-h200-12L on an H200
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(1, HERE)

from dsv41_jax.inference import Engine, InferenceOptions, Request  # noqa: E402
from dsv41_jax.inference.engine import compile_seconds  # noqa: E402
from dsv41_jax.inference.prefill import chunk_bucket  # noqa: E402
from dsv41_jax.inference.step import FAST_COMPILE  # noqa: E402


def build_engine(args):
    """(engine, model description) for --model tiny | default | 12L | bench40."""
    cpu = jax.default_backend() == "cpu"
    kw = dict(max_batch=args.max_batch, max_len=args.max_len, prefill_chunk=args.prefill_chunk)
    opts = InferenceOptions(compiler_options=FAST_COMPILE) if cpu else InferenceOptions()
    if args.model == "default":
        from dsv41_jax.default_model import default_model

        config, params, tok = default_model()
        return Engine(config, params, tokenizer=tok, options=opts, **kw), config
    from bench_inference import BENCH_MODELS, cpu_config, device_params, synthetic_hasher

    config = cpu_config() if args.model == "tiny" else BENCH_MODELS[args.model]()
    dtype = jnp.float32 if cpu else jnp.bfloat16
    params = device_params(config, dtype)
    return Engine(config, params, hasher=synthetic_hasher(config), options=opts, **kw), config


def make_requests(args, vocab: int) -> tuple[list[Request], np.ndarray]:
    rng = np.random.default_rng(args.seed)
    lo, hi = args.prompt_len
    olo, ohi = args.output_len
    reqs = []
    for _ in range(args.n):
        n = int(rng.integers(lo, hi + 1))
        m = int(rng.integers(olo, ohi + 1))
        reqs.append(Request([int(t) for t in rng.integers(3, vocab, n)], max_new_tokens=m, stop_tokens=()))
    gaps = rng.exponential(1.0, args.n)  # Poisson arrivals at rate 1; scaled by the chosen rate later
    return reqs, np.cumsum(gaps) - gaps[0]


def warm_up(engine, args, vocab: int, log) -> float:
    """Compile every program both modes use: each prefill chunk bucket, the CED decoder pass, the decode step."""
    t0 = time.perf_counter()
    lo, hi = args.prompt_len
    # chunk lengths either mode can use: a batch's / lanes' longest prompt, or any tail of a prompt over one chunk
    widths = range(1 if hi > args.prefill_chunk else lo, hi + 1)
    buckets = sorted({chunk_bucket(n, args.prefill_chunk) for n in widths})
    for size in buckets:
        p = [3 + (i % (vocab - 3)) for i in range(size)]
        engine.generate([Request(p, max_new_tokens=2, stop_tokens=())] * engine.max_batch)  # a full batch, as timed
        log(f"  warm-up: static, chunk bucket {size}: {time.perf_counter() - t0:.1f} s")
    t1 = time.perf_counter()
    batcher = engine.batcher(prefill_lanes=args.lanes, decode_run=args.decode_run)
    batcher.precompile((lo, hi))  # every refill row bucket x chunk length, and the decode step
    log(f"  warm-up: continuous ({len(batcher.row_buckets)} row buckets {list(batcher.row_buckets)} x chunk "
        f"buckets {buckets}): {time.perf_counter() - t1:.1f} s")
    return time.perf_counter() - t0


def _plain(x):
    """NumPy scalars as Python numbers for JSON."""
    return x.item() if hasattr(x, "item") else str(x)


def percentile(xs, q):
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else float("nan")


def summarize(mode, token_times, arrivals, t_start, t_end, steps, max_batch, n_prompt_tokens):
    ttft = [tt[0] - a for tt, a in zip(token_times, arrivals)]
    itl = [b - a for tt in token_times for a, b in zip(tt, tt[1:])]
    n_tokens = sum(len(tt) for tt in token_times)
    wall = t_end - t_start
    decode_tokens = n_tokens - len(token_times)  # the first token of each request comes from its prefill
    return dict(mode=mode, wall_s=wall, requests=len(token_times), output_tokens=n_tokens,
                prompt_tokens=n_prompt_tokens, tokens_per_s=n_tokens / wall, requests_per_s=len(token_times) / wall,
                ttft_p50_ms=1e3 * percentile(ttft, 50), ttft_p99_ms=1e3 * percentile(ttft, 99),
                itl_p50_ms=1e3 * percentile(itl, 50), itl_p99_ms=1e3 * percentile(itl, 99),
                ttft_mean_ms=1e3 * float(np.mean(ttft)), decode_steps=steps,
                occupancy=decode_tokens / (steps * max_batch) if steps else float("nan"))


_compiles = [0]  # XLA compilations in this process (jax.monitoring), to show that the timed runs compile nothing


def _count_compiles(event: str, _duration: float, **_kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


def run_static(engine, reqs):
    """Fixed batches through ``Engine.generate``: its device decode loop hands tokens back in runs of up to
    ``engine.readback_every`` steps, so the static mode's inter-token latencies are bursty (zero inside a run); its
    throughput is what it is compared on."""
    b = engine.max_batch
    times = [[] for _ in reqs]
    steps = 0
    c0, n0 = compile_seconds(), _compiles[0]
    t0 = time.perf_counter()
    for k in range(0, len(reqs), b):
        group = reqs[k:k + b]
        res = engine.generate(group, on_token=lambda i, _t, k=k: times[k + i].append(time.perf_counter()))
        steps += engine.last_stats.decode_steps
        for i, r in enumerate(res):
            assert r.ok and len(r.tokens) == group[i].max_new_tokens, (k + i, r)
    t1 = time.perf_counter()
    out = summarize("static", times, [t0] * len(reqs), t0, t1, steps, b, sum(len(r.prompt) for r in reqs))
    out.update(compiles_during_run=_compiles[0] - n0, compile_s_during_run=compile_seconds() - c0)
    return out, t1 - t0


def run_continuous(engine, reqs, arrivals, lanes, decode_run=None, refill_min=None):
    batcher = engine.batcher(prefill_lanes=lanes, decode_run=decode_run, refill_min=refill_min)
    c0, n0 = compile_seconds(), _compiles[0]
    times, ids = {}, {}
    t0 = time.perf_counter()
    i = 0
    while i < len(reqs) or batcher.busy:
        now = time.perf_counter() - t0
        while i < len(reqs) and arrivals[i] <= now:
            ids[batcher.submit(reqs[i])] = i
            i += 1
        if batcher.busy:
            for c in batcher.step():
                assert c.ok and len(c.tokens) == reqs[ids[c.id]].max_new_tokens, c
                times[ids[c.id]] = c.token_times
        elif i < len(reqs):
            time.sleep(max(0.0, arrivals[i] - now))
    t1 = time.perf_counter()
    out = summarize("continuous", [times[k] for k in range(len(reqs))], list(t0 + arrivals), t0, t1,
                    batcher.stats.decode_steps, engine.max_batch, sum(len(r.prompt) for r in reqs))
    st = batcher.stats
    out.update(iterations=st.iterations, prefill_chunks=st.prefill_chunks, last_arrival_s=float(arrivals[-1]),
               readbacks=st.readbacks, prefill_s=st.prefill_s, decode_s=st.decode_s,
               host_other_s=(t1 - t0) - st.prefill_s - st.decode_s, lanes=batcher.lanes,
               decode_run=batcher.decode_run, refill_min=batcher.refill_min, prefill_rows=st.prefill_rows,
               prefill_rows_used=st.prefill_rows_used, refill_buckets=dict(sorted(st.refill_buckets.items())),
               compiles_during_run=_compiles[0] - n0,
               compile_s_during_run=compile_seconds() - c0,
               ms_per_iteration=1e3 * (t1 - t0) / max(st.iterations, 1),
               ms_per_decode_step=1e3 * st.decode_s / max(st.decode_steps, 1),
               ms_per_prefill_chunk=1e3 * st.prefill_s / max(st.prefill_chunks, 1))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "default", "12L", "bench40"), default="tiny")
    ap.add_argument("--n", type=int, default=256, help="requests")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--prompt-len", default="16,256", help="min,max prompt tokens (uniform)")
    ap.add_argument("--output-len", default="8,128", help="min,max new tokens (uniform)")
    ap.add_argument("--prefill-chunk", type=int, default=128)
    ap.add_argument("--lanes", type=int, default=None, help="prefill lanes (default: the batcher's)")
    ap.add_argument("--decode-run", type=int, default=None,
                    help="decode steps per continuous iteration, read back together (default: the batcher's)")
    ap.add_argument("--refill-min", default="",
                    help="admission policies to run, comma-separated refill_min values (default: the batcher's); "
                         "each is a continuous run of the same arrivals")
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrival rate, requests/s")
    ap.add_argument("--load", type=float, default=2.0,
                    help="without --rate: the arrival rate as a multiple of the static run's requests/s")
    ap.add_argument("--wait-file", default=None,
                    help="before the timed runs, wait (at most 300 s) until this file exists: another job sharing the "
                         "machine (compiling in another process) then finishes before anything is timed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for bench_serving.json (default $OUT or .)")
    args = ap.parse_args(argv)
    args.prompt_len = tuple(int(x) for x in args.prompt_len.split(","))
    args.output_len = tuple(int(x) for x in args.output_len.split(","))
    if args.prompt_len[1] + args.output_len[1] - 1 > args.max_len:
        ap.error(f"--max-len {args.max_len} is too small for prompts up to {args.prompt_len[1]} + outputs up to "
                 f"{args.output_len[1]}")
    out_dir = args.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    compile_seconds()  # registers the engine's compile-time listener
    engine, config = build_engine(args)
    vocab = config.vocab_size
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), jax=jax.__version__,
                device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), host=platform.node(),
                model=args.model, config=config.name, layers=config.num_hidden_layers, hidden=config.hidden_size,
                dtype=str(engine.params["embed"].dtype), n=args.n, max_batch=args.max_batch, max_len=args.max_len,
                prompt_len=args.prompt_len, output_len=args.output_len, prefill_chunk=args.prefill_chunk,
                lanes=engine.batcher(prefill_lanes=args.lanes).lanes, seed=args.seed,
                command="python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None
                                                                             else sys.argv[1:])))
    log(f"meta {json.dumps(meta)}")
    reqs, unit_arrivals = make_requests(args, vocab)
    meta["warmup_s"] = warm_up(engine, args, vocab, log)
    log(f"warm-up (compiles) {meta['warmup_s']:.1f} s")
    path = os.path.join(out_dir, "bench_serving.json")
    if args.wait_file:
        t_wait = time.perf_counter()
        while not os.path.exists(args.wait_file) and time.perf_counter() - t_wait < 300:
            time.sleep(0.5)
        meta["waited_s"] = time.perf_counter() - t_wait
        log(f"waited {meta['waited_s']:.1f} s for {args.wait_file} (exists: {os.path.exists(args.wait_file)})")
    static, static_wall = run_static(engine, reqs)
    log(f"static: {static['tokens_per_s']:.1f} tok/s")
    with open(path, "w") as f:  # the baseline alone, in case the continuous run does not finish
        json.dump(dict(meta=meta, static=static), f, indent=1, default=_plain)
    rate = args.rate or args.load * args.n / static_wall
    meta["rate_per_s"] = rate
    policies = [int(x) for x in args.refill_min.split(",") if x.strip()] or [None]
    conts = []
    for rmin in policies:
        cont = run_continuous(engine, reqs, unit_arrivals / rate, args.lanes, args.decode_run, rmin)
        cont["throughput_ratio"] = cont["tokens_per_s"] / static["tokens_per_s"]
        conts.append(cont)
        log(f"continuous (refill_min {cont['refill_min']}): {cont['tokens_per_s']:.1f} tok/s, "
            f"x{cont['throughput_ratio']:.3f} of static")
    result = dict(meta=meta, static=static, continuous=conts[0], throughput_ratio=conts[0]["throughput_ratio"],
                  continuous_runs=conts)

    cols = [("mode", "{}"), ("refill_min", "{}"), ("tokens_per_s", "{:.1f}"), ("throughput_ratio", "{:.3f}"),
            ("requests_per_s", "{:.2f}"), ("ttft_p50_ms", "{:.1f}"), ("ttft_p99_ms", "{:.1f}"),
            ("itl_p50_ms", "{:.2f}"), ("itl_p99_ms", "{:.2f}"), ("decode_steps", "{}"), ("occupancy", "{:.2f}"),
            ("prefill_chunks", "{}"), ("ms_per_prefill_chunk", "{:.2f}"), ("prefill_s", "{:.3f}"),
            ("wall_s", "{:.2f}")]
    print(f"\n{args.n} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, outputs {args.output_len[0]}-"
          f"{args.output_len[1]} tokens, max_batch {args.max_batch}, Poisson arrivals at {rate:.2f} req/s "
          f"(continuous; static: all at t=0)")
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    static_row = dict(static, refill_min="-", throughput_ratio=1.0, prefill_chunks="-")
    for row in [static_row] + conts:
        print("| " + " | ".join(f.format(row[c]) if row.get(c, "-") != "-" else "-" for c, f in cols) + " |")
    for cont in conts:
        print(f"continuous, refill_min {cont['refill_min']}: ratio {cont['throughput_ratio']:.3f}; "
              f"{cont['iterations']} iterations ({cont['ms_per_iteration']:.2f} ms each), "
              f"{cont['prefill_chunks']} refill chunks ({cont['ms_per_prefill_chunk']:.2f} ms each, first-token "
              f"sampling and read-back included; rows by bucket {cont['refill_buckets']}, {cont['prefill_rows_used']}"
              f" of {cont['prefill_rows']} rows used), {cont['decode_steps']} decode steps "
              f"({cont['ms_per_decode_step']:.2f} ms each, read-back included), {cont['readbacks']} read-backs, host "
              f"time outside both {cont['host_other_s']:.3f} s; compiles during the timed runs: static "
              f"{static['compiles_during_run']}, continuous {cont['compiles_during_run']}")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=_plain)
    log(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
