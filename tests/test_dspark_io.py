"""DSpark outside the model code: the release's ``mtp.*`` tensors through the checkpoint writer and loader (both
namings, float and kept-quantised), ``dsv41 generate --speculative`` and ``dsv41 train --dspark``."""

import contextlib
import functools
import io
import json

import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import load_config
from dsv41_jax.checkpoint import names as N
from dsv41_jax.checkpoint.quantized import QuantizedTensor
from dsv41_jax.checkpoint.release import load_safetensors_checkpoint
from dsv41_jax.checkpoint.release_writer import write_release_checkpoint
from dsv41_jax.inference.speculative import _draft_jit, _seed_jit, init_dspark_rings
from dsv41_jax.inference.weights import host_random_params

# One xdist worker runs this module's tests (tests/conftest.py): they share the small target (_small) and the drafter's
# training run (drafter_export), built once instead of once in each worker
pytestmark = pytest.mark.xdist_group("test_dspark_io")


@functools.lru_cache(maxsize=None)
def _small():
    """The tiny preset cut to 4 layers (SWA, ratio-1 Full, Reuse, Reuse; no Engram: fast compiles) with its
    2-block DSpark fed by the three decoder layers (CED prefill captures decoder layers only)."""
    config = load_config("tiny").replace(
        num_hidden_layers=4, compress_ratios=(0, 1, 1, 1), kv_source_layer_ids=(1,), index_source_layer_ids=(1,),
        candidate_source_layer_id=1, engram_layer_ids=(), engram_num_embeddings=(),
        dspark_target_layer_ids=(1, 2, 3))
    return config, host_random_params(config, 5, std=0.1, include_dspark=True)


def _drafts(params, config):
    """Greedy drafts (tokens, Markov-corrected logits, confidences) of 2 rows over fixed random target features."""
    rng = np.random.default_rng(0)
    feats = jnp.asarray(rng.standard_normal((2, 9, 3 * config.hidden_size)), jnp.float32)
    rings = _seed_jit(params, init_dspark_rings(config, 2), feats, jnp.zeros((2,), jnp.int32),
                      jnp.asarray([9, 6], jnp.int32), config=config, quant_on=True)
    d = _draft_jit(params, rings, jnp.asarray([9, 6], jnp.int32), jnp.zeros((2,), jnp.int32),
                   jnp.asarray([17, 200], jnp.int32), config=config, quant_on=True, moe_impl="dense")
    return np.asarray(d.tokens), np.asarray(d.logits), np.asarray(d.confidence)


@pytest.mark.parametrize("naming", [N.RELEASE, N.HF])
def test_mtp_tensors_round_trip_through_writer_and_loader(tmp_path, naming):
    """The writer stores the drafter as released (mtp.* names, FP8 / FP4 / bf16 / fp32 formats); the loader reads
    it back into the DSpark parameters, dequantised or kept quantised, and both give the drafts of the values the
    writer says a reader must produce, bit for bit."""
    config, params = _small()
    ref = write_release_checkpoint(str(tmp_path), params, config, naming=naming, include_dspark=True)
    want = _drafts(ref, config)
    stored = json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"]
    assert "mtp.0.main_proj.scale" in stored and "mtp.1.ffn.experts.3.w2.scale" in stored
    assert "mtp.1.markov_head.embed.weight" in stored and "mtp.1.confidence_head.proj.weight" in stored
    for keep in (False, True):
        _, loaded, rep = load_safetensors_checkpoint(str(tmp_path), config=config, include_dspark=True,
                                                     keep_quantized=keep, return_report=True)
        assert not rep.skipped and rep.naming == naming
        assert isinstance(loaded["dspark"]["blocks"][1]["ffn"]["experts"]["w1"], QuantizedTensor) == keep
        got = _drafts(loaded, config)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[2], want[2])
    # streamed onto a mesh by the partition rules (experts over `expert`, heads over `tensor`; the byte vocabulary
    # of 259 is not split)
    if naming == N.RELEASE:
        from jax.sharding import PartitionSpec as P

        from dsv41_jax.parallel import get_rules, make_mesh

        mesh = make_mesh("data=1,expert=4,tensor=2")
        rules = get_rules("tp").replace(vocab=None)
        _, sharded = load_safetensors_checkpoint(str(tmp_path), config=config, include_dspark=True, mesh=mesh,
                                                 rules=rules)
        dp = sharded["dspark"]
        assert dp["blocks"][0]["ffn"]["experts"]["w1"].sharding.spec[0] == "expert"
        assert dp["blocks"][1]["attn"]["wq_b"].sharding.spec == P("tensor") and dp["main_proj"].sharding.spec == P()
        np.testing.assert_array_equal(_drafts(sharded, config)[0], want[0])
    # not asked for, or a config without DSpark modules: listed as skipped, never an error
    _, plain, rep = load_safetensors_checkpoint(str(tmp_path), config=config, return_report=True)
    assert "dspark" not in plain and set(rep.skipped.values()) == {N.DSPARK_REASON}
    bare = config.replace(num_nextn_predict_layers=0)
    _, plain, rep = load_safetensors_checkpoint(str(tmp_path), config=bare, include_dspark=True, return_report=True)
    assert "dspark" not in plain and set(rep.skipped.values()) == {N.DSPARK_ABSENT_REASON}


