// The attention inputs of one stream on the device: QK-norm, RoPE and the head-major layout in
// one kernel per direction, where the unfused chain made a norm pass, a layout copy and a
// rotation pass over q and k (and in the backward a second read of both for dscale). Same
// semantics as the CPU twin, src/backend/cpu/qk_norm_rope.cpp; head dims up to 512. Two paths:
// the vector path (below) for Flux's D = 128 and other D = 8·2^k on rows aligned to 8 elements,
// the pair path described here for the rest.
//
// On the pair path a warp owns one (token, head) segment of D elements; lane i holds the RoPE
// pairs i, i + 32, … in registers, so every element is read once and written once. The
// arithmetic is f32 (the CPU twin's sums are double: the results differ by f32 rounding, ~1e-7
// relative); the sum of squares and the backward's Σ g·x̂ are warp butterflies (a fixed lane
// order), and rstd is stored in f32 and used as stored. Double per element made this kernel
// instruction-bound (f32↔f64 conversions issue at a quarter of the f32 rate on Hopper, double
// shuffles take two instructions). The backward's dscale is the column sum of dy·x̂ over all
// segments: each warp sums its segments of a fixed chunk in f32, the block adds its warps in
// warp order in double, and column_partials_total_kernel (reduce.cu, the second pass of
// column_sums) adds the chunks in order, so dscale is the same on every run.
//
// The token-side activations (q, k, v; dq, dk, dv) are f32 or bf16 (Backend::activation_dtype),
// the heads f32 or bf16 (Backend::attention_heads_dtype), each side one type and a template
// parameter of the kernels; statistics, scales, dscale and the table stay f32. Only the loads
// and stores depend on the types: values widen to f32 as loaded, the arithmetic is the f32
// path's, and each stored value is rounded once to nearest even (the normalised, unrotated
// values in between are never stored).
#include <cstdint>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8_heads.cuh"

namespace flux8 {
using namespace cuda;

namespace {

// Register budget: lanes hold kPairs pairs of each row, so D ≤ 64·kPairs; 8 covers D ≤ 512.
constexpr int kMaxPairsPerLane = 8;
// Backward: a block of kBackwardWarps warps per chunk of segments, and at most kMaxChunks
// chunks, so the second pass adds few partials per column however long the sequence.
constexpr int kBackwardWarps = 16;
constexpr int64_t kMaxChunks = 256;

// Sum over the 32 lanes of a warp (xor butterfly: the same order on every run).
__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Elements (2p, 2p+1) at p as f32: one access (8 bytes of f32, 4 of bf16) when every row
// start is pair-aligned (`vec`). bf16 pairs are widened as loaded and rounded to nearest even
// as stored.
__device__ inline float2 load_pair(const float* p, bool vec) {
  return vec ? *reinterpret_cast<const float2*>(p) : make_float2(p[0], p[1]);
}
__device__ inline float2 load_pair(const __nv_bfloat16* p, bool vec) {
  if (vec) return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
  return make_float2(__bfloat162float(p[0]), __bfloat162float(p[1]));
}
__device__ inline void store_pair(float* p, float2 v, bool vec) {
  if (vec) {
    *reinterpret_cast<float2*>(p) = v;
  } else {
    p[0] = v.x;
    p[1] = v.y;
  }
}
__device__ inline void store_pair(__nv_bfloat16* p, float2 v, bool vec) {
  if (vec) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v.x, v.y);
  } else {
    p[0] = __float2bfloat16_rn(v.x);
    p[1] = __float2bfloat16_rn(v.y);
  }
}

// The joint head-major tensors, of element type H: f32 or bf16 (Backend::attention_heads_dtype:
// what cuDNN reads), a template parameter (a run-time flag put both paths' code into every
// load and store): pairs are computed in f32 and rounded to nearest even when stored as bf16.
template <typename H>
struct Heads {
  H* p;
  int64_t ld;
  __device__ float2 load2(int64_t row, int64_t col, bool vec) const { return load_pair(p + row * ld + col, vec); }
  __device__ void store2(int64_t row, int64_t col, float2 v, bool vec) const { store_pair(p + row * ld + col, v, vec); }
};
template <typename H>
Heads<H> heads_of(const Tensor& t) {
  return Heads<H>{static_cast<H*>(t.data), t.ld};
}

// Segment s = r·n + h (the order of rmsnorm_heads' statistics): token row r = b·Ls + l, its
// columns h·D.., head row (b·n + h)·L + offset + l and table row b·L + offset + l. The two
// divisions are multiply-highs (FastDivisor; segments < 2^31, checked at launch): as 64-bit
// divisions they took more instructions than the segment's D/32 elements a lane.
struct Segment {
  int64_t token_row, col, head_row, pe_row;
};
// What both directions know of the call's shape: heads n, joint length L, the stream's length
// Ls at `offset`, head dim D (and 1/D: a multiply where a division took a dozen instructions),
// and whether every row start is pair-aligned (`vec`).
struct Geometry {
  FastDivisor heads, tokens;  // n, Ls
  int64_t n, L, Ls, offset, D, segments;
  float inv_D;
  bool vec;
  __device__ Segment segment(int64_t s) const {
    const int64_t r = heads.divide(static_cast<uint32_t>(s)), h = s - r * n;
    const int64_t b = tokens.divide(static_cast<uint32_t>(r)), l = r - b * Ls;
    return {r, h * D, (b * n + h) * L + offset + l, b * L + offset + l};
  }
};

// The segment's (cos, sin) per pair the lane holds.
template <int kPairs>
__device__ inline void load_table(float2 (&cs)[kPairs], const float* pe, const Segment& s, int64_t D, int lane,
                                  bool vec) {
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int64_t p = lane + 32 * j;
    if (p < D / 2) cs[j] = load_pair(pe + s.pe_row * D + 2 * p, vec);
  }
}

// T: the token-side activations' storage type, H: the heads' (float or __nv_bfloat16 each).
template <typename T, typename H>
struct ForwardArgs {
  Heads<H> q_heads, k_heads, v_heads;
  float *q_rstd, *k_rstd;  // null: not saved
  MatOf<T> q, k, v;
  const float *q_scale, *k_scale, *pe;
  Geometry g;
  float eps;
};

// out = rope(x / √(mean(x²) + eps) · scale) for one segment: the value rmsnorm_heads stores,
// then rope's rotation of it.
template <int kPairs, typename T, typename H>
__device__ inline void norm_rotate(const Heads<H>& out, float* rstd, const MatOf<T>& x, const float* scale,
                                   const float2 (&cs)[kPairs], const Segment& s, int64_t seg, int lane,
                                   const Geometry& geo, float eps) {
  const int64_t D = geo.D;
  const bool vec = geo.vec;
  float2 v[kPairs];
  float sq = 0.0f;
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int64_t p = lane + 32 * j;
    if (p < D / 2) {
      v[j] = load_pair(&x.at(s.token_row, s.col + 2 * p), vec);
      sq += v[j].x * v[j].x + v[j].y * v[j].y;
    }
  }
  sq = warp_sum(sq);
  const float rs = 1.0f / sqrtf(sq * geo.inv_D + eps);
  if (rstd && lane == 0) rstd[seg] = rs;
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int64_t p = lane + 32 * j;
    if (p < D / 2) {
      const float y0 = v[j].x * rs * scale[2 * p], y1 = v[j].y * rs * scale[2 * p + 1];
      const float c = cs[j].x, sn = cs[j].y;
      out.store2(s.head_row, 2 * p, make_float2(c * y0 - sn * y1, sn * y0 + c * y1), vec);
    }
  }
}

