"""Load plan of the released checkpoint from shapes alone (no data): per mesh preset, what each process reads from
disk, its peak host memory, and the bytes each chip holds.

    python benchmarks/load_plan.py                      # flash config; presets v5p-128, gpu8, gpu8_tp

Model of the loader (dsv41_jax/checkpoint/release.py, device-side dequantisation, the default off the CPU):
* every parameter is placed on its partition-rule NamedSharding (dsv41_jax.parallel.rules); a process reads, for each
  distinct shard index of its devices, the stored rows that index covers — for stacked routed experts only the experts
  (and rows) its devices own; tensors split along a later axis are read as whole rows;
* stored bytes are the release format (FP8 e4m3 + e8m0 32x32 scales, FP4 two per byte + e8m0 per 32, Engram e4m3 +
  e8m0 per 32, bf16 / f32 otherwise); DSpark (mtp.*) is skipped (not implemented);
* peak host memory = the stored bytes of the largest single device block (blocks are read, put on their devices and
  dropped one at a time) + 1 GiB of runtime; nothing else is kept on the host;
* device bytes per chip = the parameter shards in bf16 (mHC, sinks, router biases float32; Engram tables padded to the
  row-shard multiple), and, for comparison, the same kept quantised (``keep_quantized=True``).
Processes: one per host; a v5p host has 4 chips, taken as the 4 ``tensor`` coordinates of one ``expert`` index (the
order ``jax.make_mesh`` gives on a v5p slice); an 8-GPU host is one process.
"""

from __future__ import annotations

import argparse
import itertools
import math

GIB = float(1 << 30)


def stored_row_bytes(fmt: str, cols: int) -> float:
    """Stored bytes per logical row of a [rows, cols] tensor (scales amortised over their rows)."""
    from dsv41_jax.checkpoint import names as N

    if fmt == N.FP8_BLOCK:
        return cols + math.ceil(cols / 32) / 32
    if fmt == N.FP4_ROWS:
        return cols / 2 + cols / 32
    if fmt == N.ENGRAM_ROWS:
        return cols + cols / 32
    return None