def _cli(argv, capsys):
    from dsv41_jax.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


# session scope (read-only for its tests): a shuffled order interleaves modules, and a module-scoped fixture is
# then built again each time its module comes back
@pytest.fixture(scope="session")
def drafter_export(tmp_path_factory):
    """`dsv41 train --dspark` against a small random target: 2 steps with checkpoints and an export (target +
    drafter as safetensors), then the same command again, which resumes from the checkpoint (and, its schedule
    done, trains no further). Returns (target dir, export dir, the runs' stderr)."""
    from dsv41_jax.checkpoint.orbax_ckpt import export_params
    from dsv41_jax.cli import main

    config, params = _small()
    root = tmp_path_factory.mktemp("dspark_train")
    target = str(root / "target")
    export_params(target, {k: v for k, v in params.items() if k != "dspark"}, config, fmt="safetensors")
    data = root / "data.txt"
    data.write_text("def add(a, b):\n    return a + b\n\n" * 20)
    base = ["train", "--dspark", "--init-from", target, "--data", str(data), "--seq-len", "32", "--batch-size", "2",
            "--dspark-anchors", "4", "--dtype", "float32", "--ckpt-dir", str(root / "ckpt"), "--save-every", "1",
            "--log-every", "1", "--warmup", "1", "--lr", "1e-3"]
    logs = []
    for extra in (["--export", str(root / "export"), "--export-format", "safetensors"], []):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(base + ["--steps", "2"] + extra) == 0, err.getvalue()
        logs.append(err.getvalue())
    return target, str(root / "export"), logs


def test_train_dspark_checkpoints_resumes_and_exports(drafter_export):
    from dsv41_jax.checkpoint.orbax_ckpt import load_checkpoint

    target, export, logs = drafter_export
    assert "DSpark drafter (2 blocks" in logs[0] and "finished at step 2/2" in logs[0]
    assert "resumed from step 2" in logs[1] and "finished at step 2/2" in logs[1]
    config, params = _small()
    _, exported = load_checkpoint(export, include_dspark=True)
    # the target is exported unchanged, the drafter trained away from any initialisation
    np.testing.assert_array_equal(exported["layers"][1]["attn"]["wkv"], params["layers"][1]["attn"]["wkv"])
    assert not np.allclose(exported["dspark"]["main_proj"], params["dspark"]["main_proj"])
    assert np.isfinite(exported["dspark"]["blocks"][1]["ffn"]["experts"]["w2"]).all()


def test_generate_speculative_equals_plain_greedy(drafter_export, capsys):
    """`dsv41 generate --speculative` prints the same greedy continuation as plain decoding, with its acceptance
    length; a model without a drafter is a clear error."""
    target, export, _ = drafter_export
    argv = ["generate", "--checkpoint", export, "--prompt", "def add(a, b):\n", "--max-new-tokens", "14",
            "--temperature", "0"]
    rc, plain, _ = _cli(argv, capsys)
    assert rc == 0
    rc, spec, err = _cli(argv + ["--speculative"], capsys)
    assert rc == 0, err
    assert spec == plain and len(plain) > len("def add(a, b):\n")
    assert "acceptance length" in err and "tokens per verification step" in err and "tok/s" in err
    rc, _, err = _cli(["generate", "--checkpoint", target, "--speculative", "--max-new-tokens", "2"], capsys)
    assert rc == 2 and "holds no trained DSpark drafter" in err
    rc, _, err = _cli(["generate", "--config", "tiny", "--speculative", "--max-new-tokens", "2"], capsys)
    assert rc == 2 and "random weights have none" in err


