"""Single-pass mHC: the residual state is ``hc`` parallel streams; every site (attention, FFN) computes
``pre``/``post``/``comb`` from one projection of the RMS-normalised flattened streams, and — the V4.1 single-pass
twist — a site's input is collapsed with the ``pre`` computed at the PREVIOUS site (SPEC §3).
Everything here runs in float32.

Shapes decide how the float32 products run on a GPU (measured on the H200 train step, benchmarks/RESULTS.md): the
coefficient projection [tokens, hc·D] x [(2+hc)·hc, hc·D]ᵀ has 24 outputs and a 20,480-long contraction, which a
float32 cuBLAS GEMM ran with one 32x32 tile per 32 tokens looping over the whole contraction (1.6 ms for 4 GFLOP);
its weight gradient and input gradient were as slow. So the projection is ``ops.linear.narrow_matmul_f32`` (the
contraction split into a batch of chunks), and the 4 x 4 stream mixes (``collapse`` / ``expand``) are written as
sums of products that XLA fuses with their neighbours instead of batched GEMMs with a contraction of 4. All of it
stays exact float32 arithmetic (only the order of the float32 additions differs from one long dot).
"""

import math

import jax
import jax.numpy as jnp

from dsv41_jax.ops.linear import narrow_matmul_f32
from dsv41_jax.ops.norms import rms_norm, rms_normalize


# How the train step's ``comb`` (softmax + Sinkhorn, differentiable) runs when no ``comb_kernel`` is asked for:
#   "auto" (default) — "pallas_gpu" on a GPU (measured faster there), "loop" elsewhere (CPU / TPU results unchanged);
#   "loop" — XLA: a rolled loop of row / column normalisations (about ten tiny kernels per iteration forward and two
#       backward on a GPU: ~1,800 launches per fullwidth4 step on an H200, ≈ 2.3 ms);
#   "pallas_gpu" / "pallas_gpu_interpret" — ``kernels.mhc_gpu.sinkhorn_comb``: one kernel forward and one backward
#       per site, the same float32 maths (sums left to right: the last bits may differ); the fullwidth4 train step
#       2.4 ms faster than "loop" on an H200 in one process (158.0 vs 160.4 ms; loop-body launches per step ~1,800 -> 138;
#       benchmarks/RESULTS.md, 2026-12-02 19:22); the interpret form for CPU tests (slow: minutes for 19 iterations).
SINKHORN_FORMS = ("auto", "loop", "pallas_gpu", "pallas_gpu_interpret")
SINKHORN_FORM = "auto"


def _sinkhorn_form() -> str:
    if SINKHORN_FORM not in SINKHORN_FORMS:
        raise ValueError(f"ops.mhc.SINKHORN_FORM = {SINKHORN_FORM!r}: want one of {SINKHORN_FORMS}")
    if SINKHORN_FORM == "auto":
        return "pallas_gpu" if jax.default_backend() == "gpu" else "loop"
    return SINKHORN_FORM


