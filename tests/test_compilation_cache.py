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
