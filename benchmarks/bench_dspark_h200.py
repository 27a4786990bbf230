"""DSpark on a target whose decode step reads GiBs of weights: train a target, train its drafter against the frozen
target, then plain vs speculative decoding — all in one process (one device call).

    python benchmarks/bench_dspark_h200.py --out DIR            # an NVIDIA H200: ~6 minutes (--budget-s 400)
    python benchmarks/bench_dspark_h200.py --smoke --out DIR    # the same pipeline at toy size, CPU (~2-5 minutes)

Compiling is most of a short run's time (one program per shape: prefill, decode step, drafting, verification,
each at batch 1 and 16, and the training steps). GEMMs run through cuBLAS (``--xla_gpu_enable_triton_gemm=false``,
set here unless ``--triton-gemm``: without the Triton GEMMs' autotuning the train steps and the batch-16 prefill
compile 2-4x faster). The batch-1 prefill and the batch-16 decode step compiled for minutes in XLA:GPU's priority
fusion until the mHC Sinkhorn moved into its Pallas kernel on the GPU backend (benchmarks/RESULTS.md, "The slow
GPU compiles found and fixed"); all of them now compile in <= 20 s on an H200. Only the programs of the rows asked
for (``--variants``, default plain + DSpark on the device loop) are built; ``benchmarks/dspark_programs.py`` lists
them with their sizes. So right after loading the data the
script builds its decoding engines on zero parameters (the trained ones' dtypes and placement) and runs each
decoding path once in threads beside the target's training, and one drafter-training step on a zero target: the
programs then serve the trained parameters without compiling again (``warm_ups`` in the JSON, and every log line
carries the process's compile seconds so far).

Recipe (``--smoke`` shrinks every size; the numbers below are the defaults):

1. Target ``spec-h200``: the release's layer width (d 5120, 64 heads x 512, q LoRA 1280, 8 x 1024 output groups,
   expert width 2304) with 4 layers (roles 0 SWA · 1 ratio-2 Full · 2 ratio-2 Reuse · 3 ratio-1 Full), 16 routed
   experts top-6 + 1 shared, no Engram, byte vocabulary (259), fake quantisation off: 2.94 B backbone parameters,
   1.52 B active per decoded token (≈ 3 GB of bf16 weights read per batch-1 step); ``--target-experts`` /
   ``--target-topk`` / ``--drafter-experts`` change the MoE shape (a verification chunk reads the union of its
   tokens' picks: ``benchmarks/dspark_recipe_bytes.py``; call 11 ran 8 / 6 / 4). Trained from random
   initialisation on the Python standard library's sources (``asyncio`` held out), rows of 512 bytes, batch 8,
   AdamW lr 5e-4 (warm-up 30, cosine to 10 %), bf16 compute / float32 masters, for as many steps as fit
   ``--target-s`` seconds after compilation (the step time measured on steps 2-6 and again at every logged
   step; the cosine schedule follows the count).
2. Drafter: one DSpark block (block size 5, fed by the residual entering layers 1-3, SWA-only attention, 8 routed
   experts top-1 + shared, Markov rank 64, noise token 258), trained against the frozen target with target-greedy
   labels (``DSparkTrainStep``, 32 anchors per row), same optimiser settings with lr 1e-3, for as many steps as fit
   ``--drafter-s`` seconds (cut so that ``--decode-reserve-s`` remain). Its rows: ``--gen-rows`` (half) of every
   batch are the target's own continuations (``--gen-s`` seconds of generating at batch 16: a corpus stretch
   as wide as the prompts + bytes to 512, greedy or sampled at ``--gen-temperature``; what the drafter must
   predict at inference), the rest corpus rows.
3. Decoding (bf16 weights, float32-only parameters in float32): held-out ``asyncio`` prompts of 96 characters,
   ``--new-tokens`` greedy tokens; at batch 1 each of ``--prompts`` prompts alone (every row kind per prompt,
   then tokens / total time over all prompts and over the prompts whose plain continuation is not degenerate:
   ``text_stats``), at batch 16 the first 16 together; plain decoding (the device loop, read back every 8 steps),
   then speculation with the schedule off on the device (``speculative_chain``, read back every 8 steps); with
   ``--variants``, also the same in the host loop (one read-back per step), the confidence threshold
   (``--threshold``, default 0.5, or ``threshold@X``; on the device too), verifying only the first N drafts (``none:N``) and the
   hardware-aware prefix scheduler (host loop) over a step-time table measured in the same process (every chunk
   width 1 .. γ + 1; ``--prefix-batches``). Rows run in that order of importance; ``--budget-s`` skips what would start too
   late. Prefill runs without CED (the drafter's target layers 1-2 are encoder layers); it is outside the timed
   decode loop. Every speculative row checks that its tokens equal plain decoding's (bf16: near-tied logits may
   round differently in the one-token step and the verification chunk). Sampled rows (``plain~T`` / ``none~T``,
   at ``--sample-batches``): plain sampling and speculative sampling (lossless in distribution; the device loop),
   each prompt with the same seed; the speculative row's own continuation is judged by ``text_stats`` too, and
   a prompt counts among the non-degenerate ones only when neither continuation is degenerate.
   Floor: the bytes a step must read (active bf16 weights: batch 1 = attention / shared / top-6 of 16 routed
   experts per layer + head; batch b = the routed experts b tokens are expected to touch under uniform routing; a
   speculative step = a full-width verification of b (γ + 1) tokens + the drafter's block), as a fraction of a
   read-only kernel's bandwidth measured in the same process over the measured step time.

Since call 14: ``--anchors`` sets the drafter's anchors per row; ``--early-warm`` names the warm-ups that compile beside
the target train step (the others start with its training, so that compile is not slowed by six others);
``--eval-batches`` measures each trained drafter on held-out ``asyncio`` rows (teacher-forced acceptance per draft
slot, its train step at learning rate 0); the speculative programs take XLA's Triton GEMMs on the GPU by default
(``InferenceOptions.verification_compiler_options``), ``--cublas-verify-batches`` keeps cuBLAS at given batches.
Since call 15: ``--drafter-init random,target`` trains one drafter per initialisation (``DSparkTrainOptions.
drafter_init``; ``target``: the target's last layer's weights, ``train.dspark.drafter_from_target``) on the same rows,
seed and seconds each; a row's ``^INIT`` suffix picks the drafter (``none^target``; default the first listed).

Output: a table on stdout, ``DIR/bench_dspark_h200.json`` (rewritten after every row, so a run cut short by its
time limit keeps what it measured; ``compiles``: every XLA compile of the process with its program, thread and
seconds) and the two training curves in ``DIR/train_*.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import sysconfig
import threading
import time

# the programs of the decoding phase are compiled (and run once, on zero parameters) beside the training: room
# for both on the device
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
# GEMMs through cuBLAS unless --triton-gemm: XLA's Triton GEMM autotuner compiles and times dozens of candidate
# kernels for every GEMM of a new shape; cuBLAS cut this script's train steps and batch-16 prefill 2-4x on an H200
# (benchmarks/RESULTS.md, DSpark calls 3-4). (The minutes the batch-1 prefill and the batch-16 decode step spent in
# XLA:GPU's priority fusion came from the unrolled mHC Sinkhorn, now a Pallas kernel on the GPU backend.)
# The flag must be set before the backend starts.
# (only when run as a script: the modules importing this one keep their own flags)
if __name__ == "__main__" and "--triton-gemm" not in sys.argv \
        and "xla_gpu_enable_triton_gemm" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false").strip()

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_speculative import heldout_prompts  # noqa: E402
from dsv41_jax.config import load_config  # noqa: E402
from dsv41_jax.inference import Engine, InferenceOptions  # noqa: E402
from dsv41_jax.inference.engine import compile_seconds  # noqa: E402
from dsv41_jax.inference.speculative import SpeculativeDecoder  # noqa: E402
from dsv41_jax.inference.step import FAST_COMPILE  # noqa: E402
from dsv41_jax.model.counting import count_params, expected_distinct_experts, per_layer_params  # noqa: E402
from dsv41_jax.model.params import abstract_params, flat_specs  # noqa: E402
from dsv41_jax.tokenizer import ByteTokenizer  # noqa: E402
from dsv41_jax.train.config import TrainConfig  # noqa: E402
from dsv41_jax.train.data import DataLoader, Dataset, load_corpus  # noqa: E402
from dsv41_jax.train.dspark import DRAFTER_INITS, DSparkTrainOptions, DSparkTrainStep  # noqa: E402
from dsv41_jax.train.optimizer import lr_at  # noqa: E402
from dsv41_jax.train.step import make_train_step  # noqa: E402

EXCLUDE = "test,tests,idle_test,site-packages,dist-packages,__pycache__,asyncio"  # asyncio: the held-out prompts


def target_config(smoke: bool, block_size: int = 5, experts: int | None = None, topk: int | None = None,
                  drafter_experts: int | None = None, markov_rank: int | None = None):
    """The target + drafter configuration (see the module docstring); ``block_size``: the drafter's block (γ).
    ``experts`` / ``topk``: the target's routed experts and picks per token (default 16 / 6), ``drafter_experts``:
    the drafter's routed experts (default 8, top-1) — the recipe's MoE shape, which sets how many bytes a
    verification step reads against a plain one (``benchmarks/dspark_recipe_bytes.py``); ``markov_rank``: the
    drafter's Markov bias rank (default 64; --smoke 16)."""
    common = dict(vocab_size=259, num_hidden_layers=4, compress_ratios=(0, 2, 2, 1), kv_source_layer_ids=(1, 3),
                  index_source_layer_ids=(1, 3), candidate_source_layer_id=3, engram_layer_ids=(),
                  engram_num_embeddings=(), num_nextn_predict_layers=1, dspark_target_layer_ids=(1, 2, 3),
                  dspark_noise_token_id=258, dspark_block_size=block_size, quant_sim=False)
    if smoke:  # the default model's toy widths
        moe = {k: v for k, v in (("n_routed_experts", experts), ("num_experts_per_tok", topk)) if v is not None}
        return load_config("default").replace(name="spec-smoke", **common, **moe,
                                              dspark_n_routed_experts=drafter_experts or 4,
                                              dspark_num_experts_per_tok=1, dspark_markov_rank=markov_rank or 16)
    return load_config("flash").replace(name="spec-h200", **common, n_routed_experts=experts or 16,
                                        num_experts_per_tok=topk or 6,
                                        dspark_n_routed_experts=drafter_experts or 8, dspark_num_experts_per_tok=1,
                                        dspark_markov_rank=markov_rank or 64)


