// Modulated LayerNorm (adaLN) and the per-head RMSNorm of QK-norm on the device. As on the CPU
// (src/backend/cpu/norms.cpp), the variance is two-pass, mean/rstd are stored as f32 and both
// passes normalise with the stored values; every sum has a fixed order. Unlike the CPU, which
// sums rows in double, LayerNorm computes in f32 per element (see "LayerNorm with a row in
// registers"): the results differ from the CPU's by f32 rounding (~1e-7 relative). One block
// per LayerNorm row (or per chunk of rows in the backward), one warp per RMSNorm head segment.
// LayerNorm's activations may be bf16 (Backend::activation_dtype; statistics stay f32),
// RMSNorm's are f32.
#include <cuda_pipeline.h>

#include <algorithm>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/pointwise.cuh"

namespace flux8 {
using namespace cuda;

namespace {

// Sum over the 32 lanes of a warp (xor butterfly: the same order on every run).
__device__ inline double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- LayerNorm with a row in registers ---------------------------------------------------
// A thread holds kGroups groups of kV consecutive columns of a row, group i at columns
// kV·(threadIdx.x + i·kThr) ...: kV = 4 where every row of every operand starts 4-element aligned
// (one 16-byte f32 / 8-byte bf16 access per group: vec4_rows), kV = 1 otherwise. Per element
// the arithmetic is f32; row sums are combined across the block in a fixed order (warp
// butterflies, then the warps' totals in warp order), so results are the same on every run.
// Double per element, as the CPU twin computes, made these kernels bound by instruction issue:
// f32↔f64 conversions issue at 16 per SM and cycle on Hopper, a quarter of the f32 rate, and the
// double shuffles and shared-memory sums cost two instructions each.
template <int kV, int kThr>
__device__ inline int64_t row_column(int k) {
  return (threadIdx.x + int64_t(k / kV) * kThr) * kV + k % kV;
}

// kV consecutive elements of row r from column j as f32 (one access for kV = 4), and back.
template <int kV, typename T>
__device__ inline void load_vec(const MatOf<T>& m, int64_t r, int64_t j, float* v) {
  if constexpr (kV == 1) {
    v[0] = m.get(r, j);
  } else {
    static_assert(kV == 4, "groups are of 1 or 4 columns");
    const float4 q = load4(&m.at(r, j));
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  }
}
template <int kV, typename T>
__device__ inline void store_vec(const MatOf<T>& m, int64_t r, int64_t j, const float* v) {
  if constexpr (kV == 1) {
    m.set(r, j, v[0]);
  } else {
    static_assert(kV == 4, "groups are of 1 or 4 columns");
    store4(&m.at(r, j), make_float4(v[0], v[1], v[2], v[3]));
  }
}

// Block-wide sums of N values per thread, returned to every thread: warp butterflies, then each
// thread adds the warps' totals in warp order. `sh` is double-buffered by `parity` (flipped
// here), so one barrier per call suffices: a thread writes a buffer again only after the next
// call's barrier, which every thread reaches after reading this call's totals.
template <int N, int kWarps>
__device__ inline void block_sums(float (&v)[N], float (&sh)[2][kWarps][N], int& parity) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < N; ++i)
    for (int o = 16; o > 0; o >>= 1) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
  if (lane == 0)
#pragma unroll
    for (int i = 0; i < N; ++i) sh[parity][warp][i] = v[i];
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) t += sh[parity][w][i];
    v[i] = t;
  }
  parity ^= 1;
}

// A row's mean, then its two-pass variance (no cancellation for rows with a large mean), from
// the row in registers: this thread's columns row_column(k) < H in xv, the block's in column
// order. The statistics of layernorm_modulate_kernel and gated_residual_stats_kernel alike, so
// the two give the same bits for the same row.
template <int kV, int kThr, int kGroups>
__device__ inline void row_statistics(const float (&xv)[kV * kGroups], int64_t H, float eps,
                                      float (&sh)[2][kThr / 32][1], int& parity, float& mu, float& rs) {
  constexpr int kCols = kV * kGroups;
  const float h = static_cast<float>(H);
  float s[1] = {0.0f};
#pragma unroll
  for (int k = 0; k < kCols; k += kV)
    if (row_column<kV, kThr>(k) < H)
#pragma unroll
      for (int e = 0; e < kV; ++e) s[0] += xv[k + e];
  block_sums(s, sh, parity);
  mu = s[0] / h;
  float sq[1] = {0.0f};
#pragma unroll
  for (int k = 0; k < kCols; k += kV)
    if (row_column<kV, kThr>(k) < H)
#pragma unroll
      for (int e = 0; e < kV; ++e) sq[0] += (xv[k + e] - mu) * (xv[k + e] - mu);
  block_sums(sq, sh, parity);
  rs = 1.0f / sqrtf(sq[0] / h + eps);
}

