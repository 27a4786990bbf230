"""Configuration: the released values, the derived layer plan, and clear errors for invalid combinations."""

import itertools

import pytest

from dsv41_jax import ConfigError, ModelConfig, load_config
from dsv41_jax.model.counting import count_params, expected_distinct_experts
from dsv41_jax.plan import FULL, REINDEX, REUSE, SWA


def test_flash_plan_matches_release():
    c = load_config("flash")
    plan = c.plan
    assert len(plan) == 40 and plan.decoder_start == 20
    modes = {l.index: l.mode for l in plan}
    assert [i for i, m in modes.items() if m == SWA] == [0, 1]
    assert [i for i, m in modes.items() if m == FULL] == [2, 8, 14, 20]
    assert [i for i, m in modes.items() if m == REINDEX] == [24, 28, 32, 36]
    assert sum(m == REUSE for m in modes.values()) == 30
    assert [l.index for l in plan if l.engram_slot is not None] == [1, 14]
    assert plan[20].candidate_source and all(plan[i].uses_candidates for i in (24, 28, 32, 36))
    assert not plan[20].uses_candidates
    # Reuse layers read the latest KV source's KV and the latest index source's top-k.
    assert (plan[7].kv_source, plan[7].index_source) == (2, 2)
    assert (plan[27].kv_source, plan[27].index_source) == (20, 24)
    assert (plan[39].kv_source, plan[39].index_source) == (20, 36)
    assert all(plan[i].ratio == 2 for i in range(2, 20)) and all(plan[i].ratio == 1 for i in range(20, 40))
    assert plan[0].rope == "main" and plan[2].rope == "compress"


def test_flash_param_counts_reproduce_release():
    counts = count_params(load_config("flash"))
    assert 551e9 < counts.backbone < 553e9  # ≈552B backbone
    assert 196e9 < counts.engram < 198e9  # ≈196B Engram
    assert counts.engram_tables == (384_006_168 + 384_016_682) * 256
    assert 7.5e9 < counts.active_prefill < 8.5e9  # ≈8B active per prompt token (CED)
    assert 15.5e9 < counts.active_decode < 16.5e9  # ≈16B active per generated token
    assert counts.total == counts.backbone + counts.engram + counts.dspark


def test_expected_distinct_experts_is_the_mean_union_of_uniform_picks():
    # every way 3 tokens can each pick 2 of 5 experts, equally likely: the mean size of their union
    picks = list(itertools.combinations(range(5), 2))
    unions = [len(set(a) | set(b) | set(c)) for a, b, c in itertools.product(picks, repeat=3)]
    assert expected_distinct_experts(5, 2, 3) == pytest.approx(sum(unions) / len(unions), rel=1e-12)
    assert expected_distinct_experts(16, 6, 1) == pytest.approx(6) and expected_distinct_experts(8, 8, 4) == 8
    with pytest.raises(ValueError, match="topk"):
        expected_distinct_experts(8, 9, 1)


def test_hf_config_roundtrip_and_defaults():
    c = load_config("tiny")
    back = ModelConfig.from_hf_dict(c.to_hf_dict())
    for field in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
                  "engram_layer_ids", "compress_yarn", "hidden_size", "index_topk"):
        assert getattr(back, field) == getattr(c, field), field
    # HF defaults: omitted schedules are derived like the reference config class does.
    d = {"num_hidden_layers": 40, "num_nextn_predict_layers": 3}
    flash_like = ModelConfig.from_hf_dict(d)
    assert flash_like.kv_source_layer_ids == (2, 8, 14, 20)
    assert flash_like.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert flash_like.candidate_source_layer_id == 20


@pytest.mark.parametrize("changes, field", [
    (dict(o_groups=3), "o_groups"),
    (dict(compress_ratios=(0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1), kv_source_layer_ids=(6,),
          index_source_layer_ids=(6, 8, 10)), "kv_source_layer_ids"),  # Reuse layer 2 before any source
    (dict(compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 3)), "compress_ratios"),  # ratio differs from its source
    (dict(compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, -1)), "compress_ratios"),
    (dict(compress_ratios=(0, 0, 2)), "compress_ratios"),  # wrong length
    (dict(kv_source_layer_ids=(2, 4, 6), index_source_layer_ids=(2, 6, 8, 10)), "index_source_layer_ids"),
    (dict(kv_source_layer_ids=(0, 4, 6)), "kv_source_layer_ids"),  # SWA-only layer as a source
    (dict(candidate_source_layer_id=7), "candidate_source_layer_id"),
    (dict(candidate_source_layer_id=2), "candidate_source_layer_id"),  # later index sources in other groups
    (dict(engram_num_embeddings=(660,)), "engram_num_embeddings"),
    (dict(engram_layer_ids=(1, 40), engram_num_embeddings=(660, 864)), "engram_layer_ids"),
    (dict(qk_rope_head_dim=15), "qk_rope_head_dim"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(head_dim=48, qk_rope_head_dim=16), "head_dim"),  # not blockable for the fake quantisers
    (dict(hidden_size=0), "hidden_size"),
    (dict(scoring_func="softmax"), "scoring_func"),
])
def test_invalid_configs_name_the_field(tiny_config, changes, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        tiny_config.replace(**changes)


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown config"):
        load_config("no_such_config")


@pytest.mark.parametrize("content,problem", [
    (b'{"vocab_size": 259, "hidden', "the file looks truncated"),
    (b"", "the file is empty"),
    (b"<html>not json</html>", "invalid JSON"),
    (b"\x89PNG\r\n\x1a\n\xff\xfe", "not a text file"),
    (b"[1, 2]", "got a JSON list"),
    (b'{"hidden_size": "wide"}', "`hidden_size`: must be a positive integer"),
])
def test_corrupt_config_json_names_the_file_and_the_problem(tmp_path, capsys, content, problem):
    from dsv41_jax.cli import main

    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=problem) as e:
        load_config(str(tmp_path))
    assert str(tmp_path / "config.json") in str(e.value)
    assert main(["plan", "--config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "config.json") in err and problem in err


def test_corrupt_tokenizer_json_names_the_file(tmp_path):
    from dsv41_jax.tokenizer import load_tokenizer

    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0')
    with pytest.raises(ValueError, match="tokenizer.json: invalid JSON .*truncated"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("")
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer(str(tmp_path))