template <int kPairs, typename T, typename H>
__global__ void qk_norm_rope_to_heads_kernel(ForwardArgs<T, H> a) {
  const int64_t seg = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (seg >= a.g.segments) return;  // whole warps leave together (the grid is warp-aligned)
  const Segment s = a.g.segment(seg);
  float2 cs[kPairs];
  load_table(cs, a.pe, s, a.g.D, lane, a.g.vec);
  norm_rotate(a.q_heads, a.q_rstd, a.q, a.q_scale, cs, s, seg, lane, a.g, a.eps);
  norm_rotate(a.k_heads, a.k_rstd, a.k, a.k_scale, cs, s, seg, lane, a.g, a.eps);
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int64_t p = lane + 32 * j;
    if (p < a.g.D / 2)
      a.v_heads.store2(s.head_row, 2 * p, load_pair(&a.v.at(s.token_row, s.col + 2 * p), a.g.vec), a.g.vec);
  }
}

template <typename T, typename H>
struct BackwardArgs {
  MatOf<T> dq, dk, dv;  // null (p == nullptr): not wanted
  Heads<H> dq_heads, dk_heads, dv_heads;
  MatOf<T> q, k;
  const float *q_rstd, *k_rstd, *q_scale, *k_scale, *pe;
  double *q_partial, *k_partial;  // [chunks, D] dscale partials, or null: not wanted
  Geometry g;
  int64_t chunk;
};

// One segment of rmsnorm_heads_backward on g = rope⁻¹(dheads) (the gradient of the normalised,
// unrotated values): with x̂ = x·rstd, dx = rstd·(g·scale − x̂·mean(g·scale·x̂)); acc (this
// lane's dscale columns) += g·x̂.
template <int kPairs, typename T, typename H>
__device__ inline void norm_rotate_backward(const MatOf<T>& dx, float (&acc)[2 * kPairs], const Heads<H>& dheads,
                                            const MatOf<T>& x, const float* rstd, const float* scale,
                                            const float2 (&cs)[kPairs], const Segment& s, int64_t seg, int lane,
                                            const Geometry& geo) {
  const int64_t D = geo.D;
  const bool vec = geo.vec;
  const float rs = rstd[seg];
  float2 g[kPairs], xv[kPairs];
  float sgx = 0.0f;
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int64_t p = lane + 32 * j;
    if (p < D / 2) {
      const float2 d = dheads.load2(s.head_row, 2 * p, vec);
      const float c = cs[j].x, sn = cs[j].y;
      g[j] = make_float2(c * d.x + sn * d.y, c * d.y - sn * d.x);  // rotation by −θ: RoPE's backward
      xv[j] = load_pair(&x.at(s.token_row, s.col + 2 * p), vec);
      sgx += g[j].x * scale[2 * p] * (xv[j].x * rs) + g[j].y * scale[2 * p + 1] * (xv[j].y * rs);
    }
  }
  const float mean_gx = warp_sum(sgx) * geo.inv_D;
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int64_t p = lane + 32 * j;
    if (p < D / 2) {
      const float xhat0 = xv[j].x * rs, xhat1 = xv[j].y * rs;
      if (dx.p)
        store_pair(&dx.at(s.token_row, s.col + 2 * p),
                   make_float2(rs * (g[j].x * scale[2 * p] - xhat0 * mean_gx),
                               rs * (g[j].y * scale[2 * p + 1] - xhat1 * mean_gx)),
                   vec);
      acc[2 * j] += g[j].x * xhat0;
      acc[2 * j + 1] += g[j].y * xhat1;
    }
  }
}

// partial[c] = Σ over the block's warps, in warp order, of their column-c sums; 64 columns
// (a pair per lane) at a time. Every thread of the block must call it.
template <int kPairs>
__device__ inline void store_chunk_partial(double (*tile)[64], const float (&acc)[2 * kPairs], double* partial,
                                           int64_t D) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    if (64 * j >= D) break;  // the same for the whole block
    tile[warp][2 * lane] = acc[2 * j];
    tile[warp][2 * lane + 1] = acc[2 * j + 1];
    __syncthreads();
    const int64_t c = 64 * j + threadIdx.x;
    if (threadIdx.x < 64 && c < D) {
      double t = 0;
      for (int w = 0; w < kBackwardWarps; ++w) t += tile[w][threadIdx.x];
      partial[c] = t;
    }
    __syncthreads();
  }
}

// The backward kernel: a block per chunk of segments, its warps on segments begin + warp, +
// kBackwardWarps, ...; per segment q's and k's backward (each where its dx or dscale is wanted,
// both with the segment's RoPE table loaded once) and dv's copy. Each warp sums its dscale
// columns in f32, the block adds its warps in double in warp order. (With double accumulators
// q and k needed a pass each to stay within the registers; the f32 ones fit in one.)
// Two blocks per SM (≤ 64 registers a thread) up to D = 128: the grid is about two blocks per SM
// at Flux sizes. Wider heads need more registers than that; they get one block per SM.
template <int kPairs, typename T, typename H>
__global__ void __launch_bounds__(kBackwardWarps * 32, kPairs <= 2 ? 2 : 1)
    qk_norm_rope_to_heads_backward_kernel(BackwardArgs<T, H> a) {
  __shared__ double tile[kBackwardWarps][64];
  const bool q_norm = a.dq.p || a.q_partial, k_norm = a.dk.p || a.k_partial;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * a.chunk;
  const int64_t end = begin + a.chunk < a.g.segments ? begin + a.chunk : a.g.segments;
  float q_acc[2 * kPairs] = {}, k_acc[2 * kPairs] = {};
  for (int64_t seg = begin + warp; seg < end; seg += kBackwardWarps) {
    const Segment s = a.g.segment(seg);
    if (q_norm || k_norm) {
      float2 cs[kPairs];
      load_table(cs, a.pe, s, a.g.D, lane, a.g.vec);
      if (q_norm) norm_rotate_backward(a.dq, q_acc, a.dq_heads, a.q, a.q_rstd, a.q_scale, cs, s, seg, lane, a.g);
      if (k_norm) norm_rotate_backward(a.dk, k_acc, a.dk_heads, a.k, a.k_rstd, a.k_scale, cs, s, seg, lane, a.g);
    }
    if (a.dv.p) {
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        const int64_t p = lane + 32 * j;
        if (p < a.g.D / 2)
          store_pair(&a.dv.at(s.token_row, s.col + 2 * p), a.dv_heads.load2(s.head_row, 2 * p, a.g.vec), a.g.vec);
      }
    }
  }
  if (a.q_partial) store_chunk_partial<kPairs>(tile, q_acc, a.q_partial + blockIdx.x * a.g.D, a.g.D);
  if (a.k_partial) store_chunk_partial<kPairs>(tile, k_acc, a.k_partial + blockIdx.x * a.g.D, a.g.D);
}

