// The per-sample Linears' three products on CUDA cores (skinny_linear.h says why). Each kernel
// is templated on kN, the rows it holds in registers (2, 4 or 8 ≥ the call's rows), and on
// whether the weight-sized operand is read (or written) in 16-byte vectors (aligned pointers,
// row strides and widths of whole vectors), else one element at a time — in the same order of
// summation, so that where a tensor happens to sit (its alignment) never changes the bits.
#include "backend/cuda/skinny_linear.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string_view>

#include "backend/cuda/common.cuh"

namespace flux8::cuda {
namespace {

using bf16 = __nv_bfloat16;
constexpr unsigned kAllLanes = 0xffffffffu;

std::atomic<int64_t> g_products{0};

// 8 bf16 in one 16-byte load, widened to f32. The weight is read once per product, so its
// loads skip L1 (ld.global.nc.L1::no_allocate); x and dy, read by every warp, stay cached.
__device__ __forceinline__ void load8_stream(const bf16* p, float (&f)[8]) {
  uint4 u;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
               : "l"(p));
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    f[2 * i] = t.x, f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ void load8_cached(const bf16* p, float (&f)[8]) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    f[2 * i] = t.x, f[2 * i + 1] = t.y;
  }
}

// ---- fprop: a warp per output feature o, its lanes along the weight row ----------------------
template <int kN, bool kVec, typename TY>
__global__ void __launch_bounds__(kThreads) skinny_fprop_kernel(const bf16* __restrict__ x, int64_t ldx,
                                                                const bf16* __restrict__ w, int64_t ldw,
                                                                const float* __restrict__ bias, TY* __restrict__ y,
                                                                int64_t ldy, int rows, int K, int64_t M) {
  const int lane = threadIdx.x % 32;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t o = first; o < M; o += warps) {
    float acc[kN];
#pragma unroll
    for (int n = 0; n < kN; ++n) acc[n] = 0.0f;
    const bf16* wr = w + o * ldw;
    if constexpr (kVec) {
      // kAhead of the lane's 16-byte weight loads issued before any is used: the weight stream
      // is the whole cost, and one load in flight per warp leaves DRAM mostly idle.
      constexpr int kAhead = 4;
      for (int k = 8 * lane; k < K; k += 256 * kAhead) {
        float wf[kAhead][8];
#pragma unroll
        for (int u = 0; u < kAhead; ++u)
          if (k + 256 * u < K) load8_stream(wr + k + 256 * u, wf[u]);
#pragma unroll
        for (int u = 0; u < kAhead; ++u) {
          if (k + 256 * u >= K) break;
#pragma unroll
          for (int n = 0; n < kN; ++n) {
            if (n >= rows) break;
            float xf[8];
            load8_cached(x + n * ldx + k + 256 * u, xf);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[n] = fmaf(wf[u][j], xf[j], acc[n]);
          }
        }
      }
    } else {  // the vector path's order: lane l sums columns 8l..8l+7, then 256 further on
      for (int k8 = 8 * lane; k8 < K; k8 += 256)
        for (int k = k8; k < k8 + 8 && k < K; ++k) {
          const float wv = __bfloat162float(wr[k]);
#pragma unroll
          for (int n = 0; n < kN; ++n) {
            if (n >= rows) break;
            acc[n] = fmaf(wv, __bfloat162float(x[n * ldx + k]), acc[n]);
          }
        }
    }
    float mine = 0.0f;  // lane n keeps row n's sum
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      float v = acc[n];
#pragma unroll
      for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(kAllLanes, v, s);
      if (lane == n) mine = v;
    }
    if (lane < rows) store(y[lane * ldy + o], bias ? mine + bias[o] : mine);
  }
}

// ---- dgrad: blocks of 4 warps over 32·kW columns of w and a span of its rows -----------------
// Lane l owns kW consecutive columns; the block's 4 warps take every fourth row of the span, add
// their sums in shared memory and write one partial per (span, row, column); skinny_reduce adds
// the spans in order.
constexpr int kDgradWarps = 4;