// Row r per block: the statistics (row_statistics), y from the same registers: x is read once.
template <typename T, int kV, int kThr, int kGroups>
__global__ void __launch_bounds__(kThr)
    layernorm_modulate_kernel(MatOf<T> y, float* mean, float* rstd, MatOf<T> x, MatOf<T> shift, MatOf<T> scale,
                              int64_t L, float eps) {
  constexpr int kCols = kV * kGroups, kWarps = kThr / 32;
  __shared__ float sh[2][kWarps][1];
  int parity = 0;
  const int64_t r = blockIdx.x, H = x.cols;
  float xv[kCols];
#pragma unroll
  for (int k = 0; k < kCols; k += kV) {
    const int64_t j = row_column<kV, kThr>(k);
    if (j < H) load_vec<kV>(x, r, j, xv + k);
  }
  float mu, rs;
  row_statistics<kV, kThr, kGroups>(xv, H, eps, sh, parity, mu, rs);
  if (threadIdx.x == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
  if (!y.p) return;  // statistics only (a fused cast makes y)
  const int64_t b = r / L;
#pragma unroll
  for (int k = 0; k < kCols; k += kV) {
    const int64_t j = row_column<kV, kThr>(k);
    if (j >= H) continue;
    float sv[kV], cv[kV], out[kV];
    load_vec<kV>(shift, b, j, sv);
    load_vec<kV>(scale, b, j, cv);
#pragma unroll
    for (int e = 0; e < kV; ++e) out[e] = layernorm_modulate_value(xv[k + e], mu, rs, sv[e], cv[e]);
    store_vec<kV>(y, r, j, out);
  }
}

// gated_residual_stats on row r per block: out = x + gate[b] ⊙ y, one fused multiply-add an
// element as gated_residual computes it, stored; then the statistics of the stored (rounded)
// values as layernorm_modulate_kernel computes them from out, written at (b, l) of mean and
// rstd [B, L] with row stride stats_ld. The next LayerNorm's pass over out (its statistics
// alone, in FP8) is saved for two block-wide sums here.
template <typename T, int kV, int kThr, int kGroups>
__global__ void __launch_bounds__(kThr)
    gated_residual_stats_kernel(MatOf<T> out, float* mean, float* rstd, int64_t stats_ld, MatOf<T> x, MatOf<T> y,
                                MatOf<T> gate, int64_t L, float eps) {
  constexpr int kCols = kV * kGroups, kWarps = kThr / 32;
  __shared__ float sh[2][kWarps][1];
  int parity = 0;
  const int64_t r = blockIdx.x, H = x.cols, b = r / L;
  float ov[kCols];
#pragma unroll
  for (int k = 0; k < kCols; k += kV) {
    const int64_t j = row_column<kV, kThr>(k);
    if (j >= H) continue;
    float xv[kV], yv[kV], gv[kV];
    load_vec<kV>(x, r, j, xv);
    load_vec<kV>(y, r, j, yv);
    load_vec<kV>(gate, b, j, gv);
#pragma unroll
    for (int e = 0; e < kV; ++e) ov[k + e] = __fmaf_rn(gv[e], yv[e], xv[e]);
    store_vec<kV>(out, r, j, ov + k);
#pragma unroll
    for (int e = 0; e < kV; ++e) ov[k + e] = as_stored<T>(ov[k + e]);
  }
  float mu, rs;
  row_statistics<kV, kThr, kGroups>(ov, H, eps, sh, parity, mu, rs);
  if (threadIdx.x == 0) {
    const int64_t at = b * stats_ld + (r - b * L);
    mean[at] = mu;
    rstd[at] = rs;
  }
}

// Where ln_backward_rows reads row r + q's dy, x and (accumulating) old dx, group k at column j:
// device memory (GlobalRows), or a thread's own slots of a shared-memory stage that cp.async
// filled ahead (StagedRows, the staged kernel below).
template <typename T, int kV>
struct GlobalRows {
  const MatOf<T>&dy, &x, &dx;
  int64_t r;
  __device__ void dy_x(int q, int, int64_t j, float* dyv, float* xv) const {
    load_vec<kV>(dy, r + q, j, dyv);
    load_vec<kV>(x, r + q, j, xv);
  }
  __device__ void old_dx(int q, int, int64_t j, float* v) const { load_vec<kV>(dx, r + q, j, v); }
};

// kR consecutive rows r.. of the one-pass backward below, their loads issued together and their
// row sums in one block_sums: two rows at a time keep twice the loads in flight per thread and
// halve the barriers (one row at a time the kernel is bound by memory latency, neither SM nor
// DRAM busy). 1 + scale is reloaded per step (L1-resident)
// rather than held, which pays for the second row's registers.
template <int kR, typename T, int kV, int kThr, int kGroups, typename Rows>
__device__ inline void ln_backward_rows(const Rows& rows, const MatOf<T>& dx, const float* mean, const float* rstd,
                                        const MatOf<T>& scale, int64_t b, int64_t r, int64_t H, float inv_h,
                                        bool accumulate, float (&acc_shift)[kV * kGroups],
                                        float (&acc_scale)[kV * kGroups], float (&sh)[2][kThr / 32][4], int& parity) {
  constexpr int kCols = kV * kGroups;
  float dyv[kR][kCols], xhat[kR][kCols], mu[kR], rs[kR];
#pragma unroll
  for (int q = 0; q < kR; ++q) {
    mu[q] = mean[r + q], rs[q] = rstd[r + q];
#pragma unroll
    for (int k = 0; k < kCols; k += kV) {
      const int64_t j = row_column<kV, kThr>(k);
      if (j < H) {
        rows.dy_x(q, k / kV, j, dyv[q] + k, xhat[q] + k);
      } else {
#pragma unroll
        for (int e = 0; e < kV; ++e) dyv[q][k + e] = xhat[q][k + e] = 0.0f;
      }
    }
  }
  float one_plus[kCols];  // 1 + scale; 0 past the row's end
#pragma unroll
  for (int k = 0; k < kCols; k += kV) {
    const int64_t j = row_column<kV, kThr>(k);
    if (j < H) {
      load_vec<kV>(scale, b, j, one_plus + k);
#pragma unroll
      for (int e = 0; e < kV; ++e) one_plus[k + e] += 1.0f;
    } else {
#pragma unroll
      for (int e = 0; e < kV; ++e) one_plus[k + e] = 0.0f;
    }
  }
  float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // per row q: Σ g at 2q, Σ g·x̂ at 2q + 1
#pragma unroll
  for (int q = 0; q < kR; ++q)
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      xhat[q][k] = (xhat[q][k] - mu[q]) * rs[q];  // past the row's end dy and 1 + scale are 0: no terms
      const float g = dyv[q][k] * one_plus[k];
      sums[2 * q] += g;
      sums[2 * q + 1] += g * xhat[q][k];
      acc_shift[k] += dyv[q][k];
      acc_scale[k] += dyv[q][k] * xhat[q][k];
    }
  block_sums(sums, sh, parity);
  if (!dx.p) return;
#pragma unroll
  for (int q = 0; q < kR; ++q) {
    const float mean_g = sums[2 * q] * inv_h, mean_gx = sums[2 * q + 1] * inv_h;
#pragma unroll
    for (int k = 0; k < kCols; k += kV) {
      const int64_t j = row_column<kV, kThr>(k);
      if (j >= H) continue;
      float v[kV], old[kV];
      if (accumulate) rows.old_dx(q, k / kV, j, old);
#pragma unroll
      for (int e = 0; e < kV; ++e) {
        v[e] = rs[q] * (dyv[q][k + e] * one_plus[k + e] - mean_g - xhat[q][k + e] * mean_gx);
        if (accumulate) v[e] = old[e] + v[e];
      }
      store_vec<kV>(dx, r + q, j, v);
    }
  }
}

