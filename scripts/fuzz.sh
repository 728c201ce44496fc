#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz in build-fuzz/ (clang 16 or newer, AddressSanitizer
# and UndefinedBehaviorSanitizer) and runs each from its seed corpus, then prints executions per
# target. Exits 1 on any finding: a crash, a sanitizer report, an escaped exception, a timeout or
# an oversized allocation; the input that caused it is saved in build-fuzz/findings/<target>/.
# Usage: scripts/fuzz.sh [SECONDS per target (default 60) | -runs=N] [target...]
#   scripts/fuzz.sh 600                 ten minutes per target
#   scripts/fuzz.sh -runs=1000000 npy   one target, a fixed number of executions
# FLUX8_FUZZ_SEED=S fixes libFuzzer's random seed: with -runs=N a run is then the same inputs
# every time (CI's stage, so that it cannot fail at random), given the same corpus directories.
# Reproduce a finding: build-fuzz/fuzz/fuzz_<target> build-fuzz/findings/<target>/crash-...
set -euo pipefail
cd "$(dirname "$0")/.."

budget=-max_total_time=60
if (($#)); then
  case "$1" in
    -runs=*) budget=$1; shift ;;
    [0-9]*) budget=-max_total_time=$1; shift ;;
  esac
fi
targets=("$@")
if ((${#targets[@]} == 0)); then
  for f in tests/fuzz/fuzz_*.cpp; do t=${f#tests/fuzz/fuzz_}; targets+=("${t%.cpp}"); done
fi

# clang 14 and 15 lack C++20 features flux8 uses (lambdas capturing structured bindings).
cxx=${FLUX8_FUZZ_CXX:-}
if [ -z "$cxx" ]; then
  for v in 21 20 19 18 17 16; do
    if command -v "clang++-$v" > /dev/null; then cxx=clang++-$v; break; fi
  done
fi
if [ -z "$cxx" ]; then
  echo "fuzz.sh: no clang++ 16 or newer found; scripts/install_deps.sh installs one (or set FLUX8_FUZZ_CXX)" >&2
  exit 1
fi

jobs=$(nproc 2>/dev/null || echo 2)
gen=(-G Ninja); [ -f build-fuzz/CMakeCache.txt ] && gen=()
cmake -S . -B build-fuzz "${gen[@]}" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -DNDEBUG" -DFLUX8_CUDA=OFF -DFLUX8_TESTS=OFF -DFLUX8_FUZZ=ON > /dev/null
cmake --build build-fuzz -j "$jobs" --target flux8_fuzzers

export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
failed=()
summary=()
for t in "${targets[@]}"; do
  bin=build-fuzz/fuzz/fuzz_$t
  [ -x "$bin" ] || { echo "fuzz.sh: no fuzz target '$t' ($bin)" >&2; exit 1; }
  # New inputs go to the working corpus (first directory); the seeds in the repository stay.
  work=build-fuzz/corpus/$t findings=build-fuzz/findings/$t log=build-fuzz/logs/$t.log
  mkdir -p "$work" "$findings" build-fuzz/logs
  args=("$budget" ${FLUX8_FUZZ_SEED:+-seed=$FLUX8_FUZZ_SEED} -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 -print_final_stats=1
        -artifact_prefix="$findings/")
  case $t in
    checkpoint_json) args+=(-dict=tests/fuzz/dict/json.dict) ;;
    webdataset) args+=(-dict=tests/fuzz/dict/tar.dict) ;;
    *) args+=(-dict=tests/fuzz/dict/$t.dict) ;;
  esac
  echo "== fuzz_$t ($budget)"
  rc=0
  "$bin" "${args[@]}" "$work" "tests/fuzz/corpus/$t" > "$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  line="fuzz_$t: ${execs:-?} executions, ${rate:-?} exec/s"
  if ((rc != 0)); then
    failed+=("$t")
    line+=", FINDING (exit $rc): $(ls -t "$findings" | head -1) — see $log"
    grep -m1 -E "^==[0-9]+==ERROR|^SUMMARY|runtime error|finding:|terminate called|what\(\)" "$log" || tail -20 "$log"
  fi
  summary+=("$line")
  echo "$line"
done

echo "== summary"
printf '%s\n' "${summary[@]}"
if ((${#failed[@]})); then
  echo "fuzz.sh: findings in: ${failed[*]} (inputs in build-fuzz/findings/)" >&2
  exit 1
fi
