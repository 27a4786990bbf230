"""Ahead-of-time compilation of the sharded tiny model's decode step (the 6-layer cut with one layer of every role:
half the compile of the 12-layer tiny, the same kinds of layers) for a small TPU topology (v5p:2x2x2, 8 chips)
on this CPU host with libtpu (``pip install -e ".[tpu]"``); skipped when libtpu is not installed. The full-size pod
compile is ``launch/aot_pod.sh`` (output in benchmarks/RESULTS.md)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason='libtpu not installed (pip install -e ".[tpu]")')


@pytest.mark.slow  # a subprocess that imports jax and compiles
def test_aot_compile_tiny_decode_for_v5p_2x2x2(tmp_path):
    from dsv41_jax.checkpoint.orbax_ckpt import write_config_json
    from dsv41_jax.train.testing import every_role_config

    write_config_json(str(tmp_path), every_role_config())
    out = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    cmd = [sys.executable, os.path.join(ROOT, "launch", "aot_compile.py"), "--config", str(tmp_path / "config.json"),
           "--set", "vocab_size=264", "--set", "num_attention_heads=8", "--set", "o_groups=8",
           "--topology", "v5p:2x2x2", "--mesh", "data=2,expert=2,tensor=2", "--batch", "4", "--context", "256",
           "--targets", "decode", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["n_devices"] == 8 and result["mesh"] == {"data": 2, "expert": 2, "tensor": 2}
    row = result["programs"]["decode"]
    assert row["fits"] and row["peak_bytes"] > 0
    assert row["alias_size_in_bytes"] > 0  # the donated cache is updated in place
