#!/usr/bin/env bash
# Train the embedded default model (dsv41_jax/assets/default_model) on the Python standard library's sources, then
# measure train-step throughput of the full-width bench config. The recipe recorded in
# dsv41_jax/assets/default_model/TRAINING.md was run exactly like this on one H200.
#
#   bash benchmarks/train_default_model.sh STDLIB_DIR OUT_DIR [TIME_LIMIT_S] [BENCH_TIMEOUT_S] [STEPS]
#
# TIME_LIMIT_S bounds the training run (compilation included); STEPS sets the LR schedule's length;
# BENCH_TIMEOUT_S=0 skips the throughput benchmark.
# STDLIB_DIR: e.g. /usr/lib/python3.11 (its *.py files; test / site-packages directories are skipped).
# Afterwards: python benchmarks/package_default_model.py OUT_DIR/default_model  (bf16 copy into the package).
set -u
CORPUS=${1:-/usr/lib/python3.11}
OUT=${2:-out}
LIMIT=${3:-120}
BENCH_TIMEOUT=${4:-110}
STEPS=${5:-20000}
mkdir -p "$OUT"
python3 -m dsv41_jax.cli train --config default --data "$CORPUS" --glob '*.py' \
  --exclude 'test,tests,idle_test,site-packages,dist-packages,__pycache__' \
  --seq-len 512 --batch-size 32 --steps "$STEPS" --time-limit "$LIMIT" \
  --optimizer adamw --lr 2e-3 --warmup 200 --min-lr-ratio 0.05 --weight-decay 0.1 --grad-clip 1.0 \
  --indexer-loss dense --log-every 50 \
  --metrics "$OUT/default_train.jsonl" --export "$OUT/default_model" --export-format safetensors \
  2>&1 | grep -v -i 'tpu\|E0000\|=== Source\|learning/' | tee "$OUT/default_train.log"
[ "$BENCH_TIMEOUT" = 0 ] && exit 0
XLA_FLAGS="${BENCH_XLA_FLAGS:-}" timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_train.py --preset fullwidth4 --batch 4 --seq 1024 --steps 6 \
  --warmup 1 --json "$OUT/bench.jsonl" 2>&1 | grep -v -i 'tpu\|E0000\|=== Source\|learning/' | tee "$OUT/bench.log"
exit 0
