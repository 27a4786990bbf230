"""JAX's persistent compilation cache for the command line and the ``Engine``: the second run of the same command
loads its programs from disk instead of compiling them again.

Where: ``$DSV41_COMPILATION_CACHE`` if it names a directory, else ``$XDG_CACHE_HOME/dsv41_jax``, else
``~/.cache/dsv41_jax``. Off: ``DSV41_COMPILATION_CACHE=off`` (or ``0`` / ``false`` / ``no``), ``dsv41 generate
--no-compilation-cache``, or ``Engine(..., compilation_cache=False)``. The test suite turns it off for its own
processes (tests/conftest.py); a test that wants it passes a directory explicitly.

A directory configured by the user (``jax_compilation_cache_dir``, e.g. ``JAX_COMPILATION_CACHE_DIR``) wins over
ours. The cache is keyed by JAX / XLA versions, the program and its compile options, so a stale entry is never used.

JAX's cache stores compiled executables, but JAX still traces and lowers every program in every process to compute
that cache's key: for the engine's large programs (the decode step, the CED prefill chunk and decoder) that is most of
a second run's time. So the engine's jitted programs (``inference.step.jit_for``) also go through a
:class:`ProgramStore` while the cache is on: the compiled program, serialised, under ``<dir>/programs/``, keyed by
everything the trace depends on — the package's own source, the function, its static arguments, the avals, pytree
structure and devices of its array arguments, the compiler options, JAX's versions and trace-affecting settings and
the ``XLA_FLAGS`` / ``DSV41_*`` environment. A second process then loads it without tracing or lowering anything. A
program that cannot be stored (arguments on several devices, closures, values JAX would bake in as constants) runs
through plain ``jax.jit``; a stored program that fails to load is deleted and rebuilt.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import pickle
import tempfile
import threading
import weakref

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
    if current:  # the user's own cache directory wins (for JAX's cache; the serialised programs stay in ours)
        try:
            os.makedirs(path, exist_ok=True)
            _program_dir[0] = os.path.join(path, "programs")
        except OSError:
            pass
        return current
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:  # read-only home, say: run without the cache rather than fail
        return None
    _program_dir[0] = os.path.join(path, "programs")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


# ----------------------------------------------------------------------------------------------------------
# Serialised programs: a second process neither traces nor lowers
# ----------------------------------------------------------------------------------------------------------

_program_dir: list[str | None] = [None]  # set by enable_compilation_cache: <cache dir>/programs
_FORMAT = 1  # bump when the stored layout or the key's contents change


def program_dir() -> str | None:
    """Where serialised programs go in this process (None: the compilation cache is off)."""
    return _program_dir[0]


def disable_program_store() -> None:
    """Stop storing / loading serialised programs in this process (JAX's own cache is left as it is)."""
    _program_dir[0] = None


_stores: "weakref.WeakSet[ProgramStore]" = weakref.WeakSet()


def clear_program_stores() -> None:
    """Drop every store's in-process programs (what ``jax.clear_caches`` does for jitted functions)."""
    for store in list(_stores):
        store.clear()


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """sha256 of every Python source file of the package: a changed line anywhere gives new program keys."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, enum.Enum))


def _environment_key() -> tuple:
    """Everything outside the call that can change a trace or its compilation."""
    from jax._src import config as jax_config

    context = tuple(v for v in jax_config.trace_context() if _plain(v) or isinstance(v, tuple))
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("DSV41_") or k == "XLA_FLAGS"))
    backend = jax.devices()[0].client
    return (_FORMAT, _source_digest(), jax.__version__, jax.lib.__version__ if hasattr(jax.lib, "__version__") else "",
            backend.platform, backend.platform_version, repr(context), env)


class _NotStorable(Exception):
    pass


def _leaf_key(leaf, shardings: set) -> tuple:
    if isinstance(leaf, jax.Array):
        sharding = leaf.sharding
        shardings.add(sharding)
        aval = leaf.aval
        return (aval.shape, aval.dtype, aval.weak_type, leaf.committed)
    if isinstance(leaf, (bool, int, float, complex)) or hasattr(leaf, "dtype"):
        aval = jax.typeof(leaf)  # Python scalars are weakly typed, numpy arrays strongly
        return (aval.shape, aval.dtype, aval.weak_type, None)
    raise _NotStorable(f"an argument of type {type(leaf).__name__} is not an array")


def _compile_fresh(lowered):
    """``lowered.compile()`` from the compiler itself, bypassing JAX's persistent cache (None where this JAX has no
    way to): an executable XLA:CPU loaded from that cache serialises without its kernels' code — a copy of it fails
    when run ("Function ... not found"; measured with JAX 0.10.2) — so a program for the store must not come from
    there. Happens when the package's source changed but a program did not (its JAX cache entry is still valid)."""
    try:
        from jax._src import config as jax_config
        from jax.experimental.compilation_cache import compilation_cache as jax_cache
    except ImportError:
        return None
    jax_cache.reset_cache()  # JAX decides once per process whether its cache is used: decide again, off ...
    try:
        with jax_config.enable_compilation_cache(False):
            return lowered.compile()
    finally:
        jax_cache.reset_cache()  # ... and again (on) for every later compile


