// The second passes of ordered_sum and column_sums (common.cuh), in a fixed order.
#include "backend/cuda/common.cuh"

namespace flux8::cuda {

__global__ void sum_partials_kernel(const double* partial, int64_t count, double* out) {
  __shared__ double sh[kThreads];
  double s = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
  s = block_sum(s, sh);
  if (threadIdx.x == 0) *out = s;
}

namespace {
// One thread per (group, column): the chunk partials added in chunk order (to the stored value
// first when accumulating), rounded to f32 and stored (bf16: rounded once more, to nearest even,
// as the CPU twin rounds its f32 value).
template <typename T>
__device__ inline void column_partials_total_of(int64_t groups, int64_t cols, int64_t chunks, const double* partial,
                                                T* out, int64_t out_ld, bool accumulate) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < groups * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t g = i / cols, c = i % cols;
    const double* p = partial + g * chunks * cols + c;
    double t = 0;
    for (int64_t k = 0; k < chunks; ++k) t += p[k * cols];
    T* o = out + g * out_ld + c;
    store(*o, accumulate ? static_cast<float>(static_cast<double>(load(*o)) + t) : static_cast<float>(t));
  }
}
}  // namespace

__global__ void column_partials_total_kernel(int64_t groups, int64_t cols, int64_t chunks, const double* partial,
                                             float* out, int64_t out_ld, bool accumulate) {
  column_partials_total_of(groups, cols, chunks, partial, out, out_ld, accumulate);
}
__global__ void column_partials_total_kernel(int64_t groups, int64_t cols, int64_t chunks, const double* partial,
                                             __nv_bfloat16* out, int64_t out_ld, bool accumulate) {
  column_partials_total_of(groups, cols, chunks, partial, out, out_ld, accumulate);
}

}  // namespace flux8::cuda
