#!/usr/bin/env bash
# Installs dependencies, builds flux8 and trains the embedded demo (a 1M-parameter pixel-space
# Flux model drawing coloured shapes from captions) on the CPU, then prints where the sample
# grid is. Extra arguments go to `flux8 train` (e.g. --set train_iters=1200).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
jobs=$(nproc 2>/dev/null || echo 2)
# Ninja for a new build/; an existing one keeps the generator it was configured with (CMake
# refuses to switch it). build/ is shared with scripts/test.sh: the configuration leaves
# FLUX8_TESTS as it is and only the flux8 target is built, so neither script undoes the other.
gen=(-G Ninja); [ -f build/CMakeCache.txt ] && gen=()
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j "$jobs" --target flux8
build/flux8 train -c configs/demo.yaml "$@"
echo "sample grid: runs/demo/samples.png   metrics: runs/demo/metrics.jsonl   checkpoints: runs/demo/step-*"
