"""Decode kernels on the packed (release-format) KV cache: cache bytes a decode step moves per sequence, and (on a
GPU) the sparse-attention and indexer kernels timed on the packed cache read directly vs unpack-then-compute vs a
bf16 cache.

    python benchmarks/bench_packed_cache_kernels.py [--model bench40] [--contexts 4096,65536]   # bytes (computed)
    PYTHONUNBUFFERED=1 python benchmarks/bench_packed_cache_kernels.py --time --out DIR [--batches 1,32]
        [--context 16384]                                                                # GPU: kernel timings
    python benchmarks/bench_packed_cache_kernels.py --smoke   # CPU: tiny sizes, interpret mode, no timing

Bytes (per decode step and sequence, window ring + compressed KV + indexer keys over the model's layers): every
layer's attention reads its window ring (sliding_window rows), each KV source (Full layer) lets its indexer stream
the visible keys, each Reindex layer's indexer re-score its HSI pool (min(candidate blocks x block size, visible)
keys), each compressed attention layer (Full, Reuse, Reindex) gather min(index_topk, visible) compressed rows.
  bf16        bf16 cache: the kernels read 2 bytes a value.
  unpack      packed cache unpacked at every step (``packed_cache.read`` of the whole allocated compressed-KV and
              key buffers, once per KV source, and of every ring: packed bytes read + bf16 written), then the bf16
              reads above (counted as if XLA fused the ring's unpack, reorder and concatenation into one write).
  direct      the kernels read the packed bytes + scales of the rows they use and dequantise in registers.
The hierarchical top-k's leaf re-scoring (O(k x block) keys) is left out of all three.

Timing (``--time``, a GPU): one Full ratio-1 layer's indexer top-k (``kernels.indexer_topk`` with an HSI pool
emitted) and one sparse attention over its window ring + this step's row and its top-k (``kernels.sparse_attention``;
direct: ``win_ring`` = the packed ring), each in three forms as above
(unpack: ``packed_cache.read`` + the kernel in one jitted program); median of 20 synced calls after 3 warm-ups.
``--lean`` adds the attention's gather forms (``tuning={"packed_attention": "gather"}``: the selected rows' packed
bytes gathered and unpacked by one Pallas kernel, the ring unpacked in window order by another, then the bf16-cache
kernel; "gather xla", ``"gather_xla"``: the same gathers and unpacks by XLA).
Output: DIR/bench_packed_cache_kernels.json and the printed tables.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv41_jax import kernels as KN  # noqa: E402
from dsv41_jax.config import load_config  # noqa: E402
from dsv41_jax.inference import packed_cache as PC  # noqa: E402
from dsv41_jax.inference.cache import kv_sources, source_entries  # noqa: E402
from dsv41_jax.kernels import pallas_gpu as G  # noqa: E402
from dsv41_jax.plan import FULL, REINDEX, SWA  # noqa: E402


def _row_bytes(dim: int, fmt: str | None) -> float:
    if fmt is None:
        return 2.0 * dim  # bf16
    block, per_byte = PC.FORMATS[fmt]
    return dim / per_byte + dim / block


def step_bytes(config, context: int, max_len: int) -> dict:
    """Cache bytes one decode step moves per sequence at ``context`` tokens in a ``max_len`` allocation."""
    c = config
    hd, di = c.head_dim, c.index_head_dim
    kv_p, key_p = _row_bytes(hd, PC.FP4_E4M3_16), _row_bytes(di, PC.FP4_UE8M0_32)
    kv_b, key_b = _row_bytes(hd, None), _row_bytes(di, None)
    win_p = _row_bytes(hd, PC.FP8_UE8M0_32)
    rows_win = float(c.num_hidden_layers * min(c.sliding_window, context))
    rows_kv = rows_key = 0.0  # rows the kernels read
    for s in c.plan.layers:
        if s.mode == SWA or s.ratio == 0:
            continue
        vis = context // s.ratio
        rows_kv += min(c.index_topk, vis)
        if s.mode == FULL:
            rows_key += vis
        elif s.mode == REINDEX:
            rows_key += min(c.candidate_topk_blocks * c.candidate_block_size, vis)
    unpack = sum(source_entries(c, max_len, m) * (kv_p + kv_b + key_p + key_b) for _, m in kv_sources(c))
    unpack += c.num_hidden_layers * c.sliding_window * (win_p + kv_b)
    bf16 = rows_win * kv_b + rows_kv * kv_b + rows_key * key_b
    return dict(context=context, max_len=max_len, window_rows=rows_win, kv_rows=rows_kv, key_rows=rows_key,
                bf16=bf16, unpack=unpack + bf16, direct=rows_win * win_p + rows_kv * kv_p + rows_key * key_p)


def print_bytes(config, contexts):
    print(f"## cache bytes per decode step and sequence, {config.name} (computed)\n")
    print("| context (= allocation) | window rows | KV rows | key rows | bf16 cache | release, unpack-then-compute | "
          "release, kernels read packed | direct / unpack | direct / bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for t in contexts:
        r = step_bytes(config, t, t)
        rows.append(r)
        mb = lambda x: f"{x / 2**20:,.2f} MiB"  # noqa: E731
        print(f"| {t:,} | {r['window_rows']:,.0f} | {r['kv_rows']:,.0f} | {r['key_rows']:,.0f} | {mb(r['bf16'])} | "
              f"{mb(r['unpack'])} | {mb(r['direct'])} | {r['direct'] / r['unpack']:.3f} | {r['direct'] / r['bf16']:.3f} |")
    return rows


def _median_s(fn, *args, n=20):
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _looped(fn, n: int):
    """``fn(ring, kv, dp)`` called ``n`` times in one jitted program, each call's positions offset by a zero the
    compiler cannot see through (derived from the previous call's output), so no call is hoisted or merged: the
    time per call is then the kernels' own, without the host's dispatch and sync."""
    @jax.jit
    def run(ring, kv):
        def body(_, carry):
            dp, acc = carry
            x = fn(ring, kv, dp)[0, 0, 0, 0].astype(jnp.float32)
            return (x != x).astype(jnp.int32), acc + x
        dp, acc = jax.lax.fori_loop(0, n - 1, body, (jnp.int32(0), jnp.float32(0)))
        return dp, acc, fn(ring, kv, dp)  # the last call's whole output, for the checks
    return run


def time_kernels(config, batch: int, context: int, backend: str, dtype, smoke: bool,
                 attn_tuning: dict | None = None, attn_tunings: list | None = None, lean: bool = False,
                 tune_bf16: bool = False, no_indexer: bool = False, loop: int = 0) -> dict:
    c = config
    rng = np.random.default_rng(batch)
    hd, di, h, hi, w = c.head_dim, c.index_head_dim, c.num_attention_heads, c.index_n_heads, c.sliding_window
    n, k, bs = context, min(c.index_topk, context), c.candidate_block_size
    pack = jax.jit(PC.pack, static_argnums=1)

    def packed(dim, fmt):
        v, s = pack(jnp.asarray(rng.normal(size=(batch, n, dim)), jnp.float32), fmt)
        return PC.PackedRows(v, s, fmt, dim, str(jnp.dtype(dtype)))

    ckv, keys = packed(hd, PC.FP4_E4M3_16), packed(di, PC.FP4_UE8M0_32)
    v, s = pack(jnp.asarray(rng.normal(size=(batch, w, hd)), jnp.float32), PC.FP8_UE8M0_32)
    ring = PC.PackedRows(v, s, PC.FP8_UE8M0_32, hd, str(jnp.dtype(dtype)))  # the window's ring (W slots)
    new = jnp.asarray(rng.normal(size=(batch, 1, hd)), dtype)  # this step's own window row
    q = jnp.asarray(rng.normal(size=(batch, 1, h, hd)), dtype)
    pos = jnp.full((batch, 1), context - 1, jnp.int32)
    base = pos[:, 0]
    wpos = context - 1 - w + jnp.broadcast_to(jnp.arange(w + 1, dtype=jnp.int32), (batch, w + 1))
    topk = jnp.asarray(np.sort(rng.choice(n, size=(batch, 1, k), replace=True), axis=-1), jnp.int32)
    sink = jnp.zeros((h,), jnp.float32)
    iq = jnp.asarray(rng.normal(size=(batch, 1, hi, di)), dtype)
    iw = jnp.asarray(rng.normal(size=(batch, 1, hi)), jnp.float32) * hi ** -0.5

    kernel = {"packed_attention": "kernel"}  # the packed forms below: the kernel reading packed rows, whatever the
    # default form at this batch (kernels.packed_attention_form)

    @jax.jit
    def attention(ring, kv, dp=0):  # packed ring + packed KV read by the kernel
        return KN.sparse_attention(q, pos + dp, new, wpos, kv, topk, sink, window=w, backend=backend,
                                   win_ring=(ring, base), tuning=kernel)

    @jax.jit
    def attention_tuned(ring, kv):  # the packed form at --attn-tuning (every other form keeps the defaults)
        return KN.sparse_attention(q, pos, new, wpos, kv, topk, sink, window=w, backend=backend,
                                   win_ring=(ring, base), tuning=dict(kernel, **(attn_tuning or {})))

    @jax.jit
    def attention_unpack(ring, kv, dp=0):
        win = jnp.concatenate([KN.ring_rows(PC.read(ring), base).astype(dtype), new], axis=1)
        return KN.sparse_attention(q, pos + dp, win, wpos, PC.read(kv), topk, sink, window=w, backend=backend)

    @jax.jit
    def attention_ring_only(ring, kv):  # packed ring read by the kernel, KV unpacked first
        return KN.sparse_attention(q, pos, new, wpos, PC.read(kv), topk, sink, window=w, backend=backend,
                                   win_ring=(ring, base), tuning=kernel)

    @jax.jit
    def attention_kv_only(ring, kv):  # packed KV read by the kernel, ring unpacked first
        win = jnp.concatenate([KN.ring_rows(PC.read(ring), base).astype(dtype), new], axis=1)
        return KN.sparse_attention(q, pos, win, wpos, kv, topk, sink, window=w, backend=backend, tuning=kernel)

    def attention_bf16_at(ring, kv, dp=0, tuning=None):  # a bf16 cache: ring and KV in bf16
        win = jnp.concatenate([KN.ring_rows(ring, base), new], axis=1)
        return KN.sparse_attention(q, pos + dp, win, wpos, kv, topk, sink, window=w, backend=backend, tuning=tuning)

    attention_bf16 = jax.jit(attention_bf16_at)

    def indexer(ks):
        return KN.indexer_topk(iq, iw, ks, pos, ratio=1, topk=k, block_size=bs,
                               candidate_topk_blocks=c.candidate_topk_blocks, backend=backend)

    indexer_direct = jax.jit(indexer)
    indexer_unpack = jax.jit(lambda ks: indexer(PC.read(ks)))
    indexer_gather_fn = jax.jit(indexer)  # the first packed-row read (per-column pointers), as the same-run baseline

    def indexer_gather(ks):  # the load form is read when the program is traced (its first call)
        old, G.PACKED_LOAD = G.PACKED_LOAD, "gather"
        try:
            return indexer_gather_fn(ks)
        finally:
            G.PACKED_LOAD = old

    attention_gather = jax.jit(lambda ring, kv, dp=0: KN.sparse_attention(
        q, pos + dp, new, wpos, kv, topk, sink, window=w, backend=backend, win_ring=(ring, base),
        tuning=dict(kernel, packed_load="gather")))
    # the selected rows gathered and unpacked (one Pallas kernel; "gather_xla": XLA's gathers and unpack fusions),
    # the ring unpacked in window order, then the bf16-cache kernel
    attention_gathered, attention_gathered_xla = (jax.jit(functools.partial(
        lambda ring, kv, dp=0, f_=None: KN.sparse_attention(
            q, pos + dp, new, wpos, kv, topk, sink, window=w, backend=backend, win_ring=(ring, base),
            tuning={"packed_attention": f_}), f_=f_)) for f_ in ("gather", "gather_xla"))
    tuned = {json.dumps(t_, sort_keys=True): jax.jit(functools.partial(
        lambda ring, kv, dp=0, t_=None: KN.sparse_attention(q, pos + dp, new, wpos, kv, topk, sink, window=w,
                                                            backend=backend, win_ring=(ring, base), tuning=t_),
        t_=dict(kernel, **t_))) for t_ in (attn_tunings or [])}
    # the bf16 cache at the same tunings (the packed-row entries dropped: they do not apply to bf16 rows)
    tuned_bf16 = {json.dumps(t_, sort_keys=True): jax.jit(functools.partial(attention_bf16_at, tuning={
        k_: v_ for k_, v_ in t_.items() if not k_.startswith("packed_")})) for t_ in (attn_tunings or [])
        if tune_bf16}
    bf16_ring, bf16_kv, bf16_keys = (PC.read(x).astype(dtype) for x in (ring, ckv, keys))
    if lean and loop:  # every form only as its looped program (half the compiles): the checks on its last call
        forms = ((("bf16", attention_bf16, (bf16_ring, bf16_kv)),
                  ("unpack", attention_unpack, (ring, ckv)), ("direct", attention, (ring, ckv)),
                  ("gather form", attention_gathered, (ring, ckv)),
                  ("gather xla", attention_gathered_xla, (ring, ckv)))
                 + tuple((f"direct {n_}", f_, (ring, ckv)) for n_, f_ in tuned.items())
                 + tuple((f"bf16 {n_}", f_, (bf16_ring, bf16_kv)) for n_, f_ in tuned_bf16.items()))
        forms = tuple((name, _looped(f, loop), x) for name, f, x in forms)
        outs = {name: np.asarray(f(*x)[2], np.float64) for name, f, x in forms}

        def rel(x, y):
            return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))

        forms_rel = {n_: ({"vs bf16 (defaults)": rel(o_, outs["bf16"])} if n_.startswith("bf16") else
                          {"vs unpack": rel(o_, outs["unpack"]), "vs direct": rel(o_, outs["direct"]),
                           "vs bf16 at the same tuning": rel(o_, outs.get("bf16" + n_[6:], np.nan))})
                     for n_, o_ in outs.items() if n_ not in ("bf16", "unpack")}
        print(f"batch {batch}: relative distances (last call of each program): {forms_rel}", flush=True)
        res = dict(batch=batch, context=context, topk=k, dtype=str(jnp.dtype(dtype)), loop=loop,
                   attention_equal=bool(np.array_equal(outs["direct"], outs["unpack"])), indexer_equal=True,
                   gather_equal_unpack=bool(np.array_equal(outs["gather form"], outs["unpack"])),
                   gather_xla_equal_unpack=bool(np.array_equal(outs["gather xla"], outs["unpack"])),
                   forms_rel=forms_rel, indexer="not run (--loop)")
        if smoke:
            return res
        res["attention_us"] = {name: 1e6 * _median_s(f, *x) / loop for name, f, x in forms}
        print(f"batch {batch}: attention µs per call ({loop} calls a program): "
              + ", ".join(f"{n_} {v_:,.1f}" for n_, v_ in res["attention_us"].items()), flush=True)
        return res
    # equality first: the packed forms must give the unpacking forms' results bit for bit
    a, b_ = attention(ring, ckv), attention_unpack(ring, ckv)
    same_attn = bool(np.array_equal(np.asarray(a, np.float32), np.asarray(b_, np.float32)))
    i1, i2 = indexer_direct(keys), indexer_unpack(keys)
    same_idx = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(i1),
                                                                                jax.tree.leaves(i2)))
    # the baseline load form and every tuning checked the same way (bit-equal attention output, equal index sets)
    forms_equal = {"attention gather": bool(np.array_equal(np.asarray(attention_gather(ring, ckv), np.float32),
                                                           np.asarray(b_, np.float32))),
                   "indexer gather": all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(
                       jax.tree.leaves(indexer_gather(keys)), jax.tree.leaves(i2)))}
    # how far each packed form lies from the unpacking path and from the default packed form (relative L2): on the
    # device the forms are different compiled programs, so float32 accumulation order may differ
    a64, b64 = np.asarray(a, np.float64), np.asarray(b_, np.float64)
    forms_rel = {}
    for name_, f_ in tuned.items():
        o_ = f_(ring, ckv)
        forms_equal[f"attention {name_}"] = bool(np.array_equal(np.asarray(o_, np.float32),
                                                                np.asarray(b_, np.float32)))
        o64 = np.asarray(o_, np.float64)
        forms_rel[name_] = {"vs unpack": float(np.linalg.norm(o64 - b64) / max(np.linalg.norm(b64), 1e-30)),
                            "vs direct": float(np.linalg.norm(o64 - a64) / max(np.linalg.norm(a64), 1e-30)),
                            "equal to direct": bool(np.array_equal(o64, a64))}
    forms_rel["direct"] = {"vs unpack": float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), 1e-30))}
    print(f"batch {batch}: other forms equal to the unpacking path: {forms_equal}", flush=True)
    print(f"batch {batch}: relative distances: {forms_rel}", flush=True)
    for name_, f_ in tuned_bf16.items():  # each bf16-cache tuning against the bf16 cache at the defaults
        o64 = np.asarray(f_(bf16_ring, bf16_kv), np.float64)
        r64 = np.asarray(attention_bf16(bf16_ring, bf16_kv), np.float64)
        forms_rel[f"bf16 {name_}"] = {"vs bf16": float(np.linalg.norm(o64 - r64) / max(np.linalg.norm(r64), 1e-30))}
    if lean:  # timings and equality only (no float32 distances / one-operand forms: fewer device compiles)
        res = dict(batch=batch, context=context, topk=k, dtype=str(jnp.dtype(dtype)), attention_equal=same_attn,
                   indexer_equal=same_idx, forms_equal=forms_equal, forms_rel=forms_rel, loop=loop)
        forms = ((("bf16", attention_bf16, (bf16_ring, bf16_kv)),
                  ("unpack", attention_unpack, (ring, ckv)), ("direct", attention, (ring, ckv)),
                  ("direct gather", attention_gather, (ring, ckv)), ("gather form", attention_gathered, (ring, ckv)))
                 + tuple((f"direct {n_}", f_, (ring, ckv)) for n_, f_ in tuned.items())
                 + tuple((f"bf16 {n_}", f_, (bf16_ring, bf16_kv)) for n_, f_ in tuned_bf16.items()))
        if smoke:
            return res
        res["attention_us"] = {name: 1e6 * _median_s(f, *x) for name, f, x in forms}
        if not no_indexer:
            res["indexer_us"] = {name: 1e6 * _median_s(f, x) for name, f, x in
                                 (("bf16", indexer_direct, bf16_keys), ("unpack", indexer_unpack, keys),
                                  ("direct", indexer_direct, keys), ("direct gather", indexer_gather, keys))}
        return res
    # how far apart, against float32: both kernel forms and the plain-JAX reference on the same (upcast) values. On
    # an H200 the two forms differed (2026-12-02) while equal bit for bit in interpret mode on CPU; if both lie
    # within bf16-operand noise of the float32 result the difference is the kernels' accumulation (e.g. a different
    # tensor-core instruction when the dot's operand comes from registers instead of a load), not a wrong decode
    f32 = jnp.float32
    win32 = jnp.concatenate([KN.ring_rows(PC.read(ring), base).astype(f32), new.astype(f32)], axis=1)
    ref = KN.sparse_attention(q.astype(f32), pos, win32, wpos, PC.read(ckv).astype(f32), topk, sink, window=w,
                              backend="reference")
    a64, b64, r64 = (np.asarray(t, np.float64) for t in (a, b_, ref))

    def rel(x, y):
        return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))

    # which packed operand makes the difference: the ring alone, the selected KV rows alone
    ring64, kv64 = (np.asarray(f(ring, ckv), np.float64) for f in (attention_ring_only, attention_kv_only))
    tuned64 = np.asarray(attention_tuned(ring, ckv), np.float64) if attn_tuning else a64
    res = dict(batch=batch, context=context, topk=k, dtype=str(jnp.dtype(dtype)), attention_equal=same_attn,
               indexer_equal=same_idx,
               attention_packed_vs_unpack=float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), 1e-30)),
               attention_packed_max_abs_diff=float(np.max(np.abs(a64 - b64))),
               attention_packed_vs_f32=float(np.linalg.norm(a64 - r64) / max(np.linalg.norm(r64), 1e-30)),
               attention_unpack_vs_f32=float(np.linalg.norm(b64 - r64) / max(np.linalg.norm(r64), 1e-30)),
               attention_ring_only_vs_unpack=rel(ring64, b64), attention_kv_only_vs_unpack=rel(kv64, b64),
               attn_tuning=attn_tuning or {}, attention_tuned_vs_unpack=rel(tuned64, b64),
               attention_tuned_vs_f32=rel(tuned64, r64))
    print(f"attention batch {batch}: packed vs unpacking path rel {res['attention_packed_vs_unpack']:.2e} (max abs "
          f"{res['attention_packed_max_abs_diff']:.2e}); vs float32: packed {res['attention_packed_vs_f32']:.2e}, "
          f"unpacking {res['attention_unpack_vs_f32']:.2e}; packed ring only vs unpacking "
          f"{res['attention_ring_only_vs_unpack']:.2e}, packed KV only {res['attention_kv_only_vs_unpack']:.2e}"
          + (f"; packed at {attn_tuning}: vs unpacking {res['attention_tuned_vs_unpack']:.2e}, vs float32 "
             f"{res['attention_tuned_vs_f32']:.2e}" if attn_tuning else ""), flush=True)
    if smoke:
        return res
    res["attention_us"] = {name: 1e6 * _median_s(f, *x) for name, f, x in
                           (("bf16", attention_bf16, (bf16_ring, bf16_kv)), ("unpack", attention_unpack, (ring, ckv)),
                            ("direct", attention, (ring, ckv)), ("ring only", attention_ring_only, (ring, ckv)),
                            ("KV only", attention_kv_only, (ring, ckv)))
                           + ((f"direct {attn_tuning}", attention_tuned, (ring, ckv)),) * bool(attn_tuning)}
    res["indexer_us"] = {name: 1e6 * _median_s(f, x) for name, f, x in
                         (("bf16", indexer_direct, bf16_keys), ("unpack", indexer_unpack, keys),
                          ("direct", indexer_direct, keys))}
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench40")
    ap.add_argument("--contexts", default="4096,16384,65536")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--out", default=None)
    ap.add_argument("--attn-tunings", default="", help="JSON list: the packed form also at each of these sparse-"
                                                       "attention tunings (with --lean); or an object of such "
                                                       "lists keyed by batch")
    ap.add_argument("--tunings-batches", default="32", help="the batches --attn-tunings applies to")
    ap.add_argument("--lean", action="store_true", help="time bf16 / unpack / direct / direct gather (the first "
                                                        "packed-row load) and the tunings only")
    ap.add_argument("--tune-bf16", action="store_true", help="--lean: the bf16-cache form at each of --attn-tunings "
                                                            "too (its packed-row entries dropped)")
    ap.add_argument("--no-indexer", action="store_true", help="--lean: leave out the indexer timings")
    ap.add_argument("--loop", type=int, default=0, help="--lean: time each attention form as this many calls in "
                                                        "one program (µs per call; 0: one call a program); the "
                                                        "checks then compare each program's last call, the "
                                                        "indexer and the gather form are left out")
    ap.add_argument("--attn-tuning", default="", help="JSON: also the packed form at this sparse-attention tuning "
                                                      "(e.g. '{\"num_warps\": 8}')")
    args = ap.parse_args()
    config = load_config("tiny" if args.smoke else args.model)
    out = dict(date=time.strftime("%Y-%m-%d"), model=config.name, device=str(jax.devices()[0].device_kind),
               bytes=print_bytes(config, [int(x) for x in args.contexts.split(",")]))
    if args.time or args.smoke:
        backend = "pallas_gpu_interpret" if args.smoke else "pallas_gpu"
        ctx = 256 if args.smoke else args.context
        batches = [2] if args.smoke else [int(x) for x in args.batches.split(",")]
        print(f"\n## kernels on {out['device']}: one Full ratio-1 layer, context {ctx}, bf16 compute\n")
        print("| batch | kernel | bf16 cache µs | unpack-then-kernel µs | kernel on packed µs | packed = unpacked |")
        print("|---|---|---|---|---|---|")
        out["timings"] = []
        for b in batches:
            tb = [int(x) for x in args.tunings_batches.split(",")] if args.tunings_batches else []
            tunings = json.loads(args.attn_tunings) if args.attn_tunings else None
            if isinstance(tunings, dict):  # {"batch": [tunings], ...}
                tunings = tunings.get(str(b)) or (next(iter(tunings.values()), None) if args.smoke else None)
            r = time_kernels(config, b, ctx, backend, jnp.bfloat16, args.smoke,
                             json.loads(args.attn_tuning) if args.attn_tuning else None,
                             tunings if tunings and (b in tb or args.smoke) else None,
                             args.lean, args.tune_bf16, args.no_indexer, args.loop)
            out["timings"].append(r)
            if args.out:  # after every batch, so that a run cut short keeps the batches done
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "bench_packed_cache_kernels.json"), "w") as f:
                    json.dump(out, f, indent=1)
            for kind in ("attention", "indexer"):
                t = r.get(f"{kind}_us", {})
                cells = " | ".join(f"{t[f]:,.1f}" if f in t else "-" for f in ("bf16", "unpack", "direct"))
                print(f"| {b} | {kind} | {cells} | {r[f'{kind}_equal']} |")
            for kind in ("attention", "indexer"):
                extra = {f: v for f, v in r.get(f"{kind}_us", {}).items() if f not in ("bf16", "unpack", "direct")}
                if extra and "direct" in r[f"{kind}_us"]:
                    d_ = r[f"{kind}_us"]["direct"]
                    print(f"(batch {b} {kind}, other forms: " + ", ".join(
                        f"{f} {v:,.1f} µs ({v / d_:.2f}x direct)" for f, v in extra.items()) + ")")
    if args.out:  # written before the equality verdict, so a mismatch still leaves its distances on record
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_packed_cache_kernels.json"), "w") as f:
            json.dump(out, f, indent=1)
    if (args.time or args.smoke) and not all(r["attention_equal"] and r["indexer_equal"]
                                             and all(r.get("forms_equal", {}).values()) for r in out["timings"]):
        print("ERROR: the kernels on the packed cache differ from the unpacking path")
        sys.exit(1)


if __name__ == "__main__":
    main()
