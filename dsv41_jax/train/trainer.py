"""The training loop: data -> jitted train step -> progress bar, metrics file, orbax checkpoints, exports.

``train(...)`` is what ``dsv41 train`` runs. Resuming is automatic: with a checkpoint directory that already holds a
checkpoint of the same model config, the parameters, optimiser state, RNG and data position are restored and the
run continues where the checkpoint left off (bit-identical to an uninterrupted run on the same machine). SIGTERM
and SIGINT (Ctrl-C) make the loop finish the step in flight, save a checkpoint and return; a second SIGINT exits at
once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import warnings
from typing import Sequence

import jax

from dsv41_jax.config import ModelConfig
from dsv41_jax.train.config import TrainConfig, TrainWarning
from dsv41_jax.train.data import DataError, DataLoader, Dataset, ReadReport, load_corpus
from dsv41_jax.train.optimizer import lr_at
from dsv41_jax.train.step import TrainError, canonical_shardings, canonical_state, make_train_step, place_state


@dataclasses.dataclass
class TrainResult:
    state: dict
    step: int
    history: list  # [(step, metrics dict)] of logged steps
    schedule_steps: int
    stopped_by_signal: bool = False
    resumed_from: int | None = None
    export_dir: str | None = None
    stop_signal: str | None = None  # "SIGTERM" / "SIGINT" when a signal stopped the run

    @property
    def final_loss(self) -> float | None:
        return self.history[-1][1]["ce"] if self.history else None


class Progress:
    """A one-line progress bar on a TTY (plain log lines otherwise): step, loss, tokens/s, expert balance."""

    def __init__(self, total: int, start: int, enabled: bool = True, stream=None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self.start = start

    def update(self, step: int, m: dict) -> None:
        if not self.enabled:
            return
        done = (step - self.start) / max(1, self.total - self.start)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1e-9) * (1 - done) if done > 0 else float("nan")
        width = 24
        bar = "#" * int(width * done) + "." * (width - int(width * done))
        extra = f" kl {m['indexer_kl']:.3f}" if "indexer_kl" in m else ""
        extra += f" top-1 {m['top1']:.3f}" if "top1" in m else ""  # DSpark drafter
        balance = f"balance {m['balance']:.2f} | " if "balance" in m else ""
        line = (f"[{bar}] {step}/{self.total} loss {m['ce']:.4f}{extra} | {m['tokens_per_s']:,.0f} tok/s | "
                f"{balance}lr {m['lr']:.2e} | eta {eta:,.0f}s")
        if self.tty:
            self.stream.write("\r" + line.ljust(110))
            if step >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


class StopSignals:
    """SIGTERM / SIGINT -> a stop request at the next step boundary; a second SIGINT exits the process at once.

    The signals are read by a thread through ``signal.set_wakeup_fd``: a Python signal handler runs only when the main
    thread executes bytecode, which it does not while XLA compiles or runs a step (minutes for a first compile), so
    the stop request, its message and the second Ctrl-C's exit happen at once from the reader thread instead.
    Installed only from the main thread (signal handlers cannot be set elsewhere); otherwise a no-op.
    """

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.event = threading.Event()
        self.received: str | None = None  # "SIGTERM" / "SIGINT" once a stop was requested
        self._old_handlers: dict = {}
        self._old_wakeup = None
        self._socks = None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self
        rd, wr = socket.socketpair()
        wr.setblocking(False)
        self._socks = (rd, wr)
        self._old_wakeup = signal.set_wakeup_fd(wr.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            # the Python-level handler (main thread, between bytecodes) and the reader thread (at once) both request
            # the stop; only the reader counts deliveries and reports
            self._old_handlers[sig] = signal.signal(sig, self._request)
        self._thread = threading.Thread(target=self._read, args=(rd,), daemon=True, name="dsv41-stop-signals")
        self._thread.start()
        return self

    def _request(self, signum, _frame=None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
        self.event.set()

    def _read(self, rd) -> None:
        n_int = 0
        reported = False
        while True:
            try:
                data = rd.recv(16)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum not in (signal.SIGTERM, signal.SIGINT):
                    continue
                n_int += signum == signal.SIGINT
                if n_int >= 2:  # the second Ctrl-C: abort now, without saving
                    self.stream.write("\n# interrupted again: aborting without saving\n")
                    self.stream.flush()
                    os._exit(130)
                self._request(signum)
                if not reported:
                    reported = True
                    again = "; Ctrl-C again aborts without saving" if signum == signal.SIGINT else ""
                    self.stream.write(f"\n# {signal.Signals(signum).name}: finishing the current step, then "
                                      f"saving{again}\n")
                    self.stream.flush()

    def is_set(self) -> bool:
        return self.event.is_set()

    def __exit__(self, *exc) -> None:
        if self._socks is None:
            return
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        signal.set_wakeup_fd(self._old_wakeup if self._old_wakeup is not None else -1)
        rd, wr = self._socks
        wr.close()  # the reader sees the end of the stream and returns
        self._thread.join(timeout=5)
        rd.close()
        self._socks = None


def load_init_params(init_from: str, config: ModelConfig):
    """Parameters to start from: ``"default"`` (the embedded default model) or any checkpoint directory kind."""
    from dsv41_jax.checkpoint.orbax_ckpt import load_checkpoint

    if init_from == "default" and not os.path.exists(init_from):
        from dsv41_jax.default_model import DEFAULT_MODEL_DIR

        init_from = DEFAULT_MODEL_DIR
    _, params = load_checkpoint(init_from, config=config)
    return params


def _dspark_step(config: ModelConfig, tc: TrainConfig, options, init_from: str | None, mesh, export_format, say):
    """The DSpark drafter's train step against the frozen target of ``init_from`` (clear errors first)."""
    from dsv41_jax.train.dspark import DSparkTrainStep

    if not init_from:
        raise TrainError("--dspark trains a drafter for a trained target: pass --init-from (e.g. 'default')")
    if mesh is not None:
        raise TrainError("--dspark runs on one device (no --mesh)")
    if export_format == "orbax":
        raise TrainError("--dspark exports target + drafter as safetensors: pass --export-format safetensors")
    step = DSparkTrainStep(config, tc, load_init_params(init_from, config), options)
    say(f"# DSpark drafter ({config.num_nextn_predict_layers} blocks, block {config.dspark_block_size}, targets "
        f"{list(config.dspark_target_layer_ids)}) against the frozen target of {init_from}; labels: {options.labels}, "
        f"{options.anchors} anchors per row, drafter init {options.drafter_init}")
    return step


