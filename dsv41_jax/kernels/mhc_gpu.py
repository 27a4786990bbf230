"""Pallas GPU kernel (Triton lowering): an mHC site's coefficients — ``pre`` / ``post`` (scales, biases, sigmoids)
and ``comb`` (a row softmax of each token's hc x hc logits, then Sinkhorn normalisation) — in one kernel.

``ops.mhc.mhc_coefficients`` computes ``comb`` in float32 as softmax over j, + eps, a column normalisation, and
``sinkhorn_iters - 1`` (row, column) normalisation pairs. Written in XLA, every normalisation of the tiny hc x hc
matrix is a reduction that XLA does not chain with the next one, so a decode step launched about eight small
reduction kernels per mHC site (measured on an H200: ``input_reduce_fusion``, 201 launches per batch-1 step of the
12-layer bench model, 24 sites). Here each program holds a block of tokens' hc * hc entries as hc * hc vectors in
registers, and every sum over a row or column is a chain of adds: one launch per site, the same float32 maths.
Sums run left to right over the hc entries, so results can differ from XLA's reduction order in the last bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

BLOCK_TOKENS = 128


def _sum(vs):
    out = vs[0]
    for v in vs[1:]:
        out = out + v
    return out


def _normalize_rows(c, hc, eps):
    out = list(c)
    for i in range(hc):
        s = _sum(c[i * hc:(i + 1) * hc]) + eps
        for j in range(hc):
            out[i * hc + j] = c[i * hc + j] / s
    return out


def _normalize_cols(c, hc, eps):
    out = list(c)
    for j in range(hc):
        s = _sum(c[j::hc]) + eps
        for i in range(hc):
            out[i * hc + j] = c[i * hc + j] / s
    return out


def _sigmoid(v):
    return 1.0 / (1.0 + jnp.exp(-v))


@functools.partial(jax.jit, static_argnames=("hc", "hc_eps", "iters", "rms_k", "rms_eps", "block", "interpret"))
def mhc_coefficients_kernel(x, scale, base, *, hc: int, hc_eps: float, iters: int, rms_k: int | None = None,
                            rms_eps: float = 0.0, block: int = BLOCK_TOKENS, interpret: bool = False):
    """All of an mHC site's coefficients from its projection in ONE kernel: (pre [N, hc], post [N, hc], comb
    [N, hc * hc]), float32, as ``ops.mhc.mhc_coefficients`` computes them from ``mix``:
    pre = sigmoid(mix[:hc] * scale[0] + base[:hc]) + hc_eps, post = 2 sigmoid(mix[hc:2hc] * scale[1] + base[hc:2hc]),
    comb = softmax + Sinkhorn of mix[2hc:] * scale[2] + base[2hc:] (:func:`sinkhorn_fwd_math`).

    ``x`` [N, n] float32 is ``mix`` (n = (2 + hc) hc); with ``rms_k`` it is the one-pass sums [N, n + 1] (the n raw
    products and, last, the sum of squares of the K = ``rms_k`` flattened stream entries) and the RMS normalisation
    mix = sums[:n] * rsqrt(sums[n] / K + rms_eps) is applied here too. Why: in a decode step the scale / bias of the
    comb logits and the normalisation were one more small XLA kernel per site between the projection and the
    Sinkhorn kernel (24 sites per step of the 12-layer bench model). ``x`` may also be [N, width, P] (P a power of
    two): P partial sums of each entry over slices of the contraction, added here (left to right). Why: XLA split
    the one-pass reduction over K = hc * d (20,480) into a partial-sums kernel and a final-sum kernel; given the
    partials as one explicit reduction, the final sums join this kernel — one launch fewer per site."""
    n_tok = x.shape[0]
    n = (2 + hc) * hc
    width = n + (1 if rms_k is not None else 0)
    parts = x.shape[2] if x.ndim == 3 else None
    # a decode step's few tokens: a block no larger than the tokens (the partial sums are loaded as [block, P]
    # tiles, masked rows included: a 128-row block at batch 1 would issue 128x the loads it needs)
    block = min(block, 1 << max(n_tok - 1, 0).bit_length())
    if parts is not None:  # a [block, P] tile per entry, n + 1 entries: at most 256 values each (measured on an
        # H200: [32, 128] tiles made a batch-32 site ≈ 16 µs slower, likely spilled registers;
        # ops.mhc._kernel_partials)
        block = min(block, max(1, 256 // parts))
    if x.shape[:2] != (n_tok, width) or x.ndim not in (2, 3) or (parts is not None and parts & (parts - 1)):
        raise ValueError(f"mhc_coefficients_kernel: x must be [tokens, {width}] or [tokens, {width}, P] (P a power "
                         f"of two) for hc = {hc}{' with the sum of squares last' if rms_k is not None else ''}, "
                         f"got {x.shape}")
    if scale.shape != (3,) or base.shape != (n,):
        raise ValueError(f"mhc_coefficients_kernel: scale must be [3] and base [{n}], got {scale.shape} and "
                         f"{base.shape}")
    if iters < 1:
        raise ValueError(f"mhc_coefficients_kernel: iters must be >= 1, got {iters}")
    m = hc * hc

    # scale and base are read as they are (no cast or concatenation before the kernel: that would be one more
    # small XLA kernel per site, the launch this kernel is here to save)
    def kernel(x_ref, s_ref, b_ref, pre_ref, post_ref, comb_ref):
        rows = pl.program_id(0) * block + jnp.arange(block)
        ok = rows < n_tok
        safe = jnp.minimum(rows, n_tok - 1)

        def entry(j):
            if parts is None:
                return pltr.load(x_ref.at[safe, j], mask=ok, other=0.0)
            v = pltr.load(x_ref.at[safe[:, None], j, jnp.arange(parts)[None, :]], mask=ok[:, None],
                          other=0.0)  # [block, P]
            return jnp.sum(v, axis=1)

        mix = [entry(j) for j in range(n)]
        if rms_k is not None:
            sq = entry(n)
            r = jax.lax.rsqrt(sq / rms_k + rms_eps)
            mix = [v * r for v in mix]
        sc = [s_ref[g].astype(jnp.float32) for g in range(3)]
        group = [0] * hc + [1] * hc + [2] * m  # pre, post, comb columns
        z = [mix[j] * sc[group[j]] + b_ref[j].astype(jnp.float32) for j in range(n)]
        for i in range(hc):
            pltr.store(pre_ref.at[rows, i], _sigmoid(z[i]) + hc_eps, mask=ok)
            pltr.store(post_ref.at[rows, i], 2.0 * _sigmoid(z[hc + i]), mask=ok)
        c = sinkhorn_fwd_math(z[2 * hc:], hc, hc_eps, iters)
        for k in range(m):
            pltr.store(comb_ref.at[rows, k], c[k], mask=ok)

    f32 = jnp.float32
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(n_tok, block),),
        out_shape=(jax.ShapeDtypeStruct((n_tok, hc), f32), jax.ShapeDtypeStruct((n_tok, hc), f32),
                   jax.ShapeDtypeStruct((n_tok, m), f32)),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1), interpret=interpret, name="mhc_coefficients",
    )(x.astype(f32), scale, base)


# The one-pass sums' grid: SUMS_PARTS slices of the contraction (K = hc * d = 20,480 at the release's width: 160 entries
# a slice), each one program per tile of at most SUMS_MAX_TOKENS tokens. Why this split: the 2 MB float32 weight is
# the bulk of what a decode step's site reads, and 128 programs spread it over the H200's 132 SMs, each reading its
# slice of the weight once for its whole token tile (XLA's multiply-reduce read it once per token and every token's
# streams once per output: ≈ 131 MB through L1 / L2 for 4.6 MB at batch 32, 20 µs a site).
SUMS_PARTS = 128
SUMS_MAX_TOKENS = 32
_SUMS_MIN_ROWS = 16  # Triton's dot wants M, N, K >= 16: smaller token tiles and slices are padded / refused


@functools.partial(jax.jit, static_argnames=("parts", "max_tokens", "interpret"))
def mhc_sums_kernel(flat, fn, *, parts: int = SUMS_PARTS, max_tokens: int = SUMS_MAX_TOKENS,
                    interpret: bool = False):
    """An mHC site's one-pass sums in ONE kernel: flat [T, K] (the flattened streams, any float dtype), fn [N, K]
    -> [T, N + 1, P] float32, the N raw products flat · fnᵀ and (last) the sum of squares of flat, each as P partial
    sums over equal slices of the contraction — ``ops.mhc._project_sums_one_pass(flat, fn, parts=P)``'s sums up to
    the order of the float32 additions, in the layout :func:`mhc_coefficients_kernel` adds up. P is the largest power
    of two <= ``parts`` whose slices are a multiple of 16 entries (Triton's smallest dot).

    Grid: (P slices, token tiles of at most ``max_tokens``). A program reads its slice of the weight once for its
    token tile and its tokens' slice of the streams once, as 16..128-wide pieces, and forms the N products as one
    float32 dot (IEEE: exact float32 products, float32 accumulation) plus the sum of squares; the weight's rows are
    padded to a power of two (masked loads, no copy). Why: XLA's multiply-reduce over the 20,480-long contraction
    was the decode step's largest XLA kernel (benchmarks/RESULTS.md). Measured on an H200 (RESULTS.md 2026-12-04
    00:05): 11.7 µs at 32 tokens (0.39 TB/s of its 4.6 MB) against XLA's 20.8, 8.0 at one token against 1.9 — the
    time follows each program's work, not the bytes (the float32 dot runs on FMA units through shared memory; 32
    slices of 640: 43 µs) — so it is an option (``ops.mhc`` projection "kernel"), not the default."""
    if flat.ndim != 2 or fn.ndim != 2 or flat.shape[1] != fn.shape[1]:
        raise ValueError(f"mhc_sums_kernel: want flat [T, K] and fn [N, K], got {flat.shape} and {fn.shape}")
    n_tok, k = flat.shape
    n = fn.shape[0]
    if parts < 1 or max_tokens < 1:
        raise ValueError(f"mhc_sums_kernel: parts and max_tokens must be >= 1, got {parts} and {max_tokens}")
    p = 1 << (parts.bit_length() - 1)
    while p > 1 and k % (p * _SUMS_MIN_ROWS):
        p //= 2
    if k % (p * _SUMS_MIN_ROWS):
        raise ValueError(f"mhc_sums_kernel: the contraction K = {k} must be a multiple of {_SUMS_MIN_ROWS}")
    chunk = k // p  # entries per slice
    piece = min(128, chunk & -chunk)  # the largest power of two dividing the slice, at most 128 (>= 16: above)
    tile = max(_SUMS_MIN_ROWS, min(1 << (max_tokens.bit_length() - 1), 1 << max(n_tok - 1, 0).bit_length()))
    cols = max(_SUMS_MIN_ROWS, 1 << n.bit_length())  # the N products and the sum of squares: > n, a power of two

    def kernel(x_ref, w_ref, o_ref):
        part, t = pl.program_id(0), pl.program_id(1)
        rows = t * tile + jnp.arange(tile)
        ok = rows < n_tok
        safe = jnp.minimum(rows, n_tok - 1)
        wrow = jnp.arange(cols)
        w_ok = wrow < n
        w_safe = jnp.minimum(wrow, n - 1)
        acc = jnp.zeros((tile, cols), jnp.float32)
        sq = jnp.zeros((tile,), jnp.float32)
        for s in range(chunk // piece):  # a few static pieces: every load can be in flight at once
            kk = part * chunk + s * piece + jnp.arange(piece)
            x = pltr.load(x_ref.at[safe[:, None], kk[None, :]], mask=ok[:, None], other=0.0).astype(jnp.float32)
            w = pltr.load(w_ref.at[w_safe[:, None], kk[None, :]], mask=w_ok[:, None],
                          other=0.0).astype(jnp.float32)
            acc = acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                                            preferred_element_type=jnp.float32)
            sq = sq + jnp.sum(x * x, axis=1)
        out = jnp.where(wrow[None, :] == n, sq[:, None], acc)  # column n: the sum of squares
        # columns past n masked (their indices out of range, not clamped: duplicate indices would race)
        pltr.store(o_ref.at[rows[:, None], wrow[None, :], part], out, mask=ok[:, None] & (wrow <= n)[None, :])

    return pl.pallas_call(
        kernel, grid=(p, pl.cdiv(n_tok, tile)), out_shape=jax.ShapeDtypeStruct((n_tok, n + 1, p), jnp.float32),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1), interpret=interpret, name="mhc_sums",
    )(flat, fn)


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "interpret"))
def collapse_rms_norm_kernel(streams, pre, weight, *, eps: float, dtype=None, interpret: bool = False):
    """``ops.norms.rms_norm(ops.mhc.collapse(streams, pre), weight, eps)`` in ONE kernel, one program per token:
    streams [N, hc, D], pre [N, hc], weight [D] -> [N, D] in ``dtype`` (default the streams' dtype). The collapse is
    the sum over the hc streams left to right (``collapse(..., unrolled=True)``), rounded to ``dtype`` as
    ``collapse`` rounds it to the streams' dtype, then x * rsqrt(sum(x²) / D + eps), times the weight in float32,
    rounded once. (bf16 streams may be given as their float32 values: XLA then hands over the float32 buffer its
    mHC expand already wrote, instead of a separate conversion kernel.)

    Why: XLA ran each site's collapse, the norm's sum of squares and the normalisation as three kernels (the
    collapse feeds both the reduction and the element-wise pass after it, which XLA does not fuse across a
    reduction): 2 sites per layer, 6 launches where this is 2 (the decode step of the 12-layer bench model,
    benchmarks/decode_kernel_inventory.py). A token's hc x D entries (80 KB at D = 5120, float32) fit one program:
    it reads them once and keeps the collapsed row in registers for the second pass. D need not be a power of two
    (the row is read as power-of-two pieces, e.g. 4096 + 1024: static slices, no masks)."""
    n_tok, hc, d = streams.shape
    if (pre is not None and pre.shape != (n_tok, hc)) or (pre is None and hc != 1) or weight.shape != (d,):
        raise ValueError(f"collapse_rms_norm_kernel: want streams [N, hc, D], pre [N, hc] (or None with hc = 1: "
                         f"a plain RMS norm of each row), weight [D]; got {streams.shape}, "
                         f"{None if pre is None else pre.shape}, {weight.shape}")
    pieces = [(d >> b << b) - (1 << b) for b in reversed(range(d.bit_length())) if d >> b & 1]  # offsets
    pieces = [(off, d - off if i == len(pieces) - 1 else pieces[i + 1] - off) for i, off in enumerate(pieces)]
    dtype = streams.dtype if dtype is None else jnp.dtype(dtype)

    def kernel(s_ref, *refs):
        p_ref, w_ref, o_ref = refs if pre is not None else (None, *refs)
        t = pl.program_id(0)
        xs = []
        for off, size in pieces:
            if p_ref is None:  # no collapse: the row itself
                xs.append(s_ref[t, 0, pl.ds(off, size)].astype(jnp.float32))
                continue
            x = _sum([p_ref[t, i].astype(jnp.float32) * s_ref[t, i, pl.ds(off, size)].astype(jnp.float32)
                      for i in range(hc)])
            xs.append(x.astype(dtype).astype(jnp.float32))  # collapse returns the streams' dtype
        r = jax.lax.rsqrt(_sum([jnp.sum(x * x) for x in xs]) / d + eps)
        for (off, size), x in zip(pieces, xs):
            w = w_ref[pl.ds(off, size)].astype(jnp.float32)
            o_ref[t, pl.ds(off, size)] = (w * (x * r)).astype(dtype)

    return pl.pallas_call(
        kernel, grid=(n_tok,), out_shape=jax.ShapeDtypeStruct((n_tok, d), dtype),
        compiler_params=pltr.CompilerParams(num_warps=8, num_stages=1), interpret=interpret,
        name="collapse_rms_norm" if pre is not None else "rms_norm",
    )(*(streams, pre, weight) if pre is not None else (streams, weight))


# ----------------------------------------------------------------------------------------------------------------
# The softmax + Sinkhorn with a gradient (training)
# ----------------------------------------------------------------------------------------------------------------
#
# In the train step XLA runs the Sinkhorn as a rolled loop whose body is ~10 tiny kernels forward (the row and
# column sums as reductions, the divisions, the residuals stacked for the backward) and ~2 backward, per iteration:
# 19 iterations x 8 mHC sites gave ~1,800 launches of ~1.25 us in a fullwidth4 step on an H200 (≈ 2.3 ms;
# benchmarks/RESULTS.md, 2026-12-02 14:29). Here the forward is one kernel per site, and the backward another that
# saves nothing but the logits: it recomputes each iteration's input from the first normalised matrix (a loop of k
# iterations for the k-th step back, ~iters² / 2 cheap 4 x 4 steps per token, all in registers) and applies that
# step's vector-Jacobian product, traced from the same float32 code as the forward.

def _softmax_cols(x, hc, eps):
    """Row softmax (+ eps) of the hc x hc logits, then one column normalisation: the Sinkhorn's starting matrix.
    The softmax's shift is a constant to the gradient (as in ``jax.nn.softmax``)."""
    c = []
    for i in range(hc):
        row = x[i * hc:(i + 1) * hc]
        mx = row[0]
        for v in row[1:]:
            mx = jnp.maximum(mx, v)
        mx = jax.lax.stop_gradient(mx)
        e = [jnp.exp(v - mx) for v in row]
        s = _sum(e)
        c += [v / s + eps for v in e]
    return _normalize_cols(c, hc, eps)


def _sinkhorn_step(c, hc, eps):
    return _normalize_cols(_normalize_rows(c, hc, eps), hc, eps)


def sinkhorn_fwd_math(x, hc, eps, iters):
    """The kernel's forward on a list of hc * hc vectors (any arrays: the kernel's registers, or plain arrays)."""
    c = _softmax_cols(list(x), hc, eps)
    return list(jax.lax.fori_loop(0, iters - 1, lambda _, cc: tuple(_sinkhorn_step(list(cc), hc, eps)), tuple(c)))


def sinkhorn_bwd_math(x, ct, hc, eps, iters):
    """The backward kernel's maths on lists of hc * hc vectors: the logits ``x`` and comb's cotangent ``ct`` -> the
    logits' cotangent. Nothing of the forward is kept: the k-th step's input is recomputed from the first
    normalised matrix by a loop of k steps, then that step's vector-Jacobian product is applied (k = iters - 2 .. 0)."""
    c1, start_vjp = jax.vjp(lambda v: tuple(_softmax_cols(list(v), hc, eps)), tuple(x))
    step = lambda _, cc: tuple(_sinkhorn_step(list(cc), hc, eps))  # noqa: E731

    def back(j, ct):  # one step back: k = iters - 2 - j (loops, not unrolled code: the kernel compiles in seconds)
        ck = jax.lax.fori_loop(0, iters - 2 - j, step, c1)
        _, step_vjp = jax.vjp(lambda cc: step(0, cc), ck)
        return step_vjp(ct)[0]

    (dx,) = start_vjp(jax.lax.fori_loop(0, iters - 1, back, tuple(ct)))
    return list(dx)


def _comb_call(kernel, n_tok, m, block, interpret, name):
    return pl.pallas_call(kernel, grid=(pl.cdiv(n_tok, block),),
                          out_shape=jax.ShapeDtypeStruct((n_tok, m), jnp.float32),
                          compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
                          name=name)


def _sinkhorn_fwd_kernel(logits, hc, eps, iters, block, interpret):
    n_tok, m = logits.shape

    def kernel(x_ref, o_ref):
        rows = pl.program_id(0) * block + jnp.arange(block)
        ok = rows < n_tok
        safe = jnp.minimum(rows, n_tok - 1)
        c = sinkhorn_fwd_math([pltr.load(x_ref.at[safe, k], mask=ok, other=0.0) for k in range(m)], hc, eps, iters)
        for k in range(m):
            pltr.store(o_ref.at[rows, k], c[k], mask=ok)

    return _comb_call(kernel, n_tok, m, block, interpret, "mhc_sinkhorn_fwd")(logits)


def _sinkhorn_bwd_kernel(logits, g, hc, eps, iters, block, interpret):
    n_tok, m = logits.shape

    def kernel(x_ref, g_ref, o_ref):
        rows = pl.program_id(0) * block + jnp.arange(block)
        ok = rows < n_tok
        safe = jnp.minimum(rows, n_tok - 1)
        x = [pltr.load(x_ref.at[safe, k], mask=ok, other=0.0) for k in range(m)]
        ct = [pltr.load(g_ref.at[safe, k], mask=ok, other=0.0) for k in range(m)]
        dx = sinkhorn_bwd_math(x, ct, hc, eps, iters)
        for k in range(m):
            pltr.store(o_ref.at[rows, k], dx[k], mask=ok)

    return _comb_call(kernel, n_tok, m, block, interpret, "mhc_sinkhorn_bwd")(logits, g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def sinkhorn_comb(logits, hc: int, eps: float, iters: int, block: int = BLOCK_TOKENS, interpret: bool = False):
    """comb [N, hc * hc] from its logits [N, hc * hc] (float32, row-major i -> j) as ``ops.mhc.mhc_coefficients``
    computes it — softmax over j + eps, a column normalisation, ``iters - 1`` (row, column) normalisation pairs —
    in one kernel, differentiable (its backward one kernel too, saving only the logits)."""
    _check_comb(logits, hc, iters)
    return _sinkhorn_fwd_kernel(logits, hc, eps, iters, block, interpret)


def _check_comb(logits, hc, iters):
    if logits.ndim != 2 or logits.shape[1] != hc * hc or logits.dtype != jnp.float32:
        raise ValueError(f"sinkhorn_comb: logits must be float32 [tokens, {hc * hc}] for hc = {hc}, got "
                         f"{logits.dtype} {logits.shape}")
    if iters < 1:
        raise ValueError(f"sinkhorn_comb: iters must be >= 1, got {iters}")


def _sinkhorn_comb_fwd(logits, hc, eps, iters, block, interpret):
    _check_comb(logits, hc, iters)
    return _sinkhorn_fwd_kernel(logits, hc, eps, iters, block, interpret), logits


def _sinkhorn_comb_bwd(hc, eps, iters, block, interpret, logits, g):
    return (_sinkhorn_bwd_kernel(logits, g.astype(jnp.float32), hc, eps, iters, block, interpret),)


sinkhorn_comb.defvjp(_sinkhorn_comb_fwd, _sinkhorn_comb_bwd)


__all__ = ["mhc_coefficients_kernel", "mhc_sums_kernel", "sinkhorn_comb"]