// The rows of the one-pass backward's block (blockIdx.x: chunk of `rows` rows, blockIdx.y:
// sample b of L rows): [begin, end), the last chunk of a sample cut at its end.
struct LnBlockRows {
  int64_t b, chunk, begin, end;
};
__device__ inline LnBlockRows ln_block_rows(int64_t L, int64_t rows) {
  const int64_t b = blockIdx.y, chunk = blockIdx.x, begin = b * L + chunk * rows;
  return {b, chunk, begin, begin + rows < (b + 1) * L ? begin + rows : (b + 1) * L};
}

// A block's dshift/dscale column partials (f32 sums over its rows, stored as double).
template <int kV, int kThr, int kGroups>
__device__ inline void write_ln_partials(const float (&acc_shift)[kV * kGroups], const float (&acc_scale)[kV * kGroups],
                                         double* shift_partial, double* scale_partial, int64_t base, int64_t H) {
#pragma unroll
  for (int k = 0; k < kV * kGroups; ++k) {
    const int64_t j = row_column<kV, kThr>(k);
    if (j >= H) continue;
    if (shift_partial) shift_partial[base + j] = acc_shift[k];
    if (scale_partial) scale_partial[base + j] = acc_scale[k];
  }
}

// The whole LayerNorm backward in one pass over dy and x: a block takes `rows` rows of one
// sample (grid: chunks x samples), its threads the row's columns as above, two rows at a time
// (ln_backward_rows). Per row it forms dx = rstd·(g − mean(g) − x̂·mean(g·x̂)), g = dy·(1 +
// scale), and it accumulates the columns' dshift = Σ dy and dscale = Σ dy·x̂ over its ≤ 32 rows
// in f32 (in row order), written as double per-chunk partials that are then added in chunk
// order. Rows in 4-column groups (kV = 4) take the staged variant below, which reads the same
// values from shared memory.
template <typename T, int kV, int kThr, int kGroups>
__global__ void __launch_bounds__(kThr, 2)
    layernorm_modulate_backward_kernel(MatOf<T> dx, MatOf<T> dy, MatOf<T> x, const float* mean, const float* rstd,
                                       MatOf<T> scale, int64_t L, int64_t rows, bool accumulate, double* shift_partial,
                                       double* scale_partial, int64_t chunks) {
  constexpr int kCols = kV * kGroups, kWarps = kThr / 32;
  __shared__ float sh[2][kWarps][4];
  int parity = 0;
  const int64_t H = x.cols;
  const float inv_h = 1.0f / static_cast<float>(H);  // × 1/H: a division per row sum took a dozen instructions
  const auto [b, chunk, begin, end] = ln_block_rows(L, rows);
  float acc_shift[kCols], acc_scale[kCols];
#pragma unroll
  for (int k = 0; k < kCols; ++k) acc_shift[k] = acc_scale[k] = 0.0f;
  int64_t r = begin;
  for (; r + 2 <= end; r += 2)
    ln_backward_rows<2, T, kV, kThr, kGroups>(GlobalRows<T, kV>{dy, x, dx, r}, dx, mean, rstd, scale, b, r, H, inv_h,
                                              accumulate, acc_shift, acc_scale, sh, parity);
  if (r < end)
    ln_backward_rows<1, T, kV, kThr, kGroups>(GlobalRows<T, kV>{dy, x, dx, r}, dx, mean, rstd, scale, b, r, H, inv_h,
                                              accumulate, acc_shift, acc_scale, sh, parity);
  write_ln_partials<kV, kThr, kGroups>(acc_shift, acc_scale, shift_partial, scale_partial, (b * chunks + chunk) * H, H);
}

