#include "backend/backend.h"

#include <algorithm>

#include "backend/cpu/cpu_backend.h"
#if FLUX8_HAVE_CUDA
#include "backend/cuda/factory.h"
#endif
#include "config/config.h"
#include "core/error.h"

namespace flux8 {

void Backend::track_allocation(void* p, size_t bytes) {
  sizes_[p] = bytes;
  memory_.allocated += bytes;
  memory_.peak_allocated = std::max(memory_.peak_allocated, memory_.allocated);
}

void Backend::track_release(void* p) {
  const auto it = sizes_.find(p);
  if (it == sizes_.end()) return;
  memory_.allocated -= it->second;
  sizes_.erase(it);
}

BackendOptions BackendOptions::from_config(const Config& cfg) {
  BackendOptions o;
  o.threads = static_cast<int>(cfg.get_int("threads"));
  o.round_activations_to_bf16 = cfg.get_bool("round_activations_to_bf16");
  o.bf16_gemm = cfg.get_string("gemm_precision") == "bf16";
  return o;
}

std::unique_ptr<Backend> make_backend(std::string_view name, const BackendOptions& options) {
  if (name == "cpu") return std::make_unique<CpuBackend>(options);
  if (name == "auto") {
#if FLUX8_HAVE_CUDA
    if (cuda_unavailable_reason().empty()) return make_cuda_backend(options);
#endif
    return std::make_unique<CpuBackend>(options);
  }
  if (name == "cuda") {
#if FLUX8_HAVE_CUDA
    return make_cuda_backend(options);
#else
    fail("backend 'cuda': this build of flux8 has no CUDA backend (configured without nvcc); use backend: cpu, or "
         "rebuild with CUDA (README: GPU builds)");
#endif
  }
  fail("unknown backend '{}': choose 'cpu', 'cuda' or 'auto'", name);
}

}  // namespace flux8
