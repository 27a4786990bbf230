"""Does training the drafter partly on the target's own greedy continuations raise its acceptance? One target,
two drafters with the same seed and step count — corpus rows only vs corpus rows mixed with the target's
continuations (``bench_dspark_h200.target_rows``) — each measured by speculative greedy decoding of held-out
prompts (mean accepted tokens per verification step; every run's tokens checked against plain decoding).

    python benchmarks/ablate_dspark_rows.py --out DIR      # CPU, the toy widths of bench_dspark_h200 --smoke (~4 min)
"""

from __future__ import annotations

import argparse
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
from dsv41_jax.train.dspark import DSparkTrainOptions, DSparkTrainStep  # noqa: E402
from dsv41_jax.train.optimizer import lr_at  # noqa: E402
from dsv41_jax.train.step import make_train_step  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-steps", type=int, default=300)
    ap.add_argument("--drafter-steps", type=int, default=150)
    ap.add_argument("--seq", type=int, default=224)
    ap.add_argument("--gen-batches", type=int, default=8, help="generate calls of batch 8 for the target rows")
    ap.add_argument("--gen-rows", type=float, default=0.5)
    ap.add_argument("--eval-batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--bf16", action="store_true", help="decode with bf16 weights (default float32: greedy ties are "
                    "then decided identically by a one-token step and a verification chunk)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    def say(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    config = target_config(True)
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
    dstep = DSparkTrainStep(config, tcd, target, opts_d)
    cast = (lambda p: inference_params(p, config)) if args.bf16 else (lambda p: p)  # noqa: E731
    eng = Engine(config, cast({**target, "dspark": dstep.init_state()["params"]["dspark"]}),
                 max_batch=args.eval_batch, max_len=max_len, options=opts, tokenizer=tok)
    rows = None
    for _ in range(args.gen_batches):
        more = target_rows(eng, corpus, width, seq, 0.0, seed=len(rows) if rows is not None else 3, say=say)
        rows = more if rows is None else np.concatenate([rows, more])
    say(f"{len(rows)} target rows; sample continuation {tok.decode(rows[0, width:].tolist())[:120]!r}")
    plain = [r.tokens for r in eng.generate(prompts, max_new_tokens=args.new_tokens, stop_tokens=())]
    record = dict(config=config.name, weights="bf16" if args.bf16 else "float32", target_steps=args.target_steps,
                  drafter_steps=args.drafter_steps, seq=seq,
                  target_rows=int(len(rows)), arms=[])
    for name, k in (("corpus", 0), ("corpus + target rows", int(round(args.gen_rows * bs)))):
        dstate = dstep.init_state()
        loader = MixedLoader(DataLoader(Dataset(corpus, seq_len=seq, batch_size=bs, packing="concat", seed=1)),
                             rows, k, seed=4)
        top1 = []
        for i in range(args.drafter_steps):
            dstate, m = dstep(dstate, next(loader), lr_at(i, tcd, args.drafter_steps))
            top1.append(float(m["top1"]))
        loader.close()
        eng.params = cast({**dstep.target, "dspark": dstate["params"]["dspark"]})
        dec = SpeculativeDecoder(eng)
        res = dec.generate(prompts, max_new_tokens=args.new_tokens, stop_tokens=())
        same = all(r.tokens == p for r, p in zip(res, plain))
        arm = dict(name=name, target_rows_per_batch=k, accepted_length=dec.stats.mean_accepted_length,
                   steps=dec.stats.steps, train_top1_last20=float(np.mean(top1[-20:])), same_tokens=same)
        record["arms"].append(arm)
        say(json.dumps(arm))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ablate_dspark_rows.json"), "w") as f:
        json.dump(record, f, indent=1)
    print("| drafter rows | accepted length (held-out, greedy) | verification steps | train top-1 (last 20) | "
          "same tokens |")
    print("|---|---|---|---|---|")
    for a in record["arms"]:
        print(f"| {a['name']} | {a['accepted_length']:.2f} | {a['steps']} | {a['train_top1_last20']:.3f} | "
              f"{'yes' if a['same_tokens'] else 'NO'} |")


if __name__ == "__main__":
    main()
