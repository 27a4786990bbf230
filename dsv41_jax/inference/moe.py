"""MoE for inference: the same maths as :func:`dsv41_jax.ops.moe.moe` (router, clamped SwiGLU experts, one shared
expert), with the routed experts run as a tiled grouped matmul in plain JAX.

Assignments (token, expert) are sorted by expert; each expert's rows are cut into tiles of ``tile`` rows, and a
loop over the tiles that exist (a dynamic count) multiplies each tile by its own expert's weights. Only experts
that received tokens are read — a decode step with 6 active experts reads 6 experts' weights — and the work is
the assignments' work rounded up to tiles, not every expert on every token (``dense``). ``jax.lax.ragged_dot``
(``ragged``) computes the same thing but is slow on this JAX's CPU backend (measured: 4-13x slower than dense).

A decode step has few tokens (m <= ``STATIC_MAX_TOKENS``) and needs a loop whose trip count XLA knows: on a GPU a
loop with a data-dependent trip count copies its predicate to the host before every iteration (a host round-trip
inside the step). :func:`routed_slots` gives every used expert one slot of ``pow2(m)`` rows (an expert takes each
token at most once, so its rows fit) and loops over ``min(n_experts, m * top_k)`` slots — a static count. Each used
expert's weights are read once, as in the tiled loop; slots beyond the used experts (possible only when fewer than
``min(n_experts, m * top_k)`` distinct experts are picked) read one unused expert each and add nothing. The work is
``slots * pow2(m)`` rows, which for m <= 64 stays under the GPU's bytes-to-FLOPs balance (the step is bound by
reading the weights). On a GPU (kernel backend ``pallas_gpu``) the slots run as two Pallas kernels instead of the
loop (``kernels.expert_gemm_gpu``): the loop's ``w[e]`` is a dynamic slice that XLA copies out of the stacked
weights before each GEMM, the kernels read the stacked weights in place and skip spare slots; one token uses its
top-k picks as the slots directly. Larger token counts (prefill chunks, the CED decoder replay) keep the tiled loop,
except where every expert gets a slot and the padded rows stay few (``STATIC_MAX_ROWS``: a verification chunk on 16
experts), and except on a Hopper GPU (``grouped``, ``InferenceOptions.grouped_prefill_moe``), where prefill chunks run
the Mosaic GPU grouped GEMM (``kernels.grouped_gemm_mgpu``, the train step's): the tiled loop's trip count is data
dependent, so on a GPU every tile costs a host round-trip, and its ``w[e]`` slices are copied out of the stacked
weights — on an H200 (2026-12-03, the 12-layer bench model, one 32K-token prompt in chunks of 512) the CED prefill
took 2.05 s on the tiled loop (the device idle 57 % of a profiled prefill; weight-slice copies and loop bookkeeping
0.41 s of device time against 0.24 s of expert GEMMs) and 0.81 s on the grouped GEMM (benchmarks/RESULTS.md). With many
experts (the release's 384) and a large batch, fewer distinct experts than slots are picked (batch 64: ~243 of 384)
and the spare slots' weight reads are wasted. With release FP4 experts marked for a quantised-GEMM kernel
(``InferenceOptions.quantized_gemm``), :func:`moe_inference` runs the grouped Pallas GEMM instead
(``kernels.quant_gemm.fp4_grouped`` through ``ops.moe.routed_ragged``): only experts with rows are read, from their
packed bytes, with no slot padding. One token on the GPU kernels (decode at batch 1) can take
:func:`routed_fp4_one_token` instead (``fp4_one_token=True``, the default: 1.10 vs 1.50 ms of expert kernels per step
on an H200, 0.80 ms since the kernels' pair decode, benchmarks/RESULTS.md):
its top-k picks are the slots of two gemv kernels over the picked experts' packed bytes
(``kernels.quant_gemm.fp4_slot_swiglu`` / ``fp4_slot_down``), with no sort, tile metadata or scatter. A decode batch
can take :func:`routed_fp4_every_expert` instead (``fp4_every_expert=True``, off by default: on an H200 its kernels
were 0.88x the grouped path's and the 40-layer batch-32 step 1.06 ms slower, benchmarks/RESULTS.md 2026-12-03 18:00).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax import kernels
from dsv41_jax.kernels.expert_gemm_gpu import MIN_ROWS
from dsv41_jax.ops.linear import (Fp8GemmInput, gemm_input, is_plain_weight, linear, matmul_precision,
                                  select_expert)
from dsv41_jax.ops.moe import expert_mlp, grouped_kernel_backend, route, routed_ragged

STATIC_MAX_TOKENS = 64
# Above STATIC_MAX_TOKENS the static path is still taken when every expert gets a slot and the padded rows
# (n_experts * pow2(m)) stay this few: a speculative verification chunk (batch 16 x 6 tokens = 96) on 16 experts
# then runs one batched GEMM per projection (2,048 rows, compute well under the weights' read time on an H200)
# instead of the tiled loop, whose data-dependent trip count is a host round-trip per tile on a GPU (measured on
# an H200: the batch-16 verification step took 19 ms against 3 ms for a plain step, benchmarks/RESULTS.md).
STATIC_MAX_ROWS = 2048
# Up to this many tokens the slot kernels (GPU) run even when every expert gets a slot, instead of the batched GEMM
# over all experts: their spare slots (experts no token picked) read nothing. A batch-1 verification chunk (6 tokens
# x top-6 on 16 experts) leaves ~1 expert unpicked under uniform routing and more under a trained, skewed router or
# a scheduled (shortened) chunk, whose masked tokens pick none (``live``); the batched GEMM reads all 16 (measured
# from the deviceless H200 compile of the DSpark bench's verification step: 4.53 GB of routed weights per step).
# Above it nearly every expert is picked anyway (16 tokens x top-6: P(an expert unpicked) = 0.05 %).
LIVE_SLOT_MAX_TOKENS = 8


def _pow2_at_least(n: int, lo: int = 8) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def _swiglu_expert(rows, w1, w2, w3, wts, limit, dtype):
    """One expert's clamped SwiGLU on ``rows`` [R, d], each output row scaled by ``wts`` [R] (float32 out). The
    weights may be in any form :func:`dsv41_jax.ops.linear.linear` takes (float, release FP8 / FP4, marked)."""
    gate = linear(rows, w1).astype(jnp.float32)
    up = linear(rows, w3).astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    act = jax.nn.silu(gate) * up * wts[:, None]
    return linear(act.astype(dtype), w2).astype(jnp.float32)


def _swiglu_every_expert(xs, w1, w2, w3, wts, limit, dtype):
    """:func:`_swiglu_expert` for every expert at once: xs [E, R, d] (slot e = expert e), plain weights [E, ...]
    read in place by batched GEMMs (no per-expert slice is copied out first)."""
    def bmm(a, w):
        return jnp.einsum("eri,eoi->ero", a, w, precision=matmul_precision(a, w))

    gate = bmm(xs, w1).astype(jnp.float32)
    up = bmm(xs, w3).astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    # rows of weight 0 (an expert the token did not pick) are set to 0, not multiplied by it: an overflowed
    # activation there (inf · 0) would otherwise reach the token's sum as NaN; their down projection is then 0
    act = jnp.where(wts[..., None] != 0, jax.nn.silu(gate) * up * wts[..., None], 0.0)
    return bmm(act.astype(dtype), w2).astype(jnp.float32)


def _routed_every_expert(x, weights, idx, w1, w2, w3, limit, live=None):
    """x [M, d]; weights / idx [M, k] -> [M, d] float32 with every expert run on every token by batched GEMMs over
    the stacked plain weights (read in place), each token's output scaled by its routing weight for that expert
    (0 where it did not pick it) and the experts' outputs summed.

    This is the sorted-slot form (sort the assignments by expert, gather each expert's tokens into a slot of
    ``pow2(M)`` rows, scatter-add the rows back) with the slot's rows in token order: expert e's row t is token t.
    Every row of every expert is still computed (M rows per expert against ``pow2(M)``: no more work), each row's
    value is the same product, and the combine adds the same terms, with exact zeros for the experts a token did not
    pick. What goes is the glue the sort needs — on an H200's decode step at batch 32 a sort, a count scatter, a
    gather of the slots' rows and the combine's scatter-add per layer — in favour of one small fusion (the dense
    routing weights) and a reduction over the experts."""
    n_exp = w1.shape[0]
    picked = idx[:, :, None] == jnp.arange(n_exp, dtype=idx.dtype)  # [M, k, E]; a token's picks are distinct
    if live is not None:
        picked = picked & live.reshape(-1, 1, 1)  # masked rows pick nothing: routed output 0
    # at most one j matches (t, e): the sum is that weight, exactly, or 0
    dense = jnp.sum(jnp.where(picked, weights.astype(jnp.float32)[:, :, None], 0.0), axis=1).T  # [E, M]
    xs = jnp.broadcast_to(x[None], (n_exp,) + x.shape)
    # the rows of the experts a token did not pick are exact zeros (their activation is set to 0)
    return jnp.sum(_swiglu_every_expert(xs, w1, w2, w3, dense, limit, x.dtype), axis=0)


def _slot_kernel_blocks(rows, w1, w2, w3, backend):
    """Block sizes of the slot kernels (``kernels.expert_gemm_gpu``) for these weights, or None where the XLA loop
    runs instead (CPU reference backend, non-GPU kernels, quantised / marked weights, shapes the blocks do not
    divide)."""
    if not backend.startswith("pallas_gpu") or not all(is_plain_weight(w) for w in (w1, w2, w3)):
        return None
    from dsv41_jax.kernels.expert_gemm_gpu import slot_blocks

    _, f, d = w1.shape
    up = slot_blocks(rows, d, f, max(w1.size, w3.size))
    down = slot_blocks(rows, f, d, w2.size)
    return None if up is None or down is None else (up, down)


def _slot_kernels(xs, slot_expert, live, slot_wts, w1, w2, w3, limit, blocks, backend):
    """[S, R, d] float32: each live slot's rows through its expert's SwiGLU, by the two slot kernels."""
    from dsv41_jax.kernels.expert_gemm_gpu import slot_down, slot_swiglu

    (bn_up, bk_up), (bn_down, bk_down) = blocks
    interpret = backend.endswith("interpret")
    act = slot_swiglu(xs, slot_expert, live, slot_wts, w1, w3, limit=float(limit), block_n=bn_up, block_k=bk_up,
                      interpret=interpret)
    return slot_down(act, slot_expert, live, w2, block_n=bn_down, block_k=bk_down, interpret=interpret)


def _drop_dead(idx, live, n_exp):
    """The picks of tokens that are not ``live`` [M] (masked rows of a chunk) moved to the out-of-range expert
    ``n_exp``: they sort last, ``bincount`` drops them and no slot or tile takes them, so those rows' routed output
    is 0 and the experts only they picked are not read. Live rows are unchanged."""
    return idx if live is None else jnp.where(live.reshape(-1, 1), idx, n_exp)


def routed_slots(x, weights, idx, w1, w2, w3, limit, backend: str = "reference", live=None):
    """x [M, d]; weights / idx [M, k] -> [M, d] float32, with a static loop over min(n_experts, M * k) expert slots
    (see the module docstring). Same maths as :func:`routed_tiled`. ``live`` [M] bool (optional): rows whose
    routed output is needed; the others get 0 and read no expert (:func:`_drop_dead`).

    When every expert gets a slot (M * k >= n_experts: a decode batch of 3+ tokens on 16 experts, 64 on the
    release's 384) and the weights are plain arrays, every expert runs on every token and one batched GEMM per
    projection replaces the loop (:func:`_routed_every_expert`, no sort): the loop's ``w[e]`` with a data-dependent
    ``e`` is a dynamic slice that XLA on a GPU copies out before each GEMM (measured on an H200: the copies were a
    third of the batch-32 step's device time), while the batched GEMM reads the stacked weights where they are. Same
    bytes read, same maths.
    Otherwise, on the Pallas GPU backend (``backend``), the slot kernels replace the loop (module docstring)."""
    m, k = idx.shape
    n_exp = w1.shape[0]
    n_slots = min(n_exp, m * k)
    backend = kernels.resolve_backend(backend)
    blocks = _slot_kernel_blocks(_pow2_at_least(m, MIN_ROWS), w1, w2, w3, backend)
    # the batched GEMM over every expert when every expert gets a slot, except for a few tokens on the slot
    # kernels, which skip the experts nobody picked (LIVE_SLOT_MAX_TOKENS)
    every_expert = (n_slots == n_exp and all(is_plain_weight(w) for w in (w1, w2, w3))
                    and (blocks is None or m > LIVE_SLOT_MAX_TOKENS))
    if every_expert:
        return _routed_every_expert(x, weights, idx, w1, w2, w3, limit, live)
    rows = _pow2_at_least(m, MIN_ROWS if blocks else 8)
    if blocks is not None and m == 1:
        # one token: its top-k experts are distinct, so slot j is its j-th pick (no sort, no scatter back); every
        # slot reads the token's one row (the kernel broadcasts it in registers: no [k, rows, d] copy first)
        xs = x.reshape(1, 1, x.shape[-1])
        slot_wts = jnp.zeros((k, rows), jnp.float32).at[:, 0].set(weights[0].astype(jnp.float32))
        ys = _slot_kernels(xs, idx[0].astype(jnp.int32), jnp.ones((k,), jnp.int32), slot_wts, w1, w2, w3, limit,
                           blocks, backend)
        return jnp.sum(ys[:, 0, :], axis=0)[None]
    flat = _drop_dead(idx, live, n_exp).reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments sorted by expert (dead rows' picks last)
    token = order // k
    wts = weights.reshape(-1)[order].astype(jnp.float32)
    counts = jnp.bincount(flat, length=n_exp).astype(jnp.int32)
    row_start = jnp.cumsum(counts) - counts
    slot_expert = jnp.argsort(counts == 0, stable=True)[:n_slots].astype(jnp.int32)  # used first, ascending
    r = row_start[slot_expert][:, None] + jnp.arange(rows, dtype=jnp.int32)[None, :]  # [slots, rows]
    ok = jnp.arange(rows)[None, :] < counts[slot_expert][:, None]
    r = jnp.where(ok, r, 0)
    slot_token = token[r]
    slot_wts = jnp.where(ok, wts[r], 0.0)
    xs = x[slot_token]  # [slots, rows, d]: each slot's tokens, gathered once
    if blocks is not None:
        # the slots' weights read in place by two Pallas kernels (gate / up + SwiGLU, then down): no slice copied
        # out of the stacked weights, spare slots (no rows) read nothing
        live = (counts[slot_expert] > 0).astype(jnp.int32)
        ys = _slot_kernels(xs, slot_expert, live, slot_wts, w1, w2, w3, limit, blocks, backend)
        ys = jnp.where(ok[..., None], ys, 0.0)
        return jnp.zeros((m, x.shape[-1]), jnp.float32).at[slot_token.reshape(-1)].add(ys.reshape(-1, x.shape[-1]))

    def body(s, out):
        e = slot_expert[s]
        y = _swiglu_expert(xs[s], select_expert(w1, e), select_expert(w2, e), select_expert(w3, e), slot_wts[s],
                           limit, x.dtype)
        return out.at[s].set(y)

    ys = jax.lax.fori_loop(0, n_slots, body, jnp.zeros((n_slots, rows, x.shape[-1]), jnp.float32))
    ys = jnp.where(ok[..., None], ys, 0.0)
    return jnp.zeros((m, x.shape[-1]), jnp.float32).at[slot_token.reshape(-1)].add(ys.reshape(-1, x.shape[-1]))


def _tile_rows(assignments: int, n_experts: int) -> int:
    t = 8
    while t < 256 and t * n_experts < assignments:
        t *= 2
    return t


def routed_tiled(x, weights, idx, w1, w2, w3, limit, tile: int | None = None, live=None):
    """x [M, d]; weights / idx [M, k] -> [M, d] float32 (sum of the weighted expert outputs; rows not ``live``
    [M]: 0, as in :func:`routed_slots`)."""
    m, k = idx.shape
    n_exp = w1.shape[0]
    a = m * k
    tile = tile or _tile_rows(a, n_exp)
    flat = _drop_dead(idx, live, n_exp).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    wts = weights.reshape(-1)[order].astype(jnp.float32)
    counts = jnp.bincount(flat, length=n_exp).astype(jnp.int32)
    row_start = jnp.cumsum(counts) - counts  # first sorted row of each expert
    tiles = (counts + tile - 1) // tile
    tile_start = jnp.cumsum(tiles) - tiles
    n_tiles = jnp.sum(tiles)
    xs = jnp.pad(x[token], ((0, tile), (0, 0)))
    wts = jnp.pad(wts, (0, tile))
    d = x.shape[-1]

    def body(t, out):
        e = jnp.searchsorted(tile_start, t, side="right") - 1
        e = jnp.clip(e, 0, n_exp - 1)
        r0 = row_start[e] + (t - tile_start[e]) * tile
        rows = jax.lax.dynamic_slice_in_dim(xs, r0, tile, axis=0)
        valid = (r0 + jnp.arange(tile)) < row_start[e] + counts[e]
        # select_expert: only this expert's weights are read (and, in the release's FP4 form, dequantised)
        y = _swiglu_expert(rows, select_expert(w1, e), select_expert(w2, e), select_expert(w3, e),
                           jax.lax.dynamic_slice_in_dim(wts, r0, tile), limit, x.dtype)
        y = jnp.where(valid[:, None], y, 0.0)
        old = jax.lax.dynamic_slice_in_dim(out, r0, tile, axis=0)
        return jax.lax.dynamic_update_slice_in_dim(out, old + y, r0, axis=0)

    out = jax.lax.fori_loop(0, n_tiles, body, jnp.zeros((a + tile, d), jnp.float32))
    return jnp.zeros((m, d), jnp.float32).at[token].add(out[:a])


def fp4_one_token_backend(n_tokens: int, w1, w2, w3) -> str | None:
    """The GPU kernel backend that runs :func:`routed_fp4_one_token` for these routed experts, or None: one token,
    release FP4 experts marked for a ``pallas_gpu`` quantised-GEMM backend (the grouped kernel's condition), K of
    both projections a multiple of the 32-value scale block."""
    kernel = grouped_kernel_backend(w1, w2, w3)
    if n_tokens != 1 or kernel is None or not kernel.startswith("pallas_gpu"):
        return None
    return kernel if w1.shape[2] % 32 == 0 and w2.shape[2] % 32 == 0 else None


def routed_fp4_one_token(x, weights, idx, w1, w2, w3, limit, backend: str, decode: str | None = None):
    """x [1, d]; weights / idx [1, k]; marked stacked FP4 experts -> [1, d] float32: the routed experts of one token
    as two kernels over its k picks (``kernels.quant_gemm.fp4_slot_swiglu`` / ``fp4_slot_down``). The same maths
    and roundings as :func:`ops.moe.routed_ragged` on the grouped kernel: the input rounded to FP8 (w1's marker),
    gate / up rounded to x.dtype, the activation times the routing weight rounded to x.dtype and then to FP8 (w2's
    marker), each pick's output rounded to x.dtype and the picks summed in float32. ``decode``: the kernels' decode
    form (``kernels.quant_gemm_gpu.FP4_SLOT_DECODES``; None: their default)."""
    from dsv41_jax.kernels import quant_gemm

    tuning = {"decode": decode} if decode else None
    picks = idx[0].astype(jnp.int32)  # a token's top-k experts are distinct: one slot each, no sort
    xs = gemm_input(x, w1)[0]
    act = quant_gemm.fp4_slot_swiglu(xs, picks, weights[0].astype(jnp.float32), w1.weight, w3.weight,
                                     limit=float(limit), backend=backend, tuning=tuning)
    y = quant_gemm.fp4_slot_down(gemm_input(act, w2), picks, w2.weight, backend=backend, tuning=tuning)
    return y[None]


def fp4_every_expert_backend(n_tokens: int, top_k: int, w1, w2, w3) -> str | None:
    """The GPU kernel backend that runs :func:`routed_fp4_every_expert` for these routed experts, or None: release
    FP4 experts marked for a ``pallas_gpu`` quantised-GEMM backend (the grouped kernel's condition), a decode batch
    of 2..``EVERY_EXPERT_MAX_TOKENS`` tokens whose picks can cover every expert (``n_tokens * top_k >= n_experts``,
    the bf16 path's rule for its every-expert form: below it most experts go unpicked and the grouped kernel's
    launch is the smaller), and expert widths the kernels' tiles divide (multiples of 16 rows, 32-value K)."""
    from dsv41_jax.kernels.quant_gemm_gpu import EVERY_EXPERT_MAX_TOKENS

    kernel = grouped_kernel_backend(w1, w2, w3)
    if kernel is None or not kernel.startswith("pallas_gpu"):
        return None
    n_exp, f, d = w1.shape
    if not (2 <= n_tokens <= EVERY_EXPERT_MAX_TOKENS and n_tokens * top_k >= n_exp):
        return None
    return kernel if f % 32 == 0 and d % 32 == 0 else None


def routed_fp4_every_expert(x, weights, idx, w1, w2, w3, limit, backend: str, live=None, up_tuning=None,
                            down_tuning=None):
    """x [M, d]; weights / idx [M, k]; marked stacked FP4 experts -> [M, d] float32: every expert on every token
    (:func:`_routed_every_expert`'s form for the packed FP4 experts) as two kernels
    (``kernels.quant_gemm.fp4_every_swiglu`` / ``fp4_every_down``) over dense routing weights [E, M] — no sort, tile
    table or scatter. The same maths and roundings as :func:`ops.moe.routed_ragged` on the grouped kernel: the input
    rounded to FP8 (w1's marker), gate / up rounded to x.dtype, the activation times the routing weight rounded to
    x.dtype and then to FP8 (w2's marker), each pick's output rounded to x.dtype and the picks summed in float32;
    a token's unpicked experts contribute exact zeros. Experts that no (``live`` [M]) token picked are not read.
    ``live``: rows whose output is needed; the others pick nothing (routed output 0). ``up_tuning`` /
    ``down_tuning``: the two kernels' tiling overrides (``kernels.quant_gemm_gpu.fp4_every_tiling``; None: defaults)."""
    from dsv41_jax.kernels import quant_gemm

    n_exp = w1.shape[0]
    picked = idx[:, :, None] == jnp.arange(n_exp, dtype=idx.dtype)  # [M, k, E]; a token's picks are distinct
    if live is not None:
        picked = picked & live.reshape(-1, 1, 1)
    # at most one j matches (t, e): the sum is that weight, exactly, or 0
    dense = jnp.sum(jnp.where(picked, weights.astype(jnp.float32)[:, :, None], 0.0), axis=1).T  # [E, M]
    used = jnp.any(picked, axis=(0, 1)).astype(jnp.int32)  # [E]
    # the activations come out of the gate / up kernel already rounded as w2's input (its epilogue): the same
    # values as gemm_input(act, w2), without XLA's two rounding kernels
    act = quant_gemm.fp4_every_swiglu(gemm_input(x, w1), dense, used, w1.weight, w3.weight, limit=float(limit),
                                      round_fp8=isinstance(w2, Fp8GemmInput), backend=backend, tuning=up_tuning)
    return quant_gemm.fp4_every_down(act, used, w2.weight, backend=backend, tuning=down_tuning)


def _static_trip_count(m: int, k: int, w1, w2, w3) -> bool:
    """Whether m tokens' routed experts take :func:`routed_slots` (static trip count) rather than the tiled loop."""
    if m <= STATIC_MAX_TOKENS:
        return True
    n_exp = w1.shape[0]
    return (m * k >= n_exp and n_exp * _pow2_at_least(m) <= STATIC_MAX_ROWS
            and all(is_plain_weight(w) for w in (w1, w2, w3)))


def _grouped_fits(x, w1, w2, w3) -> bool:
    """Whether the routed experts can take the Mosaic GPU grouped GEMM (``grouped`` in :func:`moe_inference`):
    plain 16-bit weights and input, and tiles that divide both products (``kernels.grouped_gemm_mgpu.mgpu_fits``)."""
    from dsv41_jax.kernels.grouped_gemm_mgpu import mgpu_fits

    if not all(is_plain_weight(w) for w in (w1, w2, w3)):
        return False
    if any(jnp.dtype(a.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) for a in (x, w1, w2, w3)):
        return False
    n_exp, f, d = w1.shape
    return mgpu_fits(x.shape[0], d, f, n_exp) and mgpu_fits(x.shape[0], f, d, n_exp)


def moe_inference(x: jax.Array, params: dict, *, top_k: int, temp: float, scaling: float, limit: float,
                  normalize: bool = True, tile: int | None = None, backend: str = "auto",
                  router_one_pass: bool = False, fp4_one_token: bool = True,
                  fp4_slot_decode: str | None = None, fp4_grouped_tuning: tuple = (),
                  live: jax.Array | None = None, grouped: bool = False,
                  fp4_every_expert: bool = False) -> jax.Array:
    """x [..., d] -> y [..., d] in x.dtype (router + tiled routed experts + the shared expert). ``backend`` (a
    ``dsv41_jax.kernels`` backend) picks the decode path's slot kernels on a GPU (:func:`routed_slots`);
    ``router_one_pass``: the router logits as one reduction (``ops.moe.route``); ``fp4_one_token``: one token's
    release FP4 experts on the GPU kernels by :func:`routed_fp4_one_token` (default True, measured faster in the step;
    False: the grouped kernel — ``InferenceOptions.fp4_one_token``); ``fp4_slot_decode``: those kernels' decode form
    (None: their default); ``fp4_grouped_tuning``: (name, value) pairs for the grouped FP4 kernel (empty: its
    defaults); ``live`` (x's leading shape, bool): the tokens whose output is used (a chunk's unmasked rows) — on
    the slot / tiled paths the others' routed output is 0 and the experts only they picked are not read; the release
    FP4 and grouped paths ignore it. The live tokens' outputs do not depend on it. ``grouped``: token counts past the
    static paths (prefill chunks) run the routed experts as one grouped GEMM per projection through the Mosaic GPU
    kernels (``ops.moe.routed_ragged`` with ``grouped_mgpu``: each expert's weights read in place, no loop) instead
    of the tiled loop, where the weights and tiles suit them (:func:`_grouped_fits`; off GPUs the kernels'
    ``jax.lax`` reference runs). ``fp4_every_expert``: decode batches' release FP4 experts on the GPU kernels as
    every expert on every token (:func:`routed_fp4_every_expert`, where :func:`fp4_every_expert_backend` allows)
    instead of the grouped kernel (``InferenceOptions.fp4_every_expert``); ``live`` applies there too."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, idx, _ = route(flat, params["gate"]["weight"], params["gate"]["bias"], top_k=top_k, temp=temp,
                            scaling=scaling, normalize=normalize, one_pass=router_one_pass)
    e = params["experts"]
    live_rows = None if live is None else jnp.broadcast_to(live, shape[:-1]).reshape(-1)
    one_token = fp4_one_token_backend(flat.shape[0], e["w1"], e["w2"], e["w3"]) if fp4_one_token else None
    every = (fp4_every_expert_backend(flat.shape[0], top_k, e["w1"], e["w2"], e["w3"]) if fp4_every_expert
             else None)
    if one_token is not None:
        y = routed_fp4_one_token(flat, weights, idx, e["w1"], e["w2"], e["w3"], limit, one_token, fp4_slot_decode)
    elif every is not None:
        y = routed_fp4_every_expert(flat, weights, idx, e["w1"], e["w2"], e["w3"], limit, every, live_rows)
    elif grouped_kernel_backend(e["w1"], e["w2"], e["w3"]) is not None:
        # release FP4 experts with a quantised-GEMM kernel: one grouped Pallas GEMM per projection reads only the
        # experts that received rows, straight from their packed bytes (no slot padding, no per-expert loop)
        y = routed_ragged(flat, weights, idx, e["w1"], e["w2"], e["w3"], limit,
                          fp4_tuning=dict(fp4_grouped_tuning) or None)
    elif tile is None and _static_trip_count(flat.shape[0], top_k, e["w1"], e["w2"], e["w3"]):
        # decode (and short verification chunks on few experts): a loop with a static trip count
        y = routed_slots(flat, weights, idx, e["w1"], e["w2"], e["w3"], limit, backend, live=live_rows)
    elif tile is None and grouped and _grouped_fits(flat, e["w1"], e["w2"], e["w3"]):
        # prefill chunks on a Hopper GPU: one Mosaic GPU grouped GEMM per projection (module docstring); every row
        # is computed, masked ones too (their outputs are not used: ``live`` only saves work on the other paths)
        y = routed_ragged(flat, weights, idx, e["w1"], e["w2"], e["w3"], limit, grouped_impl="grouped_mgpu")
    else:
        y = routed_tiled(flat, weights, idx, e["w1"], e["w2"], e["w3"], limit, tile, live=live_rows)
    s = params["shared_experts"]
    y = y + expert_mlp(flat, s["w1"], s["w2"], s["w3"], limit).astype(jnp.float32)
    return y.astype(x.dtype).reshape(shape)


__all__ = ["moe_inference", "routed_tiled", "routed_slots", "routed_fp4_one_token", "fp4_one_token_backend",
           "routed_fp4_every_expert", "fp4_every_expert_backend",
           "STATIC_MAX_TOKENS",
           "STATIC_MAX_ROWS", "LIVE_SLOT_MAX_TOKENS"]
