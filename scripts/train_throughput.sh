#!/usr/bin/env bash
# `flux8 train` at a benchmark workload's shape (docs/WORKLOADS.md) on synthetic
# MLPerf-shaped shards (`flux8 data synthetic`): what a real run's step costs with its data path
# — the loader, the batch assembly, the upload — and its checkpoints, beside `flux8 bench`'s
# step, which starts with its batch on the device. Runs `flux8 train` with a key off and on,
# alternating (TRAIN_THROUGHPUT_COMPARE: data_overlap, the default, or async_save;
# TRAIN_THROUGHPUT_ROUNDS rounds, default 2), and prints from each run's metrics.jsonl the median
# step time of steps 6 to TRAIN_THROUGHPUT_STEPS (default 30) and of its data stages, what each
# checkpoint cost the step loop (a save in line: all of it; async_save: the host copy) and how
# long it took to write, and the median step while a checkpoint was written behind training.
# Checkpoints: every TRAIN_THROUGHPUT_SAVE_INTERVAL steps (default 0: only the end-of-run one).
# The last run then resumes for one step (the time to verify and load its checkpoint).
#   scripts/train_throughput.sh W1|W2 [--set key=value ...]   (more --set: passed to flux8 train)
#   TRAIN_THROUGHPUT_COMPARE=async_save TRAIN_THROUGHPUT_SAVE_INTERVAL=10 TRAIN_THROUGHPUT_STEPS=40 \
#     scripts/train_throughput.sh W2
# Shards and runs go to TRAIN_THROUGHPUT_DIR (default /dev/shm/flux8_train_throughput: the end
# of run checkpoint of W2 is ~16 GB). Needs build/flux8 and python3 (standard library only).
set -euo pipefail
cd "$(dirname "$0")/.."
workload=${1:?usage: scripts/train_throughput.sh W1|W2 [--set key=value ...]}
shift
work=${TRAIN_THROUGHPUT_DIR:-/dev/shm/flux8_train_throughput}
steps=${TRAIN_THROUGHPUT_STEPS:-30}
rounds=${TRAIN_THROUGHPUT_ROUNDS:-2}
compare=${TRAIN_THROUGHPUT_COMPARE:-data_overlap}
save_interval=${TRAIN_THROUGHPUT_SAVE_INTERVAL:-0}
case "$compare" in
  data_overlap|async_save) ;;
  *) echo "train_throughput: TRAIN_THROUGHPUT_COMPARE is '$compare'; use data_overlap or async_save" >&2; exit 2 ;;
esac
case "$workload" in
  W1) model=(-c configs/models/flux_535m.yaml --set micro_batch_size=32)
      samples=256 ;;
  W2) model=(-c configs/models/flux_12b_dev.yaml --set num_double_blocks=2 --set num_single_blocks=4
             --set image_size=1024 --set text_seq_len=512 --set micro_batch_size=2)
      samples=64 ;;
  *) echo "train_throughput: unknown workload '$workload' (W1 or W2)" >&2; exit 2 ;;
esac
# The bench's fastest FP8 configuration (docs/PERFORMANCE.md, Current numbers).
fast=(--set fp8=hybrid --set fp8_recipe=delayed --set fp8_dot_product_attention=true
      --set grad_precision=bf16 --set adam_moment_precision=bf16 --set cuda_graph=true)
mkdir -p "$work"
data="$work/$workload-data"
build/flux8 data synthetic "${model[@]}" --out "$data" --samples "$samples" --samples-per-shard 32
# "step X ms, data wait Y, read Z, assemble A, upload B" (medians over steps 6..steps), then the
# checkpoints: what each cost the step loop and how long it took to write.
summary() {
  python3 - "$1" "$steps" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
last = int(sys.argv[2])
rows = [r for r in lines if "step_time_s" in r]
window = [r for r in rows if 6 <= r["step"] <= last]
med = lambda rs, k: 1e3 * statistics.median(r.get(k, float("nan")) for r in rs) if rs else float("nan")
tflops = statistics.median(r.get("model_tflops_per_s", float("nan")) for r in window) if window else float("nan")
out = (f"step {med(window, 'step_time_s'):.2f} ms ({tflops:.0f} model TFLOP/s), data wait {med(window, 'data_wait_s'):.2f}, "
       f"read {med(window, 'data_read_s'):.2f}, assemble {med(window, 'data_assemble_s'):.2f}, "
       f"upload {med(window, 'data_upload_s'):.2f}")
# Which steps ran while a checkpoint was written behind training (between its snapshot and its
# checkpoint event), and what each save held the step loop for.
writing, behind, stalls, writes = False, set(), [], []
for r in lines:
    ev = r.get("event")
    if ev == "checkpoint_snapshot":
        writing = True
        stalls.append(r["snapshot_seconds"] + r["wait_seconds"])
    elif ev == "checkpoint":
        if r.get("async"):
            writing = False
            writes.append(r["seconds"])
        else:
            stalls.append(r["seconds"])
    elif "step_time_s" in r and writing:
        behind.add(r["step"])
if stalls:
    gb = next((r["bytes"] / 1e9 for r in lines if r.get("event") == "checkpoint"), float("nan"))
    out += f"; {len(stalls)} checkpoints of {gb:.2f} GB held the step loop " + ", ".join(f"{x:.2f}" for x in stalls) + " s"
if writes:
    out += ", written behind it in " + ", ".join(f"{x:.1f}" for x in writes) + " s"
    during = [r for r in window if r["step"] in behind]
    if during:
        out += f"; step {med(during, 'step_time_s'):.2f} ms while writing ({len(during)} steps)"
print(out)
PY
}
for round in $(seq "$rounds"); do
  for value in off on; do
    setting=(--set "$compare=$value")
    run="$work/$workload-run-$value"
    rm -rf "$run"
    build/flux8 train "${model[@]}" "${fast[@]}" --set backend=cuda --set "train_data=$data/train-*.tar" \
        --set train_iters="$steps" --set lr_warmup_iters=0 --set log_interval=1 --set save_dir="$run" \
        --set save_interval="$save_interval" "${setting[@]}" "$@" > "$work/$workload-$value.log" 2>&1 ||
      { tail -20 "$work/$workload-$value.log"; echo "train_throughput: flux8 train failed" >&2; exit 1; }
    echo "$workload round $round $compare=$value: $(summary "$run/metrics.jsonl")" \
         "(medians of steps 6-$steps; $(grep -o 'first step done [0-9.]* s' "$work/$workload-$value.log"))"
    # The last run resumes once for one step more: how long verifying and loading its
    # checkpoint takes (every file's SHA-256 read back, then the tensors).
    if [ "$round" = "$rounds" ] && [ "$value" = on ]; then
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