def test_default_model_ships_its_drafter():
    """The embedded default model's trained drafter (drafter.safetensors) loads on request; plain loads of the
    model are unchanged (the mtp.* tensors listed as skipped)."""
    from dsv41_jax.checkpoint.release import ReleaseCheckpoint
    from dsv41_jax.default_model import DEFAULT_MODEL_DIR, default_model

    config, params, _ = default_model(include_dspark=True)
    assert config.num_nextn_predict_layers == 2 and len(params["dspark"]["blocks"]) == 2
    assert float(np.abs(np.asarray(params["dspark"]["main_proj"])).max()) > 0
    _, plain, _ = default_model()
    assert "dspark" not in plain
    rep = ReleaseCheckpoint(DEFAULT_MODEL_DIR).report
    assert set(rep.skipped.values()) == {N.DSPARK_REASON} and len(rep.skipped) == 96


def test_generate_speculative_schedule_options(drafter_export, capsys):
    """`--schedule prefix` with a given step-time table stays lossless and reports its table; the speculative
    options fail clearly (before any weights load) where they cannot apply; --help shows them with defaults."""
    _, export, _ = drafter_export
    argv = ["generate", "--checkpoint", export, "--prompt", "def add(a, b):\n", "--max-new-tokens", "14",
            "--temperature", "0"]  # the shapes of the test above: its programs are reused
    rc, plain, _ = _cli(argv, capsys)
    # equal step times: verifying every draft is the best prefix, so the step keeps the width compiled above
    rc, spec, err = _cli(argv + ["--speculative", "--schedule", "prefix", "--step-times", "1:2,2:2,3:2,4:2,5:2"],
                         capsys)
    assert rc == 0, err
    assert spec == plain and "confidence scheduling prefix, step times (given) 1: 2.00 ms" in err
    for extra, msg in ((["--schedule", "prefix"], "only apply with --speculative"),
                       (["--speculative", "--step-times", "1:2"], "use it with --schedule prefix"),
                       (["--speculative", "--schedule", "prefix", "--step-times", "1:2,x"], "'x' is not N:MS"),
                       (["--speculative", "--schedule", "prefix", "--step-times", "0:2"], "need N >= 1"),
                       (["--speculative", "--schedule", "threshold", "--threshold", "0"], "--threshold must be in"),
                       (["--speculative", "--draft-len", "0"], "--draft-len must be >= 1"),
                       (["--speculative", "--draft-len", "9"], "exceeds the drafter's block")):
        rc, _, err = _cli(argv + extra, capsys)
        assert rc == 2 and msg in err, (extra, err)
    from dsv41_jax.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["generate"]
    text = sub.format_help()
    assert "{none,threshold,prefix}" in text and "(default: none)" in text and "--step-times N:MS" in text


def test_prefix_step_time_table():
    from dsv41_jax.inference.speculative import parse_step_times, prefix_schedule, steps_per_s_from_table

    table = parse_step_times("1:4, 3:5,6:8")
    assert table == {1: 0.004, 3: 0.005, 6: 0.008}
    sps = steps_per_s_from_table(table, rows=2)
    assert sps(2) == 250.0 and sps(3) == 200.0 and sps(12) == 125.0 and sps(40) == 125.0
    # one row, confidences 0.9, 0.5, 0.1, ...: 2 drafts (width 3: 2.35 expected tokens per 5 ms step) beat
    # none (1 per 4 ms), one (1.9 per 5 ms) and all five (2.4 per 8 ms)
    a = np.array([[0.9, 0.45, 0.045, 0.004, 0.0004]])
    assert prefix_schedule(a, steps_per_s_from_table(table), early_stop=False).tolist() == [2]
