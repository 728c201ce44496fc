// f32 <-> bf16 conversion of contiguous buffers (common.cuh): cuDNN attention's staging
// copies and the bf16 GEMM operands of contiguous tensors.
#include <cuda_bf16.h>

#include "backend/cuda/common.cuh"

namespace flux8::cuda {
namespace {

// y[i] = x[i] converted (store rounds to nearest even into bf16, load widens exactly), elements
// [0, 4·n4) four at a time (load4/store4: 16 bytes of f32, 8 of bf16), the rest one at a time.
template <typename Y, typename X>
__global__ void convert_kernel(Y* __restrict__ y, const X* __restrict__ x, int64_t n4, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t g = first; g < n4; g += stride) store4(y + 4 * g, load4(x + 4 * g));
  for (int64_t i = 4 * n4 + first; i < n; i += stride) store(y[i], load(x[i]));
}

// Four at a time where both sides allow it (vec4_aligned), else one at a time: callers pass
// staging buffers (256-byte aligned) and tensors (possibly not).
template <typename Y, typename X>
void convert(Y* y, const X* x, int64_t n, cudaStream_t stream) {
  const int64_t b = (n / 4 + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(b < 1 ? 1 : (b > 4096 ? 4096 : b));
  convert_kernel<<<blocks, kThreads, 0, stream>>>(y, x, vec4_aligned(y) && vec4_aligned(x) ? n / 4 : 0, n);
  FLUX8_LAUNCH_CHECK(convert_kernel);
}

}  // namespace

void to_bf16(__nv_bfloat16* y, const float* x, int64_t n, cudaStream_t stream) { convert(y, x, n, stream); }
void to_f32(float* y, const __nv_bfloat16* x, int64_t n, cudaStream_t stream) { convert(y, x, n, stream); }

}  // namespace flux8::cuda
