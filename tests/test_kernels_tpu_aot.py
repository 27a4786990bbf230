"""The Mosaic TPU kernels compile ahead of time for real TPU topologies (v5p, v6e) on a CPU host with libtpu.

Needs the ``tpu`` extra (``pip install -e .[tpu]``: jax[tpu] = libtpu); skipped without it. The kernels are wrapped
in ``shard_map`` over the topology (batch-sharded) and compiled by libtpu at release widths (64 heads x 512,
top-512 + window 128; indexer 32 x 128) with CI-sized caches; the attention backward (dQ and both dKV kernels) at
16 heads x 128, top-128, window 128 over 1024 compressed entries (the same kernels and row blocks; release widths in
``launch/aot_kernels_tpu.py`` without ``--small``). ``launch/aot_kernels_tpu.py`` is the same at full size.
"""

import os

import pytest

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

pytest.importorskip("libtpu", reason="AOT TPU compile needs the tpu extra (jax[tpu] / libtpu)")


ALL = ("sparse_attention_decode", "sparse_attention_prefill", "sparse_attention_backward", "indexer_score_pool")

# every kernel on v5p (the backward only there: training runs on v5p in launch/train_plan.py); on v6e the decode attention and the indexer (the prefill variant is the same kernel body with
# the index list in a per-query SMEM block instead of scalar prefetch) — keeps the CI compile time down
CASES = [("v5p:2x2x1", ALL), ("v6e:2x2", ("sparse_attention_decode", "indexer_score_pool"))]

# Compiled in a subprocess: the test workers share an on-disk XLA cache (tests/test_train.py), which TPU programs
# compiled here must neither read nor fill. One subprocess compiles every case (one jax + libtpu start instead of
# one per topology); each test checks its own topology's kernels.
_SCRIPT = """
import json, runpy, sys
mod = runpy.run_path(sys.argv[1])
out = []
for case in sys.argv[2:]:
    topology, kernels = case.split("=")
    results = mod["compile_all"]((topology,), small=True, verbose=False, kernels=tuple(kernels.split(",")))
    out += [[name, k, c.memory_analysis() is not None, "tpu_custom_call" in c.as_text()] for name, k, c in results]
print(json.dumps(out))
"""

# the module's tests share the subprocess's results (the fixture below): one xdist worker runs them
pytestmark = pytest.mark.xdist_group("test_kernels_tpu_aot")


@pytest.fixture(scope="module")
def compiled():
    """[topology, kernel, has a memory analysis, has the Mosaic call] for every case of CASES."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(root / "launch" / "aot_kernels_tpu.py"),
                           *(f"{t}={','.join(k)}" for t, k in CASES)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a subprocess that imports jax and compiles
@pytest.mark.parametrize("topology,kernels", CASES)
def test_mosaic_kernels_compile_for_tpu(compiled, topology, kernels):
    results = [r[1:] for r in compiled if r[0] == topology]
    assert {k for k, _, _ in results} == set(kernels)
    for kname, has_memory_analysis, has_mosaic_call in results:
        assert has_memory_analysis, kname
        assert has_mosaic_call, kname  # the Mosaic kernel is in the compiled program