// The staged variant (every operand's rows in aligned 4-column groups): the same rows, sums and
// order, but each thread copies its own columns of the rows kStages − 1 pairs ahead into
// shared memory with cp.async (dy, x and, when accumulating, the old dx) and reads the current
// pair from there. The kernel above leaves its warps mostly stalled on their loads at low
// occupancy — a block issues a pair's loads only after the previous pair's barrier. A thread reads back only the slots
// it filled itself, so the stages need no barrier beyond cp.async's own wait.
template <typename T, int kThr, int kGroups>
struct StagedRows {
  static constexpr int kV = 4, kSlot = kGroups * kThr * kV;  // one row of one tensor
  static constexpr int kStage = 3 * 2 * kSlot;               // dy, x, old dx of two rows
  const T* stage;
  __device__ const T* slot(int tensor, int q, int g) const {
    return stage + (tensor * 2 + q) * kSlot + (g * kThr + threadIdx.x) * kV;
  }
  __device__ static void widen4(const T* p, float* v) {
    const float4 f = load4(p);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  }
  __device__ void dy_x(int q, int g, int64_t, float* dyv, float* xv) const {
    widen4(slot(0, q, g), dyv);
    widen4(slot(1, q, g), xv);
  }
  __device__ void old_dx(int q, int g, int64_t, float* v) const { widen4(slot(2, q, g), v); }
  // Rows r, r + 1 (those before end) into `st`, as this thread will read them; one cp.async group
  // (committed even when empty, so that groups and stages stay in step). One row pointer per
  // tensor and row, the groups at constant offsets from it (kThr·kV elements apart): the copies
  // take no 64-bit index arithmetic of their own.
  __device__ static void issue(T* st, const MatOf<T>& dy, const MatOf<T>& x, const MatOf<T>& dx, bool old, int64_t r,
                               int64_t end, int64_t H) {
    const int c = threadIdx.x * kV;
    T* const s = st + c;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      if (r + q >= end) break;
      const T* const dyr = dy.p + (r + q) * dy.ld + c;
      const T* const xr = x.p + (r + q) * x.ld + c;
      const T* const dxr = old ? dx.p + (r + q) * dx.ld + c : nullptr;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        if (c + g * kThr * kV >= H) break;  // the groups past the row's end: none of their columns exist
        const int o = g * kThr * kV;
        __pipeline_memcpy_async(s + (0 * 2 + q) * kSlot + o, dyr + o, kV * sizeof(T));
        __pipeline_memcpy_async(s + (1 * 2 + q) * kSlot + o, xr + o, kV * sizeof(T));
        if (old) __pipeline_memcpy_async(s + (2 * 2 + q) * kSlot + o, dxr + o, kV * sizeof(T));
      }
    }
    __pipeline_commit();
  }
};

template <typename T, int kThr, int kGroups, int kStages>
__global__ void __launch_bounds__(kThr, 2)
    layernorm_modulate_backward_staged_kernel(MatOf<T> dx, MatOf<T> dy, MatOf<T> x, const float* mean,
                                              const float* rstd, MatOf<T> scale, int64_t L, int64_t rows,
                                              bool accumulate, double* shift_partial, double* scale_partial,
                                              int64_t chunks) {
  using Rows = StagedRows<T, kThr, kGroups>;
  constexpr int kV = 4, kCols = kV * kGroups, kWarps = kThr / 32;
  extern __shared__ float4 staged_smem[];  // kStages stages of Rows::kStage elements
  T* const stages = reinterpret_cast<T*>(staged_smem);
  __shared__ float sh[2][kWarps][4];
  int parity = 0;
  const int64_t H = x.cols;
  const float inv_h = 1.0f / static_cast<float>(H);
  const auto [b, chunk, begin, end] = ln_block_rows(L, rows);
  const bool old = accumulate && dx.p;
  float acc_shift[kCols], acc_scale[kCols];
#pragma unroll
  for (int k = 0; k < kCols; ++k) acc_shift[k] = acc_scale[k] = 0.0f;
  int64_t next = begin;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s, next += 2) Rows::issue(stages + s * Rows::kStage, dy, x, dx, old, next, end, H);
  int stage = 0;
  for (int64_t r = begin; r < end; r += 2, next += 2) {
    // Refill the stage the previous pair was read from (this thread's own slots: its reads of
    // them are done), then wait for the current pair's group.
    Rows::issue(stages + (stage + kStages - 1) % kStages * Rows::kStage, dy, x, dx, old, next, end, H);
    __pipeline_wait_prior(kStages - 1);
    const Rows cur{stages + stage * Rows::kStage};
    if (r + 2 <= end)
      ln_backward_rows<2, T, kV, kThr, kGroups>(cur, dx, mean, rstd, scale, b, r, H, inv_h, accumulate, acc_shift,
                                                acc_scale, sh, parity);
    else
      ln_backward_rows<1, T, kV, kThr, kGroups>(cur, dx, mean, rstd, scale, b, r, H, inv_h, accumulate, acc_shift,
                                                acc_scale, sh, parity);
    stage = (stage + 1) % kStages;
  }
  write_ln_partials<kV, kThr, kGroups>(acc_shift, acc_scale, shift_partial, scale_partial, (b * chunks + chunk) * H, H);
}

