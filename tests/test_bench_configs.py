"""The 40-layer benchmark model (configs/bench40.py): the release's layer plan and widths, 16 routed experts, and
bf16 weights that fit one H200."""

from dsv41_jax import load_config
from dsv41_jax.model.counting import count_params
from dsv41_jax.ops.engram_hash import EngramHashLayout


def test_bench40_is_the_release_plan_minus_expert_count_and_fits_one_h200():
    flash, bench = load_config("flash"), load_config("bench40")
    assert bench.num_hidden_layers == flash.num_hidden_layers == 40
    roles = lambda c: [(s.stack, s.ratio, s.mode, s.kv_source, s.index_source, s.engram_slot)  # noqa: E731
                       for s in c.plan.layers[:40]]
    assert roles(bench) == roles(flash)  # SWA, ratio-2 Full / Reuse, ratio-1 Full, Reindex, HSI, Engram at 1 and 14
    assert bench.candidate_source_layer_id == 20 and bench.engram_layer_ids == (1, 14)
    for field in ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                  "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "candidate_topk_blocks",
                  "num_experts_per_tok", "moe_intermediate_size", "vocab_size", "hc_mult"):
        assert getattr(bench, field) == getattr(flash, field), field
    assert bench.n_routed_experts == 16
    layout = EngramHashLayout.build(bench.engram_layer_ids, bench.engram_max_ngram_size, bench.engram_n_heads,
                                    bench.engram_vocab_size, bench.engram_compressed_vocab_size, 1)
    assert tuple(int(r) for r in layout.rows_per_layer) == tuple(bench.engram_num_embeddings)
    bf16_bytes = 2 * count_params(bench).total
    assert 60e9 < bf16_bytes < 66e9  # 62.7 GB: leaves ~78 GB of the H200's 141 GB for caches and activations