ROW_KINDS = ("plain", "none", "host", "threshold", "prefix")


TRITON_VERIFY = "%tg"  # row suffix: the speculative programs with XLA's Triton GEMMs (verification_compiler_options)


def uses_triton_verify(v: str) -> bool:
    """Row ``v`` runs on the engine whose speculative programs use XLA's Triton GEMMs (a ``%tg`` suffix; the other
    rows' GEMMs are cuBLAS's, see the top of this file)."""
    return TRITON_VERIFY in v


INIT_SUFFIX = "^"  # row suffix: the drafter of that initialisation (--drafter-init), e.g. none^target


def init_suffix(v: str) -> tuple[str, str | None]:
    """A row of --variants -> (the row without its ``^INIT`` suffix, the drafter initialisation it asks for or
    None). Raises ValueError naming the bad entry."""
    base, sep, init = v.partition(INIT_SUFFIX)
    if not sep:
        return v, None
    init = init.replace(TRITON_VERIFY, "")
    if init not in DRAFTER_INITS or base.partition("~")[0].partition(":")[0].partition("@")[0] == "plain":
        raise ValueError(f"{v!r}: '{INIT_SUFFIX}INIT' (the drafter started {' / '.join(DRAFTER_INITS)}) only goes "
                         "with a speculative row")
    return base + (TRITON_VERIFY if TRITON_VERIFY in v.partition(INIT_SUFFIX)[2] else ""), init


def init_of(v: str, inits) -> str:
    """The initialisation of the drafter that decodes row ``v``: its ``^INIT``, else the first of --drafter-init."""
    asked = init_suffix(v)[1]
    if asked is not None and asked not in inits:
        raise ValueError(f"{v!r}: no drafter started {asked!r} (--drafter-init {','.join(inits)})")
    return inits[0] if asked is None else asked


def drafter_suffix(v: str) -> tuple[str, float | None]:
    """A row of --variants -> (the row without its drafter suffix, the drafter asked for or None): ``none#1.0``
    decodes with the drafter trained on the target's continuations sampled at T 1 (``--gen-temperature``),
    ``none#0`` with the one trained on its greedy continuations. A ``%tg`` engine suffix and a ``^INIT`` drafter
    initialisation (:func:`init_suffix`) are left out too. Raises ValueError naming the bad entry."""
    v = init_suffix(v)[0].replace(TRITON_VERIFY, "")
    base, sep, t = v.rpartition("#")
    if not sep:
        return v, None
    try:
        temp = float(t)
    except ValueError:
        temp = -1.0
    if not temp >= 0 or base.partition("~")[0].partition(":")[0].partition("@")[0] == "plain":
        raise ValueError(f"{v!r}: '#T' (the drafter trained on rows generated at temperature T >= 0) only goes "
                         "with a speculative row")
    return base, temp


def drafter_of(v: str, gen_temperatures) -> float:
    """The generation temperature of the drafter that decodes row ``v``: the one its ``#T`` names, else the one
    trained on rows generated in the row's own decoding mode (the nearest temperature: greedy rows -> the drafter
    of greedy rows, T 1 -> the one of T-1 rows; ties -> the first listed)."""
    base, asked = drafter_suffix(v)
    if asked is not None:
        if asked not in gen_temperatures:
            raise ValueError(f"{v!r}: no drafter trained on rows generated at T {asked:g} (--gen-temperature "
                             f"{','.join(f'{t:g}' for t in gen_temperatures)})")
        return asked
    temp = variant_temperature(base)[1]
    return min(gen_temperatures, key=lambda t: abs(t - temp))


def plain_of(v: str) -> str:
    """The baseline row of row ``v``: plain decoding, sampled at ``v``'s temperature (``none~0.7`` -> ``plain~0.7``)."""
    v = drafter_suffix(v)[0]
    return "plain" + v[v.index("~"):] if "~" in v else "plain"


def variant_temperature(v: str) -> tuple[str, float]:
    """A row of --variants -> (the row without its temperature, the sampling temperature; 0 = greedy):
    ``plain~1.0`` / ``none~0.7`` sample at that temperature (plain sampling / speculative sampling, the same
    seed per prompt); a ``#T`` drafter suffix (:func:`drafter_suffix`) is left out. Raises ValueError naming the
    bad entry."""
    v = drafter_suffix(v)[0]
    base, sep, t = v.partition("~")
    if not sep:
        return v, 0.0
    try:
        temp = float(t)
    except ValueError:
        temp = -1.0
    if not temp > 0 or base not in ("plain", "none"):
        raise ValueError(f"{v!r}: '~T' (a sampling temperature T > 0) only goes with plain / none")
    return base, temp


def parse_variant(v: str) -> tuple[str, int | None, float | None]:
    """A decode row kind of --variants -> (kind, drafts verified or None = all, threshold or None = --threshold):
    ``none:5`` verifies the first 5 drafts, ``threshold@0.3`` sets the survival threshold of that row; a
    ``~T`` suffix (sampling, :func:`variant_temperature`) is checked and left out. Raises ValueError naming the
    bad entry."""
    v, _ = variant_temperature(v)
    head, _, n = v.partition(":")
    kind, _, thr = head.partition("@")
    if kind not in ROW_KINDS:
        raise ValueError(f"unknown row kind {v!r} (one of {', '.join(ROW_KINDS)})")
    if n and (kind not in ("none", "threshold") or not n.isdigit() or int(n) < 1):
        raise ValueError(f"{v!r}: ':N' (N >= 1 drafts verified) only goes with none / threshold")
    if thr:
        try:
            t = float(thr)
        except ValueError:
            t = None
        if kind != "threshold" or t is None:
            raise ValueError(f"{v!r}: '@X' (a survival threshold) only goes with threshold, X a number")
    return kind, int(n) if n else None, float(thr) if thr else None