// Calls f.template operator()<kV, kThr, kGroups>() with the variant for rows of H columns (vec4:
// every operand's rows in aligned groups of 4), or returns false beyond 4096 columns. 256
// threads of 12 columns for Flux's 3072: fewer threads a row means fewer warps' totals to add
// per row sum, which with 768 threads of 4 columns cost more instructions than the elements.
template <typename F>
bool with_row_variant(int64_t H, bool vec4, F&& f) {
  if (vec4) {
    if (H <= 512)
      f.template operator()<4, 128, 1>();
    else if (H <= 1024)
      f.template operator()<4, 256, 1>();
    else if (H <= 2048)
      f.template operator()<4, 256, 2>();
    else if (H <= 3072)
      f.template operator()<4, 256, 3>();
    else if (H <= 4096)
      f.template operator()<4, 256, 4>();
    else
      return false;
  } else {
    if (H <= 256)
      f.template operator()<1, 256, 1>();
    else if (H <= 512)
      f.template operator()<1, 256, 2>();
    else if (H <= 1024)
      f.template operator()<1, 256, 4>();
    else if (H <= 2048)
      f.template operator()<1, 512, 4>();
    else if (H <= 3072)
      f.template operator()<1, 512, 6>();
    else if (H <= 4096)
      f.template operator()<1, 512, 8>();
    else
      return false;
  }
  return true;
}

// Rows wider than 4096 columns: one block per row, looping over the columns (f32 per element,
// the thread sums combined in double).
template <typename T>
__global__ void layernorm_modulate_wide_kernel(MatOf<T> y, float* mean, float* rstd, MatOf<T> x, MatOf<T> shift,
                                               MatOf<T> scale, int64_t L, float eps) {
  __shared__ double sh[kThreads];
  const int64_t r = blockIdx.x, H = x.cols, b = r / L;
  float s = 0;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) s += x.get(r, j);
  const float mu = static_cast<float>(block_sum(double(s), sh) / static_cast<double>(H));
  float sq = 0;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) sq += (x.get(r, j) - mu) * (x.get(r, j) - mu);
  const float rs = static_cast<float>(1.0 / sqrt(block_sum(double(sq), sh) / static_cast<double>(H) + eps));
  if (threadIdx.x == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
  if (!y.p) return;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x)
    y.set(r, j, layernorm_modulate_value(x.get(r, j), mu, rs, shift.get(b, j), scale.get(b, j)));
}

template <typename T>
__global__ void layernorm_modulate_dx_kernel(MatOf<T> dx, MatOf<T> dy, MatOf<T> x, const float* mean, const float* rstd,
                                             MatOf<T> scale, int64_t L, bool accumulate) {
  __shared__ double sh[kThreads];
  const int64_t r = blockIdx.x, H = x.cols, b = r / L;
  const float mu = mean[r], rs = rstd[r];
  float sg = 0, sgx = 0;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const float g = dy.get(r, j) * (1.0f + scale.get(b, j));
    sg += g;
    sgx += g * ((x.get(r, j) - mu) * rs);
  }
  const float mean_g = static_cast<float>(block_sum(double(sg), sh) / static_cast<double>(H));
  const float mean_gx = static_cast<float>(block_sum(double(sgx), sh) / static_cast<double>(H));
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const float g = dy.get(r, j) * (1.0f + scale.get(b, j));
    const float v = rs * (g - mean_g - (x.get(r, j) - mu) * rs * mean_gx);
    dx.set(r, j, accumulate ? dx.get(r, j) + v : v);
  }
}

