"""Test setup: float32 everywhere with the highest matmul precision (DESIGN: numerics are tested in fp32), 8 fake
CPU devices for the sharding tests (the flag must be set before jax is imported), and one XLA compilation cache per
test run.

Every global setting lives here, so no test's outcome depends on which test module was imported or ran first. The
compilation cache is shared by the run's xdist workers (and the training subprocesses of test_checkpoint_train,
which ask for it: the train-step program is identical across many tests, so it is compiled once), but never across
runs: a directory named after this run, removed at its end, so nothing left by an earlier run, another checkout or
another jax can be read back.
"""

import json
import os
import random
import shutil
import tempfile
import uuid

# 8 fake CPU devices for the sharding tests; LLVM at -O0 without its expensive passes: the suite is dominated by XLA
# compiling small programs, not by running them (measured: -16 % CPU time on test_dspark + test_golden_hf, same
# results; no fast-math either way, so the arithmetic is IEEE in both). Tests that start jax in a subprocess with
# another device count pass these too (``cpu_xla_flags``).
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _jaxlib_version() -> tuple:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(p) for p in version("jaxlib").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return ()


# XLA:CPU's element-wise fusions through its older LLVM IR emitter instead of the MLIR fusion emitters: fewer
# compiler passes per fusion (measured on a loaded 2-core machine, CPU seconds of compiling the 6-layer model's
# forward and gradient programs in six interleaved pairs: 0.93x on average, 5 of 6 pairs faster; test_golden_hf +
# test_release_precision 229 against 242 s, every test passing). Arithmetic and exp / log / sin / erf are bit-identical;
# tanh and log1p use another polynomial (within 4e-7 of the MLIR emitters' values). XLA aborts on a flag it does not
# know, so it is only passed to the jaxlib versions it was checked on.
# And the LLVM module of a program in one piece instead of split for parallel code generation: the split, its
# extra modules and their dispatch cost CPU time, and a test worker has no spare core to use them (measured, three
# interleaved pairs, jemalloc: compile CPU 13.0 / 11.8 / 10.4 s against 14.4 / 14.9 / 14.2 s).
# And two passes that only decide where copies and buffers go, never what is computed: copy insertion without its
# region analysis (more conservative: a few more copies, each one a plain move of the same bits) and the default
# instruction scheduler instead of the concurrency-optimised one. Measured, compile CPU seconds of the 6-layer
# model's forward and gradient programs, four interleaved pairs on the shared 2-core machine: 9.3 / 11.5 / 12.7 /
# 11.5 s against 10.0 / 14.3 / 18.5 / 12.7 s.
if _jaxlib_version() and (0, 10) <= _jaxlib_version() < (0, 11):
    FAST_COMPILE_XLA_FLAGS += (" --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
                               " --xla_cpu_copy_insertion_use_region_analysis=false"
                               " --xla_cpu_enable_concurrency_optimized_scheduler=false")


def cpu_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a jax subprocess on ``devices`` fake CPU devices, compiling as fast as this process does."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_XLA_FLAGS}"


# jemalloc, where the machine has it (Debian / Ubuntu: `apt-get install libjemalloc2`; .ci/run installs it): the
# controller preloads it into the xdist workers and every jax subprocess, which it starts after importing this file.
# XLA's compiler allocates and frees millions of small objects; with glibc's malloc compiling the model's programs took
# ~15 % more CPU time (measured: compile CPU of three forward / gradient programs of the 6-layer model, three
# interleaved rounds on a 2-core machine: 18.0-20.5 s against 22.2-24.0 s). Results are the same: only the allocator
# changes. DSV41_TEST_JEMALLOC=0 turns it off.
def _preload_jemalloc() -> None:
    import ctypes.util

    if os.environ.get("DSV41_TEST_JEMALLOC", "1") == "0" or "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        return
    lib = ctypes.util.find_library("jemalloc")  # a soname such as libjemalloc.so.2, which the loader finds
    if lib:
        os.environ["LD_PRELOAD"] = " ".join(filter(None, [lib, os.environ.get("LD_PRELOAD", "")]))


