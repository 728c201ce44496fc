#!/usr/bin/env bash
# Builds and checks flux8 on the GPU machine (Ubuntu 24.04, CUDA 13, no package registry),
# using the Debian packages that scripts/prepare_carry.sh unpacked into .carry/ here:
#   device run, carry [".carry"]:  scripts/gpu_check.sh
# Stages (GPU_CHECK_STAGES, default "info build test check demo bench"):
#   info   nvidia-smi, nvcc, compilers, CPU, Python packages, cuDNN/NCCL folders -> $OUT/env.txt
#   build  configure + build Release in build/ with every core against .carry (a no-op when
#          build/ is already up to date, e.g. a second call on a machine still warm)
#   launch (not a default stage) launch to first step, each process's start to the end of its
#          first step: W1 FP8 delayed + FP8 attention with an empty driver JIT cache
#          (CUDA_CACHE_PATH: cuDNN's attention kernels compile), then W1 and W2 with that cache,
#          then `flux8 train` on the demo config (its first_step event) -> $OUT/launch.txt; run it
#          right after build, before any other GPU process
#   test   the whole CTest suite, GPU conformance tests (label gpu) included -> $OUT/ctest.log
#          (Python checks are skipped, with a note, when python3 lacks numpy/safetensors/ml_dtypes)
#   check  `flux8 check` (GPU, versions, FP8 recipes here) -> $OUT/check.txt
#   disttrain (not a default stage) scripts/dist_train_check.sh on the GPU: the demo trained by one
#          rank, and by 2 or 4 ranks sharing GPU 0 (FLUX8_COMM=mpi) at DP=2, DP=2 with the
#          distributed optimizer, TP=2 and TP=2 x DP=2 -> $OUT/disttrain.txt
#   multigpu (not a default stage) tools/multi_gpu_check.py, the checks of a machine with several
#          GPUs (correctness over NCCL, data-parallel scaling, the big model at TP=2, a killed rank;
#          GPU_CHECK_MULTIGPU_ARGS adds options, e.g. --parts; no job runs past GPU_CHECK_DEADLINE,
#          the parts not begun are named) -> $OUT/multigpu.txt, multi_gpu.json, multigpu_logs.tar.gz
#   dist   (not a default stage) the GPU collective conformance suite (tests/gpu/dist) under the
#          build's mpiexec: one rank (NCCL and MPI staged through the host), two ranks sharing
#          GPU 0 with FLUX8_COMM=mpi, and, where the machine has several GPUs, one rank per GPU
#          with the default choice (NCCL) -> $OUT/dist.txt
#   bench  `flux8 bench`, the parts in GPU_CHECK_BENCH_PARTS (default "peer gemm steps profile"):
#            peer       first, the PyTorch peer on this GPU: diffusers and torchao installed from
#                       .carry/wheels (scripts/prepare_peer_wheels.sh) into a folder of their own
#                       (install_carried_wheels), then tools/peer_bench.py on W1 and W2 in its three modes
#                       (GPU_CHECK_PEER_ARGS adds options) -> $OUT/peer.json, peer.txt; the steps
#                       part then prints each run's ratios to it (--peer)
#            gemm       the FP8-linear vs cuBLASLt micro-benchmark
#            steps      W1, W2 x BF16 and the FP8 recipes (GPU_CHECK_BENCH_ARGS adds options)
#            profile    the per-op breakdown (--profile) of W1/W2 in BF16 and FP8 delayed, then FP8
#                       delayed with fp8_dot_product_attention (bench_profile_fp8_attention.*)
#            recompute  W1, W2 in BF16 and FP8 delayed with recompute_granularity selective, full
#            curve      a GPU_CHECK_CURVE_STEPS (500) step flux_535m loss curve in BF16 and FP8
#                       delayed hybrid on GPU_CHECK_CURVE_DATA (structured, or prototypes: the
#                       memorised set); ~90 s
#          -> $OUT/bench*.json, .txt
#   encode (not a default stage) tools/encode_throughput.py: tools/encode_dataset.py's images/s
#          at 1024 px with real-sized, randomly initialised encoders (the Flux VAE, T5 v1.1 XXL,
#          CLIP ViT-L/14, bf16), diffusers installed from .carry/wheels as for the peer bench part,
#          on GPU_CHECK_ENCODE_IMAGES (256) synthetic images, one pass for each batch of
#          GPU_CHECK_ENCODE_BATCH ("8,16") with each decoding-thread count of
#          GPU_CHECK_ENCODE_WORKERS ("4,<cores>"); GPU_CHECK_ENCODE_ARGS adds options; ~2 minutes,
#          bounded by GPU_CHECK_DEADLINE -> $OUT/encode_throughput.json, .txt
#   demo   the embedded demo trained on the GPU (configs/demo.yaml --set backend=cuda), in BF16
#          and FP8 (delayed, hybrid) -> $OUT/demo_*.log, metrics
#   ncu    Nsight Compute over one step (GPU_CHECK_NCU_ARGS, default W2 FP8 delayed + FP8
#          attention, `bench --steps 1 --warmup 0`), for each kernel-name regex in
#          GPU_CHECK_NCU_KERNELS (default "layernorm_modulate_backward qk_norm_rope cast_per_tensor
#          column_partials") its first GPU_CHECK_NCU_COUNT (60) launches with the SpeedOfLight,
#          Occupancy, LaunchStats, WarpStateStats and MemoryWorkloadAnalysis sections
#          -> $OUT/ncu_<regex>.txt, and scripts/ncu_summary.py's table of them -> $OUT/ncu_summary.txt
#          (GPU_CHECK_NCU_BIN: the ncu binary, default /usr/local/cuda/bin/ncu)
#   ab     the working tree against a base commit in the same call (scripts/ab_prepare.sh REV
#          made ab_base/; name it in carry): ab_base is built while the other stages run, then
#          GPU_CHECK_AB_ROUNDS (2; 0 skips the benchmarks and profiles) rounds alternate `flux8 bench --precision
#          ${GPU_CHECK_AB_PRECISION:-bf16,delayed} --steps 10 --warmup 3` of base and working tree,
#          and one --profile of each -> $OUT/ab_{base,new}.txt, ab_profile_{base,new}.txt, and
#          scripts/profile_diff.py's ops that moved (≥ 0.02 ms) -> $OUT/ab_profile_diff.txt;
#          GPU_CHECK_AB_ARGS adds arguments to each (e.g. --set fp8_dot_product_attention=true);
#          GPU_CHECK_AB_LAUNCH=N first alternates N cold launches of each (W1 FP8 + FP8 attention,
#          an empty JIT cache per process) -> $OUT/ab_launch.txt
#   table  scripts/fp8_demo_table.sh with the 9 trainings at once (FLUX8_TABLE_JOBS, default 9)
#          -> $OUT/fp8_table.md, $OUT/timings.tsv, $OUT/fp8_table_logs.tar.gz (logs, metrics.jsonl);
#          GPU_CHECK_TABLE_ARGS adds --set arguments (e.g. a short probe: --set train_iters=30)
#   converge (not a default stage) tools/convergence.py --tier w1 (flux_535m at W1's shape, 5000
#          steps a run) into runs/conv_w1 with GPU_CHECK_CONVERGE_ARGS (default: seeds 1,2,3, every
#          recipe and format), starting runs only while they can end before GPU_CHECK_DEADLINE; name
#          runs/conv_w1 in carry to go on from an earlier call's runs -> $OUT/converge.txt (the
#          table), $OUT/converge.tar.gz (runs/conv_w1: logs, bench.json curves, results.json)
# While the bench and ab stages run, nvidia-smi samples the SM clock, power and the reasons the
# GPU holds its clocks back every 100 ms -> $OUT/gpu_clocks.csv (each benchmark's start is marked
# with the time of day in gpu_check.log): step times drift up within a run of steps.
# Everything printed also goes to $OUT/gpu_check.log. More than 8 files under $OUT (the device
# tool's limit) leave gpu_check.log, ctest.log and the first *.txt/*.md/*.json as they are and
# pack the rest into $OUT/more.tar.gz. GPU_CHECK_DEADLINE (seconds from start, default 570)
# bounds the table, encode, converge and multigpu stages so that their partial results still
# come back before the device tool's 600 s limit. Any failure stops the script with a message and a
# non-zero status.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
: "${OUT:?OUT is not set: run this through the device tool (or set OUT=some/folder)}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
# The device tool brings back at most 8 files from $OUT: on any exit the less useful ones are
# packed into $OUT/more.tar.gz (scripts/pack_out.sh).
clock_monitor=
finish() {
  [ -z "$clock_monitor" ] || kill "$clock_monitor" 2>/dev/null || true
  scripts/pack_out.sh "$OUT" || true
}
trap finish EXIT
stages=${GPU_CHECK_STAGES:-info build test check demo bench}
deadline=${GPU_CHECK_DEADLINE:-570}
cores=$(nproc)
elapsed() { echo $(($(date +%s) - start)); }
die() { echo "GPU_CHECK FAILED ($(elapsed) s): $*" >&2; exit 1; }
stage() { echo; echo "=== $1 ($(elapsed) s) ==="; }
has() { [[ " $stages " == *" $1 "* ]]; }
mark() { echo "[$(date +%H:%M:%S.%N | cut -c1-12)] $*"; }
# The clock sampler (see above), started once; the newer field name first (driver >= 535).
monitor_clocks() {
  [ -z "$clock_monitor" ] && command -v nvidia-smi > /dev/null || return 0
  local q=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu
  if nvidia-smi --query-gpu=clocks_event_reasons.active --format=csv > /dev/null 2>&1; then
    q+=,clocks_event_reasons.active,clocks_event_reasons.sw_power_cap,clocks_event_reasons.hw_slowdown
  else
    q+=,clocks_throttle_reasons.active
  fi
  nvidia-smi --query-gpu="$q" --format=csv -lms 100 > "$OUT/gpu_clocks.csv" 2>&1 &
  clock_monitor=$!
}