// Rows of one sample per block of the one-pass backward: about ceil(B·L / kLnSlots) (2 blocks per
// SM of kReferenceSms) so that the grid is about one wave, at most 64 (fewer partials to
// write and add). Where that leaves a short last wave, fewer rows a block can do better: a
// block walks its rows one pair after another, so a call takes about (waves) x (rows a block)
// pair steps, and the count is the one between half that first choice and itself that makes
// the product smallest (ties to more rows): a short second wave costs more than the partials
// that fewer rows a block add (docs/PERFORMANCE.md, Measurements behind the kernels). Searching
// all of 1..64 would pick 7 or 9 rows, hundreds of partials a
// sample. A function of the shape only, so the order of the dshift/dscale sums, and their
// bits, are the same on every run and every GPU.
constexpr int64_t kLnMaxRows = 64, kLnSlots = 2 * kReferenceSms;
int64_t ln_rows_per_block(int64_t B, int64_t L) {
  const int64_t first = std::clamp<int64_t>((B * L + kLnSlots - 1) / kLnSlots, 1, kLnMaxRows);
  int64_t best = first, best_cost = -1;
  for (int64_t r = first; r >= (first + 1) / 2; --r) {
    const int64_t blocks = B * ((L + r - 1) / r), cost = (blocks + kLnSlots - 1) / kLnSlots * r;
    if (best_cost < 0 || cost < best_cost) best = r, best_cost = cost;
  }
  return best;
}

__global__ void rmsnorm_heads_kernel(Mat y, float* rstd, Mat x, const float* scale, int64_t D, int64_t n,
                                     int64_t segments, double eps) {
  const int64_t seg = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (seg >= segments) return;  // whole warps leave together (segments are warp-aligned)
  const int64_t r = seg / n, off = (seg % n) * D;
  double sq = 0;
  for (int64_t d = lane; d < D; d += 32) {
    const double v = x.at(r, off + d);
    sq += v * v;
  }
  sq = warp_sum(sq);
  const float rs = static_cast<float>(1.0 / sqrt(sq / static_cast<double>(D) + eps));
  if (lane == 0) rstd[seg] = rs;
  for (int64_t d = lane; d < D; d += 32) y.at(r, off + d) = x.at(r, off + d) * rs * scale[d];
}

__global__ void rmsnorm_heads_dx_kernel(Mat dx, Mat dy, Mat x, const float* rstd, const float* scale, int64_t D,
                                        int64_t n, int64_t segments) {
  const int64_t seg = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (seg >= segments) return;
  const int64_t r = seg / n, off = (seg % n) * D;
  const double rs = rstd[seg];
  double s = 0;
  for (int64_t d = lane; d < D; d += 32) s += static_cast<double>(dy.at(r, off + d)) * scale[d] * x.at(r, off + d) * rs;
  const double mean_gx = warp_sum(s) / static_cast<double>(D);
  for (int64_t d = lane; d < D; d += 32) {
    const double g = static_cast<double>(dy.at(r, off + d)) * scale[d];
    dx.at(r, off + d) = static_cast<float>(rs * (g - x.at(r, off + d) * rs * mean_gx));
  }
}

template <typename T>
void layernorm_modulate_as(CudaBackend& be, const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                           const Tensor& shift, const Tensor& scale, int64_t rows, int64_t L, double eps) {
  const MatOf<T> Y = mat_of_or_null<T>(y), X = mat_of<T>(x), SH = mat_of<T>(shift), SC = mat_of<T>(scale);
  const unsigned grid = static_cast<unsigned>(rows);
  const bool vec4 = vec4_rows(X) && vec4_rows(SH) && vec4_rows(SC) && (!Y.p || vec4_rows(Y));
  const bool launched = with_row_variant(x.shape[2], vec4, [&]<int kV, int kThr, int kGroups>() {
    layernorm_modulate_kernel<T, kV, kThr, kGroups><<<grid, kThr, 0, be.stream()>>>(
        Y, mean.ptr<float>(), rstd.ptr<float>(), X, SH, SC, L, static_cast<float>(eps));
    FLUX8_LAUNCH_CHECK(layernorm_modulate_kernel);
  });
  if (launched) return;
  layernorm_modulate_wide_kernel<T><<<grid, kThreads, 0, be.stream()>>>(Y, mean.ptr<float>(), rstd.ptr<float>(), X, SH,
                                                                        SC, L, static_cast<float>(eps));
  FLUX8_LAUNCH_CHECK(layernorm_modulate_wide_kernel);
}