template <int kN, bool kVec>
__global__ void __launch_bounds__(32 * kDgradWarps) skinny_dgrad_kernel(const bf16* __restrict__ dy, int64_t lddy,
                                                                        const bf16* __restrict__ w, int64_t ldw,
                                                                        float* __restrict__ partial, int rows, int K,
                                                                        int64_t M, int64_t span) {
  constexpr int kW = kVec ? 8 : 1, kCols = 32 * kW;
  __shared__ float sums[kDgradWarps][kN][kCols];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k0 = blockIdx.x * kCols + lane * kW;
  const int64_t o_begin = blockIdx.y * span, o_end = o_begin + span < M ? o_begin + span : M;
  float acc[kN][kW];
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int j = 0; j < kW; ++j) acc[n][j] = 0.0f;
  if (k0 < K) {  // kVec: K % 8 == 0, so the lane's 8 columns are all inside
    // kAhead rows' weight loads in flight before any is used (as in the fprop kernel).
    constexpr int kAhead = 4;
    for (int64_t o0 = o_begin + warp; o0 < o_end; o0 += kDgradWarps * kAhead) {
      float wf[kAhead][8];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        const int64_t o = o0 + u * kDgradWarps;
        if (o >= o_end) break;
        if constexpr (kVec)
          load8_stream(w + o * ldw + k0, wf[u]);
        else
          wf[u][0] = __bfloat162float(w[o * ldw + k0]);
      }
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        const int64_t o = o0 + u * kDgradWarps;
        if (o >= o_end) break;
#pragma unroll
        for (int n = 0; n < kN; ++n) {
          if (n >= rows) break;
          const float d = __bfloat162float(dy[n * lddy + o]);
#pragma unroll
          for (int j = 0; j < kW; ++j) acc[n][j] = fmaf(d, wf[u][j], acc[n][j]);
        }
      }
    }
  }
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int j = 0; j < kW; ++j) sums[warp][n][lane * kW + j] = acc[n][j];
  __syncthreads();
  for (int i = threadIdx.x; i < rows * kCols; i += blockDim.x) {
    const int n = i / kCols, c = i % kCols, k = blockIdx.x * kCols + c;
    if (k >= K) continue;
    float t = sums[0][n][c];
#pragma unroll
    for (int v = 1; v < kDgradWarps; ++v) t += sums[v][n][c];
    partial[(static_cast<int64_t>(blockIdx.y) * rows + n) * K + k] = t;
  }
}

// dx[n, k] = (dx +) Σ_span partial[span][n][k], the spans in order.
template <typename TX>
__global__ void __launch_bounds__(kThreads) skinny_reduce_kernel(const float* __restrict__ partial, int spans,
                                                                 int rows, int K, TX* __restrict__ dx, int64_t lddx,
                                                                 bool accumulate) {
  const int64_t n_items = static_cast<int64_t>(rows) * K;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_items;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / K, k = i % K;
    float t = 0.0f;
    for (int s = 0; s < spans; ++s) t += partial[(static_cast<int64_t>(s) * rows + n) * K + k];
    TX& out = dx[n * lddx + k];
    store(out, accumulate ? load(out) + t : t);
  }
}

// ---- wgrad: a thread per kW consecutive columns of dw, kWgradRows rows of it ----------------
constexpr int kWgradRows = 16;

