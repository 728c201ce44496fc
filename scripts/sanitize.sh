#!/usr/bin/env bash
# The CPU test suite built with AddressSanitizer and UndefinedBehaviorSanitizer (-O1, line
# tables) in build-asan/; any report fails the test that triggered it. scripts/test.sh runs it
# after the Release suite. Usage: scripts/sanitize.sh [extra ctest arguments, e.g. -R Safetensors]
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
gen=(-G Ninja); [ -f build-asan/CMakeCache.txt ] && gen=()
cmake -S . -B build-asan "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DFLUX8_CUDA=OFF -DFLUX8_TESTS=ON \
  -DFLUX8_SANITIZE=address,undefined > /dev/null
cmake --build build-asan -j "$jobs"
export ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1:strict_init_order=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir build-asan --no-tests=error --output-on-failure -j "$jobs" "$@"
