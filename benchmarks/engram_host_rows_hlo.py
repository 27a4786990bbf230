"""The H200 compile of the Engram host-row kernel (``kernels.rows_gpu``) on tables in pinned host memory: does XLA
hand the host-memory table to the kernel as it is, or copy it to the device first? (CPU only, deviceless.)

    JAX_PLATFORMS=cpu /work/venv_cuda/bin/python benchmarks/engram_host_rows_hlo.py [--out FILE]

The compile-only H200 device of ``deviceless_gpu`` has no memory spaces, so JAX drops a ``pinned_host`` sharding
when lowering for it; the lowered module's table arguments are therefore marked ``mhlo.memory_kind = "pinned_host"``
by hand (what JAX writes for such an argument on a real GPU) before XLA compiles it. Printed: the entry layout (the
tables' ``S(5)``: host memory) and every custom call and copy of the optimised HLO."""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from deviceless_gpu import h200_device

    dev = h200_device()
    import jax
    import jax.numpy as jnp
    from jax._src.lib.mlir import ir
    from jax.sharding import SingleDeviceSharding

    from dsv41_jax.kernels.rows_gpu import take_rows

    n = 963_078  # bench40's first Engram table: FP8 row bytes [n, 256] and e8m0 scales [n, 8]; batch 32's ids
    sd = SingleDeviceSharding(dev)
    shapes = (jax.ShapeDtypeStruct((n, 256), jnp.uint8, sharding=sd),
              jax.ShapeDtypeStruct((n, 8), jnp.uint8, sharding=sd),
              jax.ShapeDtypeStruct((32, 1, 24), jnp.int32, sharding=sd))
    lowered = jax.jit(lambda v, s, ids: (take_rows(v, ids), take_rows(s, ids))).lower(*shapes)
    module = lowered._lowering._hlo
    with module.context:
        main_fn = next(op for op in module.body.operations if str(op.attributes["sym_name"]) == '"main"')
        attrs = main_fn.attributes["arg_attrs"]
        host = ir.StringAttr.get("pinned_host")
        marked = [ir.DictAttr.get({**{a.name: a.attr for a in attrs[i]}, "mhlo.memory_kind": host}) for i in (0, 1)]
        main_fn.attributes["arg_attrs"] = ir.ArrayAttr.get(marked + [attrs[2]])
    hlo = lowered.compile().as_text()
    lines = [ln for ln in hlo.splitlines() if "entry_computation_layout" in ln or "custom-call(" in ln
             or " copy(" in ln or "copy-start" in ln or "dynamic-slice" in ln]
    text = "\n".join(ln[:400] for ln in lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
