"""Ahead-of-time compile the Mosaic TPU kernels for real TPU topologies on a CPU host (libtpu, no TPU needed).

    TPU_SKIP_MDS_QUERY=1 python launch/aot_kernels_tpu.py [--topology v5p:2x2x1 --topology v6e:2x2] [--small]

Each kernel is wrapped in ``shard_map`` over the topology's devices (batch-sharded), lowered and compiled by libtpu
for that chip; the script prints one line per (topology, kernel) with the compiled program's memory analysis.
``tests/test_kernels_tpu_aot.py`` runs the small shapes in CI (needs the ``tpu`` extra: ``pip install -e .[tpu]``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several test workers may each load libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

DEFAULT_TOPOLOGIES = ("v5p:2x2x1", "v6e:2x2")


def _cases(small: bool):
    """(name, fn(*arrays), [ShapeDtypeStruct per device-local shard with batch leading]) at release widths. The
    backward case (dQ and both dKV kernels; the forward's log-sum-exp comes in as an input) has the training shapes'
    compressed table (ratio 4 of 4096 tokens: 1024 entries) and, ``small``, CI-sized widths."""
    from dsv41_jax.kernels import pallas_tpu as T

    h, d, k, w = 64, 512, 512, 128
    n = 4096 if small else 131072
    t = 256 if small else 4096
    hi, di = 32, 128
    bf = jnp.bfloat16
    i32 = jnp.int32
    sds = jax.ShapeDtypeStruct

    def decode(q, qpos, win, wpos, ckv, topk, sink):
        b, c = qpos.shape
        return T.attention_fwd(q, qpos, win, wpos, jnp.zeros((b, c), i32), jnp.zeros((b,), i32), ckv, topk, sink,
                               window=w, scale=d ** -0.5, wspan=win.shape[1])

    def prefill(q, pos, kv, ckv, topk, sink):
        b, tt = pos.shape
        wstart = jnp.broadcast_to(jnp.arange(tt, dtype=i32) - (w - 1), (b, tt))
        return T.attention_fwd(q, pos, kv, pos, wstart, jnp.zeros((b,), i32), ckv, topk, sink, window=w,
                               scale=d ** -0.5, wspan=w)

    def backward(q, pos, kv, ckv, topk, sink, out, lse, dout):  # the backward kernels at the training shapes
        b, tt = pos.shape
        wstart = jnp.broadcast_to(jnp.arange(tt, dtype=i32) - (w - 1), (b, tt))
        dq, dkv, dckv, dsink = T.attention_bwd(q, pos, kv, pos, wstart, jnp.zeros((b,), i32), ckv, topk, sink, out,
                                               lse, dout, window=w, scale=q.shape[-1] ** -0.5, wspan=w)
        return dq, dkv, dckv, dsink[None]  # the sink's gradient per shard (their sum is the whole batch's)

    def score_pool(q, wt, keys, vis):
        return T.score_pool(q, wt, keys, vis, g1=8)

    # backward: the training shapes (4096 tokens, ratio 4: 1024 compressed entries); CI-sized: 16 heads x 128,
    # top-128 (same kernels and row blocks, a third of the compile time)
    hb, db, kb = (16, 128, 128) if small else (h, d, k)
    b = 2
    return [
        ("sparse_attention_decode", decode,
         [sds((b, 1, h, d), bf), sds((b, 1), i32), sds((b, w, d), bf), sds((b, w), i32), sds((b, n, d), bf),
          sds((b, 1, k), i32), sds((h,), jnp.float32)], (0, 0, 0, 0, 0, 0, None)),
        ("sparse_attention_prefill", prefill,
         [sds((1, t, h, d), bf), sds((1, t), i32), sds((1, t, d), bf), sds((1, n, d), bf), sds((1, t, k), i32),
          sds((h,), jnp.float32)], (0, 0, 0, 0, 0, None)),
        ("sparse_attention_backward", backward,
         [sds((1, t, hb, db), bf), sds((1, t), i32), sds((1, t, db), bf), sds((1, 1024, db), bf), sds((1, t, kb), i32),
          sds((hb,), jnp.float32), sds((1, t, hb, db), bf), sds((1, t, hb), jnp.float32), sds((1, t, hb, db), bf)],
         (0, 0, 0, 0, 0, None, 0, 0, 0)),
        ("indexer_score_pool", score_pool,
         [sds((b, 4, hi, di), bf), sds((b, 4, hi), jnp.float32), sds((b, n, di), bf), sds((b, 4), i32)],
         (0, 0, 0, 0)),
    ]


def compile_all(topologies=DEFAULT_TOPOLOGIES, small=True, verbose=True, kernels=None):
    from jax.experimental import topologies as topo_mod

    results = []
    for name in topologies:
        topo = topo_mod.get_topology_desc(platform="tpu", topology_name=name)
        devs = np.array(topo.devices).reshape(-1)
        mesh = Mesh(devs, ("data",))
        nd = len(devs)
        for kname, fn, shards, batch_axes in _cases(small):
            if kernels is not None and kname not in kernels:
                continue
            specs = tuple(P("data") if a == 0 else P() for a in batch_axes)
            glob = [jax.ShapeDtypeStruct((s.shape[0] * nd,) + s.shape[1:] if a == 0 else s.shape, s.dtype,
                                         sharding=NamedSharding(mesh, sp))
                    for s, a, sp in zip(shards, batch_axes, specs)]
            smap = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("data"), check_vma=False)
            t0 = time.time()
            compiled = jax.jit(smap).trace(*glob).lower().compile()
            mem = compiled.memory_analysis()
            dt = time.time() - t0
            line = (f"{name:12s} {kname:26s} compiled in {dt:5.1f}s  "
                    f"temp={getattr(mem, 'temp_size_in_bytes', '?')} B  "
                    f"args={getattr(mem, 'argument_size_in_bytes', '?')} B")
            results.append((name, kname, compiled))
            if verbose:
                print(line, flush=True)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topology", action="append", help="e.g. v5p:2x2x1, v6e:2x2 (repeatable)")
    ap.add_argument("--small", action="store_true", help="CI-sized cache / sequence lengths")
    args = ap.parse_args(argv)
    compile_all(tuple(args.topology or DEFAULT_TOPOLOGIES), small=args.small)
    return 0


if __name__ == "__main__":
    sys.exit(main())
