#!/usr/bin/env bash
# Where XLA:GPU spends the compile of one bench_dspark_h200 program, under several XLA flag sets: each variant in its
# own process with a time limit, the HLO module dumped after every pass (benchmarks/dspark_programs.py --compile on
# abstract parameters), and the pass log summarised as (seconds before the next dump, pass). The last line of a
# variant that ran out of time names the pass it was in ("before_<pass>"). On an NVIDIA H200 (2026-12-02) the
# batch-1 prefill of the spec-h200 target sat in priority-fusion for > 40 s alone (> 6 minutes beside other
# compiles) while the batch-16 prefill compiled whole in 21 s.
#
#   bash benchmarks/probe_fusion_compile.sh OUT_DIR [PROGRAM] [BATCH] [SECONDS]
#
# PROGRAM: a dspark_programs.py name (default "prefill"); BATCH (default 1); SECONDS per variant (default 60).
# A flag this JAX no longer knows ends its variant at once ("Unknown flags in XLA_FLAGS" in its log).
set -u
out=${1:?usage: probe_fusion_compile.sh OUT_DIR [PROGRAM] [BATCH] [SECONDS]}
prog=${2:-prefill}
batch=${3:-1}
limit=${4:-60}
mkdir -p "$out"
base="--xla_gpu_enable_triton_gemm=false"
variants=(
  "baseline|"
  "no_heroless|--xla_gpu_experimental_enable_triton_heroless_priority_fusion=false"
  "no_fusion_autotuner|--xla_gpu_experimental_enable_fusion_autotuner=false --xla_gpu_experimental_enable_fusion_block_level_rewriter=false"
  "autotune0|--xla_gpu_autotune_level=0"
  "no_dynamic_slice_fusion|--xla_gpu_enable_dynamic_slice_fusion=false"
)
for v in "${variants[@]}"; do
  name=${v%%|*}
  extra=${v#*|}
  dump=$(mktemp -d)
  t0=$(date +%s.%N)
  XLA_FLAGS="$base $extra --xla_dump_to=$dump --xla_dump_hlo_pass_re=.* --xla_dump_hlo_module_re=.*" \
    timeout "$limit" python3 benchmarks/dspark_programs.py --batches "$batch" --only "$prog" --compile \
    > "$out/$name.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  passes=$(mktemp)
  ls -l --time-style=+%s.%N "$dump" | awk 'NR>1{print $6, $7}' | sort -n \
    | awk 'NR==1{t0=$1} {printf "%.2f %s\n", $1-t0, $2}' > "$passes"
  { echo "# dumps (s since the first, file)"; cat "$passes"; } >> "$out/$name.log"  # one file per variant
  echo "== $name (rc $rc, $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b - a}') s): $extra"
  grep '^| [0-9]' "$out/$name.log" || tail -2 "$out/$name.log"
  echo "  longest gaps (s, the dump that ended them):"
  awk 'NR>1{printf "%.2f %s\n", $1-p, $2} {p=$1}' "$passes" | sort -rn | head -4 | sed 's/^/    /'
  echo "  last dump: $(tail -1 "$passes")"
  rm -rf "$dump" "$passes"
done
