#!/usr/bin/env bash
# Train the embedded default model's DSpark drafter (mtp.0-1 in dsv41_jax/assets/default_model) against the frozen
# default model, on the CPU, then package it and measure its acceptance on held-out text. The recipe recorded in
# dsv41_jax/assets/default_model/TRAINING.md ("DSpark drafter") was run exactly like this.
#
#   bash benchmarks/train_default_drafter.sh STDLIB_DIR OUT_DIR [TIME_LIMIT_S] [STEPS]
#
# STDLIB_DIR: e.g. /usr/lib/python3.11. Its asyncio/ package is held out (the acceptance is measured there).
set -u
CORPUS=${1:-/usr/lib/python3.11}
OUT=${2:-out_drafter}
LIMIT=${3:-960}
STEPS=${4:-1200}
mkdir -p "$OUT"
python3 -m dsv41_jax.cli train --dspark --config default --init-from default --data "$CORPUS" --glob '*.py' \
  --exclude 'test,tests,idle_test,site-packages,dist-packages,__pycache__,asyncio' \
  --seq-len 256 --batch-size 4 --dspark-anchors 32 --dspark-labels target --dtype float32 \
  --steps "$STEPS" --time-limit "$LIMIT" --optimizer adamw --lr 2e-3 --warmup 50 --min-lr-ratio 0.05 \
  --weight-decay 0.1 --grad-clip 1.0 --log-every 25 --no-progress \
  --metrics "$OUT/drafter_train.jsonl" --ckpt-dir "$OUT/ckpt" --save-every 200 \
  --export "$OUT/model" --export-format safetensors \
  2>&1 | grep -v -i 'tpu\|E0000\|=== Source\|learning/\|InitGoogle' | tee "$OUT/drafter_train.log"
