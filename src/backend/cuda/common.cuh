#pragma once
// What the kernel files share: argument checks (the CPU backend's, from op_checks.h), a
// device view of a [rows, cols] matrix with its row stride, launch shapes, and the fixed-order
// reductions that keep results identical from run to run.
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/op_checks.h"

namespace flux8::cuda {

using ops::Named;
using ops::require_contiguous;
using ops::require_defined;
using ops::require_rank;
using ops::require_same_matrix;
using ops::require_shape;
using ops::require_vector;

// The CUDA backend computes in f32 (inside kernels: f32, with f64 where the CPU twin uses it).
inline void require_f32(std::string_view op, std::initializer_list<Named> tensors) {
  ops::call_dtype(op, tensors, {DType::f32}, "CUDA");
}

// A [rows, cols] matrix view with row stride ld, passed to kernels by value.
struct Mat {
  float* p;
  int64_t rows, cols, ld;
  __device__ float& at(int64_t r, int64_t c) const { return p[r * ld + c]; }
};
inline Mat mat(const Tensor& t) { return Mat{t.ptr<float>(), t.rows(), t.cols(), t.ld}; }
inline Mat mat_or_null(const Tensor& t) { return t.defined() ? mat(t) : Mat{nullptr, 0, 0, 0}; }

constexpr int kThreads = 256;

inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > (1 << 20) ? (1 << 20) : b));  // grid-stride beyond
}

// Blocks for one thread per item, for kernels that are not grid-stride loops.
inline unsigned exact_blocks(int64_t n, int threads = kThreads) {
  const int64_t b = (n + threads - 1) / threads;
  if (b >= (int64_t(1) << 31)) fail("CUDA launch over {} items needs more than 2^31 blocks", n);
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

// Block-wide sum of one value per thread, in a fixed tree order (deterministic). blockDim.x
// must be a power of two ≤ 1024; `shared` has blockDim.x entries. Returns the sum to thread 0.
template <typename T>
__device__ inline T block_sum(T v, T* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const T total = shared[0];
  __syncthreads();
  return total;
}

// ---- Σ f(i) over [0, n) in double, in an order that depends on n only ----------------------
// Pass 1: block b sums elements [b·kSumChunk, (b+1)·kSumChunk) (each thread a strided subset,
// then a fixed tree); pass 2: one block sums the partials the same way. f: __device__ lambda
// (int64_t i) -> double.
constexpr int64_t kSumChunk = 8192;

template <typename F>
__global__ void partial_sums_kernel(int64_t n, F f, double* partial) {
  __shared__ double sh[kThreads];
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kSumChunk;
  const int64_t end = begin + kSumChunk < n ? begin + kSumChunk : n;
  double s = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) s += f(i);
  s = block_sum(s, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sum_partials_kernel(const double* partial, int64_t count, double* out);

template <typename F>
double ordered_sum(CudaBackend& be, int64_t n, F f) {
  const int64_t chunks = n > 0 ? (n + kSumChunk - 1) / kSumChunk : 1;
  double* partial = static_cast<double*>(be.scratch2(static_cast<size_t>(chunks + 1) * sizeof(double)));
  if (n > 0) {
    partial_sums_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, be.stream()>>>(n, f, partial);
    FLUX8_LAUNCH_CHECK(partial_sums_kernel);
  } else {
    FLUX8_CUDA_CHECK(cudaMemsetAsync(partial, 0, sizeof(double), be.stream()));
  }
  sum_partials_kernel<<<1, kThreads, 0, be.stream()>>>(partial, chunks, partial + chunks);
  FLUX8_LAUNCH_CHECK(sum_partials_kernel);
  double* result = static_cast<double*>(be.pinned_result());
  FLUX8_CUDA_CHECK(cudaMemcpyAsync(result, partial + chunks, sizeof(double), cudaMemcpyDeviceToHost, be.stream()));
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(be.stream()));
  return *result;
}

// ---- per-sample column sums: out[g, c] (=, or += when accumulate) Σ_{r<rows} value(g, r, c) --
// For dshift/dscale/dgate/dscale-of-RMSNorm: groups g = samples (or 1), rows = tokens. Each
// block owns 32 columns of one group; its 8 thread rows walk the rows in a fixed stride and
// are combined in a fixed order. value: __device__ lambda (int64_t g, int64_t r, int64_t c)
// -> double.
template <typename V>
__global__ void column_sums_kernel(int64_t groups, int64_t rows, int64_t cols, V value, float* out,
                                   int64_t out_ld, bool accumulate) {
  __shared__ double sh[8][33];
  const int64_t g = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  double s = 0;
  if (c < cols)
    for (int64_t r = threadIdx.y; r < rows; r += 8) s += value(g, r, c);
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    double t = 0;
    for (int k = 0; k < 8; ++k) t += sh[k][threadIdx.x];
    float* o = out + g * out_ld + c;
    *o = accumulate ? static_cast<float>(static_cast<double>(*o) + t) : static_cast<float>(t);
  }
}

template <typename V>
void column_sums(CudaBackend& be, int64_t groups, int64_t rows, int64_t cols, V value, float* out, int64_t out_ld,
                 bool accumulate) {
  if (groups == 0 || cols == 0) return;
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(groups));
  column_sums_kernel<<<grid, dim3(32, 8), 0, be.stream()>>>(groups, rows, cols, value, out, out_ld, accumulate);
  FLUX8_LAUNCH_CHECK(column_sums_kernel);
}

// Launches a grid-stride loop over n items: f(i) for every i in [0, n).
template <typename F>
__global__ void for_each_kernel(int64_t n, F f) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    f(i);
}
template <typename F>
void for_each(CudaBackend& be, int64_t n, F f) {
  if (n <= 0) return;
  for_each_kernel<<<blocks_for(n), kThreads, 0, be.stream()>>>(n, f);
  FLUX8_LAUNCH_CHECK(for_each_kernel);
}

}  // namespace flux8::cuda
