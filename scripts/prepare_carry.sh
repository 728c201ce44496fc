#!/usr/bin/env bash
# Builds .carry/: the Debian 12 packages flux8 needs to build and run on a machine without a
# package registry (the GPU machine, Ubuntu 24.04). Run it here, on Debian 12, with apt's
# package lists present; it downloads the .deb files (apt-get download, no root needed) and
# unpacks them with dpkg -x into .carry/ (ignored by git), then trims docs and static libraries
# nobody links, makes every symbolic link relative, and adds the links Debian's
# update-alternatives would make for OpenBLAS. scripts/gpu_check.sh builds against it with
#   cmake -DCMAKE_PREFIX_PATH=$PWD/.carry/usr -DFLUX8_EXTRA_PREFIX=$PWD/.carry/usr
# and runs with LD_LIBRARY_PATH=.carry/usr/lib/x86_64-linux-gnu{,/openblas-pthread}.
# Then scripts/prepare_peer_wheels.sh adds .carry/wheels/: the Python wheels of the PyTorch peer
# (tools/peer_bench.py) that gpu_check.sh's bench stage installs there.
# Usage: scripts/prepare_carry.sh   (safe to run again: it rebuilds .carry/ from scratch)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(libyaml-cpp-dev libyaml-cpp0.7 libfmt-dev libfmt9 libcli11-dev nlohmann-json3-dev
          libopenblas-dev libopenblas0 libopenblas0-pthread libopenblas-pthread-dev
          libgfortran5 libquadmath0 libgtest-dev libpng-dev libpng16-16 zlib1g-dev zlib1g)
max_mib=60  # the device tool carries 64 MiB at most, with the working tree

command -v apt-get >/dev/null && command -v dpkg >/dev/null || { echo "needs apt-get and dpkg (Debian)" >&2; exit 1; }
arch=$(dpkg --print-architecture)
[ "$arch" = amd64 ] || { echo "this machine is $arch; the GPU machine is amd64" >&2; exit 1; }

debs=$(mktemp -d)
trap 'rm -rf "$debs"' EXIT
(cd "$debs" && apt-get download -q "${packages[@]}") || {
  echo "apt-get download failed (run 'apt-get update' first if the package lists are missing)" >&2; exit 1; }

rm -rf .carry
mkdir -p .carry
for f in "$debs"/*.deb; do
  dpkg -x "$f" .carry
  dpkg-deb -f "$f" Package Version | paste -sd' ' >> .carry/PACKAGES
done

root=.carry/usr
lib=$root/lib/x86_64-linux-gnu
# Debian's alternatives (made by postinst, which dpkg -x does not run) point the generic names at
# the pthread OpenBLAS; make them here, relative.
for name in libopenblas.so libopenblas.so.0 libblas.so libblas.so.3; do
  if [ -e "$lib/openblas-pthread/$name" ] && [ ! -e "$lib/$name" ]; then
    ln -s "openblas-pthread/$name" "$lib/$name"
  fi
done

# Trim: documentation, manuals, LAPACK (flux8 uses only CBLAS) and the static BLAS archives.
rm -rf .carry/usr/share/doc .carry/usr/share/man .carry/usr/share/lintian .carry/usr/share/info
rm -f "$lib"/openblas-pthread/liblapack.*
find .carry \( -name 'libopenblas*.a' -o -name 'libblas.a' -o -name 'liblapack.a' \) -delete
# The GoogleTest sources (googletest package) are only for building it from source: drop them.
rm -rf .carry/usr/src

# Make every absolute symbolic link relative (an absolute one would point into the GPU machine's /).
carry_abs=$(cd .carry && pwd)
while IFS= read -r link; do
  target=$(readlink "$link")
  case $target in
    /*) dir=$(dirname "$link")
        rel=$(realpath -m --relative-to="$dir" "$carry_abs$target")
        ln -sfn "$rel" "$link" ;;
  esac
done < <(find .carry -type l)

# Every link must resolve inside .carry.
bad=0
while IFS= read -r link; do
  if [ ! -e "$link" ]; then echo "dangling link: $link -> $(readlink "$link")" >&2; bad=1; fi
  case $(readlink "$link") in /*) echo "absolute link left: $link" >&2; bad=1 ;; esac
done < <(find .carry -type l)
[ "$bad" -eq 0 ] || exit 1

# The CMake package files flux8 loads must locate themselves, not name this machine's /usr (the
# generated ones compare against /usr only to handle a /lib -> /usr/lib link: those lines are fine;
# OpenBLASConfig.cmake does name /usr, but flux8 finds OpenBLAS with FindBLAS, not through it).
if grep -rnE '/usr/(include|lib)' "$lib"/cmake .carry/usr/share/cmake* 2>/dev/null |
     grep -vE '_realOrig|_IMPORT_PREFIX "/usr/lib/x86_64-linux-gnu/cmake/|^[^:]*:[0-9]+:#'; then
  echo "the CMake package files above hard-code /usr paths" >&2; exit 1
fi

scripts/prepare_peer_wheels.sh

size_mib=$(du -sm .carry | cut -f1)
echo "packages: $(wc -l < .carry/PACKAGES), .carry: ${size_mib} MiB"
[ "$size_mib" -le "$max_mib" ] || { echo ".carry is ${size_mib} MiB, over the ${max_mib} MiB allowed" >&2; exit 1; }
