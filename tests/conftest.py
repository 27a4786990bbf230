"""Test setup: float32 everywhere with the highest matmul precision (DESIGN: numerics are tested in fp32), 8 fake
CPU devices for the sharding tests (the flag must be set before jax is imported), and one XLA compilation cache per
test run.

Every global setting lives here, so no test's outcome depends on which test module was imported or ran first. The
compilation cache is shared by the run's xdist workers (and the training subprocesses of test_checkpoint_train,
which ask for it: the train-step program is identical across many tests, so it is compiled once), but never across
runs: a directory named after this run, removed at its end, so nothing left by an earlier run, another checkout or
another jax can be read back.
"""

import os
import random
import shutil
import tempfile
import uuid

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# set by the controller before the xdist workers start; the workers and subprocesses inherit it
os.environ.setdefault("DSV41_TEST_RUN_ID", uuid.uuid4().hex[:12])
XLA_CACHE = os.path.join(tempfile.gettempdir(), f"dsv41_jax_test_xla_cache_{os.environ['DSV41_TEST_RUN_ID']}")
os.environ.setdefault("DSV41_COMPILATION_CACHE", "off")  # the CLI / Engine's own persistent cache stays off in tests

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", XLA_CACHE)  # this process only (not inherited by subprocesses)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

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


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist): the run is over
        shutil.rmtree(XLA_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_config():
    from dsv41_jax import load_config

    return load_config("tiny")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each xdist worker runs many modules, and every module compiles its own programs (configs, shapes, options):
    kept, they grow a worker to several GB. Dropping JAX's in-memory caches after each module keeps a worker's
    memory to what one module needs; programs a later module needs again come back from this run's on-disk
    compilation cache."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()
