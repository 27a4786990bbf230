"""The cached forward over a chunk of new tokens: the one primitive behind prefill chunks, the CED decoder replay
and decode steps (a decode step is a chunk of one token).

Every sequence slot ``b`` of the batch holds ``pos0[b]`` tokens already; the chunk brings ``n_valid[b]`` new ones
(a prefix of the chunk's ``C`` columns; the rest is padding) at positions ``pos0[b] + i``. Nothing of the padding
reaches the caches or the valid tokens:

* SWA: window keys are the slot's ring (positions derived from ``pos0``, see ``cache.py``) followed by the chunk's
  own latents, padding given position -1 (invisible); only valid tokens are written back to the ring.
* Compressor: the slot's partial group is prepended (per-slot shift) to the chunk's projections; only complete
  groups made of valid tokens become entries, written at their own entry index; the new partial group is kept.
* Indexer: queries score the source's cached keys under the per-query visibility ``s < (pos + 1) // m`` after this
  chunk's entries were written, so a query sees exactly the entries a whole-sequence forward shows it.
* Engram: the host computes row ids per sequence from its own history; the gate of padding tokens is shut.

The maths is the training forward's (the same ``ops`` functions); only the bookkeeping differs. The HSI pool is
carried as sorted candidate-block ids; a Reindex layer either masks its full score row to the pool (prefill) or
gathers and scores only the pool's ``candidate_topk_blocks * candidate_block_size`` entries (decode) — the same
top-k, since the gathered candidates keep entry order and ``lax.top_k`` breaks ties towards the lower index.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from dsv41_jax.compilation_cache import ProgramStore
from dsv41_jax import kernels
from dsv41_jax.config import ModelConfig, ceil_div
from dsv41_jax.ops.attention import attention_inputs, attention_output
from dsv41_jax.ops.compressor import compressed_entries, pool_groups, project_compressor_inputs
from dsv41_jax.ops.engram import engram_write
from dsv41_jax.ops.indexer import indexer_queries, indexer_scores, mask_invisible, select_topk, visible_counts
from dsv41_jax.ops.mhc import collapse, collapse_rms_norm, expand, mhc_coefficients
from dsv41_jax.inference import packed_cache as PC
from dsv41_jax.inference.moe import moe_inference
from dsv41_jax.ops.moe import is_hopper_gpu, moe
from dsv41_jax.ops.linear import head_logits, linear
from dsv41_jax.ops.norms import rms_norm
from dsv41_jax.ops.query_blocks import map_query_blocks
from dsv41_jax.ops.rope import cos_sin, rope_tables
from dsv41_jax.plan import FULL, REINDEX, LayerSpec

_HI = jax.lax.Precision.HIGHEST
NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class InferenceOptions:
    """Static options of the cached forward (hashable: they are part of the jit cache key)."""

    quant_sim: bool | None = None  # None -> config.quant_sim
    moe_impl: str = "tiled"  # "tiled" (inference.moe: grouped matmul over the used experts) | "ragged" | "dense"
    replay_len: int | None = None  # CED decoder replay length; None -> sliding_window (128 released)
    ced: bool = True  # False: prefill runs every layer over the whole prompt ("full replay")
    query_chunk: int = 256  # attention queries per block inside a chunk
    index_block_elems: int = 1 << 24  # budget for one [queries, index heads, entries] block of indexer scores
    hsi_gather: bool | None = None  # Reindex scoring by gathering the pool (None: when the chunk is small and
    #                                the pool is smaller than the cache)
    hsi_gather_max_chunk: int = 8  # "small chunk" for the automatic choice
    index_key_block: int | None = 4096  # Full/Reindex scoring streams over blocks of this many entries, visible
    #                                     ones only (None: score the whole cache row at once) ...
    prefill_key_block: int = 512  # ... and this many in prefill chunks (many queries: less work past the visible end)
    compiler_options: tuple = ()  # XLA compiler options as (name, value) pairs, e.g. fast compiles for CPU tests
    kernel_backend: str = "auto"  # dsv41_jax.kernels backend for sparse attention and the indexer top-k: "auto"
    #                               (Pallas on GPU / TPU, the plain-JAX reference on CPU) or one of kernels.BACKENDS
    mhc_kernel: bool | None = None  # each mHC site's softmax + Sinkhorn in one Pallas GPU kernel (kernels.mhc_gpu)
    #                                 instead of XLA's unrolled normalisations; None: on the "pallas_gpu" backend
    #                                 (not its interpret mode). Why by default there: the unrolled Sinkhorn made
    #                                 XLA:GPU's priority fusion search Triton tilings for minutes (benchmarks/RESULTS)
    mhc_one_pass: bool | None = None  # steps of at most 64 tokens (decode): each mHC site's projection and RMS as
    #                             one reduction, the stream mixes as unrolled sums (fewer kernels; ops.mhc); None: on
    #                             the "pallas_gpu" backend, where the coefficient kernel then also applies the RMS
    #                             (kernels.mhc_gpu): 4 launches fewer per layer in the H200 decode step
    #                             (benchmarks/decode_kernel_inventory.py), the same float32 maths
    mhc_projection: str | None = None  # with mhc_one_pass and the coefficient kernel: the one-pass sums as "reduce"
    #                             (one multiply-reduce), "gemm" (a float32 GEMM + a sum of squares) or "kernel"
    #                             (one Pallas kernel, kernels.mhc_gpu.mhc_sums_kernel); None: "reduce"
    #                             (ops.mhc.mhc_coefficients' projection; why: benchmarks/RESULTS.md 15:15, 00:05)
    mhc_partials: int | None = None  # with the "reduce" projection: its partial sums per entry handed to the
    #                             coefficient kernel (ops.mhc.mhc_coefficients' partials); None: 32 at one token,
    #                             64 up to 32 tokens, else 1
    norm_kernel: bool | None = None  # each site's mHC collapse and RMS norm in one Pallas GPU kernel (ops.mhc.
    #                             collapse_rms_norm; XLA runs them as 3 kernels), the q-LoRA norm in one (XLA: 2);
    #                             None: steps of at most 64 tokens on the "pallas_gpu" backend (not its interpret
    #                             mode): 5 launches fewer per layer in the H200 decode step (decode_kernel_inventory)
    router_one_pass: bool | None = None  # steps of at most 64 tokens: the MoE router's logits as one reduction
    #                                (ops.moe.route) instead of a split-K float32 GEMM + the sum of its chunks; None:
    #                                on the "pallas_gpu" backend
    grouped_prefill_moe: bool | None = None  # prefill chunks' routed experts (token counts past the static decode
    #                             paths) as one Mosaic GPU grouped GEMM per projection instead of the tiled loop
    #                             (inference.moe.moe_inference ``grouped``); None: on a Hopper GPU with the
    #                             "pallas_gpu" backend. Measured on an H200 (2026-12-03): a 32K-token CED prefill of
    #                             the 12-layer bench model 0.81 s against 2.05 s on the tiled loop (RESULTS.md)
    gemm_input_fp8: bool = False  # the release's FP8 rounding of every FP8 / FP4 GEMM's input (ForwardOptions)
    quantized_gemm: str = "reference"  # with gemm_input_fp8: how QuantizedTensor GEMMs run — "reference" (dequantise
    #                                    in XLA) or a kernels.quant_gemm backend ("auto", "pallas_gpu", "pallas_tpu")
    fp4_one_token: bool = True  # one token's release FP4 routed experts on the GPU kernels as two gemv kernels over
    #                             its picks (inference.moe.routed_fp4_one_token) instead of the grouped FP4 kernel:
    #                             measured faster in the step (H200, 2026-12-02, 12-layer bench model at batch 1:
    #                             1.10 vs 1.50 ms of expert kernels, 3.76 vs 4.30 ms per queued step; the first
    #                             form of its down kernel had been slower; benchmarks/RESULTS.md)
    fp4_slot_decode: str | None = None  # those kernels' decode form (kernels.quant_gemm_gpu.FP4_SLOT_DECODES; None:
    #                                     the kernels' default) — to measure one form against another in one run
    fp4_every_expert: bool = False  # decode batches' (2-64 tokens, tokens x top-k >= experts) release FP4 routed
    #                             experts on the GPU kernels as every expert on every token (inference.moe.
    #                             routed_fp4_every_expert: two kernels over dense routing weights, no sort / tile
    #                             table / scatter) instead of the grouped FP4 kernel. Off: on an H200 (2026-12-03
    #                             18:00 UTC, 40-layer bench model, batch 32) 24.14 vs 23.07 ms per step, its kernels
    #                             0.88x the grouped path's (benchmarks/RESULTS.md)
    gemm_input_kernel: bool | None = None  # with a "pallas_gpu" quantized_gemm backend: each GEMM input's FP8
    #                             rounding as one Pallas kernel (kernels.quant_gemm.fp8_round, bit for bit the same
    #                             values) instead of XLA's two (block amax, then the rounding); None: on when
    #                             quantized_gemm resolves to "pallas_gpu" (not its interpret mode). H200, 40-layer
    #                             bench model, packed cache (benchmarks/RESULTS.md, 2026-12-03 18:00 UTC): 1.0-1.3 µs
    #                             a rounding against 2.0-3.4; the step 9.82 -> 9.75 ms at batch 1, 24.14 -> 23.84 ms
    #                             at batch 32 (on the every-expert MoE); 4 launches a layer fewer
    fp8_gemm_tuning: tuple = ()  # (name, value) pairs for the FP8 dense kernel on the GPU (kernels.quant_gemm_gpu.
    #                              fp8_gemm: e.g. (("mma_rows", "weights"),); empty: its defaults) — to measure one
    #                              form against another in one run
    fp4_grouped_tuning: tuple = ()  # (name, value) pairs for the grouped FP4 expert kernel (kernels.quant_gemm_gpu.
    #                                 fp4_grouped_gemm: mma_rows, decode, block sizes; empty: its defaults) — to
    #                                 measure one form against another in one run
    banded_chunk_attention: bool | None = None  # a chunk of more than ``query_chunk`` queries attends in one kernel
    #                             call where each query scans only its own window's rows (``kernels.sparse_attention``
    #                             ``band``) instead of a map over query blocks that each scan the ring plus the whole
    #                             block; None: on the "pallas_gpu" backends (other backends keep the map: the
    #                             reference's per-block scores bound its memory; the TPU kernel is not measured so).
    #                             H200, 32K CED prefill of the 12-layer bench model: 0.557 vs 0.626 s (RESULTS.md)
    engram_host_gather: str | None = None  # Engram tables in host memory (inference.host_tables): how each step's
    #                             rows reach the device (ops.gather.HOST_GATHERS: "kernel", the GPU reads them from
    #                             pinned host memory; "host", gathered by XLA host compute); None: "kernel" on a CUDA
    #                             GPU, "host" elsewhere — to measure one form against another in one run
    packed_cache_kernels: bool = False  # with cache="release" on the GPU kernels: the sparse attention and the
    #                                     indexer read the packed window ring, compressed KV and keys and dequantise
    #                                     in registers, instead of unpacking whole buffers first. Equal to the
    #                                     unpacking path bit for bit in interpret mode on CPU, but off by default:
    #                                     on an H200 (2026-12-02) the attention kernel on packed rows was slower
    #                                     (303 vs 155 µs, one Full layer, context 16K) and its output differed from
    #                                     the unpacking path, the indexer slower too (184 vs 142 µs; RESULTS.md)
    decode_dot_merger: bool | None = None  # XLA's dot merger in the decode / verification programs (one to a few
    #                              tokens): it joins GEMMs that share an input by copying their weights into one
    #                              matrix before the GEMM, every step (the shared expert's gate + up, q-LoRA + KV +
    #                              indexer projections). None: off in the speculative verification programs on
    #                              the "pallas_gpu" backend, on in plain decode (decode_compiler_options).
    #                              H200, DSpark bench recipe, batch 1: verification step 2.81 -> 2.62 ms. Plain
    #                              decode keeps it: on the 40-layer bench model at batch 32 the split GEMMs are
    #                              1,560 -> 1,660 launches per step (39.0 -> 41.5 per layer, deviceless H200
    #                              compile), their step time not measured (RESULTS.md)
    verification_compiler_options: tuple | None = None  # XLA options added to the speculative programs only
    #                              (verification, drafting, the speculative device loop), after compiler_options.
    #                              None: XLA's Triton GEMMs (TRITON_GEMMS) on the "pallas_gpu" backend, whatever the
    #                              process's XLA_FLAGS say, nothing elsewhere; () adds nothing. H200, DSpark bench
    #                              recipe, batch 1: the greedy step 2.22 -> 1.99 ms, same tokens; the speculative
    #                              device loop's compile 17 -> 22 s (RESULTS.md, "DSpark on the H200", calls 12-13)

    attention_split_rule: str | None = None  # the GPU sparse attention's split of the key list over programs
    #                              (kernels.SPLIT_RULES; None: kernels.SPLIT_RULE) — the packed and bf16 caches alike
    packed_attention: str | None = None  # with packed_cache_kernels: how the GPU sparse attention reads the packed
    #                              cache (kernels.PACKED_ATTENTION_FORMS: "kernel", dequantised in its registers;
    #                              "gather", the selected rows gathered and unpacked by one fused Pallas kernel,
    #                              then the bf16-cache kernel; "gather_xla", the same gathers by XLA; None:
    #                              kernels.packed_attention_form's default, a gather form where the selected rows
    #                              fit the buffer ("gather" from kernels.PACKED_FUSED_GATHER_MIN_ROWS query rows):
    #                              on an H200 the batch-32 release step 22.85 -> 20.36 ms, batch 1 10.01 -> 9.30 ms
    #                              with XLA's gathers; one batch-32 layer 99.8 -> 71.3 µs fused, RESULTS.md)

    def resolved_quant(self, config: ModelConfig) -> bool:
        return config.quant_sim if self.quant_sim is None else self.quant_sim

    def resolved_replay(self, config: ModelConfig) -> int:
        return config.sliding_window if self.replay_len is None else self.replay_len


FAST_COMPILE = (("xla_backend_optimization_level", 0), ("xla_llvm_disable_expensive_passes", True))
TRITON_GEMMS = (("xla_gpu_enable_triton_gemm", True),)  # the speculative programs' GEMMs on the GPU backend


def _kernels_read_packed(opts: InferenceOptions) -> bool:
    """Whether this step hands a packed cache to the kernels as it is (``InferenceOptions.packed_cache_kernels`` on a
    backend whose kernels read packed rows) rather than unpacking the buffers first."""
    return opts.packed_cache_kernels and kernels.reads_packed_cache(opts.kernel_backend)


@functools.lru_cache(maxsize=None)
def _jit(fn, static: tuple, donate: tuple, compiler_options: tuple):
    jitted = jax.jit(fn, static_argnames=static, donate_argnames=donate,
                     compiler_options=dict(compiler_options) if compiler_options else None)
    return ProgramStore(fn, jitted, static, donate, compiler_options)


def jit_for(fn, opts: "InferenceOptions", static=("config", "opts"), donate=("cache",)):
    """``fn`` jitted with the options' XLA compiler options (one wrapper per function and option set). While the
    persistent compilation cache is on, its compiled programs are also stored serialised, so that a later process
    loads them without tracing (``dsv41_jax.compilation_cache.ProgramStore``)."""
    return _jit(fn, tuple(static), tuple(donate), tuple(opts.compiler_options))


def _rope(config: ModelConfig) -> dict:
    return {k: jnp.asarray(v) for k, v in rope_tables(config).items()}


def _batch_index(b: int, c: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(b)[:, None], (b, c))


# ----------------------------------------------------------------------------------------------------------
# Rings
# ----------------------------------------------------------------------------------------------------------

def ring_read(ring: jax.Array, pos0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The ring's contents in position order (positions pos0 - W .. pos0 - 1) and those positions (-1 = none)."""
    ring = PC.read(ring)  # packed (release) layout: unpacked at read in this reference path
    b, w = ring.shape[:2]
    p = pos0[:, None] - w + jnp.arange(w)[None, :]
    vals = jnp.take_along_axis(ring, jnp.mod(p, w).reshape(b, w, *([1] * (ring.ndim - 2))), axis=1)
    return vals, ring_positions(pos0, w)


