"""A 40-layer full-width benchmark model for one NVIDIA H200: the release's layer plan at the release's widths,
minus expert count.

Every role of the release (``dsv41 plan --config bench40``): SWA-only layers 0-1, ratio-2 encoder layers 2-19
(Full at 2, 8, 14, Reuse between), the ratio-1 decoder 20-39 (Full + HSI candidate source at 20, Reindex at 24, 28,
32, 36, Reuse between), Engram at layers 1 and 14. Each layer is the release's (d 5120, 64 heads x 512, q LoRA
1280, 8 x 1024 output groups, window 128, indexer 32 x 128 top-512, HSI 2048 blocks of 8, mHC 4 streams) with 16
routed experts (top-6, width 2304, the release's router) + 1 shared expert instead of 384. Engram tables are built
for an Engram vocabulary of 40,000 (963,078 and 970,134 rows instead of ≈384 M): a decode step reads only the
looked-up rows, so the step's bytes do not depend on the table size. No DSpark drafter (not implemented).

Parameters (``dsv41 params --config bench40``): 30.56 B backbone + 0.81 B Engram = 31.37 B, 62.7 GB (58.4 GiB) in
bfloat16, which leaves about 78 GB of the H200's 141 GB for caches and activations. A decode step touches the
attention, the shared expert, the routed experts the batch selects (6 per layer at batch 1, all 16 at batch 32),
the embedding row and the head.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location("dsv41_configs_flash", os.path.join(os.path.dirname(__file__),
                                                                                  "flash.py"))
_flash = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_flash)


def get_config():
    c = _flash.get_config()
    c.name = "bench40"
    c.compress_ratios = [0, 0] + [2] * 18 + [1] * 20  # the release's 40 layers, no DSpark blocks
    c.num_nextn_predict_layers = 0
    c.n_routed_experts = 16
    c.engram_vocab_size = 40_000
    c.engram_num_embeddings = [963_078, 970_134]  # EngramHashLayout.build((1, 14), 4, 8, 40_000, 99092, 1)
    c.quant_sim = False  # fake quantisation is numerics emulation, not a storage format: off for speed runs
    return c
