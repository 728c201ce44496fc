#pragma once
// What the kernel files share: argument checks (the CPU backend's, from op_checks.h), a
// device view of a [rows, cols] matrix with its row stride, launch shapes, and the fixed-order
// reductions that keep results identical from run to run.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/fast_div.h"
#include "backend/op_checks.h"

namespace flux8::cuda {

using ops::Named;
using ops::require_contiguous;
using ops::require_defined;
using ops::require_rank;
using ops::require_same_matrix;
using ops::require_shape;
using ops::require_vector;

using ops::tensor_fields;

// The CUDA backend computes in f32 (inside kernels: f32, with f64 where the CPU twin uses it).
inline void require_f32(std::string_view op, std::span<const Named> tensors) {
  ops::call_dtype(op, tensors, {DType::f32}, "CUDA");
}
// Attention heads (Backend::attention_heads_dtype): the defined ones all f32 or all bf16.
// Returns whether they are bf16.
inline bool heads_in_bf16(std::string_view op, std::span<const Named> heads) {
  return ops::call_dtype(op, heads, {DType::f32, DType::bf16}, "CUDA") == DType::bf16;
}

// Activations (BackendOptions::bf16_activations: inputs, outputs and input gradients of the
// ops, Backend::activation_dtype) are stored in f32 or bf16; parameters, parameter gradients and
// statistics stay f32. The defined activation tensors of one call share one of the two types;
// returns whether it is bf16 (the kernels compute in f32 either way: load widens, store rounds
// to nearest even).
inline bool activations_in_bf16(std::string_view op, std::span<const Named> activations) {
  return ops::call_dtype(op, activations, {DType::f32, DType::bf16}, "CUDA") == DType::bf16;
}

// Parameter gradients (Backend::gradient_dtype: BackendOptions::bf16_grads) are stored in f32
// or bf16; the defined ones of one call share one type. Returns whether it is bf16 (false when
// none is defined). Their writers sum in f32 or double and round once as they store.
inline bool grads_in_bf16(std::string_view op, std::span<const Named> grads) {
  for (const Named& g : grads)
    if (g.t.defined()) return ops::call_dtype(op, grads, {DType::f32, DType::bf16}, "CUDA") == DType::bf16;
  return false;
}

// The same for tensors named at the call.
inline void require_f32(std::string_view op, std::initializer_list<Named> tensors) {
  require_f32(op, std::span<const Named>(tensors.begin(), tensors.size()));
}
inline bool heads_in_bf16(std::string_view op, std::initializer_list<Named> heads) {
  return heads_in_bf16(op, std::span<const Named>(heads.begin(), heads.size()));
}
inline bool activations_in_bf16(std::string_view op, std::initializer_list<Named> activations) {
  return activations_in_bf16(op, std::span<const Named>(activations.begin(), activations.size()));
}

// The same over every Tensor field of an op whose tensors all have that role, named as declared.
template <typename Op>
void require_f32(const Op& a) {
  require_f32(Op::name, tensor_fields(a));
}
template <typename Op>
bool activations_in_bf16(const Op& a) {
  return activations_in_bf16(Op::name, tensor_fields(a));
}
template <typename Op>
bool grads_in_bf16(const Op& a) {
  return grads_in_bf16(Op::name, tensor_fields(a));
}

// f(p) with p the gradient's storage, float* or __nv_bfloat16* by its type (checked by
// grads_in_bf16): for the kernels that write a gradient in either type.
template <typename F>
void with_grad_storage(const Tensor& g, F&& f) {
  if (g.dtype == DType::bf16)
    f(g.ptr<__nv_bfloat16>());
  else
    f(g.ptr<float>());
}

// Element access for the two storage types: load gives the f32 value, store rounds to it.
__device__ __forceinline__ float load(const float& x) { return x; }
__device__ __forceinline__ float load(const __nv_bfloat16& x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(float& y, float v) { y = v; }
__device__ __forceinline__ void store(__nv_bfloat16& y, float v) { y = __float2bfloat16_rn(v); }

// Four consecutive elements as f32, and back, in one access: 16 bytes of f32 (a float4), 8 of
// bf16 (widened as load() does, rounded as store() does; through a uint2, as a struct of bf16
// pairs would be copied member by member, in two 4-byte accesses). p must be aligned to the
// four elements (vec4_aligned, vec4_rows).
__device__ inline float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ inline void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
// Two bf16 in one 32-bit word (element 2k in the low half), widened: a shift and a mask, where
// __bfloat1622float2 takes a byte permute and a multiply for the high half (AdamW with bf16
// moments, bound by its instructions, loads three such pairs an element).
__device__ __forceinline__ float2 widen_bf16x2(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
__device__ inline float4 load4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = widen_bf16x2(u.x), b = widen_bf16x2(u.y);
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ inline void store4(__nv_bfloat16* p, float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  uint2 u;
  memcpy(&u.x, &lo, 4), memcpy(&u.y, &hi, 4);
  *reinterpret_cast<uint2*>(p) = u;
}

// The value an op's output has once stored as a T: f32 as computed, bf16 as store() rounds it
// (the conversion instruction: nearest even, a NaN becomes the canonical NaN). The CPU's integer
// round_to_bf16 gives the same bits for every non-NaN value but costs ~6 integer instructions an
// element, in casts bound by the integer pipe (GELU's).
template <typename T>
__device__ inline float as_stored(float v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return __bfloat162float(__float2bfloat16_rn(v));
}

// Eight consecutive elements of T as loaded (the bytes as stored: one uint4 of bf16, two float4s
// of f32), widened to f32 only when used: a loop that loads the next iteration's elements before
// the current one's arithmetic holds them in 4 (bf16) or 8 (f32) registers, not 8 floats each.
// widen() gives load8's values.
template <typename T>
struct Raw8;
template <>
struct Raw8<float> {
  float4 a, b;
  __device__ void load(const float* p) { a = load4(p), b = load4(p + 4); }
  __device__ void widen(float (&v)[8]) const {
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
};
template <>
struct Raw8<__nv_bfloat16> {
  uint4 u;
  __device__ void load(const __nv_bfloat16* p) { u = *reinterpret_cast<const uint4*>(p); }
  __device__ void widen(float (&v)[8]) const {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __nv_bfloat162 h;
      memcpy(&h, &w[i], 4);
      const float2 f = __bfloat1622float2(h);
      v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
  }
};

// Eight consecutive elements as f32, and back: 32 bytes of f32 (two float4s), 16 of bf16 (one
// uint4), widened and rounded as load4/store4 do. p must be aligned to the eight elements.
__device__ inline void load8(const float* p, float (&v)[8]) {
  Raw8<float> r;
  r.load(p);
  r.widen(v);
}
__device__ inline void store8(float* p, const float (&v)[8]) {
  store4(p, make_float4(v[0], v[1], v[2], v[3]));
  store4(p + 4, make_float4(v[4], v[5], v[6], v[7]));
}
__device__ inline void load8(const __nv_bfloat16* p, float (&v)[8]) {
  Raw8<__nv_bfloat16> r;
  r.load(p);
  r.widen(v);
}
__device__ inline void store8(__nv_bfloat16* p, const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    memcpy(&w[i], &h, 4);
  }
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// The sample of row r (r / rows per sample) without a 64-bit division per element: rows of one
// launch must have 32-bit indices. 0 rows per sample (no rows to divide) gives the divisor 1.
inline FastDivisor row_divisor(std::string_view op, int64_t rows, int64_t per_sample) {
  if (rows >= (int64_t(1) << 31)) fail("{}: {} rows: beyond the 2^31 rows one launch indexes", op, rows);
  return FastDivisor(static_cast<uint32_t>(per_sample > 1 ? per_sample : 1));
}

// A [rows, cols] matrix view with row stride ld, passed to kernels by value.
struct Mat {
  float* p;
  int64_t rows, cols, ld;
  __device__ float& at(int64_t r, int64_t c) const { return p[r * ld + c]; }
};
inline Mat mat(const Tensor& t) { return Mat{t.ptr<float>(), t.rows(), t.cols(), t.ld}; }
inline Mat mat_or_null(const Tensor& t) { return t.defined() ? mat(t) : Mat{nullptr, 0, 0, 0}; }

// The same view over elements of type T (float or __nv_bfloat16: an activation in either
// storage type). Kernels over activations are templated on T and dispatched on
// activations_in_bf16(); values are read with load() and written with store().
template <typename T>
struct MatOf {
  T* p;
  int64_t rows, cols, ld;
  __device__ T& at(int64_t r, int64_t c) const { return p[r * ld + c]; }
  __device__ float get(int64_t r, int64_t c) const { return load(p[r * ld + c]); }
  __device__ void set(int64_t r, int64_t c, float v) const { store(p[r * ld + c], v); }
};
template <typename T>
MatOf<T> mat_of(const Tensor& t) {
  return MatOf<T>{static_cast<T*>(t.data), t.rows(), t.cols(), t.ld};
}
template <typename T>
MatOf<T> mat_of_or_null(const Tensor& t) {
  return t.defined() ? mat_of<T>(t) : MatOf<T>{nullptr, 0, 0, 0};
}

// Whether p may start a load4/store4 (16-byte aligned f32, 8-byte aligned bf16).
template <typename T>
bool vec4_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (4 * sizeof(T)) == 0;
}
// Rows of whole 4-element vectors, every one a load4/store4 (quads() for either storage type).
template <typename T>
bool vec4_rows(const MatOf<T>& m) {
  return vec4_aligned(m.p) && m.ld % 4 == 0 && m.cols % 4 == 0;
}

// Rows of whole 8-element vectors, every one a load8/store8 (16 bytes of bf16, 32 of f32).
template <typename T>
bool vec8_rows(const MatOf<T>& m) {
  return reinterpret_cast<uintptr_t>(m.p) % (8 * sizeof(T)) == 0 && m.ld % 8 == 0 && m.cols % 8 == 0;
}

constexpr int kThreads = 256;

// The SMs of an H100/H200 (132), for launch shapes that fix a reduction's order (the LayerNorm
// backward's rows per block, the QK-norm backward's segments per group): a constant, not the
// device's SM count, so that the order, and the bits of the sums, depend on the call's shape
// alone and are the same on every GPU.
constexpr int64_t kReferenceSms = 132;

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

// Pass 2 and the read-back: Σ partial[0 .. count) in the fixed order, into partial[count] (the
// scratch must hold count + 1 doubles), then to the host (a synchronisation).
inline double total_of_partials(CudaBackend& be, double* partial, int64_t count) {
  sum_partials_kernel<<<1, kThreads, 0, be.stream()>>>(partial, count, partial + count);
  FLUX8_LAUNCH_CHECK(sum_partials_kernel);
  double* result = static_cast<double*>(be.pinned_result());
  FLUX8_CUDA_CHECK(cudaMemcpyAsync(result, partial + count, sizeof(double), cudaMemcpyDeviceToHost, be.stream()));
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(be.stream()));
  return *result;
}

// Pass 1 queued: the per-chunk partials in the reduction scratch (count + 1 doubles, the last
// left for the total); returns them and their count.
template <typename F>
std::pair<double*, int64_t> queue_partial_sums(CudaBackend& be, int64_t n, F f) {
  const int64_t chunks = n > 0 ? (n + kSumChunk - 1) / kSumChunk : 1;
  double* partial = static_cast<double*>(be.reduction_scratch(static_cast<size_t>(chunks + 1) * sizeof(double)));
  if (n > 0) {
    partial_sums_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, be.stream()>>>(n, f, partial);
    FLUX8_LAUNCH_CHECK(partial_sums_kernel);
  } else {
    FLUX8_CUDA_CHECK(cudaMemsetAsync(partial, 0, sizeof(double), be.stream()));
  }
  return {partial, chunks};
}

template <typename F>
double ordered_sum(CudaBackend& be, int64_t n, F f) {
  const auto [partial, chunks] = queue_partial_sums(be, n, f);
  return total_of_partials(be, partial, chunks);
}

// ---- per-sample column sums: out[g, c] (=, or += when accumulate) Σ_{r<rows} value(g, r, c) --
// For dshift/dscale/dgate/bias grads and the dscale of RMSNorm: groups g = samples (or 1),
// rows = tokens (or tokens × heads). Rows are cut into chunks of kColumnChunk; pass 1 gives
// each (group, chunk, 32 columns) a block whose 8 thread rows walk the chunk in a fixed stride
// and combine in a fixed order; pass 2 adds the chunk partials of each column in a fixed order
// (column_partials_total).
// The order depends on the shape only, so results are identical from run to run, and the work
// spreads over the GPU however few groups and columns there are (RMSNorm's dscale is 128 columns
// over a million rows: one pass over them would leave most of the GPU idle). Chunks hold kColumnChunk rows, more when a
// grid would need over 65535 of them. value: __device__ lambda (int64_t g, int64_t r,
// int64_t c) -> double or float, called exactly once per element (c < cols), so it may also write that
// element's output of a fused op (gated_residual_backward writes dy while summing dgate).
// out: f32, or bf16 for an activation's gradient (dshift, dscale, dgate: the f32 total rounded
// once more, to nearest even, as the CPU twin rounds its f32 value).
constexpr int64_t kColumnChunk = 256;

template <typename V>
__global__ void column_partials_kernel(int64_t rows, int64_t cols, int64_t chunks, int64_t chunk_rows, V value,
                                       double* partial) {
  __shared__ double sh[8][33];
  const int64_t g = blockIdx.z, chunk = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t begin = chunk * chunk_rows, end = begin + chunk_rows < rows ? begin + chunk_rows : rows;
  // A thread's ≤ chunk_rows / 8 rows are summed in the value's type (float where the callers'
  // terms are f32 products: a double add per element costs a conversion at a quarter of the
  // f32 issue rate), the 8 thread rows and the chunks in double.
  decltype(value(g, begin, c)) s = 0;
  if (c < cols)
    for (int64_t r = begin + threadIdx.y; r < end; r += 8) s += value(g, r, c);
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    double t = 0;
    for (int k = 0; k < 8; ++k) t += sh[k][threadIdx.x];
    partial[(g * chunks + chunk) * cols + c] = t;
  }
}

// For f32 and for bf16 outputs (reduce.cu; overloads, not a template: without relocatable
// device code a kernel template cannot be instantiated in one file and launched from others).
// Blocks of 32 x kColumnTotalWarps threads, a grid of (column blocks of 32, groups).
constexpr int kColumnTotalWarps = 8;
__global__ void column_partials_total_kernel(int64_t cols, int64_t chunks, const double* partial, float* out,
                                             int64_t out_ld, bool accumulate);
__global__ void column_partials_total_kernel(int64_t cols, int64_t chunks, const double* partial, __nv_bfloat16* out,
                                             int64_t out_ld, bool accumulate);

// The second pass on its own, for kernels that write partials [groups, chunks, cols] of their
// own (the one-pass LayerNorm backward, the FP8 casts, the QK-norm backward): out[g, c] (=, or
// += when accumulate) Σ_k partial[g, k, c] in a fixed order (each warp of a block over a
// contiguous run of chunks, then the warps in order).
template <typename T>
void column_partials_total(CudaBackend& be, int64_t groups, int64_t cols, int64_t chunks, const double* partial, T* out,
                           int64_t out_ld, bool accumulate) {
  if (groups == 0 || cols == 0) return;
  if (groups > 65535) fail("column sums: {} groups is beyond the launch limit of 65535", groups);
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(groups));
  column_partials_total_kernel<<<grid, dim3(32, kColumnTotalWarps), 0, be.stream()>>>(cols, chunks, partial, out,
                                                                                      out_ld, accumulate);
  FLUX8_LAUNCH_CHECK(column_partials_total_kernel);
}

