// The second pass of ordered_sum (common.cuh): one block sums the partials in a fixed order.
#include "backend/cuda/common.cuh"

namespace flux8::cuda {

__global__ void sum_partials_kernel(const double* partial, int64_t count, double* out) {
  __shared__ double sh[kThreads];
  double s = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
  s = block_sum(s, sh);
  if (threadIdx.x == 0) *out = s;
}

}  // namespace flux8::cuda