_preload_jemalloc()
os.environ.setdefault("XLA_FLAGS", cpu_xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# set by the controller before the xdist workers start; the workers and subprocesses inherit it
os.environ.setdefault("DSV41_TEST_RUN_ID", uuid.uuid4().hex[:12])
XLA_CACHE = os.path.join(tempfile.gettempdir(), f"dsv41_jax_test_xla_cache_{os.environ['DSV41_TEST_RUN_ID']}")
XDIST_GROUPS = os.path.join(tempfile.gettempdir(), f"dsv41_jax_test_groups_{os.environ['DSV41_TEST_RUN_ID']}.json")
os.environ.setdefault("DSV41_COMPILATION_CACHE", "off")  # the CLI / Engine's own persistent cache stays off in tests

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", XLA_CACHE)  # this process only (not inherited by subprocesses)
# Programs that took 30 ms or more to compile are stored too: both workers compile many of the same small programs
# (parameter initialisers, quantisers, per-op programs), and every module drops the in-memory caches
# (``_release_compiled_programs``), so without this they were compiled again and again (measured: -4 % CPU time on
# test_model_properties + test_release_checkpoint + test_release_precision against a 0.25 s threshold).
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.03)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def pytest_addoption(parser):
    parser.addoption("--shuffle", metavar="SEED", type=int, default=None,
                     help="run the tests in a random order drawn from SEED (every xdist worker draws the same order); "
                          "shows that no test depends on another having run first")


def pytest_report_header(config):
    seed = config.getoption("--shuffle")
    return None if seed is None else f"test order shuffled with seed {seed} (--shuffle {seed})"


def pytest_collection_modifyitems(config, items):
    seed = config.getoption("--shuffle")
    if seed is not None:
        random.Random(seed).shuffle(items)
    # One xdist group (pyproject's addopts ask for ``--dist loadgroup``): the memory_heavy tests run one after
    # another in one worker, never beside each other. Two of them at once, plus the other worker, passed the suite's
    # 4 GB bound (measured whole-run peaks of 3.93 and 4.08 GB: a ~1.9 GB notebook beside a ~1.1 GB subprocess).
    # Tests marked ``xdist_group(name)`` (those sharing a costly session fixture or cached engine) run in one worker
    # too, so that what they share is built once, not once per worker (a memory_heavy test stays in that group).
    groups = {}
    for item in items:
        if item.get_closest_marker("memory_heavy"):
            item.add_marker(pytest.mark.xdist_group("memory_heavy"))
            groups[item.nodeid] = "memory_heavy"
        elif item.get_closest_marker("xdist_group"):
            marker = item.get_closest_marker("xdist_group")
            groups[item.nodeid] = marker.args[0] if marker.args else marker.kwargs.get("name", "default")
    # xdist (3.8) puts a test in its group by appending "@group" to its node id, which pytest 9 no longer lets it
    # change (the id is derived, not stored): the groups were silently ignored and the memory_heavy tests ran beside
    # each other. So the workers also write the groups down, and the controller's scheduler (below) reads them.
    # With them, the ``slow`` tests (compiles of their own, subprocesses): the scheduler ranks a test it has no
    # measured time for (TEST_SECONDS) by that marker.
    if hasattr(config, "workerinput"):
        tmp = f"{XDIST_GROUPS}.{os.environ.get('PYTEST_XDIST_WORKER', 'w')}"
        slow = [item.nodeid for item in items if item.get_closest_marker("slow")]
        with open(tmp, "w") as f:
            json.dump({"groups": groups, "slow": slow}, f)
        os.replace(tmp, XDIST_GROUPS)  # both workers write the same map; each write is whole


# Each test's measured seconds (tests/test_seconds.json: setup + call + teardown, from a whole-suite run): the
# scheduler below hands out the longest work first, so that a run ends on the quickest tests and the two workers
# finish together (the earlier order, groups, then ``slow`` tests, then the rest in collection order, ended a
# measured run on one worker finishing test_train's 12-17 s tests while the other waited: 25 s). Whole modules, not
# single tests, longest first (then a module's tests longest first): ranking single tests interleaved the modules
# (238 module changes in a run instead of 75: module fixtures rebuilt and 66 drops of a worker's compiled programs
# instead of 27). Only the order depends on these numbers, never an outcome; a test missing from the file counts
# SLOW_TEST_SECONDS when marked ``slow``, else QUICK_TEST_SECONDS. Regenerate after adding long tests:
#   python -m pytest -n 2 tests --durations=0 --durations-min=0 > /tmp/run.txt; python tests/conftest.py /tmp/run.txt
TEST_SECONDS = os.path.join(os.path.dirname(__file__), "test_seconds.json")
SLOW_TEST_SECONDS, QUICK_TEST_SECONDS = 20.0, 1.0


