#include "backend/backend.h"

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace flux8 {

std::unique_ptr<Backend> make_backend(std::string_view name, const BackendOptions& options) {
  if (name == "cpu") return std::make_unique<CpuBackend>(options);
  if (name == "cuda")
    fail("backend 'cuda': this build of flux8 has no CUDA backend yet; use --backend cpu");
  fail("unknown backend '{}': choose 'cpu' or 'cuda'", name);
}

}  // namespace flux8
