"""The persistent compilation cache: where it lives, how it is turned off, and that a second process loads what
the first compiled (subprocesses: the suite's own processes keep it off, tests/conftest.py)."""

import os
import subprocess
import sys
import textwrap

from dsv41_jax.compilation_cache import ENV, default_cache_dir, resolve

_CHILD = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp
    from dsv41_jax.compilation_cache import enable_compilation_cache
    events = []
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
    print("DIR", enable_compilation_cache(None))
    jax.jit(lambda x: jnp.sin(x) * 3 + x.sum())(jnp.arange(7.0)).block_until_ready()
    print("HITS", sum(e == "/jax/compilation_cache/cache_hits" for e in events))
""")


def test_cache_location_and_switches(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == resolve(None) == resolve(True) == os.path.join(str(tmp_path), "dsv41_jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert resolve(None) == os.path.join(os.path.expanduser("~"), ".cache", "dsv41_jax")
    assert resolve(str(tmp_path / "x")) == str(tmp_path / "x")
    for off in ("off", "0", "false", "NO"):
        monkeypatch.setenv(ENV, off)
        assert resolve(None) is None
    monkeypatch.setenv(ENV, str(tmp_path / "y"))
    assert resolve(None) == str(tmp_path / "y")
    assert resolve(False) is None


def test_a_second_process_loads_the_compiled_program(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "JAX_COMPILATION_CACHE_DIR")}
    env.update(XDG_CACHE_HOME=str(tmp_path), JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))

    def child(extra=None):
        out = subprocess.run([sys.executable, "-c", _CHILD], env=dict(env, **(extra or {})), capture_output=True,
                             text=True, timeout=120, check=True).stdout
        return dict(line.split(" ", 1) for line in out.strip().splitlines())

    first = child()
    assert first == {"DIR": os.path.join(str(tmp_path), "dsv41_jax"), "HITS": "0"}
    assert os.listdir(first["DIR"])  # the compiled program was stored
    assert int(child()["HITS"]) >= 1  # ... and loaded by the next process (the lambda and jnp.arange's program)
    assert child({ENV: "off"}) == {"DIR": "None", "HITS": "0"}


# ------------------------------------------------------------------------------------------------------------
# Serialised programs (ProgramStore): a later process loads the engine's programs without tracing them
# ------------------------------------------------------------------------------------------------------------

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dsv41_jax import compilation_cache as CC  # noqa: E402


def _affine(params, cache, x, *, k):
    return {"acc": cache["acc"] + k * x}, params["w"] @ x


def _store(fn=_affine):
    return CC.ProgramStore(fn, jax.jit(fn, static_argnames=("k",), donate_argnames=("cache",)), ("k",), ("cache",),
                           ())


@pytest.fixture
def program_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(CC, "_program_dir", [str(tmp_path / "programs")])
    yield tmp_path / "programs"
    CC.clear_program_stores()


def _call(store, n=3, k=2.0):
    params = {"w": jnp.arange(n * n, dtype=jnp.float32).reshape(n, n)}
    cache = {"acc": jnp.ones((n,), jnp.float32)}
    new_cache, y = store(params, cache, jnp.arange(n, dtype=jnp.float32), k=k)
    assert cache["acc"].is_deleted()  # still donated
    return np.asarray(new_cache["acc"]), np.asarray(y)


def test_program_store_round_trip(program_dir, monkeypatch):
    w, x = np.arange(9.0).reshape(3, 3), np.arange(3.0)
    want = (1 + 2 * x, w @ x)
    first = _store()
    assert all(np.array_equal(a, b) for a, b in zip(_call(first), want))
    _call(first)  # same signature: the in-process program, nothing built
    assert (first.built, first.loaded, len(os.listdir(program_dir))) == (1, 0, 1)

    traces = []
    monkeypatch.setattr(CC, "_source_digest", CC._source_digest)  # restored after the test
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **kw: traces.append(name) if name == "/jax/core/compile/jaxpr_trace_duration" else None)
    again = _store()  # a new process, as far as the store knows
    assert all(np.array_equal(a, b) for a, b in zip(_call(again), want))
    assert (again.built, again.loaded) == (0, 1) and not traces  # loaded, not traced

    _call(again, 4)  # another shape, another static value: new programs
    _call(again, 3, k=3.0)
    assert (again.built, again.loaded, len(os.listdir(program_dir))) == (2, 1, 3)

    monkeypatch.setattr(CC, "_source_digest", lambda: "edited")  # a changed package source: new keys
    other = _store()
    _call(other)
    assert (other.built, other.loaded) == (1, 0)


def test_program_store_rebuilds_damaged_entries_and_skips_what_it_cannot_key(program_dir):
    _call(_store())
    (entry,) = os.listdir(program_dir)
    (program_dir / entry).write_bytes(b"not a program")
    store = _store()
    _, y = _call(store)
    assert (store.built, store.loaded) == (1, 0) and np.array_equal(y, [5.0, 14.0, 23.0])

    scale = 2.0
    closure = _store(lambda params, cache, x, *, k: _affine(params, cache, scale * x, k=k))
    assert not closure.storable  # its captured values are in no key
    _call(closure)
    assert closure.built == 0 and len(os.listdir(program_dir)) == 1

    CC.disable_program_store()
    plain = _store()
    _call(plain)
    assert plain.built == plain.loaded == 0



def test_a_program_already_in_jax_cache_is_stored_from_a_fresh_compile(program_dir, tmp_path):
    """The package's source changed but a program did not: JAX's own cache still holds it. An executable loaded
    from there serialises without its code on XLA:CPU, so the store compiles afresh (its entry must run)."""
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax_cache.reset_cache()
    try:
        jax.clear_caches()  # compile for real (not from memory) ...
        _call(jax.jit(_affine, static_argnames=("k",), donate_argnames=("cache",)))  # ... into JAX's cache only
        assert os.listdir(tmp_path / "jax") and not os.path.exists(program_dir)
        jax.clear_caches()  # a new process: the store's compile would be a hit in JAX's cache
        _call(_store())
        loaded = _store()
        acc, y = _call(loaded)
        assert loaded.loaded == 1 and np.array_equal(y, [5.0, 14.0, 23.0]) and np.array_equal(acc, [1, 3, 5])
    finally:
        jax.config.update("jax_compilation_cache_dir", saved[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
        jax_cache.reset_cache()

@pytest.mark.slow  # compiles a 6-layer model's prefill and decode programs
def test_the_engine_compiles_one_decode_program_and_reloads_every_program(program_dir):
    from dsv41_jax import Engine
    from dsv41_jax.inference import FAST_COMPILE, InferenceOptions
    from dsv41_jax.inference.decode import _decode_opts, decode_chain_program
    from dsv41_jax.inference.weights import host_random_params
    from dsv41_jax.train.testing import every_role_config

    # the 6-layer cut with every layer role once: how many programs the engine builds and reloads does not depend on
    # the depth, and they compile in about half the time of the 12-layer tiny's
    config = every_role_config(quant_sim=False)
    opts = InferenceOptions(compiler_options=FAST_COMPILE)
    engine = Engine(config, host_random_params(config, 3, std=0.1), max_batch=2, max_len=48, prefill_chunk=16,
                    options=opts, compilation_cache=False)
    first = [r.tokens for r in engine.generate([[5, 6, 7], list(range(3, 30))], max_new_tokens=4)]
    first.append(engine.generate([[9] * 20], max_new_tokens=6)[0].tokens)  # another prompt length, batch fill
    decode = decode_chain_program(_decode_opts(opts))
    assert decode.built == 1 and len(decode._programs) == 1  # one decode program for every (greedy) call
    stored = sorted(os.listdir(program_dir))

    CC.clear_program_stores()  # a later process: every program from disk, none traced or lowered again
    again = [r.tokens for r in engine.generate([[5, 6, 7], list(range(3, 30))], max_new_tokens=4)]
    again.append(engine.generate([[9] * 20], max_new_tokens=6)[0].tokens)
    assert again == first
    assert sorted(os.listdir(program_dir)) == stored
    assert sum(s.built for s in CC._stores) == len(stored) and sum(s.loaded for s in CC._stores) == len(stored)