def ring_positions(pos0: jax.Array, w: int) -> jax.Array:
    """Positions of a W-slot ring's contents in :func:`ring_read`'s order (pos0 - W .. pos0 - 1; -1 = none)."""
    p = pos0[:, None] - w + jnp.arange(w)[None, :]
    return jnp.where(p >= 0, p, -1)


def ring_write(ring: jax.Array, vals: jax.Array, pos0: jax.Array, n_valid: jax.Array) -> jax.Array:
    """Write the last min(W, n_valid) valid chunk values at slots (pos0 + i) mod W."""
    b, c = vals.shape[:2]
    w = ring.shape[1]
    i = jnp.arange(c)[None, :]
    keep = (i < n_valid[:, None]) & (i >= n_valid[:, None] - w)
    slot = jnp.where(keep, jnp.mod(pos0[:, None] + i, w), w)  # w is out of range: dropped
    return PC.set_rows(ring, (_batch_index(b, c), slot), vals)  # either layout


# ----------------------------------------------------------------------------------------------------------
# Compressor (streaming) and indexer keys
# ----------------------------------------------------------------------------------------------------------

def emit_entries(src: dict, x: jax.Array, comp: dict, idx_p: dict, ratio: int, pos0: jax.Array, n_valid: jax.Array,
                 config: ModelConfig, rope: dict, quant_on: bool) -> dict:
    """Compress the chunk's valid tokens into a KV source's cache: complete groups become entries (rotated and
    quantised main KV + indexer keys), the incomplete tail is kept as the partial group."""
    c = config
    b, t, _ = x.shape
    nmax = src["kv"].shape[1]
    src = dict(src)
    if ratio == 1:
        latent = rms_norm(linear(x, comp["wkv"]), comp["norm"], c.rms_norm_eps)
        k = jnp.arange(t)[None, :]
        entry = pos0[:, None] + k
        complete = k < n_valid[:, None]
    else:
        m = ratio
        kv, gate = project_compressor_inputs(x, comp["wkv"], comp.get("wgate"))  # float32 [B, C, hd]
        r = jnp.mod(pos0, m)
        groups = ceil_div(m + t, m)
        span = groups * m
        j = jnp.arange(span)[None, :]
        take = jnp.clip(jnp.where(j < r[:, None], j, m + j - r[:, None]), 0, m + t - 1)[..., None]
        xk = jnp.take_along_axis(jnp.concatenate([src["buf_kv"], kv], axis=1), take, axis=1)
        xg = jnp.take_along_axis(jnp.concatenate([src["buf_gate"], gate], axis=1), take, axis=1)
        latent = pool_groups(xk, xg, comp["norm"], m, c.rms_norm_eps, x.dtype)  # [B, groups, hd]
        k = jnp.arange(groups)[None, :]
        filled = r + n_valid
        complete = (k + 1) * m <= filled[:, None]
        entry = (pos0 // m)[:, None] + k
        start = (filled // m) * m
        tail = (start[:, None] + jnp.arange(m)[None, :])[..., None]
        src["buf_kv"] = jnp.take_along_axis(xk, tail, axis=1)
        src["buf_gate"] = jnp.take_along_axis(xg, tail, axis=1)
    ccos, csin = cos_sin(rope["compress"], entry * ratio)
    rotated, keys = compressed_entries(latent, idx_p, ccos, csin, c.rms_norm_eps, quant_on)
    where = jnp.where(complete, entry, nmax)
    bi = _batch_index(b, entry.shape[1])
    src["kv"] = PC.set_rows(src["kv"], (bi, where), rotated)  # either layout (packed_cache)
    src["keys"] = PC.set_rows(src["keys"], (bi, where), keys)
    return src


# ----------------------------------------------------------------------------------------------------------
# Indexer with the HSI pool as sorted block ids
# ----------------------------------------------------------------------------------------------------------

def candidate_block_ids(scores: jax.Array, q_pos: jax.Array, ratio: int, block_size: int,
                        topk_blocks: int) -> jax.Array:
    """HSI level one as block ids: [B, C, min(topk_blocks, n_blocks)] sorted ascending, -1 (last) for none.

    Same selection as :func:`dsv41_jax.ops.indexer.candidate_blocks` (block max-pool, newest visible block
    pinned, -inf blocks dropped), kept as ids so a decode step can gather the pool instead of masking.
    """
    n = scores.shape[-1]
    n_blocks = ceil_div(n, block_size)
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, n_blocks * block_size - n)), constant_values=NEG_INF)
    block_scores = jnp.max(padded.reshape(*scores.shape[:-1], n_blocks, block_size), axis=-1)
    newest = (visible_counts(q_pos, ratio) - 1) // block_size
    block_scores = jnp.where(jnp.arange(n_blocks)[None, None, :] == newest[..., None], jnp.inf, block_scores)
    values, picks = jax.lax.top_k(block_scores, min(topk_blocks, n_blocks))
    picks = jnp.sort(jnp.where(values > NEG_INF, picks, n_blocks), axis=-1)
    return jnp.where(picks >= n_blocks, -1, picks).astype(jnp.int32)


