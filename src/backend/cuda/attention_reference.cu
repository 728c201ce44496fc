// The plain f32 attention kernels: the fallback where cuDNN does not run, and the tests'
// second opinion on it. Clarity over speed: about two orders of magnitude slower than cuDNN at
// Flux sizes.
//
// One warp owns one row (a query row in the forward and in dq, a key row in dk/dv); lane l
// holds elements l, l+32, ... of the row's head vectors. A block of kWarps warps walks the
// other side's rows in tiles of ≤ 32 staged in shared memory; within a tile lane j keeps the
// score of row j, so the tile's max, exponentials and sums are warp-wide operations. The
// softmax is online (FlashAttention): a running max m and sum ℓ, rescaled by exp(m_old − m_new)
// once per tile. Warp sums use the xor butterfly, which leaves the same bits in every lane.
//
// Backward, with P_ij = exp(scale·q_i·k_j − lse_i), δ_i = dO_i·O_i:
//   dq_i = scale·Σ_j P_ij (dO_i·v_j − δ_i) k_j            (one warp per query row)
//   dv_j = Σ_i P_ij dO_i,  dk_j = scale·Σ_i P_ij (dO_i·v_j − δ_i) q_i   (one warp per key row)
// Each output element is written by one lane: no atomics, the same result on every run.
#include <cmath>
#include <type_traits>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "core/error.h"

namespace flux8::cuda {

namespace {

constexpr int kWarps = 8;                        // rows per block
constexpr int kMaxTile = 32;                     // other-side rows per shared-memory tile (≤ lanes)
constexpr size_t kTileBytes = size_t(48) << 10;  // default dynamic shared memory limit
constexpr unsigned kFull = 0xffffffffu;

__device__ inline float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}
__device__ inline float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}

// Rows per tile such that `arrays` tiles of [tile, D] floats fit the shared memory limit.
int tile_rows(int64_t D, int arrays) {
  const int64_t t = static_cast<int64_t>(kTileBytes / (sizeof(float) * static_cast<size_t>(arrays * D)));
  return static_cast<int>(t < kMaxTile ? t : kMaxTile);
}

// Loads rows [r0, r0 + n) of a [*, D] head (contiguous) into a [n, D] shared tile.
__device__ inline void load_tile(float* tile, const float* head, int64_t r0, int n, int D) {
  const float* src = head + r0 * D;
  for (int i = threadIdx.x; i < n * D; i += blockDim.x) tile[i] = src[i];
}

template <int kPerLane>
__device__ inline void load_row(float (&r)[kPerLane], const float* row, int D, int lane) {
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    const int d = lane + 32 * t;
    r[t] = d < D ? row[d] : 0.0f;
  }
}

template <int kPerLane>
__device__ inline float dot_row(const float (&r)[kPerLane], const float* tile_row, int D, int lane) {
  float s = 0;
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    const int d = lane + 32 * t;
    if (d < D) s += r[t] * tile_row[d];
  }
  return warp_sum(s);
}

// grid (B·n, ceil(L / kWarps)), block kWarps·32, dynamic shared 2·tile·D floats.
template <int kPerLane>
__global__ void forward_kernel(float* o, float* lse, const float* q, const float* k, const float* v, int64_t L, int D,
                               int tile, float scale) {
  extern __shared__ float shared[];
  float* ks = shared;
  float* vs = shared + tile * D;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t bh = blockIdx.x, i = static_cast<int64_t>(blockIdx.y) * kWarps + warp;
  const bool active = i < L;
  const int64_t row = bh * L + (active ? i : 0);
  const float* kh = k + bh * L * D;
  const float* vh = v + bh * L * D;

  float qi[kPerLane], acc[kPerLane];
  load_row(qi, q + row * D, D, lane);
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) acc[t] = 0;
  float m = -INFINITY, l = 0;

  for (int64_t j0 = 0; j0 < L; j0 += tile) {
    const int n = static_cast<int>(L - j0 < tile ? L - j0 : tile);
    __syncthreads();  // the previous tile is consumed
    load_tile(ks, kh, j0, n, D);
    load_tile(vs, vh, j0, n, D);
    __syncthreads();
    if (!active) continue;
    float s = -INFINITY;  // lane j: the score of key j0 + j
    for (int j = 0; j < n; ++j) {
      const float sj = dot_row(qi, ks + j * D, D, lane) * scale;
      if (lane == j) s = sj;
    }
    const float m_new = fmaxf(m, warp_max(s));
    const float rescale = expf(m - m_new);  // 0 on the first tile (m = −inf)
    const float p = lane < n ? expf(s - m_new) : 0.0f;
    l = l * rescale + warp_sum(p);
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) acc[t] *= rescale;
    for (int j = 0; j < n; ++j) {
      const float pj = __shfl_sync(kFull, p, j);
      const float* vj = vs + j * D;
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) {
        const int d = lane + 32 * t;
        if (d < D) acc[t] += pj * vj[d];
      }
    }
    m = m_new;
  }
  if (!active) return;
  const float inv = 1.0f / l;
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    const int d = lane + 32 * t;
    if (d < D) o[row * D + d] = acc[t] * inv;
  }
  if (lane == 0) lse[row] = m + logf(l);
}