// The row chunks of column_sums (and column_sums4) for `rows` rows, and their partials'
// scratch [groups, chunks, cols].
struct ColumnChunks {
  int64_t chunk_rows, chunks;
  double* partial;
};
inline ColumnChunks column_chunks(CudaBackend& be, int64_t groups, int64_t rows, int64_t cols,
                                  int64_t chunk_rows = kColumnChunk) {
  if (groups > 65535) fail("column_sums: {} groups is beyond the launch limit of 65535", groups);
  if (rows > chunk_rows * 65535) chunk_rows = (rows + 65534) / 65535;
  const int64_t chunks = rows > 0 ? (rows + chunk_rows - 1) / chunk_rows : 1;
  auto* partial =
      static_cast<double*>(be.reduction_scratch(static_cast<size_t>(groups * chunks * cols) * sizeof(double)));
  return {chunk_rows, chunks, partial};
}

template <typename V, typename T>
void column_sums(CudaBackend& be, int64_t groups, int64_t rows, int64_t cols, V value, T* out, int64_t out_ld,
                 bool accumulate) {
  if (groups == 0 || cols == 0) return;
  const ColumnChunks k = column_chunks(be, groups, rows, cols);
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(k.chunks),
                  static_cast<unsigned>(groups));
  column_partials_kernel<<<grid, dim3(32, 8), 0, be.stream()>>>(rows, cols, k.chunks, k.chunk_rows, value, k.partial);
  FLUX8_LAUNCH_CHECK(column_partials_kernel);
  column_partials_total(be, groups, cols, k.chunks, k.partial, out, out_ld, accumulate);
}