// ---- the vector path ------------------------------------------------------------------------
// Head dims D = 8·kLanes with kLanes a power of two up to 32 (Flux's 128: 16 lanes), and every
// row start aligned to 8 elements (vec_path_lanes): a group of kLanes lanes owns a segment,
// each lane 8 consecutive elements (4 RoPE pairs) in one 16-byte access of bf16 (two of f32),
// a segment's loads all issued before its arithmetic. The plain forward takes one segment per
// group; the FP8-heads forward and the backward take a run of segments per group with the next
// segments' loads in flight (segments_per_group, forward_runs, BackwardLoads). The pair path's 4-byte accesses and
// per-element scale loads leave both directions latency-bound; the vector path takes about a third off each
// (docs/PERFORMANCE.md, Measurements behind the kernels). The sums run over the group's lanes (xor butterfly, a fixed
// order), so each path is deterministic; the two paths differ by f32 rounding.

// Blocks per SM the FP8-heads forward is laid out for (segments_per_group) and compiled for (≤ 64
// registers a thread). Left to itself ptxas gives it 72 registers: 3 blocks of 256 threads per
// SM, at which it is latency-bound; 4 blocks are faster (docs/PERFORMANCE.md, Measurements
// behind the kernels).
constexpr int kFp8ForwardBlocksPerSm = 4;
// The vector path's backward (both head types), compiled for 2 blocks of 256 threads per SM
// (≤ 128 registers a thread): a segment's arithmetic and the next two segments' loads in
// registers, without spilling for bf16 activations (the f32 variants, tests only, spill a
// little). 3 blocks (≤ 80 registers, one segment ahead) spill and are no faster than 2 blocks
// with one ahead; two ahead beat one (docs/PERFORMANCE.md, Measurements behind the kernels).
constexpr int kBackwardVecBlocksPerSm = 2;

// The lanes of this thread's group, for shuffles within it.
template <int kLanes>
__device__ inline unsigned group_mask() {
  if constexpr (kLanes == 32) {
    return 0xffffffffu;
  } else {
    return ((1u << kLanes) - 1u) << (threadIdx.x % 32 / kLanes * kLanes);
  }
}
template <int kLanes>
__device__ inline float group_sum(float v) {
  const unsigned mask = group_mask<kLanes>();
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
  return v;
}

// The q and k scales (D each) in shared memory, loaded once per block by its threads (every
// thread of the block calls load(), before any leaves): a lane's 8 columns are then two 16-byte
// reads. Each lane had loaded them from global memory element by element (the flat parameter
// buffer does not align parameters to 16 bytes), 16 requests a lane and segment, as many as all
// its other loads and stores together, which left the FP8 backward bound by L1.
template <int D>
struct ScaleTile {
  alignas(16) float q[D];
  alignas(16) float k[D];
  __device__ void load(const float* q_scale, const float* k_scale) {
    for (int i = static_cast<int>(threadIdx.x); i < D; i += static_cast<int>(blockDim.x)) {
      q[i] = __ldg(q_scale + i);
      k[i] = __ldg(k_scale + i);
    }
    __syncthreads();
  }
};

// norm_rotate for the lane's 8 elements x of the segment into y; cs holds their 4 (cos, sin)
// pairs, scale_tile the scale (a ScaleTile's, in shared memory).
template <int kLanes>
__device__ inline void norm_rotate8(float (&y)[8], float* rstd, const float (&x)[8], const float* scale_tile,
                                    const float (&cs)[8], int64_t seg, int c, float inv_D, float eps) {
  float sc[8];
  load8(scale_tile + c, sc);
  float sq = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sq += x[i] * x[i];
  sq = group_sum<kLanes>(sq);
  const float rs = 1.0f / sqrtf(sq * inv_D + eps);
  if (rstd && c == 0) rstd[seg] = rs;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float y0 = x[2 * j] * rs * sc[2 * j], y1 = x[2 * j + 1] * rs * sc[2 * j + 1];
    const float cn = cs[2 * j], sn = cs[2 * j + 1];
    y[2 * j] = cn * y0 - sn * y1;
    y[2 * j + 1] = sn * y0 + cn * y1;
  }
}

// The segments [first, last) of this thread's group of kLanes lanes in the loops over runs of
// segments (the FP8-heads forward, the backward; blocks of kThreads threads): `per_group`
// consecutive ones (segments_per_group) from the group's index in the grid times per_group, cut
// at the call's `segments` (none for groups past its end). The same for every lane of a group.
struct GroupRun {
  int64_t first, last;
};
template <int kLanes>
__device__ inline GroupRun group_run(int64_t per_group, int64_t segments) {
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * (kThreads / kLanes) + threadIdx.x / kLanes) * per_group;
  return {first, first + per_group < segments ? first + per_group : segments};
}

// The RoPE row of a run's current token, loaded once per token as the run reaches it
// (consecutive segments are a token's heads): the lane's 8 columns of table row `row`.
struct RopeRowCache {
  Raw8<float> cols;
  int64_t row = -1;
  // cs = the (cos, sin) pairs of segment s in the lane's columns c .. c + 7 of the table pe
  // (rows of D), loaded where its row is not the cached one.
  __device__ void cos_sin(float (&cs)[8], const float* pe, const Segment& s, int D, int c) {
    if (s.pe_row != row) cols.load(pe + s.pe_row * D + c), row = s.pe_row;
    cols.widen(cs);
  }
};

