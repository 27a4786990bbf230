"""Instruction counts of the quantised-GEMM Pallas GPU kernels, on a CPU host, with no GPU: the kernel is lowered to
Triton IR by JAX (as for a CUDA device), compiled for sm_90 by Triton's own compiler and disassembled; the table is
the SASS opcode histogram, registers, stack (spills) and instructions per weight byte per thread.

    pip install triton            # the ``sass`` extra: Triton's compiler, ptxas and cuobjdump (x86-64 Linux wheels)
    python benchmarks/kernel_sass.py fp4_up                         # the committed default
    python benchmarks/kernel_sass.py fp4_up --tuning '{"decode": "f16"}'
    python benchmarks/kernel_sass.py fp4_down --tuning '{"block_n": 8}' --keep DIR   # also keeps .ttir/.ptx/.sass

Kernels: ``fp4_up`` / ``fp4_down`` (``fp4_slot_swiglu`` / ``fp4_slot_down`` at the bench model's expert shape, 16
experts of 2304 x 5120, 6 picks, bf16), ``fp8_fused`` (``fp8_gemm_fused`` at M = 1: the shared expert's w1 + w3, 2 x
2304 x 5120), ``fp8_m32`` (``fp8_gemm`` at M = 32; ``--tuning '{"mma": "fp8"}'`` its FP8 tensor-core form, with
``"mma_rows": "tokens"`` the synchronous one),
``fp4_grouped`` (the batch-32 step's grouped FP4 GEMM; ``mma`` likewise), ``attn_packed`` / ``attn_bf16`` (the decode
sparse attention of one bench40 layer at ``--batch`` (1) on the packed cache / on bf16 rows; "per byte" there is per
key-block value and thread), ``idx_pool_*`` / ``idx_gather_*`` (the indexer's score kernels, ``score_pool`` over 32K
keys / ``gather_score``, at ``--batch``, on FP4 + ue8m0 keys (``packed``) or bf16 keys; per key value of one tile and
thread). The packed cases take ``--tuning '{"packed_load": "gather"}'`` for the first packed-row read
(``pallas_gpu.PACKED_LOADS``) and ``'{"packed_ahead": false}'`` for the attention's compressed rows read by pipelined
tile loads (decoded once per dot operand) instead of one block ahead (decoded once). Every loop of a kernel is listed
with its own counts.

Why: the one-token FP4 kernels turned out bound by the CUDA cores, not HBM — 17.9 instructions per weight byte and
255 registers with spills before the pair decode, 13.3 and 101 registers after (measured on an H200 1.35x faster,
benchmarks/RESULTS.md, 2026-12-02). At 128 lane-instructions per clock per multiprocessor, N instructions per byte
cap a kernel near 128 / N bytes per clock per SM (x 132 SMs x clock), whatever the memory system does: a bound read
here in seconds, before any device time is spent.

The IR goes through Triton's TTIR passes first, as on the device (``--no-ttir-passes``: as JAX emitted it, the
counts before 2026-12-04).

Caveats: the device compiles the same IR with the Triton bundled in its jaxlib, whose passes may differ a little
from the installed Triton's; "per byte" divides the static instruction count by the bytes one thread streams, which
is the executed count only for kernels whose K loop is unrolled (the default slot and FP8 gemv tilings; a warning is
printed when the SASS has a backward branch). The IR is captured by wrapping JAX's private Pallas Triton lowering
entry point (``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module``), which may move between JAX versions.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, named to keep its warning quiet

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsv41_jax.kernels import quant_gemm_gpu as G  # noqa: E402

E, F, D, PICKS = 16, 2304, 5120, 6


def capture_triton_ir(trace_and_lower) -> list[str]:
    """The Triton IR (MLIR text) of every Pallas GPU kernel lowered while ``trace_and_lower()`` runs."""
    from jax._src.pallas.triton import lowering as L
    from jax._src.pallas.triton import pallas_call_registration as R

    got, orig = [], L.lower_jaxpr_to_triton_module

    def wrapped(*a, **k):
        res = orig(*a, **k)
        got.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    R.lowering.lower_jaxpr_to_triton_module = wrapped
    try:
        trace_and_lower()
    finally:
        R.lowering.lower_jaxpr_to_triton_module = orig
    return got


def ttir_passes(path: str, num_warps: int, num_stages: int) -> str:
    """Triton IR text after Triton's own TTIR stage (``make_ttir``: inliner, canonicalizer, combine, broadcast
    reordering, CSE, loop unrolling). Why: ``triton.compile`` of an IR file starts at the stage after the file's (IR
    tests' convention), so a .ttir is lowered without these passes — while the device's pipeline (XLA's Triton
    compilation, modelled on ``make_ttir``) runs them on the IR JAX emits. Without them the counts can include
    work the device's compile folds away (e.g. a constant multiply the combine pass removes)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    mod = ir.parse_mlir_module(path, ctx)
    mod.context = ctx
    opts = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages))
    backend.make_ttir(mod, {}, opts, 90)
    return str(mod)


