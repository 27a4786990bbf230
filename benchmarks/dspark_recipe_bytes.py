"""Bytes of weights a batch-1 plain step and a batch-1 DSpark verification step read, for candidate target + drafter
MoE shapes of ``bench_dspark_h200`` (CPU, shapes only, no allocation), and the tokens per verification step each
needs for a given speed-up.

    python benchmarks/dspark_recipe_bytes.py                 # the candidates below + the release's union note
    python benchmarks/dspark_recipe_bytes.py --json OUT.json

Why: an MoE's verification step runs γ + 1 tokens through each layer, and each token picks its own top-k routed
experts, so the step reads the *union* of the experts they pick — under uniform routing E (1 - (1 - k / E) ** (γ + 1))
of E — where a plain step reads k. With 16 experts top-6 and γ = 7 that is 15.6 of 16 (2.6× the routed bytes of a
plain step), plus the drafter's block. A speed-up S at batch 1 needs (tokens per verification step) ≥ S × (step time
ratio); where the steps are weight-bound the time ratio follows the byte ratio.

Counted (bf16, 2 bytes a parameter): plain = every non-routed backbone weight + k routed experts per layer + head;
verification = every non-routed backbone weight + the union of γ + 1 tokens' picks + head, plus the drafter:
its non-routed weights (attention, shared expert, ``main_proj``, heads) + the union of its γ + 1 slots' top-k picks
among its own experts (the drafter's pass runs ``[x_p, noise × γ]``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_dspark_h200 import target_config  # noqa: E402
from dsv41_jax.config import load_config  # noqa: E402
from dsv41_jax.model.counting import expected_distinct_experts as union  # noqa: E402
from dsv41_jax.model.params import flat_specs  # noqa: E402


def step_bytes(config) -> dict:
    """Bytes (bf16) one batch-1 plain step and one batch-1 verification step of γ + 1 tokens read (module doc)."""
    c = config
    t = c.dspark_block_size + 1
    parts = dict(dense=0, routed=0, drafter_dense=0, drafter_routed=0)
    for path, s in flat_specs(c, include_dspark=True):
        p = path.split("/")
        drafter = p[0] == "dspark"
        if p[0] == "embed":
            continue  # a lookup: one row per token
        routed = "experts" in p and "shared_experts" not in p
        parts[("drafter_" if drafter else "") + ("routed" if routed else "dense")] += 2 * s.size
    e, k, de, dk = c.n_routed_experts, c.num_experts_per_tok, c.dspark_n_routed_experts, c.dspark_num_experts_per_tok
    plain = parts["dense"] + parts["routed"] * k / e
    target_verify = parts["dense"] + parts["routed"] * union(e, k, t) / e
    drafter = parts["drafter_dense"] + parts["drafter_routed"] * union(de, dk, t) / de
    return dict(experts=e, topk=k, drafter_experts=de, gamma=t - 1, union=union(e, k, t),
                drafter_union=union(de, dk, t), plain_gb=plain / 1e9, verify_target_gb=target_verify / 1e9,
                drafter_gb=drafter / 1e9, verify_gb=(target_verify + drafter) / 1e9,
                byte_ratio=(target_verify + drafter) / plain, backbone_b=(parts["dense"] + parts["routed"]) / 2e9)


# (target experts, top-k, drafter experts, γ): call 10's recipe first, then the candidates
CANDIDATES = [(16, 6, 8, 7), (16, 6, 8, 3), (16, 6, 2, 7), (8, 6, 8, 7), (8, 6, 4, 7), (8, 6, 2, 7), (8, 6, 4, 3),
              (8, 7, 4, 7), (12, 6, 4, 7)]
# call 10's measured greedy batch-1 steps (benchmarks/RESULTS.md): time ratio 1.91 at a byte ratio of its recipe's
CALL10_TIME_RATIO = 3.00 / 1.57


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--speedup", type=float, default=1.8)
    args = ap.parse_args(argv)
    rows = [step_bytes(target_config(False, g, e, k, de)) for e, k, de, g in CANDIDATES]
    calib = CALL10_TIME_RATIO / rows[0]["byte_ratio"]  # measured time ratio per byte ratio (one recipe, one run)
    print(f"| target experts / top-k | drafter experts (top-1) | γ | union of γ+1 tokens' picks | backbone B | "
          f"plain GB | verification GB (target + drafter) | byte ratio | tokens / step for {args.speedup}× "
          f"(time ratio = byte ratio) | same, time ratio = byte ratio × {calib:.2f} (call 10) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        r["tokens_needed"] = args.speedup * r["byte_ratio"]
        r["tokens_needed_call10"] = args.speedup * r["byte_ratio"] * calib
        print(f"| {r['experts']} / {r['topk']} | {r['drafter_experts']} | {r['gamma']} | {r['union']:.2f} "
              f"(drafter {r['drafter_union']:.2f}) | {r['backbone_b']:.2f} | {r['plain_gb']:.2f} | "
              f"{r['verify_gb']:.2f} ({r['verify_target_gb']:.2f} + {r['drafter_gb']:.2f}) | {r['byte_ratio']:.2f} | "
              f"{r['tokens_needed']:.2f} | {r['tokens_needed_call10']:.2f} |")
    # the release: its routed experts' union over a verification chunk of block_size + 1 tokens
    rel = load_config("flash")
    t = rel.dspark_block_size + 1
    notes = []
    for e in (rel.n_routed_experts, 256):
        u = union(e, rel.num_experts_per_tok, t)
        notes.append(dict(experts=e, topk=rel.num_experts_per_tok, tokens=t, union=u,
                          routed_bytes_ratio=u / rel.num_experts_per_tok))
        print(f"release shape {e} routed experts top-{rel.num_experts_per_tok}, {t}-token chunk: "
              f"{u:.1f} distinct experts per layer, {u / rel.num_experts_per_tok:.2f}× a one-token step's routed bytes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, call10_time_per_byte_ratio=calib, release=notes), f, indent=1)


if __name__ == "__main__":
    main()