// The FP8-heads forward's loop: a group of kLanes lanes takes a run of `per_group` consecutive
// segments (segments_per_group), the next segment's loads issued before the current one's
// arithmetic, the RoPE row loaded once per token (consecutive segments are a token's heads).
// One segment per group, as the plain forward below runs, left each block's loads, arithmetic
// and statistics reduction in turn, with nothing in flight during the last two (runs are faster:
// docs/PERFORMANCE.md, Measurements behind the kernels). For each segment: store(head row, 0, v), then store(head row,
// 1, q's output), store(head row, 2, k's), each the 8 values of the lane's columns c.
template <int kLanes, typename T, typename H, typename Store>
__device__ inline void forward_runs(const ForwardArgs<T, H>& a, int64_t per_group, const ScaleTile<8 * kLanes>& scales,
                                    int c, Store&& store) {
  constexpr int D = 8 * kLanes;
  const auto [first, last] = group_run<kLanes>(per_group, a.g.segments);
  if (first >= last) return;  // the same for the whole group
  struct Loads {
    Raw8<T> q, k, v;
  } cur, next;
  const auto load = [&](Loads& l, const Segment& s) {
    l.q.load(&a.q.at(s.token_row, s.col + c));
    l.k.load(&a.k.at(s.token_row, s.col + c));
    l.v.load(&a.v.at(s.token_row, s.col + c));
  };
  load(cur, a.g.segment(first));
  RopeRowCache rope;
  for (int64_t seg = first; seg < last; ++seg) {
    if (seg + 1 < last) load(next, a.g.segment(seg + 1));
    const Segment s = a.g.segment(seg);  // (recomputed rather than carried: fewer registers)
    float cs[8], x[8], y[8];
    rope.cos_sin(cs, a.pe, s, D, c);
    cur.v.widen(x);
    store(s.head_row, 0, x);
    cur.q.widen(x);
    norm_rotate8<kLanes>(y, a.q_rstd, x, scales.q, cs, seg, c, a.g.inv_D, a.eps);
    store(s.head_row, 1, y);
    cur.k.widen(x);
    norm_rotate8<kLanes>(y, a.k_rstd, x, scales.k, cs, seg, c, a.g.inv_D, a.eps);
    store(s.head_row, 2, y);
    cur = next;
  }
}

// The plain (bf16 or f32 heads) forward keeps one segment per group and no loop: it has no
// statistics to reduce, so its blocks leave as soon as their segment is stored, and many small
// blocks keep more bytes in flight than runs of segments do (runs are slower here:
// docs/PERFORMANCE.md, Measurements behind the kernels).
struct SegmentInputs8 {
  float cs[8], q[8], k[8], v[8];
};
template <typename T, typename H>
__device__ inline void load_segment8(SegmentInputs8& in, const ForwardArgs<T, H>& a, const Segment& s, int c) {
  load8(a.pe + s.pe_row * a.g.D + c, in.cs);
  load8(&a.q.at(s.token_row, s.col + c), in.q);
  load8(&a.k.at(s.token_row, s.col + c), in.k);
  load8(&a.v.at(s.token_row, s.col + c), in.v);
}

template <int kLanes, typename T, typename H>
__global__ void qk_norm_rope_to_heads_vec_kernel(ForwardArgs<T, H> a) {
  __shared__ ScaleTile<8 * kLanes> scales;
  scales.load(a.q_scale, a.k_scale);
  const int64_t seg = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
  if (seg >= a.g.segments) return;  // whole groups leave together
  const int c = 8 * static_cast<int>(threadIdx.x % kLanes);
  const Segment s = a.g.segment(seg);
  SegmentInputs8 in;
  load_segment8(in, a, s, c);
  store8(a.v_heads.p + s.head_row * a.v_heads.ld + c, in.v);
  float y[8];
  norm_rotate8<kLanes>(y, a.q_rstd, in.q, scales.q, in.cs, seg, c, a.g.inv_D, a.eps);
  store8(a.q_heads.p + s.head_row * a.q_heads.ld + c, y);
  norm_rotate8<kLanes>(y, a.k_rstd, in.k, scales.k, in.cs, seg, c, a.g.inv_D, a.eps);
  store8(a.k_heads.p + s.head_row * a.k_heads.ld + c, y);
}

// The vector path with FP8 heads (qk_norm_rope_to_heads_fp8): the same values, each rounded as
// the heads' type H stores it and cast with its tensor's delayed scale (fp8_heads.cuh); a block's
// amax and counts per tensor go to its partials (kCount: the counts are wanted, a report step).
// The heads tensors of `a` are not used.
template <int kLanes, typename T, typename H, bool kCount>
__global__ void __launch_bounds__(kThreads, kFp8ForwardBlocksPerSm)
    qk_norm_rope_to_heads_fp8_kernel(ForwardArgs<T, H> a, int64_t per_group, Fp8HeadsOut q8, Fp8HeadsOut k8,
                                     Fp8HeadsOut v8) {
  __shared__ ScaleTile<8 * kLanes> scales;
  scales.load(a.q_scale, a.k_scale);
  const float sq = *q8.scale, sk = *k8.scale, sv = *v8.scale;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *q8.scale_inv = scale_inverse(sq);
    *k8.scale_inv = scale_inverse(sk);
    *v8.scale_inv = scale_inverse(sv);
  }
  CastTally<kCount> tq, tk, tv;
  const int c = 8 * static_cast<int>(threadIdx.x % kLanes);
  forward_runs<kLanes>(a, per_group, scales, c, [&](int64_t head_row, int which, const float(&y)[8]) {
    const int64_t at = head_row * (8 * kLanes) + c;
    if (which == 0)
      store8_fp8<H>(v8, at, y, sv, tv);
    else if (which == 1)
      store8_fp8<H>(q8, at, y, sq, tq);
    else
      store8_fp8<H>(k8, at, y, sk, tk);
  });
  // (no return before: every thread of the block reduces)
  q8.finish_block(tq);
  k8.finish_block(tk);
  v8.finish_block(tv);
}

// norm_rotate_backward for the lane's 8 elements: d the head gradients, x the saved input,
// scale_tile the scale (a ScaleTile's, in shared memory).
template <int kLanes, typename T>
__device__ inline void norm_rotate_backward8(const MatOf<T>& dx, float (&acc)[8], const float (&d)[8],
                                             const float (&x)[8], float rs, const float* scale_tile,
                                             const float (&cs)[8], const Segment& s, int c, float inv_D) {
  float sc[8];
  load8(scale_tile + c, sc);
  float g[8], xh[8];
  float sgx = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float cn = cs[2 * j], sn = cs[2 * j + 1];
    g[2 * j] = cn * d[2 * j] + sn * d[2 * j + 1];  // rotation by −θ: RoPE's backward
    g[2 * j + 1] = cn * d[2 * j + 1] - sn * d[2 * j];
    xh[2 * j] = x[2 * j] * rs;
    xh[2 * j + 1] = x[2 * j + 1] * rs;
    sgx += g[2 * j] * sc[2 * j] * xh[2 * j] + g[2 * j + 1] * sc[2 * j + 1] * xh[2 * j + 1];
  }
  const float mean_gx = group_sum<kLanes>(sgx) * inv_D;
  if (dx.p) {
    float o[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = rs * (g[i] * sc[i] - xh[i] * mean_gx);
    store8(&dx.at(s.token_row, s.col + c), o);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] += g[i] * xh[i];
}

// One segment's loads for the vector path's backward, as stored: the head gradients (FP8 codes
// when kFp8, else 8 elements of H), the saved inputs q and k and their rstd. The loop below
// issues the next two segments' before the current one's arithmetic. (The RoPE row is loaded once
// per token, as the loop reaches it: RopeRowCache.)
template <typename T, typename H, bool kFp8>
struct BackwardLoads {
  using HeadGrad = std::conditional_t<kFp8, uint2, Raw8<H>>;
  HeadGrad dq, dk, dv;
  Raw8<T> q, k;
  float q_rs, k_rs;

