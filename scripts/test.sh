#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run): installs dependencies, then
#   release  builds flux8 (Release) and its tests in build/ and runs CTest;
#   asan     the CPU suite built with AddressSanitizer + UndefinedBehaviorSanitizer in
#            build-asan/ (scripts/sanitize.sh);
#   fuzz     every fuzz target of tests/fuzz, $FLUX8_FUZZ_RUNS (default 30000) executions each
#            from a fixed seed and the seed corpora alone, so the stage gives the same verdict on
#            every run (scripts/fuzz.sh, build-fuzz/; longer, varying runs: scripts/fuzz.sh SECONDS).
# A stage that runs no test fails. Usage: scripts/test.sh [extra ctest arguments, e.g. -R Golden]
# (they apply to the release and asan stages); FLUX8_TEST_STAGES="release" runs only the named
# stages.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
jobs=$(nproc 2>/dev/null || echo 2)
stages=${FLUX8_TEST_STAGES:-release asan fuzz}

stage_timer() { echo "== stage $1: $((SECONDS - $2)) s"; }

if [[ " $stages " == *" release "* ]]; then
  start=$SECONDS
  # Ninja for a new build/; an existing one keeps the generator it was configured with (CMake
  # refuses to switch it). FLUX8_TESTS=ON: build/ may have been configured without the tests.
  gen=(-G Ninja); [ -f build/CMakeCache.txt ] && gen=()
  cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DFLUX8_TESTS=ON
  cmake --build build -j "$jobs"
  ctest --test-dir build --no-tests=error --output-on-failure -j "$jobs" "$@"
  stage_timer release "$start"
fi
if [[ " $stages " == *" asan "* ]]; then
  start=$SECONDS
  scripts/sanitize.sh "$@"
  stage_timer asan "$start"
fi
if [[ " $stages " == *" fuzz "* ]]; then
  start=$SECONDS
  # A fresh working corpus: inputs a local run found earlier would change what this one tries.
  rm -rf build-fuzz/corpus
  FLUX8_FUZZ_SEED=${FLUX8_FUZZ_SEED:-1} scripts/fuzz.sh "-runs=${FLUX8_FUZZ_RUNS:-30000}"
  stage_timer fuzz "$start"
fi
