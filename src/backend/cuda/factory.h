#pragma once
// Creating the CUDA backend without pulling CUDA headers into the caller.
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace flux8 {

// Fails with the reason when no usable GPU is present.
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options);
// "" when a CUDA device usable by this build is present, else why not (for tests and `check`).
std::string cuda_unavailable_reason();

// What `flux8 check` reports: the GPU, versions of the driver and libraries, and per FP8 recipe
// whether it runs here (natively, emulated, or not at all and why).
struct CudaReport {
  struct Line {
    std::string key, value;
  };
  std::vector<Line> lines;        // "GPU", "compute capability", "driver", "cuBLASLt", ...
  std::vector<Line> fp8_recipes;  // recipe (and "FP8 attention") -> "native (...)", "emulated: ...", "no: ..."
  bool usable = false;            // a GPU this build can run on
};
CudaReport cuda_report();

}  // namespace flux8