  __device__ void load(const BackwardArgs<T, H>& a, const Segment& s, int64_t seg, int c, const Fp8HeadsIn& dq8,
                       const Fp8HeadsIn& dk8, const Fp8HeadsIn& dv8) {
    if constexpr (kFp8) {
      const int64_t at = s.head_row * a.g.D + c;
      dq = load8_codes(dq8, at);
      dk = load8_codes(dk8, at);
      if (a.dv.p) dv = load8_codes(dv8, at);
    } else {
      dq.load(a.dq_heads.p + s.head_row * a.dq_heads.ld + c);
      dk.load(a.dk_heads.p + s.head_row * a.dk_heads.ld + c);
      if (a.dv.p) dv.load(a.dv_heads.p + s.head_row * a.dv_heads.ld + c);
    }
    q.load(&a.q.at(s.token_row, s.col + c));
    k.load(&a.k.at(s.token_row, s.col + c));
    q_rs = a.q_rstd[seg], k_rs = a.k_rstd[seg];
  }
};

// Dequantized (kFp8: scale_inv s) or widened head gradients.
template <typename H, bool kFp8, typename R>
__device__ inline void widen_head_grad(const R& r, float s, Fp8Format f, float (&v)[8]) {
  if constexpr (kFp8)
    dequantize8<H>(r, s, f, v);
  else
    r.widen(v);
}

// The vector path's backward: a group of kLanes lanes per run of `per_group` consecutive
// segments, each lane 8 columns as in the forward, the next two segments' loads issued before
// the current one's arithmetic. One segment per group and no loop (the forward's arrangement) left
// the kernel latency-bound: a block loaded, then computed, then summed its dscale tile behind a
// barrier, with nothing in flight in between; a loop without the prefetch keeps too few bytes in
// flight (docs/PERFORMANCE.md, Measurements behind the kernels). A run of
// segments also loads its RoPE row once per token (consecutive segments are a token's heads)
// and adds its dscale terms g·x̂ in f32 in segment order before the block adds its groups in
// group order into a row of `q_part` / `k_part` ([blocks, D] f32, or null: not wanted), which
// column_sums then adds up in its fixed order. per_group is a function of the shape alone
// (segments_per_group), so the sums' order and bits are the same on every run and GPU.
//
// kFp8: the head gradients are FP8 codes (qk_norm_rope_to_heads_backward_fp8), read from dq8, dk8,
// dv8 and dequantized as dequantize() into H gives them; the heads tensors of `a` are not used.
template <int kLanes, typename T, typename H, bool kFp8>
__global__ void __launch_bounds__(kThreads, kBackwardVecBlocksPerSm)
    qk_norm_rope_to_heads_backward_vec_kernel(BackwardArgs<T, H> a, int64_t per_group, float* q_part, float* k_part,
                                              Fp8HeadsIn dq8, Fp8HeadsIn dk8, Fp8HeadsIn dv8) {
  constexpr int kGroups = kThreads / kLanes, D = 8 * kLanes;
  __shared__ alignas(16) float tile[2][kGroups][D];
  __shared__ ScaleTile<D> scales;
  scales.load(a.q_scale, a.k_scale);
  const bool q_norm = a.dq.p || q_part, k_norm = a.dk.p || k_part;
  const int group = static_cast<int>(threadIdx.x) / kLanes, c = 8 * static_cast<int>(threadIdx.x % kLanes);
  const auto [first, last] = group_run<kLanes>(per_group, a.g.segments);
  float dq_s = 0.0f, dk_s = 0.0f, dv_s = 0.0f;
  if constexpr (kFp8) {
    dq_s = *dq8.scale_inv, dk_s = *dk8.scale_inv;
    if (a.dv.p) dv_s = *dv8.scale_inv;
  }
  float q_acc[8] = {}, k_acc[8] = {};
  if (first < last) {                            // the same for the whole group
    BackwardLoads<T, H, kFp8> cur, next, after;  // segments seg, seg + 1, seg + 2
    cur.load(a, a.g.segment(first), first, c, dq8, dk8, dv8);
    if (first + 1 < last) next.load(a, a.g.segment(first + 1), first + 1, c, dq8, dk8, dv8);
    RopeRowCache rope;
    for (int64_t seg = first; seg < last; ++seg) {
      if (seg + 2 < last) after.load(a, a.g.segment(seg + 2), seg + 2, c, dq8, dk8, dv8);
      // (recomputed rather than carried from the previous iteration's loads: fewer registers)
      const Segment s = a.g.segment(seg);
      float cs[8], dqh[8], dkh[8], q[8], k[8];
      rope.cos_sin(cs, a.pe, s, D, c);
      if (a.dv.p) {
        float dvh[8];
        widen_head_grad<H, kFp8>(cur.dv, dv_s, dv8.format, dvh);
        store8(&a.dv.at(s.token_row, s.col + c), dvh);
      }
      if (q_norm) {
        widen_head_grad<H, kFp8>(cur.dq, dq_s, dq8.format, dqh);
        cur.q.widen(q);
        norm_rotate_backward8<kLanes>(a.dq, q_acc, dqh, q, cur.q_rs, scales.q, cs, s, c, a.g.inv_D);
      }
      if (k_norm) {
        widen_head_grad<H, kFp8>(cur.dk, dk_s, dk8.format, dkh);
        cur.k.widen(k);
        norm_rotate_backward8<kLanes>(a.dk, k_acc, dkh, k, cur.k_rs, scales.k, cs, s, c, a.g.inv_D);
      }
      cur = next;
      next = after;
    }
  }
  if (!q_part && !k_part) return;  // the same for the whole block
  // Two 16-byte stores a lane and tensor: 8 scalar stores at a stride of 8 floats were 8-way
  // bank conflicts (the lanes of a group hit 4 banks, a warp's two groups the same 4).
  store8(&tile[0][group][c], q_acc);
  store8(&tile[1][group][c], k_acc);
  __syncthreads();
  for (int col = static_cast<int>(threadIdx.x); col < 2 * D; col += blockDim.x) {
    float* part = col < D ? q_part : k_part;
    if (!part) continue;
    float t = 0.0f;
    for (int g = 0; g < kGroups; ++g) t += tile[col / D][g][col % D];
    part[static_cast<int64_t>(blockIdx.x) * D + col % D] = t;
  }
}

// Segments per group for the vector path's loops over runs of segments (the FP8 forward, the
// backward) in a call of `segments`: enough groups for one wave of `blocks_per_sm` blocks on each
// of kReferenceSms SMs at 16 lanes a segment (Flux's D = 128), so each group's run is as long as
// that allows. A function of the shape only: it fixes the order of the backward's dscale sums,
// so their bits are the same on every run and GPU.
int64_t segments_per_group(int64_t segments, int blocks_per_sm) {
  const int64_t target_groups = kReferenceSms * blocks_per_sm * (kThreads / 16);
  const int64_t per = (segments + target_groups - 1) / target_groups;
  return per < 1 ? 1 : per;
}

