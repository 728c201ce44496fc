// `flux8 check`: can this machine run flux8 on a GPU, and which FP8 recipes? Prints the GPU,
// compute capability, driver/CUDA/cuBLASLt/cuDNN/NCCL versions and, per recipe and for FP8
// attention, whether it runs natively, emulated, or not (with the reason). Exit status 0 when
// the CUDA backend is usable.
#include <fmt/core.h>

#include "cli/commands.h"
#if FLUX8_HAVE_CUDA
#include "backend/cuda/factory.h"
#endif

namespace flux8::cli {

Command add_check_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("check", "report the GPU, driver and library versions, and which FP8 recipes and "
                                          "FP8 attention can run here (exit status 1 when the CUDA backend cannot "
                                          "run)");
  return {cmd, []() {
    fmt::print("flux8 0.1.0\n");
    fmt::print("  {:<20} {}\n", "CPU backend", "always available (OpenBLAS + OpenMP; FP8 emulated bit-exactly)");
#if FLUX8_HAVE_CUDA
    const CudaReport r = cuda_report();
    for (const auto& l : r.lines) fmt::print("  {:<20} {}\n", l.key, l.value);
    fmt::print("FP8 on the GPU (recipes, attention):\n");
    for (const auto& l : r.fp8_recipes) fmt::print("  {:<20} {}\n", l.key, l.value);
    return r.usable ? 0 : 1;
#else
    fmt::print("  {:<20} {}\n", "CUDA backend",
               "not built (no nvcc when flux8 was configured; README: GPU builds)");
    return 1;
#endif
  }};
}

}  // namespace flux8::cli
