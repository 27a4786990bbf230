"""DeepSeek-V4.1-Flash as released (SPEC §1). ``get_config()`` returns an ml-collections ConfigDict whose keys are
``dsv41_jax.ModelConfig`` fields; ``dsv41_jax.load_config("flash")`` turns it into the frozen, validated config."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "flash"
    c.vocab_size = 129280
    c.hidden_size = 5120
    c.num_hidden_layers = 40
    c.num_attention_heads = 64
    c.head_dim = 512
    c.q_lora_rank = 1280
    c.qk_rope_head_dim = 64
    c.o_groups = 8
    c.o_lora_rank = 1024
    c.sliding_window = 128
    c.rope_theta = 10000.0
    c.compress_rope_theta = 160000.0
    c.compress_yarn = dict(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)
    c.compress_ratios = [0, 0] + [2] * 18 + [1] * 20 + [0] * 3
    c.kv_source_layer_ids = [2, 8, 14, 20]
    c.index_source_layer_ids = [2, 8, 14, 20, 24, 28, 32, 36]
    c.candidate_source_layer_id = 20
    c.candidate_topk_blocks = 2048
    c.candidate_block_size = 8
    c.index_n_heads = 32
    c.index_head_dim = 128
    c.index_topk = 512
    c.n_routed_experts = 384
    c.num_experts_per_tok = 6
    c.moe_intermediate_size = 2304
    c.routed_scaling_factor = 1.5
    c.swiglu_limit = 10.0
    c.hc_mult = 4
    c.hc_sinkhorn_iters = 20
    c.hc_eps = 1e-6
    c.rms_norm_eps = 1e-20
    c.engram_layer_ids = [1, 14]
    c.engram_vocab_size = 16_000_000
    c.engram_num_embeddings = [384_006_168, 384_016_682]
    c.engram_max_ngram_size = 4
    c.engram_n_heads = 8
    c.engram_head_dim = 256
    c.engram_pad_id = 2
    c.engram_compressed_vocab_size = 99092
    c.num_nextn_predict_layers = 3
    c.dspark_block_size = 5
    c.dspark_noise_token_id = 128799
    c.dspark_target_layer_ids = [37, 38, 39]
    c.dspark_markov_rank = 256
    c.dspark_n_routed_experts = 128
    c.dspark_num_experts_per_tok = 3
    c.max_position_embeddings = 1048576
    c.quant_sim = True
    return c
