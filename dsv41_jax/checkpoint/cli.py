"""``dsv41 convert`` and ``dsv41 inspect`` (registered by :func:`add_parsers` from ``dsv41_jax/cli.py``)."""

from __future__ import annotations


def _cmd_convert(args) -> int:
    from dsv41_jax.checkpoint.convert import convert

    convert(args.src, args.dst, dtype=args.dtype, config=_config(args.config), overwrite=args.overwrite)
    return 0


def _cmd_inspect(args) -> int:
    from dsv41_jax.checkpoint.convert import inspect

    print(inspect(args.dir, _config(args.config)))
    return 0


def _config(name):
    if name is None:
        return None
    from dsv41_jax.config import load_config

    return load_config(name)


def add_parsers(sub, formatter_class=None) -> None:
    kw = {"formatter_class": formatter_class} if formatter_class else {}
    s = sub.add_parser("convert", help="convert a release / HF safetensors checkpoint into an orbax parameter export "
                                       "(streamed, resumable, verified)", **kw)
    s.add_argument("src", help="safetensors checkpoint directory (release or HF naming)")
    s.add_argument("dst", help="output directory (written atomically: <dst>.tmp-convert until verified)")
    s.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of the dequantised weights (mHC, sinks and router biases stay float32)")
    s.add_argument("--config", default=None, help="config preset / config.json [default: the checkpoint's]")
    s.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    s.set_defaults(fn=_cmd_convert)
    s = sub.add_parser("inspect", help="describe a safetensors checkpoint: naming, dtypes, bytes by component, "
                                       "missing / unknown / skipped tensors against a config", **kw)
    s.add_argument("dir")
    s.add_argument("--config", default=None, help="config preset / config.json to match [default: the checkpoint's]")
    s.set_defaults(fn=_cmd_inspect)
