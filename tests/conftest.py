"""Test setup: float32 everywhere with the highest matmul precision (DESIGN: numerics are tested in fp32), 8 fake
CPU devices for the sharding tests (the flag must be set before jax is imported), and one XLA compilation cache per
test run.

Every global setting lives here, so no test's outcome depends on which test module was imported or ran first. The
compilation cache is shared by the run's xdist workers and the subprocesses the tests start (the environment carries
it: the train-step program is identical across many tests, so it is compiled once), but never across runs: a
directory named after this run, removed at its end, so nothing left by an earlier run, another checkout or another
jax can be read back.
"""

import os
import shutil
import tempfile
import uuid

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# set by the controller before the xdist workers start; the workers and subprocesses inherit it
os.environ.setdefault("DSV41_TEST_RUN_ID", uuid.uuid4().hex[:12])
XLA_CACHE = os.path.join(tempfile.gettempdir(), f"dsv41_jax_test_xla_cache_{os.environ['DSV41_TEST_RUN_ID']}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", XLA_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1.0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist): the run is over
        shutil.rmtree(XLA_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_config():
    from dsv41_jax import load_config

    return load_config("tiny")