template <int kN, bool kVec>
__global__ void __launch_bounds__(kThreads) skinny_wgrad_kernel(const bf16* __restrict__ dy, int64_t lddy,
                                                                const bf16* __restrict__ x, int64_t ldx,
                                                                float* __restrict__ dw, int64_t lddw, int rows, int K,
                                                                int64_t M, bool accumulate) {
  constexpr int kW = kVec ? 4 : 1;
  const int k0 = (blockIdx.x * blockDim.x + threadIdx.x) * kW;
  if (k0 >= K) return;  // kVec: K % 4 == 0, so the thread's 4 columns are all inside
  float xs[kN][kW];
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int j = 0; j < kW; ++j) xs[n][j] = 0.0f;
    if (n >= rows) continue;
    if constexpr (kVec) {
      const float4 v = load4(x + n * ldx + k0);
      xs[n][0] = v.x, xs[n][1] = v.y, xs[n][2] = v.z, xs[n][3] = v.w;
    } else {
      xs[n][0] = __bfloat162float(x[n * ldx + k0]);
    }
  }
  const int64_t o_begin = static_cast<int64_t>(blockIdx.y) * kWgradRows;
  const int64_t o_end = o_begin + kWgradRows < M ? o_begin + kWgradRows : M;
  for (int64_t o = o_begin; o < o_end; ++o) {
    float v[kW];
#pragma unroll
    for (int j = 0; j < kW; ++j) v[j] = 0.0f;
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      if (n >= rows) break;
      const float d = __bfloat162float(dy[n * lddy + o]);
#pragma unroll
      for (int j = 0; j < kW; ++j) v[j] = fmaf(d, xs[n][j], v[j]);
    }
    float* dst = dw + o * lddw + k0;
    if constexpr (kVec) {
      float4 r = make_float4(v[0], v[1], v[2], v[3]);
      if (accumulate) {
        const float4 old = load4(dst);
        r.x += old.x, r.y += old.y, r.z += old.z, r.w += old.w;
      }
      store4(dst, r);
    } else {
      *dst = accumulate ? *dst + v[0] : v[0];
    }
  }
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

void require_rows(int64_t N) {
  if (N < 1 || N > kSkinnyRows) fail("skinny linear kernels take 1 to {} rows, not {}", kSkinnyRows, N);
}

}  // namespace

int64_t skinny_products() { return g_products.load(); }

bool skinny_enabled() {
  const char* e = std::getenv("FLUX8_LINEAR_SKINNY");
  return !(e && std::string_view(e) == "0");
}

void skinny_fprop(CudaBackend& be, Bf16Rows x, Bf16Rows w, const float* bias, const Tensor& y, int64_t N, int64_t K,
                  int64_t M) {
  require_rows(N);
  const bool vec = K % 8 == 0 && x.ld % 8 == 0 && w.ld % 8 == 0 && aligned(x.p, 16) && aligned(w.p, 16);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((M + 7) / 8, 16384));  // a warp per row
  auto launch = [&]<int kN, bool kVec, typename TY>() {
    skinny_fprop_kernel<kN, kVec, TY><<<blocks, kThreads, 0, be.stream()>>>(
        x.p, x.ld, w.p, w.ld, bias, static_cast<TY*>(y.data), y.ld, static_cast<int>(N), static_cast<int>(K), M);
    FLUX8_LAUNCH_CHECK(skinny_fprop_kernel);
  };
  auto by_type = [&]<int kN, bool kVec>() {
    if (y.dtype == DType::bf16)
      launch.template operator()<kN, kVec, bf16>();
    else
      launch.template operator()<kN, kVec, float>();
  };
  auto by_vec = [&]<int kN>() {
    if (vec)
      by_type.template operator()<kN, true>();
    else
      by_type.template operator()<kN, false>();
  };
  if (N <= 2)
    by_vec.template operator()<2>();
  else if (N <= 4)
    by_vec.template operator()<4>();
  else
    by_vec.template operator()<8>();
  ++g_products;
}

