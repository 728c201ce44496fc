#!/usr/bin/env bash
# Downloads into .carry/wheels/ the wheels tools/peer_bench.py needs on the lent GPU machine,
# which has PyTorch 2.11 and diffusers' own dependencies (huggingface_hub, safetensors, Pillow,
# regex, PyYAML) but no package registry:
#   diffusers  pure Python (py3-none-any);
#   torchao    has no pure-Python wheel: one build for CPython >= 3.10 (abi3) on manylinux x86_64,
#              whose compiled extensions load with torch >= 2.11 only (its float8 training is
#              Python over torch._scaled_mm and does not need them).
# --no-deps: nothing else travels. scripts/gpu_check.sh's bench stage installs them with
# `pip install --no-index --find-links .carry/wheels` into a folder of its own (PYTHONPATH).
# Usage: scripts/prepare_peer_wheels.sh   (scripts/prepare_carry.sh runs it after the packages)
set -euo pipefail
cd "$(dirname "$0")/.."

wheels=(diffusers==0.42.1 torchao==0.18.0)
python=$(command -v python3) || { echo "needs python3 with pip" >&2; exit 1; }
rm -rf .carry/wheels
mkdir -p .carry/wheels
# The GPU machine's interpreter: CPython 3.12 on x86_64 Linux (glibc 2.39).
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .carry/wheels "${wheels[@]}" ||
  { echo "pip download of ${wheels[*]} failed (PyPI reachable?)" >&2; exit 1; }
[ "$(find .carry/wheels -name '*.whl' | wc -l)" -eq "${#wheels[@]}" ] ||
  { echo "expected ${#wheels[@]} wheels in .carry/wheels, found: $(find .carry/wheels -type f -printf "%f ")" >&2; exit 1; }
echo "peer wheels: $(find .carry/wheels -name '*.whl' -printf '%f ')($(du -sm .carry/wheels | cut -f1) MiB)"
