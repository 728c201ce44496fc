#!/usr/bin/env bash
# Installs what flux8 needs to build and test on Debian/Ubuntu: a C++20 compiler, CMake, Ninja,
# OpenBLAS, yaml-cpp, nlohmann-json, CLI11, fmt, libpng, GoogleTest, clang with libFuzzer (the
# fuzz targets); and the Python packages the interop and encoder tests use (numpy, safetensors,
# torch, diffusers, transformers). Safe to run again: installed packages are skipped.
set -euo pipefail

packages=(build-essential cmake ninja-build pkg-config libopenblas-dev libyaml-cpp-dev
          nlohmann-json3-dev libcli11-dev libfmt-dev libpng-dev libgtest-dev python3 python3-pip
          libopenmpi-dev openmpi-bin)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  echo "installing: ${missing[*]}"
  $sudo_cmd apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# clang 16 or newer, with libFuzzer and OpenMP, for the fuzz targets (scripts/fuzz.sh): clang 14
# and 15 lack C++20 features flux8 uses. libFuzzer (libclang_rt.fuzzer-*.a) ships in
# libclang-rt-N-dev on Debian 12 and Ubuntu 24.04, in libclang-common-N-dev on older releases.
have_clang=""
for v in 21 20 19 18 17 16; do
  if command -v "clang++-$v" > /dev/null &&
     compgen -G "$(clang++-$v -print-resource-dir)/lib/*/libclang_rt.fuzzer*.a" > /dev/null; then
    have_clang=$v; break
  fi
done
if [ -z "$have_clang" ]; then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -q
  for v in 19 18 17 16; do
    if apt-cache show "clang-$v" > /dev/null 2>&1; then
      clang_packages=("clang-$v" "libomp-$v-dev")
      apt-cache show "libclang-rt-$v-dev" > /dev/null 2>&1 && clang_packages+=("libclang-rt-$v-dev")
      echo "installing: ${clang_packages[*]}"
      DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q --no-install-recommends "${clang_packages[@]}"
      break
    fi
  done
fi

# ml_dtypes 0.7.x: the E8M0 reference that tests/python/test_fp8_ml_dtypes.py compares with,
# checked against flux8 over all 2^32 f32 inputs. 0.7 changed how f32 subnormals round (older
# copies are upgraded); the pin keeps a later release's rule change from failing CI unannounced.
# tensorboard's event reader and mlperf-logging's compliance checker (with the 6.1.0 training
# rules) read back what tests/python/test_tensorboard.py's run writes. torch, diffusers,
# transformers (with tokenizers) and Pillow: the encoders of tools/encode_dataset.py,
# tools/encode_prompts.py and tools/decode_latents.py, which tests/python/test_encode_to_picture.py
# runs with tiny models. matplotlib: the curves of tools/convergence.py (tests/python/test_convergence.py).
# PyPI's torch for Linux brings its CUDA libraries along (a few GB); there is
# no CPU-only torch on PyPI.
python_packages=(numpy safetensors "ml_dtypes>=0.7,<0.8" tensorboard "mlperf-logging>=4.1.68" torch diffusers
                 transformers tokenizers pillow matplotlib)
if ! python3 -c "import numpy, safetensors, ml_dtypes, tensorboard, os, sys, mlperf_logging.compliance_checker as c
import torch, diffusers, transformers, tokenizers, PIL, matplotlib
sys.exit(not os.path.isdir(os.path.join(os.path.dirname(c.__file__), 'training_6.1.0')) or
         tuple(int(p) for p in ml_dtypes.__version__.split('.')[:2]) != (0, 7))" 2>/dev/null; then
  echo "installing Python packages: ${python_packages[*]}"
  python3 -m pip install -q "${python_packages[@]}" 2>/dev/null ||
    python3 -m pip install -q --break-system-packages "${python_packages[@]}"
fi