void skinny_dgrad(CudaBackend& be, Bf16Rows dy, Bf16Rows w, const Tensor& dx, int64_t N, int64_t K, int64_t M,
                  bool accumulate) {
  require_rows(N);
  const bool vec = K % 8 == 0 && w.ld % 8 == 0 && aligned(w.p, 16);
  const int64_t cols_per_block = vec ? 256 : 32;
  const int64_t col_blocks = (K + cols_per_block - 1) / cols_per_block;
  // Spans of w's rows: enough blocks for ~8 per SM (each keeps 4 warps of weight loads in
  // flight), but spans of at least 64 rows, so the partials stay a few percent of w's bytes.
  // The spans (the order of the sum) depend on K and M only, not on which path the call's
  // alignment allows: a tensor placed elsewhere gives the same bits.
  const int64_t vector_blocks = (K + 255) / 256;
  const int64_t spans = std::clamp<int64_t>((1056 + vector_blocks - 1) / vector_blocks, 1, std::max<int64_t>(1, M / 64));
  const int64_t span = (M + spans - 1) / spans, used = (M + span - 1) / span;
  auto* partial = static_cast<float*>(be.reduction_scratch(static_cast<size_t>(used * N * K) * sizeof(float)));
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(used));
  auto launch = [&]<int kN, bool kVec>() {
    skinny_dgrad_kernel<kN, kVec><<<grid, 32 * kDgradWarps, 0, be.stream()>>>(
        dy.p, dy.ld, w.p, w.ld, partial, static_cast<int>(N), static_cast<int>(K), M, span);
    FLUX8_LAUNCH_CHECK(skinny_dgrad_kernel);
  };
  auto by_vec = [&]<int kN>() {
    if (vec)
      launch.template operator()<kN, true>();
    else
      launch.template operator()<kN, false>();
  };
  if (N <= 2)
    by_vec.template operator()<2>();
  else if (N <= 4)
    by_vec.template operator()<4>();
  else
    by_vec.template operator()<8>();
  const unsigned blocks = blocks_for(N * K);
  if (dx.dtype == DType::bf16)
    skinny_reduce_kernel<bf16><<<blocks, kThreads, 0, be.stream()>>>(
        partial, static_cast<int>(used), static_cast<int>(N), static_cast<int>(K), dx.ptr<bf16>(), dx.ld, accumulate);
  else
    skinny_reduce_kernel<float><<<blocks, kThreads, 0, be.stream()>>>(
        partial, static_cast<int>(used), static_cast<int>(N), static_cast<int>(K), dx.ptr<float>(), dx.ld, accumulate);
  FLUX8_LAUNCH_CHECK(skinny_reduce_kernel);
  ++g_products;
}

void skinny_wgrad(CudaBackend& be, Bf16Rows dy, Bf16Rows x, const Tensor& dw, int64_t N, int64_t K, int64_t M,
                  bool accumulate) {
  require_rows(N);
  const bool vec = K % 4 == 0 && x.ld % 4 == 0 && dw.ld % 4 == 0 && aligned(x.p, 8) && aligned(dw.data, 16);
  const int64_t cols_per_block = vec ? 4 * kThreads : kThreads;
  const dim3 grid(static_cast<unsigned>((K + cols_per_block - 1) / cols_per_block),
                  static_cast<unsigned>((M + kWgradRows - 1) / kWgradRows));
  auto launch = [&]<int kN, bool kVec>() {
    skinny_wgrad_kernel<kN, kVec><<<grid, kThreads, 0, be.stream()>>>(
        dy.p, dy.ld, x.p, x.ld, dw.ptr<float>(), dw.ld, static_cast<int>(N), static_cast<int>(K), M, accumulate);
    FLUX8_LAUNCH_CHECK(skinny_wgrad_kernel);
  };
  auto by_vec = [&]<int kN>() {
    if (vec)
      launch.template operator()<kN, true>();
    else
      launch.template operator()<kN, false>();
  };
  if (N <= 2)
    by_vec.template operator()<2>();
  else if (N <= 4)
    by_vec.template operator()<4>();
  else
    by_vec.template operator()<8>();
  ++g_products;
}

}  // namespace flux8::cuda
