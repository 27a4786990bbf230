"""Which rows raise the drafter's acceptance? One target, several drafters with the same seed and step count
(``--arms``): corpus rows only, or corpus rows mixed with the target's own greedy or sampled (T 1) continuations
(``bench_dspark_h200.target_rows``) in a given fraction, optionally another Markov rank — each measured by
speculative decoding of held-out prompts in the modes of ``--eval-temperatures`` (mean accepted tokens per
verification step; greedy runs' tokens checked against plain decoding).

    python benchmarks/ablate_dspark_rows.py --out DIR      # CPU, the toy widths of bench_dspark_h200 --smoke (~4 min)
    python benchmarks/ablate_dspark_rows.py --out DIR --block-size 7 --eval-temperatures 0,1 \
        --arms greedy:0.5,sampled:0.5,greedy:1,sampled:1,greedy:0.5:64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import sysconfig
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_dspark_h200 import (EXCLUDE, MixedLoader, inference_params, target_config,  # noqa: E402
                                          target_rows)
from benchmarks.bench_speculative import heldout_prompts  # noqa: E402
from dsv41_jax.inference import Engine, InferenceOptions  # noqa: E402
from dsv41_jax.inference.speculative import SpeculativeDecoder  # noqa: E402
from dsv41_jax.inference.step import FAST_COMPILE  # noqa: E402
from dsv41_jax.tokenizer import ByteTokenizer  # noqa: E402
from dsv41_jax.train.config import TrainConfig  # noqa: E402
from dsv41_jax.train.data import DataLoader, Dataset, load_corpus  # noqa: E402
from dsv41_jax.train.dspark import DRAFTER_INITS, DSparkTrainOptions, DSparkTrainStep  # noqa: E402
from dsv41_jax.train.optimizer import lr_at  # noqa: E402
from dsv41_jax.train.step import make_train_step  # noqa: E402


ARM_KEYS = {"anchors": int, "steps": int, "ce": float, "init": str}  # an arm's KEY=VALUE settings (training recipe)
# init=context (this ablation only): the target initialisation's context path alone — main_proj / main_norm and every
# block's wkv / kv_norm from drafter_from_target, every other tensor the random initialisation's (same seed)
ARM_INITS = (*DRAFTER_INITS, "context")


def parse_arm(text: str) -> tuple[str, float, int | None, dict]:
    """An arm of --arms: ``ROWS:FRACTION[:RANK][:KEY=VALUE...]`` -> (rows: corpus / greedy / sampled, the fraction
    of each batch's rows taken from the target's continuations of that kind, the drafter's Markov rank or None = the
    config's, {anchors: block starts per row, steps: drafter steps, ce: the loss's cross-entropy weight} where
    given, init: the drafter's start, ``DSparkTrainOptions.drafter_init`` random / target). Raises ValueError naming
    the bad arm."""
    parts = [x for x in text.split(":") if "=" not in x]
    extra = {}
    for kv in (x for x in text.split(":") if "=" in x):
        key, _, value = kv.partition("=")
        try:
            extra[key] = ARM_KEYS[key](value)
        except (KeyError, ValueError):
            raise ValueError(f"arm {text!r}: {kv!r} is not one of " + ", ".join(f"{k}=<{t.__name__}>"
                                                                              for k, t in ARM_KEYS.items())) from None
        if key == "init":
            if value not in ARM_INITS:
                raise ValueError(f"arm {text!r}: init is one of {ARM_INITS}")
        elif extra[key] < 0 or (key != "ce" and extra[key] < 1):
            raise ValueError(f"arm {text!r}: {kv!r} out of range")
    try:
        rows, frac = parts[0], float(parts[1]) if len(parts) > 1 else 0.0
        rank = int(parts[2]) if len(parts) > 2 else None
    except ValueError:
        rows, frac, rank = "", -1.0, None
    if rows not in ("corpus", "greedy", "sampled") or not 0 <= frac <= 1 or len(parts) > 3 or (
            rank is not None and rank < 1) or (rows == "corpus") != (frac == 0):
        raise ValueError(f"arm {text!r}: ROWS:FRACTION[:RANK], ROWS corpus (fraction 0) / greedy / sampled "
                         "(fraction in (0, 1]), RANK >= 1")
    return rows, frac, rank, extra


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-steps", type=int, default=300)
    ap.add_argument("--drafter-steps", type=int, default=150)
    ap.add_argument("--seq", type=int, default=224)
    ap.add_argument("--block-size", type=int, default=5, help="the drafter's block (drafts per step)")
    ap.add_argument("--gen-batches", type=int, default=8, help="generate calls of batch 8 for the target rows "
                    "(of each kind the arms use)")
    ap.add_argument("--arms", default="corpus:0,greedy:0.5", help="drafters to train, each ROWS:FRACTION[:RANK]: "
                    "corpus rows only (corpus:0), or that fraction of every batch from the target's greedy / "
                    "sampled (T 1) continuations; RANK: the drafter's Markov rank (default the config's, 16)")
    ap.add_argument("--eval-temperatures", default="0", help="decoding modes each drafter is measured in: 0 = "
                    "greedy (tokens checked against plain decoding), T > 0 = speculative sampling at T (seed 0)")
    ap.add_argument("--eval-batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--bf16", action="store_true", help="decode with bf16 weights (default float32: greedy ties are "
                    "then decided identically by a one-token step and a verification chunk)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    try:
        arms = [parse_arm(a) for a in args.arms.split(",") if a]
    except ValueError as e:
        ap.error(str(e))
    evals = [float(t) for t in args.eval_temperatures.split(",") if t]
    t0 = time.perf_counter()

    def say(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    config = target_config(True, args.block_size)
    tok = ByteTokenizer(model_vocab_size=config.vocab_size)
    corpus = load_corpus([sysconfig.get_paths()["stdlib"]], tok, glob="*.py", exclude=EXCLUDE,
                         model_vocab_size=config.vocab_size, max_docs=200)
    seq, bs = args.seq, 4
    tc = TrainConfig(seq_len=seq, batch_size=bs, steps=args.target_steps, lr=2e-3, warmup_steps=10, min_lr_ratio=0.1,
                     weight_decay=0.1, grad_clip=1.0, compute_dtype="float32", quant_sim=False)
    step_fn = make_train_step(config, tc)
    state = step_fn.init_state()
    loader = DataLoader(Dataset(corpus, seq_len=seq, batch_size=bs, packing="concat", seed=0))
    for i in range(args.target_steps):
        state, m = step_fn(state, next(loader), lr_at(i, tc, args.target_steps))
    loader.close()
    say(f"target: {args.target_steps} steps, last loss {float(m['loss']):.3f}")
    target = state["params"]
    opts = InferenceOptions(ced=False, compiler_options=FAST_COMPILE)
    prompts = heldout_prompts(args.eval_batch, 96, tok)
    width = max(len(p) for p in prompts)
    max_len = max(seq, width + args.new_tokens + 16)
    tcd = tc.replace(lr=1e-3, seed=1, steps=args.drafter_steps)
    opts_d = DSparkTrainOptions(anchors=8, labels="target")
    cast = (lambda p, c: inference_params(p, c)) if args.bf16 else (lambda p, c: p)  # noqa: E731
    configs, steps, engines = {}, {}, {}

    def setup(rank, extra=None):  # one config / engine per Markov rank, one drafter train step per recipe
        extra = extra or {}
        if rank not in configs:
            c = config if rank is None else config.replace(dspark_markov_rank=rank)
            configs[rank] = c
            engines[rank] = Engine(c, cast({**target, "dspark": DSparkTrainStep(c, tcd, target, opts_d).init_state()[
                "params"]["dspark"]}, c), max_batch=args.eval_batch, max_len=max_len, options=opts, tokenizer=tok)
        key = (rank, extra.get("anchors"), extra.get("ce"), extra.get("init"))
        if key not in steps:
            o = dataclasses.replace(opts_d, **({"anchors": extra["anchors"]} if "anchors" in extra else {}),
                                    **({"ce_weight": extra["ce"]} if "ce" in extra else {}),
                                    **({"drafter_init": "target" if extra["init"] == "context" else extra["init"]}
                                       if "init" in extra else {}))
            steps[key] = DSparkTrainStep(configs[rank], tcd, target, o)
        return configs[rank], steps[key], engines[rank]

    _, _, eng = setup(None)
    rows_of = {}
    for kind, temp in (("greedy", 0.0), ("sampled", 1.0)):
        if not any(a[0] == kind for a in arms):
            continue
        rows = None
        for _ in range(args.gen_batches):
            more = target_rows(eng, corpus, width, seq, 0.0, seed=len(rows) if rows is not None else 3, say=say,
                               temperature=temp)
            rows = more if rows is None else np.concatenate([rows, more])
        rows_of[kind] = rows
        say(f"{len(rows)} {kind} target rows; sample continuation {tok.decode(rows[0, width:].tolist())[:120]!r}")
    plain = {t: [r.tokens for r in eng.generate(prompts, max_new_tokens=args.new_tokens, stop_tokens=(),
                                                 temperature=t, seed=0)] for t in evals}
    record = dict(config=config.name, weights="bf16" if args.bf16 else "float32", target_steps=args.target_steps,
                  drafter_steps=args.drafter_steps, seq=seq, block_size=args.block_size,
                  target_rows={k: int(len(v)) for k, v in rows_of.items()}, arms=[])
    for kind, frac, rank, extra in arms:
        c, dstep, eng = setup(rank, extra)
        n_steps = extra.get("steps", args.drafter_steps)
        tcd_arm = tcd.replace(steps=n_steps)
        dstate = dstep.init_state()
        if extra.get("init") == "context":
            rand = DSparkTrainStep(c, tcd, target, opts_d).init_state()["params"]["dspark"]
            tgt = dstate["params"]["dspark"]
            dp = {**rand, "main_proj": tgt["main_proj"], "main_norm": tgt["main_norm"],
                  "blocks": [{**rb, "attn": {**rb["attn"], "wkv": tb["attn"]["wkv"], "kv_norm": tb["attn"]["kv_norm"]}}
                             for rb, tb in zip(rand["blocks"], tgt["blocks"])]}
            dstate = dstep.init_state({"dspark": dp})
        k = int(round(frac * bs))
        loader = MixedLoader(DataLoader(Dataset(corpus, seq_len=seq, batch_size=bs, packing="concat", seed=1)),
                             rows_of.get(kind), k, seed=4)
        hist = []
        for i in range(n_steps):
            dstate, m = dstep(dstate, next(loader), lr_at(i, tcd_arm, n_steps))
            hist.append({key: float(v) for key, v in m.items()})
        loader.close()
        last = {key: float(np.mean([h[key] for h in hist[-20:]])) for key in hist[-1]}
        eng.params = cast({**dstep.target, "dspark": dstate["params"]["dspark"]}, c)
        arm = dict(rows=kind, target_rows_per_batch=k, markov_rank=c.dspark_markov_rank, steps=n_steps,
                   anchors=dstep.options.anchors, ce_weight=dstep.options.ce_weight,
                   drafter_init=extra.get("init", dstep.options.drafter_init),
                   train_top1_last20=last["top1"], train_accept_last20=last["accept_rate"],
                   train_accept_by_slot=[last[f"accept_{j}"] for j in range(c.dspark_block_size)],
                   train_top1_by_slot=[last[f"top1_{j}"] for j in range(c.dspark_block_size)],
                   # the first step's metrics: the drafter as initialised (before any update)
                   step0_accept_by_slot=[hist[0][f"accept_{j}"] for j in range(c.dspark_block_size)],
                   step0_top1_by_slot=[hist[0][f"top1_{j}"] for j in range(c.dspark_block_size)],
                   curve_top1_0=[float(np.mean([h["top1_0"] for h in hist[i:i + 10]]))
                                 for i in range(0, n_steps, 10)], evals={})
        for t in evals:
            dec = SpeculativeDecoder(eng)
            res = dec.generate(prompts, max_new_tokens=args.new_tokens, stop_tokens=(), temperature=t, seed=0)
            arm["evals"][str(t)] = dict(accepted_length=dec.stats.mean_accepted_length, steps=dec.stats.steps,
                                        same_tokens=None if t > 0 else all(
                                            r.tokens == p for r, p in zip(res, plain[t])))
        record["arms"].append(arm)
        say(json.dumps(arm))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ablate_dspark_rows.json"), "w") as f:
        json.dump(record, f, indent=1)
    print("| drafter rows | target rows per batch | Markov rank | anchors per row | steps | CE weight | init | "
          + " | ".join(
        f"tokens per step ({'greedy' if t == 0 else f'T {t:g}'})" for t in evals)
        + " | train top-1 / accept (last 20) | train accept by slot | train top-1 by slot | same tokens (greedy) |")
    print("|---" * (11 + len(evals)) + "|")
    for a in record["arms"]:
        same = a["evals"].get("0.0", {}).get("same_tokens")
        print(f"| {a['rows']} | {a['target_rows_per_batch']} of {bs} | {a['markov_rank']} | {a['anchors']} | "
              f"{a['steps']} | {a['ce_weight']:g} | {a['drafter_init']} | "
              + " | ".join(f"{a['evals'][str(t)]['accepted_length']:.2f}" for t in evals)
              + f" | {a['train_top1_last20']:.3f} / {a['train_accept_last20']:.3f} | "
              + " ".join(f"{x:.2f}" for x in a["train_accept_by_slot"]) + " | "
              + " ".join(f"{x:.2f}" for x in a["train_top1_by_slot"])
              + f" | {'—' if same is None else ('yes' if same else 'NO')} |")


if __name__ == "__main__":
    main()
