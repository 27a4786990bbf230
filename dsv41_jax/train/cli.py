"""``dsv41 train``: fine-tune / train a model on text or JSONL with orbax checkpoints (registered by dsv41_jax.cli).

    dsv41 train --init-from default --data corpus/ --glob '*.py' --steps 200 --ckpt-dir ckpt/   # fine-tune
    dsv41 train --config tiny --data corpus/ --glob '*.txt' --steps 1000 --ckpt-dir ckpt/      # from random weights

Re-running the same command resumes from the latest checkpoint in ``--ckpt-dir``. SIGTERM or Ctrl-C finishes the
step in flight, saves and exits (a second Ctrl-C aborts at once).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from dsv41_jax.train.config import DEFAULT_LORA_TARGETS


def add_parser(sub, formatter_class=argparse.ArgumentDefaultsHelpFormatter) -> None:
    s = sub.add_parser("train", help="train / fine-tune with optax + orbax checkpoints (resumable)",
                       formatter_class=formatter_class,
                       description="Train or fine-tune; the same command again resumes from --ckpt-dir. Fine-tune "
                                   "the embedded default model: dsv41 train --init-from default --data DIR ...")
    g = s.add_argument_group("model and data")
    g.add_argument("--config", default=None,
                   help="model preset (configs/*.py), config.json or checkpoint dir [default: the --init-from "
                        "checkpoint's config, else tiny (random weights)]")
    g.add_argument("--data", nargs="+", required=True, help="text / JSONL files or directories")
    g.add_argument("--glob", default="*", help="file name patterns inside directories (comma-separated)")
    g.add_argument("--exclude", default="", help="skip directories with these names (comma-separated patterns)")
    g.add_argument("--text-key", default="text", help="JSONL field holding the document text")
    g.add_argument("--tokenizer", default=None, help="HF tokenizer.json [default: byte-level]")
    g.add_argument("--max-docs", type=int, default=None, help="read at most this many documents [default: all]")
    g.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start from these parameters: 'default' (the embedded default model) or any checkpoint "
                        "directory [default: random initialisation]")
    g = s.add_argument_group("schedule")
    g.add_argument("--steps", type=int, default=1000,
                   help="optimiser steps of the whole run (the LR schedule's length)")
    g.add_argument("--seq-len", type=int, default=256, help="tokens per training row")
    g.add_argument("--batch-size", type=int, default=8, help="rows per step")
    g.add_argument("--packing", choices=("concat", "pad", "segments"), default="concat",
                   help="documents into rows: one cut stream | one document per row | packed with segment ids")
    g.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the data order")
    g.add_argument("--time-limit", type=float, default=None, help="seconds; shrinks --steps to fit after a probe")
    g = s.add_argument_group("optimiser")
    g.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw", help="optax optimiser")
    g.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    g.add_argument("--schedule", choices=("cosine", "linear", "constant", "wsd"), default="cosine",
                   help="learning-rate decay after the warm-up")
    g.add_argument("--warmup", type=int, default=100, help="linear warm-up steps (keep it well below --steps)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate / peak")
    g.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay (matrices only)")
    g.add_argument("--b2", type=float, default=0.95, help="Adam second-moment decay")
    g.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0 = off)")
    g.add_argument("--train-only", action="append", default=[], metavar="REGEX",
                   help="train only parameters whose path matches (repeatable), e.g. '/attn/'")
    g.add_argument("--freeze", action="append", default=[], metavar="REGEX",
                   help="freeze parameters whose path matches (repeatable), e.g. 'engram/embed'")
    g = s.add_argument_group("LoRA (adapters on a frozen base instead of full fine-tuning)")
    g.add_argument("--lora", action="store_true",
                   help="train low-rank adapters only; the base (--init-from) stays frozen, --export writes the "
                        "merged model")
    g.add_argument("--lora-rank", type=int, default=8, help="adapter rank r")
    g.add_argument("--lora-alpha", type=float, default=16.0, help="adapter scale numerator (scale = alpha / r)")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    g.add_argument("--lora-targets", default=DEFAULT_LORA_TARGETS, metavar="REGEX",
                   help="adapted weights: regex over parameter paths (default: the attention q, kv and output "
                        "projections)")
    g = s.add_argument_group("numerics and model options")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="compute dtype (master weights and optimiser state are float32)")
    g.add_argument("--quant-sim", choices=("config", "on", "off"), default="config",
                   help="the release's fake FP8 / FP4 quantisation (config: as the model config says)")
    g.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"), default="none",
                   help="jax.checkpoint policy (full: keep nothing, dots: keep matmul outputs, dots_no_batch: "
                        "keep those without batch dimensions)")
    g.add_argument("--remat-scope", choices=("forward", "layer"), default="forward",
                   help="where --remat applies: around the whole forward, or around each decoder layer (the "
                        "backward then recomputes one layer at a time)")
    g.add_argument("--moe-impl", choices=("auto", "ragged", "blocked", "grouped", "grouped_mgpu", "dense",
                                          "expert_parallel"), default="auto",
                   help="MoE implementation (blocked: grouped GEMM over padded row blocks, no ragged_dot; grouped: "
                        "the same blocks by a Pallas GPU kernel that reads each expert's weight in place; "
                        "grouped_mgpu: JAX's Mosaic GPU ragged-dot kernels (Hopper); ragged: jax.lax.ragged_dot; "
                        "auto: grouped_mgpu on Hopper GPUs, grouped on other GPUs, ragged elsewhere)")
    g.add_argument("--compute-copy", action="store_true",
                   help="keep the bf16 copy of the float32 masters in the train state, written by each update, "
                        "instead of casting every master each step (the same training; + 2 bytes per weight)")
    g.add_argument("--query-chunk", type=int, default=256, help="attention / indexer query chunk")
    g.add_argument("--bias-update-rate", type=float, default=1e-3, help="noaux expert-bias update (0 = off)")
    g.add_argument("--aux-loss", type=float, default=0.0, help="sequence-wise balance loss coefficient")
    g.add_argument("--indexer-loss", choices=("off", "dense", "sparse"), default="off",
                   help="indexer KL objective (dense: all visible entries, sparse: the selected top-k)")
    g.add_argument("--indexer-loss-coef", type=float, default=1.0, help="weight of the indexer KL loss")
    g.add_argument("--mesh", default=None, help="e.g. data=2,expert=4 [default: one device]")
    g.add_argument("--rules", default="tp", help="logical-axis rules preset for --mesh")
    g = s.add_argument_group("checkpoints and logs")
    g.add_argument("--ckpt-dir", default=None,
                   help="orbax checkpoint directory (resumes from its latest step) [default: no checkpoints]")
    g.add_argument("--save-every", type=int, default=1000, help="checkpoint every this many steps (and at the end)")
    g.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    g.add_argument("--metrics", default=None, help="append JSON lines of metrics here [default: none]")
    g.add_argument("--log-every", type=int, default=10, help="progress / metrics every this many steps")
    g.add_argument("--no-progress", action="store_true", help="no progress bar or stage messages")
    g.add_argument("--export", default=None, help="write inference parameters here at the end [default: none]")
    g.add_argument("--export-format", choices=("orbax", "safetensors"), default="orbax", help="format of --export")
    g.add_argument("--allow-data-change", action="store_true",
                   help="resume parameters/optimiser from --ckpt-dir even though the data differ")
    _add_dspark_arguments(s)
    s.set_defaults(fn=run)


def _add_dspark_arguments(s) -> None:
    g = s.add_argument_group("DSpark drafter (--dspark)")
    g.add_argument("--dspark", action="store_true",
                   help="train the config's DSpark drafter against the frozen target of --init-from (checkpoints "
                        "hold the drafter; --export writes target + drafter as safetensors)")
    g.add_argument("--dspark-anchors", type=int, default=64, help="draft blocks sampled per row and step")
    g.add_argument("--dspark-labels", choices=("target", "data"), default="target",
                   help="what each draft slot learns: the target's greedy token, or the text's next token")
    g.add_argument("--dspark-decay", type=float, default=4.0, help="slot k's loss weight is exp(-k / decay)")
    g.add_argument("--drafter-init", choices=("random", "target"), default="random",
                   help="a fresh drafter's start: random, or the target's last layers' weights (attention, norms, "
                        "mHC, shared and the first routed experts; main_proj = identity on the last captured layer)")


def _dspark_options(args):
    if not args.dspark:
        return None
    from dsv41_jax.train.dspark import DSparkTrainOptions

    return DSparkTrainOptions(anchors=args.dspark_anchors, labels=args.dspark_labels, decay=args.dspark_decay,
                              drafter_init=args.drafter_init)


def _resolve_config(args):
    from dsv41_jax.config import load_config

    if args.config is not None:
        return load_config(args.config)
    if args.init_from is None:
        return load_config("tiny")
    if args.init_from == "default" and not os.path.exists(args.init_from):
        from dsv41_jax.default_model import DEFAULT_MODEL_DIR

        return load_config(DEFAULT_MODEL_DIR)
    if os.path.isfile(os.path.join(args.init_from, "config.json")):
        return load_config(args.init_from)
    raise ValueError(f"--init-from {args.init_from}: no config.json there; pass --config for its model")


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"dsv41: warning: {message}", file=sys.stderr, flush=True)


def run(args) -> int:
    from dsv41_jax.train.config import TrainConfig, TrainWarning
    from dsv41_jax.train.trainer import train

    config = _resolve_config(args)
    tc = TrainConfig(
        seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps, packing=args.packing, seed=args.seed,
        optimizer=args.optimizer, lr=args.lr, schedule=args.schedule, warmup_steps=args.warmup,
        min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, b2=args.b2, grad_clip=args.grad_clip,
        trainable=tuple(args.train_only), frozen=tuple(args.freeze), compute_dtype=args.dtype,
        quant_sim=None if args.quant_sim == "config" else args.quant_sim == "on", remat=args.remat,
        remat_scope=args.remat_scope, compute_copy=args.compute_copy,
        moe_impl=args.moe_impl, query_chunk=args.query_chunk, bias_update_rate=args.bias_update_rate,
        aux_loss_coef=args.aux_loss, indexer_loss=args.indexer_loss, indexer_loss_coef=args.indexer_loss_coef,
        lora=args.lora, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        lora_targets=args.lora_targets)
    mesh = None
    if args.mesh:
        from dsv41_jax.parallel.mesh import make_mesh

        mesh = make_mesh(args.mesh)
    start = f"parameters of {args.init_from}" if args.init_from else "random weights"
    if tc.lora:
        from dsv41_jax.train.lora import LoraConfig, lora_targets

        lc = LoraConfig.from_train_config(tc)
        n = lora_targets(config, lc)  # validates the targets before any data is read
        start += (f"; LoRA rank {lc.rank} alpha {lc.alpha:g} dropout {lc.dropout:g} on {len(n)} weights "
                  f"({sum(lc.rank * (o + i) for o, i in n.values()):,} adapter parameters)")
    print(f"# train {config.name}: {config.num_hidden_layers} layers, d={config.hidden_size}, from {start}; batch "
          f"{tc.batch_size}x{tc.seq_len}, {tc.steps} steps, {tc.optimizer} lr {tc.lr} ({tc.schedule}, warm-up "
          f"{tc.warmup_steps}), {tc.compute_dtype}", file=sys.stderr, flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("always", TrainWarning)
        shown = warnings.showwarning
        warnings.showwarning = lambda m, c, *a, **k: (_print_warning(m, c, *a, **k) if issubclass(c, TrainWarning)
                                                       else shown(m, c, *a, **k))
        result = train(config, tc, args.data, tokenizer=args.tokenizer, glob=args.glob, text_key=args.text_key,
                       ckpt_dir=args.ckpt_dir, save_every=args.save_every, keep=args.keep, metrics_path=args.metrics,
                       log_every=args.log_every, progress=not args.no_progress, init_from=args.init_from,
                       export_dir=args.export, export_format=args.export_format, time_limit=args.time_limit,
                       mesh=mesh, rules=args.rules, allow_data_change=args.allow_data_change, max_docs=args.max_docs,
                       exclude=args.exclude, dspark=_dspark_options(args))
    if result.stopped_by_signal:  # SIGTERM / Ctrl-C: one line saying what was kept
        if args.ckpt_dir:
            print(f"saved step {result.step} to {args.ckpt_dir}; rerun to resume", file=sys.stderr)
        else:
            print(f"stopped at step {result.step} by {result.stop_signal}; nothing saved (no --ckpt-dir)",
                  file=sys.stderr)
        return 130 if result.stop_signal == "SIGINT" else 0
    resumed = f" (resumed from step {result.resumed_from})" if result.resumed_from is not None else ""
    loss = f"; final loss {result.final_loss:.4f}" if result.final_loss is not None else ""
    print(f"# finished at step {result.step}/{result.schedule_steps}{resumed}{loss}", file=sys.stderr)
    if args.ckpt_dir:
        print(f"# checkpoint: {args.ckpt_dir}", file=sys.stderr)
    if result.export_dir:
        print(f"# exported parameters: {result.export_dir}", file=sys.stderr)
    return 0