// δ_r = dO_r·O_r, one warp per row.
template <int kPerLane>
__global__ void delta_kernel(float* delta, const float* dout, const float* o, int64_t rows, int D) {
  const int lane = threadIdx.x % 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (r >= rows) return;
  float a[kPerLane];
  load_row(a, dout + r * D, D, lane);
  const float d = dot_row(a, o + r * D, D, lane);
  if (lane == 0) delta[r] = d;
}

// dq: grid (B·n, ceil(L / kWarps)), dynamic shared 2·tile·D floats (K and V tiles).
template <int kPerLane>
__global__ void dq_kernel(float* dq, const float* dout, const float* q, const float* k, const float* v,
                          const float* lse, const float* delta, int64_t L, int D, int tile, float scale) {
  extern __shared__ float shared[];
  float* ks = shared;
  float* vs = shared + tile * D;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t bh = blockIdx.x, i = static_cast<int64_t>(blockIdx.y) * kWarps + warp;
  const bool active = i < L;
  const int64_t row = bh * L + (active ? i : 0);
  const float* kh = k + bh * L * D;
  const float* vh = v + bh * L * D;

  float qi[kPerLane], doi[kPerLane], acc[kPerLane];
  load_row(qi, q + row * D, D, lane);
  load_row(doi, dout + row * D, D, lane);
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) acc[t] = 0;
  const float lse_i = lse[row], delta_i = delta[row];

  for (int64_t j0 = 0; j0 < L; j0 += tile) {
    const int n = static_cast<int>(L - j0 < tile ? L - j0 : tile);
    __syncthreads();
    load_tile(ks, kh, j0, n, D);
    load_tile(vs, vh, j0, n, D);
    __syncthreads();
    if (!active) continue;
    float ds = 0;  // lane j: P_ij (dP_ij − δ_i) for key j0 + j
    for (int j = 0; j < n; ++j) {
      const float s = dot_row(qi, ks + j * D, D, lane) * scale;
      const float dp = dot_row(doi, vs + j * D, D, lane);
      if (lane == j) ds = expf(s - lse_i) * (dp - delta_i);
    }
    for (int j = 0; j < n; ++j) {
      const float dsj = __shfl_sync(kFull, ds, j);
      const float* kj = ks + j * D;
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) {
        const int d = lane + 32 * t;
        if (d < D) acc[t] += dsj * kj[d];
      }
    }
  }
  if (!active) return;
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    const int d = lane + 32 * t;
    if (d < D) dq[row * D + d] = acc[t] * scale;
  }
}

// dk, dv (either may be null): grid (B·n, ceil(L / kWarps)) over key rows; dynamic shared
// 2·tile·D + 2·tile floats (Q and dO tiles, their lse and δ).
template <int kPerLane>
__global__ void dkdv_kernel(float* dk, float* dv, const float* dout, const float* q, const float* k, const float* v,
                            const float* lse, const float* delta, int64_t L, int D, int tile, float scale) {
  extern __shared__ float shared[];
  float* qs = shared;
  float* dos = shared + tile * D;
  float* lses = shared + 2 * tile * D;
  float* deltas = lses + tile;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t bh = blockIdx.x, j = static_cast<int64_t>(blockIdx.y) * kWarps + warp;
  const bool active = j < L;
  const int64_t row = bh * L + (active ? j : 0);
  const float* qh = q + bh * L * D;
  const float* doh = dout + bh * L * D;

  float kj[kPerLane], vj[kPerLane], dk_acc[kPerLane], dv_acc[kPerLane];
  load_row(kj, k + row * D, D, lane);
  load_row(vj, v + row * D, D, lane);
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) dk_acc[t] = dv_acc[t] = 0;

  for (int64_t i0 = 0; i0 < L; i0 += tile) {
    const int n = static_cast<int>(L - i0 < tile ? L - i0 : tile);
    __syncthreads();
    load_tile(qs, qh, i0, n, D);
    load_tile(dos, doh, i0, n, D);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      lses[i] = lse[bh * L + i0 + i];
      deltas[i] = delta[bh * L + i0 + i];
    }
    __syncthreads();
    if (!active) continue;
    float p = 0, ds = 0;  // lane i: P_ij and P_ij (dP_ij − δ_i) for query i0 + i
    for (int i = 0; i < n; ++i) {
      const float s = dot_row(kj, qs + i * D, D, lane) * scale;
      const float dp = dot_row(vj, dos + i * D, D, lane);
      if (lane == i) {
        p = expf(s - lses[i]);
        ds = p * (dp - deltas[i]);
      }
    }
    for (int i = 0; i < n; ++i) {
      const float pi = __shfl_sync(kFull, p, i), dsi = __shfl_sync(kFull, ds, i);
      const float *qi = qs + i * D, *doi = dos + i * D;
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) {
        const int d = lane + 32 * t;
        if (d < D) {
          dv_acc[t] += pi * doi[d];
          dk_acc[t] += dsi * qi[d];
        }
      }
    }
  }
  if (!active) return;
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    const int d = lane + 32 * t;
    if (d >= D) continue;
    if (dv) dv[row * D + d] = dv_acc[t];
    if (dk) dk[row * D + d] = dk_acc[t] * scale;
  }
}

