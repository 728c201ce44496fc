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
// A block of 32 x kColumnTotalWarps threads (common.cuh) per (group, 32 columns): lane x on
// column c, warp y on the chunks [y·per, (y + 1)·per) in chunk order, then the warps' sums in
// warp order (to the stored value first when accumulating), rounded to f32 and stored (bf16:
// rounded once more, to nearest even, as the CPU twin rounds its f32 value). A fixed order, so
// the same bits on every run. One thread per column walking all the chunks would leave W2's
// LayerNorm totals (6,144 columns of 144 chunks) on 24 blocks, bound by latency.
template <typename T>
__device__ inline void column_partials_total_of(int64_t cols, int64_t chunks, const double* partial, T* out,
                                                int64_t out_ld, bool accumulate) {
  __shared__ double sh[kColumnTotalWarps][32];
  const int64_t g = blockIdx.y, c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t per = (chunks + kColumnTotalWarps - 1) / kColumnTotalWarps, k0 = threadIdx.y * per;
  const int64_t k1 = k0 + per < chunks ? k0 + per : chunks;
  double t = 0;
  if (c < cols) {
    const double* p = partial + g * chunks * cols + c;
#pragma unroll 4
    for (int64_t k = k0; k < k1; ++k) t += p[k * cols];
  }
  sh[threadIdx.y][threadIdx.x] = t;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  double s = 0;
#pragma unroll
  for (int w = 0; w < kColumnTotalWarps; ++w) s += sh[w][threadIdx.x];
  T* o = out + g * out_ld + c;
  store(*o, accumulate ? static_cast<float>(static_cast<double>(load(*o)) + s) : static_cast<float>(s));
}
}  // namespace

__global__ void column_partials_total_kernel(int64_t cols, int64_t chunks, const double* partial, float* out,
                                             int64_t out_ld, bool accumulate) {
  column_partials_total_of(cols, chunks, partial, out, out_ld, accumulate);
}
__global__ void column_partials_total_kernel(int64_t cols, int64_t chunks, const double* partial, __nv_bfloat16* out,
                                             int64_t out_ld, bool accumulate) {
  column_partials_total_of(cols, chunks, partial, out, out_ld, accumulate);
}

}  // namespace flux8::cuda
