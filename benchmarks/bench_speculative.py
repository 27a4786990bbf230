"""Speculative decoding (DSpark) vs plain decoding: tokens/s at batch 1 and 16, accepted length, steps.

    python benchmarks/bench_speculative.py --preset cpu  [--out DIR]    # tiny config + 2 draft blocks, CPU
    python benchmarks/bench_speculative.py --preset h200 [--out DIR]    # bench_inference's 12-layer full-width
                                                                        # model + 3 full-width draft blocks
    python benchmarks/bench_speculative.py --preset default [--out DIR] # the embedded default model + its trained
                                                                        # drafter, prompts from held-out text

``--preset default`` measures the trained drafter: prompts are cut from the Python standard library's ``asyncio``
package (held out of the drafter's training; ``heldout_prompts``), and the oracle rows are left out unless
``--oracle``.

Random weights: the DSpark drafter's acceptance is ~0, so the table also runs the verification machinery with
an ORACLE drafter that proposes the plain run's own continuation — all drafts accepted (the upper bound of the
engine at acceptance length γ + 1) and every second step corrupted at draft 2 (one accepted, rollbacks) — next to
the DSpark drafter (its drafting cost, acceptance of random weights) and, for the DSpark drafter, the confidence
threshold scheduler. Every speculative row checks that its tokens equal the plain run's (greedy). Times are
medians of ``--reps`` runs after a warm-up run (compiles); tokens/s counts generated tokens over the decode loop
(prefill excluded). Results: a Markdown table on stdout and ``DIR/bench_speculative.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_inference import cpu_config, h200_config, synthetic_hasher  # noqa: E402
from dsv41_jax.inference import Engine, InferenceOptions  # noqa: E402
from dsv41_jax.inference.speculative import SpeculativeDecoder  # noqa: E402
from dsv41_jax.inference.step import FAST_COMPILE  # noqa: E402
from dsv41_jax.inference.weights import host_random_params  # noqa: E402


def make_params(config, dtype, seed=0):
    if jax.default_backend() == "cpu":
        return host_random_params(config, seed, std=0.02, dtype=dtype, include_dspark=True)
    from dsv41_jax.model.params import init_params

    return init_params(config, jax.random.PRNGKey(seed), dtype, include_dspark=True)


def oracle(plain: dict, prompt_lens: dict, gamma: int, corrupt_every: int = 0):
    """A drafter proposing the plain run's continuation; every ``corrupt_every``-th step draft 2 is wrong."""

    def drafter(dec, pending, active):
        lengths = dec.engine.lengths()
        out = np.zeros((len(pending), gamma), np.int64)
        for s in np.flatnonzero(active):
            done = int(lengths[s]) - prompt_lens[s] + 1
            cont = plain[s][done:done + gamma]
            out[s, :len(cont)] = cont
            if corrupt_every and dec.stats.steps % corrupt_every == 0 and gamma > 1:
                out[s, 1] = (out[s, 1] + 1) % dec.config.vocab_size
        return out

    return drafter