// The lanes a segment takes on the vector path (D / 8), or 0 where the pair path runs: D not 8
// times a power of two up to 32, or a row start of the token-side or heads tensors not aligned
// to 8 elements (16 bytes of bf16, 32 of f32), or the RoPE table's start not to 32 bytes. The
// condition counts elements, not bytes, so the f32 and bf16 versions of a call take the same
// path (tests compare the two bit for bit).
// Whether every row of these tensors (the undefined ones skipped) starts at a multiple of
// `elems` elements: base address and ld.
bool rows_aligned_to(std::initializer_list<Tensor> ts, int elems) {
  for (const Tensor& t : ts)
    if (t.defined() && (reinterpret_cast<uintptr_t>(t.data) % (elems * dtype_size(t.dtype)) != 0 || t.ld % elems != 0))
      return false;
  return true;
}

int vec_path_lanes(int64_t D, std::initializer_list<Tensor> rows, const Tensor& pe) {
  int lanes = 0;
  for (int l = 1; l <= 32; l *= 2)
    if (D == 8 * l) lanes = l;
  if (!rows_aligned_to(rows, 8)) return 0;
  return reinterpret_cast<uintptr_t>(pe.data) % 32 == 0 ? lanes : 0;
}

// f.template operator()<kN>() for kN = n, a power of two from kFrom up to kMax (any other n:
// kMax): the vector path's lanes per segment (up to 32), the pair path's pairs per lane (up to 8).
template <int kFrom, int kMax, typename F>
void with_power_of_two(int n, F&& f) {
  if constexpr (kFrom >= kMax)
    f.template operator()<kMax>();
  else if (n == kFrom)
    f.template operator()<kFrom>();
  else
    with_power_of_two<kFrom * 2, kMax>(n, f);
}
template <typename F>
void with_lanes(int lanes, F&& f) {
  with_power_of_two<1, 32>(lanes, f);
}

// Pairs per lane for head dim D: the smallest power of two with 32·kPairs ≥ D/2.
int pairs_per_lane(std::string_view op, int64_t D) {
  for (int k = 1; k <= kMaxPairsPerLane; k *= 2)
    if (32 * k >= D / 2) return k;
  fail(
      "{}: head dim {} is beyond the {} this kernel holds in registers (Flux uses 128); the unfused "
      "rmsnorm_heads, tokens_to_heads and rope take any even D",
      op, D, 64 * kMaxPairsPerLane);
}

// Whether every row start of these tensors is pair-aligned (ld even, base a multiple of two
// elements: 8 bytes of f32, 4 of bf16): then pairs move as one float2 or one bf16 pair.
bool pair_aligned(std::initializer_list<Tensor> ts) { return rows_aligned_to(ts, 2); }

// The call's Geometry; its segments are indexed with 32-bit arithmetic (FastDivisor).
Geometry geometry_of(std::string_view op, const ops::QkNormRopeDims& d, int64_t offset,
                     std::initializer_list<Tensor> tensors) {
  const int64_t segments = d.B * d.Ls * d.n;
  if (segments >= (int64_t(1) << 31))
    fail("{}: {} (token, head) segments: beyond the 2^31 one launch indexes", op, segments);
  // (an empty call, n or Ls 0, launches nothing: its divisors are 1)
  return {FastDivisor(static_cast<uint32_t>(d.n > 0 ? d.n : 1)),
          FastDivisor(static_cast<uint32_t>(d.Ls > 0 ? d.Ls : 1)),
          d.n,
          d.L,
          d.Ls,
          offset,
          d.D,
          segments,
          1.0f / static_cast<float>(d.D),
          pair_aligned(tensors)};
}

// f.template operator()<kPairs>() for the pairs per lane pairs_per_lane gave.
template <typename F>
void with_pairs(int pairs, F&& f) {
  with_power_of_two<1, 8>(pairs, f);
}

// The forward kernels' arguments; q_rstd, k_rstd undefined: not saved.
template <typename T, typename H>
ForwardArgs<T, H> forward_args(Heads<H> q_heads, Heads<H> k_heads, Heads<H> v_heads, const Tensor& q_rstd,
                               const Tensor& k_rstd, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& q_scale, const Tensor& k_scale, const Tensor& pe, const Geometry& geo,
                               double eps) {
  return {q_heads,
          k_heads,
          v_heads,
          q_rstd.defined() ? q_rstd.ptr<float>() : nullptr,
          k_rstd.defined() ? k_rstd.ptr<float>() : nullptr,
          mat_of<T>(q),
          mat_of<T>(k),
          mat_of<T>(v),
          q_scale.ptr<float>(),
          k_scale.ptr<float>(),
          pe.ptr<float>(),
          geo,
          static_cast<float>(eps)};
}

// f.template operator()<T, H>() for the token-side type T and the heads' type H.
template <typename F>
void with_types(bool tokens_bf16, bool heads_bf16, F&& f) {
  if (tokens_bf16) {
    if (heads_bf16)
      f.template operator()<__nv_bfloat16, __nv_bfloat16>();
    else
      f.template operator()<__nv_bfloat16, float>();
  } else {
    if (heads_bf16)
      f.template operator()<float, __nv_bfloat16>();
    else
      f.template operator()<float, float>();
  }
}

}  // namespace

namespace {
// The plain op of an FP8-heads op: every field of `a` whose name and type the plain op shares,
// the others (the heads) left for the caller.
template <typename Plain, typename Fp8>
Plain same_named_fields(const Fp8& a) {
  using To = decltype(std::declval<Plain&>().fields());
  using From = decltype(a.fields());
  Plain p{};
  To to = p.fields();
  const From from = a.fields();
  [&]<size_t... I>(std::index_sequence<I...>) {
    const auto copy = [&]<size_t i>() {
      constexpr size_t j = [] {
        for (size_t k = 0; k < Fp8::field_names.size(); ++k)
          if (std::string_view(Fp8::field_names[k]) == std::string_view(Plain::field_names[i])) return k;
        return Fp8::field_names.size();
      }();
      if constexpr (j < Fp8::field_names.size()) {
        using ToField = std::remove_cvref_t<std::tuple_element_t<i, To>>;
        using FromField = std::remove_cvref_t<std::tuple_element_t<j, From>>;
        if constexpr (std::is_same_v<ToField, FromField>) std::get<i>(to) = std::get<j>(from);
      }
    };
    (copy.template operator()<I>(), ...);
  }
  (std::make_index_sequence<Plain::field_names.size()>{});
  return p;
}

}  // namespace

