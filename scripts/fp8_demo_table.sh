#!/usr/bin/env bash
# Trains the embedded demo on the CPU backend (the FP8 reference emulation; a later
# `--set backend=auto` argument moves it to a GPU) in BF16 and in FP8 with every recipe and format (same seed), and
# prints the final validation losses as a markdown table (docs/FP8.md). About 50 minutes on
# 2 CPU cores (FP8 is emulated bit-exactly on the CPU, ~1.9x slower than BF16 there).
# Usage: scripts/fp8_demo_table.sh [build/flux8] [extra --set arguments...]
# On a machine with many cores, FLUX8_TABLE_JOBS=9 runs the 9 trainings at once (each with
# FLUX8_TABLE_THREADS threads, default max(1, cores / jobs); results do not depend on the thread
# count) and then prints the same table; it writes each run's wall time to
# runs/fp8_table/timings.tsv (FLUX8_TABLE_OUT moves runs/fp8_table). Default (FLUX8_TABLE_JOBS unset or 1): one run after another.
set -euo pipefail
# The whole script is one { } block: bash reads it completely before running it, so editing this
# file while a table is being made cannot change what the running copy does next.
{
cd "$(dirname "$0")/.."
bin=${1:-build/flux8}
shift || true
out=${FLUX8_TABLE_OUT:-runs/fp8_table}
mkdir -p "$out"
run() {  # name, then --set arguments
  local name=$1; shift
  "$bin" train -c configs/demo.yaml --set backend=cpu --set save_dir="$out/$name" --set sample_prompts= --set eval_interval=0 \
      --set log_interval=100 --set fp8_stats_interval=0 "$@" > "$out/$name.log" 2>&1 || { echo "$name failed: see $out/$name.log"; exit 1; }
  grep -o 'validation loss [0-9.]* -> [0-9.]*' "$out/$name.log" | awk '{print $5}'
}
recipes=(delayed tensorwise blockwise mxfp8)
formats=(e4m3 hybrid)
njobs=${FLUX8_TABLE_JOBS:-1}
if [ "$njobs" -gt 1 ]; then
  cores=$(nproc 2>/dev/null || echo 2)
  threads=${FLUX8_TABLE_THREADS:-$((cores / njobs > 0 ? cores / njobs : 1))}  # no more threads than cores
  # The runs share the demo dataset: write it once first, or each run would write it at the same
  # time (train_data's directory, runs/demo/data unless the extra arguments set it).
  data_dir=runs/demo/data
  for a in "$@"; do case $a in train_data=*) data_dir=$(dirname "${a#train_data=}") ;; esac; done
  if [ ! -f "$data_dir/manifest.json" ]; then
    "$bin" data demo --out "$data_dir" -c configs/demo.yaml "$@" > "$out/data.log" 2>&1 ||
      { echo "writing the demo dataset failed: see $out/data.log" >&2; exit 1; }
  fi
  names=(bf16); args=("")
  for recipe in "${recipes[@]}"; do
    for format in "${formats[@]}"; do
      names+=("${recipe}_${format}"); args+=("--set fp8=$format --set fp8_recipe=$recipe")
    done
  done
  echo -e "run\tthreads\tseconds" > "$out/timings.tsv"
  pids=(); failed=0
  for idx in "${!names[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$njobs" ]; do wait -n || true; done
    # shellcheck disable=SC2086  # args[idx] is a list of words
    # OMP_NUM_THREADS too: the FP8 quantizers' OpenMP regions (src/fp8/quantize.cpp) do not
    # follow the threads key and would otherwise start one thread per core in every run.
    ( export OMP_NUM_THREADS=$threads
      t0=$(date +%s.%N)
      run "${names[idx]}" --set threads="$threads" ${args[idx]} "$@" > "$out/${names[idx]}.result"
      echo -e "${names[idx]}\t$threads\t$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.0f", b-a}')" >> "$out/timings.tsv"
    ) &
    pids+=($!)
  done
  for idx in "${!pids[@]}"; do
    wait "${pids[idx]}" || { echo "${names[idx]} failed: see $out/${names[idx]}.log" >&2; failed=1; }
  done
  [ "$failed" -eq 0 ] || exit 1
  bf16=$(cat "$out/bf16.result")
  echo "| run | final validation loss | vs BF16 |"
  echo "|---|---|---|"
  echo "| BF16 | $bf16 | — |"
  for recipe in "${recipes[@]}"; do
    for format in "${formats[@]}"; do
      v=$(cat "$out/${recipe}_${format}.result")
      echo "| FP8 $recipe $format | $v | $(awk -v a="$v" -v b="$bf16" 'BEGIN{printf "%+.1f%%", 100*(a-b)/b}') |"
    done
  done
  exit 0
fi

bf16=$(run bf16 "$@")
echo "| run | final validation loss | vs BF16 |"
echo "|---|---|---|"
echo "| BF16 | $bf16 | — |"
for recipe in delayed tensorwise blockwise mxfp8; do
  for format in e4m3 hybrid; do
    v=$(run "${recipe}_${format}" --set fp8="$format" --set fp8_recipe="$recipe" "$@")
    echo "| FP8 $recipe $format | $v | $(awk -v a="$v" -v b="$bf16" 'BEGIN{printf "%+.1f%%", 100*(a-b)/b}') |"
  done
done
exit 0
}