def corpus_warnings(read: ReadReport, n_tokens: int, tc: TrainConfig) -> list[str]:
    """Suspicious data for this run: skipped files, a corpus smaller than one batch or repeated many times."""
    out = []
    if read.binary:
        out.append(f"{len(read.binary)} binary file(s) skipped (a NUL byte in the first 8 KiB), e.g. {read.binary[0]}")
    if read.undecodable:
        out.append(f"{len(read.undecodable)} file(s) are not valid UTF-8 (bytes replaced by U+FFFD), e.g. "
                   f"{read.undecodable[0]}")
    per_step = tc.batch_size * tc.seq_len
    if n_tokens < per_step:
        out.append(f"the corpus has {n_tokens:,} tokens, fewer than one batch ({tc.batch_size} x {tc.seq_len} = "
                   f"{per_step:,}): every step repeats it")
    elif tc.steps * per_step > 100 * n_tokens:
        out.append(f"{tc.steps} steps x {per_step:,} tokens read the {n_tokens:,}-token corpus "
                   f"{tc.steps * per_step / n_tokens:,.0f} times: expect over-fitting")
    return out


def _to_host(m: dict) -> dict:
    return {k: float(v) for k, v in jax.device_get(m).items()}


def _load_tokenizer(tokenizer, config: ModelConfig):
    from dsv41_jax.tokenizer import ByteTokenizer, load_tokenizer

    if tokenizer is None:
        return ByteTokenizer(model_vocab_size=config.vocab_size)
    if isinstance(tokenizer, str):
        return load_tokenizer(tokenizer, model_vocab_size=config.vocab_size)
    return tokenizer


