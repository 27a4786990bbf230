"""Kernel dispatch: CSA2 sparse attention and the (hierarchical) indexer top-k behind one ``backend=`` switch.

Backends
  ``"reference"``             plain JAX (``dsv41_jax.ops``), the definition of correct; differentiable.
  ``"pallas_gpu"``            Pallas, Triton lowering (chosen by measurement on the H200: ``pallas_gpu.py``).
  ``"pallas_tpu"``            Pallas Mosaic TPU (scalar-prefetched indices, per-row DMA).
  ``"pallas_gpu_interpret"``  / ``"pallas_tpu_interpret"``: the same kernels in Pallas interpret mode (CPU tests).
  ``"auto"`` (default)        pallas_gpu on GPU, pallas_tpu on TPU, reference elsewhere (CPU).

Gradients (``jax.custom_vjp``): ``pallas_gpu`` has a FUSED backward (a dQ kernel per query with dQ in registers;
dKV by key-centric kernels that sum each row's gradient in float32 over the queries reading it and write it once,
no atomics: ``pallas_gpu.attention_bwd``; sink gradient from the saved log-sum-exp), the default for every dtype
(``tuning={"fused_bwd": False}`` opts out; ``{"bwd_dkv": "atomic", "bwd_dkv_selected": "atomic"}`` selects the
earlier fp32 atomic scatter-add, which stays the default for selected rows when the top-k lists are narrower than
a quarter of the entries: ``pallas_gpu.BY_KEY_MIN_FILL``).
Its bf16 gradients are within bf16 rounding of float32 (the atomic form's on the H200, benchmarks/RESULTS.md: an
earlier "0.30 error" compared it against a reference backward whose bf16 accumulation was the inaccurate side).
``pallas_tpu`` has the same design in Mosaic (``pallas_tpu.attention_bwd``: dQ per query over the rows DMA'd as in
the forward, dKV per block of 128 rows over the queries that read it, float32 sums, no atomics), the default for
every dtype; checked in TPU interpret mode (bf16 against float32 on upcast inputs) and compiled ahead of time for v5p,
not yet timed on TPU hardware. ``tuning={"fused_bwd": False}`` on either backend selects the REFERENCE-RECOMPUTE
backward (the VJP of the plain-JAX reference recomputed from the saved inputs, every sum in float32: the shared KV
enters the query-chunk map in float32 and gathered rows scatter-add their gradient in float32, ``ops.gather``):
accurate, not fast. The indexer returns integer indices (no gradient), as in the reference.

Sequence-variant note: ``sequence_sparse_attention`` takes query t's window keys from the index range
[t - window + 1, t] and masks them by position (and document); that equals the reference whenever positions
strictly increase along the sequence, or within each document when ``segments`` is given.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from dsv41_jax.kernels import hier_topk, reference
from dsv41_jax.kernels.reference import pool_ids_to_mask, pool_mask_to_ids  # noqa: F401  (public helpers)
from dsv41_jax.ops import attention as _ref_attn

BACKENDS = ("auto", "reference", "pallas_gpu", "pallas_tpu", "pallas_gpu_interpret", "pallas_tpu_interpret")

__all__ = ["BACKENDS", "resolve_backend", "reads_packed_cache", "ring_rows", "selected_rows", "window_rows",
           "sparse_attention", "PACKED_ATTENTION_FORMS", "PACKED_GATHER_MIN_ROWS", "PACKED_FUSED_GATHER_MIN_ROWS",
           "packed_attention_form",
           "sequence_sparse_attention", "indexer_topk",
           "pool_ids_to_mask", "pool_mask_to_ids", "backward_kind"]


def resolve_backend(backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    if backend != "auto":
        return backend
    platform = jax.default_backend()
    if platform in ("gpu", "cuda", "rocm"):
        return "pallas_gpu"
    if platform == "tpu":
        return "pallas_tpu"
    return "reference"


def backward_kind(backend: str = "auto", dtype=jnp.float32) -> str:
    """How attention gradients are computed: 'fused' (Pallas kernel), 'reference-recompute' or 'reference'."""
    be = resolve_backend(backend)
    if be == "reference":
        return "reference"
    cfg = _AttnCfg(be, "explicit", 1, 1.0, 1, 0, ())
    return "fused" if _fused_bwd(cfg, jnp.zeros((), dtype)) else "reference-recompute"


# ----------------------------------------------------------------------------------------------------------------
# Sparse attention
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _AttnCfg:
    backend: str
    variant: str  # "explicit" (window rows listed per batch) | "sequence" (window = the sequence itself)
    window: int
    scale: float
    wspan: int
    chunk: int
    tuning: tuple  # sorted (name, value) pairs for the GPU kernels


# Default block configuration of the fused GPU backward (``pallas_gpu.attention_bwd`` keyword arguments; explicit
# ``tuning={"bwd_<name>": ...}`` entries win): the dQ kernel's tiles (``block_h`` heads x ``block_k`` rows,
# ``num_warps``) and, where set, the key-centric dKV kernels' (``key_block`` rows x ``key_block_h`` heads,
# ``key_warps``, ``key_splits``; unset = ``attention_bwd``'s own defaults). 16-bit inputs: picked by the H200 sweep
# at fullwidth4's train shapes (benchmarks/RESULTS.md, 2026-12-02, ``benchmarks/bench_train_tiles.py``): dQ over
# 32-row steps (was 16) and the dKV kernels on 4 warps (was 8), each 4-10 % faster per layer there; other shapes
# (decode-sized backward passes) are unmeasured with these. The dQ kernel's loop over its rows pipelined over 2
# stages (``num_stages``; attention_bwd's own default is 1): the fullwidth4 train step 4.6 ms (2.7 %) faster on an
# H200 in one process (benchmarks/RESULTS.md, 2026-12-02 14:29), first-step loss bit-identical, gradient norm
# within 1.1e-5 (the pipelined kernel's float32 accumulation order). The dKV kernels' loops pipelined over 2 stages
# too (``key_stages``): the dKV family 17.0 ms per fullwidth4 step (18.2 in the 15:15 profile), the step 0.3 ms
# faster alone and 1.2 ms faster beside the Sinkhorn kernel in one process — within the run's noise alone, so a small
# gain (benchmarks/RESULTS.md, 2026-12-02 19:22); first-step loss and gradient norm bit-identical (same sums).
GPU_BWD_DEFAULTS = {
    "16bit": {"block_h": 32, "block_k": 32, "num_warps": 4, "num_stages": 2, "key_warps": 4, "key_stages": 2},
    "float32": {"block_h": 16, "block_k": 16, "num_warps": 4},  # fp32 tiles are twice the registers
}


# The flash-decoding split of the key list (``num_splits``) when the query rows alone leave the GPU's 132
# multiprocessors (an H200's) partly idle; ``tuning={"split_rule": ...}`` picks one per call, an explicit
# ``num_splits`` wins over every rule. The packed-cache and bf16-cache calls take the same rule, so the packed kernels
# stay bit-equal to unpack-then-kernel (a split count changes the float32 merge order).
#   "fill"      ceil(132 / programs) splits, at most half the key blocks; 1-4 16-bit query rows: 4 splits.
#   "wave"      floor(132 / programs) splits, at most half the key blocks: the programs fit in one wave.
#   "few_wave"  (the default) "wave" for 1-4 16-bit query rows, "fill" for more. On an H200 (benchmarks/RESULTS.md,
#               2026-12-03 18:40 UTC; bench40 layer, top-512 + 129 window rows, kernel µs per call) batch 1 gained
#               on both caches with more splits than 4 (bf16 cache 27.5 -> 20.5 µs at 8, packed 43.7 -> 31.6) and
#               the 40-layer release step 9.62 -> 9.20 ms; at batch 32 "wave" (2 splits instead of 3) made the
#               packed kernel faster (141.6 -> 132.7 µs, the step 22.71 -> 21.91 ms) but the bf16-cache kernel slower
#               (60.1 -> 71.2 µs), so batch 32 keeps "fill".
SPLIT_RULES = ("fill", "wave", "few_wave")
SPLIT_RULE = "few_wave"
GPU_SMS = 132


# How the GPU decode kernel consumes a PACKED compressed-KV cache buffer (``tuning={"packed_attention": ...}``, in the
# step ``InferenceOptions.packed_attention``); every form gives the unpack-then-kernel result bit for bit in interpret
# mode (the same kernel over the same values, the same key blocks and splits):
#   "kernel"  the sparse-attention kernel loads each selected row's packed bytes + scales and dequantises them in
#             registers (``pallas_gpu.attention_fwd(ckv_fmt=...)``; the packed window ring likewise).
#   "gather"  the selected rows' bytes + scales are gathered and unpacked (:func:`selected_rows`: a dense
#             [B, C * K, D] of only the rows the kernel reads, the top-k remapped onto it), the packed window ring is
#             unpacked in window order (:func:`ring_rows`), then the bf16-cache kernel runs over both. The gathers
#             are one fused Pallas kernel each (``packed_gather_gpu``: bytes and scales decoded in registers).
#   "gather_xla"  the same with the gathers and unpacks in plain JAX (XLA's gather + unpack fusions; the first
#             form of "gather", kept as its oracle and same-run baseline).
# The default is a gather form from PACKED_GATHER_MIN_ROWS query rows (1: every decode batch). With XLA's gathers, on
# an H200 (benchmarks/RESULTS.md, 2026-12-03 21:15 UTC; bench40, top-512 + 129 window rows, 64 heads x 512, bf16): at
# batch 32 one layer's call 113.0 µs against the packed kernel's 147.0 (bf16 cache 56.6), and the 40-layer release step 22.85
# -> 20.36 ms (0.96x -> 1.07x the bf16 step's 21.86; the sparse attention 4.36 -> 1.19 ms a step, XLA's fusions +0.76
# ms: the selected rows are gathered once per KV source and top-k, shared by the layers reusing them). At batch 1 the
# one-layer call was 29.6 against 33.2 µs, and the release step (RESULTS.md, 22:17 UTC) 10.01 -> 9.30 ms (kernel time
# 9.44 -> 9.18; the sparse attention 0.76 -> 0.41 ms a step; 1.24x -> 1.33x the bf16 step's 12.38). 2-31 rows are not
# measured. Long chunks (prefill) whose C x K selected rows outnumber the buffer's (the gather form would unpack the
# whole buffer) keep the kernel: not measured either.
# The default gathers are the fused Pallas kernels ("gather") from PACKED_FUSED_GATHER_MIN_ROWS query rows: on an H200
# (benchmarks/RESULTS.md, 2026-12-04 00:09 UTC; one bench40 layer as above, same run) the batch-32 call took 71.3 µs
# against 99.8 with XLA's gathers (bf16 cache 60.9, packed kernel 132.9; the gathers ≈ 10 against ≈ 39 µs), while at
# batch 1 it took 30.5 against 28.4 (one ring program per 32 window rows: 5 programs at batch 1), so fewer rows keep
# XLA's gathers ("gather_xla"); in the 40-layer release step at batch 32 (RESULTS.md, 2026-12-04 01:23 UTC) 20.25 ->
# 19.81 ms. 2-31 rows are not measured.
PACKED_ATTENTION_FORMS = ("kernel", "gather", "gather_xla")
PACKED_GATHER_MIN_ROWS = 1
PACKED_FUSED_GATHER_MIN_ROWS = 32


def packed_attention_form(rows: int, form: str | None = None, fits: bool = True) -> str:
    """The packed-cache form for ``rows`` query rows (batch x chunk): ``form`` if given (checked), else the default:
    a gather form from :data:`PACKED_GATHER_MIN_ROWS` rows when ``fits`` (the chunk's C x K selected rows are no more
    than the buffer's) — "gather" (the fused gathers) from :data:`PACKED_FUSED_GATHER_MIN_ROWS` rows, "gather_xla"
    below — and "kernel" otherwise."""
    if form is None:
        form = "kernel" if rows < PACKED_GATHER_MIN_ROWS or not fits else (
            "gather" if rows >= PACKED_FUSED_GATHER_MIN_ROWS else "gather_xla")
    if form not in PACKED_ATTENTION_FORMS:
        raise ValueError(f"unknown packed attention form {form!r}; choose one of {PACKED_ATTENTION_FORMS}")
    return form


def decode_splits(progs: int, nblk: int, few_rows: bool, rule: str = SPLIT_RULE) -> int:
    """Key-list splits for ``progs`` programs (query rows x head blocks x value blocks) over ``nblk`` key blocks;
    ``few_rows``: the 16-bit tiling of 1-4 query rows (16 heads a program)."""
    if rule not in SPLIT_RULES:
        raise ValueError(f"unknown split rule {rule!r}; choose one of {SPLIT_RULES}")
    if rule == "few_wave":
        rule = "wave" if few_rows else "fill"
    if rule == "fill" and few_rows:
        return 4
    if progs >= GPU_SMS:
        return 1
    per_wave = -(-GPU_SMS // progs) if rule == "fill" else GPU_SMS // progs
    return int(max(1, min(nblk // 2, per_wave)))


def _gpu_tuning(cfg: _AttnCfg, q, topk, bwd=False):
    """Block sizes for the GPU kernels: explicit ``tuning`` entries win; defaults were picked by the H200 sweeps in
    benchmarks/RESULTS.md (decode: 32 heads x 512 x 32 rows, 4 warps, 3 stages; prefill: 64 x 512 x 64, 8 warps)."""
    from dsv41_jax.kernels import pallas_gpu as G

    t = dict(cfg.tuning)
    t.pop("fused_bwd", None)
    rule = t.pop("split_rule", None) or SPLIT_RULE
    b, c, h, d = q.shape
    wide = jnp.dtype(q.dtype).itemsize >= 4  # fp32 tiles are twice the registers / shared memory
    if bwd:
        t = {k[4:]: v for k, v in t.items() if k.startswith("bwd_")}
        for k_, v_ in GPU_BWD_DEFAULTS["float32" if wide else "16bit"].items():
            t.setdefault(k_, v_)
        return t
    t = {k: v for k, v in t.items() if not k.startswith("bwd_")}
    rows = b * c
    if wide:
        base = dict(block_h=16, block_d=256, block_k=16, num_warps=4, num_stages=2)
    elif rows >= 512:  # prefill-like: many queries
        base = dict(block_h=64, block_d=512, block_k=64, num_warps=8, num_stages=2)
    elif rows <= 4:  # a handful of queries: split heads finer (and the key list: ``decode_splits``)
        base = dict(block_h=16, block_d=512, block_k=32, num_warps=4, num_stages=3)
    else:
        base = dict(block_h=32, block_d=512, block_k=32, num_warps=4, num_stages=3)
    for k_, v_ in base.items():
        t.setdefault(k_, v_)
    if "num_splits" not in t:  # flash-decoding split of the key list only when one wave is not filled
        kk = 0 if topk is None else topk.shape[-1]
        nblk = -(-cfg.wspan // t["block_k"]) + -(-kk // t["block_k"])
        hb = -(-h // max(16, min(t["block_h"], G._pow2(h))))
        db = max(1, G._pow2(d) // t["block_d"])
        t["num_splits"] = decode_splits(b * c * hb * db, nblk, rows <= 4 and not wide, rule)
    return t


def _fused_bwd(cfg: _AttnCfg, q) -> bool:
    """Kernel backward (``pallas_gpu.attention_bwd`` / ``pallas_tpu.attention_bwd``): the default for every dtype
    on both kernel backends (float32 sums throughout; checked against float32 gradients on upcast inputs: the GPU's
    on the H200, benchmarks/RESULTS.md, the TPU's in TPU interpret mode, tests/test_kernels_tpu_bwd.py);
    ``tuning={"fused_bwd": False}`` selects the reference-recompute backward."""
    if not cfg.backend.startswith(("pallas_gpu", "pallas_tpu")):
        return False
    return bool(dict(cfg.tuning).get("fused_bwd", True))


def _tpu_blocks(cfg: _AttnCfg):
    """Row blocks of the TPU kernels: ``block_k`` selected rows per DMA block (128 on hardware; 8 in interpret mode:
    same result, a far smaller unrolled program) and ``key_block`` rows per dKV program (128; 16 in interpret)."""
    t = dict(cfg.tuning)
    interp = cfg.backend.endswith("interpret")
    return t.get("block_k", 8 if interp else 128), t.get("key_block", 16 if interp else 128)


def _attn_fwd_impl(cfg: _AttnCfg, q, q_pos, wkv, wpos, wstart, floor, ckv, topk, sink, qseg, wseg, with_lse=False):
    be = cfg.backend
    if ckv is not None and ckv.dtype != wkv.dtype:
        ckv = ckv.astype(wkv.dtype)
    if be.startswith("pallas_gpu"):
        from dsv41_jax.kernels import pallas_gpu as G

        out, lse = G.attention_fwd(q, q_pos, wkv.astype(q.dtype), wpos, wstart, floor,
                                   None if ckv is None else ckv.astype(q.dtype), topk, sink, qseg, wseg,
                                   window=cfg.window, scale=cfg.scale, wspan=cfg.wspan,
                                   interpret=be.endswith("interpret"), **_gpu_tuning(cfg, q, topk))
        return out, lse
    if be.startswith("pallas_tpu"):
        from dsv41_jax.kernels import pallas_tpu as T

        with_lse = with_lse and _fused_bwd(cfg, q)  # the kernel backward reads the log-sum-exp
        res = T.attention_fwd(q, q_pos, wkv.astype(q.dtype), wpos, wstart, floor,
                              None if ckv is None else ckv.astype(q.dtype), topk, sink, qseg, wseg,
                              window=cfg.window, scale=cfg.scale, wspan=cfg.wspan, block_k=_tpu_blocks(cfg)[0],
                              return_lse=with_lse, interpret=be.endswith("interpret"))
        return res if with_lse else (res, None)
    raise ValueError(be)


def _attn_reference(cfg: _AttnCfg, q, q_pos, wkv, wpos, floor, ckv, topk, sink, qseg, wseg):
    seg = {} if qseg is None else ({"segments": qseg} if cfg.variant == "sequence" else {"q_seg": qseg, "k_seg": wseg})
    if cfg.variant == "sequence":
        return _ref_attn.sequence_sparse_attention(q, wkv, wpos, ckv, topk, sink, window=cfg.window, floor=floor,
                                                   chunk=cfg.chunk, **seg)
    return _ref_attn.sparse_attention(q, q_pos, wkv, wpos, ckv, topk, sink, window=cfg.window, floor=floor,
                                      scale=cfg.scale, **seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, q_pos, wkv, wpos, wstart, floor, ckv, topk, sink, qseg, wseg):
    return _attn_fwd_impl(cfg, q, q_pos, wkv, wpos, wstart, floor, ckv, topk, sink, qseg, wseg)[0]


def _attention_fwd(cfg, q, q_pos, wkv, wpos, wstart, floor, ckv, topk, sink, qseg, wseg):
    out, lse = _attn_fwd_impl(cfg, q, q_pos, wkv, wpos, wstart, floor, ckv, topk, sink, qseg, wseg, with_lse=True)
    return out, (q, q_pos, wkv, wpos, wstart, floor, ckv, topk, sink, qseg, wseg, out, lse)


def _attention_bwd(cfg, res, g):
    q, q_pos, wkv, wpos, wstart, floor, ckv, topk, sink, qseg, wseg, out, lse = res
    if _fused_bwd(cfg, q) and cfg.backend.startswith("pallas_tpu"):
        from dsv41_jax.kernels import pallas_tpu as T

        block_k, key_block = _tpu_blocks(cfg)
        dq, dw, dc, ds = T.attention_bwd(q, q_pos, wkv.astype(q.dtype), wpos, wstart, floor,
                                         None if ckv is None else ckv.astype(q.dtype), topk, sink, out, lse, g,
                                         qseg, wseg, window=cfg.window, scale=cfg.scale, wspan=cfg.wspan,
                                         block_k=block_k, key_block=key_block,
                                         interpret=cfg.backend.endswith("interpret"))
        dw = dw.astype(wkv.dtype)
        dc = None if ckv is None else dc.astype(ckv.dtype)
    elif _fused_bwd(cfg, q):
        from dsv41_jax.kernels import pallas_gpu as G

        interp = cfg.backend.endswith("interpret")
        tuning = _gpu_tuning(cfg, q, topk, bwd=True)
        dq, dw, dc, ds = G.attention_bwd(q, q_pos, wkv.astype(q.dtype), wpos, wstart, floor,
                                         None if ckv is None else ckv.astype(q.dtype), topk, sink, out, lse, g,
                                         qseg, wseg, window=cfg.window, scale=cfg.scale, wspan=cfg.wspan,
                                         interpret=interp, **tuning)
        dw = dw.astype(wkv.dtype)
        dc = None if ckv is None else dc.astype(ckv.dtype)
    else:  # reference-recompute backward (fused_bwd=False): VJP of the plain-JAX reference
        def f(q_, wkv_, ckv_, sink_):
            return _attn_reference(cfg, q_, q_pos, wkv_, wpos, floor, ckv_, topk, sink_, qseg, wseg)

        _, vjp = jax.vjp(f, q, wkv, ckv, sink)
        dq, dw, dc, ds = vjp(g.astype(out.dtype))
    return dq, None, dw, None, None, None, dc, None, ds, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _is_packed(x) -> bool:
    """A packed cache buffer (``inference.packed_cache.PackedRows``; duck-typed: kernels do not import inference)."""
    return x is not None and hasattr(x, "fmt") and hasattr(x, "scales") and hasattr(x, "values")


def _unpacked(x):
    """A packed cache buffer unpacked to its dtype (the unpack-then-compute path), anything else as is."""
    if not _is_packed(x):
        return x
    from dsv41_jax.inference.packed_cache import read

    return read(x)


def ring_rows(ring, base):
    """A ring buffer's rows in window order (row j = slot (base + j) mod R, i.e. positions base - R .. base - 1 of
    ``inference.step.ring_read``), unpacked if packed: what the window ring of :func:`sparse_attention` stands for."""
    vals = _unpacked(ring)
    r = vals.shape[1]
    slot = jnp.mod(jnp.asarray(base, jnp.int32)[:, None] + jnp.arange(r, dtype=jnp.int32)[None, :], r)
    return jnp.take_along_axis(vals, slot.reshape(slot.shape + (1,) * (vals.ndim - 2)), axis=1)


def _gather_kernel(fused: bool, buf) -> bool:
    from dsv41_jax.kernels import packed_gather_gpu as PG

    return fused and buf.values.ndim == 3 and PG.fits(buf.dim, buf.fmt)


def selected_rows(buf, topk, dtype, *, fused: bool = False, interpret: bool = False):
    """The rows a top-k list selects from a packed cache buffer [B, N, D], unpacked to ``dtype``: (rows [B, C * K, D],
    top-k [B, C, K] remapped onto them: query c's entry j -> row c * K + j, -1 (empty) kept). Indices are clipped to
    [0, N) as the kernels clip them, so every entry reads the row it would read in the buffer. When C * K > N (a
    long chunk) the whole buffer unpacked is the smaller tensor and is returned with the top-k as it is; either way
    the kernel sees the same values in the same key blocks. ``fused``: the rows gathered and unpacked by one Pallas
    GPU kernel (``packed_gather_gpu.selected_rows``, bit-equal; ``interpret`` runs it in interpret mode) instead of
    plain JAX, where the row is one power-of-two tile."""
    from dsv41_jax.inference.packed_cache import unpack

    b, c, k = topk.shape
    n = int(buf.values.shape[1])
    if c * k > n:
        return unpack(buf.values, buf.scales, buf.fmt, dtype), topk
    if _gather_kernel(fused, buf):
        from dsv41_jax.kernels import packed_gather_gpu as PG

        rows = PG.selected_rows(buf.values, buf.scales, topk.reshape(b, c * k), fmt=buf.fmt, dim=buf.dim,
                                dtype=dtype, interpret=interpret)
    else:
        idx = jnp.clip(topk.astype(jnp.int32), 0, n - 1).reshape(b, c * k, 1)
        rows = unpack(jnp.take_along_axis(buf.values, idx, axis=1), jnp.take_along_axis(buf.scales, idx, axis=1),
                      buf.fmt, dtype)
    slots = jnp.arange(c * k, dtype=jnp.int32).reshape(1, c, k)
    return rows, jnp.where(topk >= 0, slots, -1).astype(topk.dtype)


def window_rows(ring, base, new, *, fused: bool = False, interpret: bool = False):
    """The window a ring stands for: its rows in window order (:func:`ring_rows`, unpacked if packed) followed by the
    chunk's own rows ``new`` [B, L, D], in ``new.dtype``. ``fused`` (a packed ring of [B, R, D] power-of-two-tile
    rows): one Pallas GPU kernel reads the packed slots, decodes them in registers and writes the whole window
    (``packed_gather_gpu.window_rows``, bit-equal)."""
    if _is_packed(ring) and _gather_kernel(fused, ring):
        from dsv41_jax.kernels import packed_gather_gpu as PG

        return PG.window_rows(ring.values, ring.scales, base, new, fmt=ring.fmt, ring_dtype=jnp.dtype(ring.dtype),
                              interpret=interpret)
    return jnp.concatenate([ring_rows(ring, base).astype(new.dtype), new], axis=1)


def reads_packed_cache(backend: str = "auto") -> bool:
    """Whether this backend's decode kernels read a packed (release-format) cache directly: the GPU (Triton) sparse
    attention and indexer kernels dequantise the rows they load in registers; the reference and TPU backends unpack
    the buffer first (``packed_cache.read``)."""
    return resolve_backend(backend).startswith("pallas_gpu")


def _per_shard(fn, args, dims, out_dims):
    """``fn(*args)``, run per shard under an active sharding context (``dsv41_jax.parallel.rules``).

    XLA's SPMD partitioner cannot split a Pallas call (an opaque custom call): under ``jit`` on a mesh it would
    gather the operands and run the whole kernel on every device. Inside ``shard_map`` each device runs the kernel
    on its own batch rows (and heads): ``dims`` gives, per argument, one letter per dimension — "b" (the batch,
    over the rules' ``batch`` axes), "h" (attention heads, over the ``heads`` axes) or None — or None for an absent
    (None) argument; ``out_dims`` the same for the outputs (a tuple of them when ``fn`` returns a tuple). Mesh axes
    that do not divide the dimension are dropped (as in ``parallel.rules.constrain``). Without a context, or when
    no axis splits anything, ``fn(*args)``. Gradients flow through (the transpose of a head- or batch-replicated
    operand, e.g. the sinks, sums over the shards)."""
    from dsv41_jax.parallel.rules import current

    ctx = current()
    if ctx is None:
        return fn(*args)
    from jax.sharding import PartitionSpec as P

    present = [a for a in args if a is not None]
    sizes = {}
    for a, d in zip(args, dims):
        if a is None:
            continue
        for n, letter in zip(a.shape, d):
            if letter is not None:
                sizes.setdefault(letter, n)

    def fitting(logical, n):
        axes = list(ctx.axes(logical))
        while axes and n % math.prod(ctx.mesh.shape[x] for x in axes):
            axes.pop()
        return tuple(axes)

    mesh_axes = {"b": fitting("batch", sizes.get("b", 1)), "h": fitting("heads", sizes.get("h", 1))}
    if ctx.mesh.size == 1:
        return fn(*args)
    # (with nothing split, still a shard_map: every device runs the whole kernel, which XLA cannot do for it)

    def spec(d):
        return P(*[None if x is None or not mesh_axes[x] else
                   (mesh_axes[x] if len(mesh_axes[x]) > 1 else mesh_axes[x][0]) for x in d])

    in_specs = tuple(spec(d) for a, d in zip(args, dims) if a is not None)
    tuple_out = isinstance(out_dims[0], tuple) or out_dims[0] is None
    outs = out_dims if tuple_out else (out_dims,)
    live = [i for i, d in enumerate(outs) if d is not None]

    def body(*shards):
        it = iter(shards)
        res = fn(*[None if a is None else next(it) for a in args])
        res = res if tuple_out else (res,)
        return tuple(res[i] for i in live)

    mapped = jax.shard_map(body, mesh=ctx.mesh, in_specs=in_specs, out_specs=tuple(spec(outs[i]) for i in live),
                           check_vma=False)(*present)
    full = [None] * len(outs)
    for i, r in zip(live, mapped):
        full[i] = r
    return tuple(full) if tuple_out else full[0]


def _floor_vec(floor, b):
    return jnp.broadcast_to(jnp.asarray(floor, jnp.int32).reshape(-1), (b,)) if jnp.ndim(floor) <= 1 else floor


def sparse_attention(q, q_pos, win_kv, win_pos, compressed_kv, topk, sink, *, window: int, floor=0,
                     scale: float | None = None, q_seg=None, k_seg=None, backend: str = "auto",
                     tuning: dict | None = None, win_ring=None, band: bool = False):
    """Decode / explicit-window form; same contract as ``ops.attention.sparse_attention``.

    q [B, C, H, D]; q_pos [B, C]; win_kv [B, L, D] with positions win_pos [B, L] (< 0 = empty);
    compressed_kv [B, N, D] or None; topk [B, C, K] (-1 = empty) or None; sink [H]; q_seg / k_seg optional
    document ids [B, C] / [B, L]. ``tuning``: GPU block sizes (see ``_gpu_tuning``).

    ``compressed_kv`` may be a packed cache buffer (``packed_cache.PackedRows``): the GPU kernel then reads the
    selected rows' packed bytes and scales and dequantises them in registers (forward only: the decode path),
    equal to running it on ``packed_cache.read(compressed_kv)``; the other backends unpack it first.
    ``tuning={"packed_attention": "gather"}`` (GPU backends; :data:`PACKED_ATTENTION_FORMS`) instead gathers and
    unpacks only the selected rows (:func:`selected_rows`) and the ring, then runs the bf16-cache kernel: the same
    result again.

    ``win_ring`` = (ring [B, R, D] array or packed buffer, base [B] int32): the window's first R rows are the ring's
    slots in window order (:func:`ring_rows`) and ``win_kv`` holds only the rows after them; ``win_pos`` /
    ``k_seg`` cover all R + L rows. The GPU kernel reads a packed ring's slots directly (FP8 + ue8m0 scales,
    dequantised in registers); otherwise the rows are materialised and concatenated first.

    ``band`` (a promise of the caller): the S window rows hold consecutive positions in order and the last C of them
    are the queries' own (row S - C + c at query c's position), as in a prefill chunk after its ring. The kernels
    then scan, per query, only the ``window`` rows that end at its own row (a per-query slot span, as the sequence
    form does) instead of all S rows for every query: the same keys (the masks are unchanged, and every row the
    masks admit lies in that span), so the same result up to the order of the float32 sums. The reference backend
    masks every row by position and ignores it."""
    be = resolve_backend(backend)
    tuning = dict(tuning or {})
    fits = not _is_packed(compressed_kv) or topk is None or (
        q.shape[1] * topk.shape[-1] <= compressed_kv.values.shape[1])
    form = packed_attention_form(q.shape[0] * q.shape[1], tuning.pop("packed_attention", None), fits)
    gather = form.startswith("gather") and be.startswith("pallas_gpu") and (
        win_ring is not None or (_is_packed(compressed_kv) and topk is not None and topk.shape[-1] > 0))
    if gather:  # the bf16-cache kernel over the selected rows, unpacked; its tuning has no packed-row entries
        tuning = {k_: v_ for k_, v_ in tuning.items() if not k_.startswith("packed_")}
        fused = dict(fused=form == "gather", interpret=be.endswith("interpret"))
        if _is_packed(compressed_kv) and topk is not None and topk.shape[-1] > 0:
            compressed_kv, topk = selected_rows(compressed_kv, topk, q.dtype, **fused)
        if win_ring is not None:
            win_kv = window_rows(*win_ring, win_kv, **fused)
            win_ring = None
    if _is_packed(compressed_kv) and not (be.startswith("pallas_gpu") and topk is not None and topk.shape[-1] > 0):
        compressed_kv = _unpacked(compressed_kv)
    if win_ring is not None and not (be.startswith("pallas_gpu") and _is_packed(win_ring[0]) and win_kv.shape[1]):
        win_kv = jnp.concatenate([ring_rows(*win_ring).astype(win_kv.dtype), win_kv], axis=1)
        win_ring = None
    if be == "reference":
        seg = {} if q_seg is None else {"q_seg": q_seg, "k_seg": k_seg}
        return reference.sparse_attention(q, q_pos, win_kv, win_pos, compressed_kv, topk, sink, window=window,
                                          floor=floor, scale=scale, **seg)
    b, c, _, d = q.shape
    n_ring = 0 if win_ring is None else int(win_ring[0].shape[1])
    s_len = n_ring + int(win_kv.shape[1])
    if band and s_len < c:
        raise ValueError(f"sparse_attention(band=True): {s_len} window rows cannot end with the {c} queries' own")
    wspan = min(int(window), s_len) if band else s_len
    cfg = _AttnCfg(be, "explicit", int(window), float(d ** -0.5 if scale is None else scale),
                   wspan, 0, tuple(sorted((tuning or {}).items())))
    if topk is not None and topk.shape[-1] == 0:
        compressed_kv, topk = None, None
    if compressed_kv is None or topk is None:
        compressed_kv, topk = None, None
    if band:  # query c's span: the window rows ending at its own row s_len - c_total + c (non-decreasing in c)
        wstart = jnp.maximum(s_len - c + jnp.arange(c, dtype=jnp.int32) - (int(window) - 1), 0)
        wstart = jnp.broadcast_to(wstart[None, :], (b, c))
    else:
        wstart = jnp.zeros((b, c), jnp.int32)
    qseg = None if q_seg is None else q_seg.astype(jnp.int32)
    wseg = None if q_seg is None else k_seg.astype(jnp.int32)
    if _is_packed(compressed_kv) or win_ring is not None:
        # forward-only kernel over packed rows (no VJP: a cache is not trained)
        from dsv41_jax.kernels import pallas_gpu as G

        q, win_kv = jax.lax.stop_gradient(q), jax.lax.stop_gradient(win_kv)
        if _is_packed(compressed_kv):
            ckv, ckv_fmt = (compressed_kv.values, compressed_kv.scales), compressed_kv.fmt
        else:
            ckv, ckv_fmt = None if compressed_kv is None else compressed_kv.astype(q.dtype), None
        ring, ring_fmt = None, None
        if win_ring is not None:
            ring = (win_ring[0].values, win_ring[0].scales, jnp.asarray(win_ring[1], jnp.int32))
            ring_fmt = win_ring[0].fmt
        tun = _gpu_tuning(cfg, q, topk)
        if b * c <= 32 and "num_warps" not in dict(cfg.tuning):
            # the in-register decode of a [block_k, 512] tile of packed rows spills at 4 warps (255 registers, 1.6 KB
            # of stack in the sm_90 SASS); 8 warps hold it without spills and ran the batch-1 kernel in 130.5 µs
            # against 259.1 on an H200 (benchmarks/RESULTS.md, 2026-12-02 18:41 UTC; the same outputs). At batch 32
            # (32-head tiles) the tile-load form spills less at 8 warps (640 B of stack against 1112) and ran 232.1 µs
            # against 258.1 at 4 (benchmarks/RESULTS.md, 2026-12-03); batches 5-31 are not measured.
            tun["num_warps"] = 8
        tun.setdefault("packed_load", G.PACKED_LOAD)  # read at trace time: the baseline form stays selectable
        tun.setdefault("packed_ahead", G.PACKED_AHEAD)
        out, _ = G.attention_fwd(q, q_pos.astype(jnp.int32), win_kv.astype(q.dtype), win_pos.astype(jnp.int32),
                                 wstart, _floor_vec(floor, b), ckv, None if topk is None else topk.astype(jnp.int32),
                                 sink, qseg, wseg, window=cfg.window, scale=cfg.scale, wspan=cfg.wspan,
                                 ckv_fmt=ckv_fmt, ring=ring, ring_fmt=ring_fmt, interpret=be.endswith("interpret"),
                                 **tun)
        return out
    return _attention(cfg, q, q_pos.astype(jnp.int32), win_kv, win_pos.astype(jnp.int32), wstart,
                      _floor_vec(floor, b), compressed_kv, None if topk is None else topk.astype(jnp.int32), sink,
                      qseg, wseg)


def sequence_sparse_attention(q, kv, positions, compressed_kv, topk, sink, *, window: int, floor=0,
                              chunk: int = 256, segments=None, backend: str = "auto", tuning: dict | None = None):
    """Whole-sequence (prefill / training) form; same contract as ``ops.attention.sequence_sparse_attention``.

    q [B, T, H, D]; kv [B, T, D] (the sequence's own window latents, key t at positions[:, t]); ``segments``
    [B, T] packed-document ids (positions restart per document)."""
    be = resolve_backend(backend)
    compressed_kv = _unpacked(compressed_kv)  # (a whole sequence's top-k lists: every packed form unpacks first)
    tuning = dict(tuning or {})
    packed_attention_form(q.shape[0] * q.shape[1], tuning.pop("packed_attention", None))
    if be == "reference":
        seg = {} if segments is None else {"segments": segments}
        return reference.sequence_sparse_attention(q, kv, positions, compressed_kv, topk, sink, window=window,
                                                   floor=floor, chunk=chunk, **seg)
    b, t, _, d = q.shape
    cfg = _AttnCfg(be, "sequence", int(window), float(d ** -0.5), int(window), int(chunk),
                   tuple(sorted((tuning or {}).items())))
    if topk is not None and topk.shape[-1] == 0:
        compressed_kv, topk = None, None
    if compressed_kv is None or topk is None:
        compressed_kv, topk = None, None
    wstart = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) - (window - 1), (b, t))
    pos = positions.astype(jnp.int32)
    seg = None if segments is None else segments.astype(jnp.int32)
    args = (q, pos, kv, pos, wstart, _floor_vec(floor, b), compressed_kv,
            None if topk is None else topk.astype(jnp.int32), sink, seg, seg)
    dims = (("b", None, "h", None), ("b", None), ("b", None, None), ("b", None), ("b", None), ("b",),
            ("b", None, None), ("b", None, None), ("h",), ("b", None), ("b", None))
    return _per_shard(functools.partial(_attention, cfg), args, [None if a is None else d for a, d in zip(args, dims)],
                      ("b", None, "h", None))


# ----------------------------------------------------------------------------------------------------------------
# Indexer
# ----------------------------------------------------------------------------------------------------------------

def _indexer_ops(be: str, packed=None):
    """(score_pool, gather_score, select) for a kernel backend; ``packed`` (GPU only): the keys' packed buffer, whose
    format the score kernels are told (they then take its (values, scales) as the keys)."""
    interp = be.endswith("interpret")
    if be.startswith("pallas_gpu"):
        from dsv41_jax.kernels import pallas_gpu as G

        def select(v, i, k):
            if v.shape[-1] > G.SELECT_MAX:
                return hier_topk.select_xla(v, i, k)
            return G.select(v, i, k, interpret=interp)

        kfmt = {} if packed is None else dict(keys_fmt=packed.fmt, keys_dtype=str(jnp.dtype(packed.dtype)),
                                              packed_load=G.PACKED_LOAD)
        return (functools.partial(G.score_pool, interpret=interp, **kfmt),
                functools.partial(G.gather_score, interpret=interp, **kfmt), select)
    from dsv41_jax.kernels import pallas_tpu as T

    return functools.partial(T.score_pool, interpret=interp), T.gather_score, hier_topk.select_xla


def indexer_topk(q, weights, keys, q_pos, *, ratio: int, topk: int, pool=None, block_size: int = 8,
                 candidate_topk_blocks: int | None = None, backend: str = "auto", pool_format: str = "auto"):
    """Same contract as ``ops.indexer.indexer_topk`` (top-k sorted by position, -1 padded; identical index sets).

    ``pool`` may be a block mask [B, C, n_blocks] (bool) or kept block ids [B, C, P] (int); the new pool (candidate
    source only) is returned as ``pool_format``: "mask", "ids", or "auto" (= mask for the reference backend, ids for
    kernel backends, which then never touch O(N) data in Reindex layers).

    ``keys`` may be a packed cache buffer (``packed_cache.PackedRows``): the GPU score kernels read its FP4 bytes and
    scales and dequantise in registers (same index sets as on ``packed_cache.read(keys)``); other backends unpack it.
    """
    be = resolve_backend(backend)
    if pool_format == "auto":
        pool_format = "mask" if be == "reference" else "ids"
    g1 = block_size
    packed = keys if _is_packed(keys) and be.startswith("pallas_gpu") and not g1 & (g1 - 1) else None
    if packed is None:
        keys = _unpacked(keys)
    if be == "reference" or g1 & (g1 - 1):
        return reference.indexer_topk(q, weights, keys, q_pos, ratio=ratio, topk=topk, pool=pool,
                                      block_size=block_size, candidate_topk_blocks=candidate_topk_blocks,
                                      pool_format=pool_format)
    kw = dict(be=be, ratio=ratio, topk=topk, g1=g1, candidate_topk_blocks=candidate_topk_blocks,
              pool_format=pool_format)
    if packed is not None:  # a packed decode cache (the engine's GPU step, not split by a mesh) goes to the kernels
        return _indexer_kernels(q, weights, packed, q_pos, pool, **kw)
    pool_dims = None if pool is None else ("b", None, None)
    out_dims = (("b", None, None), None if candidate_topk_blocks is None else ("b", None, None))
    return _per_shard(lambda *a: _indexer_kernels(*a, **kw), (q, weights, keys, q_pos, pool),
                      (("b", None, None, None), ("b", None, None), ("b", None, None), ("b", None), pool_dims),
                      out_dims)


def _indexer_kernels(q, weights, keys, q_pos, pool, *, be, ratio, topk, g1, candidate_topk_blocks, pool_format):
    """The kernel backends' body of :func:`indexer_topk` (one shard's batch rows under a mesh). ``keys``: an array,
    or a packed cache buffer for the GPU kernels to dequantise in registers."""
    packed = keys if _is_packed(keys) else None
    if packed is None and be.startswith("pallas_tpu") and q.dtype != keys.dtype:
        # One dtype in the kernel's dots (Mosaic refuses mixed 16 / 32-bit operands): the queries' when they are
        # 16-bit (bf16 training), the keys' otherwise. float32 keys under the release's FP4 fake quantisation (e2m1
        # values x power-of-two scales) are exact in bf16; without it this rounds the keys of a selection (no
        # gradient flows through the indexer) to bf16.
        if jnp.dtype(q.dtype).itemsize == 2:
            keys = keys.astype(q.dtype)
        else:
            q = q.astype(keys.dtype)
    b, c = q.shape[:2]
    n = keys.shape[1]
    if packed is not None:
        keys = (packed.values, packed.scales)
    q, weights, keys = (jax.lax.stop_gradient(x) for x in (q, weights, keys))
    n_blocks = -(-n // g1)
    vis = (q_pos.astype(jnp.int32) + 1) // ratio  # visible count (unclipped, like the reference)
    score_pool, gather_score, select = _indexer_ops(be, packed)
    leaf = functools.partial(gather_score, q, weights, keys, vis)
    if n == 0:
        sel = jnp.full((b, c, 0), -1, jnp.int32)
        new_pool = None
        if candidate_topk_blocks is not None:
            new_pool = jnp.zeros((b, c, 0), bool if pool_format == "mask" else jnp.int32)
        return sel, new_pool
    bmax = smax = None
    if pool is None or candidate_topk_blocks is not None:
        bmax, smax = score_pool(q, weights, keys, vis, g1=g1)
    if pool is not None:
        ids = pool if jnp.issubdtype(pool.dtype, jnp.integer) else pool_mask_to_ids(pool, n_blocks)
        cand = hier_topk.pool_entries(ids.astype(jnp.int32), g1, n)
        sel = hier_topk.select_in_pool(leaf(cand), cand, g1, topk, n, select)
    else:
        sel = hier_topk.top_entries(bmax, smax, n, g1, topk, select, leaf)
    new_pool = None
    if candidate_topk_blocks is not None:
        newest = jnp.where(vis > 0, (vis - 1) // g1, -1)
        bpin, spin = hier_topk.pin_newest(bmax, smax, newest)
        ids = hier_topk.top_blocks(bpin, spin, candidate_topk_blocks, select)
        new_pool = pool_ids_to_mask(ids, n_blocks) if pool_format == "mask" else ids
    return sel, new_pool