def _test_seconds() -> dict:
    try:
        with open(TEST_SECONDS) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups the workers wrote (XDIST_GROUPS): a test in a group is scheduled with its
    group, every other test on its own, as xdist does. Longest first, from the measured seconds (TEST_SECONDS): the
    modules by their total (a group counts as a module of its own), then a module's tests by their own, so that the
    two workers finish together and each runs a module's tests together; in the shuffled order with ``--shuffle``,
    which then decides alone."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    shuffled = config.getoption("--shuffle") is not None
    measured = _test_seconds()

    class Scheduling(LoadGroupScheduling):
        hints = None
        ranks = None

        def _hints(self):
            if self.hints is None:  # read once all workers have collected (the scheduler starts after that)
                try:
                    with open(XDIST_GROUPS) as f:
                        self.hints = json.load(f)
                except FileNotFoundError:  # no worker got as far as writing them (a collection error): no groups
                    self.hints = {"groups": {}, "slow": []}
                self.hints["slow"] = set(self.hints["slow"])
            return self.hints

        def _split_scope(self, nodeid):
            if "@" in nodeid:  # a pytest where xdist's own suffix works
                return super()._split_scope(nodeid)
            return self._hints()["groups"].get(nodeid, nodeid)

        def _assign_work_unit(self, node):
            if self.workqueue and not shuffled:  # xdist hands out the queue's first unit: the longest first
                self.workqueue.move_to_end(max(self.workqueue, key=self._rank), last=False)
            super()._assign_work_unit(node)

        def _rank(self, scope):
            if self.ranks is None:  # the whole queue is known at the first assignment
                slow = self._hints()["slow"]
                seconds = {s: sum(measured.get(t, SLOW_TEST_SECONDS if t in slow else QUICK_TEST_SECONDS)
                                  for t in tests) for s, tests in self.workqueue.items()}
                module = {s: s if len(tests) > 1 else s.split("::")[0] for s, tests in self.workqueue.items()}
                totals = {}
                for s in self.workqueue:
                    totals[module[s]] = totals.get(module[s], 0.0) + seconds[s]
                self.ranks = {s: (totals[module[s]], module[s], seconds[s]) for s in self.workqueue}  # module: ties
            return self.ranks[scope]

    return Scheduling(config, log)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist): the run is over
        shutil.rmtree(XLA_CACHE, ignore_errors=True)
        if os.path.exists(XDIST_GROUPS):
            os.remove(XDIST_GROUPS)


def compiled(fn, *args, static_argnums=()):
    """``fn(*args)`` traced and compiled as ONE jitted program, and run.

    Kernel tests compare a kernel's result against a reference (or a second form of the same kernel) on the same
    inputs. Called eagerly, every jnp op of the test's computation and every kernel call is its own small XLA program
    (hundreds of compiles a test, almost all of its CPU time); in one program the kernel and its reference compile
    once, together. What is computed is the same: the same kernels and reference functions on the same values (XLA
    on CPU neither reassociates floating-point sums nor uses fast-math, whether or not ops are fused), and every
    Python-side check inside them (shape errors, dispatch, monkeypatched hooks) still runs, at trace time. ``fn``
    takes the arrays as arguments (not as closed-over constants) so that the program is compiled for their shapes;
    non-array arguments go through ``static_argnums``."""
    return jax.jit(fn, static_argnums=static_argnums)(*args)


@pytest.fixture(scope="session")
def tiny_config():
    from dsv41_jax import load_config

    return load_config("tiny")


# A worker that holds more than this at the end of a module drops its compiled programs there (below it keeps them:
# the next module often needs some of them again, and dropping them costs a retrace, a relowering and a read from
# the on-disk cache, or a recompile for programs under its 30 ms threshold). In a shuffled order modules interleave,
# so dropping after every module dropped them after almost every test. Measured on 2026-12-02: no clear effect on
# CPU time (7 small modules -n 0 on a quiet machine, in order 39.6 s before / 41.1 s after, shuffled 47.9 / 49.5 s;
# the whole suite from a working tree on a shared machine 15 min 58 s in order, 14 min 7 s shuffled).
MODULE_END_LIMIT_MIB = 768


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """Each xdist worker runs many modules, and every module compiles its own programs (configs, shapes, options):
    kept, they grow a worker to several GB. Dropping JAX's in-memory caches after a module once the worker holds
    more than MODULE_END_LIMIT_MIB keeps a worker's memory to about what one module needs; programs a later module
    needs again come back from this run's on-disk compilation cache."""
    import gc
    import resource
    import time

    log = os.environ.get("DSV41_TEST_MEMLOG")
    start = time.perf_counter(), _rss_kib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    dropped = _rss_kib() > MODULE_END_LIMIT_MIB * 1024
    if dropped:
        jax.clear_caches()
        gc.collect()
    if log:  # which module grows a worker: one JSON line per module
        import json

        before_trim = _rss_kib()
        if dropped:
            _malloc_trim()
        with open(log, "a") as f:
            f.write(json.dumps({
                "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "module": request.module.__name__,
                "seconds": round(time.perf_counter() - start[0], 1), "rss_start_mib": start[1] // 1024,
                "rss_end_mib": before_trim // 1024, "rss_trimmed_mib": _rss_kib() // 1024, "dropped": dropped,
                "maxrss_start_mib": start[2] // 1024,
                "maxrss_end_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                "children_maxrss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024}) + "\n")
    elif dropped:
        _malloc_trim()


