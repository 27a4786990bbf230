"""Engram tables in host memory (``inference.host_tables``): the looked-up rows are gathered on the host and equal
the device-table path bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.inference import Engine
from dsv41_jax.inference.engine import EngineError
from dsv41_jax.inference.host_tables import choose_placement, engram_table_bytes, place_engram_tables
from dsv41_jax.inference.weights import host_random_params
from dsv41_jax.model import release_weights as RW
from dsv41_jax.ops.engram import engram_write
from dsv41_jax.ops.gather import in_host_memory


def test_engram_write_from_a_host_table_equals_the_device_table(tiny_config):
    config = tiny_config.replace(quant_sim=False)
    layer = config.engram_layer_ids[0]
    params = host_random_params(config, 0, dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    d, hc = config.hidden_size, config.hc_mult
    streams = jnp.asarray(rng.standard_normal((2, 3, hc, d)), jnp.bfloat16)
    for form in (params, RW.quantize_params(params, config)):  # bf16 rows, and the release's FP8 rows + scales
        host = place_engram_tables(form)
        sizes = engram_table_bytes(host)
        assert sizes["device"] == 0 and sizes["host"] == engram_table_bytes(form)["device"] > 0
        p_dev, p_host = form["layers"][layer]["engram"], host["layers"][layer]["engram"]
        n_rows = jax.tree.leaves(p_dev["embed"])[0].shape[0]
        ids = jnp.asarray(rng.integers(0, n_rows, (2, 3, config.n_hash_cols)), jnp.int32)
        f = jax.jit(lambda s, i, p: engram_write(s, i, p, eps=config.rms_norm_eps))
        want, got = f(streams, ids, p_dev), f(streams, ids, p_host)
        assert not in_host_memory(got)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        hlo = f.lower(streams, ids, p_host).as_text()
        assert 'memory_kind = "pinned_host"' in hlo  # the table stays a host argument ...
        gathers = [ln for ln in hlo.splitlines() if "stablehlo.gather" in ln]
        assert gathers and all('_xla_compute_type = "host"' in ln for ln in gathers)  # ... read only on the host


def test_engram_table_placement_is_validated_and_auto_follows_the_device_budget(tiny_config):
    gb = 10 ** 9  # the full release on one H200: ≈ 510 GB of weights, 200 GB of them Engram tables
    assert choose_placement(510 * gb, 200 * gb, 20 * gb, 141 * gb) == "host"
    assert choose_placement(60 * gb, 20 * gb, 20 * gb, 141 * gb) == "device"
    assert choose_placement(510 * gb, 200 * gb, 20 * gb, None) == "device"  # no reported limit (CPU)
    assert choose_placement(510 * gb, 0, 20 * gb, 141 * gb) == "device"  # no tables to move
    params = host_random_params(tiny_config, 0)
    engine = Engine(tiny_config, params, max_batch=1, max_len=16, compilation_cache=False)
    assert engine.engram_tables == "device" and engram_table_bytes(engine.params)["host"] == 0
    with pytest.raises(ValueError, match="placement"):
        place_engram_tables(params, "disk")
    with pytest.raises(EngineError, match="engram_tables"):
        Engine(tiny_config, params, max_batch=1, max_len=16, engram_tables="disk", compilation_cache=False)


def test_gpu_row_kernel_equals_the_clamped_gather_and_bad_forms_are_named():
    # the kernel behind take_rows_from_host(how="kernel") (CUDA GPUs: it reads pinned host memory), in Pallas
    # interpret mode: the Engram release table's byte rows and scale rows, and a bf16 table whose width is not a
    # power of two; out-of-range ids clamp, a count that is not a multiple of the block is sliced back
    from dsv41_jax.kernels.rows_gpu import take_rows as gpu_take_rows
    from dsv41_jax.ops.gather import take_rows_from_host

    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(-3, 53, (2, 3, 7)), jnp.int32)
    for table in (jnp.asarray(rng.integers(0, 256, (50, 256)), jnp.uint8),
                  jnp.asarray(rng.integers(0, 256, (50, 8)), jnp.uint8),
                  jnp.asarray(rng.standard_normal((50, 24)), jnp.bfloat16)):
        got = gpu_take_rows(table, ids, block_rows=16, interpret=True)
        assert got.shape == ids.shape + table.shape[1:] and got.dtype == table.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.take(table, ids, axis=0, mode="clip")))
    with pytest.raises(ValueError, match="host-table gather"):
        take_rows_from_host(table, ids, how="disk")
