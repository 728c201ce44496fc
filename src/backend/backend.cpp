#include "backend/backend.h"

#include "backend/cpu/cpu_backend.h"
#if FLUX8_HAVE_CUDA
#include "backend/cuda/factory.h"
#endif
#include "core/error.h"

namespace flux8 {

std::unique_ptr<Backend> make_backend(std::string_view name, const BackendOptions& options) {
  if (name == "cpu") return std::make_unique<CpuBackend>(options);
  if (name == "cuda") {
#if FLUX8_HAVE_CUDA
    return make_cuda_backend(options);
#else
    fail("backend 'cuda': this build of flux8 has no CUDA backend (configured without nvcc); use backend: cpu, or "
         "rebuild with CUDA (README: GPU builds)");
#endif
  }
  fail("unknown backend '{}': choose 'cpu' or 'cuda'", name);
}

}  // namespace flux8
