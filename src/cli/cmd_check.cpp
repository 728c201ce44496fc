// `flux8 check`: can this machine run flux8 on a GPU, and which FP8 recipes? Prints the GPU,
// compute capability, driver/CUDA/cuBLASLt/cuDNN/NCCL versions, the driver's JIT cache and,
// per recipe and for FP8 attention, whether it runs natively, emulated, or not (with the
// reason). Exit status 0 when the CUDA backend is usable.
#include <fmt/core.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "cli/commands.h"
#if FLUX8_HAVE_CUDA
#include "backend/cuda/factory.h"
#endif

namespace flux8::cli {

#if FLUX8_HAVE_CUDA
namespace {

// The CUDA driver's cache of code compiled at run time (cuDNN's attention kernels among it):
// where it is and what it holds. An empty one costs the first step of a run seconds of compiling
// (docs/PERFORMANCE.md, Current numbers), once per cache.
std::string jit_cache_summary() {
  const char* disable = std::getenv("CUDA_CACHE_DISABLE");
  if (disable && std::string(disable) == "1")
    return "disabled (CUDA_CACHE_DISABLE=1): cuDNN's attention kernels compile at every launch (~2 s)";
  const char* set = std::getenv("CUDA_CACHE_PATH");
  const char* home = std::getenv("HOME");
  std::filesystem::path dir;
  if (set && *set)
    dir = set;
  else if (home && *home)
    dir = std::filesystem::path(home) / ".nv" / "ComputeCache";
  else
    return "the driver's default (no HOME, no CUDA_CACHE_PATH)";
  const std::string where = dir.string() + (set && *set ? " (CUDA_CACHE_PATH)" : " (the driver's default)");
  int64_t files = 0;
  uintmax_t bytes = 0;
  std::error_code ec;
  for (std::filesystem::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code size_ec;
    if (!it->is_regular_file(size_ec)) continue;
    ++files;
    const uintmax_t n = it->file_size(size_ec);
    if (!size_ec) bytes += n;
  }
  if (files == 0)
    return where +
           ": empty — the first run here compiles cuDNN's attention kernels into it (~2 s); "
           "point CUDA_CACHE_PATH at shared storage to keep them across fresh nodes";
  return fmt::format("{}: {} file{}, {:.1f} MB (kernels compiled by earlier runs)", where, files, files == 1 ? "" : "s",
                     static_cast<double>(bytes) / 1e6);
}

}  // namespace
#endif

Command add_check_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("check",
                                 "report the GPU, driver and library versions, the driver's JIT cache, and "
                                 "which FP8 recipes and FP8 attention can run here (exit status 1 when the "
                                 "CUDA backend cannot run)");
  return {cmd, []() {
            fmt::print("flux8 0.1.0\n");
            fmt::print("  {:<20} {}\n", "CPU backend",
                       "always available (OpenBLAS + OpenMP; FP8 emulated bit-exactly)");
#if FLUX8_HAVE_CUDA
            // Read before cuda_report(): its FP8-attention probe builds a cuDNN graph, which compiles
            // kernels into this very cache, and an empty cache must be reported as the run found it.
            const std::string jit_cache = jit_cache_summary();
            const CudaReport r = cuda_report();
            for (const auto& l : r.lines) fmt::print("  {:<20} {}\n", l.key, l.value);
            fmt::print("  {:<20} {}\n", "JIT cache", jit_cache);
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
