#!/usr/bin/env python
"""What each form of the narrow float32 projections' input gradient (``ops.linear.NARROW_DX_FORM``) compiles to for
an NVIDIA H200, on a machine without a GPU (``deviceless_gpu.py``): one mHC site of the ``fullwidth4`` train step —
the RMS-normalised streams [4, 1024, 4, 5120] projected to the 24 coefficients (``ops.mhc.mhc_coefficients``) and
differentiated — listed kernel by kernel (fusions, cuBLAS calls, Pallas kernels) with each kernel's result shape.

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \\
        PYTHONPATH=$PWD:<dir with the CUDA plugin's packages> python benchmarks/narrow_dx_deviceless.py [--forms ...]

No timing (there is no device): it shows whether a form becomes a library GEMM, a Pallas kernel or a fusion, and
which fusion the RMS norm's backward lands in.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def kernels(hlo: str) -> list[tuple[str, str, str]]:
    """(name, result shape, kind or custom-call target) of every fusion / custom call in the entry computation."""
    entry = hlo[hlo.index("\nENTRY"):]
    out = []
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*?) (fusion|custom-call)\(", line)
        if m:
            what = re.search(r'custom_call_target="([^"]+)"|kind=(\w+)', line)
            out.append((m.group(1), m.group(2), (what.group(1) or what.group(2)) if what else ""))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--forms", default="reduce,minor,dot,pallas_gpu")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=5120)
    p.add_argument("--hc", type=int, default=4)
    p.add_argument("--hlo-dir", default=None, help="write each form's optimised HLO here")
    args = p.parse_args(argv)

    from deviceless_gpu import h200_device, on_device

    dev = h200_device()
    import jax
    import jax.numpy as jnp

    from dsv41_jax.ops import linear as LIN
    from dsv41_jax.ops.mhc import mhc_coefficients

    hc, n = args.hc, (2 + args.hc) * args.hc

    def loss(streams, fn, base, scale):  # a scalar of all three coefficient sets, so every path has a gradient
        pre, post, comb = mhc_coefficients(streams, fn, base, scale, hc_eps=1e-6, rms_eps=1e-6, sinkhorn_iters=20)
        return jnp.sum(pre) + jnp.sum(post * post) + jnp.sum(comb * comb)

    S = jax.ShapeDtypeStruct
    shapes = on_device((S((args.tokens, hc, args.dim), jnp.float32), S((n, hc * args.dim), jnp.float32),
                        S((n,), jnp.float32), S((3,), jnp.float32)), dev)
    saved = LIN.NARROW_DX_FORM
    for form in args.forms.split(","):
        LIN.NARROW_DX_FORM = form
        jax.clear_caches()
        t0 = time.perf_counter()
        try:
            hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*shapes).compile().as_text()
        finally:
            LIN.NARROW_DX_FORM = saved
        ks = kernels(hlo)
        print(f"\n== NARROW_DX_FORM={form!r}: {len(ks)} kernels, compiled in {time.perf_counter() - t0:.1f} s")
        for name, shape, what in ks:
            print(f"   {name:34s} {what:28s} {shape[:110]}")
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            with open(os.path.join(args.hlo_dir, f"hlo_{form}.txt"), "w") as f:
                f.write(hlo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