// column_sums over rows of whole 4-column groups (cols a multiple of 4): value4(g, r, c) gives
// the float4 of columns c..c+3 (c a multiple of 4), so a warp moves 128 columns per row in one
// vector access a thread, where column_sums' warp of 32 scalar columns took four times the
// instructions and keeps too few loads in flight. The same order of sums as column_sums within a chunk; shorter chunks
// where the grid would be small (column_sums4_chunk_rows).
template <typename V>
__global__ void column_partials4_kernel(int64_t rows, int64_t cols, int64_t chunks, int64_t chunk_rows, V value4,
                                        double* partial) {
  __shared__ float4 sh[8][32];
  const int64_t g = blockIdx.z, chunk = blockIdx.y;
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x) * 4;
  const int64_t begin = chunk * chunk_rows, end = begin + chunk_rows < rows ? begin + chunk_rows : rows;
  float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (c < cols) {
#pragma unroll 4
    for (int64_t r = begin + threadIdx.y; r < end; r += 8) {
      const float4 v = value4(g, r, c);
      s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
  }
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y < 4 && c < cols) {  // thread row e adds column c + e over the 8 thread rows
    const int e = threadIdx.y;
    double t = 0;
    for (int k = 0; k < 8; ++k) t += reinterpret_cast<const float*>(&sh[k][threadIdx.x])[e];
    partial[(g * chunks + chunk) * cols + c + e] = t;
  }
}

