"""A tiny twin of the release for CPU tests: the same layer roles at toy sizes (the reference notes' §4 layout).

Layers: 0–1 SWA (Engram at 1), 2–5 ratio-2 encoder (two KV groups, Full + Reuse, Engram at 4), 6–11 ratio-1
decoder (Full candidate source at 6, Reindex at 8 and 10, Reuse between). Sizes are small enough that a forward
over a few hundred tokens runs in well under a second on a laptop CPU.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "tiny"
    c.vocab_size = 259  # the byte-level tokenizer: 3 specials + 256 bytes
    c.hidden_size = 64
    c.num_hidden_layers = 12
    c.num_attention_heads = 4
    c.head_dim = 64
    c.q_lora_rank = 32
    c.qk_rope_head_dim = 16
    c.o_groups = 2
    c.o_lora_rank = 16
    c.sliding_window = 8
    c.rope_theta = 10000.0
    c.compress_rope_theta = 160000.0
    c.compress_yarn = dict(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)
    c.compress_ratios = [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1]
    c.kv_source_layer_ids = [2, 4, 6]
    c.index_source_layer_ids = [2, 4, 6, 8, 10]
    c.candidate_source_layer_id = 6
    c.candidate_topk_blocks = 3
    c.candidate_block_size = 2
    c.index_n_heads = 16
    c.index_head_dim = 32
    c.index_topk = 4
    c.n_routed_experts = 8
    c.num_experts_per_tok = 2
    c.moe_intermediate_size = 32
    c.routed_scaling_factor = 1.5
    c.swiglu_limit = 10.0
    c.hc_mult = 4
    c.hc_sinkhorn_iters = 20
    c.hc_eps = 1e-6
    c.rms_norm_eps = 1e-20
    c.engram_layer_ids = [1, 4]
    c.engram_vocab_size = 101
    c.engram_num_embeddings = [660, 864]
    c.engram_max_ngram_size = 4
    c.engram_n_heads = 2
    c.engram_head_dim = 32
    c.engram_pad_id = 2
    c.engram_compressed_vocab_size = 230  # the byte tokenizer's canonical map (case- and whitespace-merged)
    # DSpark (SPEC §9) at toy size: 2 draft blocks (the first owns main_proj, the last the heads) drafting 4
    # tokens from the residual entering decoder layers 9-11; its parameters exist only with include_dspark=True.
    c.num_nextn_predict_layers = 2
    c.dspark_block_size = 4
    c.dspark_target_layer_ids = [9, 10, 11]
    c.dspark_n_routed_experts = 8
    c.dspark_num_experts_per_tok = 2
    c.dspark_markov_rank = 16
    c.dspark_noise_token_id = 258
    c.max_position_embeddings = 1048576
    c.quant_sim = True
    return c
