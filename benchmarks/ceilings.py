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
