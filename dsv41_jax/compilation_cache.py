"""JAX's persistent compilation cache for the command line and the ``Engine``: the second run of the same command
loads its programs from disk instead of compiling them again.

Where: ``$DSV41_COMPILATION_CACHE`` if it names a directory, else ``$XDG_CACHE_HOME/dsv41_jax``, else
``~/.cache/dsv41_jax``. Off: ``DSV41_COMPILATION_CACHE=off`` (or ``0`` / ``false`` / ``no``), ``dsv41 generate
--no-compilation-cache``, or ``Engine(..., compilation_cache=False)``. The test suite turns it off for its own
processes (tests/conftest.py); a test that wants it passes a directory explicitly.

A directory configured by the user (``jax_compilation_cache_dir``, e.g. ``JAX_COMPILATION_CACHE_DIR``) wins over
ours. The cache is keyed by JAX / XLA versions, the program and its compile options, so a stale entry is never used.
"""

from __future__ import annotations

import os

import jax

ENV = "DSV41_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no", "none")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dsv41_jax")


def resolve(setting: bool | str | os.PathLike | None = None) -> str | None:
    """The directory a setting selects, or None for off. ``None`` = the environment's choice (default: on)."""
    if setting is None:
        env = os.environ.get(ENV)
        if env is not None and env.strip().lower() in _OFF:
            return None
        setting = env.strip() if env and env.strip().lower() not in ("1", "on", "true", "yes") else True
    if setting is False:
        return None
    if setting is True:
        return default_cache_dir()
    return os.path.expanduser(os.fspath(setting))


def enable_compilation_cache(setting: bool | str | os.PathLike | None = None) -> str | None:
    """Turn the persistent compilation cache on (see the module docstring); returns the directory in use or None.

    Every compiled program is stored (``jax_persistent_cache_min_compile_time_secs = 0``): on a CPU most of the
    engine's programs compile in under JAX's default one-second threshold yet add up to most of a short run."""
    path = resolve(setting)
    if path is None:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:  # the user's own cache directory wins
        return current
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:  # read-only home, say: run without the cache rather than fail
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


__all__ = ["ENV", "default_cache_dir", "enable_compilation_cache", "resolve"]