// column_sums4's chunks: kColumnChunk rows, halved (down to 32) while the grid would have fewer
// than kColumnSums4Blocks blocks: with fixed 256-row chunks a short stream (W2's text, 2 samples
// of 512 rows) runs on too few blocks to approach DRAM bandwidth (docs/PERFORMANCE.md,
// Measurements behind the kernels). A function of the shape only, as the summation order must be.
constexpr int64_t kColumnSums4Blocks = 1024;
inline int64_t column_sums4_chunk_rows(int64_t groups, int64_t rows, int64_t cols) {
  const int64_t column_blocks = (cols / 4 + 31) / 32;
  int64_t chunk_rows = kColumnChunk;
  while (chunk_rows > 32 && groups * column_blocks * ((rows + chunk_rows - 1) / chunk_rows) < kColumnSums4Blocks)
    chunk_rows /= 2;
  return chunk_rows;
}

template <typename V, typename T>
void column_sums4(CudaBackend& be, int64_t groups, int64_t rows, int64_t cols, V value4, T* out, int64_t out_ld,
                  bool accumulate) {
  if (groups == 0 || cols == 0) return;
  const ColumnChunks k = column_chunks(be, groups, rows, cols, column_sums4_chunk_rows(groups, rows, cols));
  const dim3 grid(static_cast<unsigned>((cols / 4 + 31) / 32), static_cast<unsigned>(k.chunks),
                  static_cast<unsigned>(groups));
  column_partials4_kernel<<<grid, dim3(32, 8), 0, be.stream()>>>(rows, cols, k.chunks, k.chunk_rows, value4, k.partial);
  FLUX8_LAUNCH_CHECK(column_partials4_kernel);
  column_partials_total(be, groups, cols, k.chunks, k.partial, out, out_ld, accumulate);
}