def text_stats(tokens) -> dict:
    """How varied a continuation is: the fraction of distinct tokens, the longest run of one token, the fraction
    of 4-grams that already occurred earlier in it (a loop). ``degenerate``: a run of one token over a quarter of
    it or >= 60 % repeated 4-grams — text any drafter predicts, which must not carry a speed-up."""
    t = [int(x) for x in tokens]
    n = len(t)
    if n == 0:
        return dict(tokens=0, distinct_fraction=0.0, longest_run=0, repeated_4gram_fraction=0.0, degenerate=True)
    run = best = 1
    for i in range(1, n):
        run = run + 1 if t[i] == t[i - 1] else 1
        best = max(best, run)
    seen, rep = set(), 0
    grams = [tuple(t[i:i + 4]) for i in range(n - 3)]
    for g in grams:
        rep += g in seen
        seen.add(g)
    rep4 = rep / len(grams) if grams else 0.0
    return dict(tokens=n, distinct_fraction=len(set(t)) / n, longest_run=best, repeated_4gram_fraction=rep4,
                degenerate=bool(best >= max(n // 4, 2) or rep4 >= 0.6))


def kernel_table(trace_dir: str, steps: int, top: int = 12) -> dict:
    """Device busy time per step and the kernels that take it, from a ``jax.profiler.trace`` of ``steps`` decoding
    steps (``benchmarks/trace_events.py``); {"error": ...} where the trace has no device events (the CPU)."""
    import collections
    import re

    from benchmarks.trace_events import load_trace, newest_trace, union_length

    path = newest_trace(trace_dir)
    if path is None:
        return {"error": f"no trace under {trace_dir}"}
    events, pname, tname = load_trace(path)
    dev = {p for p, n in pname.items() if re.search(r"/device:(GPU|gpu)|GPU", n) and "host" not in n.lower()}
    by_name, intervals = collections.defaultdict(lambda: [0, 0.0]), []
    for e in events:
        if e.get("ph") != "X" or e["pid"] not in dev:
            continue
        if not re.search(r"stream", tname.get((e["pid"], e.get("tid")), ""), re.I):
            continue  # per-stream rows only
        dur = float(e.get("dur", 0))
        by_name[e.get("name", "")][0] += 1
        by_name[e.get("name", "")][1] += dur
        intervals.append((float(e["ts"]), float(e["ts"]) + dur))
    if not intervals:
        return {"error": "no device events in the trace"}
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return dict(steps=steps, busy_ms_per_step=union_length(intervals) / 1e3 / steps,
                launches_per_step=sum(v[0] for v in by_name.values()) / steps,
                top=[[n[:80], v[0] / steps, round(v[1] / 1e3 / steps, 4)] for n, v in ranked[:top]],
                events=[[n[:80], v[0] / steps, round(v[1] / 1e3 / steps, 4)] for n, v in ranked[:300]])


def step_bytes(config, batch: int) -> dict:
    """Bytes of weights a plain decode step must read, at 2 bytes per parameter (the few float32-only ones are
    counted as bf16): every non-routed backbone weight, the routed experts ``batch`` tokens are expected to touch
    under uniform top-k routing (a fraction 1 - (1 - k / E) ** batch of them) and the head (the embedding is a
    lookup: one row per token)."""
    c = config
    layers = per_layer_params(c)
    routed = sum(layer["routed experts"][0] for layer in layers)
    other = sum(n for layer in layers for comp, (n, _) in layer.items() if comp != "routed experts")
    touched = expected_distinct_experts(c.n_routed_experts, c.num_experts_per_tok, batch) / c.n_routed_experts
    head = c.vocab_size * c.hidden_size
    return dict(routed=2 * routed, other=2 * other, head=2 * head, touched_fraction=touched,
                total=2 * (other + touched * routed + head))


def inference_params(train_params: dict, config) -> dict:
    """bf16 copies of float32 masters, the float32-only parameters kept in float32 (what the loaders give)."""
    fp32 = {p for p, s in flat_specs(config, include_dspark=True) if s.dtype == "float32"}

    def cast(path, x):
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        return x if name in fp32 else x.astype(jnp.bfloat16)

    return jax.tree_util.tree_map_with_path(cast, train_params)


def train_loop(step_fn, state, loader, tc: TrainConfig, seconds: float, max_steps: int, log, metrics_path: str,
               say, first_batch=None) -> tuple[dict, dict]:
    """Steps until ``seconds`` after the first (compiling) step, the LR schedule fitted to the step count that
    fits, at most ``max_steps``; ``first_batch``: the first step's batch (already drawn from ``loader``). The count
    is estimated over steps 2-6 and estimated again at every logged step from the steps since the last one (the
    warm-ups' compiles and runs share the device at first: on an H200 they made steps 2-6 take 407 ms against
    ~145 ms later, and the target trained 20 of its 50 s), the cosine schedule following the new count. Returns
    (state, record)."""
    t0 = time.perf_counter()
    total = max_steps
    step, t_first, t_probe, probe_step, last = 0, None, None, 0, {}
    history = []
    with open(metrics_path, "w") as f:
        while step < total:
            batch = first_batch if (step == 0 and first_batch is not None) else next(loader)
            state, m = step_fn(state, batch, lr_at(step, tc, total))
            step += 1
            if step == 1:
                jax.block_until_ready(state["step"])
                t_first = time.perf_counter() - t0
                say(f"  first step (compile included) {t_first:.1f} s")
            if step == 2:
                jax.block_until_ready(state["step"])
                t_probe = time.perf_counter()
            if step == 6 and total > 6:
                jax.block_until_ready(state["step"])
                per = (time.perf_counter() - t_probe) / 4
                total = max(7, min(max_steps, 6 + int((seconds - (time.perf_counter() - t0 - t_first)) / per)))
                say(f"  {per * 1e3:.0f} ms / step: {total} steps fit")
                t_probe, probe_step = time.perf_counter(), step
            if step % log == 0 or step == total:
                last = {k: float(v) for k, v in jax.device_get(m).items()}  # (waits for the step)
                now = time.perf_counter()
                if t_probe is not None and step > 6 and step < total and step - probe_step >= log:
                    per = (now - t_probe) / (step - probe_step)
                    fit = max(step + 1, min(max_steps, step + int((seconds - (now - t0 - t_first)) / per)))
                    if fit != total:
                        say(f"  {per * 1e3:.0f} ms / step now: {fit} steps fit (was {total})")
                        total = fit
                    t_probe, probe_step = now, step
                row = dict(step=step, elapsed_s=now - t0, **last)
                history.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                say("  " + " ".join(f"{k} {v:.4g}" for k, v in row.items() if k in (
                    "step", "loss", "ce", "top1", "accept_rate", "elapsed_s")))
    jax.block_until_ready(state["step"])
    wall = time.perf_counter() - t0
    rec = dict(steps=step, compile_first_step_s=t_first, train_s=wall - t_first, tokens=step * tc.seq_len *
               tc.batch_size, final=last, train_config=tc.to_dict())
    return state, rec


def stack_watchdog(every_s: float, file, t0: float) -> threading.Event:
    """Every ``every_s`` seconds write every thread's Python stack to ``file`` (where a slow compile sits), from a
    daemon thread that holds the GIL while it reads them (``sys._current_frames``). Not
    ``faulthandler.dump_traceback_later``: its watchdog walks the other threads' frames without the GIL while they
    run, and on an H200 (call 9a, benchmarks/RESULTS.md) the process died of a segmentation fault in the middle of
    such a dump, the dump cut at a frame it could not read. Returns the event that stops it."""
    import traceback

    stop = threading.Event()

    def loop():
        while not stop.wait(every_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            frames = sys._current_frames()
            parts = [f"--- stacks at {time.perf_counter() - t0:.0f} s ---"]
            for ident, frame in frames.items():
                parts.append(f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
            file.write("\n".join(parts) + "\n")
            file.flush()

    threading.Thread(target=loop, name="stack-watchdog", daemon=True).start()
    return stop


def zero_params(config, device) -> dict:
    """Zeros with the inference parameters' dtypes (bf16; the float32-only ones float32), committed to ``device``:
    the stand-ins the decoding and drafter-training programs are compiled with while the target trains — same
    avals and placement as the trained parameters, so the programs compiled on them serve those."""
    return jax.tree.map(lambda s: jax.device_put(jnp.zeros(s.shape, s.dtype), device),
                        abstract_params(config, jnp.bfloat16, include_dspark=True))


def same_signature(a, b) -> bool:
    """Same pytree structure, shapes and dtypes (the programs compiled for ``a`` serve ``b``)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(la, lb)))


class Warmer(threading.Thread):
    """Runs ``fn`` (compiling programs on zero parameters) beside the main thread; keeps its error, if any."""

    def __init__(self, name: str, fn, say):
        super().__init__(name=name, daemon=True)
        self.fn, self.say, self.error, self.seconds = fn, say, None, None
        self.stop = threading.Event()  # asks a stoppable warm-up (the prefix table's widths) to end early

    def run(self):
        t0 = time.perf_counter()
        try:
            self.fn(self)
        except Exception as e:  # noqa: BLE001 - a failed warm-up only means the program compiles when first used
            self.error = f"{type(e).__name__}: {e}"
            self.say(f"  warm-up {self.name} FAILED: {self.error}")
        self.seconds = time.perf_counter() - t0
        self.say(f"  warm-up {self.name} done in {self.seconds:.1f} s")

    def wait(self, say) -> None:
        if self.is_alive():
            t0 = time.perf_counter()
            say(f"  waiting for warm-up {self.name}")
            self.join()
            say(f"  waited {time.perf_counter() - t0:.1f} s for warm-up {self.name}")


def target_rows(engine: Engine, corpus, width: int, seq: int, seconds: float, seed: int, say,
                temperature: float = 0.0) -> np.ndarray:
    """Rows of ``seq`` tokens = a ``width``-token stretch of the training corpus (BOS first, like the prompts)
    + the target's continuation, greedy or sampled at ``temperature``: what the drafter must predict at
    inference. Batches of the engine's size until ``seconds`` have passed (at least one)."""
    rng = np.random.default_rng(seed)
    b, new = engine.max_batch, seq - width
    rows, t0 = [], time.perf_counter()
    toks = corpus.tokens
    bos = engine.tokenizer.bos_id
    while not rows or time.perf_counter() - t0 < seconds:
        starts = rng.integers(0, len(toks) - width, b)
        prompts = [[bos] + [int(t) for t in toks[s:s + width - 1]] for s in starts]
        res = engine.generate(prompts, max_new_tokens=new, stop_tokens=(), temperature=temperature,
                              seed=int(rng.integers(0, 2 ** 31)))
        for p, r in zip(prompts, res):
            row = (p + list(r.tokens))[:seq]
            rows.append(row + [0] * (seq - len(row)))
        say(f"  {len(rows)} target rows ({time.perf_counter() - t0:.1f} s; "
            f"{engine.last_stats.decode_s * 1e3 / new:.2f} "
            f"ms / step at batch {b})")
    return np.asarray(rows, np.int32)


class MixedLoader:
    """The corpus loader's batches with their first ``k`` rows replaced by target rows drawn at random (same keys
    and dtypes, so the training program is the same)."""

    def __init__(self, loader, rows: np.ndarray | None, k: int, seed: int):
        self.loader, self.rows, self.k = loader, rows, k if rows is not None else 0
        self.rng = np.random.default_rng(seed)

    def __next__(self) -> dict:
        batch = dict(next(self.loader))
        if self.k:
            pick = self.rows[self.rng.integers(0, len(self.rows), self.k)]
            for key in ("tokens", "targets", "loss_mask", "valid"):
                batch[key] = np.array(batch[key])
            batch["tokens"][:self.k] = pick
            batch["targets"][:self.k, :-1] = pick[:, 1:]
            batch["loss_mask"][:self.k] = 1
            batch["valid"][:self.k] = True
        return batch

    def close(self):
        self.loader.close()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="toy sizes, for a CPU rehearsal")
    ap.add_argument("--target-s", type=float, default=None, help="seconds of target training after compiling")
    ap.add_argument("--gen-s", type=float, default=None, help="seconds of target generation (batch = the largest "
                    "of --batches) for the drafter's training rows; 0: train on the corpus alone")
    ap.add_argument("--gen-temperature", default="0", help="the target's generations for the drafter: greedy (0) "
                    "or sampled at this temperature; several (e.g. 0,1.0): one drafter per temperature, each trained "
                    "on its own rows (--gen-s and --drafter-s each), and each decoding row uses the drafter of its "
                    "own mode (the nearest temperature; a '#T' suffix on a row picks one, e.g. none#1.0)")
    ap.add_argument("--gen-rows", type=float, default=0.5, help="fraction of each drafter batch's rows taken from "
                    "the target's generations")
    ap.add_argument("--drafter-s", type=float, default=None, help="seconds of drafter training after compiling "
                    "(cut so that --decode-reserve-s stay for decoding)")
    ap.add_argument("--decode-reserve-s", type=float, default=None, help="seconds kept for the decoding phase")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prefix-batches", default="1", help="batches that also run the prefix scheduler (its "
                    "step-time table needs one program per chunk width)")
    ap.add_argument("--variants", default="plain,none", help="decode rows, in this order per batch: plain (always), "
                    "none (DSpark, device loop), host (DSpark, host loop), threshold (confidence threshold 0.5, "
                    "device loop), prefix (prefix scheduler over a measured step-time table, --prefix-batches, host "
                    "loop). none / threshold take ':N' to verify only the first N drafts, threshold '@X' its threshold (e.g. none:5 with "
                    "--block-size 7); plain~T / none~T sample at temperature T (plain sampling and speculative "
                    "sampling, seed = the prompt's index). Each kind of row compiles its own programs: host the host "
                    "loop's step (also "
                    "timed alone at full width), prefix one step program per chunk width")
    ap.add_argument("--sample-batches", default="1", help="batches that run the sampled rows (~T) of --variants")
    ap.add_argument("--block-size", type=int, default=5, help="the drafter's block size (drafts per step, γ)")
    ap.add_argument("--target-experts", type=int, default=None, help="the target's routed experts (default 16; "
                    "--smoke: the default model's 8)")
    ap.add_argument("--target-topk", type=int, default=None, help="the target's routed experts per token (default 6; "
                    "--smoke: 2)")
    ap.add_argument("--drafter-experts", type=int, default=None, help="the drafter's routed experts, top-1 "
                    "(default 8; --smoke: 4)")
    ap.add_argument("--markov-rank", type=int, default=None, help="the drafter's Markov bias rank (default 64; "
                    "--smoke 16)")
    ap.add_argument("--ce-weight", type=float, default=None, help="the drafter loss's weight on cross-entropy "
                    "against the target's greedy tokens (default DSparkTrainOptions': 0.1, beside 0.9 on the "
                    "total variation to the target's distribution); 0 = distillation on the distribution alone")
    ap.add_argument("--threshold", type=float, default=0.5, help="the threshold rows' survival threshold (> 1: "
                    "every step verifies the pending token alone, in the full-width chunk)")
    ap.add_argument("--trace-batches", default="", help="batches whose rows also run once under jax.profiler.trace: "
                    "device busy ms per step and the kernels taking it (JSON: trace)")
    ap.add_argument("--trace-variants", default="plain,none", help="the row kinds --trace-batches traces")
    ap.add_argument("--triton-verify-batches", default="1", help="batches that run the rows with a '%%tg' suffix: "
                    "speculation whose programs (verification, drafting, device loop) use XLA's Triton GEMMs, on an "
                    "engine of their own (InferenceOptions.verification_compiler_options)")
    ap.add_argument("--cublas-verify-batches", default="", help="batches whose speculative engine keeps cuBLAS GEMMs "
                    "in its speculative programs (InferenceOptions.verification_compiler_options=()); elsewhere they "
                    "take the engine's default, XLA's Triton GEMMs on the GPU (no autotuning of the wide verification "
                    "GEMMs beside the training)")
    ap.add_argument("--anchors", type=int, default=None, help="drafter training: block starts drawn per row and step "
                    "(default 32; --smoke 8). The target's forward over the rows is the step's fixed part: more anchors "
                    "per row give more draft slots to learn from per second")
    ap.add_argument("--eval-batches", type=int, default=None, help="after each drafter's training: this many batches "
                    "of held-out asyncio rows (corpus text, never trained on) through the drafter's train step at "
                    "learning rate 0 — teacher-forced acceptance per draft slot on held-out text (default 4)")
    ap.add_argument("--early-warm", default="all", help="the warm-ups started beside the target train step's compile "
                    "(names as logged: plain-b1, spec-b1, spec-triton-b1, plain-b16, spec-b16, drafter-train, "
                    "prefix-b1; 'all' = every one); the others start when the target's training starts. Fewer beside the "
                    "compile: it ends sooner (call 13: 113 s beside six); the later ones compile during the training")
    ap.add_argument("--triton-gemm", action="store_true", help="keep XLA's Triton GEMMs (and their autotuning; the "
                    "default turns them off: cuBLAS GEMMs, see the top of this file)")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts run one by one at batch 1 "
                    "(default 12; --smoke 3)")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=None, help="skip what is left after this many seconds")
    ap.add_argument("--no-train", action="store_true", help="random weights instead of training (the decoding "
                    "programs' compile times and the steps' costs in a short run; acceptance means nothing)")
    ap.add_argument("--no-warm", action="store_true", help="compile the decoding programs when first used instead "
                    "of beside the target's training")
    ap.add_argument("--watchdog-s", type=float, default=None, help="write every thread's stack to DIR/stacks.txt "
                    "every this many seconds (where a slow compile sits); 0 = off (default: 60 on an accelerator, "
                    "off on the CPU)")
    ap.add_argument("--log-compiles", action="store_true", help="log every compilation (jax_log_compiles)")
    ap.add_argument("--drafter-init", default="random", help="the drafters' starting values, comma-separated "
                    f"({' / '.join(DRAFTER_INITS)}; DSparkTrainOptions.drafter_init): several train one drafter per "
                    "initialisation and generation temperature on the same rows and seconds each (an A/B); a row "
                    f"decodes with the first unless its '{INIT_SUFFIX}INIT' suffix picks another, e.g. none^target")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    inits = [x for x in args.drafter_init.split(",") if x]
    if not inits or any(x not in DRAFTER_INITS for x in inits) or len(set(inits)) != len(inits):
        ap.error(f"--drafter-init: distinct values of {', '.join(DRAFTER_INITS)}, comma-separated; got "
                 f"{args.drafter_init!r}")
    variants = [v for v in args.variants.split(",") if v]
    bad = []
    for v in variants:
        try:
            parse_variant(v)
        except ValueError as e:
            bad.append(str(e))
    if bad:
        ap.error("--variants: " + "; ".join(bad))
    if args.ce_weight is not None and args.ce_weight < 0:
        ap.error(f"--ce-weight must be >= 0, got {args.ce_weight}")
    try:
        gen_temps = [float(t) for t in args.gen_temperature.split(",") if t.strip()]
    except ValueError:
        gen_temps = []
    if not gen_temps or any(not t >= 0 for t in gen_temps) or len(set(gen_temps)) != len(gen_temps):
        ap.error(f"--gen-temperature: distinct temperatures >= 0, comma-separated; got {args.gen_temperature!r}")
    if args.anchors is not None and args.anchors < 1:
        ap.error(f"--anchors must be >= 1, got {args.anchors}")
    if args.markov_rank is not None and args.markov_rank < 1:
        ap.error(f"--markov-rank must be >= 1, got {args.markov_rank}")
    for v in variants:
        try:
            drafter_of(v, gen_temps)
            init_of(v, inits)
        except ValueError as e:
            bad.append(str(e))
        if uses_triton_verify(v) and parse_variant(v)[0] not in ("none", "threshold"):
            bad.append(f"{v!r}: '{TRITON_VERIFY}' (Triton GEMMs in the speculative programs) only goes with none / "
                       "threshold")
    if bad:
        ap.error("--variants: " + "; ".join(bad))
    if "plain" not in variants:
        variants.insert(0, "plain")  # every speculative row is a ratio against it
    for v in list(variants):  # and every sampled row against plain sampling at its temperature
        if variant_temperature(v)[1] > 0 and plain_of(v) not in variants:
            variants.insert(variants.index(v), plain_of(v))
    host_step = "host" in variants  # the host loop's step program is needed
    t_start = time.perf_counter()
    smoke = args.smoke
    budget = args.budget_s or (1e9 if smoke else 400)
    target_s = args.target_s if args.target_s is not None else (0.0 if smoke else 90.0)
    gen_s = args.gen_s if args.gen_s is not None else (0.0 if smoke else 15.0)
    drafter_s = args.drafter_s if args.drafter_s is not None else (0.0 if smoke else 100.0)
    reserve = args.decode_reserve_s if args.decode_reserve_s is not None else (0.0 if smoke else 50.0)
    new = args.new_tokens or (12 if smoke else 128)
    reps = args.reps if args.reps is not None else (1 if smoke else 2)
    n_prompts = args.prompts or (3 if smoke else 12)
    out = args.out or "."
    os.makedirs(out, exist_ok=True)
    cpu = jax.default_backend() == "cpu"
    device = jax.devices()[0]
    lock = threading.Lock()

    def say(msg):
        with lock:
            print(f"[{time.perf_counter() - t_start:6.1f}s] {msg} (compiling so far {compile_seconds():.0f} s)",
                  file=sys.stderr, flush=True)

    def left():
        return budget - (time.perf_counter() - t_start)

    if args.log_compiles:
        jax.config.update("jax_log_compiles", True)
    compiles = []  # (program, seconds, thread, ended at s): every XLA compile of the process

    def on_compile(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            with lock:
                compiles.append(dict(program=str(kw.get("fun_name", "?")), seconds=round(duration, 2),
                                     thread=threading.current_thread().name,
                                     ended_at_s=round(time.perf_counter() - t_start, 1)))

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    watchdog = args.watchdog_s if args.watchdog_s is not None else (0 if cpu else 60)
    stop_watch = None
    if watchdog:
        import faulthandler

        stacks = open(os.path.join(out, "stacks.txt"), "w")
        faulthandler.enable(file=stacks)  # a real crash writes its thread's stack here
        stop_watch = stack_watchdog(watchdog, stacks, t_start)

    config = target_config(smoke, args.block_size, args.target_experts, args.target_topk, args.drafter_experts,
                           args.markov_rank)
    counts = count_params(config)
    record = dict(config=config.name, device=jax.devices()[0].device_kind, jax=jax.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv),
                  params=dict(backbone=counts.backbone, dspark=counts.dspark, active_decode=counts.active_decode),
                  moe=dict(target_experts=config.n_routed_experts, target_topk=config.num_experts_per_tok,
                           drafter_experts=config.dspark_n_routed_experts,
                           drafter_topk=config.dspark_num_experts_per_tok,
                           markov_rank=config.dspark_markov_rank),
                  xla_flags=os.environ.get("XLA_FLAGS", ""), variants=variants, stages={}, rows=[],
                  compiles=compiles)

    def save():
        with lock:
            with open(os.path.join(out, "bench_dspark_h200.json"), "w") as f:
                json.dump(record, f, indent=1)

    def stage(name, **kw):
        record["stages"][name] = dict(at_s=time.perf_counter() - t_start, compile_s_total=compile_seconds(), **kw)
        save()

    # ---- data -----------------------------------------------------------------------------------------------
    tok = ByteTokenizer(model_vocab_size=config.vocab_size)
    stdlib = sysconfig.get_paths()["stdlib"]
    corpus = load_corpus([stdlib], tok, glob="*.py", exclude=EXCLUDE, model_vocab_size=config.vocab_size,
                         max_docs=40 if smoke else None)
    record["data"] = dict(stdlib=stdlib, tokens=int(len(corpus.tokens)), docs=int(corpus.n_docs), exclude=EXCLUDE)
    say(f"data: {corpus.n_docs} files of {stdlib}, {len(corpus.tokens):,} byte tokens")
    seq, bs = (128, 4) if smoke else (512, 8)
    tc = TrainConfig(seq_len=seq, batch_size=bs, steps=2000, lr=5e-4, warmup_steps=4 if smoke else 30,
                     min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0, compute_dtype="float32" if cpu else "bfloat16",
                     quant_sim=False)
    tcd = tc.replace(lr=1e-3, seed=1)
    opts_d = DSparkTrainOptions(anchors=args.anchors or (8 if smoke else 32), labels="target",
                                **({} if args.ce_weight is None else dict(ce_weight=args.ce_weight)))

    # ---- decoding setup: engines on zero parameters, their programs compiled beside the target's training ----
    # ced=False: the drafter's target layers include encoder layers (1, 2), which CED prefill runs before the
    # replay segment is known; prefill is outside the timed decode loop
    opts = InferenceOptions(ced=False, **(dict(compiler_options=FAST_COMPILE) if cpu else {}))
    gamma = config.dspark_block_size
    prompt_len = 96
    batches = [int(x) for x in args.batches.split(",")]
    prefix_batches = {int(x) for x in args.prefix_batches.split(",") if x} if "prefix" in variants else set()
    sample_batches = {int(x) for x in args.sample_batches.split(",") if x}
    gen_batch = max(batches)
    max_len = max(2 * prompt_len + new + 16, seq)  # seq: the target's generations for the drafter's rows
    zeros = zero_params(config, device)
    prompts = {b: heldout_prompts(b, prompt_len, tok) for b in batches}
    cublas_batches = {int(x) for x in args.cublas_verify_batches.split(",") if x}
    opts_cublas = dataclasses.replace(opts, verification_compiler_options=())
    engines = {(b, role): Engine(config, zeros, max_batch=b, max_len=max_len,
                                 options=opts_cublas if (role == "spec" and b in cublas_batches) else opts,
                                 tokenizer=tok)
               for b in batches for role in ("plain", "spec")}
    tg_batches = {int(x) for x in args.triton_verify_batches.split(",") if x}
    opts_tg = dataclasses.replace(opts, verification_compiler_options=(("xla_gpu_enable_triton_gemm", True),))
    engines.update({(b, "spec_tg"): Engine(config, zeros, max_batch=b, max_len=max_len, options=opts_tg,
                                           tokenizer=tok)
                    for b in batches if b in tg_batches and any(uses_triton_verify(v) for v in variants)})
    if not args.no_warm:  # an engine of its own for the prefix table's warm-up (programs are shared by shape)
        engines.update({(b, "prefix"): Engine(config, zeros, max_batch=b, max_len=max_len, options=opts,
                                              tokenizer=tok) for b in prefix_batches if b in batches})
    warmers = {}

    def decoder_kwargs(variant):
        """SpeculativeDecoder arguments of a speculative row (the prefix row's are set when its table is measured)."""
        kind, n, thr = parse_variant(variant)
        kw = dict(num_draft=n) if n else {}
        if kind == "threshold":
            kw.update(schedule="threshold", threshold=args.threshold if thr is None else thr)
        elif kind == "host":  # the same speculation with one read-back per step
            kw.update(chain_every=0)
        return kw

    def batch_variants(b):
        """The rows batch ``b`` runs: the sampled ones (~T) only at --sample-batches, the Triton ones (%tg) only at
        --triton-verify-batches."""
        return [v for v in variants if (variant_temperature(v)[1] == 0 or b in sample_batches)
                and (not uses_triton_verify(v) or b in tg_batches)]

    def warm_plain(b):
        def fn(w):
            engines[b, "plain"].generate(prompts[b], max_new_tokens=3, stop_tokens=())
            # the sampler's programs (one for every temperature > 0): sampled rows, sampled generations
            if any(variant_temperature(v)[1] > 0 for v in batch_variants(b)) or (
                    b == gen_batch and max(gen_temps) > 0):
                engines[b, "plain"].generate(prompts[b], max_new_tokens=3, stop_tokens=(), temperature=1.0)
        return fn

    def spec_role(v):
        return "spec_tg" if uses_triton_verify(v) else "spec"

    def warm_spec(b, role="spec"):
        def fn(w):
            kinds = {(json.dumps(decoder_kwargs(v), sort_keys=True), variant_temperature(v)[1] > 0): v
                     for v in batch_variants(b) if parse_variant(v)[0] in ("none", "threshold", "host")
                     and spec_role(v) == role}
            for (_, sampled), v in kinds.items():  # device loop (schedule off / threshold, each width); host loop
                dec = SpeculativeDecoder(engines[b, role], **decoder_kwargs(v))
                # one run builds every program of the row (fresh rings are committed like those a step returns)
                dec.generate(prompts[b], max_new_tokens=2 * gamma + 2, stop_tokens=(),
                             temperature=1.0 if sampled else 0.0)
        return fn

    def warm_prefix(b):
        def fn(w):  # the step-time table's narrower programs, after the full-width ones (one compile at a time)
            for other in batches:
                warmers[other, "spec"].join()
            dec = SpeculativeDecoder(engines[b, "prefix"])
            for width in range(1, gamma + 2):
                if w.stop.is_set():
                    break
                dec.measure_step_times(widths=(width,), reps=1)  # fresh rings, then returned ones
        return fn

    zero_dstep = None
    if not args.no_warm:
        for b in batches:
            warmers[b, "plain"] = Warmer(f"plain-b{b}", warm_plain(b), say)
            warmers[b, "spec"] = Warmer(f"spec-b{b}", warm_spec(b), say)
            if (b, "spec_tg") in engines:
                warmers[b, "spec_tg"] = Warmer(f"spec-triton-b{b}", warm_spec(b, "spec_tg"), say)
        for b in batches:
            if b in prefix_batches:
                warmers[b, "prefix"] = Warmer(f"prefix-b{b}", warm_prefix(b), say)
    if not args.no_warm and not args.no_train:
        zero_dstep = DSparkTrainStep(config, tcd, {k: v for k, v in zeros.items() if k != "dspark"}, opts_d)
        probe = DataLoader(Dataset(corpus, seq_len=seq, batch_size=bs, packing="concat", seed=7))
        probe_batch = next(probe)
        probe.close()

        def warm_drafter(w):
            st = zero_dstep.init_state()
            for _ in range(2):  # the first step's state (fresh) and the later steps' (a step's output)
                st, m = zero_dstep(st, probe_batch, 1e-3)
            jax.block_until_ready(m)
            del st, m
            zero_dstep.target = zero_dstep._target_as_given = None  # keep the program, not the zeros
        warmers["drafter"] = Warmer("drafter-train", warm_drafter, say)
    # the target's train step: traced and lowered alone (Python, under the GIL: in call 7 beside five warm-up
    # threads tracing their programs it took 61 s instead of ~20), then compiled by XLA (outside the GIL) while the
    # warm-ups trace and compile theirs
    target_job = None
    if not args.no_train:
        t0 = time.perf_counter()
        step_fn = make_train_step(config, tc)
        state = step_fn.init_state()
        loader = DataLoader(Dataset(corpus, seq_len=seq, batch_size=bs, packing="concat", seed=0))
        first_batch = next(loader)
        lowered = step_fn.lower(state, first_batch, 0.0)
        target_job = dict(step_fn=step_fn, state=state, loader=loader, first_batch=first_batch,
                          lower_s=time.perf_counter() - t0)
        say(f"target train step traced + lowered alone in {target_job['lower_s']:.1f} s")
    early = set(args.early_warm.split(",")) if args.early_warm != "all" else {w.name for w in warmers.values()}
    late = [w for w in warmers.values() if w.name not in early]
    if warmers:
        for w in warmers.values():
            if w.name in early:
                w.start()
        say(f"warm-ups started: {', '.join(w.name for w in warmers.values() if w.name in early) or 'none'}"
            + (f"; at the training's start: {', '.join(w.name for w in late)}" if late else ""))
    if target_job is not None:
        t0 = time.perf_counter()
        compiled = lowered.compile()
        del lowered
        target_job["compile_s"] = time.perf_counter() - t0
        target_job["compiled"] = compiled
        say(f"target train step compiled in {target_job['compile_s']:.1f} s (beside the warm-ups started)")
    for w in late:  # they compile (CPU) while the target trains (device)
        w.start()
    if late:
        say(f"warm-ups started: {', '.join(w.name for w in late)}")

    drafter_params = {}  # (generation temperature of its rows, its initialisation) -> the parameters with it
    if args.no_train:  # random weights: the programs' compile times and the steps' costs, no acceptance to speak of
        from dsv41_jax.model.params import init_from_specs, param_specs

        say("random weights (--no-train): no target / drafter training, no generations")
        params = jax.device_put(inference_params(init_from_specs(param_specs(config, include_dspark=True),
                                                                 jax.random.PRNGKey(0)), config), device)
        if not same_signature(params, zeros):
            say("WARNING: the random parameters' signature differs from the warm-up's: programs compile again")
        for e in engines.values():
            e.params = params
        drafter_params.update({(t, x): params for t in gen_temps for x in inits})
        record["weights"] = "random (std 0.02), untrained"
        del zeros
    else:
        # ---- 1. the target ----------------------------------------------------------------------------------------
        say(f"target {config.name}: {counts.backbone / 1e9:.3f} B backbone parameters, "
            f"{counts.active_decode / 1e9:.3f} B "
            f"active per decoded token; training")
        compiled, state, loader = target_job["compiled"], target_job["state"], target_job["loader"]

        def target_step(st, batch, lr):
            return compiled(st, batch, np.float32(lr))
        state, rec = train_loop(target_step, state, loader, tc, target_s, 8 if smoke else 5000,
                                2 if smoke else 25, os.path.join(out, "train_target.jsonl"), say,
                                first_batch=target_job["first_batch"])
        loader.close()
        rec.update(lower_s=target_job["lower_s"], compile_s=target_job["compile_s"])
        record["target_training"] = rec
        step_fn = target_job = compiled = None
        target_params = state["params"]
        del state, step_fn
        stage("target_trained")

        # the trained target in the engines (the drafter still zeros: plain decoding does not read it)
        params = jax.device_put(inference_params({**target_params, "dspark": zeros["dspark"]}, config), device)
        if not same_signature(params, zeros):
            say("WARNING: the trained parameters' signature differs from the warm-up's: programs compile again")
        for e in engines.values():
            e.params = params

        # ---- 2. target generations, the drafter(s) against the frozen target -------------------------------------
        # one drafter per --gen-temperature, each on its own rows (the target's continuations in one decoding mode)
        # beside corpus rows; every drafter starts from the same initialisation and sees the same corpus rows, so
        # they differ only in the mode of the target's text they learned
        rows_of = {t: None for t in gen_temps}
        if gen_s > 0:
            if (gen_batch, "plain") in warmers:
                warmers[gen_batch, "plain"].wait(say)
            width = max(len(p) for p in prompts[gen_batch])  # the prompts' width: the prefill program already built
            record["generations"] = []
            for t in gen_temps:
                say(f"target generations for the drafter: batch {gen_batch}, {width}-token corpus stretches + "
                    f"{seq - width} tokens at temperature {t:g}, {gen_s:.0f} s")
                rows = target_rows(engines[gen_batch, "plain"], corpus, width, seq, gen_s, seed=3, say=say,
                                   temperature=t)
                rows_of[t] = rows
                np.save(os.path.join(out, f"target_rows_T{t:g}.npy"), rows)
                sample = tok.decode(rows[0, width:].tolist())
                record["generations"].append(dict(rows=int(len(rows)), prompt_width=width, seq=seq,
                                                  sample=sample[:400], temperature=t,
                                                  text=text_stats(rows[:, width:].reshape(-1)[:4096])))
                say(f"  sample continuation: {sample[:200]!r}")
            stage("generated")
        say(f"drafter: {counts.dspark / 1e9:.3f} B parameters ({config.num_nextn_predict_layers} block); "
            f"{len(gen_temps) * len(inits)} to train")
        dstep = DSparkTrainStep(config, tcd, target_params, opts_d)
        del target_params
        dstep.target = jax.device_put(dstep.target, device)  # committed, like the warm-up's zeros
        if "drafter" in warmers:
            warmers["drafter"].wait(say)
            if warmers["drafter"].error is None:
                dstep._jitted = zero_dstep._jitted  # the program compiled on zeros (the target is an argument)
        # the target's inference parameters once; each drafter's own subtree beside them
        base_params = jax.device_put(inference_params({**dstep.target, "dspark": zeros["dspark"]}, config), device)
        record["drafters"] = []
        n_eval = args.eval_batches if args.eval_batches is not None else 4
        heldout = load_corpus([os.path.join(stdlib, "asyncio")], tok, glob="*.py", exclude="test,tests,__pycache__",
                              model_vocab_size=config.vocab_size) if n_eval else None
        drafters = [(t, x) for t in gen_temps for x in inits]
        for i, (t, init) in enumerate(drafters):
            # the same seed for every drafter: a target-initialised one keeps the random one's Markov and
            # confidence heads (drafter_from_target); the step's program does not depend on the initialisation
            opts_i = dataclasses.replace(opts_d, drafter_init=init)
            dstep.options = opts_i
            dstate = dstep.init_state()
            rows = rows_of[t]
            k = int(round(args.gen_rows * bs)) if rows is not None else 0
            loader = MixedLoader(DataLoader(Dataset(corpus, seq_len=seq, batch_size=bs, packing="concat", seed=1)),
                                 rows, k, seed=4)
            # the time left before the decoding reserve, shared by the drafters still to train
            d_seconds = (max(5.0, min(drafter_s, (left() - reserve) / (len(drafters) - i))) if not smoke
                         else drafter_s)
            say(f"  drafter {i} (rows generated at T {t:g}, init {init}): {k} of {bs} rows per batch from the "
                f"target's generations; {d_seconds:.0f} s")
            name = ("train_drafter" + ("" if len(gen_temps) == 1 else f"_T{t:g}")
                    + ("" if len(inits) == 1 else f"_{init}") + ".jsonl")
            dstate, rec = train_loop(dstep, dstate, loader, tcd, d_seconds, 6 if smoke else 10000,
                                     2 if smoke else 25, os.path.join(out, name), say)
            loader.close()
            record["drafters"].append(dict(rec, options=opts_i.to_dict(), target_rows_per_batch=k,
                                           gen_temperature=t, drafter_init=init))
            # copies: the float32-only leaves would otherwise be the state's own buffers, which the held-out
            # evaluation's steps donate (on an H200 that deleted them: every speculative row failed, and plain
            # decoding, whose programs take the whole parameter tree, left jit's fast path for a 2.8x slower step)
            dparams = jax.tree.map(lambda x: jnp.array(x, copy=True), jax.device_put(
                inference_params({"dspark": dstate["params"]["dspark"]}, config)["dspark"], device))
            drafter_params[t, init] = {**base_params, "dspark": dparams}
            if n_eval:  # learning rate 0: the same compiled step, no update — metrics on rows it never saw
                ev = DataLoader(Dataset(heldout, seq_len=seq, batch_size=bs, packing="concat", seed=11))
                ms = []
                for _ in range(n_eval):
                    dstate, m = dstep(dstate, next(ev), 0.0)
                    ms.append({k: float(v) for k, v in jax.device_get(m).items()})
                ev.close()
                keys = ["accept_rate", "top1"] + [f"{n}_{k}" for n in ("accept", "top1") for k in range(gamma)]
                held = {k: statistics.mean(m[k] for m in ms) for k in keys if k in ms[0]}
                record["drafters"][-1]["heldout"] = dict(rows=n_eval * bs, seq=seq, source="asyncio", **held)
                say(f"  drafter {i} on held-out asyncio rows ({n_eval * bs} x {seq}, teacher-forced): accept "
                    + " ".join(f"{held.get(f'accept_{k}', float('nan')):.3f}" for k in range(gamma))
                    + " | top-1 " + " ".join(f"{held.get(f'top1_{k}', float('nan')):.3f}" for k in range(gamma)))
            del dstate
        record["drafter_training"] = record["drafters"][0]
        del dstep, base_params
        for e in engines.values():
            e.params = drafter_params[gen_temps[0], inits[0]]
        del zeros
        stage("drafter_trained")

    # ---- 3. decoding ----------------------------------------------------------------------------------------
    if cpu:
        bw = None
    else:
        from benchmarks.ceilings import read_bandwidth

        bw = read_bandwidth(2.0)
    record["read_bandwidth_bytes_per_s"] = bw
    def timed(fn, steps_of):
        times, res, steps = [], None, None
        for i in range(reps + 1):  # the first run compiles what the warm-up did not
            t0, c0 = time.perf_counter(), compile_seconds()
            res, dt = fn()
            times.append(dt)
            steps = steps_of()
            say(f"  run {i}: {time.perf_counter() - t0:.2f} s wall ({compile_seconds() - c0:.1f} s compiling), "
                f"decode loop {dt * 1e3:.1f} ms")
        return res, statistics.median(times[1:] if reps else times), steps

    plain_out = {}  # (batch, prompt set, temperature) -> plain decoding's tokens per row
    trace_batches = {int(x) for x in args.trace_batches.split(",") if x}
    trace_variants = set(args.trace_variants.split(","))

    def traced(b, variant, fn, steps_of) -> dict:
        """One more run under jax.profiler.trace (its prefill included): the kernel table of its steps."""
        if b not in trace_batches or variant not in trace_variants:
            return {}
        d = os.path.join("/tmp", "bench_dspark_traces", f"b{b}_{variant.replace(':', '_').replace('@', '_')}")
        with jax.profiler.trace(d):
            fn()
        t = kernel_table(d, steps_of())
        say(f"  trace: {json.dumps({k: v for k, v in t.items() if k != 'events'})[:1500]}")
        return {"trace": t}

    # prompt sets: at batch 1 each of --prompts held-out prompts alone (one generate call each: acceptance and
    # tokens/s per prompt, and over all of them); at batch b > 1 the b prompts together. Every set runs every row
    # kind in turn (plain first), so a run cut short keeps whole sets.
    eval_sets = {b: ([[p] for p in heldout_prompts(n_prompts, prompt_len, tok)] if b == 1 else [prompts[b]])
                 for b in batches}
    record["prompts"] = {str(b): [[tok.decode(p) for p in ps] for ps in sets] for b, sets in eval_sets.items()}
    runs = record.setdefault("runs", [])  # one entry per (batch, prompt set, row kind)
    decoders, step_tables = {}, {}

    def run_one(b, si, variant) -> dict:
        """Decode prompt set ``si`` of batch ``b`` with row kind ``variant``: the median decode time of ``reps``
        runs after a first one, the counts, the tokens and their check against plain decoding."""
        ps = eval_sets[b][si]
        first = si == 0
        base, temp = variant_temperature(variant)
        samp = dict(temperature=temp, seed=si)  # sampled rows: plain and speculative with the same seed
        if base == "plain":
            eng = engines[b, "plain"]

            def fn():
                res = eng.generate(ps, max_new_tokens=new, stop_tokens=(), **samp)
                return res, eng.last_stats.decode_s
            res, dt, _ = timed(fn, lambda: new - 1)
            toks = [r.tokens for r in res]
            plain_out[b, si, temp] = toks
            r = dict(steps=new - 1, rows_verified=len(ps) * (new - 1), emitted=len(ps) * (new - 1), drafted=0,
                     accepted=0, rollbacks=0, same=None, text=[text_stats(t) for t in toks],
                     **(traced(b, variant, fn, lambda: new - 1) if first else {}))
            if first:
                sample = tok.decode(res[0].tokens)
                record.setdefault("samples", {})[f"{b}{variant[5:]}"] = dict(prompt=tok.decode(ps[0]), plain=sample)
                say(f"  sample: {sample[:160]!r}")
        else:
            eng = engines[b, spec_role(variant)]
            eng.params = drafter_params[drafter_of(variant, gen_temps), init_of(variant, inits)]  # no new program
            kind, n_draft, thr = parse_variant(variant)
            if (b, variant) not in decoders:
                kw = dict(num_draft=n_draft) if n_draft else {}
                if kind == "threshold":
                    kw.update(schedule="threshold", threshold=args.threshold if thr is None else thr)
                elif kind == "host":  # the same speculation with one read-back per step
                    kw.update(chain_every=0)
                elif kind == "prefix":
                    kw.update(schedule="prefix", step_times=step_tables[b])
                decoders[b, variant] = SpeculativeDecoder(eng, **kw)
            dec = decoders[b, variant]

            def fn():
                res = dec.generate(ps, max_new_tokens=new, stop_tokens=(), **samp)
                return res, dec.stats.decode_s
            res, dt, _ = timed(fn, lambda: dec.stats.steps)
            st = dec.stats
            toks = [x.tokens for x in res]
            # sampled rows: other draws than plain sampling's (the same distribution), nothing to compare token
            # for token; their own text is judged as plain's is
            ref = plain_out.get((b, si, 0.0)) if temp == 0 else None
            diff = None if ref is None else [
                [s, next((j for j, (x, y) in enumerate(zip(t, ref[s])) if x != y), min(len(t), len(ref[s])))]
                for s, t in enumerate(toks) if t != ref[s]]
            r = dict(steps=st.steps, rows_verified=st.rows_verified, emitted=st.emitted, drafted=st.drafted,
                     accepted=st.accepted, rollbacks=st.rollbacks, device_steps=st.device_steps,
                     same=None if ref is None else not diff, differing_rows=diff,
                     **({"text": [text_stats(t) for t in toks]} if temp > 0 else {}))
            if first and temp > 0:
                say(f"  sample: {tok.decode(toks[0])[:160]!r}")
            if first:
                r.update(traced(b, variant, fn, lambda: dec.stats.steps))
                if kind == "none" and host_step and not n_draft:  # the host loop's step program alone at full width
                    t_round = dec.measure_step_times(widths=(gamma + 1,), reps=5)[gamma + 1]
                    r["round_ms_full_width"] = t_round * 1e3
                    say(f"  one speculative step program at width {gamma + 1}: {t_round * 1e3:.2f} ms")
        r.update(batch=b, set=si, variant=variant, tokens=len(ps) * new, decode_s=dt)
        return r

    def aggregate(b, variant, sets, label) -> dict | None:
        """One table row over the prompt sets ``sets`` of batch ``b``: tokens / total time, emitted / verified
        rows, the step time, every set's check against plain decoding."""
        rs = [r for r in runs if r["batch"] == b and r["variant"] == variant and r["set"] in sets and "error" not in r]
        ps = {r["set"]: r for r in runs if r["batch"] == b and r["variant"] == plain_of(variant) and "error" not in r}
        rs = [r for r in rs if r["set"] in ps]  # only sets with a plain row to compare with
        if not rs:
            return None
        dt = sum(r["decode_s"] for r in rs)
        plain_dt = sum(ps[r["set"]]["decode_s"] for r in rs)
        tokens = sum(r["tokens"] for r in rs)
        steps = sum(r["steps"] for r in rs)
        plain_steps = sum(ps[r["set"]]["steps"] for r in rs)
        tps, plain_tps = tokens / dt, tokens / plain_dt
        step_ms, plain_step = dt / steps * 1e3, plain_dt / plain_steps * 1e3
        acc = sum(r["emitted"] for r in rs) / sum(r["rows_verified"] for r in rs)
        kind, n_draft, thr = parse_variant(variant)
        temp = variant_temperature(variant)[1]
        if kind == "plain":
            floor_bytes, same = step_bytes(config, b)["total"], "—"
        else:  # a full-width verification reads the weights (b (γ + 1) tokens') and the drafter's block
            floor_bytes = step_bytes(config, b * ((n_draft or gamma) + 1))["total"] + 2 * counts.dspark
            bad = [r["set"] for r in rs if not r["same"]]
        if kind != "plain" and temp > 0:
            same = "— (sampled: the same distribution, other draws)"
        elif kind != "plain":
            same = "yes" if not bad else (f"NO (sets {bad})" if b == 1 else
                                          "NO (rows " + ", ".join(str(d[0]) for r in rs for d in r["differing_rows"])
                                          + ")")
        bw_frac = None if bw is None else floor_bytes / (step_ms / 1e3) / bw
        name = {"plain": "plain (device loop)", "none": "DSpark (device loop)", "host": "DSpark (host loop)",
                "threshold": f"DSpark + threshold {args.threshold if thr is None else thr:g} (device loop)",
                "prefix": "DSpark + prefix (measured, host loop)"}[kind] + ("" if kind == "plain" else
                                                                           f", γ {n_draft or gamma}")
        name += f", sampled T {temp:g}" if temp > 0 else ", greedy"
        if kind != "plain" and len(gen_temps) > 1:
            dt_ = drafter_of(variant, gen_temps)
            name += f", drafter of {'greedy' if dt_ == 0 else f'T-{dt_:g}'} rows"
        if kind != "plain" and len(inits) > 1:
            name += f", drafter init {init_of(variant, inits)}"
        gemms = None
        if kind != "plain" and not cpu:  # the GEMMs of the row's speculative programs
            from dsv41_jax.inference.decode import _decode_opts

            copts = dict(_decode_opts(engines[b, spec_role(variant)].options, verification=True).compiler_options)
            gemms = "Triton" if copts.get("xla_gpu_enable_triton_gemm") else (
                "cuBLAS" if "triton_gemm=false" in os.environ.get("XLA_FLAGS", "") else "XLA default")
            name += f", {gemms} GEMMs in its programs"
        texts = [t for r in rs for t in ps[r["set"]]["text"]]
        own = [t for r in rs for t in r.get("text", [])] if kind != "plain" and temp > 0 else []
        row = dict(batch=b, prompts=label, decoding=name, variant=variant, sets=len(rs), tokens=tokens, decode_s=dt,
                   tokens_per_s=tps, plain_tokens_per_s=plain_tps, speedup=tps / plain_tps, accepted_length=acc,
                   steps=steps, step_ms=step_ms, step_vs_plain=step_ms / plain_step,
                   rollbacks=sum(r["rollbacks"] for r in rs), drafted=sum(r["drafted"] for r in rs),
                   accepted=sum(r["accepted"] for r in rs), floor_bytes=floor_bytes,
                   floor_ms=None if bw is None else floor_bytes / bw * 1e3, read_bw_fraction=bw_frac,
                   datasheet_bw_fraction=floor_bytes / (step_ms / 1e3) / 4.8e12, same_tokens=same,
                   temperature=temp, verify_gemms=gemms, distinct_fraction=statistics.mean(t["distinct_fraction"] for t in texts),
                   own_distinct_fraction=statistics.mean(t["distinct_fraction"] for t in own) if own else None)
        record["rows"].append(row)
        save()
        sf = "—" if bw_frac is None else f"{100 * bw_frac:.0f} %"
        print(f"| {b} | {label} | {name} | {tps:,.1f} | {tps / plain_tps:.2f} | {acc:.2f} | "
              f"{row['drafted']} / {row['accepted']} | {steps} | {step_ms:.2f} | {step_ms / plain_step:.2f} | "
              f"{floor_bytes / 1e9:.2f} | {sf} | {row['distinct_fraction']:.2f}"
              + (f" / {row['own_distinct_fraction']:.2f}" if own else "") + f" | {same} |", flush=True)
        return row

    for bi, b in enumerate(batches):
        later = 20 * (len(batches) - bi - 1)  # seconds kept for the later batches' rows
        for role in ("spec", "spec_tg"):
            if (b, role) in warmers:
                warmers[b, role].wait(say)
        if (b, "plain") in warmers:
            warmers[b, "plain"].wait(say)
        if b in prefix_batches:
            if (b, "prefix") in warmers:
                warmers[b, "prefix"].wait(say)
            try:
                table = SpeculativeDecoder(engines[b, "spec"]).measure_step_times(reps=5)
                step_tables[b] = table
                record.setdefault("step_time_tables_ms", {})[str(b)] = {str(w): t * 1e3 for w, t in table.items()}
                say(f"  batch {b} step-time table: " + ", ".join(f"{w}: {t * 1e3:.2f} ms" for w, t in table.items()))
            except Exception as e:  # noqa: BLE001 - the other rows still run
                say(f"  batch {b} step-time table FAILED: {type(e).__name__}: {e}")
        kinds = [v for v in batch_variants(b) if parse_variant(v)[0] != "prefix"]
        if b in step_tables:
            kinds.append("prefix")
        for si in range(len(eval_sets[b])):
            if left() < (20 if smoke else 15) + later:
                say(f"budget: skipping batch {b} prompt sets {si}.. ({left():.0f} s left)")
                record.setdefault("skipped", []).append(f"batch {b} sets {si}..{len(eval_sets[b]) - 1}")
                save()
                break
            for variant in kinds:
                say(f"batch {b}, prompt set {si}: {variant}")
                try:
                    runs.append(run_one(b, si, variant))
                except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
                    say(f"  FAILED: {type(e).__name__}: {e}")
                    runs.append(dict(batch=b, set=si, variant=variant, error=f"{type(e).__name__}: {e}"))
                save()

    # ---- the table: every row kind over all prompt sets; at batch 1 also over the prompts whose plain
    # continuation is not degenerate (text_stats) and, for a sampled speculative row, whose own continuation is not
    # either; greedy rows first, then each sampling temperature against plain sampling at it ----------------------
    print(f"# bench_dspark_h200: {config.name} ({counts.active_decode / 1e9:.3f} B active / token), "
          f"{record['device']}, γ={gamma}, prompt {prompt_len} chars, {new} new tokens", flush=True)
    print("| batch | prompts | decoding | tokens/s | × plain | tokens per verification step (accepted + 1) | "
          "drafts verified / accepted | steps | step ms | × plain step | floor GB / step | % of read BW | "
          "distinct-token fraction (plain / sampled row) | same tokens as plain |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)

    def run_of(b, si, v):
        return next((x for x in runs if x["batch"] == b and x["set"] == si and x["variant"] == v
                     and "error" not in x), None)

    def not_degenerate(b, si, v) -> bool:
        """The prompt counts for row ``v``: its plain continuation is not degenerate, nor (sampled rows) the row's."""
        pr, r = run_of(b, si, plain_of(v)), run_of(b, si, v)
        return (pr is not None and not pr["text"][0]["degenerate"]
                and (r is None or not any(t["degenerate"] for t in r.get("text", []))))

    groups_of = {}  # batch -> [(temperature, row kinds)]
    for b in batches:
        kinds = [v for v in batch_variants(b) if parse_variant(v)[0] != "prefix"] + (
            ["prefix"] if b in step_tables else [])
        groups_of[b] = [(t, [v for v in kinds if variant_temperature(v)[1] == t])
                        for t in sorted({variant_temperature(v)[1] for v in kinds})]
        for temp, vs in groups_of[b]:
            plain_sets = sorted(r["set"] for r in runs if r["batch"] == b and r["variant"] == plain_of(vs[0])
                                and "error" not in r)
            for v in vs:
                aggregate(b, v, set(plain_sets), f"{len(plain_sets)} prompts" if b == 1 else f"{b} prompts together")
            if b == 1:
                for v in vs:
                    ok = [si for si in plain_sets if not_degenerate(b, si, v)]
                    if not aggregate(b, v, set(ok), f"{len(ok)} non-degenerate"):
                        print(f"| {b} | 0 non-degenerate | {v} | — | — | — | — | — | — | — | — | — | — | — |",
                              flush=True)
    if 1 in batches:  # per prompt
        for temp, vs in groups_of[1]:
            kinds = [v for v in vs if parse_variant(v)[0] != "plain"]
            head = "greedy" if temp == 0 else f"sampled at T {temp:g} (seed = prompt index; sampled rows: × plain " \
                                              f"(tokens per step) [their own repeated 4-grams, longest run])"
            print(f"# batch 1, per prompt, {head}: plain tokens/s; per row kind × plain (tokens per verification "
                  f"step)", flush=True)
            print("| prompt | start | distinct-token fraction | longest run | repeated 4-grams | degenerate | "
                  "plain tokens/s | " + " | ".join(kinds) + " | same tokens |", flush=True)
            print("|---" * (8 + len(kinds)) + "|", flush=True)
            for si in range(len(eval_sets[1])):
                pr = run_of(1, si, plain_of(vs[0]))
                if pr is None:
                    continue
                t = pr["text"][0]
                cells, same = [], True
                for v in kinds:
                    r = run_of(1, si, v)
                    cell = "—" if r is None else (f"{pr['decode_s'] / r['decode_s']:.2f}× "
                                                  f"({r['emitted'] / r['rows_verified']:.2f})")
                    if r is not None and r.get("text"):
                        o = r["text"][0]
                        cell += (f" [{o['repeated_4gram_fraction']:.2f}, {o['longest_run']}"
                                 + (", degenerate]" if o["degenerate"] else "]"))
                    cells.append(cell)
                    same = same and (r is None or r["same"] is None or bool(r["same"]))
                start = tok.decode(eval_sets[1][si][0][1:])[:24].replace("\n", "⏎").replace("|", "¦")  # after BOS
                print(f"| {si} | `{start}` | {t['distinct_fraction']:.2f} | {t['longest_run']} | "
                      f"{t['repeated_4gram_fraction']:.2f} | {'yes' if t['degenerate'] else 'no'} | "
                      f"{pr['tokens'] / pr['decode_s']:,.1f} | " + " | ".join(cells)
                      + f" | {'yes' if same else 'NO'}{'' if temp == 0 else ' (greedy rows only)'} |", flush=True)
    if stop_watch is not None:
        stop_watch.set()
    record["warm_ups"] = {w.name: dict(seconds=w.seconds, error=w.error) for w in warmers.values()}
    record["wall_s"] = time.perf_counter() - t_start
    # every compile of the process, longest first (wall seconds: compiles in other threads and the training ran
    # at the same time)
    print(f"# XLA compiles: {len(compiles)}, {sum(c['seconds'] for c in compiles):.0f} s in all (summed over "
          f"threads); the longest:", flush=True)
    print("| program | thread | compile s | ended at s |\n|---|---|---|---|", flush=True)
    for c in sorted(compiles, key=lambda c: -c["seconds"])[:16]:
        print(f"| {c['program']} | {c['thread']} | {c['seconds']:.1f} | {c['ended_at_s']:.0f} |", flush=True)
    stage("done")
    say(f"done in {record['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
