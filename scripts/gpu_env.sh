# Sourced (not run) on the GPU machine: the library paths build/flux8 needs there.
#   source scripts/gpu_env.sh   (from the repository root)
# The Debian packages unpacked by scripts/prepare_carry.sh (.carry, named in the device tool's
# carry), cuDNN and NCCL from the Python environment's nvidia-* wheels (docs/USAGE.md, GPU builds), and the
# toolkit's lib64 (cuDNN's runtime-compiled engines need NVRTC). Sets flux8_carry, flux8_python,
# flux8_cudnn_root and flux8_nccl_root for scripts/gpu_check.sh.
flux8_carry=$PWD/.carry/usr
export LD_LIBRARY_PATH=$flux8_carry/lib/x86_64-linux-gnu:$flux8_carry/lib/x86_64-linux-gnu/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
flux8_python=$(command -v python3 || true)
flux8_wheel_dir() { [ -n "$flux8_python" ] && "$flux8_python" -c "import nvidia.$1 as m; print(list(m.__path__)[0])" 2>/dev/null || true; }
flux8_cudnn_root=$(flux8_wheel_dir cudnn)
flux8_nccl_root=$(flux8_wheel_dir nccl)
for flux8_d in "$flux8_cudnn_root" "$flux8_nccl_root"; do
  [ -n "$flux8_d" ] && export LD_LIBRARY_PATH=$flux8_d/lib:$LD_LIBRARY_PATH
done
export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:/usr/local/cuda/lib64