// The one-pass backward (H ≤ 4096, B ≤ 65535), for activations of type T.
template <typename T>
void layernorm_modulate_backward_one_pass(CudaBackend& be, const Tensor& dx, const Tensor& dshift, const Tensor& dscale,
                                          const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                                          const Tensor& scale, bool accumulate_dx, int64_t B, int64_t L, int64_t H) {
  const int64_t rows = ln_rows_per_block(B, L), chunks = (L + rows - 1) / rows;
  const size_t partial_bytes = static_cast<size_t>(2 * B * chunks * H) * sizeof(double);
  double* partial =
      dshift.defined() || dscale.defined() ? static_cast<double*>(be.reduction_scratch(partial_bytes)) : nullptr;
  double* shift_partial = dshift.defined() ? partial : nullptr;
  double* scale_partial = dscale.defined() ? partial + B * chunks * H : nullptr;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(B));
  const MatOf<T> DX = mat_of_or_null<T>(dx), DY = mat_of<T>(dy), X = mat_of<T>(x), S = mat_of<T>(scale);
  const float *mu = mean.ptr<float>(), *rs = rstd.ptr<float>();
  const bool vec4 = vec4_rows(DY) && vec4_rows(X) && vec4_rows(S) && (!DX.p || vec4_rows(DX));
  const bool launched = with_row_variant(H, vec4, [&]<int kV, int kThr, int kGroups>() {
    if constexpr (kV == 4) {
      // Three stages of bf16 rows (two blocks of 111 KB per SM at H = 3072), two of f32.
      constexpr int kStages = sizeof(T) == 2 ? 3 : 2;
      constexpr size_t bytes = kStages * StagedRows<T, kThr, kGroups>::kStage * sizeof(T);
      static const bool configured = [] {
        FLUX8_CUDA_CHECK(cudaFuncSetAttribute(layernorm_modulate_backward_staged_kernel<T, kThr, kGroups, kStages>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
        return true;
      }();
      (void)configured;
      layernorm_modulate_backward_staged_kernel<T, kThr, kGroups, kStages><<<grid, kThr, bytes, be.stream()>>>(
          DX, DY, X, mu, rs, S, L, rows, accumulate_dx, shift_partial, scale_partial, chunks);
      FLUX8_LAUNCH_CHECK(layernorm_modulate_backward_staged_kernel);
    } else {
      layernorm_modulate_backward_kernel<T, kV, kThr, kGroups><<<grid, kThr, 0, be.stream()>>>(
          DX, DY, X, mu, rs, S, L, rows, accumulate_dx, shift_partial, scale_partial, chunks);
      FLUX8_LAUNCH_CHECK(layernorm_modulate_backward_kernel);
    }
  });
  if (!launched) fail("layernorm_modulate_backward: the one-pass kernel holds rows of up to 4096 columns, not {}", H);
  if (shift_partial) column_partials_total(be, B, H, chunks, shift_partial, dshift.ptr<T>(), dshift.ld, false);
  if (scale_partial) column_partials_total(be, B, H, chunks, scale_partial, dscale.ptr<T>(), dscale.ld, false);
}

// Rows wider than 4096 columns: dx one block per row, the column sums in their own passes.
template <typename T>
void layernorm_modulate_backward_passes(CudaBackend& be, const Tensor& dx, const Tensor& dshift, const Tensor& dscale,
                                        const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                                        const Tensor& scale, bool accumulate_dx, int64_t B, int64_t L, int64_t H) {
  if (dx.defined() && B * L > 0) {
    layernorm_modulate_dx_kernel<T><<<static_cast<unsigned>(B * L), kThreads, 0, be.stream()>>>(
        mat_of<T>(dx), mat_of<T>(dy), mat_of<T>(x), mean.ptr<float>(), rstd.ptr<float>(), mat_of<T>(scale), L,
        accumulate_dx);
    FLUX8_LAUNCH_CHECK(layernorm_modulate_dx_kernel);
  }
  const MatOf<T> DY = mat_of<T>(dy), X = mat_of<T>(x);
  const float *mu = mean.ptr<float>(), *rs = rstd.ptr<float>();
  if (dshift.defined())
    column_sums(
        be, B, L, H, [=] __device__(int64_t b, int64_t l, int64_t j) { return double(DY.get(b * L + l, j)); },
        dshift.ptr<T>(), dshift.ld, false);
  if (dscale.defined())
    column_sums(
        be, B, L, H,
        [=] __device__(int64_t b, int64_t l, int64_t j) {
          const int64_t r = b * L + l;
          return double(DY.get(r, j)) * ((double(X.get(r, j)) - mu[r]) * rs[r]);
        },
        dscale.ptr<T>(), dscale.ld, false);
}

}  // namespace

void CudaBackend::execute(const op::LayernormModulate& args) {
  constexpr std::string_view op = "layernorm_modulate";
  const bool bf = activations_in_bf16(op, tensor_fields(args, {"y", "x", "shift", "scale"}));
  const auto [B, L, H] = ops::check(op, args);
  require_f32(op, tensor_fields(args, {"mean", "rstd"}));  // statistics: f32 whatever the activations
  if (B * L == 0) return;
  if (bf)
    layernorm_modulate_as<__nv_bfloat16>(*this, args.y, args.mean, args.rstd, args.x, args.shift, args.scale, B * L, L,
                                         args.eps);
  else
    layernorm_modulate_as<float>(*this, args.y, args.mean, args.rstd, args.x, args.shift, args.scale, B * L, L,
                                 args.eps);
}

