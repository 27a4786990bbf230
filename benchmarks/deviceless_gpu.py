"""Compile programs for an NVIDIA H200 on a machine without a GPU (XLA:GPU ahead-of-time, "deviceless").

XLA's GPU compiler needs the device's facts (compute capability, SMs, shared memory, registers, L2, bandwidth), not
the device: given a ``GpuTargetConfigProto`` (``h200_target_config.txtpb`` beside this file) the CUDA PJRT plugin
makes a compile-only topology whose device a program can be lowered and compiled for. GEMM autotuning needs a
device and is skipped (every GEMM gets the compiler's default choice), so compile times here are those of
``--xla_gpu_autotune_level=0`` on the device; everything else (fusion, Triton code generation, PTX → SASS) runs.

Needs the CUDA plugin (``pip install jax[cuda12]`` of the same jax version; no GPU, no driver) importable beside
the project's packages. Usage from Python::

    from benchmarks.deviceless_gpu import h200_device, on_device
    dev = h200_device()                                          # before any other jax backend use
    compiled = jax.jit(fn).lower(*on_device(abstract_args, dev)).compile()

The environment must set ``JAX_PLATFORMS=cpu`` (the CUDA client itself cannot start without a GPU; the topology
does not need it) and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (the plugin's version check calls ``cuInit``).
"""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
H200_TARGET_CONFIG = os.path.join(HERE, "h200_target_config.txtpb")


def h200_device(target_config: str = H200_TARGET_CONFIG):
    """The compile-only device of a one-GPU H200 topology."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    with open(target_config) as f:
        text = f.read()
    topo = topologies.get_topology_desc("h200", platform="cuda", target_config=text, topology="1x1x1")
    return topo.devices[0]


def on_device(tree, device):
    """Abstract arguments (``ShapeDtypeStruct`` leaves, ``None`` kept) placed on ``device``."""
    import jax
    from jax.sharding import SingleDeviceSharding

    shd = SingleDeviceSharding(device)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shd), tree)