source scripts/gpu_env.sh  # LD_LIBRARY_PATH for .carry, the cuDNN/NCCL wheels and the toolkit
carry=$flux8_carry
[ -d "$carry/include" ] || die ".carry/usr is missing: run scripts/prepare_carry.sh here and name .carry in carry"
python=$flux8_python
[ -n "$python" ] || die "no python3"
cudnn_root=$flux8_cudnn_root; nccl_root=$flux8_nccl_root
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
# A process's first step, FP8 + FP8 attention, with the driver's JIT cache in folder $3 (an empty
# one: as a fresh machine's first run): `BIN bench` of workload $2, 3 steps, no warm-up, and its
# result and "launch to first step" lines.
first_step() {  # $1: flux8 binary, $2: workload, $3: JIT cache folder
  CUDA_CACHE_PATH=$3 "$1" bench --workload "$2" --precision delayed --set fp8_dot_product_attention=true \
      --steps 3 --warmup 0 2>&1 | grep -E '^W|launch to first step:'
}

# The machine has no package registry: the wheels scripts/prepare_peer_wheels.sh put in
# .carry/wheels are installed, without their dependencies (the machine's Python has those), into
# a new folder of their own, wheel_site, to put on PYTHONPATH.
install_carried_wheels() {  # $@: the packages
  ls .carry/wheels/*.whl > /dev/null 2>&1 ||
    die "no .carry/wheels: run scripts/prepare_carry.sh here and name .carry in carry"
  wheel_site=$(mktemp -d)
  "$python" -m pip install -q --no-index --no-deps --no-compile --find-links .carry/wheels --target "$wheel_site" \
      "$@" || die "installing $* from .carry/wheels failed"
}

configure() {  # $1: source folder (its build/ folder is made)
  cmake -S "$1" -B "$1/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$carry" \
        -DFLUX8_EXTRA_PREFIX="$carry" -DPython3_EXECUTABLE="$python" -DFLUX8_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90a ${cudnn_root:+-DFLUX8_CUDNN_ROOT="$cudnn_root"} \
        ${nccl_root:+-DFLUX8_NCCL_ROOT="$nccl_root"}
}

if has ab; then  # the base's flux8 builds on a third of the cores while the other stages run
  [ -f ab_base/AB_REV ] || die "no ab_base/: run scripts/ab_prepare.sh REV here and name ab_base in carry"
  ( configure ab_base > "$OUT/ab_base_build.log" 2>&1 &&
      cmake --build ab_base/build -j $((cores / 3 + 1)) --target flux8 >> "$OUT/ab_base_build.log" 2>&1 ) &
  ab_build=$!
fi

if has info; then
  stage info
  {
    echo "## host"; uname -a; grep PRETTY_NAME /etc/os-release || true; echo "nproc: $cores"
    lscpu 2>/dev/null | grep -E '^(Model name|Socket|Core|Thread|CPU\(s\))' || true
    free -g 2>/dev/null | head -2 || true
    echo; echo "## nvidia-smi"; nvidia-smi || echo "nvidia-smi failed"
    echo; echo "## nvcc"; /usr/local/cuda/bin/nvcc --version || echo "no nvcc at /usr/local/cuda/bin"
    echo; echo "## compilers and tools"
    for t in c++ g++ gcc cmake ninja make; do printf '%s: ' "$t"; ("$t" --version 2>/dev/null | head -1) || echo missing; done
    echo; echo "## python: $python"; "$python" --version
    for m in numpy safetensors ml_dtypes torch; do
      "$python" -c "import $m; print('$m', getattr($m, '__version__', '?'))" 2>/dev/null || echo "$m: MISSING"
    done
    echo; echo "## cuDNN / NCCL (Python packages nvidia.cudnn, nvidia.nccl)"
    for m in cudnn nccl; do
      d=$("$python" -c "import nvidia.$m as m; print(list(m.__path__)[0])" 2>/dev/null) || { echo "nvidia.$m: MISSING"; continue; }
      echo "$m dir: $d"
      ls "$d" "$d/include" "$d/lib" 2>/dev/null | sed 's/^/  /'
    done
    echo; echo "## pip list"; "$python" -m pip list 2>/dev/null || true
  } > "$OUT/env.txt" 2>&1
  sed -n '/## host/,/## pip list/p' "$OUT/env.txt" | grep -vE '^  lib.*\.so' | head -80
fi

if has build; then
  stage build
  command -v c++ >/dev/null || die "no C++ compiler (c++) on this machine"
  if [ ! -f build/CMakeCache.txt ]; then
    configure . || die "cmake configure failed"
  fi
  cmake --build build -j "$cores" --target flux8 || die "build of flux8 failed"
  cmake --build build -j "$cores" || die "build of the tests failed"
  missing=$(ldd build/flux8 | grep 'not found' || true)
  [ -z "$missing" ] || die "build/flux8 cannot find shared libraries: $missing"
  ldd build/flux8 | grep -E 'openblas|yaml|fmt|png|gfortran|gomp|stdc|cudnn|cublas|nccl'
  build/flux8 --help > /dev/null || die "build/flux8 --help failed"
  echo "build done ($(elapsed) s)"
fi

if has launch; then
  # Before any other GPU process: the driver's JIT cache is then as a fresh machine's. Each run
  # gets a cache folder of its own (CUDA_CACHE_PATH), empty for the cold run and kept for the
  # warm one, so the cold figure does not depend on what ran here before.
  stage launch
  [ -x build/flux8 ] || die "no build/flux8: run the build stage"
  jit=$(mktemp -d)
  : > "$OUT/launch.txt"
  for run in "W1 cold" "W1 warm" "W2 warm"; do
    w=${run% *}
    echo "== $run (CUDA_CACHE_PATH $([ "${run#* }" = cold ] && echo empty || echo "of the cold run"))" >> "$OUT/launch.txt"
    first_step build/flux8 "$w" "$jit" >> "$OUT/launch.txt" || die "flux8 bench ($run) failed"
  done
  echo "== flux8 train on configs/demo.yaml, 3 steps (CUDA_CACHE_PATH empty)" >> "$OUT/launch.txt"
  rm -rf runs/gpu_launch_demo
  CUDA_CACHE_PATH=$(mktemp -d) build/flux8 train -c configs/demo.yaml --set backend=cuda \
      --set save_dir=runs/gpu_launch_demo --set train_iters=3 2>&1 | grep -E 'first step done' >> "$OUT/launch.txt" ||
    die "flux8 train (demo, 3 steps) failed or logged no first_step event"
  cat "$OUT/launch.txt"
fi

if has test; then
  stage test
  [ -x build/flux8_tests ] || die "no build/flux8_tests: run the build stage"
  ctest_args=(--test-dir build --output-on-failure -j "$cores" --timeout 300)
  if ! "$python" -c "import numpy, safetensors, ml_dtypes" 2>/dev/null; then
    echo "NOTE: $python lacks numpy/safetensors/ml_dtypes: skipping the Python checks (ctest -LE python)" |
      tee "$OUT/ctest.log"
    ctest_args+=(-LE python)
  fi
  set +e
  ctest "${ctest_args[@]}" 2>&1 | tee -a "$OUT/ctest.log" | grep -vE '^ *[0-9]+/[0-9]+ Test +#[0-9]+: .* Passed'
  rc=${PIPESTATUS[0]}
  set -e
  # Later stages still run (their logs help); the script fails at the end.
  [ "$rc" -eq 0 ] || { echo "CTEST FAILED (status $rc): see ctest.log"; test_failed=1; }
fi

if has check; then
  stage check
  build/flux8 check | tee "$OUT/check.txt" || die "flux8 check says the CUDA backend cannot run here"
fi

if has dist; then
  stage dist
  [ -x build/flux8_gpu_dist_tests ] || die "no build/flux8_gpu_dist_tests: run the build stage"
  mpiexec=$(sed -n 's/^MPIEXEC_EXECUTABLE:FILEPATH=//p' build/CMakeCache.txt)
  [ -x "$mpiexec" ] || die "build/CMakeCache.txt names no mpiexec (MPIEXEC_EXECUTABLE): the build found no Open MPI"
  # (The GPU machine's own Open MPI, 4.1.6, with which the build stage found MPI.)
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  : > "$OUT/dist.txt"
  dist_run() {  # $1: what, then the environment and mpiexec's arguments
    local what=$1 log rc; shift
    log=$(mktemp)
    set +e
    env "$@" build/flux8_gpu_dist_tests --gtest_color=no > "$log" 2>&1
    rc=$?
    set -e
    { echo "== $what"; cat "$log"; } >> "$OUT/dist.txt"
    echo "$what: $(grep -cE '^\[ +OK \]' "$log") passed, $(grep -cE '^\[ +SKIPPED \] .*\(' "$log") skipped," \
         "$(grep -cE '^\[ +FAILED +\] .*\(' "$log") failed (rank 0's count)"
    # (|| true: with nothing skipped grep finds nothing, which must not end the script)
    { grep -A1 ': Skipped$' "$log" | grep -vE ': Skipped$|^--$' | sort | uniq -c | sed 's/^/  skipped: /'; } || true
    [ "$rc" -eq 0 ] || { grep -E 'FAILED|Failure' "$log" | head -20; die "the GPU collective tests ($what) failed: see dist.txt"; }
  }
  dist_run "one rank: NCCL and host-staged MPI" "$mpiexec" -np 1
  dist_run "two ranks on GPU 0, FLUX8_COMM=mpi" FLUX8_COMM=mpi "$mpiexec" -np 2 --oversubscribe
  if [ "${gpus:-0}" -ge 2 ]; then
    dist_run "$gpus ranks, one per GPU (NCCL)" "$mpiexec" -np "$gpus"
  fi
fi

if has disttrain; then
  stage disttrain
  scripts/dist_train_check.sh cuda "${GPU_CHECK_DISTTRAIN_STEPS:-20}" | tee "$OUT/disttrain.txt" ||
    die "the distributed training check failed (runs/dist_check.*.log)"
fi

if has multigpu; then
  stage multigpu
  [ -x build/flux8 ] || die "no build/flux8: run the build stage"
  mpiexec=$(sed -n 's/^MPIEXEC_EXECUTABLE:FILEPATH=//p' build/CMakeCache.txt)
  [ -x "$mpiexec" ] || die "build/CMakeCache.txt names no mpiexec (MPIEXEC_EXECUTABLE): the build found no Open MPI"
  left=$((deadline - $(elapsed) - 15))
  set +e
  # shellcheck disable=SC2086  # GPU_CHECK_MULTIGPU_ARGS: the tool's options, split into words
  PYTHONUNBUFFERED=1 "$python" tools/multi_gpu_check.py --flux8 build/flux8 --mpirun "$mpiexec" \
      --out runs/multi_gpu --deadline "$left" ${GPU_CHECK_MULTIGPU_ARGS:-} 2>&1 | tee "$OUT/multigpu.txt"
  rc=${PIPESTATUS[0]}
  set -e
  cp runs/multi_gpu/multi_gpu.json "$OUT/" 2>/dev/null || true
  tar czf "$OUT/multigpu_logs.tar.gz" -C runs/multi_gpu logs 2>/dev/null || true
  case $rc in
    0) ;;
    3) echo "multigpu: parts left for want of time (above): call again with GPU_CHECK_MULTIGPU_ARGS=--parts ..." ;;
    *) die "tools/multi_gpu_check.py: a check not met or a job failed (status $rc): see multigpu.txt" ;;
  esac
fi

if has demo; then
  stage demo
  for run in bf16 fp8_delayed_hybrid; do
    args=(--set backend=cuda --set save_dir=runs/gpu_demo_$run)
    [ "$run" = bf16 ] || args+=(--set fp8=hybrid --set fp8_recipe=delayed)
    rm -rf "runs/gpu_demo_$run"
    t0=$(date +%s.%N)
    build/flux8 train -c configs/demo.yaml "${args[@]}" ${GPU_CHECK_DEMO_ARGS:-} > "$OUT/demo_$run.log" 2>&1 ||
      { tail -20 "$OUT/demo_$run.log"; die "demo training ($run) on the GPU failed: see demo_$run.log"; }
    echo "demo $run: $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s; $(grep -o 'validation loss [0-9.]* -> [0-9.]*' "$OUT/demo_$run.log")"
    cp "runs/gpu_demo_$run/metrics.jsonl" "$OUT/demo_${run}_metrics.jsonl" 2>/dev/null || true
  done
  cp runs/gpu_demo_bf16/samples*.png "$OUT/" 2>/dev/null || true
fi

if has bench; then
  stage bench
  monitor_clocks
  parts=${GPU_CHECK_BENCH_PARTS:-peer gemm steps profile}
  peer_args=()
  if [[ " $parts " == *" peer "* ]]; then
    mark "bench peer"
    install_carried_wheels diffusers torchao
    # shellcheck disable=SC2086  # GPU_CHECK_PEER_ARGS: extra options, split into words
    PYTHONPATH=$wheel_site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 "$python" tools/peer_bench.py \
        --workload W1,W2 --out "$OUT/peer.json" ${GPU_CHECK_PEER_ARGS:-} 2>&1 | tee "$OUT/peer.txt" ||
      die "tools/peer_bench.py failed: see peer.txt"
    peer_args=(--peer "$OUT/peer.json")
  fi
  if [[ " $parts " == *" gemm "* ]]; then
    build/flux8 bench --gemm --steps 20 --json "$OUT/bench_gemm.json" 2>&1 | tee "$OUT/bench_gemm.txt" ||
      die "flux8 bench --gemm failed"
  fi
  if [[ " $parts " == *" steps "* ]]; then
    mark "bench steps"
    build/flux8 bench ${GPU_CHECK_BENCH_ARGS:-} "${peer_args[@]}" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" ||
      die "flux8 bench failed"
  fi
  if [[ " $parts " == *" profile "* ]]; then
    mark "bench profile"
    build/flux8 bench --precision bf16,delayed --profile --steps 3 --warmup 2 --json "$OUT/bench_profile.json" 2>&1 |
      tee "$OUT/bench_profile.txt" || die "flux8 bench --profile failed"
    build/flux8 bench --precision delayed --set fp8_dot_product_attention=true --profile --steps 3 --warmup 2 \
        --json "$OUT/bench_profile_fp8_attention.json" 2>&1 | tee "$OUT/bench_profile_fp8_attention.txt" ||
      die "flux8 bench --profile with FP8 attention failed"
  fi
  if [[ " $parts " == *" recompute "* ]]; then
    for policy in selective full; do
      build/flux8 bench --precision bf16,delayed --set recompute_granularity=$policy --steps 5 --warmup 2 \
          --json "$OUT/bench_recompute_$policy.json" 2>&1 | tee "$OUT/bench_recompute_$policy.txt" ||
        die "flux8 bench with recompute_granularity=$policy failed"
    done
  fi
  if [[ " $parts " == *" curve "* ]]; then
    build/flux8 bench --workload W1 --precision bf16,delayed --warmup 0 --steps "${GPU_CHECK_CURVE_STEPS:-500}" \
        --data "${GPU_CHECK_CURVE_DATA:-structured}" --json "$OUT/bench_curve.json" 2>&1 |
      tee "$OUT/bench_curve.txt" || die "the W1 loss-curve run failed"
  fi
fi

if has encode; then
  stage encode
  install_carried_wheels diffusers
  left=$((deadline - $(elapsed)))
  [ "$left" -gt 60 ] || die "only $left s left before GPU_CHECK_DEADLINE=$deadline: no time for the encode stage"
  # shellcheck disable=SC2086  # GPU_CHECK_ENCODE_ARGS: extra options, split into words
  PYTHONPATH=$wheel_site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 timeout -k 10 "$left" "$python" \
      tools/encode_throughput.py --json "$OUT/encode_throughput.json" --images "${GPU_CHECK_ENCODE_IMAGES:-256}" \
      --batch "${GPU_CHECK_ENCODE_BATCH:-8,16}" --workers "${GPU_CHECK_ENCODE_WORKERS:-4,$cores}" \
      ${GPU_CHECK_ENCODE_ARGS:-} 2>&1 | tee "$OUT/encode_throughput.txt" ||
    die "tools/encode_throughput.py failed or ran past $left s: see encode_throughput.txt (the JSON keeps the passes done)"
fi

if has ncu; then
  stage ncu
  [ -x build/flux8 ] || die "no build/flux8: run the build stage"
  ncu_bin=${GPU_CHECK_NCU_BIN:-/usr/local/cuda/bin/ncu}
  [ -x "$ncu_bin" ] || die "no Nsight Compute at $ncu_bin (set GPU_CHECK_NCU_BIN)"
  ncu_args=${GPU_CHECK_NCU_ARGS:-"bench --workload W2 --precision delayed --set fp8_dot_product_attention=true --steps 1 --warmup 0"}
  : > "$OUT/ncu_summary.txt"
  for regex in ${GPU_CHECK_NCU_KERNELS:-layernorm_modulate_backward qk_norm_rope cast_per_tensor column_partials}; do
    report="$OUT/ncu_$(echo "$regex" | tr -c 'A-Za-z0-9_\n' '_').txt"
    mark "ncu $regex"
    # shellcheck disable=SC2086  # ncu_args: the flux8 command line, split into words
    "$ncu_bin" --kernel-name "regex:$regex" --launch-count "${GPU_CHECK_NCU_COUNT:-60}" --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        build/flux8 $ncu_args > "$report" 2>&1 || { tail -5 "$report"; die "ncu on '$regex' failed: see $report"; }
    # (the group's status is ncu_summary.py's: it fails when no kernel matched)
    { echo "## $regex ($ncu_args)"; "$python" scripts/ncu_summary.py "$report" && echo; } | tee -a "$OUT/ncu_summary.txt" ||
      die "no kernel matched '$regex': see $report"
  done
fi

if has ab; then
  stage ab
  monitor_clocks
  [ -x build/flux8 ] || die "no build/flux8: run the build stage"
  wait "$ab_build" || { tail -20 "$OUT/ab_base_build.log"; die "the build of ab_base failed: see ab_base_build.log"; }
  echo "base: $(cat ab_base/AB_REV); new: the working tree"
  ab_args=${GPU_CHECK_AB_ARGS:-}  # e.g. "--set fp8_dot_product_attention=true" (word-split on purpose)
  # Cold launches, alternating: each process with an empty JIT cache of its own, as a fresh
  # machine's first run (its first step compiles cuDNN's attention kernels).
  for round in $(seq "${GPU_CHECK_AB_LAUNCH:-0}"); do
    for side in base new; do
      bin=build/flux8; [ "$side" = base ] && bin=ab_base/build/flux8
      echo "--- cold launch, round $round, $side" >> "$OUT/ab_launch.txt"
      first_step "$bin" W1 "$(mktemp -d)" | grep 'launch to first step:' >> "$OUT/ab_launch.txt" ||
        die "flux8 bench (cold launch, $side) failed"
    done
  done
  [ -f "$OUT/ab_launch.txt" ] && cat "$OUT/ab_launch.txt"
  for round in $(seq "${GPU_CHECK_AB_ROUNDS:-2}"); do
    for side in base new; do
      bin=build/flux8; [ "$side" = base ] && bin=ab_base/build/flux8
      mark "--- round $round, $side"
      "$bin" bench --precision "${GPU_CHECK_AB_PRECISION:-bf16,delayed}" --steps 10 --warmup 3 $ab_args 2>&1 |
        tee -a "$OUT/ab_$side.txt" || die "flux8 bench ($side) failed"
    done
  done
  [ "${GPU_CHECK_AB_ROUNDS:-2}" -gt 0 ] && for side in base new; do  # 0 rounds: the launches alone
    bin=build/flux8; [ "$side" = base ] && bin=ab_base/build/flux8
    "$bin" bench --precision "${GPU_CHECK_AB_PRECISION:-bf16,delayed}" --profile --steps 3 --warmup 2 $ab_args \
        > "$OUT/ab_profile_$side.txt" 2>&1 || die "flux8 bench --profile ($side) failed"
  done
  if [ -f "$OUT/ab_profile_new.txt" ]; then
    echo "per-op profiles: ab_profile_base.txt, ab_profile_new.txt; what moved (ab_profile_diff.txt):"
    "$python" scripts/profile_diff.py "$OUT/ab_profile_base.txt" "$OUT/ab_profile_new.txt" |
      tee "$OUT/ab_profile_diff.txt" || die "scripts/profile_diff.py failed on the ab profiles"
  fi
fi

if has table; then
  stage table
  [ -x build/flux8 ] || die "no build/flux8: run the build stage"
  left=$((deadline - $(elapsed)))
  [ "$left" -gt 20 ] || die "only $left s left before GPU_CHECK_DEADLINE=$deadline: no time for the table"
  echo "table: ${FLUX8_TABLE_JOBS:-9} runs at once on $cores cores, at most $left s"
  rm -rf runs/fp8_table
  set +e
  # shellcheck disable=SC2086  # GPU_CHECK_TABLE_ARGS: extra --set arguments, split into words
  FLUX8_TABLE_JOBS=${FLUX8_TABLE_JOBS:-9} timeout -k 15 "$left" scripts/fp8_demo_table.sh build/flux8 \
      ${GPU_CHECK_TABLE_ARGS:-} > "$OUT/fp8_table.md"
  rc=$?
  set -e
  cp runs/fp8_table/timings.tsv "$OUT/" 2>/dev/null || true
  tar czf "$OUT/fp8_table_logs.tar.gz" runs/fp8_table/*.log runs/fp8_table/timings.tsv runs/fp8_table/*/metrics.jsonl 2>/dev/null || true
  cat "$OUT/fp8_table.md"
  column -t "$OUT/timings.tsv" 2>/dev/null || true
  if [ "$rc" -ne 0 ]; then
    for f in runs/fp8_table/*.log; do echo "--- $f"; tail -3 "$f"; done
    [ "$rc" -eq 124 ] && die "the table did not finish in $left s (partial logs in fp8_table_logs.tar.gz)"
    die "scripts/fp8_demo_table.sh failed (status $rc)"
  fi
fi
if has converge; then
  stage converge
  [ -x build/flux8 ] || die "no build/flux8: run the build stage"
  left=$((deadline - $(elapsed) - 10))
  [ "$left" -gt 60 ] || die "only $left s left before GPU_CHECK_DEADLINE=$deadline: no time for a convergence run"
  set +e
  # shellcheck disable=SC2086  # GPU_CHECK_CONVERGE_ARGS: harness options, split into words
  PYTHONUNBUFFERED=1 timeout -k 10 "$((left + 5))" "$python" tools/convergence.py --tier w1 --out runs/conv_w1 \
      --no-plots --time-budget "$left" ${GPU_CHECK_CONVERGE_ARGS:---seeds 1,2,3} 2>&1 | tee "$OUT/converge.txt"
  rc=${PIPESTATUS[0]}
  set -e
  tar czf "$OUT/converge.tar.gz" runs/conv_w1 2>/dev/null || true
  case $rc in
    0) ;;
    3) echo "converge: runs are left (above); call again with runs/conv_w1 carried" ;;
    *) die "tools/convergence.py failed (status $rc): see converge.txt" ;;
  esac
fi
[ "${test_failed:-0}" -eq 0 ] || die "ctest failed: see ctest.log"
echo; echo "GPU_CHECK OK ($(elapsed) s)"
