#!/usr/bin/env bash
# One process against jobs of several ranks, `flux8 train` on the embedded demo: the step losses
# and the final validation score of each layout beside the single process's, with the largest
# relative difference. On the GPU machine (gpu_check.sh's disttrain stage) the ranks share GPU 0
# through the host-staged communicator (FLUX8_COMM=mpi); elsewhere they run on the CPU backend.
#   scripts/dist_train_check.sh [BACKEND] [STEPS]      (cpu or cuda; 20 steps)
# DIST_CHECK_LAYOUTS: the layouts to run (default "dp2 dp2_zero tp2 tp2_dp2").
# Needs mpirun (Open MPI) and the flux8 binary: FLUX8_BIN, default build/flux8. Output: a table on
# stdout; runs under runs/dist_check.
set -euo pipefail
cd "$(dirname "$0")/.."
backend=${1:-cpu}
steps=${2:-20}
bin=${FLUX8_BIN:-build/flux8}
root=runs/dist_check
rm -rf "$root"
mkdir -p "$(dirname "$root")"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
[ "$backend" = cuda ] && export FLUX8_COMM=mpi
common=(-c configs/demo.yaml --set backend="$backend" --set train_iters="$steps" --set micro_batch_size=4
        --set global_batch_size=16 --set eval_interval=0 --set eval_samples=64 --set sample_prompts=
        --set save_interval=0 --set log_interval=1)
[ "$backend" = cpu ] && common+=(--set threads=1)
# The demo's data is generated once, by the single process.
"$bin" train "${common[@]}" --set save_dir="$root/one" > "$root.one.log" 2>&1 ||
  { tail -20 "$root.one.log"; exit 1; }
layouts=("dp2:2:--set tensor_model_parallel_size=1" "dp2_zero:2:--set use_distributed_optimizer=true"
         "tp2:2:--set tensor_model_parallel_size=2" "tp2_dp2:4:--set tensor_model_parallel_size=2")
wanted=" ${DIST_CHECK_LAYOUTS:-dp2 dp2_zero tp2 tp2_dp2} "
ran=()
for layout in "${layouts[@]}"; do
  IFS=: read -r name np extra <<< "$layout"
  [[ "$wanted" == *" $name "* ]] || continue
  ran+=("$name")
  # shellcheck disable=SC2086
  mpirun -np "$np" --oversubscribe "$bin" train "${common[@]}" $extra --set save_dir="$root/$name" \
    > "$root.$name.log" 2>&1 || { tail -20 "$root.$name.log"; echo "$name failed" >&2; exit 1; }
done
python3 - "$root" "${ran[@]}" <<'PY'
import json, sys
root, names = sys.argv[1], sys.argv[2:]
def read(run):
    losses, val = [], None
    for line in open(f"{root}/{run}/metrics.jsonl"):
        r = json.loads(line)
        if "loss" in r: losses.append(r["loss"])
        if "val_loss" in r: val = r["val_loss"]
    return losses, val
one, one_val = read("one")
print(f"{'layout':10} {'steps':>5} {'last loss':>12} {'max rel diff (losses)':>22} {'val loss':>10} {'rel diff':>10}")
print(f"{'1 process':10} {len(one):5d} {one[-1]:12.6f} {'':>22} {one_val:10.6f}")
for n in names:
    l, v = read(n)
    d = max(abs(a - b) / abs(b) for a, b in zip(l, one))
    print(f"{n:10} {len(l):5d} {l[-1]:12.6f} {d:22.3g} {v:10.6f} {abs(v - one_val) / one_val:10.3g}")
PY
