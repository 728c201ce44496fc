#pragma once
// How long this process has run: the "launch" of launch to the first step (docs/PERFORMANCE.md),
// which includes what happens before main() — the dynamic loader mapping
// cuBLASLt, cuDNN and NCCL — and the CUDA context, which a timer started by flux8 itself would
// miss.
#include <chrono>

namespace flux8 {

// Seconds from t to now on the steady clock (how long a step, a data stage or a checkpoint took).
inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Seconds since the kernel started this process (Linux: /proc/self/stat's start time against
// CLOCK_BOOTTIME, at the kernel's clock-tick resolution, 10 ms). Elsewhere, or when /proc cannot
// be read: since this function's first call.
double seconds_since_process_start();

}  // namespace flux8
