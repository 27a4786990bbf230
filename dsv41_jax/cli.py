"""``dsv41`` command line: plan, params, forward, generate, train."""

from __future__ import annotations

import argparse
import json
import os
import sys


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's real default, except where there is nothing to show (None, False, an empty list) or the
    help text already says it (``[default: ...]``)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        nothing = default is None or default is False or default is argparse.SUPPRESS or default in ([], "")
        if "default:" in text or nothing:
            return text
        return super()._get_help_string(action)


class StatusLine:
    """One updating progress line on a TTY (carriage return); elsewhere at most one line per tenth of the work."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_tenth = -1
        self._open = False

    def update(self, text: str, done: int, total: int) -> None:
        if self.tty:
            self.stream.write("\r" + text.ljust(79))
            self._open = True
            if done >= total:
                self.end()
        else:
            tenth = 10 * done // max(total, 1)
            if tenth > self._last_tenth or done >= total:
                self._last_tenth = tenth
                self.stream.write(text + "\n")
        self.stream.flush()

    def end(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def _shorten(text: str, head: int = 120, tail: int = 200) -> str:
    """``text``, or for a long one its start and end around a note of what was left out (prompt echoes)."""
    if len(text) <= head + tail + 40:
        return text
    return f"{text[:head]}\n[... {len(text) - head - tail:,} characters of the prompt not shown ...]\n{text[-tail:]}"


def _trained_context(args, source: str) -> int | None:
    """Row length the weights were trained on, where recorded: the embedded default model, or a parameter export
    written by ``dsv41 train`` (its marker file records ``train_seq_len``)."""
    from dsv41_jax.checkpoint.orbax_ckpt import EXPORT_MARKER
    from dsv41_jax.default_model import TRAINED_SEQ_LEN

    if source == "the embedded default model":
        return TRAINED_SEQ_LEN
    if args.checkpoint is None:
        return None
    marker = os.path.join(args.checkpoint, EXPORT_MARKER)
    try:
        with open(marker) as f:
            value = json.load(f).get("train_seq_len")
        return int(value) if value else None
    except (OSError, ValueError, AttributeError, TypeError):
        return None


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


def _load_for_generate(args):
    """(config, params, tokenizer, description) for ``dsv41 generate``."""
    from dsv41_jax.config import load_config
    from dsv41_jax.inference.weights import host_random_params
    from dsv41_jax.tokenizer import load_tokenizer

    from dsv41_jax.checkpoint.orbax_ckpt import load_checkpoint
    from dsv41_jax.default_model import default_model, default_model_available

    speculative = getattr(args, "speculative", False)
    if args.checkpoint:
        if speculative:
            config, params = _load_drafter_checkpoint(args)
        else:
            config, params = load_checkpoint(args.checkpoint, keep_quantized=args.weights == "release")
        source = args.checkpoint
    elif args.config in (None, "default") and default_model_available():
        config, params, _ = default_model(include_dspark=speculative)
        source = "the embedded default model"
    else:
        if speculative:
            raise ValueError("--speculative needs a trained DSpark drafter: random weights have none (use the "
                             "embedded default model or a --checkpoint with mtp.* tensors)")
        config = load_config(args.config or "tiny")
        params = host_random_params(config, args.seed)
        source = f"random weights (seed {args.seed})"
    tokenizer = load_tokenizer(args.tokenizer, model_vocab_size=config.vocab_size)
    return config, params, tokenizer, source


def _load_drafter_checkpoint(args):
    """(config, params with the DSpark drafter) of ``--checkpoint`` for ``generate --speculative``; a clear error
    when the config has no DSpark modules or the checkpoint no trained drafter (mtp.* tensors)."""
    from dsv41_jax.checkpoint.errors import CheckpointError
    from dsv41_jax.checkpoint.orbax_ckpt import load_checkpoint
    from dsv41_jax.config import load_config

    try:
        config = load_config(args.checkpoint)
    except (ValueError, FileNotFoundError, OSError):
        config = None
    if config is not None and config.num_nextn_predict_layers <= 0:
        raise ValueError(f"--speculative: the model of {args.checkpoint} has no DSpark drafter "
                         "(num_nextn_predict_layers=0 in its config)")
    try:
        return load_checkpoint(args.checkpoint, keep_quantized=args.weights == "release", include_dspark=True)
    except CheckpointError as e:
        if "missing tensor mtp." in str(e):
            raise ValueError(f"--speculative: {args.checkpoint} holds no trained DSpark drafter (no mtp.* tensors; "
                             "train one with `dsv41 train --dspark`)") from e
        raise


def _generate_speculative(args, engine, reqs, on_token):
    """``generate --speculative``: the requests through :class:`SpeculativeDecoder` on ``engine``. Returns (results,
    summary lines: the acceptance length — mean tokens per verification step — and the timings)."""
    import time

    from dsv41_jax.inference.engine import compile_seconds
    from dsv41_jax.inference.speculative import SpeculativeDecoder

    schedule = None if args.schedule == "none" else args.schedule
    block = engine.config.dspark_block_size
    if args.draft_len is not None and args.draft_len > block:
        raise ValueError(f"--draft-len {args.draft_len} exceeds the drafter's block: it drafts at most "
                         f"dspark_block_size={block} tokens per step")
    table, table_note = None, ""
    if schedule == "prefix":
        from dsv41_jax.inference.speculative import parse_step_times

        if args.step_times is not None:
            table, how = parse_step_times(args.step_times), "given"
        else:  # the step program at every width, timed on this engine before generating
            t_measure = time.perf_counter()
            table = SpeculativeDecoder(engine, num_draft=args.draft_len).measure_step_times()
            how = f"measured in {time.perf_counter() - t_measure:.1f} s, compiles included"
        table_note = (f", step times ({how}) " +
                      ", ".join(f"{w}: {t * 1e3:.2f} ms" for w, t in sorted(table.items())))
    dec = SpeculativeDecoder(engine, num_draft=args.draft_len, schedule=schedule, threshold=args.threshold,
                             step_times=table)
    first = []  # (time, compile seconds so far) at the first token: the prefill is done, the decode loop starts

    def on_token_timed(i, tok):
        if not first:
            first.append((time.perf_counter(), compile_seconds()))
        on_token(i, tok)

    c0, t0 = compile_seconds(), time.perf_counter()
    results = dec.generate(reqs, on_token=on_token_timed)
    st = dec.stats
    after_first = sum(len(r.tokens) for r in results) - len(results)
    ttft = first[0][0] - t0 if first else float("nan")
    decode_compile = compile_seconds() - first[0][1] if first else 0.0
    steady = st.decode_s - decode_compile
    rate = f"{after_first / steady:,.1f} tok/s without it" if steady > 0 and after_first else "no steady rate"
    sched = {"threshold": f"threshold {args.threshold}", "prefix": f"prefix{table_note}"}.get(schedule, "off")
    return results, [
        f"# speculative decoding: DSpark, {dec.num_draft} drafts per step, confidence scheduling {sched} | acceptance "
        f"length {st.mean_accepted_length:.2f} tokens per verification step ({st.accepted:,} of {st.drafted:,} drafts "
        f"accepted; {st.steps} verification steps, {st.rollbacks} with a rollback)",
        f"# compile: {compile_seconds() - c0:.1f} s (lowering + XLA, inside the times below) | time to first token: "
        f"{ttft:.2f} s (prefill of {len(reqs[0].prompt):,} tokens) | decode: {after_first:,} tokens after the first "
        f"in {st.decode_s:.2f} s ({decode_compile:.1f} s of it compiling), {rate} | finish: "
        f"{', '.join(r.finish_reason for r in results)}"]


def _quantized_gemm_option(name: str, weights: str | None, platform: str) -> tuple[str, str]:
    """(``--quantized-gemm`` as given, the backend it resolves to here), checked against ``--weights`` and the
    platform before anything is loaded: a clear error, not a lowering failure inside the first step."""
    from dsv41_jax.kernels.quant_gemm import resolve_backend  # unknown names: QuantGemmError (a ValueError)

    resolved = resolve_backend(name)
    if name != "reference" and weights == "bf16":
        raise ValueError(f"--quantized-gemm {name}: bf16 weights have no FP8 / FP4 GEMMs; the option applies to "
                         "--weights release")
    needs = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}.get(resolved)
    if needs and platform != needs:
        raise ValueError(f"--quantized-gemm {name}: the {resolved} kernels need a {needs.upper()}, this run is on "
                         f"{platform} (use auto, reference or {resolved}_interpret)")
    return name, resolved


def _cmd_generate(args) -> int:
    import jax

    from dsv41_jax.inference.cache import cache_footprint
    from dsv41_jax.inference.engine import Engine, Request
    from dsv41_jax.inference.step import FAST_COMPILE, InferenceOptions
    from dsv41_jax.compilation_cache import enable_compilation_cache

    cache_setting = False if args.no_compilation_cache else None
    enable_compilation_cache(cache_setting)  # before anything compiles (loading the weights does)
    qgemm, qgemm_resolved = _quantized_gemm_option(args.quantized_gemm, args.weights, jax.default_backend())
    _check_speculative_arguments(args)
    config, params, tokenizer, source = _load_for_generate(args)
    prompt = tokenizer.encode(args.prompt, add_bos=True)
    n = args.num_samples
    if n < 1:
        raise ValueError(f"--num-samples must be >= 1, got {n}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    max_len = args.max_len or len(prompt) + args.max_new_tokens
    fast = args.fast_compile == "on" or (args.fast_compile == "auto" and jax.default_backend() == "cpu")
    opts = InferenceOptions(ced=not args.no_ced, compiler_options=FAST_COMPILE if fast else (),
                            quantized_gemm=qgemm)
    engine = Engine(config, params, max_batch=n, max_len=max_len, tokenizer=tokenizer,
                    prefill_chunk=args.prefill_chunk, options=opts, compilation_cache=cache_setting,
                    weights=args.weights, cache=args.cache, engram_tables=args.engram_tables)
    if qgemm != "reference" and engine.weights_format != "release":  # --weights left to the parameters' form
        raise ValueError(f"--quantized-gemm {qgemm}: these weights are served in bf16 (no FP8 / FP4 GEMMs); the "
                         "option applies to --weights release")
    err = sys.stderr
    print(f"# {config.name}: {config.num_hidden_layers} layers, d={config.hidden_size}, {source}; prompt "
          f"{len(prompt)} tokens, {n} sample(s), max_len {max_len}, {jax.default_backend()}"
          f"{' (fast XLA compile)' if fast else ''}; {'CED prefill' if opts.ced else 'full-replay prefill'}",
          file=err)
    dtype = str(engine.cache_dtype.name if hasattr(engine.cache_dtype, "name") else engine.cache_dtype)
    print(f"# {engine.footprint().describe()}", file=err)
    gemms = (f" (FP8 / FP4 GEMMs: {qgemm}" + (f" -> {qgemm_resolved}" if qgemm_resolved != qgemm else "") + ")"
             if engine.weights_format == "release" else "")
    tables = f"; Engram tables in {engine.engram_tables} memory" if config.engram_layer_ids else ""
    print(f"# weights [{engine.weights_format}]: {engine.weight_bytes():,} B{gemms}{tables}; cache [{args.cache}]: "
          f"{engine.footprint().per_token:,.1f} B/token", file=err)
    release = cache_footprint(config, "release")
    print(f"# released FP4/FP8 storage would be {release.per_token:,.1f} B/token ({dtype} here: "
          f"{engine.footprint().per_token:,.1f} B/token)", file=err)

    trained = _trained_context(args, source)
    if trained is not None and len(prompt) > trained:
        print(f"dsv41: warning: the prompt is {len(prompt):,} tokens but the model was trained on rows of {trained} "
              "tokens: text beyond that is outside what it learnt (and the prefill takes longer)", file=err)
    status = StatusLine(err)

    def progress(done, total):
        status.update(f"# prefill {done:,}/{total:,} prompt tokens", done, total)

    stream = n == 1
    pending: list[int] = []
    echoed = []  # the prompt is echoed with the first new token, after the prefill's progress lines

    def on_token(i: int, tok: int) -> None:
        if not stream:
            return
        if not echoed:
            status.end()
            print(_shorten(args.prompt), end="", flush=True)
            echoed.append(True)
        pending.append(tok)
        text = tokenizer.decode(pending)
        if "\ufffd" not in text or len(pending) >= 4:  # wait for a whole UTF-8 character
            print(text, end="", flush=True)
            pending.clear()

    reqs = [Request(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed + i, stop_tokens=(tokenizer.eos_id,)) for i in range(n)]
    if args.speculative:
        results, summary = _generate_speculative(args, engine, reqs, on_token)
    else:
        results = engine.generate(reqs, on_token=on_token, progress=progress)
    for r in results:
        if r.error:
            raise ValueError(r.error)
    status.end()
    if stream:
        if not echoed:
            print(_shorten(args.prompt), end="")
        if pending:
            print(tokenizer.decode(pending), end="")
        print()
    for i, r in enumerate(results):
        if not stream:
            print(f"--- sample {i} ({r.finish_reason}) ---")
            print(_shorten(args.prompt) + (r.text or ""))
    if args.speculative:
        print("\n".join(summary), file=err)
        return 0
    st = engine.last_stats
    steady = (f"{st.steady_tokens_per_s:,.1f} tok/s steady (the steps after the first)"
              if st.steady_tokens_per_s == st.steady_tokens_per_s else "too few steps for a steady rate")
    print(f"# compile: {st.compile_s:.1f} s (lowering + XLA, inside the times below) | time to first token: "
          f"{st.time_to_first_token_s:.2f} s (prefill of {st.prompt_tokens:,} tokens) | decode: {st.new_tokens:,} "
          f"tokens in {st.decode_s:.2f} s, {steady}, first step {st.first_step_s:.2f} s | finish: "
          f"{', '.join(r.finish_reason for r in results)}", file=err)
    return 0


SCHEDULES = ("none", "threshold", "prefix")  # SpeculativeDecoder(schedule=...): None, "threshold", "prefix"


def _add_speculative_arguments(s) -> None:
    g = s.add_argument_group("speculative decoding (DSpark)")
    g.add_argument("--speculative", action="store_true",
                   help="decode with the model's trained DSpark drafter (lossless: greedy output is identical, "
                        "sampled output has the same distribution); prints the acceptance length")
    g.add_argument("--draft-len", type=int, default=None,
                   help="drafts proposed per step, 1 .. the config's dspark_block_size [default: dspark_block_size]")
    g.add_argument("--schedule", choices=SCHEDULES, default="none",
                   help="drafts verified per step: none = all --draft-len; threshold = those whose predicted "
                        "survival (product of the confidence head's probabilities) stays >= --threshold; prefix = "
                        "the hardware-aware prefix scheduler: the drafts maximising expected accepted tokens per "
                        "second of step time (--step-times, else measured at start-up), the step as wide as its "
                        "widest row")
    g.add_argument("--threshold", type=float, default=0.5, help="survival threshold of --schedule threshold, in (0, 1]")
    g.add_argument("--step-times", default=None, metavar="N:MS,...",
                   help="--schedule prefix: the step's time in ms for N tokens per row (1 + drafts verified), e.g. "
                        "'1:4.0,3:4.6,6:5.9' [default: measured at start-up for N = 1 .. --draft-len + 1]")


def _check_speculative_arguments(args) -> None:
    """Clear errors for speculative options that cannot apply, before anything is loaded."""
    given = [flag for flag, on in (("--draft-len", args.draft_len is not None), ("--schedule", args.schedule != "none"),
                                   ("--step-times", args.step_times is not None)) if on]
    if given and not args.speculative:
        raise ValueError(f"{', '.join(given)} only apply with --speculative")
    if args.draft_len is not None and args.draft_len < 1:
        raise ValueError(f"--draft-len must be >= 1, got {args.draft_len}")
    if args.schedule == "threshold" and not 0.0 < args.threshold <= 1.0:
        raise ValueError(f"--threshold must be in (0, 1], got {args.threshold}")
    if args.step_times is not None:
        if args.schedule != "prefix":
            raise ValueError("--step-times is the prefix schedule's table: use it with --schedule prefix")
        from dsv41_jax.inference.speculative import parse_step_times

        parse_step_times(args.step_times)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash in JAX", formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("plan", help="print the unrolled layer plan", formatter_class=HelpFormatter)
    s.add_argument("--config", default="flash", help="preset name (configs/*.py) or config.json / checkpoint dir")
    s.set_defaults(fn=_cmd_plan)
    s = sub.add_parser("params", help="print parameter counts (total, backbone, Engram, DSpark, active per token)",
                       formatter_class=HelpFormatter)
    s.add_argument("--config", default="flash", help="preset name (configs/*.py) or config.json / checkpoint dir")
    s.set_defaults(fn=_cmd_params)
    s = sub.add_parser("generate", help="generate text (cached CED prefill + jitted decode)",
                       formatter_class=HelpFormatter)
    s.add_argument("--config", default=None, help="preset name with random weights, or 'default' for the embedded "
                   "trained model [default: 'default' when it is installed, else 'tiny']")
    s.add_argument("--checkpoint", default=None, help="checkpoint directory (config.json + safetensors, ...)")
    s.add_argument("--prompt", default="Hello", help="text to continue")
    s.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per sample")
    # Sampling by default (seeded, so reproducible): greedy decoding of a small model loops on a phrase.
    s.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--top-p", type=float, default=0.95, help="1 = off")
    s.add_argument("--seed", type=int, default=0, help="weights seed (random weights) and sampling seed")
    s.add_argument("--num-samples", type=int, default=1, help="samples generated as one batch (seeds seed+i)")
    s.add_argument("--max-len", type=int, default=None, help="cache length [default: prompt + max-new-tokens]")
    s.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill chunk (default: the Engine's: 512, longer on a Hopper GPU)")
    s.add_argument("--no-ced", action="store_true", help="full-replay prefill (every layer over the prompt)")
    s.add_argument("--fast-compile", choices=("auto", "on", "off"), default="auto",
                   help="unoptimised XLA compiles (auto: on CPU, where compile time dominates small models)")
    s.add_argument("--tokenizer", default=None, help="path to an HF tokenizer.json [default: byte-level]")
    s.add_argument("--no-compilation-cache", action="store_true",
                   help="do not use JAX's persistent compilation cache (on by default, in $XDG_CACHE_HOME/dsv41_jax "
                        "or ~/.cache/dsv41_jax; also DSV41_COMPILATION_CACHE=off)")
    s.add_argument("--weights", choices=("bf16", "release"), default=None, help="release: FP8 / FP4 weights on "
                   "device, GEMM inputs rounded to FP8 [default: release for quantised parameters, else bf16]")
    s.add_argument("--cache", choices=("bf16", "release"), default="bf16", help="release: packed FP8 / FP4 KV cache")
    s.add_argument("--engram-tables", choices=("auto", "device", "host"), default="auto",
                   help="where the Engram tables live: host (pinned host memory; only each step's rows move to the "
                        "device, read by the GPU itself on one CUDA GPU), device, or auto (host only where the "
                        "weights and cache cannot fit on the device)")
    s.add_argument("--quantized-gemm", default="reference", metavar="BACKEND",
                   help="with --weights release, how the FP8 / FP4 GEMMs run: reference (dequantise, then an XLA "
                        "GEMM), auto (the Pallas kernels reading the stored bytes on GPU / TPU, reference on CPU), "
                        "pallas_gpu, pallas_tpu, or pallas_gpu_interpret / pallas_tpu_interpret (CPU checks) "
                        "[default: reference]")
    _add_speculative_arguments(s)
    s.set_defaults(fn=_cmd_generate)
    from dsv41_jax.train.cli import add_parser as _add_train_parser  # `dsv41 train` (dsv41_jax/train/cli.py)

    _add_train_parser(sub, formatter_class=HelpFormatter)
    from dsv41_jax.checkpoint.cli import add_parsers as _add_checkpoint_parsers  # `dsv41 convert` / `dsv41 inspect`

    _add_checkpoint_parsers(sub, formatter_class=HelpFormatter)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"dsv41: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (loading, compiling, generating): no traceback
        what = " before the first training step; nothing to save" if args.cmd == "train" else ""
        print(f"\ndsv41 {args.cmd}: interrupted (Ctrl-C){what}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
