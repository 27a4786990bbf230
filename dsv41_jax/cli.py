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
    from dsv41_jax.generate_simple import generate_cli

    return generate_cli(args)


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
