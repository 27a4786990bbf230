"""``dsv41`` command line: plan, params, forward, generate."""

from __future__ import annotations

import argparse
import sys
import time


def _cmd_plan(args) -> int:
    from dsv41_jax.config import load_config

    config = load_config(args.config)
    print(f"# layer plan of {config.name}: {config.num_hidden_layers} layers, encoder 0–{config.plan.decoder_start - 1}, "
          f"decoder {config.plan.decoder_start}–{config.num_hidden_layers - 1}")
    print(config.plan.table())
    return 0


def _cmd_params(args) -> int:
    from dsv41_jax.config import load_config
    from dsv41_jax.model.counting import count_params

    config = load_config(args.config)
    print(f"# parameter counts of {config.name} (abstract shapes, nothing allocated)")
    print(count_params(config).table())
    return 0


def _cmd_generate(args) -> int:
    import jax

    from dsv41_jax.checkpoint.hf import load_hf_checkpoint
    from dsv41_jax.config import load_config
    from dsv41_jax.inference.recompute import generate_by_recompute
    from dsv41_jax.model.model import default_hasher
    from dsv41_jax.model.params import init_params
    from dsv41_jax.tokenizer import load_tokenizer

    if args.checkpoint:
        config, params = load_hf_checkpoint(args.checkpoint)
        source = args.checkpoint
    else:
        config = load_config(args.config)
        params = init_params(config, jax.random.PRNGKey(args.seed))
        source = f"random weights (seed {args.seed})"
    tokenizer = load_tokenizer(args.tokenizer, model_vocab_size=config.vocab_size)
    hasher = default_hasher(config, tokenizer)
    prompt = tokenizer.encode(args.prompt, add_bos=True)
    print(f"# {config.name}: {config.num_hidden_layers} layers, d={config.hidden_size}, {source}; "
          f"prompt {len(prompt)} tokens", file=sys.stderr)
    t0 = time.perf_counter()
    produced: list[int] = []

    def on_token(tok: int) -> None:
        produced.append(tok)
        print(tokenizer.decode([tok]), end="", flush=True)

    print(args.prompt, end="", flush=True)
    generate_by_recompute(params, config, prompt, max_new_tokens=args.max_new_tokens, hasher=hasher,
                          temperature=args.temperature, seed=args.seed, stop_tokens=(tokenizer.eos_id,),
                          on_token=on_token)
    dt = time.perf_counter() - t0
    print()
    print(f"# {len(produced)} tokens in {dt:.1f} s ({len(produced) / dt:.1f} tok/s, compile included)",
          file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash in JAX")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("plan", help="print the unrolled layer plan")
    s.add_argument("--config", default="flash", help="preset name (configs/*.py) or config.json / checkpoint dir")
    s.set_defaults(fn=_cmd_plan)
    s = sub.add_parser("params", help="print parameter counts (total, backbone, Engram, DSpark, active per token)")
    s.add_argument("--config", default="flash")
    s.set_defaults(fn=_cmd_params)
    s = sub.add_parser("generate", help="generate text")
    s.add_argument("--config", default="tiny")
    s.add_argument("--checkpoint", default=None, help="HF-named checkpoint directory (config.json + safetensors)")
    s.add_argument("--prompt", default="Hello")
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tokenizer", default=None, help="path to an HF tokenizer.json (default: byte-level)")
    s.set_defaults(fn=_cmd_generate)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"dsv41: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
