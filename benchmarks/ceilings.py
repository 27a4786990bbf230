"""Hardware ceilings measured in the benchmark's own process, so that every ratio is against a number taken in the
same run on the same chip."""

import statistics
import time

import jax
import jax.numpy as jnp


def read_bandwidth(gib: float) -> float:
    """Bytes/s of a read-only kernel (a bf16 sum) over a buffer of ``gib`` GiB: median of 10 runs."""
    n = int(gib * 2 ** 30) // 2
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    f(x).block_until_ready()
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    del x
    return n * 2 / statistics.median(ts)


def copy_and_read_bandwidth(device_us, n_int32: int = 1 << 30) -> dict:
    """``copy_bw`` (read + write) and ``read_bw`` (a row sum) in bytes/s over an int32 buffer of ``n_int32`` elements
    (default 4 GiB), each from ``device_us(jitted_fn, args)``: the caller's device time of one call in µs."""
    a = jnp.full((n_int32 // 1024, 1024), 3, jnp.int32)
    copy_us = device_us(jax.jit(lambda v: v + 1), (a,))
    read_us = device_us(jax.jit(lambda v: jnp.sum(v, axis=1)), (a,))
    del a
    return dict(copy_bw=2 * 4 * n_int32 / (copy_us * 1e-6), read_bw=4 * n_int32 / (read_us * 1e-6))