// f(r, c) for every element of a rows x cols matrix: threads along the columns (coalesced),
// blocks along the rows. Unlike for_each over r·cols + c, no thread divides a 64-bit index
// (which cost the layout and elementwise kernels more than their memory traffic).
// Short rows share a block: blockDim = (cols rounded up to a warp, kThreads / that).
template <typename F>
__global__ void for_each_row_kernel(int64_t rows, int cols, F f) {
  const int c = static_cast<int>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += step) f(r, c);
}
template <typename F>
void for_each_row(CudaBackend& be, int64_t rows, int64_t cols, F f) {
  if (rows <= 0 || cols <= 0) return;
  if (cols > (int64_t(1) << 30)) fail("CUDA launch over rows of {} elements: beyond 2^30 columns", cols);
  const int tx = cols >= kThreads ? kThreads : static_cast<int>((cols + 31) / 32 * 32), ty = kThreads / tx;
  const int64_t row_blocks = (rows + ty - 1) / ty;
  const dim3 grid(static_cast<unsigned>((cols + tx - 1) / tx),
                  static_cast<unsigned>(row_blocks < 65535 ? row_blocks : 65535));
  for_each_row_kernel<<<grid, dim3(tx, ty), 0, be.stream()>>>(rows, static_cast<int>(cols), f);
  FLUX8_LAUNCH_CHECK(for_each_row_kernel);
}