def plan(config, preset_name: str, chips_per_process: int):
    from jax.sharding import AbstractMesh

    from dsv41_jax.checkpoint import names as N
    from dsv41_jax.model.params import FP32, flat_specs
    from dsv41_jax.parallel import api as par_api
    from dsv41_jax.parallel.mesh import AXES, get_preset

    preset = get_preset(preset_name)
    sizes = tuple(preset.shape[a] for a in AXES)
    mesh = AbstractMesh(sizes, AXES)
    specs = par_api.param_partition_specs(config, mesh, preset.rules)
    flat_pspec = {}
    import jax

    for (path, _), ps in zip(flat_specs(config), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(
            x, jax.sharding.PartitionSpec))):
        flat_pspec[path] = ps
    coords = list(itertools.product(*[range(n) for n in sizes]))  # row-major (data, expert, tensor)
    n_proc = max(1, len(coords) // chips_per_process)
    procs = [coords[i * chips_per_process:(i + 1) * chips_per_process] for i in range(n_proc)]

    def shard_index(coord, axes, dim_size):
        if axes is None:
            return (0, dim_size)
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        k, n = 0, 1
        for a in axes:
            i = AXES.index(a)
            k, n = k * sizes[i] + coord[i], n * sizes[i]
        step = dim_size // n
        return (k * step, (k + 1) * step)

    read = [0.0] * n_proc
    peak_block = [0.0] * n_proc
    dev_bytes, dev_q_bytes = 0.0, 0.0  # per chip (all chips equal under these rules)
    for path, spec in flat_specs(config):
        stacked = "{e}" in spec.hf_name
        name = N.to_release(spec.hf_name.format(e=0) if stacked else spec.hf_name)
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        fmt = N.storage_format(module)
        shape = par_api._padded_shape(path, spec.shape, mesh, preset.rules)
        ps = tuple(flat_pspec[path]) + (None,) * (len(shape) - len(flat_pspec[path]))
        item = 4 if spec.dtype == FP32 else 2
        per_dev = math.prod(e - b for b, e in (shard_index(coords[0], ps[d], shape[d]) for d in range(len(shape))))
        dev_bytes += per_dev * item
        rb = stored_row_bytes(fmt, shape[-1])
        if rb is None:  # float tensor: stored bf16 / f32
            rb = (4 if spec.dtype == FP32 else 2) * (math.prod(shape[1:]) if len(shape) > 1 else 1)
            if len(shape) <= 1:
                rb = (4 if spec.dtype == FP32 else 2) * (shape[0] if shape else 1)
        dev_q_bytes += per_dev * (rb / (shape[-1] if len(shape) > 1 else (shape[0] if shape else 1))
                                  if fmt != N.FLOAT else item)
        lead = 2 if stacked else 1
        for p, devs in enumerate(procs):
            blocks = {tuple(shard_index(c, ps[d], shape[d]) for d in range(min(lead, len(shape)))) for c in devs}
            # bytes of the stored rows those blocks cover (stacked: experts x rows)
            if len(shape) <= 1:
                b = rb if fmt == N.FLOAT else 0
                read[p] += b
                peak_block[p] = max(peak_block[p], b)
                continue
            covered = set()
            for blk in blocks:
                if stacked:
                    (e0, e1), (r0, r1) = blk
                    covered |= {(e, r0, r1) for e in range(e0, e1)}
                else:
                    covered.add((0,) + blk[0])
            real = spec.shape[-2]
            read[p] += sum(max(0, min(r1, real) - r0) for _, r0, r1 in covered) * rb
            for blk in blocks:  # one device block is on the host at a time
                n_e = (blk[0][1] - blk[0][0]) if stacked else 1
                (r0, r1) = blk[-1]
                peak_block[p] = max(peak_block[p], n_e * max(0, min(r1, real) - r0) * rb)
    return {"preset": preset_name, "mesh": dict(zip(AXES, sizes)), "rules": preset.rules, "processes": n_proc,
            "chips_per_process": chips_per_process, "read_per_process": read, "peak_block": peak_block,
            "device_bytes_bf16": dev_bytes, "device_bytes_quantised": dev_q_bytes}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="flash")
    ap.add_argument("--presets", default="v5p-128:4,gpu8:8,gpu8_tp:8",
                    help="preset:chips_per_process, comma-separated")
    args = ap.parse_args()
    from dsv41_jax.checkpoint.release_writer import synthetic_entries
    from dsv41_jax.config import load_config

    config = load_config(args.config)
    stored = sum(math.prod(e[2]) * (4 if e[1] == "F32" else 2 if e[1] == "BF16" else 1)
                 for e in synthetic_entries(config))
    print(f"# load plan of {config.name} (DSpark skipped): {stored / GIB:,.1f} GiB stored in the release format")
    print("| preset | mesh (rules) | processes x chips | read per process GiB (max / total over processes) | "
          "peak host GiB per process | device GiB per chip, bf16 | device GiB per chip, kept quantised |")
    print("|---|---|---|---|---|---|---|")
    for item in args.presets.split(","):
        name, chips = item.split(":")
        r = plan(config, name, int(chips))
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "1"
        print(f"| {name} | {mesh} ({r['rules']}) | {r['processes']} x {r['chips_per_process']} | "
              f"{max(r['read_per_process']) / GIB:,.1f} / {sum(r['read_per_process']) / GIB:,.1f} | "
              f"{(max(r['peak_block']) + GIB) / GIB:,.1f} | {r['device_bytes_bf16'] / GIB:,.1f} | "
              f"{r['device_bytes_quantised'] / GIB:,.1f} |")


if __name__ == "__main__":
    main()