# A worker whose resident memory passes this after a test drops its compiled programs at once instead of at the end
# of the module: tests of one module (the engine's variants, the interpret-mode kernels) each compile programs of
# their own, and kept, they would stack up to ~3 GB in one worker. Programs a later test needs again come back from
# this run's on-disk compilation cache (or are recompiled, when they compiled in under a second).
WORKER_MEMORY_SOFT_LIMIT_MIB = 1024


# Tests marked memory_heavy reach 1.5-2 GB with their subprocesses (the notebooks that fine-tune, the release-precision
# engine, the interpret-mode engine, the sharded train step, the multi-process tests). They run one at a time (their
# xdist group, above), and the worker drops what it holds before one when it holds more than this, so that one of
# them and the other worker's test (≤ ~1.5 GB) stay under the suite's 4 GB together (measured: a 3.93 GB whole-run
# peak when such a test started at 0.9 GB).
MEMORY_HEAVY_START_LIMIT_MIB = 512


@pytest.fixture(autouse=True)
def _bound_worker_memory(request):
    """Before a ``memory_heavy`` test: drop compiled programs when the worker holds more than
    MEMORY_HEAVY_START_LIMIT_MIB. After each test: drop them when it holds more than WORKER_MEMORY_SOFT_LIMIT_MIB.
    With DSV41_TEST_MEMLOG_TESTS=path also one JSON line per test (its own peak RSS), to find which test sets a
    worker's high-water mark."""
    if request.node.get_closest_marker("memory_heavy") and _rss_kib() > MEMORY_HEAVY_START_LIMIT_MIB * 1024:
        import gc

        jax.clear_caches()
        gc.collect()
        _malloc_trim()
    log = os.environ.get("DSV41_TEST_MEMLOG_TESTS")
    if log:
        import time

        setup_peak = _peak_rss_kib()  # since the last test ended: includes this test's module / session fixtures
        t0, rss0 = time.perf_counter(), _rss_kib()
        _reset_peak_rss()
    yield
    if log:
        import json

        peak = _peak_rss_kib()
        with open(log, "a") as f:
            f.write(json.dumps({"test": request.node.nodeid, "seconds": round(time.perf_counter() - t0, 1),
                                "rss_start_mib": rss0 // 1024, "peak_mib": peak // 1024,
                                "fixture_peak_mib": setup_peak // 1024}) + "\n")
    if _rss_kib() > WORKER_MEMORY_SOFT_LIMIT_MIB * 1024:
        import gc

        jax.clear_caches()
        gc.collect()
        _malloc_trim()
    if log:
        _reset_peak_rss()


def _reset_peak_rss():
    """Linux: writing 5 to /proc/self/clear_refs resets VmHWM (the peak RSS) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _status_kib(field: str) -> int:
    """A memory field of /proc/self/status in KiB (Linux); 0 where there is no /proc (memory is then not bounded)."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(field + ":")), 0)
    except OSError:
        return 0


def _peak_rss_kib():
    return _status_kib("VmHWM")


def _rss_kib():
    return _status_kib("VmRSS")


def _malloc_trim():
    """Hand freed heap pages back to the OS: glibc (and jemalloc) keep them in their arenas otherwise, and a worker's RSS then stays at
    the high-water mark of the largest module it ran, whatever later modules need."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    try:  # jemalloc (preloaded above): purge the dirty pages of every arena (4096 = MALLCTL_ARENAS_ALL)
        ctypes.CDLL(None).mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0))
    except (OSError, AttributeError):  # no jemalloc in this process
        pass


if __name__ == "__main__":  # tests/test_seconds.json from a run's ``--durations=0`` report (see TEST_SECONDS)
    import re
    import sys

    measured = {}
    for line in open(sys.argv[1]):
        m = re.search(r"([0-9.]+)s (?:setup|call|teardown) +(\S+::.+?)\s*$", line)
        if m:
            measured[m.group(2)] = measured.get(m.group(2), 0.0) + float(m.group(1))
    with open(TEST_SECONDS, "w") as f:
        json.dump({k: round(v, 1) for k, v in sorted(measured.items())}, f, indent=0)
        f.write("\n")
