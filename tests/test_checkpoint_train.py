"""Training checkpoints (orbax): exact resume, SIGTERM, SIGKILL during a save, restore onto another mesh, parameter
exports and ``dsv41_jax.load_checkpoint`` on every checkpoint kind."""

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax
from dsv41_jax.checkpoint.orbax_ckpt import TrainCheckpointer, export_params
from dsv41_jax.train import TrainConfig, make_train_step, train
from dsv41_jax.train.step import canonical_shardings, canonical_state, place_state
from dsv41_jax.train.testing import small_config, write_corpus

from conftest import XLA_CACHE  # the run's compilation cache, shared with the training subprocesses

# One xdist worker runs this module's tests (tests/conftest.py): they share the uninterrupted reference run (straight),
# built once instead of once in each worker
pytestmark = pytest.mark.xdist_group("test_checkpoint_train")

STD = dict(seq_len=32, batch_size=2, weight_decay=0.0, warmup_steps=2)  # the program test_train.py shares
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# session scope (read-only for its tests): a shuffled order interleaves modules, and a module-scoped fixture is
# then built again each time its module comes back
@pytest.fixture(scope="session")
def cfg():
    return small_config()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="session")
def straight(cfg, corpus):
    """6 steps without interruption: the reference for every resume test."""
    tc = TrainConfig(steps=6, lr=3e-3, **STD)
    return tc, train(cfg, tc, [corpus], glob="*.txt", progress=False, log_every=1)


def _assert_trees_equal(a, b):
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert len(fa) == len(fb)
    for (pa, x), (pb, y) in zip(fa, fb):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(pa))


def test_resume_is_exact(cfg, corpus, straight, tmp_path):
    tc, ref = straight
    ckpt = str(tmp_path / "ckpt")
    first = train(cfg, tc, [corpus], glob="*.txt", ckpt_dir=ckpt, save_every=100, progress=False, log_every=1,
                  stop_after=3)
    assert first.step == 3 and TrainCheckpointer(ckpt).latest_step() == 3
    second = train(cfg, tc, [corpus], glob="*.txt", ckpt_dir=ckpt, save_every=100, progress=False, log_every=1)
    assert second.resumed_from == 3 and second.step == 6
    losses = [m["ce"] for _, m in first.history + second.history]
    assert losses == [m["ce"] for _, m in ref.history]  # identical, not merely close
    _assert_trees_equal(second.state, ref.state)  # parameters, optimiser state, step, RNG


def test_sigterm_saves_and_stops(cfg, corpus, straight, tmp_path):
    tc, ref = straight
    ckpt = str(tmp_path / "ckpt")

    def on_step(step, state):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    res = train(cfg, tc, [corpus], glob="*.txt", ckpt_dir=ckpt, save_every=100, progress=False, on_step=on_step)
    assert res.stopped_by_signal and res.step == 2
    ck = TrainCheckpointer(ckpt)
    assert ck.latest_step() == 2
    ck.close()
    done = train(cfg, tc, [corpus], glob="*.txt", ckpt_dir=ckpt, progress=False)
    assert done.resumed_from == 2
    _assert_trees_equal(done.state["params"], ref.state["params"])


_CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py: the same programs, so
    jax.config.update("jax_compilation_cache_dir", sys.argv[4])   # the run's cache serves them
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    from dsv41_jax.checkpoint import orbax_ckpt
    from dsv41_jax.train import TrainConfig, train
    from dsv41_jax.train.testing import small_config

    corpus, ckpt, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    original = orbax_ckpt.TrainCheckpointer.save

    def save(self, step, *args, **kwargs):
        out = original(self, step, *args, **kwargs)  # async: returns while the write is in flight
        if step == kill_at:
            print("SAVE_IN_FLIGHT", step, sorted(os.listdir(ckpt)), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    orbax_ckpt.TrainCheckpointer.save = save
    tc = TrainConfig(steps=6, lr=3e-3, seq_len=32, batch_size=2, weight_decay=0.0, warmup_steps=2)
    train(small_config(), tc, [corpus], glob="*.txt", ckpt_dir=ckpt, save_every=1, keep=3, progress=False)
""")


@pytest.mark.slow  # a subprocess that imports jax and compiles
def test_sigkill_during_save_leaves_previous_checkpoint_and_restart_continues(cfg, corpus, straight, tmp_path):
    tc, ref = straight
    ckpt = str(tmp_path / "ckpt")
    script = tmp_path / "crash.py"
    script.write_text(_CRASH_SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(script), corpus, ckpt, "4", XLA_CACHE], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "SAVE_IN_FLIGHT 4" in proc.stdout
    entries = sorted(os.listdir(ckpt))
    committed = sorted(int(d) for d in entries if d.isdigit())
    partial = [d for d in entries if "tmp" in d]
    # the kill hit step 4's write: step 3 is the newest complete checkpoint (orbax only renames a finished write);
    # if the write happened to finish first, step 4 is complete too. Either way nothing is half-visible.
    assert committed[-1] in (3, 4) and 3 in committed, entries
    if committed[-1] == 3:
        assert partial, entries  # the interrupted write is a temporary directory, not a step
    ck = TrainCheckpointer(ckpt)
    step = make_train_step(cfg, tc)
    for s in ck.all_steps():  # every visible checkpoint restores and is finite
        state, pos, meta = ck.restore(step.abstract_state(), s)
        assert int(state["step"]) == s and meta["step"] == s
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state["params"]))
    ck.close()
    resumed = train(cfg, tc, [corpus], glob="*.txt", ckpt_dir=ckpt, save_every=1, keep=3, progress=False)
    assert resumed.resumed_from == committed[-1] and resumed.step == 6
    assert not [d for d in os.listdir(ckpt) if "tmp" in d]  # the partial write was cleaned up
    _assert_trees_equal(resumed.state, ref.state)  # as if never interrupted


# `dsv41 train` in a subprocess whose data loader blocks before batch `block_at` (sleeping `block_s` seconds, after
# printing BLOCKED), so a real SIGINT lands while a given step is pending.
_BLOCKING_CLI = textwrap.dedent("""
    import sys, time
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py: the same programs, so
    jax.config.update("jax_compilation_cache_dir", sys.argv[3])   # the run's cache serves them
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    from dsv41_jax.train import trainer

    block_at, block_s = int(sys.argv[1]), float(sys.argv[2])
    original = trainer.DataLoader.__next__
    calls = [0]

    def blocking_next(self):
        calls[0] += 1
        if calls[0] == block_at:
            print("BLOCKED", flush=True)
            time.sleep(block_s)
        return original(self)

    trainer.DataLoader.__next__ = blocking_next
    from dsv41_jax.cli import main
    sys.exit(main(sys.argv[4:]))
""")


def _start_blocking_cli(tmp_path, cfg, corpus, ckpt, block_at, block_s):
    from dsv41_jax.checkpoint.orbax_ckpt import write_config_json

    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir(exist_ok=True)
    write_config_json(str(cfg_dir), cfg)
    script = tmp_path / "blocking_cli.py"
    script.write_text(_BLOCKING_CLI)
    # the program of `straight`: TrainConfig(steps=6, lr=3e-3, **STD) on the same corpus
    args = ["train", "--config", str(cfg_dir / "config.json"), "--data", corpus, "--glob", "*.txt", "--steps", "6",
            "--lr", "3e-3", "--seq-len", "32", "--batch-size", "2", "--weight-decay", "0", "--warmup", "2",
            "--ckpt-dir", ckpt, "--save-every", "100", "--log-every", "1"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(script), str(block_at), str(block_s), XLA_CACHE, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "BLOCKED"
    return proc


@pytest.mark.slow  # a subprocess that imports jax and compiles
def test_ctrl_c_saves_the_step_in_flight_and_resume_is_exact(cfg, corpus, straight, tmp_path):
    """SIGINT as Ctrl-C sends it, while step 3 is pending: the step finishes, is saved, and the command exits 130 with
    one line naming the step and the directory; the same command again resumes to the uninterrupted result."""
    import time

    tc, ref = straight
    ckpt = str(tmp_path / "ckpt")
    proc = _start_blocking_cli(tmp_path, cfg, corpus, ckpt, block_at=3, block_s=2.0)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "SIGINT: finishing the current step, then saving" in err
    assert err.strip().splitlines()[-1] == f"saved step 3 to {ckpt}; rerun to resume"
    assert time.perf_counter() - t0 < 60, "the interrupted run took too long to stop"
    ck = TrainCheckpointer(ckpt)
    assert ck.latest_step() == 3
    ck.close()
    done = train(cfg, tc, [corpus], glob="*.txt", ckpt_dir=ckpt, save_every=100, progress=False, log_every=1)
    assert done.resumed_from == 3 and done.step == 6
    _assert_trees_equal(done.state, ref.state)  # parameters, optimiser state, step, RNG: as if never interrupted


def test_second_ctrl_c_aborts_at_once(cfg, corpus, tmp_path):
    """A second SIGINT does not wait for the pending step (blocked here for 120 s): the process exits at once."""
    import time

    ckpt = str(tmp_path / "ckpt")
    proc = _start_blocking_cli(tmp_path, cfg, corpus, ckpt, block_at=1, block_s=120.0)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert time.perf_counter() - t0 < 10
    assert proc.returncode == 130, err[-3000:]
    assert "aborting without saving" in err
    saved = [d for d in os.listdir(ckpt) if d.isdigit()] if os.path.isdir(ckpt) else []
    assert saved == []  # aborted before any step finished: nothing written


def test_restore_onto_another_mesh(cfg, tmp_path):
    from dsv41_jax.parallel.mesh import make_mesh

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake CPU) devices")
    tc = TrainConfig(**STD)
    mesh_a, mesh_b = make_mesh("data=2,expert=4"), make_mesh("expert=8")
    step_a = make_train_step(cfg, tc, mesh=mesh_a)
    state = step_a.init_state()
    # a non-trivial optimiser state: one update with random gradients
    grads = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(x.size % 97), x.shape, x.dtype),
                         state["params"])
    _, opt = jax.jit(step_a.optimizer.update)(grads, state["opt_state"], state["params"])
    state = {**state, "opt_state": opt}
    assert state["params"]["layers"][1]["engram"]["embed"].shape[0] == 664  # padded for 8-way row sharding
    ck = TrainCheckpointer(str(tmp_path / "ckpt"))
    saved = canonical_state(step_a, state)
    ck.save(7, saved, data_position={"epoch": 0, "row": 5}, model_config=cfg, train_config=tc, force=True)
    ck.wait()
    # onto mesh B
    step_b = make_train_step(cfg, tc, mesh=mesh_b)
    abstract = step_b.abstract_state()
    restored, pos, _ = ck.restore(abstract, shardings=canonical_shardings(step_b, abstract))
    on_b = place_state(step_b, restored)
    w1 = on_b["params"]["layers"][2]["ffn"]["experts"]["w1"]
    assert w1.sharding.mesh.shape["expert"] == 8 and w1.sharding.spec[0] == "expert"
    _assert_trees_equal(canonical_state(step_b, on_b), saved)
    assert pos == {"epoch": 0, "row": 5}
    # and onto a single device (no mesh)
    step_c = make_train_step(cfg, tc)
    unsharded, _, _ = ck.restore(step_c.abstract_state())
    _assert_trees_equal(unsharded, saved)
    ck.close()


def test_exports_and_load_checkpoint_kinds(cfg, tmp_path):
    from dsv41_jax.checkpoint.hf import CheckpointError

    tc = TrainConfig(**STD)
    step = make_train_step(cfg, tc)
    state = step.init_state(seed=3)
    ckpt = str(tmp_path / "ckpt")
    ck = TrainCheckpointer(ckpt, async_save=False)
    ck.save(5, state, data_position={"epoch": 0, "row": 0}, model_config=cfg, train_config=tc)
    ck.close()
    params = state["params"]
    for path in (ckpt, os.path.join(ckpt, "5")):  # training directory (latest step) or one step
        c2, p2 = dsv41_jax.load_checkpoint(path)
        assert c2 == cfg
        _assert_trees_equal(p2, params)
    orbax_dir = export_params(str(tmp_path / "export_orbax"), params, cfg)
    c3, p3 = dsv41_jax.load_checkpoint(orbax_dir)
    assert c3 == cfg  # the full config (name, quant_sim) survives
    _assert_trees_equal(p3, params)
    st_dir = export_params(str(tmp_path / "export_st"), params, cfg, fmt="safetensors")
    c4, p4 = dsv41_jax.load_checkpoint(st_dir)
    assert c4 == cfg
    _assert_trees_equal(p4, params)
    c5, p5 = dsv41_jax.load_checkpoint(orbax_dir, dtype=jnp.bfloat16)
    assert p5["layers"][0]["attn"]["wq_a"].dtype == jnp.bfloat16
    assert p5["layers"][0]["hc_attn"]["fn"].dtype == jnp.float32  # fp32-only parameters stay fp32
    with pytest.raises(CheckpointError, match="not empty"):
        export_params(orbax_dir, params, cfg)
    with pytest.raises(CheckpointError, match="another model config"):
        dsv41_jax.load_checkpoint(ckpt, config=cfg.replace(hidden_size=32))
    with pytest.raises(CheckpointError, match="not found"):
        dsv41_jax.load_checkpoint(str(tmp_path / "nope"))
