"""Golden PartitionSpec tables of the flash config's parameters per mesh preset (tests/golden/). Regenerate after an
intended change with ``DSV41_UPDATE_GOLDEN=1 python -m pytest tests/test_sharding_golden.py`` and review the diff."""

import os

import pytest

import dsv41_jax
from dsv41_jax.parallel import PRESETS
from dsv41_jax.parallel.golden import partition_spec_table

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_flash_partition_specs_match_golden(preset):
    table = partition_spec_table(dsv41_jax.load_config("flash"), preset)
    path = os.path.join(GOLDEN, f"partition_specs_{preset}.txt")
    if os.environ.get("DSV41_UPDATE_GOLDEN"):
        with open(path, "w") as f:
            f.write(table)
    with open(path) as f:
        expected = f.read()
    assert table == expected, f"PartitionSpecs for {preset} changed; see {path} (DSV41_UPDATE_GOLDEN=1 rewrites)"
