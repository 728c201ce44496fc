#!/usr/bin/env bash
# Trains the embedded demo in BF16 and in FP8 with every recipe and format (same seed), and
# prints the final validation losses as a markdown table (docs/FP8.md). About 50 minutes on
# 2 CPU cores (FP8 is emulated bit-exactly on the CPU, ~1.9x slower than BF16 there).
# Usage: scripts/fp8_demo_table.sh [build/flux8] [extra --set arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/flux8}
shift || true
out=runs/fp8_table
mkdir -p "$out"
run() {  # name, then --set arguments
  local name=$1; shift
  "$bin" train -c configs/demo.yaml --set save_dir="$out/$name" --set sample_prompts= --set eval_interval=0 \
      --set log_interval=100 --set fp8_stats_interval=0 "$@" > "$out/$name.log" 2>&1 || { echo "$name failed: see $out/$name.log"; exit 1; }
  grep -o 'validation loss [0-9.]* -> [0-9.]*' "$out/$name.log" | awk '{print $5}'
}
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