def heldout_prompts(n: int, length: int, tokenizer) -> list[list[int]]:
    """``n`` prompts of ``length`` byte tokens from the running Python's ``asyncio`` sources (held out of the default
    drafter's training): file i (sorted, cycling) from its first line start after byte 600."""
    import sysconfig

    root = os.path.join(sysconfig.get_paths()["stdlib"], "asyncio")
    files = sorted(f for f in os.listdir(root) if f.endswith(".py") and os.path.getsize(os.path.join(root, f)) > 2000)
    out = []
    for i in range(n):
        text = open(os.path.join(root, files[i % len(files)]), encoding="utf-8").read()
        start = text.index("\n", 600 + 97 * (i // len(files))) + 1
        out.append(tokenizer.encode(text[start:start + length], add_bos=True))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=("cpu", "h200", "default"), default="cpu")
    ap.add_argument("--oracle", action="store_true", help="--preset default: also the oracle drafter rows")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tokenizer = None
    if args.preset == "default":
        import jax.numpy as jnp

        from dsv41_jax.default_model import default_model

        cpu = jax.default_backend() == "cpu"
        config, params, tokenizer = default_model(jnp.float32 if cpu else jnp.bfloat16, include_dspark=True)
        opts = InferenceOptions(compiler_options=FAST_COMPILE) if cpu else InferenceOptions()
        prompt_len, new = args.prompt_len or 96, args.new_tokens or 64
        max_len = 2 * prompt_len + new + 8  # prompts are cut by characters: a few may take 2-4 byte tokens
    elif args.preset == "cpu":
        config = cpu_config().replace(num_nextn_predict_layers=2)
        dtype, max_len, opts = np.float32, 256, InferenceOptions(compiler_options=FAST_COMPILE)
        prompt_len, new = args.prompt_len or 40, args.new_tokens or 24
    else:
        config = h200_config(num_nextn_predict_layers=3, dspark_n_routed_experts=16, dspark_num_experts_per_tok=3)
        import jax.numpy as jnp

        dtype, max_len, opts = jnp.bfloat16, 4096, InferenceOptions()
        prompt_len, new = args.prompt_len or 1024, args.new_tokens or 64
    if args.preset != "default":
        params = make_params(config, dtype)
    gamma = config.dspark_block_size
    rows = []
    print(f"# bench_speculative --preset {args.preset}: {config.name}, {jax.devices()[0].device_kind}, γ={gamma}, "
          f"prompt {prompt_len}, {new} new tokens, greedy", flush=True)
    print("| batch | drafter | tokens/s | × plain | accepted length | verify steps | rollbacks | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    def save(rows):  # after every row: a run cut short by a time limit still leaves its rows
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_speculative.json"), "w") as f:
                json.dump(dict(preset=args.preset, config=config.name, device=jax.devices()[0].device_kind,
                               prompt_len=prompt_len, new_tokens=new, rows=rows), f, indent=1)

    for b in (int(x) for x in args.batches.split(",")):
        if tokenizer is not None:
            eng = Engine(config, params, max_batch=b, max_len=max_len, options=opts, tokenizer=tokenizer)
            prompts = heldout_prompts(b, prompt_len, tokenizer)
        else:
            eng = Engine(config, params, max_batch=b, max_len=max_len, options=opts, hasher=synthetic_hasher(config))
            rng = np.random.default_rng(b)
            prompts = [[int(t) for t in rng.integers(3, config.vocab_size, prompt_len)] for _ in range(b)]
        lens = {s: len(p) for s, p in enumerate(prompts)}

        times = []
        for _ in range(args.reps + 1):  # the first run compiles
            res = eng.generate(prompts, max_new_tokens=new, stop_tokens=())
            times.append(eng.last_stats.decode_s)
        decode_s = statistics.median(times[1:] if args.reps else times)
        plain = {s: r.tokens for s, r in enumerate(res)}
        plain_tps = b * new / decode_s
        rows.append(dict(batch=b, drafter="plain", tokens_per_s=plain_tps))
        print(f"| {b} | plain decoding | {plain_tps:,.1f} | 1.00 | 1.00 | {new - 1} | 0 | — |", flush=True)
        save(rows)
        variants = [("oracle, all accepted", dict(drafter=oracle(plain, lens, gamma))),
                    ("oracle, every 2nd step 1 accepted", dict(drafter=oracle(plain, lens, gamma, 2))),
                    ("DSpark (random weights)", dict()),
                    ("DSpark + threshold 0.5", dict(schedule="threshold", threshold=0.5))]
        if tokenizer is not None:  # the trained drafter
            variants = (variants[:1] if args.oracle else []) + [
                ("DSpark (trained)", dict()), ("DSpark (trained) + threshold 0.5", variants[3][1])]
        for name, kw in variants:
            dec = SpeculativeDecoder(eng, **kw)

            times = []
            for _ in range(args.reps + 1):  # the first run compiles
                out = dec.generate(prompts, max_new_tokens=new, stop_tokens=())
                times.append(dec.stats.decode_s)
            dt = statistics.median(times[1:] if args.reps else times)
            st = dec.stats
            same = all(r.tokens == plain[s] for s, r in enumerate(out))
            tps = b * new / dt
            rows.append(dict(batch=b, drafter=name, tokens_per_s=tps, speedup=tps / plain_tps,
                             accepted_length=st.mean_accepted_length, steps=st.steps, rollbacks=st.rollbacks,
                             same_tokens=same))
            print(f"| {b} | {name} | {tps:,.1f} | {tps / plain_tps:.2f} | {st.mean_accepted_length:.2f} | "
                  f"{st.steps} | {st.rollbacks} | {'yes' if same else 'NO'} |", flush=True)
            save(rows)
        del eng



if __name__ == "__main__":
    main()
