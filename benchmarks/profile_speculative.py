"""Where a speculative round's time goes, against a plain decode step, in the same run.

    python benchmarks/profile_speculative.py [--preset default|cpu] [--batch 1] [--new-tokens 64] [--reps 3]
                                             [--full-opt] [--schedule none|threshold|prefix]

Runs plain greedy decoding and DSpark speculative greedy decoding (``SpeculativeDecoder.generate``) on the same
prompts, then a second, instrumented speculative run in which every jitted program the speculative module
dispatches (module-level ``*_jit`` functions and ``jit_for`` wrappers) is timed to completion
(``block_until_ready``) and counted. Per round (= one verification step) it prints: wall time, the time inside each
program, the rest (host work: Python, numpy, Engram hashing, transfers, eager ops), and the number of program
calls. The instrumented run serialises host and device work, so its total is an upper bound; the untimed run's
per-round time is the real cost. Times are the best (minimum) of ``--reps`` runs after a compiling run: on a shared
machine the minimum is the least disturbed measurement (medians are printed next to it). On the CPU the programs are
compiled with the benchmarks' fast-compile options (``FAST_COMPILE``) unless ``--full-opt``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv41_jax.inference import Engine, InferenceOptions  # noqa: E402
from dsv41_jax.inference import speculative as SP  # noqa: E402
from dsv41_jax.inference.step import FAST_COMPILE  # noqa: E402


class ProgramTimer:
    """Wraps the speculative module's jitted entry points with timers (time to a ready result) and counters."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.calls = collections.Counter()
        self.on = False
        self._saved = {}

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*a, **k))
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return out

        return timed

    def install(self):
        for name in dir(SP):
            obj = getattr(SP, name)
            if name.endswith("_jit") and callable(obj):
                self._saved[name] = obj
                setattr(SP, name, self.wrap(name, obj))
        orig_jit_for = SP.jit_for
        self._saved["jit_for"] = orig_jit_for

        def jit_for(fn, *a, **k):
            return self.wrap(getattr(fn, "__name__", "jit_for"), orig_jit_for(fn, *a, **k))

        SP.jit_for = jit_for

    def reset(self):
        self.seconds.clear()
        self.calls.clear()


def load(preset: str, batch: int, prompt_len: int, new: int, full_opt: bool = False):
    from benchmarks.bench_speculative import heldout_prompts

    if preset == "default":
        from dsv41_jax.default_model import default_model

        cpu = jax.default_backend() == "cpu"
        config, params, tok = default_model(jnp.float32 if cpu else jnp.bfloat16, include_dspark=True)
        opts = InferenceOptions(compiler_options=FAST_COMPILE) if cpu and not full_opt else InferenceOptions()
        eng = Engine(config, params, max_batch=batch, max_len=2 * prompt_len + new + 8, options=opts, tokenizer=tok)
        return eng, heldout_prompts(batch, prompt_len, tok)
    from benchmarks.bench_inference import cpu_config, synthetic_hasher
    from benchmarks.bench_speculative import make_params

    config = cpu_config().replace(num_nextn_predict_layers=2)
    params = make_params(config, np.float32)
    opts = InferenceOptions() if full_opt else InferenceOptions(compiler_options=FAST_COMPILE)
    eng = Engine(config, params, max_batch=batch, max_len=256, options=opts, hasher=synthetic_hasher(config))
    rng = np.random.default_rng(batch)
    return eng, [[int(t) for t in rng.integers(3, config.vocab_size, prompt_len)] for _ in range(batch)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=("default", "cpu"), default="default")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--full-opt", action="store_true", help="CPU: full XLA optimisation instead of FAST_COMPILE")
    ap.add_argument("--schedule", choices=("none", "threshold", "prefix"), default="none",
                    help="threshold: survival >= 0.5; prefix: over a step-time table measured first")
    args = ap.parse_args(argv)
    timer = ProgramTimer()
    timer.install()
    eng, prompts = load(args.preset, args.batch, args.prompt_len, args.new_tokens, args.full_opt)
    new = args.new_tokens
    kw = {}
    if args.schedule == "threshold":
        kw = dict(schedule="threshold", threshold=0.5)
    elif args.schedule == "prefix":
        table = SP.SpeculativeDecoder(eng).measure_step_times(reps=5)
        print("# step times (measured): " + ", ".join(f"{w}: {t * 1e3:.2f} ms" for w, t in sorted(table.items())))
        kw = dict(schedule="prefix", step_times=table)
    dec = SP.SpeculativeDecoder(eng, **kw)

    plain_s, spec_s, rounds = [], [], []
    for rep in range(args.reps + 1):  # rep 0 compiles; plain and speculative interleaved (same load)
        res = eng.generate(prompts, max_new_tokens=new, stop_tokens=())
        plain_steps = eng.last_stats.decode_steps
        plain_s.append(eng.last_stats.decode_s)
        out = dec.generate(prompts, max_new_tokens=new, stop_tokens=())
        spec_s.append(dec.stats.decode_s)
        rounds.append(dec.stats.steps)
        assert [r.tokens for r in out] == [r.tokens for r in res], "speculative output differs from plain"
    st = dec.stats
    b = args.batch
    best_plain, best_spec = min(plain_s[1:]), min(spec_s[1:])
    plain_step = best_plain / plain_steps
    spec_round = best_spec / rounds[-1]
    opt = "full XLA optimisation" if args.full_opt or jax.default_backend() != "cpu" else "FAST_COMPILE"
    print(f"# profile_speculative --preset {args.preset} batch {b}: {eng.config.name}, "
          f"{jax.devices()[0].device_kind}, {opt}, γ={dec.num_draft}, schedule {args.schedule}, {new} new tokens, greedy, "
          f"best of {args.reps}")
    print(f"plain: {plain_step * 1e3:.2f} ms/step (median {statistics.median(plain_s[1:]) / plain_steps * 1e3:.2f}), "
          f"{b * new / best_plain:.1f} tokens/s")
    print(f"speculative: {spec_round * 1e3:.2f} ms/round (median {statistics.median(spec_s[1:]) / rounds[-1] * 1e3:.2f};"
          f" {spec_round / plain_step:.2f} plain steps), {st.steps} rounds, accepted length "
          f"{st.mean_accepted_length:.2f}, {b * new / best_spec:.1f} tokens/s ({best_plain / best_spec:.2f}x plain)")

    per = collections.defaultdict(list)
    calls = None
    for _ in range(args.reps):
        timer.reset()
        started = []

        def start(i, t):  # the first token is accounted where the decode loop's clock starts: count from there
            if not started:
                started.append(True)
                timer.on = True

        dec.generate(prompts, max_new_tokens=new, stop_tokens=(), on_token=start)
        timer.on = False
        n = dec.stats.steps
        per["total"].append(dec.stats.decode_s / n)
        for k, v in timer.seconds.items():
            per[k].append(v / n)
        per["host (rest)"].append((dec.stats.decode_s - sum(timer.seconds.values())) / n)
        calls = {k: v / n for k, v in timer.calls.items()}
    print("\n| per round (instrumented) | ms | plain steps | program calls / round |")
    print("|---|---|---|---|")
    for k in sorted(per, key=lambda k: (k in ("total", "host (rest)"), k == "total", k)):
        ms = min(per[k]) * 1e3
        print(f"| {k} | {ms:.2f} | {ms / (plain_step * 1e3):.2f} | {calls.get(k, ''):{'.2f' if k in calls else ''}} |")


if __name__ == "__main__":
    main()