void CudaBackend::execute(const op::QkNormRopeToHeads& args) {
  constexpr std::string_view op = "qk_norm_rope_to_heads";
  const auto d = ops::check(op, args);
  // The types after the shape checks, whose messages name a missing tensor: the activations
  // (token side) f32 or bf16, the heads f32 or bf16, the rest f32.
  const bool bf16 = activations_in_bf16(op, tensor_fields(args, {"q", "k", "v"}));
  require_f32(op, tensor_fields(args, {"q_rstd", "k_rstd", "q_scale", "k_scale", "pe"}));
  const bool heads_bf16 = heads_in_bf16(op, tensor_fields(args, {"q_heads", "k_heads", "v_heads"}));
  const int pairs = pairs_per_lane(op, d.D);
  const Geometry geo = geometry_of(op, d, args.token_offset,
                                   {args.q_heads, args.k_heads, args.v_heads, args.q, args.k, args.v, args.pe});
  if (geo.segments == 0) return;
  const int lanes = vec_path_lanes(d.D, {args.q_heads, args.k_heads, args.v_heads, args.q, args.k, args.v}, args.pe);
  const unsigned blocks = exact_blocks(geo.segments * (lanes > 0 ? lanes : 32));
  const auto launch = [&]<typename T, typename H>() {
    const auto a =
        forward_args<T, H>(heads_of<H>(args.q_heads), heads_of<H>(args.k_heads), heads_of<H>(args.v_heads), args.q_rstd,
                           args.k_rstd, args.q, args.k, args.v, args.q_scale, args.k_scale, args.pe, geo, args.eps);
    if (lanes > 0) {
      with_lanes(lanes, [&]<int kLanes>() {
        qk_norm_rope_to_heads_vec_kernel<kLanes><<<blocks, kThreads, 0, stream_>>>(a);
        FLUX8_LAUNCH_CHECK(qk_norm_rope_to_heads_vec_kernel);
      });
      ++qk_norm_rope_vector_calls_;
      return;
    }
    with_pairs(pairs, [&]<int kPairs>() {
      qk_norm_rope_to_heads_kernel<kPairs><<<blocks, kThreads, 0, stream_>>>(a);
      FLUX8_LAUNCH_CHECK(qk_norm_rope_to_heads_kernel);
    });
  };
  with_types(bf16, heads_bf16, launch);
}

void CudaBackend::execute(const op::QkNormRopeToHeadsFp8& args) {
  constexpr std::string_view op = "qk_norm_rope_to_heads_fp8";
  const Shape h = ops::check(op, args);
  const DType t = attention_heads_dtype(args.q.dtype, h[3]);
  // Shape proxies over the codes: heads of the plain op's type for its checks and path choice
  // (never written: the kernel writes the codes).
  const Tensor qh(args.q_heads.codes.codes, t, h), kh(args.k_heads.codes.codes, t, h),
      vh(args.v_heads.codes.codes, t, h);
  op::QkNormRopeToHeads plain = same_named_fields<op::QkNormRopeToHeads>(args);
  plain.q_heads = qh, plain.k_heads = kh, plain.v_heads = vh;
  const auto d = ops::check(op, plain);
  const bool bf16 = activations_in_bf16(op, tensor_fields(args, {"q", "k", "v"}));
  require_f32(op, tensor_fields(args, {"q_rstd", "k_rstd", "q_scale", "k_scale", "pe"}));
  const bool heads_bf16 = t == DType::bf16;  // the proxies' type (attention_heads_dtype: f32 or bf16)
  const Geometry geo = geometry_of(op, d, args.token_offset, {qh, kh, vh, args.q, args.k, args.v, args.pe});
  const int lanes = vec_path_lanes(d.D, {qh, kh, vh, args.q, args.k, args.v}, args.pe);
  const Fp8Heads* const outs[3] = {&args.q_heads, &args.k_heads, &args.v_heads};
  bool fused = lanes > 0 && geo.segments > 0;
  for (const Fp8Heads* o : outs)
    fused = fused && fp8_heads_vec8(o->codes) && o->q.scaling == Fp8Scaling::per_tensor && o->q.delayed_scale;
  if (!fused) {  // the pair path, an empty call or a scale not known ahead (current scaling)
    Backend::execute(args);
    return;
  }
  const int64_t per_group = segments_per_group(geo.segments, kFp8ForwardBlocksPerSm);
  const int64_t blocks = exact_blocks((geo.segments + per_group - 1) / per_group * lanes);
  const bool count = args.q_heads.q.stats || args.k_heads.q.stats || args.v_heads.q.stats;
  auto* partials =
      count ? static_cast<StatsPartial*>(scratch(static_cast<size_t>(3 * blocks) * sizeof(StatsPartial))) : nullptr;
  const Fp8HeadsOut q8 = fp8_heads_out(args.q_heads, count, partials),
                    k8 = fp8_heads_out(args.k_heads, count, partials + blocks),
                    v8 = fp8_heads_out(args.v_heads, count, partials + 2 * blocks);
  with_types(bf16, heads_bf16, [&]<typename T, typename H>() {
    const auto a =
        forward_args<T, H>(Heads<H>{}, Heads<H>{}, Heads<H>{}, args.q_rstd, args.k_rstd, args.q, args.k, args.v,
                           args.q_scale, args.k_scale, args.pe, geo, args.eps);  // (the heads: the FP8 outputs instead)
    with_lanes(lanes, [&]<int kLanes>() {
      if (count)
        qk_norm_rope_to_heads_fp8_kernel<kLanes, T, H, true>
            <<<static_cast<unsigned>(blocks), kThreads, 0, stream_>>>(a, per_group, q8, k8, v8);
      else
        qk_norm_rope_to_heads_fp8_kernel<kLanes, T, H, false>
            <<<static_cast<unsigned>(blocks), kThreads, 0, stream_>>>(a, per_group, q8, k8, v8);
      FLUX8_LAUNCH_CHECK(qk_norm_rope_to_heads_fp8_kernel);
    });
  });
  ++qk_norm_rope_vector_calls_;
  if (!count) return;  // the amaxes went to their targets by atomics
  const int64_t elements = geo.segments * d.D;
  total_cast_stats(partials, blocks, elements, args.q_heads.q);
  total_cast_stats(partials + blocks, blocks, elements, args.k_heads.q);
  total_cast_stats(partials + 2 * blocks, blocks, elements, args.v_heads.q);
}

void CudaBackend::execute(const op::QkNormRopeToHeadsBackward& args) {
  qk_norm_rope_backward("qk_norm_rope_to_heads_backward", args, nullptr);
}

void CudaBackend::execute(const op::QkNormRopeToHeadsBackwardFp8& args) {
  constexpr std::string_view op = "qk_norm_rope_to_heads_backward_fp8";
  const Shape h = ops::check(op, args);
  const DType t = attention_heads_dtype(args.q.dtype, h[3]);
  const QTensor codes[3] = {args.dq_heads, args.dk_heads, args.dv_heads};
  const bool vec8 = fp8_heads_vec8(args.dq_heads) && fp8_heads_vec8(args.dk_heads) && fp8_heads_vec8(args.dv_heads);
  // Shape proxies over the codes: heads of the plain op's type for its checks and path choice
  // (never read: the kernel reads the codes).
  op::QkNormRopeToHeadsBackward plain = same_named_fields<op::QkNormRopeToHeadsBackward>(args);
  plain.dq_heads = Tensor(args.dq_heads.codes, t, h), plain.dk_heads = Tensor(args.dk_heads.codes, t, h),
  plain.dv_heads = Tensor(args.dv_heads.codes, t, h);
  if (vec8 && h.numel() > 0 && qk_norm_rope_backward(op, plain, codes)) return;
  // Not the vector path (head dim, alignment): dequantize, then the plain op.
  Backend::execute(args);
}

