"""Two processes on localhost, 4 fake CPU devices each, joined with ``jax.distributed`` (gloo CPU collectives) into
one 8-device mesh (data=2, expert=2, tensor=2): ``launch/run.py --mode pod`` runs the sharded forward with the
expert-parallel MoE, and the logits gathered on process 0 equal the single-process unsharded forward."""

import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax
from dsv41_jax import ForwardOptions
from dsv41_jax.checkpoint.orbax_ckpt import write_config_json
from dsv41_jax.model.model import default_hasher
from dsv41_jax.train.testing import every_role_config

from conftest import cpu_xla_flags  # the suite's fast-compile XLA flags, for the subprocesses too

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.memory_heavy
@pytest.mark.slow  # a subprocess that imports jax and compiles
def test_two_process_launch_equals_unsharded(tmp_path):
    out = tmp_path / "logits.npy"
    # tiny cut to 6 layers with every layer role once (faster compiles), with a vocabulary, head count and output
    # group count the 8 devices divide
    cfg = every_role_config(vocab_size=264, num_attention_heads=8, o_groups=8)
    write_config_json(str(tmp_path), cfg)
    config_json = str(tmp_path / "config.json")
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(4), JAX_PLATFORMS="cpu")
    procs = []
    for pid in range(2):
        cmd = [sys.executable, os.path.join(ROOT, "launch", "run.py"), "--mode", "pod", "--config", config_json,
               "--mesh", "data=2,expert=2,tensor=2", "--batch", "8", "--seq", "24",
               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid),
               "--cpu-collectives", "gloo", "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        finally:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    assert "2 processes, 8 devices" in logs[0]
    got = np.load(out)

    params = dsv41_jax.init_params(cfg, jax.random.PRNGKey(0))
    tokens = np.random.RandomState(0).randint(3, 259, (8, 24)).astype(np.int32)
    eids = jnp.asarray(default_hasher(cfg.replace(vocab_size=259)).row_ids(tokens))  # as launch/run.py hashes
    forward = jax.jit(dsv41_jax.forward, static_argnames=("config", "options"))  # one program, not op by op
    ref = forward(params, jnp.asarray(tokens), config=cfg, engram_ids=eids, options=ForwardOptions(quant_sim=False))
    ref = np.asarray(ref)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-5
