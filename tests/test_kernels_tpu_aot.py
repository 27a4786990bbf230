"""The Mosaic TPU kernels compile ahead of time for real TPU topologies (v5p, v6e) on a CPU host with libtpu.

Needs the ``tpu`` extra (``pip install -e .[tpu]``: jax[tpu] = libtpu); skipped without it. The kernels are wrapped
in ``shard_map`` over the topology (batch-sharded) and compiled by libtpu at release widths (64 heads x 512,
top-512 + window 128; indexer 32 x 128) with CI-sized caches. ``launch/aot_kernels_tpu.py`` is the same at full size.
"""

import os

import pytest

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

pytest.importorskip("libtpu", reason="AOT TPU compile needs the tpu extra (jax[tpu] / libtpu)")


@pytest.fixture(autouse=True)
def _no_persistent_compilation_cache():
    """Other test modules share an on-disk XLA cache; TPU programs compiled here must not read CPU entries from it."""
    import jax

    old = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", old)


ALL = ("sparse_attention_decode", "sparse_attention_prefill", "indexer_score_pool")


# every kernel on v5p; on v6e the decode attention and the indexer (the prefill variant is the same kernel body with
# the index list in a per-query SMEM block instead of scalar prefetch) — keeps the CI compile time down
@pytest.mark.parametrize("topology,kernels", [("v5p:2x2x1", ALL),
                                              ("v6e:2x2", ("sparse_attention_decode", "indexer_score_pool"))])
def test_mosaic_kernels_compile_for_tpu(topology, kernels):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "launch" / "aot_kernels_tpu.py"
    spec = importlib.util.spec_from_file_location("aot_kernels_tpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    results = mod.compile_all((topology,), small=True, verbose=False, kernels=kernels)
    assert {k for _, k, _ in results} == set(kernels)
    for _, _, compiled in results:
        assert compiled.memory_analysis() is not None
        assert "tpu_custom_call" in compiled.as_text()  # the Mosaic kernel is in the compiled program