def block_ids_to_mask(ids: jax.Array, n_blocks: int) -> jax.Array:
    b, c, k = ids.shape
    mask = jnp.zeros((b, c, n_blocks), bool)
    where = jnp.where(ids >= 0, ids, n_blocks)
    return mask.at[jnp.arange(b)[:, None, None], jnp.arange(c)[None, :, None], where].set(True, mode="drop")


def _pad_last(x: jax.Array, width: int, value) -> jax.Array:
    if x.shape[-1] >= width:
        return x[..., :width]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])], constant_values=value)


def pooled_topk(q: jax.Array, weights: jax.Array, keys: jax.Array, q_pos: jax.Array, pool_ids: jax.Array, *,
                ratio: int, block_size: int, topk: int) -> jax.Array:
    """Top-k inside the HSI pool by scoring only the pooled entries (gathered): [B, C, min(topk, N)].

    Equal to masking the full score row to the pool and taking the top-k there: candidates are gathered in
    ascending entry order, so ties resolve to the same (lowest) entries.
    """
    n = keys.shape[1]
    b, c, kb = pool_ids.shape
    cand = (pool_ids[..., None] * block_size + jnp.arange(block_size)).reshape(b, c, kb * block_size)
    ok = jnp.repeat(pool_ids >= 0, block_size, axis=-1) & (cand < n)
    safe = jnp.where(ok, cand, 0)
    gathered = jax.vmap(lambda kb_, ib: kb_[ib])(keys, safe)  # [B, C, M, di]
    di = q.shape[-1]
    dots = jnp.einsum("bchd,bcmd->bchm", q.astype(jnp.float32), gathered.astype(jnp.float32), precision=_HI)
    dots = jax.nn.relu(dots) * (di ** -0.5)
    scores = jnp.einsum("bchm,bch->bcm", dots, weights.astype(jnp.float32), precision=_HI)
    scores = jnp.where(ok & (cand < visible_counts(q_pos, ratio)[..., None]), scores, NEG_INF)
    kk = min(topk, cand.shape[-1])
    values, j = jax.lax.top_k(scores, kk)
    idx = jnp.where(values > NEG_INF, jnp.take_along_axis(cand, j, axis=-1), n)
    idx = jnp.sort(idx, axis=-1)
    idx = jnp.where(idx >= n, -1, idx).astype(jnp.int32)
    return _pad_last(idx, min(topk, n), -1)


