#!/usr/bin/env bash
# The demo's FP8 table (docs/FP8.md): tools/convergence.py's demo tier with this script's
# defaults: the CPU backend (the FP8 reference emulation; a later `--set backend=auto` argument
# moves it to a GPU), BF16 and every recipe x format, printing the markdown table.
# Usage: scripts/fp8_demo_table.sh [build/flux8] [extra --set arguments...]
# Environment: FLUX8_TABLE_SEEDS (default 1234; e.g. 1234,7,42 for mean ± std and intervals),
# FLUX8_TABLE_JOBS runs at once (default 1), FLUX8_TABLE_THREADS threads each (default
# max(1, cores / jobs); results do not depend on the thread count), FLUX8_TABLE_OUT the output
# folder (default runs/fp8_table: each run's <variant>_seed<S>.log and folder, timings.tsv,
# results.json, table.md, and curves.png where matplotlib is installed).
# A finished run in the output folder is reused; see `python3 tools/convergence.py --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/flux8}
shift || true
args=(--tier demo --flux8 "$bin" --out "${FLUX8_TABLE_OUT:-runs/fp8_table}" --seeds "${FLUX8_TABLE_SEEDS:-1234}"
      --jobs "${FLUX8_TABLE_JOBS:-1}" --set backend=cpu)
[ -n "${FLUX8_TABLE_THREADS:-}" ] && args+=(--threads "$FLUX8_TABLE_THREADS")
if ! python3 -c "import matplotlib" 2>/dev/null; then
  echo "note: no matplotlib here: the table without curves.png (plot it elsewhere with tools/convergence.py --plot-from)" >&2
  args+=(--no-plots)
fi
exec python3 tools/convergence.py "${args[@]}" "$@"
