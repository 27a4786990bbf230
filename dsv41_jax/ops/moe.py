"""DeepSeekMoE for V4.1: sqrt-softplus router with a selection-only (noaux) bias, normalised top-k weights × the
routed scaling factor, clamped SwiGLU experts, and exactly one shared expert (SPEC §6).

Routed-expert implementations with identical maths: ``dense`` (every expert on every token, masked; for tiny
configs and tests), ``ragged`` (tokens sorted by expert, ``jax.lax.ragged_dot``; dropless) and
``blocked`` (the same sorted rows, each expert's group padded to whole row blocks, one batched GEMM over the blocks
with every block's expert weight gathered: dropless, :func:`blocked_grouped_matmul`), ``grouped`` (the same blocks
through a Pallas GPU grouped GEMM that reads each block's expert weight in place, with dX / dW kernels:
``kernels.grouped_gemm_gpu``) and ``grouped_mgpu`` (the sorted rows unpadded through JAX's Mosaic GPU ragged-dot
kernels for Hopper: ``kernels.grouped_gemm_mgpu``). XLA's GPU backend lowers ``ragged_dot`` to a zero-padded batched
dot over *every* expert (each expert multiplies all M·k rows: E times the FLOPs; benchmarks/RESULTS.md, ISSUE 13
profile), which the others avoid. ``auto`` (the default, :func:`resolve_moe_impl`) picks ``grouped_mgpu`` on Hopper
GPUs (the fastest on an NVIDIA H200: 1.08x the train step's tokens/s of ``blocked``, ``grouped`` 1.04x, in one
process; benchmarks/RESULTS.md), ``grouped`` on other GPUs and ``ragged`` elsewhere (TPUs lower ``ragged_dot`` to a
grouped matmul kernel; on CPU nothing was measured faster).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.ops.linear import (gemm_input, is_plain_weight, linear, linear_many, matmul_precision,
                                  narrow_dot_one_pass, narrow_matmul_f32, quantized_gemm_backend,
                                  weight_array)

MOE_IMPLS = ("auto", "ragged", "blocked", "grouped", "grouped_mgpu", "dense", "expert_parallel")


def is_hopper_gpu() -> bool:
    """Whether the default device is an NVIDIA Hopper GPU (compute capability 9.x: the Mosaic GPU kernels' target)."""
    dev = jax.devices()[0]
    return dev.platform in ("gpu", "cuda") and str(getattr(dev, "compute_capability", "")).startswith("9.")


def resolve_moe_impl(impl: str) -> str:
    """The routed-expert implementation ``impl`` names: ``auto`` -> ``grouped_mgpu`` on a Hopper GPU, ``grouped``
    on other GPU backends, ``ragged`` otherwise; any other member of :data:`MOE_IMPLS` as given."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"unknown moe impl {impl!r}; choose one of {MOE_IMPLS}")
    if impl != "auto":
        return impl
    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        return "ragged"
    return "grouped_mgpu" if is_hopper_gpu() else "grouped"


def route(x: jax.Array, gate_weight: jax.Array, gate_bias: jax.Array, *, top_k: int, temp: float,
          scaling: float, normalize: bool = True, one_pass: bool = False):
    """x [M, d] -> (weights [M, k] fp32, indices [M, k] int32, scores [M, E] fp32). ``one_pass`` (a few tokens, a
    decode step): the logits as one float32 reduction over d (``ops.linear.narrow_dot_one_pass``) instead of a
    split-K GEMM and the sum of its chunks."""
    if one_pass:
        logits = narrow_dot_one_pass(x, gate_weight) / temp
    else:
        logits = narrow_matmul_f32(x, gate_weight) / temp  # float32 (the official router); few outputs, long d
    scores = jnp.sqrt(jax.nn.softplus(logits))
    _, idx = jax.lax.top_k(scores + gate_bias.astype(jnp.float32), top_k)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if normalize and top_k > 1:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, idx.astype(jnp.int32), scores


def swiglu(x: jax.Array, w1: jax.Array, w3: jax.Array, limit: float) -> jax.Array:
    """silu(min(W1 x, limit)) · clip(W3 x, ±limit) in fp32 (the pre-down-projection activation)."""
    # any weight form (float, release FP8 / FP4, marked); release FP8 weights on the GPU kernel path: one launch
    gate, up = (y.astype(jnp.float32) for y in linear_many(x, (w1, w3)))
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return jax.nn.silu(gate) * up


def expert_mlp(x, w1, w2, w3, limit, weight=None):
    y = swiglu(x, w1, w3, limit)
    if weight is not None:
        y = y * weight
    return linear(y.astype(x.dtype), w2)


def routed_dense(x, weights, idx, w1, w2, w3, limit):
    """Every expert on every token; combine with the (sparse) routing weights. O(M·E) — tests / tiny only."""
    n_exp = w1.shape[0]
    x_in, act_w2 = gemm_input(x, w1), w2  # release-format / marked stacked weights: dequantise, round inputs
    w1, w3, w2 = (weight_array(w, x.dtype) for w in (w1, w3, w2))
    dense_w = jnp.zeros((x.shape[0], n_exp), jnp.float32).at[jnp.arange(x.shape[0])[:, None], idx].add(weights)
    act = jax.vmap(lambda a, c: swiglu(x_in, a, c, limit), out_axes=1)(w1, w3)  # [M, E, F]
    act = act * dense_w[..., None]
    # the release rounds the down projection's input after the routing weight is applied
    act = gemm_input(act.astype(x.dtype), act_w2)
    return jnp.einsum("mef,edf->md", act, w2, precision=matmul_precision(act, w2)).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _block_weights(w: jax.Array, block_group: jax.Array, n_groups: int) -> jax.Array:
    """``w[block_group]`` ([n_blocks, ...]); ``block_group`` is sorted, so the weight gradient — the sum of each
    group's blocks — is one GEMM with a one-hot [G, n_blocks] matrix (float32 accumulation), not a scatter-add
    (measured on the H200 as a slow kernel of the step, benchmarks/RESULTS.md)."""
    return jnp.take(w, block_group, axis=0)


def _block_weights_fwd(w, block_group, n_groups):
    return jnp.take(w, block_group, axis=0), (block_group, jnp.zeros((), w.dtype))


def _block_weights_bwd(n_groups, res, g):
    block_group, w_dtype_carrier = res
    one_hot = (jnp.arange(n_groups, dtype=block_group.dtype)[:, None] == block_group[None, :]).astype(g.dtype)
    prec = jax.lax.Precision.HIGHEST if g.dtype == jnp.float32 else None  # no TF32 rounding of float32 gradients
    dw = jnp.einsum("gb,b...->g...", one_hot, g, precision=prec, preferred_element_type=jnp.float32)
    return dw.astype(w_dtype_carrier.dtype), None


_block_weights.defvjp(_block_weights_fwd, _block_weights_bwd)


def blocked_grouped_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array, *, block: int = 512,
                           precision=None, kernel: str | None = None) -> jax.Array:
    """``rows`` [M, K] sorted by group (``group_sizes`` [G], summing to M) times their group's ``w`` [G, N, K]
    (transposed) -> [M, N] in ``rows.dtype``; equals ``ragged_dot(rows, swapaxes(w, 1, 2), group_sizes)``.

    Each group's rows are copied to the start of a fresh run of ``block``-row blocks (at most ceil(M / block) + G
    blocks in all, a static bound), and the blocks are multiplied by their group's weight:

    * ``kernel=None`` (XLA): every block takes its group's weight (``_block_weights``: the weight gradient of a
      group's blocks is summed in float32 by one GEMM), and one batched GEMM runs over the blocks.
    * ``kernel="gpu"`` / ``"interpret"``: the Pallas grouped GEMM (``kernels.grouped_gemm_gpu``, compiled or in
      interpret mode) reads each block's expert weight in place, with dX and dW kernels for the gradients; its tiles
      set the block size (``block`` is ignored). Shapes its tiles cannot divide take the XLA form.

    Work: the M rows plus at most ``block - 1`` padding rows per group — not G x M. The product has float32
    accumulation inside and the operands' dtype outside (as ``ragged_dot``), so the backward GEMMs get a bf16
    cotangent: a float32 output (``preferred_element_type``) made them float32 (TF32) GEMMs on the H200, the largest
    kernels of the step (benchmarks/RESULTS.md). Inference's ``inference.moe.routed_tiled`` cuts the same sorted
    rows into tiles but loops over the tiles that exist (a dynamic trip count: not differentiable)."""
    m, k = rows.shape
    g, n, _ = w.shape
    tiles = None
    if kernel is not None:
        from dsv41_jax.kernels import grouped_gemm_gpu as gg

        if kernel not in ("gpu", "interpret"):
            raise ValueError(f"blocked_grouped_matmul: kernel must be None, 'gpu' or 'interpret', got {kernel!r}")
        bound_rows = -(-m // 16) * 16 + g * gg.GROUPED_TILES["block_m"]
        tiles = gg.grouped_tiles(k, n, max(w.size, bound_rows * max(k, n)))
        if tiles is not None:
            block = tiles["block_m"]
    # no block larger than the power of two above the mean group size: few rows per group (small batches) would
    # otherwise be mostly padding
    block = min(block, max(16 if tiles else 8, 1 << (max(1, -(-m // g)) - 1).bit_length()))
    n_blocks = -(-m // block) + g
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    padded = -(-sizes // block) * block
    padded_ends = jnp.cumsum(padded)
    group_of_row = jnp.repeat(jnp.arange(g, dtype=jnp.int32), sizes, total_repeat_length=m)
    dest = (padded_ends - padded)[group_of_row] + jnp.arange(m, dtype=jnp.int32) - starts[group_of_row]
    # dest is strictly increasing (rows sorted by group, groups laid out in order): unique, sorted indices let
    # XLA scatter / gather without atomics, here and in the transposes of the backward
    buf = jnp.zeros((n_blocks * block, k), rows.dtype).at[dest].set(rows, unique_indices=True,
                                                                     indices_are_sorted=True)
    # blocks past the last group's run hold zeros; give them any valid group (their outputs are never read)
    block_group = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(n_blocks) * block, side="right"),
                              g - 1).astype(jnp.int32)
    if tiles is not None:
        tiles["block_m"] = block
        tiles["dw"]["block_r"] = min(tiles["dw"]["block_r"], block)
        n_live = (padded_ends[-1:] // block).astype(jnp.int32)
        out = gg.grouped_gemm(buf, w, block_group, n_live, (padded_ends - padded).astype(jnp.int32),
                              padded.astype(jnp.int32), gg.tiles_key(tiles), kernel == "interpret")
    else:
        w_blocks = _block_weights(w, block_group, g)  # [n_blocks, N, K]
        out = jnp.einsum("bmk,bnk->bmn", buf.reshape(n_blocks, block, k), w_blocks, precision=precision)
        out = out.reshape(n_blocks * block, n)
    return out.at[dest].get(unique_indices=True, indices_are_sorted=True)


def routed_ragged(x, weights, idx, w1, w2, w3, limit, grouped_impl: str = "ragged_dot", block: int = 512,
                  fp4_tuning: dict | None = None):
    """Dropless grouped matmuls: sort the M·k assignments by expert, one grouped GEMM per projection
    (``grouped_impl``: ``ragged_dot``, ``blocked`` or ``grouped`` — :func:`blocked_grouped_matmul` in its XLA or
    its Pallas kernel form; the kernel compiles on a GPU backend and runs in interpret mode elsewhere — or
    ``grouped_mgpu``: JAX's Mosaic GPU ragged-dot kernels for Hopper, ``kernels.grouped_gemm_mgpu``, with the
    ``jax.lax`` ragged products in their place off GPUs), scatter back. ``fp4_tuning``: the FP4 grouped kernel's
    tiling / form (``kernels.quant_gemm.fp4_grouped``'s ``tuning``) when the experts are stored FP4."""
    m, k = idx.shape
    n_exp = w1.shape[0]
    flat_expert = idx.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    token_of = order // k
    # every (token, slot) row once, permuted by expert: a gather with unique indices, whose transpose (the input
    # gradient) is a plain scatter and a sum over the k slots rather than an atomic scatter-add of 16-bit rows
    # (the latter measured at ~1 ms per MoE layer on the H200 at 4,096 tokens, benchmarks/RESULTS.md)
    # the input rounded (release weights) before its rows are copied: the rounding is per row, so the copies are
    # the same values, and a shared expert rounding the same ``x`` shares the one rounding (XLA's CSE) instead of a
    # second one over k times the rows
    x_in = gemm_input(x, w1)
    x_slots = jnp.broadcast_to(x_in[:, None, :], (m, k, x.shape[-1])).reshape(m * k, x.shape[-1])
    xs = x_slots.at[order].get(unique_indices=True)
    act_w2 = w2
    group_sizes = jnp.bincount(flat_expert, length=n_exp).astype(jnp.int32)
    kernel = grouped_kernel_backend(w1, w2, w3)
    if kernel is not None:  # Pallas grouped GEMM on the stored FP4 bytes (kernels.quant_gemm)
        from dsv41_jax.kernels import quant_gemm

        def grouped(rows, w):
            return quant_gemm.fp4_grouped(rows, group_sizes, w.weight, backend=kernel, tuning=fp4_tuning)
    else:
        w1, w3, w2 = (weight_array(w, x.dtype) for w in (w1, w3, w2))
        prec = matmul_precision(x, w1)  # HIGHEST only for float32 operands (Mosaic rejects it on a bf16 ragged_dot)

        def grouped(rows, w):
            if grouped_impl == "blocked":
                return blocked_grouped_matmul(rows, w, group_sizes, block=block, precision=prec)
            on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
            if grouped_impl == "grouped":
                return blocked_grouped_matmul(rows, w, group_sizes, precision=prec,
                                              kernel="gpu" if on_gpu else "interpret")
            if grouped_impl == "grouped_mgpu":
                from dsv41_jax.kernels import grouped_gemm_mgpu as gm

                fits = gm.mgpu_fits(*rows.shape, w.shape[1], w.shape[0])
                # 16-bit operands only (a float32 wgmma would be TF32); else the Pallas grouped kernel (or its XLA form)
                if rows.dtype not in (jnp.bfloat16, jnp.float16) or not fits:
                    return blocked_grouped_matmul(rows, w, group_sizes, precision=prec,
                                                  kernel="gpu" if on_gpu else "interpret")
                return gm.ragged_gemm(rows, w, group_sizes, "mgpu" if on_gpu else "reference",
                                      gm.tiles_key(gm.MGPU_TILES))
            return jax.lax.ragged_dot(rows, jnp.swapaxes(w, 1, 2), group_sizes, precision=prec)
    gate = grouped(xs, w1).astype(jnp.float32)
    up = grouped(xs, w3).astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    act = jax.nn.silu(gate) * up * weights.reshape(-1)[order][:, None]
    out = grouped(gemm_input(act.astype(x.dtype), act_w2), w2)
    return jnp.zeros((m, x.shape[-1]), jnp.float32).at[token_of].add(out.astype(jnp.float32))


def grouped_kernel_backend(*ws) -> str | None:
    """The quantised-GEMM kernel backend shared by stacked expert weights (all marked ``Fp8GemmInput`` with one
    kernel ``gemm`` and stored as FP4 QuantizedTensors), or None: the plain-JAX path."""
    bes = {quantized_gemm_backend(w) for w in ws}
    if len(bes) != 1 or None in bes:
        return None
    from dsv41_jax.kernels import quant_gemm

    return bes.pop() if all(quant_gemm.takes_fp4_grouped(w.weight) for w in ws) else None


def moe(x: jax.Array, params: dict, *, top_k: int, temp: float, scaling: float, limit: float,
        impl: str = "auto", normalize: bool = True, capacity_factor: float | None = None):
    """x [..., d] -> (y [..., d] in x.dtype, aux dict with router scores / indices for statistics).

    ``impl="expert_parallel"`` dispatches tokens to experts sharded over a mesh (``dsv41_jax.parallel``; needs an
    active sharding context); ``capacity_factor`` (EP only, None = dropless) may drop assignments, counted per
    token in ``aux["dropped"]``."""
    impl = resolve_moe_impl(impl)
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, idx, scores = route(flat, params["gate"]["weight"], params["gate"]["bias"], top_k=top_k, temp=temp,
                                 scaling=scaling, normalize=normalize)
    e = params["experts"]
    extra = {}
    if impl == "expert_parallel":
        from dsv41_jax.parallel.expert_parallel import routed_expert_parallel  # lazy: ops stay mesh-agnostic

        if not all(is_plain_weight(e[k]) for k in ("w1", "w2", "w3")):
            raise NotImplementedError("moe_impl='expert_parallel' takes float expert weights; release-format / "
                                      "FP8-input experts run with 'ragged' or 'dense'")

        y, ep_aux = routed_expert_parallel(flat, weights, idx, e["w1"], e["w2"], e["w3"], limit,
                                           capacity_factor=capacity_factor)
        extra["dropped"] = ep_aux["dropped"].reshape(shape[:-1])
    else:
        if impl == "dense":
            y = routed_dense(flat, weights, idx, e["w1"], e["w2"], e["w3"], limit)
        else:
            grouped_impl = impl if impl in ("blocked", "grouped", "grouped_mgpu") else "ragged_dot"
            y = routed_ragged(flat, weights, idx, e["w1"], e["w2"], e["w3"], limit, grouped_impl=grouped_impl)
    s = params["shared_experts"]
    y = y + expert_mlp(flat, s["w1"], s["w2"], s["w3"], limit).astype(jnp.float32)
    return y.astype(x.dtype).reshape(shape), {"scores": scores, "indices": idx, **extra}
