#!/usr/bin/env bash
# Full-size compile-proof: the flash config's sharded decode step and CED prefill for v5p-128 and v5p-256, compiled
# on this CPU host with libtpu. Long (tens of minutes on 2 cores): run it in the background and watch the log.
#   bash launch/aot_pod.sh            # -> benchmarks/aot/<preset>.{log,json}
#   PODS="v5p-256:32" TARGETS=decode bash launch/aot_pod.sh
# Needs libtpu: pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=benchmarks/aot
mkdir -p "$OUT"
CONTEXT=${CONTEXT:-1048576}
CHUNK=${CHUNK:-2048}
# PODS="preset:batch ..." picks the runs (default both, one after the other)
for spec in ${PODS:-v5p-128:16 v5p-256:32}; do
  preset=${spec%%:*}; batch=${spec##*:}
  echo "=== $preset: batch $batch x context $CONTEXT, prefill chunk $CHUNK ($(date -u +%FT%TZ))"
  "$PY" launch/aot_compile.py --config flash --preset "$preset" --batch "$batch" --context "$CONTEXT" \
      --prefill-chunk "$CHUNK" --targets "${TARGETS:-decode,prefill}" --out "$OUT/$preset.json" \
      2> >(grep -v -E "^(WARNING: could not|E0000|=== Source|learning/|Failed to find host)" >&2) \
      | tee "$OUT/$preset.log"
done
