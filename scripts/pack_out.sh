#!/usr/bin/env bash
# Packs a results folder down to what the device tool brings back: at most MAX files (default 8,
# the tool's limit; files in subfolders count). When there are more, the first MAX - 1 by
# usefulness stay as they are and the rest go into more.tar.gz beside them (and are removed):
# gpu_check.log, ctest.log, then *.txt, *.md, *.json, then everything else, each group by name.
#   scripts/pack_out.sh DIR [MAX]
set -euo pipefail
dir=${1:?usage: scripts/pack_out.sh DIR [MAX]}
max=${2:-8}
cd "$dir"
rank() {  # prints "rank<TAB>path" for a path
  case "$1" in
    gpu_check.log) echo 0 ;;
    ctest.log) echo 1 ;;
    *.txt) echo 2 ;;
    *.md) echo 3 ;;
    *.json) echo 4 ;;
    *) echo 5 ;;
  esac
}
mapfile -t files < <(find . -type f ! -name more.tar.gz | sed 's|^\./||' | while read -r f; do
  printf '%s\t%s\n' "$(rank "$f")" "$f"
done | sort -t $'\t' -k1,1n -k2,2 | cut -f2)
[ "${#files[@]}" -le "$max" ] && exit 0
rest=("${files[@]:$((max - 1))}")
tar czf more.tar.gz "${rest[@]}"
rm -f "${rest[@]}"
find . -mindepth 1 -type d -empty -delete
echo "pack_out: ${#rest[@]} of ${#files[@]} files packed into $dir/more.tar.gz (the device tool brings back $max)"
