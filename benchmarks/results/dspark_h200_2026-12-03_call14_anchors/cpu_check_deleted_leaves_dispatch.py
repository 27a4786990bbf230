import time, jax, jax.numpy as jnp
f = jax.jit(lambda p, x: x * p["a"][0] + 1.0)
def tree(n):
    return {"a": jnp.ones((4,)), "d": [jnp.ones((64,)) for _ in range(n)]}
x = jnp.ones((8,))
for label, kill in (("live", False), ("deleted unused leaves", True)):
    p = tree(300)
    if kill:
        for a in p["d"][:9]:
            a.delete()
    try:
        jax.block_until_ready(f(p, x))
    except Exception as e:
        print(label, "raises", type(e).__name__, str(e)[:80]); continue
    t0 = time.perf_counter()
    for _ in range(200):
        y = f(p, x)
    jax.block_until_ready(y)
    print(label, f"{(time.perf_counter() - t0) / 200 * 1e6:.0f} us per call")