def train(config: ModelConfig, tc: TrainConfig, data: Sequence[str] | str, *, tokenizer=None, glob: str = "*",
          text_key: str = "text", ckpt_dir: str | None = None, save_every: int = 1000, keep: int | None = 3,
          metrics_path: str | None = None, log_every: int = 10, progress: bool = True, init_from: str | None = None,
          export_dir: str | None = None, export_format: str = "orbax", time_limit: float | None = None,
          stop_after: int | None = None, mesh=None, rules: str = "tp", handle_sigterm: bool = True,
          async_save: bool = True, allow_data_change: bool = False, max_docs: int | None = None,
          exclude: str = "", on_step=None, dspark=None) -> TrainResult:
    """Train ``config`` with ``tc`` on ``data`` (files / directories). See the module docstring.

    ``dspark`` (a :class:`~dsv41_jax.train.dspark.DSparkTrainOptions`): train the DSpark drafter against the frozen
    target loaded from ``init_from`` instead (checkpoints hold the drafter only; the export holds both).

    ``stop_after``: return after this many steps of this run (as if interrupted), saving a checkpoint.
    ``time_limit``: seconds for this run; after a short probe the total step count (and the LR schedule) is
    shrunk to fit, and the resolved count is recorded in the checkpoint and the metrics.
    """
    from dsv41_jax.checkpoint.orbax_ckpt import TrainCheckpointer
    from dsv41_jax.model.model import default_hasher

    if isinstance(data, str):
        data = [data]
    # ---- validate everything before touching the checkpoint directory ----------------------------------------
    if tc.seq_len > config.max_position_embeddings:
        raise TrainError(f"seq_len {tc.seq_len} exceeds the model's max_position_embeddings "
                         f"{config.max_position_embeddings}")
    def say(msg: str) -> None:  # stage messages, so a run shows progress from its start (compiles take minutes)
        if progress:
            print(msg, file=sys.stderr, flush=True)

    tok = _load_tokenizer(tokenizer, config)
    read = ReadReport()
    corpus = load_corpus(data, tok, glob=glob, text_key=text_key, model_vocab_size=config.vocab_size,
                         max_docs=max_docs, exclude=exclude, report=read)
    say(f"# data: {read.describe()}; {len(corpus.tokens):,} tokens")
    for msg in tc.warnings() + corpus_warnings(read, len(corpus.tokens), tc):
        warnings.warn(msg, TrainWarning, stacklevel=2)
    hasher = default_hasher(config, tok)
    dataset = Dataset(corpus, seq_len=tc.seq_len, batch_size=tc.batch_size, packing=tc.packing, seed=tc.seed,
                      hasher=hasher)
    if dspark is not None and tc.lora:
        raise TrainError("--dspark trains the drafter's own parameters (the target is frozen already): drop --lora")
    if dspark is not None:
        step_fn = _dspark_step(config, tc, dspark, init_from, mesh, export_dir and export_format, say)
    else:
        step_fn = make_train_step(config, tc, mesh=mesh, rules=rules)
    if export_dir and os.path.isdir(export_dir) and os.listdir(export_dir):
        raise TrainError(f"export directory {export_dir} is not empty; refusing to overwrite it")

    lora = getattr(step_fn, "is_lora", False)
    lora_meta = {}
    if lora:  # the frozen base is part of the run's identity: recorded, and checked on resume
        from dsv41_jax.train.lora import base_reference

        lora_meta = {"lora": {**step_fn.lora.to_dict(), "base": base_reference(init_from), "seed": tc.seed}}

    ckpt = None
    resumed_from = None
    schedule_steps = tc.steps
    position = {"epoch": 0, "row": 0}
    if ckpt_dir:
        ckpt = TrainCheckpointer(ckpt_dir, keep=keep, save_every=save_every, async_save=async_save)
    try:
        latest = ckpt.latest_step() if ckpt else None
        if latest is not None:
            ckpt.check_compatible(config, latest)
            meta = ckpt.meta(latest)
            objective = getattr(step_fn, "objective", "lm")
            if meta.get("objective", "lm") != objective:
                raise TrainError(f"checkpoint {ckpt_dir} trains the {meta.get('objective', 'lm')!r} objective, this "
                                 f"run the {objective!r} one ('dspark' = --dspark); use another --ckpt-dir")
            saved_fp = meta.get("data_fingerprint")
            if saved_fp and saved_fp != dataset.fingerprint() and not allow_data_change:
                raise DataError(f"checkpoint {ckpt_dir} was trained on other data (fingerprint {saved_fp}, now "
                                f"{dataset.fingerprint()}); pass allow_data_change / --allow-data-change to "
                                "continue from its parameters with the new data from its start")
            if lora:
                from dsv41_jax.train.lora import check_resume_base

                check_resume_base(meta, lora_meta["lora"], ckpt_dir)
                step_fn.set_base(load_init_params(init_from, config) if init_from else step_fn.random_base())
            elif meta.get("lora"):
                raise TrainError(f"checkpoint {ckpt_dir} holds LoRA adapters; resume it with --lora (same "
                                 "--init-from), or start full fine-tuning in another --ckpt-dir")
            abstract = step_fn.abstract_state()
            state, position, _ = ckpt.restore(abstract, latest, shardings=canonical_shardings(step_fn, abstract))
            state = place_state(step_fn, state)
            if saved_fp != dataset.fingerprint():
                position = {"epoch": 0, "row": 0}
            saved_tc = meta.get("train_config") or {}
            schedule_steps = int(meta.get("schedule_steps", tc.steps))
            if saved_tc.get("steps") != tc.steps:
                schedule_steps = tc.steps
            resumed_from = latest
            say(f"# resuming from step {latest} ({ckpt_dir})")
        else:
            params = None
            if init_from and dspark is None:
                params = load_init_params(init_from, config)
                say(f"# starting from the parameters of {init_from}")
            state = step_fn.init_state(params)
    except BaseException:
        if ckpt:
            ckpt.close()
        raise

    start = int(jax.device_get(state["step"]))
    loader = DataLoader(dataset, position)
    history: list = []
    metrics_file = open(metrics_path, "a") if metrics_path else None
    bar = Progress(schedule_steps, start, enabled=progress)
    stop = StopSignals()
    if handle_sigterm:  # SIGTERM and SIGINT
        stop.__enter__()
    tokens_per_step = tc.batch_size * tc.seq_len
    step = start
    last_saved = resumed_from
    t_log, n_log = time.perf_counter(), 0
    t_run = time.perf_counter()
    probe_at = start + 20 if time_limit else None
    t_probe = None
    extra_meta = lambda: {"data_fingerprint": dataset.fingerprint(), "schedule_steps": schedule_steps,  # noqa: E731
                          **lora_meta,
                          **({"objective": "dspark", "dspark": dspark.to_dict()} if dspark is not None else {})}

    def save(force=False):
        nonlocal last_saved
        if ckpt is None or last_saved == step:
            return
        ckpt.save(step, canonical_state(step_fn, state), data_position=loader.position, model_config=config,
                  train_config=tc, extra_meta=extra_meta(), force=force)
        last_saved = step

    say("# compiling the train step (the first step includes XLA compilation)…")
    t_first = None
    try:
        while step < schedule_steps and not stop.is_set():
            if stop_after is not None and step - start >= stop_after:
                break
            batch = next(loader)
            state, m = step_fn(state, batch, lr_at(step, tc, schedule_steps))
            step += 1
            n_log += 1
            if t_first is None:
                jax.block_until_ready(state["step"])
                t_first = time.perf_counter() - t_run
                say(f"# first step done in {t_first:.1f} s (compilation included)")
            if time_limit and step == start + 2:
                jax.block_until_ready(state["step"])
                t_probe = time.perf_counter()
            if probe_at is not None and step == probe_at:
                jax.block_until_ready(state["step"])
                per_step = (time.perf_counter() - t_probe) / (probe_at - start - 2)
                left = time_limit - (time.perf_counter() - t_run)
                fit = step + max(0, int(left / per_step))
                if fit < schedule_steps:
                    schedule_steps = fit
                    bar.total = fit
                probe_at = None
            if log_every and (step % log_every == 0 or step >= schedule_steps):
                hm = _to_host(m)
                now = time.perf_counter()
                hm["tokens_per_s"] = n_log * tokens_per_step / max(now - t_log, 1e-9)
                t_log, n_log = now, 0
                hm["step"] = step
                hm["epoch"], hm["row"] = loader.position["epoch"], loader.position["row"]
                history.append((step, hm))
                bar.update(step, hm)
                if metrics_file:
                    metrics_file.write(json.dumps({"step": step, **{k: v for k, v in hm.items() if k != "step"},
                                                   "elapsed_s": now - t_run}) + "\n")
                    metrics_file.flush()
                if not math.isfinite(hm["loss"]):
                    raise TrainError(f"loss became {hm['loss']} at step {step}")
            if on_step is not None:
                on_step(step, state)
            if ckpt is not None and step % max(1, save_every) == 0:
                save()
        save(force=True)
        if ckpt:
            ckpt.wait()
        exported = None
        if export_dir:
            from dsv41_jax.checkpoint.orbax_ckpt import export_params

            if lora:  # a plain parameter tree: the adapters folded into the base
                params = jax.device_get(step_fn.merged_params(state["params"]))
            else:
                params = jax.device_get(canonical_state(step_fn, state)["params"])
                if dspark is not None:
                    params = step_fn.export_params(params)
            exported = export_params(export_dir, params, config, fmt=export_format,
                                     extra={"step": step, "final_loss": history[-1][1]["ce"] if history else None,
                                            "train_seq_len": tc.seq_len})
        return TrainResult(state, step, history, schedule_steps, stop.is_set(), resumed_from, exported,
                           stop.received)
    finally:
        loader.close()
        if metrics_file:
            metrics_file.close()
        stop.__exit__(None, None, None)
        if ckpt:
            ckpt.close()


__all__ = ["train", "TrainResult", "Progress", "StopSignals", "load_init_params", "corpus_warnings"]
