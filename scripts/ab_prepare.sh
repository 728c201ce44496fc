#!/usr/bin/env bash
# Extracts a commit of this repository into ab_base/ (ignored by git) for scripts/gpu_check.sh's
# "ab" stage, which builds it on the GPU machine next to the working tree and times both on that
# machine — step times move by ±0.5 ms or more between machines, so a change is measured against
# its base on one machine, alternating. Usage, here:
#   scripts/ab_prepare.sh REV
# then, on the GPU machine (device tool, carry [".carry", "ab_base"]):
#   GPU_CHECK_STAGES="build test bench ab" scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: scripts/ab_prepare.sh REV}
commit=$(git rev-parse --verify "$rev^{commit}")
rm -rf ab_base
mkdir ab_base
git archive "$commit" | tar -x -C ab_base
ln -s ../.carry ab_base/.carry
echo "$commit" > ab_base/AB_REV
echo "ab_base/: $(git log -1 --format='%h %s' "$commit" | cut -c1-100)"