bool CudaBackend::qk_norm_rope_backward(std::string_view op, const op::QkNormRopeToHeadsBackward& args,
                                        const QTensor* fp8) {
  const auto d = ops::check(op, args);
  // The types after the shape checks, as in the forward.
  const bool bf16 = activations_in_bf16(op, tensor_fields(args, {"dq", "dk", "dv", "q", "k"}));
  grads_in_bf16(op, tensor_fields(args, {"dq_scale", "dk_scale"}));  // f32, or bf16 gradients
  require_f32(op, tensor_fields(args, {"q_rstd", "k_rstd", "q_scale", "k_scale", "pe"}));
  const bool heads_bf16 = heads_in_bf16(op, tensor_fields(args, {"dq_heads", "dk_heads", "dv_heads"}));
  const int pairs = pairs_per_lane(op, d.D);
  const Geometry geo =
      geometry_of(op, d, args.token_offset,
                  {args.dq, args.dk, args.dv, args.dq_heads, args.dk_heads, args.dv_heads, args.q, args.k, args.pe});
  const int64_t segments = geo.segments;
  const int lanes = vec_path_lanes(
      d.D, {args.dq, args.dk, args.dv, args.dq_heads, args.dk_heads, args.dv_heads, args.q, args.k}, args.pe);
  if (fp8 && lanes == 0) return false;  // FP8 heads: the vector path only
  if (segments == 0) return true;
  const Fp8HeadsIn dq8 = fp8 ? fp8_heads_in(fp8[0]) : Fp8HeadsIn{}, dk8 = fp8 ? fp8_heads_in(fp8[1]) : Fp8HeadsIn{},
                   dv8 = fp8 ? fp8_heads_in(fp8[2]) : Fp8HeadsIn{};
  const auto kernel_args = [&]<typename T, typename H>(double* q_partial, double* k_partial, int64_t chunk) {
    return BackwardArgs<T, H>{mat_of_or_null<T>(args.dq),
                              mat_of_or_null<T>(args.dk),
                              mat_of_or_null<T>(args.dv),
                              heads_of<H>(args.dq_heads),
                              heads_of<H>(args.dk_heads),
                              heads_of<H>(args.dv_heads),
                              mat_of<T>(args.q),
                              mat_of<T>(args.k),
                              args.q_rstd.ptr<float>(),
                              args.k_rstd.ptr<float>(),
                              args.q_scale.ptr<float>(),
                              args.k_scale.ptr<float>(),
                              args.pe.ptr<float>(),
                              q_partial,
                              k_partial,
                              geo,
                              chunk};
  };

  if (lanes > 0) {  // the vector path: block rows of dscale terms, then column_sums over them
    const int64_t per_group = segments_per_group(segments, kBackwardVecBlocksPerSm);
    const int64_t groups = (segments + per_group - 1) / per_group;
    const int64_t blocks = exact_blocks(groups * lanes);  // kThreads / lanes groups a block
    float* part = args.dq_scale.defined() || args.dk_scale.defined()
                      ? static_cast<float*>(scratch(static_cast<size_t>(2 * blocks * d.D) * sizeof(float)))
                      : nullptr;
    float* const q_part = args.dq_scale.defined() ? part : nullptr;
    float* const k_part = args.dk_scale.defined() ? part + blocks * d.D : nullptr;
    with_types(bf16, heads_bf16, [&]<typename T, typename H>() {
      const BackwardArgs<T, H> a = kernel_args.template operator()<T, H>(nullptr, nullptr, 0);
      with_lanes(lanes, [&]<int kLanes>() {
        if (fp8)
          qk_norm_rope_to_heads_backward_vec_kernel<kLanes, T, H, true>
              <<<static_cast<unsigned>(blocks), kThreads, 0, stream_>>>(a, per_group, q_part, k_part, dq8, dk8, dv8);
        else
          qk_norm_rope_to_heads_backward_vec_kernel<kLanes, T, H, false>
              <<<static_cast<unsigned>(blocks), kThreads, 0, stream_>>>(a, per_group, q_part, k_part, dq8, dk8, dv8);
        FLUX8_LAUNCH_CHECK(qk_norm_rope_to_heads_backward_vec_kernel);
      });
    });
    ++qk_norm_rope_vector_calls_;
    const int64_t D = d.D;
    for (const auto& [dscale, rows] : {std::pair{args.dq_scale, q_part}, std::pair{args.dk_scale, k_part}}) {
      if (!dscale.defined()) continue;
      const auto term = [rows, D] __device__(int64_t, int64_t r, int64_t c) { return rows[r * D + c]; };
      with_grad_storage(dscale, [&](auto* out) { column_sums(*this, 1, blocks, D, term, out, D, true); });
    }
    return true;
  }

  // The pair path: chunks of kColumnChunk segments (column_sums' row chunk), longer where
  // there would be more than kMaxChunks of them; a function of the shape only, so the
  // summation order is fixed.
  int64_t chunk = kColumnChunk;
  if (segments > chunk * kMaxChunks) chunk = (segments + kMaxChunks - 1) / kMaxChunks;
  const int64_t chunks = (segments + chunk - 1) / chunk;
  double* partial = nullptr;
  if (args.dq_scale.defined() || args.dk_scale.defined())
    partial = static_cast<double*>(reduction_scratch(static_cast<size_t>(2 * chunks * d.D) * sizeof(double)));
  double* const q_partial = args.dq_scale.defined() ? partial : nullptr;
  double* const k_partial = args.dk_scale.defined() ? partial + chunks * d.D : nullptr;
  with_types(bf16, heads_bf16, [&]<typename T, typename H>() {
    const BackwardArgs<T, H> a = kernel_args.template operator()<T, H>(q_partial, k_partial, chunk);
    with_pairs(pairs, [&]<int kPairs>() {
      qk_norm_rope_to_heads_backward_kernel<kPairs>
          <<<static_cast<unsigned>(chunks), kBackwardWarps * 32, 0, stream_>>>(a);
      FLUX8_LAUNCH_CHECK(qk_norm_rope_to_heads_backward_kernel);
    });
  });
  // dscale += Σ_chunks partial, chunk by chunk (the second pass of column_sums).
  for (const auto& [dscale, part] : {std::pair{args.dq_scale, q_partial}, std::pair{args.dk_scale, k_partial}})
    if (dscale.defined())
      with_grad_storage(dscale, [&](auto* out) { column_partials_total(*this, 1, d.D, chunks, part, out, d.D, true); });
  return true;
}

}  // namespace flux8
