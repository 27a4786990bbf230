"""Streamed loading of a release-format checkpoint: peak host RSS and throughput.

    python benchmarks/bench_load.py                       # ~2.2 GB synthetic checkpoint in /tmp, CPU, then removed
    python benchmarks/bench_load.py --size large --dir /path/on/big/disk --keep   # ~21 GB (the H200 run)

A synthetic checkpoint in the release's exact format (names, FP8 / FP4 / Engram dtypes and scale shapes, shards +
index; random valid codes) is written for a V4.1-architecture config (the tiny layer plan at a wider size), then
loaded in a fresh process for each mode:

* ``dequantised`` — ``dsv41_jax.load_checkpoint(dir, dtype=bfloat16)``: every FP8 / FP4 weight dequantised exactly and
  placed on the default device (host memory on CPU, HBM on a GPU): the stored bytes are sent to the device and XLA
  dequantises them there;
* ``dequantised_host`` — the same with ``dequantize_on="host"`` (numpy dequantises on the host, as ``dsv41 convert``);
* ``quantised`` — ``keep_quantized=True``: FP8 / FP4 weights stay as values + scales (``QuantizedTensor``).

Host memory, split as the bound needs it (``dsv41_jax.checkpoint.host_memory``: ``RssAnon`` / ``RssFile`` /
``RssShmem`` from ``/proc/self/status``, peaks sampled every 2 ms during the load, plus the kernel's exact peak
``VmHWM`` reset just before it). Each child measures, in one process:

1. ``after_init``: after ``import jax`` and initialising the backend (``jax.devices()``);
2. ``with_dummy`` / ``baseline``: with a same-size dummy allocation (``jnp.zeros`` of every parameter's shape and
   dtype, created on the device), then after freeing it: the runtime's own host memory for that much device memory;
3. the load: peaks of each field, and the end state (parameters alive);
4. a staging probe after the load: RSS kept after one 512 MiB ``device_put`` whose arrays are freed (a GPU runtime
   that stages host-to-device copies through a pinned pool it keeps shows it here).

The bound checked (the issue's): what the load adds to the host — anonymous + shared-memory RSS above the
baseline, plus file-backed pages above the baseline (the loader maps no file; mmapped checkpoint pages would
appear there) — is at most ``largest shard + 1 GiB + parameter bytes resident on the host backend`` (0 on a GPU).
The baseline, measured in the same run, is a plain sequential read of every shard (1 MiB reads, no decoding): the
loader's GB/s as a fraction of it (page cache as stated: warm unless ``--drop-caches`` worked).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

GIB = float(1 << 30)


def bench_config(size: str):
    from dsv41_jax.config import ModelConfig, load_config

    # every layer role of the tiny preset: SWA, ratio-2 Full / Reuse, ratio-1 Full / Reindex / Reuse, Engram
    if os.environ.get("DSV41_BASE_CONFIG"):  # a ModelConfig.to_dict() JSON (machines without ml_collections)
        with open(os.environ["DSV41_BASE_CONFIG"]) as f:
            base = ModelConfig.from_dict(json.load(f))
    else:
        base = load_config("tiny")
    if size == "small":  # ~2.2 GB on disk
        return base.replace(name="bench_load_2g", vocab_size=32768, hidden_size=2048, num_attention_heads=16,
                            head_dim=512, q_lora_rank=512, qk_rope_head_dim=64, o_groups=8, o_lora_rank=512,
                            n_routed_experts=32, moe_intermediate_size=1024, index_head_dim=128, index_n_heads=16)
    if size == "large":  # ~22 GB on disk
        return base.replace(name="bench_load_20g", vocab_size=65536, hidden_size=4096, num_attention_heads=32,
                            head_dim=512, q_lora_rank=1024, qk_rope_head_dim=64, o_groups=8, o_lora_rank=1024,
                            n_routed_experts=128, moe_intermediate_size=2048, index_head_dim=128, index_n_heads=32)
    raise SystemExit(f"unknown size {size!r}")


def _child(args) -> None:
    """Load once and print a JSON line with the measurements."""
    t_import = time.time()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv41_jax.checkpoint import release as R
    from dsv41_jax.checkpoint.host_memory import PeakSampler, rss
    from dsv41_jax.model.params import FP32, flat_specs

    if args.chunk_mib is not None:
        R.CHUNK_BYTES = int(args.chunk_mib * (1 << 20))
    dev = jax.devices()[0]
    stages = {"after_init": rss()}
    ckpt = R.ReleaseCheckpoint(args.dir)
    quantised = args.mode == "quantised"
    if not quantised:  # the same device bytes as the load, created on the device
        dummy = [jnp.zeros(spec.shape, jnp.float32 if spec.dtype == FP32 else jnp.bfloat16, device=dev)
                 for _, spec in flat_specs(ckpt.config)]
    else:
        dummy = [jnp.zeros((s.nbytes,), jnp.uint8, device=dev) for s in ckpt.sources]
    jax.block_until_ready(dummy)
    stages["with_dummy"] = rss()
    dummy_bytes = sum(int(x.nbytes) for x in dummy)
    del dummy
    _settle()
    stages["baseline"] = rss()
    t0 = time.time()
    with PeakSampler() as peak:
        _, params = ckpt.load(jnp.bfloat16, keep_quantized=quantised,
                              dequantize_on="host" if args.mode == "dequantised_host" else "device")
        jax.block_until_ready(params)
    dt = time.time() - t0
    stages["end"] = rss()
    on_host = dev.platform == "cpu"
    resident = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
    # staging probe: one 512 MiB host -> device copy, everything freed again
    _settle()
    before = rss()
    host = np.ones(512 << 20, np.uint8)
    x = jax.device_put(host, dev)
    x.block_until_ready()
    del x, host
    _settle()
    stages["probe_before"], stages["probe_after"] = before, rss()
    base = stages["baseline"]
    added = {k: peak.max.get(k, 0) - base.get(k, 0) for k in ("RssAnon", "RssShmem", "RssFile")}
    print(json.dumps({"mode": args.mode, "seconds": dt, "stages": stages, "peak": peak.max,
                      "peak_hwm": peak.hwm, "hwm_reset": peak.hwm_reset, "added": added,
                      "added_total": sum(added.values()), "hwm_added": peak.hwm - base.get("VmRSS", 0),
                      "dummy_bytes": dummy_bytes, "chunk_bytes": R.CHUNK_BYTES,
                      "param_bytes": resident, "host_param_bytes": resident if on_host else 0,
                      "bytes_read": ckpt.report.bytes_read, "device": str(dev),
                      "jax": jax.__version__, "import_seconds": t0 - t_import}), flush=True)


def _settle() -> None:
    """Let freed arrays go: the runtime returns a deleted array's buffer asynchronously."""
    import gc

    gc.collect()
    time.sleep(0.5)


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _plain_read(files) -> tuple[int, float]:
    buf = bytearray(1 << 20)
    n, t0 = 0, time.time()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while True:
                k = f.readinto(buf)
                if not k:
                    break
                n += k
    return n, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=("small", "large"))
    ap.add_argument("--dir", default="/tmp/dsv41_bench_load")
    ap.add_argument("--shard-gib", type=float, default=0.5, help="target shard size of the synthetic checkpoint")
    ap.add_argument("--modes", default="dequantised,dequantised_host,quantised")
    ap.add_argument("--drop-caches", action="store_true",
                    help="try to drop the page cache before each measurement (root; recorded whether it worked)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (default: removed at the end)")
    ap.add_argument("--json", default=None, help="write the results here (rewritten after each mode)")
    ap.add_argument("--chunk-mib", type=float, default=None, help="slice size of the streamed placement "
                    "(default: dsv41_jax.checkpoint.release.CHUNK_BYTES)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return

    from dsv41_jax.checkpoint.release_writer import write_synthetic_release

    config = bench_config(args.size)
    t0 = time.time()
    if not os.path.exists(os.path.join(args.dir, "model.safetensors.index.json")):
        shutil.rmtree(args.dir, ignore_errors=True)
        write_synthetic_release(args.dir, config, shard_bytes=int(args.shard_gib * GIB))
    t_write = time.time() - t0
    files = sorted(os.path.join(args.dir, f) for f in os.listdir(args.dir) if f.endswith(".safetensors"))
    sizes = [os.path.getsize(p) for p in files]
    total, largest = sum(sizes), max(sizes)
    results = {"config": config.name, "checkpoint_bytes": total, "shards": len(files), "largest_shard": largest,
               "write_seconds": t_write, "runs": []}
    results["page_cache_dropped"] = _drop_caches() if args.drop_caches else False
    n, t = _plain_read(files)
    results["plain_read_gbps"] = n / t / 1e9
    for mode in args.modes.split(","):
        dropped = _drop_caches() if args.drop_caches else False
        cmd = [sys.executable, __file__, "--child", "--mode", mode, "--dir", args.dir]
        cmd += ["--chunk-mib", str(args.chunk_mib)] if args.chunk_mib is not None else []
        out = subprocess.run(cmd,
                             capture_output=True, text=True, env=os.environ.copy())
        line = [x for x in out.stdout.splitlines() if x.startswith("{")]
        if out.returncode or not line:
            raise SystemExit(f"child {mode} failed:\n{out.stderr[-4000:]}")
        r = json.loads(line[-1])
        r["gbps"] = total / r["seconds"] / 1e9
        r["page_cache_dropped"] = dropped
        r["bound"] = largest + (1 << 30) + r["host_param_bytes"]
        r["within_bound"] = max(r["added_total"], r["hwm_added"]) <= r["bound"]
        results["runs"].append(r)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        print(f"# {mode}: {r['seconds']:.1f} s, added {r['added_total'] / GIB:.2f} GiB (bound "
              f"{r['bound'] / GIB:.2f})", flush=True)
    print(f"# release-format load: {config.name}, {total / GIB:.2f} GiB in {len(files)} shards (largest "
          f"{largest / GIB:.2f} GiB); plain sequential read {results['plain_read_gbps']:.2f} GB/s; page cache "
          f"dropped before each measurement: {results['page_cache_dropped']}")
    print("| mode | device | load s | GB/s | of plain read | RSS after init GiB | + dummy device params GiB "
          "| baseline GiB | added anon GiB | added shmem GiB | added file GiB | added (exact peak) GiB "
          "| host params GiB | bound GiB | within |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        st, ad = r["stages"], r["added"]
        print(f"| {r['mode']} | {r['device']} | {r['seconds']:.1f} | {r['gbps']:.2f} | "
              f"{r['gbps'] / results['plain_read_gbps']:.0%} | {st['after_init']['VmRSS'] / GIB:.2f} | "
              f"{st['with_dummy']['VmRSS'] / GIB:.2f} | {st['baseline']['VmRSS'] / GIB:.2f} | "
              f"{ad['RssAnon'] / GIB:.2f} | {ad['RssShmem'] / GIB:.2f} | {ad['RssFile'] / GIB:.2f} | "
              f"{r['hwm_added'] / GIB:.2f} | {r['host_param_bytes'] / GIB:.2f} | {r['bound'] / GIB:.2f} | "
              f"{'yes' if r['within_bound'] else 'NO'} |")
    print("\n| mode | RSS end GiB (anon / shmem / file) | staging probe: RSS kept after a freed 512 MiB device_put GiB |")
    print("|---|---|---|")
    for r in results["runs"]:
        e, b, a = r["stages"]["end"], r["stages"]["probe_before"], r["stages"]["probe_after"]
        print(f"| {r['mode']} | {e['RssAnon'] / GIB:.2f} / {e.get('RssShmem', 0) / GIB:.2f} / "
              f"{e['RssFile'] / GIB:.2f} | {(a['VmRSS'] - b['VmRSS']) / GIB:.2f} |")
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
