"""Bytes of the full release in bf16 vs the release's precision, from abstract shapes (nothing allocated):
weights by component, the device part with the Engram tables in host memory, per-device shares on N x H200, and
KV cache bytes per token. Usage: python benchmarks/release_memory.py [--config flash] [--batch 32 --context 65536]
"""

import argparse

import jax.numpy as jnp

from dsv41_jax import load_config
from dsv41_jax.inference.cache import cache_footprint
from dsv41_jax.model.release_weights import weight_footprint

H200_BYTES = 141e9  # HBM of one NVIDIA H200


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="flash")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=65536)
    a = ap.parse_args()
    c = load_config(a.config)
    rel, bf = weight_footprint(c, "release", jnp.bfloat16), weight_footprint(c, "bf16", jnp.bfloat16)
    print("| component | bf16 GB | release GB | ratio |\n|---|---:|---:|---:|")
    for k in sorted(bf, key=lambda k: -bf[k]):
        print(f"| {k} | {bf[k] / 1e9:,.1f} | {rel[k] / 1e9:,.1f} | {bf[k] / max(rel[k], 1):.2f} |")
    tot_b, tot_r = sum(bf.values()), sum(rel.values())
    dev_b, dev_r = tot_b - bf.get("engram tables", 0), tot_r - rel.get("engram tables", 0)
    print(f"| **total** | {tot_b / 1e9:,.1f} | {tot_r / 1e9:,.1f} | {tot_b / tot_r:.2f} |")
    print(f"| **device part** (Engram tables in host memory) | {dev_b / 1e9:,.1f} | {dev_r / 1e9:,.1f} | "
          f"{dev_b / dev_r:.2f} |")
    cb, cr = cache_footprint(c, "bfloat16", batch=a.batch, max_len=a.context), \
        cache_footprint(c, "release", batch=a.batch, max_len=a.context)
    print(f"\nKV cache: bf16 {cb.per_token:,.0f} B/token, release {cr.per_token:,.0f} B/token "
          f"({cb.per_token / cr.per_token:.2f}x); batch {a.batch} x {a.context} tokens: bf16 {cb.allocated / 1e9:,.1f} GB, "
          f"release {cr.allocated / 1e9:,.1f} GB")
    print("\n| devices | release weights + cache per device (GB) | of 141 GB HBM |\n|---|---:|---:|")
    for n in (4, 8):
        per = (dev_r + cr.allocated) / n
        print(f"| {n} x H200 | {per / 1e9:,.1f} | {per / H200_BYTES:.0%} |")


if __name__ == "__main__":
    main()
