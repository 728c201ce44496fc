#!/usr/bin/env bash
# `flux8 train` at a benchmark workload's shape (../shared/WORKLOADS.md) on synthetic
# MLPerf-shaped shards (`flux8 data synthetic`): what a real run's step costs with its data path
# — the loader, the batch assembly, the upload — beside `flux8 bench`'s step, which starts with
# its batch on the device. Runs `flux8 train` with data_overlap off and on, alternating
# (TRAIN_THROUGHPUT_ROUNDS rounds, default 2), and prints the median step time of steps 6 to
# TRAIN_THROUGHPUT_STEPS (default 30) from each run's metrics.jsonl, and how long the run's
# end-of-run checkpoint took to write; the last run then resumes for one step (the time to
# verify and load its checkpoint).
#   scripts/train_throughput.sh W1|W2 [--set key=value ...]   (more --set: passed to flux8 train)
# Shards and runs go to TRAIN_THROUGHPUT_DIR (default /dev/shm/flux8_train_throughput: the end
# of run checkpoint of W2 is ~16 GB). Needs build/flux8 and python3 (standard library only).
set -euo pipefail
cd "$(dirname "$0")/.."
workload=${1:?usage: scripts/train_throughput.sh W1|W2 [--set key=value ...]}
shift
work=${TRAIN_THROUGHPUT_DIR:-/dev/shm/flux8_train_throughput}
steps=${TRAIN_THROUGHPUT_STEPS:-30}
rounds=${TRAIN_THROUGHPUT_ROUNDS:-2}
case "$workload" in
  W1) model=(-c configs/models/flux_535m.yaml --set micro_batch_size=32)
      samples=256 ;;
  W2) model=(-c configs/models/flux_12b_dev.yaml --set num_double_blocks=2 --set num_single_blocks=4
             --set image_size=1024 --set text_seq_len=512 --set micro_batch_size=2)
      samples=64 ;;
  *) echo "train_throughput: unknown workload '$workload' (W1 or W2)" >&2; exit 2 ;;
esac
# The bench's fastest FP8 configuration (docs/PERFORMANCE.md, At a glance).
fast=(--set fp8=hybrid --set fp8_recipe=delayed --set fp8_dot_product_attention=true
      --set grad_precision=bf16 --set adam_moment_precision=bf16 --set cuda_graph=true)
mkdir -p "$work"
data="$work/$workload-data"
build/flux8 data synthetic "${model[@]}" --out "$data" --samples "$samples" --samples-per-shard 32
# "step X ms, data wait Y, read Z, assemble A, upload B" (medians over steps 6..steps).
medians() {
  python3 - "$1" "$steps" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_time_s"' in l][5:int(sys.argv[2])]
med = lambda k: 1e3 * statistics.median(r.get(k, float("nan")) for r in rows) if rows else float("nan")
print(f"step {med('step_time_s'):.2f} ms, data wait {med('data_wait_s'):.2f}, read {med('data_read_s'):.2f}, "
      f"assemble {med('data_assemble_s'):.2f}, upload {med('data_upload_s'):.2f}")
PY
}
for round in $(seq "$rounds"); do
  for overlap in off on; do
    run="$work/$workload-run-$overlap"
    rm -rf "$run"
    build/flux8 train "${model[@]}" "${fast[@]}" --set backend=cuda --set "train_data=$data/train-*.tar" \
        --set train_iters="$steps" --set lr_warmup_iters=0 --set log_interval=1 --set save_dir="$run" \
        --set data_overlap=$overlap "$@" > "$work/$workload-$overlap.log" 2>&1 ||
      { tail -20 "$work/$workload-$overlap.log"; echo "train_throughput: flux8 train failed" >&2; exit 1; }
    echo "$workload round $round data_overlap=$overlap: $(medians "$run/metrics.jsonl")" \
         "(medians of steps 6-$steps; $(grep -o 'first step done [0-9.]* s' "$work/$workload-$overlap.log");" \
         "end-of-run checkpoint $(grep -o '([0-9.]* GB in [0-9.]* s)' "$work/$workload-$overlap.log"))"
    # The last run resumes once for one step more: how long verifying and loading its
    # checkpoint takes (every file's SHA-256 read back, then the tensors).
    if [ "$round" = "$rounds" ] && [ "$overlap" = on ]; then
      build/flux8 train "${model[@]}" "${fast[@]}" --set backend=cuda --set "train_data=$data/train-*.tar" \
          --set train_iters=$((steps + 1)) --set lr_warmup_iters=0 --set log_interval=1 --set save_dir="$run" \
          --resume "$@" > "$work/$workload-resume.log" 2>&1 ||
        { tail -20 "$work/$workload-resume.log"; echo "train_throughput: flux8 train --resume failed" >&2; exit 1; }
      echo "$workload resume: $(grep -o 'verified in [0-9.]* s, loaded in [0-9.]* s' "$work/$workload-resume.log");" \
           "$(grep -o 'first step done [0-9.]* s' "$work/$workload-resume.log")"
    fi
    rm -rf "$run"
  done
done
rm -rf "$data"
