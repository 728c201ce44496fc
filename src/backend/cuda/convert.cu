// f32 <-> bf16 conversion of contiguous buffers (common.cuh): cuDNN attention's staging
// copies and the bf16 GEMM operands of contiguous tensors.
#include <cuda_bf16.h>

#include "backend/cuda/common.cuh"

namespace flux8::cuda {
namespace {

// Elements [0, 4·n4) go four at a time (x 16-byte aligned), the rest one at a time.
__global__ void to_bf16_kernel(__nv_bfloat16* __restrict__ y, const float* __restrict__ x, int64_t n4, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  __nv_bfloat162* y2 = reinterpret_cast<__nv_bfloat162*>(y);
  for (int64_t g = first; g < n4; g += stride) {
    const float4 a = x4[g];
    y2[2 * g] = __floats2bfloat162_rn(a.x, a.y);
    y2[2 * g + 1] = __floats2bfloat162_rn(a.z, a.w);
  }
  for (int64_t i = 4 * n4 + first; i < n; i += stride) y[i] = __float2bfloat16_rn(x[i]);
}

__global__ void to_f32_kernel(float* __restrict__ y, const __nv_bfloat16* __restrict__ x, int64_t n4, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(x);
  float4* y4 = reinterpret_cast<float4*>(y);
  for (int64_t g = first; g < n4; g += stride) {
    const float2 a = __bfloat1622float2(x2[2 * g]), b = __bfloat1622float2(x2[2 * g + 1]);
    y4[g] = make_float4(a.x, a.y, b.x, b.y);
  }
  for (int64_t i = 4 * n4 + first; i < n; i += stride) y[i] = __bfloat162float(x[i]);
}

unsigned conversion_blocks(int64_t n) {
  const int64_t b = (n / 4 + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 4096 ? 4096 : b));
}

}  // namespace

// The staging buffers are 256-byte aligned; the caller's f32 tensor may not be.
void to_bf16(__nv_bfloat16* y, const float* x, int64_t n, cudaStream_t stream) {
  to_bf16_kernel<<<conversion_blocks(n), kThreads, 0, stream>>>(y, x, aligned16(x) ? n / 4 : 0, n);
  FLUX8_LAUNCH_CHECK(to_bf16_kernel);
}
void to_f32(float* y, const __nv_bfloat16* x, int64_t n, cudaStream_t stream) {
  to_f32_kernel<<<conversion_blocks(n), kThreads, 0, stream>>>(y, x, aligned16(y) ? n / 4 : 0, n);
  FLUX8_LAUNCH_CHECK(to_f32_kernel);
}

}  // namespace flux8::cuda