// Calls f(std::integral_constant<int, P>) with P the smallest of 1, 2, 4, 8 with 32·P ≥ D.
template <typename F>
void with_per_lane(int64_t D, F f) {
  if (D <= 32)
    f(std::integral_constant<int, 1>{});
  else if (D <= 64)
    f(std::integral_constant<int, 2>{});
  else if (D <= 128)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}

void check_shape(const AttentionShape& s) {
  if (s.head_dim < 1 || s.head_dim > kReferenceMaxHeadDim)
    fail("attention (reference kernel): head dim {} is outside 1..{}", s.head_dim, kReferenceMaxHeadDim);
  if (s.batch * s.heads > 0x7fffffff || (s.seq + kWarps - 1) / kWarps > 65535)
    fail("attention (reference kernel): {} heads of sequence length {} exceed its launch grid", s.batch * s.heads,
         s.seq);
}

dim3 row_grid(const AttentionShape& s) {
  return dim3(static_cast<unsigned>(s.batch * s.heads), static_cast<unsigned>((s.seq + kWarps - 1) / kWarps));
}

}  // namespace

void reference_attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                                 const AttentionShape& s, float scale, cudaStream_t stream) {
  if (s.rows() == 0) return;
  check_shape(s);
  const int D = static_cast<int>(s.head_dim), tile = tile_rows(D, 2);
  const size_t shared = sizeof(float) * 2 * static_cast<size_t>(tile) * D;
  with_per_lane(D, [&](auto per_lane) {
    forward_kernel<decltype(per_lane)::value>
        <<<row_grid(s), kWarps * 32, shared, stream>>>(o, lse, q, k, v, s.seq, D, tile, scale);
    FLUX8_LAUNCH_CHECK(forward_kernel);
  });
}

void reference_attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                                  const float* v, const float* o, const float* lse, const AttentionShape& s,
                                  float scale, float* delta, cudaStream_t stream) {
  if (s.rows() == 0 || (!dq && !dk && !dv)) return;
  check_shape(s);
  const int D = static_cast<int>(s.head_dim);
  with_per_lane(D, [&](auto per_lane) {
    constexpr int P = decltype(per_lane)::value;
    const unsigned delta_blocks = static_cast<unsigned>((s.rows() + kWarps - 1) / kWarps);
    delta_kernel<P><<<delta_blocks, kWarps * 32, 0, stream>>>(delta, dout, o, s.rows(), D);
    FLUX8_LAUNCH_CHECK(delta_kernel);
    if (dq) {
      const int tile = tile_rows(D, 2);
      const size_t shared = sizeof(float) * 2 * static_cast<size_t>(tile) * D;
      dq_kernel<P><<<row_grid(s), kWarps * 32, shared, stream>>>(dq, dout, q, k, v, lse, delta, s.seq, D, tile, scale);
      FLUX8_LAUNCH_CHECK(dq_kernel);
    }
    if (dk || dv) {
      // Two [tile, D] tiles plus lse and δ of the tile: one extra "row" of D floats covers them.
      const int tile = tile_rows(D + 1, 2);
      const size_t shared = sizeof(float) * 2 * static_cast<size_t>(tile) * (D + 1);
      dkdv_kernel<P>
          <<<row_grid(s), kWarps * 32, shared, stream>>>(dk, dv, dout, q, k, v, lse, delta, s.seq, D, tile, scale);
      FLUX8_LAUNCH_CHECK(dkdv_kernel);
    }
  });
}

}  // namespace flux8::cuda
