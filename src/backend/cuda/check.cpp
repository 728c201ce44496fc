#include "backend/cuda/check.h"

namespace flux8::cuda {

void fail_cuda(cudaError_t e, const char* call, const char* file, int line) {
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