// Rows of whole float4s: 16-byte aligned base, ld and cols multiples of 4. Moving 16 bytes per
// thread instead of 4 takes copies and elementwise kernels from well below HBM bandwidth
// towards the copy rate.
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
// Elements [begin, begin + n) of a contiguous vector (a bias) as a vector of its own; an
// undefined one stays undefined. (cols_slice keeps the row stride: not contiguous.)
inline Tensor vector_part(const Tensor& v, int64_t begin, int64_t n) {
  if (!v.defined()) return v;
  return Tensor(static_cast<char*>(v.data) + static_cast<size_t>(begin) * dtype_size(v.dtype), v.dtype, Shape{n});
}
inline bool quads(const Mat& m) { return aligned16(m.p) && m.ld % 4 == 0 && m.cols % 4 == 0; }
__device__ inline float4& quad(const Mat& m, int64_t r, int64_t c) { return *reinterpret_cast<float4*>(&m.at(r, c)); }

// y[i] = bf16(x[i]) (round to nearest even) / y[i] = f32(x[i]) for i < n, on `stream`; four
// elements an access where both sides are aligned for it, any alignment otherwise (convert.cu).
void to_bf16(__nv_bfloat16* y, const float* x, int64_t n, cudaStream_t stream);
void to_f32(float* y, const __nv_bfloat16* x, int64_t n, cudaStream_t stream);

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
