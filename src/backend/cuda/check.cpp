#include "backend/cuda/check.h"

namespace flux8::cuda {

void fail_cuda(cudaError_t e, const char* call, const char* file, int line) {
  // An allocation outside the backend's own allocate() (workspaces, staging buffers): the same
  // kind of error, with the device's free and total memory (the request is not known here).
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    throw OutOfMemoryError(
        fmt::format("CUDA error {} ({}) in {} at {}:{} ({:.2f} GiB free of {:.1f} GiB)", cudaGetErrorName(e),
                    cudaGetErrorString(e), call, file, line, free_b / 1073741824.0, total_b / 1073741824.0),
        0, free_b, total_b);
  }
  fail("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(e), cudaGetErrorString(e), call, file, line);
}

void fail_cublas(cublasStatus_t s, const char* call, const char* file, int line) {
  fail("cuBLASLt error {} ({}) in {} at {}:{}", cublasLtGetStatusName(s), cublasLtGetStatusString(s), call, file, line);
}

void fail_cudnn(cudnnStatus_t s, const char* call, const char* file, int line) {
  char detail[1024] = {0};
  cudnnGetLastErrorString(detail, sizeof(detail));
  fail("cuDNN error {} in {} at {}:{}{}{}", cudnnGetErrorString(s), call, file, line, detail[0] ? ": " : "", detail);
}

}  // namespace flux8::cuda
