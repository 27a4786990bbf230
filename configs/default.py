"""The embedded default model (``dsv41_jax/assets/default_model``): a small V4.1-architecture model that ships with
the package so ``dsv41 generate`` produces recognisable text offline. Byte-level vocabulary; every layer role of
the release at toy width:

  0 SWA · 1 SWA + Engram · 2 ratio-2 Full (KV + index source) · 3 ratio-2 Reuse + Engram · 4 ratio-2 Reuse ·
  5 ratio-1 Full (decoder; HSI candidate source) · 6 ratio-1 Reindex (inside the HSI pool) · 7 ratio-1 Reuse

Trained on the Python standard library's own sources (see dsv41_jax/assets/default_model/TRAINING.md).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "default"
    c.vocab_size = 259  # ByteTokenizer: 3 specials + 256 bytes
    c.hidden_size = 128
    c.num_hidden_layers = 8
    c.num_attention_heads = 4
    c.head_dim = 64
    c.q_lora_rank = 64
    c.qk_rope_head_dim = 16
    c.o_groups = 2
    c.o_lora_rank = 64
    c.sliding_window = 128
    c.rope_theta = 10000.0
    c.compress_rope_theta = 160000.0
    c.compress_yarn = dict(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)
    c.compress_ratios = [0, 0, 2, 2, 2, 1, 1, 1]
    c.kv_source_layer_ids = [2, 5]
    c.index_source_layer_ids = [2, 5, 6]
    c.candidate_source_layer_id = 5
    c.candidate_topk_blocks = 8
    c.candidate_block_size = 8
    c.index_n_heads = 16
    c.index_head_dim = 32
    c.index_topk = 32
    c.n_routed_experts = 8
    c.num_experts_per_tok = 2
    c.moe_intermediate_size = 48
    c.routed_scaling_factor = 1.5
    c.swiglu_limit = 10.0
    c.hc_mult = 4
    c.hc_sinkhorn_iters = 20
    c.hc_eps = 1e-6
    c.rms_norm_eps = 1e-20
    c.engram_layer_ids = [1, 3]
    c.engram_vocab_size = 1009
    c.engram_num_embeddings = [6126, 6332]
    c.engram_max_ngram_size = 4
    c.engram_n_heads = 2
    c.engram_head_dim = 32
    c.engram_pad_id = 2
    c.engram_compressed_vocab_size = 230
    c.num_nextn_predict_layers = 2  # the DSpark drafter (mtp.0-1 in the asset; TRAINING.md)
    c.dspark_target_layer_ids = [5, 6, 7]
    c.dspark_n_routed_experts = 8
    c.dspark_num_experts_per_tok = 2
    c.dspark_markov_rank = 16
    c.dspark_noise_token_id = 258
    c.max_position_embeddings = 1048576
    c.quant_sim = True
    return c