def compile_to_sass(ttir: str, num_warps: int, num_stages: int, work: str, *,
                    run_ttir_passes: bool = True) -> tuple[str, str]:
    """Triton IR text -> (SASS text, resource usage text), compiled for sm_90 (after Triton's TTIR passes unless
    ``run_ttir_passes`` is False: the counts before 2026-12-04)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError:
        sys.exit("kernel_sass.py needs Triton's compiler: pip install triton")
    path = os.path.join(work, "kernel.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    if run_ttir_passes:
        os.replace(path, os.path.join(work, "kernel.jax.ttir"))  # as JAX emitted it
        with open(path, "w") as f:
            f.write(ttir_passes(os.path.join(work, "kernel.jax.ttir"), num_warps, num_stages))
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                              num_stages=num_stages))
    print(f"   triton metadata: shared {k.metadata.shared} B, num_warps {num_warps}, num_stages {num_stages}")
    cubin = os.path.join(work, "kernel.cubin")
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    with open(os.path.join(work, "kernel.ptx"), "w") as f:
        f.write(k.asm["ptx"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    with open(os.path.join(work, "kernel.sass"), "w") as f:
        f.write(sass)
    return sass, res


def opcode_histogram(sass: str) -> collections.Counter:
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m and m.group(1) != "NOP":
            ops[m.group(1)] += 1
    return ops


def has_backward_branch(sass: str) -> bool:
    """Whether any branch jumps to an earlier address (a loop the static count does not unroll)."""
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]+)\*/.*\bBRA\s+0x([0-9a-f]+)", line)
        if m and int(m.group(2), 16) < int(m.group(1), 16):
            return True
    return False


def loop_bodies(sass: str) -> list[list[str]]:
    """The SASS lines of every loop (from the target of each backward branch to that branch), in code order."""
    lines = sass.splitlines()
    addr = [re.match(r"\s*/\*([0-9a-f]+)\*/", ln) for ln in lines]
    found = []
    for i, ln in enumerate(lines):
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", ln)
        if m and addr[i] and int(m.group(1), 16) < int(addr[i].group(1), 16):
            tgt = int(m.group(1), 16)
            start = next(j for j, a in enumerate(addr) if a and int(a.group(1), 16) >= tgt)
            found.append(lines[start:i + 1])
    return found


def loop_body(sass: str) -> list[str] | None:
    """The SASS lines of the innermost (shortest) loop, or None."""
    return min(loop_bodies(sass), key=len, default=None)


def kernel_case(name: str, tuning: dict, nk: tuple[int, int] = (F, D), batch: int = 1):
    """(trace-and-lower thunk, num_warps, num_stages, weight bytes one thread streams) of a named kernel."""
    sds, u8 = jax.ShapeDtypeStruct, jnp.uint8
    lower = dict(lowering_platforms=("cuda",))
    if name == "fp4_up":
        w = (sds((E, F, D // 2), u8), sds((E, F, D // 32), u8))
        t = G.fp4_slot_tiling(F, D, **tuning)
        fn = jax.jit(lambda x, p, wt, a, b, c, d: G.fp4_slot_swiglu(x, p, wt, a, b, c, d, limit=10.0, **tuning))
        args = (sds((D,), jnp.bfloat16), sds((PICKS,), jnp.int32), sds((PICKS,), jnp.float32), *w, *w)
        per_thread = 2 * t["block_n"] * D / 2 / (32 * t["num_warps"])
        return (lambda: fn.trace(*args).lower(**lower)), t["num_warps"], t["num_stages"], per_thread
    if name == "fp4_down":
        w = (sds((E, D, F // 2), u8), sds((E, D, F // 32), u8))
        t = G.fp4_slot_tiling(D, F, down=True, **tuning)
        fn = jax.jit(lambda a, p, v, s: G.fp4_slot_down(a, p, v, s, **tuning))
        args = (sds((PICKS, F), jnp.bfloat16), sds((PICKS,), jnp.int32), *w)
        per_thread = t["block_n"] * F / 2 / (32 * t["num_warps"])
        return (lambda: fn.trace(*args).lower(**lower)), t["num_warps"], t["num_stages"], per_thread
    if name == "fp8_fused":
        ws = [(sds((F, D), u8), sds((F // 32, D // 32), u8))] * 2
        fn = jax.jit(lambda x, a, b, c, d: G.fp8_gemm_fused(x, ((a, b), (c, d)), **tuning))
        args = (sds((1, D), jnp.bfloat16), *ws[0], *ws[1])
        num_warps = tuning.get("num_warps", 8)  # fp8_gemm_fused's fused gemv default
        t = G.fp8_default_tiling(1, 2 * F, D, **{k: v for k, v in tuning.items() if k != "num_warps"})
        # the fused kernel holds one copy of the program per projection: count one of them
        per_thread = 2 * t["block_n"] * D / (32 * num_warps)
        return (lambda: fn.trace(*args).lower(**lower)), num_warps, tuning.get("num_stages", t["num_stages"]), \
            per_thread
    if name == "fp8_m32":  # the batch-32 decode step's dense FP8 projections (tensor-core form), N x K = --nk
        n, k = nk
        fn = jax.jit(lambda x, v, s: G.fp8_gemm(x, v, s, **tuning))
        args = (sds((32, k), jnp.bfloat16), sds((n, k), u8), sds((-(-n // 32), -(-k // 32)), u8))
        if tuning.get("mma") == "fp8":  # the FP8 tensor-core forms: 64-row blocks, 256-wide K steps, 4 warps, 3 stages
            bn, bk, nw = tuning.get("block_n") or 64, tuning.get("block_k") or 256, tuning.get("num_warps") or 4
            return ((lambda: fn.trace(*args).lower(**lower)), nw, tuning.get("num_stages") or 3, bn * bk / (32 * nw))
        t = G.fp8_default_tiling(32, n, k, **tuning)
        return ((lambda: fn.trace(*args).lower(**lower)), t["num_warps"], t["num_stages"],
                t["block_n"] * t["block_k"] / (32 * t["num_warps"]))
    if name == "fp8_gemv":  # a batch-1 decode step's single FP8 projection (gemv form), N x K = --nk; per byte of
        # the whole weight stream of one program (K steps unrolled; per item for the persistent form's loop)
        n, k = nk
        fn = jax.jit(lambda x, v, s: G.fp8_gemm(x, v, s, **tuning))
        args = (sds((1, k), jnp.bfloat16), sds((n, k), u8), sds((-(-n // 32), -(-k // 32)), u8))
        t = G.fp8_default_tiling(1, n, k, **tuning)
        return ((lambda: fn.trace(*args).lower(**lower)), t["num_warps"], t["num_stages"],
                t["block_n"] * k / (32 * t["num_warps"]))
    if name == "fp4_grouped":  # the batch-32 decode step's w1 / w3: 192 routed rows over 16 experts
        rows = 32 * PICKS
        fn = jax.jit(lambda x, g, v, s: G.fp4_grouped_gemm(x, g, v, s, **tuning))
        args = (sds((rows, D), jnp.bfloat16), sds((E,), jnp.int32), sds((E, F, D // 2), u8), sds((E, F, D // 32), u8))
        # per thread and K step of the loop: block_n x block_k / 2 packed bytes over the program's threads (both
        # forms' block_n / block_k / num_warps / num_stages defaults are 64 / 256 / 4 / 3)
        bn, bk = tuning.get("block_n") or 64, tuning.get("block_k") or 256
        nw, ns = tuning.get("num_warps") or 4, tuning.get("num_stages") or 3
        return (lambda: fn.trace(*args).lower(**lower)), nw, ns, bn * bk / 2 / (32 * nw)
    if name in ("attn_packed", "attn_bf16"):
        # the decode sparse attention of one Full layer of bench40 at batch 1 (one query, 64 heads x 512, window ring
        # of 128 rows + this step's row, top-512 compressed rows): on the packed cache (FP8 ring + ue8m0 scales, FP4
        # KV + e4m3 scales, dequantised in registers) or on bf16 rows (the unpack-then-compute form's kernel)
        from dsv41_jax import kernels as KN
        from dsv41_jax.config import load_config
        from dsv41_jax.inference import packed_cache as PC

        c = load_config("bench40")
        hd, h, w, kk, n = c.head_dim, c.num_attention_heads, c.sliding_window, c.index_topk, 4096
        i32, bf, b = jnp.int32, jnp.bfloat16, batch

        def packed(rows, fmt):
            block, per_byte = PC.FORMATS[fmt]
            return PC.PackedRows(sds((b, rows, hd // per_byte), u8), sds((b, rows, hd // block), u8), fmt, hd,
                                 "bfloat16")

        pk = name == "attn_packed"
        ring = packed(w, PC.FP8_UE8M0_32) if pk else sds((b, w, hd), bf)
        kv = packed(n, PC.FP4_E4M3_16) if pk else sds((b, n, hd), bf)
        q, pos, new = sds((b, 1, h, hd), bf), sds((b, 1), i32), sds((b, 1, hd), bf)
        wpos, topk, base = sds((b, w + 1), i32), sds((b, 1, kk), i32), sds((b,), i32)

        def attn(q, pos, new, wpos, ring, kv, topk, base):
            return KN.sparse_attention(q, pos, new, wpos, kv, topk, jnp.zeros((h,), jnp.float32), window=w,
                                       backend="pallas_gpu", win_ring=(ring, base), tuning=tuning or None)

        args = (q, pos, new, wpos, ring, kv, topk, base)
        # kernels.sparse_attention's defaults: 8 warps on packed rows for <= 32 query rows, else 4; 32-row key blocks
        # and 3 stages at batch 1 and 32 (16 heads a program at batch 1, 32 at batch 32)
        nw = tuning.get("num_warps") or (8 if pk and b <= 32 else 4)
        # "per byte" here: per value of one 32-row key block, per thread
        return (lambda: jax.jit(attn).trace(*args).lower(**lower)), nw, tuning.get("num_stages") or 3, \
            32 * hd / (32 * nw)
    if name in ("idx_pool_packed", "idx_pool_bf16", "idx_gather_packed", "idx_gather_bf16"):
        # the indexer's score kernels of one bench40 Full ratio-1 layer (one query per row, 32K keys): the streamed
        # block maxima (score_pool) and the gathered leaves (gather_score), on FP4 + ue8m0 keys or bf16 keys
        from dsv41_jax.config import load_config
        from dsv41_jax.inference import packed_cache as PC
        from dsv41_jax.kernels import pallas_gpu as P

        c = load_config("bench40")
        hi, di, g1, b, n, bf = c.index_n_heads, c.index_head_dim, c.candidate_block_size, batch, 32768, jnp.bfloat16
        pk = name.endswith("packed")
        keys = (sds((b, n, di // 2), u8), sds((b, n, di // 32), u8)) if pk else (sds((b, n, di), bf),)
        kf = dict(keys_fmt=PC.FP4_UE8M0_32, keys_dtype="bfloat16") if pk else {}
        kf.update(tuning)
        q, w, vis = sds((b, 1, hi, di), bf), sds((b, 1, hi), jnp.float32), sds((b, 1), jnp.int32)
        if name.startswith("idx_pool"):
            idx = jax.jit(lambda q, w, vis, *k: P.score_pool(q, w, k if pk else k[0], vis, g1=g1, **kf))
            args = (q, w, vis, *keys)
            nw, ns, tile = kf.get("num_warps", 4), kf.get("num_stages", 3), kf.get("tile", 256)
        else:
            m = c.index_topk * 2
            idx = jax.jit(lambda q, w, vis, cand, *k: P.gather_score(q, w, k if pk else k[0], vis, cand, **kf))
            args = (q, w, vis, sds((b, 1, m), jnp.int32), *keys)
            nw, ns, tile = kf.get("num_warps", 4), kf.get("num_stages", 3), kf.get("tile", 128)
        # "per byte": per key value of one tile, per thread
        return (lambda: idx.trace(*args).lower(**lower)), nw, ns, tile * di / (32 * nw)
    raise SystemExit(f"unknown kernel {name!r}: fp4_up, fp4_down, fp8_fused, fp4_grouped, fp8_m32, attn_packed or "
                     f"attn_bf16")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=("fp4_up", "fp4_down", "fp8_fused", "fp4_grouped", "fp8_m32", "fp8_gemv",
                                       "attn_packed",
                                       "attn_bf16", "idx_pool_packed", "idx_pool_bf16", "idx_gather_packed",
                                       "idx_gather_bf16"))
    ap.add_argument("--batch", type=int, default=1, help="attn_* / idx_*: the decode batch")
    ap.add_argument("--tuning", default="{}", help="JSON: the kernel's tiling / decode overrides")
    ap.add_argument("--nk", default=f"{F},{D}", help="fp8_m32: the weight's N,K (default: the shared expert's w1)")
    ap.add_argument("--keep", default=None, help="a folder to keep kernel.{ttir,ptx,cubin,sass} in")
    ap.add_argument("--no-ttir-passes", action="store_true", help="compile the IR as JAX emitted it, without "
                    "Triton's TTIR passes (the device runs them; the counts of this script before 2026-12-04)")
    args = ap.parse_args()
    tuning = json.loads(args.tuning)
    thunk, num_warps, num_stages, per_thread = kernel_case(args.kernel, tuning,
                                                           tuple(int(v) for v in args.nk.split(",")), args.batch)
    irs = capture_triton_ir(thunk)
    if len(irs) != 1:
        raise SystemExit(f"expected one Pallas kernel, lowered {len(irs)}")
    work = args.keep or tempfile.mkdtemp(prefix="kernel_sass_")
    os.makedirs(work, exist_ok=True)
    sass, res = compile_to_sass(irs[0], num_warps, num_stages, work, run_ttir_passes=not args.no_ttir_passes)
    ops = opcode_histogram(sass)
    total = sum(ops.values())
    usage = " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+)", res))
    loop = has_backward_branch(sass)
    print(f"{args.kernel} {tuning or '(default)'}: {usage}; {total} SASS instructions, "
          f"{per_thread:.0f} weight bytes per thread -> {total / per_thread:.1f} per byte"
          + ("  [backward branch: a loop, the per-byte figure is not the executed count]" if loop else ""))
    print("   " + ", ".join(f"{o} {n}" for o, n in ops.most_common(20)))
    body = loop_body(sass) if loop else None
    if body:  # a K loop (fori_loop kernels): the loop body's instructions per weight byte of one K step
        bops = opcode_histogram("\n".join(body))
        btotal = sum(bops.values())
        print(f"   loop body: {btotal} SASS instructions, {per_thread:.0f} weight bytes per thread and K step -> "
              f"{btotal / per_thread:.1f} per byte")
        print("   " + ", ".join(f"{o} {n}" for o, n in bops.most_common(24)))
        loops = loop_bodies(sass)
        if len(loops) > 1:  # e.g. the sparse attention's window-row loop, then its compressed-row loop
            for j, lb in enumerate(loops):
                lops = opcode_histogram("\n".join(lb))
                print(f"   loop {j + 1} of {len(loops)}: {sum(lops.values())} SASS instructions (spill stores STL "
                      f"{lops['STL']}, loads LDL {lops['LDL']}): " + ", ".join(
                          f"{o} {n}" for o, n in lops.most_common(12)))
    if args.keep:
        print(f"   kept in {work}")


if __name__ == "__main__":
    main()
