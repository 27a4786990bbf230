"""Test setup: float32 everywhere with the highest matmul precision (DESIGN: numerics are tested in fp32), and 8
fake CPU devices for the sharding tests (the flag must be set before jax is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("DSV41_COMPILATION_CACHE", "off")  # no persistent compilation cache in the suite's processes

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="session")
def tiny_config():
    from dsv41_jax import load_config

    return load_config("tiny")