def run_indexer(ip: dict, x: jax.Array, q_res: jax.Array, spec: LayerSpec, pos: jax.Array, keys: jax.Array,
                pool_ids: jax.Array | None, config: ModelConfig, rope: dict, opts: InferenceOptions,
                quant_on: bool):
    """(top-k [B, C, min(index_topk, N)], new pool ids or None) of a Full / Reindex layer for the chunk."""
    c = config
    b, t, _ = x.shape
    n = keys.shape[1]
    cos, sin = cos_sin(rope["compress"], pos)
    qi, w = indexer_queries(ip, x, q_res, cos, sin, n_heads=c.index_n_heads, head_dim=c.index_head_dim,
                            quant_on=quant_on)
    bs = c.candidate_block_size
    restricted = spec.uses_candidates and pool_ids is not None
    if kernels.resolve_backend(opts.kernel_backend) != "reference":
        # Pallas: streaming scores + hierarchical top-k (no [queries, entries] score matrix in HBM); Reindex layers
        # score only the gathered pool. Same index sets as the plain-JAX paths below.
        return kernels.indexer_topk(qi, w, keys, pos, ratio=spec.ratio, topk=c.index_topk,
                                    pool=pool_ids if restricted else None, block_size=bs,
                                    candidate_topk_blocks=c.candidate_topk_blocks if spec.candidate_source else None,
                                    backend=opts.kernel_backend, pool_format="ids")
    n_blocks = ceil_div(n, bs)
    if restricted:
        gather = opts.hsi_gather
        if gather is None:
            gather = t <= opts.hsi_gather_max_chunk and pool_ids.shape[-1] * bs < n
        if gather:
            topk = pooled_topk(qi, w, keys, pos, pool_ids, ratio=spec.ratio, block_size=bs, topk=c.index_topk)
            return topk, None

    cand = c.candidate_topk_blocks if spec.candidate_source else None
    if opts.index_key_block:
        kb = opts.index_key_block if t <= opts.hsi_gather_max_chunk else min(opts.index_key_block,
                                                                            opts.prefill_key_block)
        kb = max(bs, min(kb, n) // bs * bs)

        def block(qc, wc, pc, *pool_c):
            pool_mask = block_ids_to_mask(pool_c[0], n_blocks) if pool_c else None
            return streaming_select(qc, wc, keys, pc, ratio=spec.ratio, topk=c.index_topk, block_size=bs,
                                    key_block=kb, candidate_topk_blocks=cand, pool_mask=pool_mask)

        width = kb
    else:
        def block(qc, wc, pc, *pool_c):
            scores = mask_invisible(indexer_scores(qc, wc, keys), pc, spec.ratio)
            new_pool = None
            if cand is not None:
                new_pool = candidate_block_ids(scores, pc, spec.ratio, bs, cand)
            if pool_c:
                in_pool = jnp.take(block_ids_to_mask(pool_c[0], n_blocks), jnp.arange(n) // bs, axis=-1)
                scores = jnp.where(in_pool, scores, NEG_INF)
            return select_topk(scores, c.index_topk), new_pool

        width = n
    q_block = max(1, min(t, opts.index_block_elems // max(1, c.index_n_heads * width)))
    args = (qi, w, pos) + ((pool_ids,) if restricted else ())
    topk, new_pool = map_query_blocks(block, t, q_block, *args)
    return topk, new_pool


def _merge_topk(vals, ids, new_vals, new_ids, k):
    """Top-k of the union of a running selection and a new block. The running entries come first, so equal
    values keep the lower (earlier) index — the tie order of one ``lax.top_k`` over the whole row."""
    v = jnp.concatenate([vals, new_vals], axis=-1)
    i = jnp.concatenate([ids, jnp.broadcast_to(new_ids, new_vals.shape)], axis=-1)
    top, j = jax.lax.top_k(v, k)
    return top, jnp.take_along_axis(i, j, axis=-1)


def streaming_select(q, weights, keys, q_pos, *, ratio: int, topk: int, block_size: int, key_block: int,
                     candidate_topk_blocks: int | None = None, pool_mask: jax.Array | None = None):
    """The indexer's selection over the visible entries only, one key block at a time, with running top-k merges.

    Same result as scoring the whole row (``indexer_scores`` + ``mask_invisible`` + ``candidate_block_ids`` +
    pool masking + ``select_topk``) but the work and the [C, heads, entries] buffer scale with the number of
    VISIBLE entries (a dynamic loop over ``key_block``-sized blocks), not with the cache length: a decode step
    costs what its context needs, and a prefill chunk scores what its queries can see. ``keys`` [B, N, di] with
    N a multiple of ``block_size``; ``pool_mask`` [B, C, N / block_size] restricts the top-k (Reindex).
    Returns (top-k [B, C, min(topk, N)], candidate block ids [B, C, min(candidate_topk_blocks, N / bs)] or None).
    """
    b, c = q_pos.shape
    n = keys.shape[1]
    bs = block_size
    if n % bs:
        raise ValueError(f"streaming_select needs the entry count ({n}) to be a multiple of the block size ({bs})")
    kb = key_block
    n_blocks = n // bs
    vis = visible_counts(q_pos, ratio)
    n_iter = (jnp.max(vis) + kb - 1) // kb
    k = min(topk, n)
    init = [jnp.full((b, c, k), NEG_INF, jnp.float32), jnp.full((b, c, k), n, jnp.int32)]
    kc = 0
    if candidate_topk_blocks is not None:
        kc = min(candidate_topk_blocks, n_blocks)
        init += [jnp.full((b, c, kc), NEG_INF, jnp.float32), jnp.full((b, c, kc), n_blocks, jnp.int32)]
    newest = (vis - 1) // bs

    def body(i, carry):
        start = jnp.minimum(i * kb, n - kb)  # the last block is shifted back to stay in range ...
        entries = start + jnp.arange(kb, dtype=jnp.int32)
        fresh = entries >= i * kb  # ... and what an earlier block already covered is masked
        scores = indexer_scores(q, weights, jax.lax.dynamic_slice_in_dim(keys, start, kb, axis=1))
        scores = jnp.where(fresh & (entries < vis[..., None]), scores, NEG_INF)
        out = list(carry)
        if kc:
            blocks = start // bs + jnp.arange(kb // bs, dtype=jnp.int32)
            bmax = jnp.max(scores.reshape(b, c, kb // bs, bs), axis=-1)
            bmax = jnp.where(blocks == newest[..., None], jnp.inf, bmax)
            bmax = jnp.where(blocks * bs >= i * kb, bmax, NEG_INF)
            out[2], out[3] = _merge_topk(carry[2], carry[3], bmax, blocks, kc)
        if pool_mask is not None:
            in_pool = jnp.repeat(jax.lax.dynamic_slice_in_dim(pool_mask, start // bs, kb // bs, axis=-1), bs, -1)
            scores = jnp.where(in_pool, scores, NEG_INF)
        out[0], out[1] = _merge_topk(carry[0], carry[1], scores, entries, k)
        return tuple(out)

    res = jax.lax.fori_loop(0, n_iter, body, tuple(init))

    def finish(vals, ids, size):
        ids = jnp.sort(jnp.where(vals > NEG_INF, ids, size), axis=-1)
        return jnp.where(ids >= size, -1, ids).astype(jnp.int32)

    topk_ids = finish(res[0], res[1], n)
    pool = finish(res[2], res[3], n_blocks) if kc else None
    return topk_ids, pool


# ----------------------------------------------------------------------------------------------------------
# Attention over ring + chunk
# ----------------------------------------------------------------------------------------------------------

def chunk_attention(q, pos, win_kv, win_pos, compressed, topk, sink, *, window: int, floor, q_block: int,
                    backend: str = "auto", win_ring=None, banded: bool = False, tuning: dict | None = None):
    """q [B, C, H, D] at pos [B, C]; window keys [B, W + C, D] where index k holds position pos0 - W + k.
    ``win_ring`` (one query block only): (ring, pos0), the first W window keys read from the ring itself and
    ``win_kv`` [B, C, D] the chunk's (``kernels.sparse_attention``). ``banded``: a chunk of more than ``q_block``
    queries runs as one kernel call in which each query scans only its window's rows (that layout is
    ``kernels.sparse_attention``'s ``band``), not as a map over query blocks each scanning W + q_block rows.
    ``tuning``: the kernels' (``kernels.sparse_attention``), every call alike."""
    b, t = q.shape[:2]
    sparse_attention = functools.partial(kernels.sparse_attention, backend=backend, tuning=tuning)
    if banded and t > q_block and win_ring is None:
        # The map's blocks ran the kernel's 256-query tiling (32 heads per program: every key row read twice) over
        # W + 256 window rows per query, and sliced each block's queries out (16 kernels + ~120 XLA glue kernels per
        # 4096-token chunk and layer); the one call takes the prefill tiling over `window` rows. On an H200
        # (benchmarks/RESULTS.md, 2026-12-03 10:14 UTC) the 32K-token CED prefill's sparse attention took 0.072 s in 90
        # launches against 0.146 s in 6,465, the prefill 0.557 s against 0.626
        return sparse_attention(q, pos, win_kv, win_pos, compressed, topk, sink, window=window, floor=floor,
                                band=True)
    if t <= q_block:
        return sparse_attention(q, pos, win_kv, win_pos, compressed, topk, sink, window=window, floor=floor,
                                win_ring=win_ring)
    if win_ring is not None:
        raise ValueError("chunk_attention: win_ring serves a single query block; materialise the ring first")
    nb = ceil_div(t, q_block)
    pad = nb * q_block - t
    q_p = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    pos_p = jnp.pad(pos, ((0, 0), (0, pad)), constant_values=-1)
    kv_p = jnp.pad(win_kv, ((0, 0), (0, pad), (0, 0)))
    kpos_p = jnp.pad(win_pos, ((0, 0), (0, pad)), constant_values=-1)
    tk_p = None if topk is None else jnp.pad(topk, ((0, 0), (0, pad), (0, 0)), constant_values=-1)
    w = win_kv.shape[1] - t  # ring length

    def one(i):
        s = i * q_block
        sl = lambda a, size: jax.lax.dynamic_slice_in_dim(a, s, size, axis=1)  # noqa: E731
        return sparse_attention(sl(q_p, q_block), sl(pos_p, q_block), sl(kv_p, q_block + w),
                                sl(kpos_p, q_block + w), compressed, None if tk_p is None else sl(tk_p, q_block),
                                sink, window=window, floor=floor)

    out = jax.lax.map(one, jnp.arange(nb))
    return jnp.moveaxis(out, 0, 1).reshape(b, nb * q_block, *q.shape[2:])[:, :t]


@dataclasses.dataclass
class _Shared:
    """Cross-layer values of one pass (the latest KV source's cache, the latest top-k, the HSI pool)."""

    kv: Any = None
    keys: Any = None
    topk: Any = None
    pool: Any = None


def attention_step(p: dict, x: jax.Array, spec: LayerSpec, pos: jax.Array, pos0: jax.Array, n_valid: jax.Array,
                   cache: dict, shared: _Shared, config: ModelConfig, rope: dict, opts: InferenceOptions,
                   quant_on: bool, emit: bool, norm_kernel: str | None = None):
    c = config
    b, t, _ = x.shape
    cos, sin = cos_sin(rope[spec.rope], pos)
    q_res, q, kv = attention_inputs(p, x, cos, sin, c, quant_on, norm_kernel=norm_kernel)

    ring = cache["swa"][spec.index]
    valid = jnp.arange(t)[None, :] < n_valid[:, None]
    win_ring = None
    if isinstance(ring, PC.PackedRows) and t <= opts.query_chunk and _kernels_read_packed(opts):
        # the GPU kernel reads the ring's FP8 slots (the state before this chunk's write) where they lie
        ring_pos, win_kv, win_ring = ring_positions(pos0, ring.shape[1]), kv, (ring, pos0)
    else:
        ring_vals, ring_pos = ring_read(ring, pos0)
        win_kv = jnp.concatenate([ring_vals.astype(kv.dtype), kv], axis=1)
    win_pos = jnp.concatenate([ring_pos, jnp.where(valid, pos, -1)], axis=1)
    cache["swa"][spec.index] = ring_write(ring, kv, pos0, n_valid)

    compressed = topk = None
    if spec.ratio > 0:
        if spec.mode == FULL:
            key = str(spec.index)
            if emit:
                cache["sources"][key] = emit_entries(cache["sources"][key], x, p["compressor"], p["indexer"],
                                                     spec.ratio, pos0, n_valid, c, rope, quant_on)
            src = cache["sources"][key]
            if _kernels_read_packed(opts):  # GPU kernels: packed rows read and dequantised
                shared = dataclasses.replace(shared, kv=src["kv"], keys=src["keys"])  # in registers (either layout)
            else:  # unpack-then-compute (reference / TPU): the whole buffer unpacked to its dtype
                shared = dataclasses.replace(shared, kv=PC.read(src["kv"]), keys=PC.read(src["keys"]))
        if spec.mode in (FULL, REINDEX):
            new_topk, new_pool = run_indexer(p["indexer"], x, q_res, spec, pos, shared.keys, shared.pool, c, rope,
                                             opts, quant_on)
            shared = dataclasses.replace(shared, topk=new_topk,
                                         pool=new_pool if spec.candidate_source else shared.pool)
        compressed, topk = shared.kv, shared.topk

    floor = cache["floor"] if spec.stack == "decoder" else 0
    out = chunk_attention(q, pos, win_kv, win_pos, compressed, topk, p["attn_sink"], window=c.sliding_window,
                          floor=floor, q_block=opts.query_chunk, backend=opts.kernel_backend, win_ring=win_ring,
                          banded=banded_chunk_attention(opts),
                          tuning=attention_tuning(opts))
    return attention_output(p, out, cos, sin, c), cache, shared


def attention_tuning(opts: InferenceOptions) -> dict | None:
    """The sparse attention's ``tuning`` entries that the options set (``kernels.sparse_attention``)."""
    t = {"split_rule": opts.attention_split_rule, "packed_attention": opts.packed_attention}
    return {k: v for k, v in t.items() if v is not None} or None


def _gemm_view(params: dict, config: ModelConfig, opts: InferenceOptions) -> dict:
    """The parameters as the layers consume them: with ``gemm_input_fp8`` the release's FP8 / FP4 GEMM weights
    are marked so their inputs are rounded to FP8 (trace-time restructure, no data movement)."""
    if not opts.gemm_input_fp8:
        return params
    from dsv41_jax.model.release_weights import mark_fp8_gemm_inputs

    return mark_fp8_gemm_inputs(params, config, opts.quantized_gemm, opts.fp8_gemm_tuning, gemm_input_kernel(opts))


def gemm_input_kernel(opts: InferenceOptions) -> bool:
    """``InferenceOptions.gemm_input_kernel`` resolved: None is on for the "pallas_gpu" quantised-GEMM backend."""
    if opts.gemm_input_kernel is not None:
        return opts.gemm_input_kernel
    from dsv41_jax.kernels.quant_gemm import resolve_backend

    return resolve_backend(opts.quantized_gemm) == "pallas_gpu"


def _auto(flag: bool | None, default: bool) -> bool:
    return default if flag is None else flag


def decode_compiler_options(opts: InferenceOptions, *, verification: bool = False) -> tuple:
    """The XLA options of the decode (``verification``: speculative verification) programs: the options' own (and
    for verification ``InferenceOptions.verification_compiler_options`` after them, where not already there), plus
    XLA's dot merger off where ``InferenceOptions.decode_dot_merger`` resolves to off (idempotent: the pass is
    named once, the verification options added once)."""
    copts = tuple(opts.compiler_options)
    gpu = kernels.resolve_backend(opts.kernel_backend) == "pallas_gpu"
    if verification:
        extra = opts.verification_compiler_options
        extra = (TRITON_GEMMS if gpu else ()) if extra is None else tuple(extra)
        copts += tuple(kv for kv in extra if kv not in copts)
    if _auto(opts.decode_dot_merger, not (verification and gpu)):
        return copts
    passes = dict(copts).get("xla_disable_hlo_passes", "")
    if "dot-merger" in passes.split(","):
        return copts
    rest = tuple((k, v) for k, v in copts if k != "xla_disable_hlo_passes")
    return rest + (("xla_disable_hlo_passes", ",".join(filter(None, (passes, "dot-merger")))),)


def banded_chunk_attention(opts: InferenceOptions) -> bool:
    """Whether long chunks attend in one banded kernel call (``InferenceOptions.banded_chunk_attention``)."""
    return _auto(opts.banded_chunk_attention, kernels.resolve_backend(opts.kernel_backend).startswith("pallas_gpu"))


def grouped_prefill_moe(opts: InferenceOptions) -> bool:
    """Whether prefill chunks' routed experts run the grouped GEMM (``InferenceOptions.grouped_prefill_moe``
    resolved: by default on a Hopper GPU with the "pallas_gpu" backend) on the engine's own MoE path
    (``moe_impl="tiled"``, inference.moe.moe_inference)."""
    on_gpu = kernels.resolve_backend(opts.kernel_backend) == "pallas_gpu"
    return opts.moe_impl == "tiled" and _auto(opts.grouped_prefill_moe, on_gpu and is_hopper_gpu())


def _mhc_kw(c: ModelConfig, opts: InferenceOptions) -> dict:
    # On the kernel (GPU / TPU) path the Sinkhorn loop is unrolled: its iterations fuse into a few kernels instead
    # of launching the loop body's kernels once per iteration (19 iterations x 2 sites per layer in every decode
    # step); on the CPU reference path it stays rolled, which compiles faster (measured: ~1.5x less CPU compile
    # time for the default model's decode step).
    #
    # The unrolled loop is one chain of ~40 row / column normalisations of each token's 4 x 4 matrix. XLA:GPU
    # (JAX 0.10-0.11) turns them into Triton "softmax" fusions and its priority fusion then merges the chain one
    # step at a time, searching every Triton tiling of the grown fusion at each step: 2-25 s of compile per mHC site
    # for 2-128 tokens per step (it depends on the token count, not monotonically), i.e. minutes per program with
    # 24 sites. The Pallas kernel computes the same float32 softmax + Sinkhorn in one launch and compiles in well
    # under a second, so it is the default on the GPU backend (mhc_kernel=None); mhc_kernel=False keeps XLA's form.
    backend = kernels.resolve_backend(opts.kernel_backend)
    use_kernel = backend == "pallas_gpu" if opts.mhc_kernel is None else opts.mhc_kernel
    return dict(hc_eps=c.hc_eps, rms_eps=c.rms_norm_eps, sinkhorn_iters=c.hc_sinkhorn_iters,
                unroll=backend != "reference",
                comb_kernel=backend if use_kernel and backend.startswith("pallas_gpu") else None)


def _norm_kernel(opts: InferenceOptions, small: bool) -> str | None:
    """ops.mhc.collapse_rms_norm's ``kernel`` for a step (``small``: at most 64 tokens)."""
    backend = kernels.resolve_backend(opts.kernel_backend)
    if not backend.startswith("pallas_gpu"):
        return None
    return backend if _auto(opts.norm_kernel, backend == "pallas_gpu" and small) else None


def embed(params: dict, tokens: jax.Array, config: ModelConfig):
    """tokens [B, C] -> (streams [B, C, hc, d], pre_mix [B, C, hc]) entering layer 0."""
    b, t = tokens.shape
    x = params["embed"][tokens]
    streams = jnp.broadcast_to(x[:, :, None, :], (b, t, config.hc_mult, config.hidden_size))
    return streams, jax.nn.one_hot(jnp.zeros((b, t), jnp.int32), config.hc_mult, dtype=jnp.float32)


def run_layers(params: dict, cache: dict, streams: jax.Array, pre_mix: jax.Array, pos0: jax.Array,
               n_valid: jax.Array, engram_ids: jax.Array | None, *, config: ModelConfig, lo: int, hi: int,
               opts: InferenceOptions, no_emit: tuple[int, ...] = (), capture: tuple[int, ...] = (),
               return_compressor_inputs: bool = False):
    """Layers [lo, hi) over a chunk. Returns (streams, pre_mix, cache). Does not advance ``cache['length']``.

    ``capture`` (layer ids, all in [lo, hi)): also return the DSpark target features, the mean over the mHC
    streams of the residual entering each of these layers (after its Engram write), concatenated in ``capture``
    order: a further value [B, C, len(capture) * d]. ``return_compressor_inputs``: also return (last) a dict
    {layer: [B, C, d]} of every KV source's compressor input (its normalised attention-site input), from which
    :func:`emit_entries` can redo a source's update for a shorter valid prefix (speculative rollback)."""
    c = config
    missing = [i for i in capture if not lo <= i < hi]
    if missing:
        raise ValueError(f"capture layers {missing} are outside the layers [{lo}, {hi}) of this pass")
    captured, compressor_inputs = {}, {}
    b, t = streams.shape[:2]
    params = _gemm_view(params, c, opts)
    quant_on = opts.resolved_quant(c)
    rope = _rope(c)
    pos = pos0[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.arange(t)[None, :] < n_valid[:, None]
    cache = dict(cache, swa=list(cache["swa"]), sources=dict(cache["sources"]))
    shared = _Shared()
    mhc_kw = _mhc_kw(c, opts)
    small = b * t <= 64  # a decode step (or a short chunk): the one-pass forms, where asked for, fuse better
    on_gpu = kernels.resolve_backend(opts.kernel_backend) == "pallas_gpu"
    few = _auto(opts.mhc_one_pass, on_gpu) and small  # fewer, fused mHC kernels (ops.mhc one_pass)
    if few:
        mhc_kw = dict(mhc_kw, one_pass=True, projection=opts.mhc_projection, partials=opts.mhc_partials)
    norm_kernel = _norm_kernel(opts, small)
    for spec in c.plan.layers[lo:hi]:
        lp = params["layers"][spec.index]
        if spec.engram_slot is not None:
            streams = engram_write(streams, engram_ids[:, :, spec.engram_slot], lp["engram"], eps=c.rms_norm_eps,
                                   live=valid, host_gather=opts.engram_host_gather)
        if spec.index in capture:
            captured[spec.index] = jnp.mean(streams, axis=2)
        a_pre, a_post, a_comb = mhc_coefficients(streams, **lp["hc_attn"], **mhc_kw)
        h = collapse_rms_norm(streams, pre_mix, lp["attn_norm"], c.rms_norm_eps, unrolled=few, kernel=norm_kernel)
        if return_compressor_inputs and spec.mode == FULL:
            compressor_inputs[spec.index] = h
        y, cache, shared = attention_step(lp["attn"], h, spec, pos, pos0, n_valid, cache, shared, c, rope, opts,
                                          quant_on, emit=spec.index not in no_emit, norm_kernel=norm_kernel)
        streams = expand(streams, y, a_post, a_comb, unrolled=few)
        f_pre, f_post, f_comb = mhc_coefficients(streams, **lp["hc_ffn"], **mhc_kw)
        h = collapse_rms_norm(streams, a_pre, lp["ffn_norm"], c.rms_norm_eps, unrolled=few, kernel=norm_kernel)
        if opts.moe_impl == "tiled":
            y = moe_inference(h, lp["ffn"], top_k=c.num_experts_per_tok, temp=c.gate_temp,
                              scaling=c.routed_scaling_factor, limit=c.swiglu_limit, normalize=c.norm_topk_prob,
                              backend=opts.kernel_backend,
                              router_one_pass=_auto(opts.router_one_pass, on_gpu) and small,
                              fp4_one_token=opts.fp4_one_token, fp4_slot_decode=opts.fp4_slot_decode,
                              fp4_grouped_tuning=opts.fp4_grouped_tuning, fp4_every_expert=opts.fp4_every_expert,
                              live=valid,  # masked rows (past n_valid) pick no expert: fewer weights read
                              grouped=grouped_prefill_moe(opts))
        else:
            y, _ = moe(h, lp["ffn"], top_k=c.num_experts_per_tok, temp=c.gate_temp, scaling=c.routed_scaling_factor,
                       limit=c.swiglu_limit, impl=opts.moe_impl, normalize=c.norm_topk_prob)
        streams = expand(streams, y, f_post, f_comb, unrolled=few)
        pre_mix = f_pre
    out = (streams, pre_mix, cache)
    if capture:
        out += (jnp.concatenate([captured[i] for i in capture], axis=-1),)
    if return_compressor_inputs:
        out += (compressor_inputs,)
    return out


def emit_decoder_source(params: dict, cache: dict, streams: jax.Array, pre_mix: jax.Array, pos0: jax.Array,
                        n_valid: jax.Array, engram_ids: jax.Array | None, *, config: ModelConfig,
                        opts: InferenceOptions) -> dict:
    """CED: the decoder's KV source (its first layer) compresses the encoder output of every prompt token.

    Its compressor input is that layer's attention input, which depends on the encoder output alone."""
    c = config
    ds = c.plan.decoder_start
    spec = c.plan[ds]
    lp = _gemm_view(params, c, opts)["layers"][ds]
    if spec.engram_slot is not None:
        valid = jnp.arange(streams.shape[1])[None, :] < n_valid[:, None]
        streams = engram_write(streams, engram_ids[:, :, spec.engram_slot], lp["engram"], eps=c.rms_norm_eps,
                               live=valid, host_gather=opts.engram_host_gather)
    h = rms_norm(collapse(streams, pre_mix), lp["attn_norm"], c.rms_norm_eps)
    sources = dict(cache["sources"])
    sources[str(ds)] = emit_entries(sources[str(ds)], h, lp["attn"]["compressor"], lp["attn"]["indexer"],
                                    spec.ratio, pos0, n_valid, c, _rope(c), opts.resolved_quant(c))
    return dict(cache, sources=sources)


def head(params: dict, streams: jax.Array, pre_mix: jax.Array, config: ModelConfig) -> jax.Array:
    h = rms_norm(collapse(streams, pre_mix), params["norm"], config.rms_norm_eps)
    return head_logits(h, params["lm_head"])


def check_ced_plan(config: ModelConfig) -> None:
    """CED prefill replays only the decoder's last tokens, so the decoder may read no KV source other than its
    first layer's (whose input is the encoder output)."""
    plan = config.plan
    ds = plan.decoder_start
    if ds >= len(plan):
        return
    later = [s.index for s in plan.layers[ds + 1:] if s.mode == FULL]
    if plan[ds].mode != FULL or later:
        raise ValueError(f"CED prefill needs the decoder's only KV source to be its first layer ({ds}); this plan "
                         f"has decoder KV sources {[s.index for s in plan.layers[ds:] if s.mode == FULL]}. "
                         "Use InferenceOptions(ced=False) (full replay) for such configs.")


__all__ = ["InferenceOptions", "FAST_COMPILE", "jit_for", "decode_compiler_options", "ring_read", "ring_write", "emit_entries", "candidate_block_ids", "block_ids_to_mask",
           "pooled_topk", "run_indexer", "chunk_attention", "attention_step", "embed", "run_layers",
           "emit_decoder_source", "head", "check_ced_plan"]
