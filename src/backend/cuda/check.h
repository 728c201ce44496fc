#pragma once
// Error checks for every CUDA runtime, cuBLASLt and cuDNN call and every kernel launch. A
// failure names the call, the file:line and the library's own message, so a report from a user
// pins the op that failed.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include "core/error.h"

namespace flux8::cuda {

[[noreturn]] void fail_cuda(cudaError_t e, const char* call, const char* file, int line);
[[noreturn]] void fail_cublas(cublasStatus_t s, const char* call, const char* file, int line);
[[noreturn]] void fail_cudnn(cudnnStatus_t s, const char* call, const char* file, int line);

}  // namespace flux8::cuda

#define FLUX8_CUDA_CHECK(call)                                                                  \
  do {                                                                                          \
    const cudaError_t flux8_e_ = (call);                                                        \
    if (flux8_e_ != cudaSuccess) ::flux8::cuda::fail_cuda(flux8_e_, #call, __FILE__, __LINE__); \
  } while (0)
#define FLUX8_CUBLAS_CHECK(call)                                                                            \
  do {                                                                                                      \
    const cublasStatus_t flux8_s_ = (call);                                                                 \
    if (flux8_s_ != CUBLAS_STATUS_SUCCESS) ::flux8::cuda::fail_cublas(flux8_s_, #call, __FILE__, __LINE__); \
  } while (0)
#define FLUX8_CUDNN_CHECK(call)                                                                           \
  do {                                                                                                    \
    const cudnnStatus_t flux8_s_ = (call);                                                                \
    if (flux8_s_ != CUDNN_STATUS_SUCCESS) ::flux8::cuda::fail_cudnn(flux8_s_, #call, __FILE__, __LINE__); \
  } while (0)
// After a <<<...>>> launch: catches bad launch configurations at the launch site (asynchronous
// faults surface at the next synchronising call, which is checked too).
#define FLUX8_LAUNCH_CHECK(kernel_name) FLUX8_CUDA_CHECK(cudaPeekAtLastError())