def mhc_coefficients(streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, hc_eps: float,
                     rms_eps: float, sinkhorn_iters: int, unroll: bool = False,
                     comb_kernel: str | None = None, one_pass: bool = False,
                     projection: str | None = None,
                     partials: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """streams [..., hc, D] -> (pre [..., hc], post [..., hc], comb [..., hc, hc]).

    ``fn`` [(2+hc)*hc, hc*D] rows are ordered pre(hc), post(hc), comb(hc*hc, row-major i -> j). ``comb`` is
    Sinkhorn-projected to (nearly) doubly stochastic, ending column-normalised: comb[i, j] weighs input stream i
    into output stream j. ``unroll``: unroll the Sinkhorn loop (same result) — a GPU decode step then runs a few
    fused kernels instead of launching the loop body's tiny kernels once per iteration; a rolled loop compiles
    faster (CPU, training). ``comb_kernel``: a Pallas GPU backend (``"pallas_gpu"``, or ``"pallas_gpu_interpret"``
    on a CPU) computes the softmax and the Sinkhorn iterations in one kernel (``kernels.mhc_gpu``; inference only:
    no gradient). ``one_pass`` (for a few tokens, a decode step): the projection and the RMS of the streams as one
    reduction over the streams (:func:`_project_rms_one_pass`) instead of a normalisation, a split-K GEMM and the sum
    of its chunks — fewer kernels, the same float32 maths up to the order of the additions. ``projection`` (one_pass
    with ``comb_kernel``): how the one-pass sums are formed — "reduce" (one multiply-reduce over the contraction),
    "gemm" (:func:`_project_sums_dot`), "kernel" (``kernels.mhc_gpu.mhc_sums_kernel``: one Pallas kernel, P partial
    sums the coefficient kernel adds), None: "reduce" (why: the notes above :func:`_project_sums_dot` and
    :data:`PROJECTIONS`). ``partials`` ("reduce" with the coefficient kernel): the reduce's partial sums per entry
    handed to the kernel (a power of two is used: the largest <= partials); None: by the token count
    (:func:`_kernel_partials`: 32 at one token, 64 up to 32 tokens, else 1).
    """
    if projection not in PROJECTIONS:
        raise ValueError(f"mhc_coefficients: projection must be one of {PROJECTIONS}, got {projection!r}")
    if partials is not None and (isinstance(partials, bool) or not isinstance(partials, int) or partials < 1):
        raise ValueError(f"mhc_coefficients: partials must be a positive int or None, got {partials!r}")
    hc = streams.shape[-2]
    if comb_kernel is not None:
        # every coefficient in one kernel after the projection (kernels.mhc_gpu.mhc_coefficients_kernel); with
        # one_pass the kernel also applies the RMS normalisation to the raw one-pass sums
        from dsv41_jax.kernels.mhc_gpu import mhc_coefficients_kernel  # lazy: ops does not need the kernels package

        lead = streams.shape[:-2]
        flat = streams.reshape(*lead, -1)
        if one_pass and projection == "kernel":  # the sums as P partials from one Pallas kernel
            from dsv41_jax.kernels.mhc_gpu import mhc_sums_kernel

            # the streams as float32 (exact), as collapse_rms_norm hands them to its kernel: XLA then passes the
            # float32 buffer its mHC expand already wrote (a bf16 operand was one more conversion kernel per site)
            x = mhc_sums_kernel(flat.reshape(-1, flat.shape[-1]).astype(jnp.float32), fn,
                                interpret=comb_kernel.endswith("interpret"))
            x, rms_k = x.reshape(*lead, *x.shape[1:]), flat.shape[-1]
        elif one_pass and projection == "gemm":  # the projection as a GEMM
            x, rms_k = _project_sums_dot(flat, fn), flat.shape[-1]
        elif one_pass:  # up to 32 tokens the kernel adds the partial sums (one XLA reduction kernel before it, not two)
            parts = partials or _kernel_partials(math.prod(lead))
            x, rms_k = _project_sums_one_pass(flat, fn, parts=parts), flat.shape[-1]
        else:
            x = narrow_matmul_f32(rms_normalize(flat, rms_eps).reshape(-1, flat.shape[-1]), fn)
            rms_k = None
        pre, post, comb = mhc_coefficients_kernel(
            x.reshape(-1, *(x.shape[len(lead):] if one_pass else x.shape[-1:])), scale, base, hc=hc,
            hc_eps=float(hc_eps), iters=int(sinkhorn_iters), rms_k=rms_k, rms_eps=float(rms_eps),
            interpret=comb_kernel.endswith("interpret"))
        return pre.reshape(*lead, hc), post.reshape(*lead, hc), comb.reshape(*lead, hc, hc)
    if one_pass:
        mix = _project_rms_one_pass(streams.reshape(*streams.shape[:-2], -1), fn, rms_eps)
    else:
        flat = rms_normalize(streams.reshape(*streams.shape[:-2], -1), rms_eps)
        mix = narrow_matmul_f32(flat.reshape(-1, flat.shape[-1]), fn).reshape(*flat.shape[:-1], -1)
    scale = scale.astype(jnp.float32)
    base = base.astype(jnp.float32)
    pre = jax.nn.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(mix[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (mix[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*mix.shape[:-1], hc, hc)
    form = _sinkhorn_form()
    if form.startswith("pallas_gpu") and not unroll:
        from dsv41_jax.kernels.mhc_gpu import sinkhorn_comb  # lazy: ops does not need the kernels package

        comb = sinkhorn_comb(logits.reshape(-1, hc * hc), hc, float(hc_eps), int(sinkhorn_iters),
                             interpret=form.endswith("interpret"))
        return pre, post, comb.reshape(logits.shape)
    comb = jax.nn.softmax(logits, axis=-1) + hc_eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + hc_eps)

    def body(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    comb = jax.lax.fori_loop(0, sinkhorn_iters - 1, body, comb, unroll=True if unroll else 1)
    return pre, post, comb


# The one-pass sums' forms with the coefficient kernel (``mhc_coefficients(projection=...)``; None: "reduce").
# "kernel" (``kernels.mhc_gpu.mhc_sums_kernel``) is not the default: measured on an H200 (2026-12-04 00:05,
# bench_decode_glue.py, float32, the coefficient kernel included) 24.4 against 25.2 µs a site at batch 32 — its sums
# 11.7 µs against XLA's 19.4 + 1.4, but the coefficient kernel 12.7 against 4.4 µs on 128 partials — and 19.4
# against 12.2 µs at batch 1; the bf16 40-layer step at batch 32 22.30 against 22.22 ms (2 launches fewer a layer).
PROJECTIONS = (None, "reduce", "gemm", "kernel")


# partial sums per entry handed to the coefficient kernel by the one-pass reduce (a power of two), by the step's
# token count. Measured on an H200 (benchmarks/RESULTS.md, 2026-12-04 01:21, bench_decode_glue.py, one site with
# the coefficient kernel, float32): one token 12.78 µs with 128 partials (the coefficient kernel's [1, 128] tiles
# 10.9 µs) against 6.43 with 32, 6.28 with 8 (the bf16 40-layer step at batch 1 12.46 -> 11.90 ms with 32); 32
# tokens 24.94 µs with XLA's own split (two reduction kernels) against 18.50 with 64 and 19.82 with 32 (128 had
# made the 12-layer step at batch 32 1.25 ms slower, 2026-12-02 22:27: its tiles' registers spilling). Other token
# counts keep XLA's split (partials 1): not measured.
_KERNEL_PARTS_MAX_TOKENS = 32


def _kernel_partials(tokens: int) -> int:
    return 32 if tokens <= 1 else 64 if tokens <= _KERNEL_PARTS_MAX_TOKENS else 1


# The one-pass sums as a float32 GEMM (``projection="gemm"``) rather than one multiply-reduce over the contraction.
# Why it was tried: the reduce reads every token's 20,480 stream entries once per output (25 times) and every weight
# once per token; at batch 32 XLA:GPU emits it as a reduction kernel of 20 µs a launch on an H200 (1.56 ms of the
# 40-layer bench model's decode step, 2 sites per layer) for ≈ 4.6 MB. Why it is not the default: in the step (H200,
# 2026-12-03 15:15) the GEMM form's split-K GEMM took 0.86 ms for those sites but its sum of squares, chunk sum and
# concatenation added about 4 launches per layer (bf16 step 39.2 -> 43.3 per layer, kernel time unchanged: 22.00 vs
# 22.02 ms; release step -0.4 ms of kernel time against another machine's profile) and no same-run comparison was
# made. ``narrow_matmul_f32``'s own split of the contraction rather than one dot XLA:GPU splits itself: in isolation
# on an H200 (bench_decode_glue.py, batch 32, the coefficient kernel included) 18.2 against 19.5 µs a site.
def _project_sums_dot(flat: jax.Array, fn: jax.Array) -> jax.Array:
    """:func:`_project_sums_one_pass`'s N + 1 sums (parts = 1) with the N products as one float32 GEMM at HIGHEST
    precision (exact float32 products; ``narrow_matmul_f32`` splits the long contraction) and the sum of squares
    as a reduction: flat [..., K], fn [N, K] -> [..., N + 1] float32; the same sums up to the order of the
    float32 additions."""
    x = flat.astype(jnp.float32)
    x2 = x.reshape(-1, x.shape[-1])
    proj = narrow_matmul_f32(x2, fn)
    sumsq = jnp.sum(x * x, axis=-1, keepdims=True)
    return jnp.concatenate([proj.reshape(*x.shape[:-1], -1), sumsq], axis=-1)


def _project_sums_one_pass(flat: jax.Array, fn: jax.Array, parts: int = 1) -> jax.Array:
    """The N raw products flat · fnᵀ and the sum of squares of flat as the N + 1 rows of ONE sum over the
    contraction: flat [..., K] (any float dtype), fn [N, K] -> [..., N + 1] float32. ``parts`` > 1: the sums over
    ``P`` equal slices of the contraction instead, [..., N + 1, P] (P the largest power of two <= ``parts`` that
    divides K), for a consumer that adds them."""
    x = flat.astype(jnp.float32)
    w = fn.astype(jnp.float32)
    rows = jnp.concatenate([x[..., None, :] * w, (x * x)[..., None, :]], axis=-2)  # [..., N + 1, K]
    if parts <= 1:
        return jnp.sum(rows, axis=-1)
    k = rows.shape[-1]
    p = 1 << (parts.bit_length() - 1)
    while k % p:
        p //= 2
    return jnp.sum(rows.reshape(*rows.shape[:-1], p, k // p), axis=-1)


def _project_rms_one_pass(flat: jax.Array, fn: jax.Array, eps: float) -> jax.Array:
    """rms_normalize(flat) · fnᵀ as ONE reduction over the flattened streams (:func:`_project_sums_one_pass`), the
    normalisation (a per-token scalar) applied to the N sums afterwards. flat [..., K], fn [N, K] -> [..., N]
    float32."""
    sums = _project_sums_one_pass(flat, fn)
    n, k = fn.shape
    return sums[..., :n] * jax.lax.rsqrt(sums[..., n:] / k + eps)


def _sum_over(terms):
    out = terms[0]
    for t in terms[1:]:
        out = out + t
    return out


def collapse(streams: jax.Array, pre: jax.Array, *, unrolled: bool = False) -> jax.Array:
    """Σ_s pre[s] · streams[s]  (fp32 math, result in the streams' dtype). ``unrolled``: the sum over the hc
    streams as hc - 1 additions (element-wise, so XLA fuses it into its consumer, e.g. the RMS norm's reduction)
    rather than a reduction of its own."""
    p32, s32 = pre.astype(jnp.float32), streams.astype(jnp.float32)
    if unrolled:
        out = _sum_over([p32[..., i, None] * s32[..., i, :] for i in range(streams.shape[-2])])
    else:
        out = jnp.sum(p32[..., None] * s32, axis=-2)
    return out.astype(streams.dtype)


def collapse_rms_norm(streams: jax.Array, pre: jax.Array, weight: jax.Array, eps: float, *, unrolled: bool = False,
                      kernel: str | None = None) -> jax.Array:
    """``rms_norm(collapse(streams, pre), weight, eps)``: a site's normalised input, [..., hc, D] -> [..., D] in the
    streams' dtype. ``kernel`` (``"pallas_gpu"``, or ``"pallas_gpu_interpret"`` on a CPU): both in one Pallas
    kernel (``kernels.mhc_gpu.collapse_rms_norm_kernel``; a decode step's few tokens: one launch instead of XLA's
    three per site), the same float32 maths with the streams summed left to right."""
    if kernel is None:
        return rms_norm(collapse(streams, pre, unrolled=unrolled), weight, eps)
    from dsv41_jax.kernels.mhc_gpu import collapse_rms_norm_kernel  # lazy: ops does not need the kernels package

    lead, (hc, d) = streams.shape[:-2], streams.shape[-2:]
    # the streams as float32 (exact): XLA's mHC expand keeps them in float32 before rounding to the streams' dtype,
    # so the kernel reads that buffer rather than one more conversion kernel's output
    out = collapse_rms_norm_kernel(streams.reshape(-1, hc, d).astype(jnp.float32),
                                   pre.reshape(-1, hc).astype(jnp.float32), weight, eps=float(eps),
                                   dtype=streams.dtype, interpret=kernel.endswith("interpret"))
    return out.reshape(*lead, d)


def expand(streams: jax.Array, y: jax.Array, post: jax.Array, comb: jax.Array, *,
           unrolled: bool = False) -> jax.Array:
    """out[j] = post[j] · y + Σ_i comb[i, j] · streams[i]. ``unrolled``: the sum over i as additions (one
    element-wise fusion) rather than a reduction."""
    c32, s32 = comb.astype(jnp.float32), streams.astype(jnp.float32)
    if unrolled:
        hc = streams.shape[-2]
        mixed = jnp.stack([_sum_over([c32[..., i, j, None] * s32[..., i, :] for i in range(hc)]) for j in range(hc)],
                          axis=-2)
    else:
        mixed = jnp.sum(c32[..., None] * s32[..., :, None, :], axis=-3)
    out = post[..., None].astype(jnp.float32) * y.astype(jnp.float32)[..., None, :] + mixed
    return out.astype(streams.dtype)
