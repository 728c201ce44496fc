#!/usr/bin/env bash
# The whole test suite: installs dependencies, builds flux8 (Release) in build/, runs CTest.
# Usage: scripts/test.sh [extra ctest arguments, e.g. -R Golden]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
jobs=$(nproc 2>/dev/null || echo 2)
# Ninja for a new build/; an existing one keeps the generator it was configured with (CMake
# refuses to switch it).
gen=(-G Ninja); [ -f build/CMakeCache.txt ] && gen=()
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs" "$@"