void CudaBackend::execute(const op::GatedResidualStats& args) {
  constexpr std::string_view op = "gated_residual_stats";
  const bool bf = activations_in_bf16(op, tensor_fields(args, {"out", "x", "y", "gate"}));
  ops::check(op, args);
  require_f32(op, tensor_fields(args, {"mean", "rstd"}));  // statistics: f32 whatever the activations
  if (args.rstd.ld != args.mean.ld)
    fail("{}: mean {} and rstd {} must share one row stride", op, args.mean.str(), args.rstd.str());
  const int64_t L = args.x.shape[1], rows = args.x.rows();
  if (rows == 0) return;
  const auto run = [&]<typename T>() {
    const MatOf<T> O = mat_of<T>(args.out), X = mat_of<T>(args.x), Y = mat_of<T>(args.y), G = mat_of<T>(args.gate);
    const bool vec4 = vec4_rows(O) && vec4_rows(X) && vec4_rows(Y) && vec4_rows(G);
    return with_row_variant(args.x.shape[2], vec4, [&]<int kV, int kThr, int kGroups>() {
      gated_residual_stats_kernel<T, kV, kThr, kGroups><<<static_cast<unsigned>(rows), kThr, 0, stream_>>>(
          O, args.mean.ptr<float>(), args.rstd.ptr<float>(), args.mean.ld, X, Y, G, L, static_cast<float>(args.eps));
      FLUX8_LAUNCH_CHECK(gated_residual_stats_kernel);
    });
  };
  const bool launched = bf ? run.template operator()<__nv_bfloat16>() : run.template operator()<float>();
  if (!launched) Backend::execute(args);  // rows wider than 4096
}

void CudaBackend::execute(const op::LayernormModulateBackward& args) {
  constexpr std::string_view op = "layernorm_modulate_backward";
  const bool bf = activations_in_bf16(op, tensor_fields(args, {"dx", "dshift", "dscale", "dy", "x", "scale"}));
  const auto [B, L, H] = ops::check(op, args);
  require_f32(op, tensor_fields(args, {"mean", "rstd"}));  // statistics: f32 whatever the activations
  if (args.dx.defined()) require_shape(op, {"dx", args.dx}, args.x.shape);
  if (args.dshift.defined()) require_shape(op, {"dshift", args.dshift}, Shape{B, H});
  if (args.dscale.defined()) require_shape(op, {"dscale", args.dscale}, Shape{B, H});
  if (!args.dx.defined() && !args.dshift.defined() && !args.dscale.defined()) return;
  if (B * L > 0 && H > 0 && H <= 4096 && B <= 65535 && args.scale.defined()) {
    require_shape(op, {"scale", args.scale}, Shape{B, H});
    if (bf)
      layernorm_modulate_backward_one_pass<__nv_bfloat16>(*this, args.dx, args.dshift, args.dscale, args.dy, args.x,
                                                          args.mean, args.rstd, args.scale, args.accumulate_dx, B, L,
                                                          H);
    else
      layernorm_modulate_backward_one_pass<float>(*this, args.dx, args.dshift, args.dscale, args.dy, args.x, args.mean,
                                                  args.rstd, args.scale, args.accumulate_dx, B, L, H);
    return;
  }
  if (args.dx.defined() && B * L > 0) require_shape(op, {"scale", args.scale}, Shape{B, H});
  if (bf)
    layernorm_modulate_backward_passes<__nv_bfloat16>(*this, args.dx, args.dshift, args.dscale, args.dy, args.x,
                                                      args.mean, args.rstd, args.scale, args.accumulate_dx, B, L, H);
  else
    layernorm_modulate_backward_passes<float>(*this, args.dx, args.dshift, args.dscale, args.dy, args.x, args.mean,
                                              args.rstd, args.scale, args.accumulate_dx, B, L, H);
}

void CudaBackend::execute(const op::RmsnormHeads& args) {
  constexpr std::string_view op = "rmsnorm_heads";
  require_f32(args);
  const auto [D, n, rows] = ops::check(op, args);
  const int64_t segments = rows * n;
  if (segments == 0) return;
  rmsnorm_heads_kernel<<<exact_blocks(segments * 32), kThreads, 0, stream_>>>(
      mat(args.y), args.rstd.ptr<float>(), mat(args.x), args.scale.ptr<float>(), D, n, segments, args.eps);
  FLUX8_LAUNCH_CHECK(rmsnorm_heads_kernel);
}

void CudaBackend::execute(const op::RmsnormHeadsBackward& args) {
  constexpr std::string_view op = "rmsnorm_heads_backward";
  require_f32(args);
  const auto [D, n, rows] = ops::check(op, args);
  const int64_t segments = rows * n;
  if (args.dx.defined() && segments > 0) {
    rmsnorm_heads_dx_kernel<<<exact_blocks(segments * 32), kThreads, 0, stream_>>>(
        mat(args.dx), mat(args.dy), mat(args.x), args.rstd.ptr<float>(), args.scale.ptr<float>(), D, n, segments);
    FLUX8_LAUNCH_CHECK(rmsnorm_heads_dx_kernel);
  }
  if (args.dscale.defined()) {
    const Mat DY = mat(args.dy), X = mat(args.x);
    const float* rs = args.rstd.ptr<float>();
    column_sums(
        *this, 1, segments, D,
        [=] __device__(int64_t, int64_t i, int64_t d) {
          const int64_t r = i / n, off = (i % n) * D;
          return double(DY.at(r, off + d)) * X.at(r, off + d) * rs[i];
        },
        args.dscale.ptr<float>(), D, true);
  }
}

}  // namespace flux8
