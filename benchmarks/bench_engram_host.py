"""The Engram rows of one decode step read from a table in host memory vs in device memory (issue 14, item 4).

    PYTHONUNBUFFERED=1 python benchmarks/bench_engram_host.py [--model 12L] [--batches 1,32] [--hows kernel,host]
        [--out DIR]
    python benchmarks/bench_engram_host.py --smoke          # CPU: the smoke model's sizes

What is timed is the only part of the step that changes with the placement: ``ops.engram.table_rows`` of each
Engram layer's release-format table (FP8 rows + e8m0 scales, random bytes at the model's sizes) for one step's ids
([batch, 1, n_hash_cols], uniform over the rows) — the gather, the dequantisation and, for a host table, the ids'
trip to the host and the rows' trip back ("host"), or the GPU kernel's reads of the rows from host memory
("kernel"; ``inference.host_tables`` / ``ops.gather.take_rows_from_host``, ``--hows``). Per placement and form:
the median of 50 calls each read back (synced) and the mean of 50 calls dispatched back to back then
read once (queued); every form checked equal to the device table's rows bit for bit (exit status 1 if one is
not: a run can then leave that form out of its step timings). The step's extra cost is at most (host - device) x the
Engram layers, if none of it overlaps the layers before the first Engram layer (not measured here: the step with
host tables is what ``profile_release_decode.py --engram-host`` times).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def timed(fn, args, n=50):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(n)]
    jax.block_until_ready(outs)
    return statistics.median(ts) * 1e6, (time.perf_counter() - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="12L")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--hows", default=None, help="host-table forms (ops.gather.HOST_GATHERS), comma-separated; "
                    "default: this backend's default form")
    args = ap.parse_args()
    from bench_fused_fp8 import random_release_params
    from profile_decode import MODELS
    from dsv41_jax.inference.host_tables import engram_table_bytes, place_engram_tables
    from dsv41_jax.model.params import init_params
    from dsv41_jax.ops.engram import table_rows
    from dsv41_jax.ops.gather import host_gather_default, in_host_memory

    hows = args.hows.split(",") if args.hows else [host_gather_default()]

    config = MODELS["smoke" if SMOKE else args.model]()
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0), jnp.bfloat16))
    layers = [{} for _ in shapes["layers"]]
    for i in config.engram_layer_ids:
        layers[i] = {"engram": {"embed": shapes["layers"][i]["engram"]["embed"]}}
    dev = jax.block_until_ready(random_release_params(config, {"layers": layers}, jax.random.PRNGKey(3)))
    host = place_engram_tables(dev)
    tables = [(dev["layers"][i]["engram"]["embed"], host["layers"][i]["engram"]["embed"])
              for i in config.engram_layer_ids]
    out = dict(meta=dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), jax=jax.__version__,
                         devices=[d.device_kind for d in jax.devices()], model=config.name,
                         command="python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
                         table_bytes=dict(device=engram_table_bytes(dev), host=engram_table_bytes(host)),
                         table_shapes=[list(t.shape) for t, _ in tables], hows=hows),
               rows=[])
    print(json.dumps(out["meta"]), flush=True)
    fn = jax.jit(lambda ts, ids, how=None: [table_rows(t, ids, jnp.bfloat16, how) for t in ts], static_argnums=2)
    print("| batch | rows per step | form | device table µs synced / queued | host table µs synced / queued | "
          "host - device µs (synced / queued) | equal |\n|---:|---:|---|---|---|---|---|", flush=True)
    for b in [int(v) for v in args.batches.split(",")]:
        rng = np.random.default_rng(b)
        ids = jnp.asarray(rng.integers(0, tables[0][0].shape[0], (b, 1, config.n_hash_cols)), jnp.int32)
        ids = ids.at[0, 0, 0].set(tables[0][0].shape[0] - 1).at[0, 0, 1].set(0)  # the tables' first and last rows
        td = [t for t, _ in tables]
        th = [t for _, t in tables]
        base = {}
        for how in hows:
            row = dict(batch=b, rows_per_step=b * config.n_hash_cols * len(tables), how=how)
            try:
                got_d, got_h = fn(td, ids), fn(th, ids, how)
                row["equal"] = all(bool(np.array_equal(np.asarray(a, np.float32), np.asarray(h, np.float32)))
                                   for a, h in zip(got_d, got_h))
                row["host_output_in_device_memory"] = not any(in_host_memory(h) for h in got_h)
                if not base:
                    base["device_us"], base["device_queued_us"] = timed(fn, (td, ids))
                row.update(base)
                row["host_us"], row["host_queued_us"] = timed(fn, (th, ids, how))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            out["rows"].append(row)
            if "error" in row:
                print(f"| {b} | {row['rows_per_step']} | {how} | FAILED: {row['error'][:300]} |", flush=True)
            else:
                print(f"| {b} | {row['rows_per_step']} | {how} | {row['device_us']:.1f} / "
                      f"{row['device_queued_us']:.1f} | {row['host_us']:.1f} / {row['host_queued_us']:.1f} | "
                      f"{row['host_us'] - row['device_us']:.1f} / {row['host_queued_us'] - row['device_queued_us']:.1f}"
                      f" | {row['equal']} |", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_engram_host.json"), "w") as f:
                json.dump(out, f, indent=1, default=str)
    return 0 if all(r.get("equal") for r in out["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