class ProgramStore:
    """``jax.jit(fn, ...)`` whose compiled programs are also kept on disk, serialised, while the compilation cache
    is on (see the module docstring); off, it is the plain jitted function. Same call signature as the jitted
    function (static arguments by name)."""

    def __init__(self, fn, jitted, static: tuple, donate: tuple, compiler_options: tuple):
        self.fn, self.jitted = fn, jitted
        self.static, self.donate, self.compiler_options = static, donate, compiler_options
        qualname = getattr(fn, "__qualname__", "")
        # a closure's captured values are not part of any key: such functions are never stored
        self.storable = getattr(fn, "__closure__", None) is None and "<locals>" not in qualname
        self.name = f"{getattr(fn, '__module__', '?')}.{qualname}"
        self._programs: dict = {}  # in-process: key -> jax.stages.Compiled
        self._lock = threading.Lock()  # guards the two dicts
        self._building: dict = {}  # signature -> the lock its builder holds: one build per program, and programs
        #                            of other signatures (other shapes) build at the same time in other threads
        self._last = None  # (directory, static arguments, program) of the last call: the hot path
        self.loaded = self.built = 0  # programs read from disk / traced and compiled here (for tests, reports)
        _stores.add(self)

    def clear(self) -> None:
        with self._lock:
            self._programs.clear()
            self._building.clear()
            self._last = None

    def __call__(self, *args, **kwargs):
        directory = _program_dir[0]
        if directory is None or not self.storable:
            return self.jitted(*args, **kwargs)
        static = tuple((k, v) for k, v in kwargs.items() if k in self.static)
        dynamic = {k: v for k, v in kwargs.items() if k not in self.static}
        last = self._last
        if (last is not None and last[0] is directory and len(last[1]) == len(static)
                and all(k == k2 and (v is v2 or v == v2) for (k, v), (k2, v2) in zip(static, last[1]))):
            # The hot path (a decode loop): the same static arguments as the last call, so try its program; the
            # compiled program checks the arguments' types itself (in C++) and refuses others with a TypeError
            # before running anything, so a mismatch only falls through to the full lookup below.
            try:
                return last[2](*args, **dynamic)
            except TypeError:
                pass
        compiled = self._lookup(directory, static, args, dynamic, kwargs)
        if compiled is None:
            return self.jitted(*args, **kwargs)
        self._last = (directory, static, compiled)
        return compiled(*args, **dynamic)

    def prepare(self, *args, **kwargs) -> bool:
        """Build (or load) the program a call with these arguments runs, without running it, so that the call then
        finds it (several threads may prepare programs of other shapes at once: compiles release the GIL).
        False where the store keeps nothing (off, or a program it cannot store): the caller then compiles by
        calling."""
        directory = _program_dir[0]
        if directory is None or not self.storable:
            return False
        static = tuple((k, v) for k, v in kwargs.items() if k in self.static)
        dynamic = {k: v for k, v in kwargs.items() if k not in self.static}
        return self._lookup(directory, static, args, dynamic, kwargs) is not None

    def _lookup(self, directory, static, args, dynamic, kwargs):
        """The compiled program for these arguments (built or loaded once), or None if they cannot be stored."""
        leaves, treedef = jax.tree_util.tree_flatten((args, dynamic))
        shardings: set = set()
        try:
            leaf_keys = tuple(_leaf_key(x, shardings) for x in leaves)
        except _NotStorable:
            return None
        if not all(isinstance(sh, jax.sharding.SingleDeviceSharding) for sh in shardings):
            return None  # sharded programs: plain jit (their keys would need the mesh)
        devices = tuple(sorted({d.id for sh in shardings for d in sh.device_set}))
        if len(devices) > 1:
            return None
        sig = (tuple(sorted(static, key=lambda kv: kv[0])), treedef, leaf_keys, devices)
        compiled = self._programs.get(sig)
        if compiled is None:
            with self._lock:
                building = self._building.setdefault(sig, threading.Lock())
            with building:
                compiled = self._programs.get(sig)
                if compiled is None:
                    compiled = self._program(directory, sig, args, kwargs)
                    with self._lock:
                        self._programs[sig] = compiled
        return compiled

    def _disk_key(self, sig) -> str | None:
        static, treedef, leaves, devices = sig
        text = repr((_environment_key(), self.name, static, self.donate, self.compiler_options, str(treedef), leaves,
                     devices))
        if " at 0x" in text:  # an object without a value-based repr (its identity would be in the key)
            return None
        return hashlib.sha256(text.encode()).hexdigest()

    def _program(self, directory: str, sig, args, kwargs):
        from jax.experimental import serialize_executable

        key = self._disk_key(sig)
        path = None if key is None else os.path.join(directory, f"{self.fn.__name__}-{key[:40]}.bin")
        if path is not None and os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    payload, in_tree, out_tree, device_ids = pickle.load(f)
                by_id = {d.id: d for d in jax.devices()}
                compiled = serialize_executable.deserialize_and_load(
                    payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
                self.loaded += 1
                return compiled
            except Exception:  # a damaged or incompatible entry: drop it and build the program again
                try:
                    os.remove(path)
                except OSError:
                    pass
        lowered = self.jitted.lower(*args, **kwargs)
        if path is None:
            self.built += 1
            return lowered.compile()
        compiled = _compile_fresh(lowered)
        self.built += 1
        if compiled is None:  # no way to bypass JAX's cache in this JAX: run it, do not store it
            return lowered.compile()
        try:
            # the devices it runs on (by default a loaded program would span all of the backend's devices)
            device_ids = sorted({d.id for sh in jax.tree_util.tree_leaves(compiled.input_shardings)
                                 for d in sh.device_set})
            blob = pickle.dumps(serialize_executable.serialize(compiled) + (device_ids,))
        except Exception:  # e.g. constants captured in the program: keep it for this process only
            return compiled
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the whole entry or none
        except OSError:
            pass
        return compiled


__all__ = ["ENV", "ProgramStore", "clear_program_stores", "default_cache_dir", "disable_program_store",
           "enable_compilation_cache", "program_dir", "resolve"]
