// FP8 casts on the device: CudaBackend::quantize, the twin of CpuBackend::quantize
// (src/backend/cpu/fp8.cpp) and of the reference quantizers (src/fp8/quantize.cpp), bit for bit:
// codes, scales and CastStats.
//
// One kernel per cast. A block owns a 128x128 tile of x, staged once through shared memory, and
// in the same pass writes the rowwise codes, the columnwise codes (the tile transposed: Hopper's
// FP8 GEMMs are TN-only, so each operand also needs a copy with the other dimension contiguous),
// the scales of its blocks and its partial of the statistics. 128 is a multiple of every block
// length, so each block of either copy (1x128, 128x128, 1x32 along x's rows; 128x1, 32x1 along
// its columns for the columnwise copy, which is the quantization of xᵀ) lies inside one tile.
// Per-tensor current scaling reduces the amax of x first: the scale must exist before any
// element is cast. Reads and writes are coalesced: warps walk rows of the tile for x and the
// rowwise codes, columns of it (pitch 129: conflict-free) for the columnwise codes.
//
// Per-tensor scaling (delayed, tensorwise) has its own lighter kernel (cast_per_tensor_kernel):
// with the scale known up front it encodes while loading and keeps only codes in shared memory.
//
// x is an activation, stored in f32 or bf16 (Backend::activation_dtype; for quantize_fused's
// LayerNorm also shift and scale, columns of the modulation Linear's output, while mean and rstd
// stay f32). The kernels are templated on that storage type only where they load: a bf16 value
// widens to f32 exactly, and everything after the load is the f32 code, so a bf16 x casts to
// the codes, scales and statistics the CPU gives for the same values in f32.
//
// Every scale comes from the FLUX8_HD functions the CPU runs (current_scale, scale_inverse,
// e8m0_scale_for_amax, mx_scale) on the same fp32 operands; every code from the FP8 conversion
// instruction applied to the same scaled fp32 value, which rounds exactly like the CPU's integer
// encoder (encode_pair; NaN takes the integer encoder's code). The
// statistics are integer counts and a max, exact in any order: where counts are wanted, tiles
// write partials that one block sums in a fixed order; an amax alone is max-accumulated by one
// atomic per tile.
#include <cuda_fp8.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend/cuda/cast_stats.cuh"
#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8_encode.cuh"
#include "backend/cuda/pointwise.cuh"
#include "fp8/quantize.h"
#include "fp8/recipe.h"

namespace flux8 {
namespace cuda {
namespace {

constexpr int kTile = 128;
constexpr int kPitch = kTile + 1;
constexpr int kCastThreads = 256;
constexpr int kWarps = kCastThreads / 32;
constexpr size_t kTileBytes = size_t(kTile) * kPitch * sizeof(float);
constexpr int kAmaxBlocks = 1024;  // partials of the per-tensor amax pass
constexpr unsigned kFull = 0xffffffffu;

// One copy of the cast (rowwise or columnwise); codes == nullptr: not wanted.
struct CastDst {
  uint8_t* codes = nullptr;
  float* scale_inv = nullptr;  // per_tensor: [1]; blockwise: [rows of the copy / block rows, scale_cols]
  uint8_t* e8m0 = nullptr;     // mx_1x32
  int64_t scale_cols = 0;      // scales per block-row of this copy
};

// An activation element as f32. bf16 widens by taking its bits as the high half of the f32's:
// exact, as load() is, and NaNs keep their sign and payload, as in the CPU's bf16_bits_to_f32,
// whatever the conversion instruction does with them (a NaN's FP8 code carries its sign).
__device__ inline float widen(float v) { return v; }
__device__ inline float widen_bits(uint32_t bf16_bits) { return __uint_as_float(bf16_bits << 16); }
__device__ inline float widen(__nv_bfloat16 v) { return widen_bits(__bfloat16_as_ushort(v)); }

// Where the cast's elements come from: x itself, or the value an element-wise op would have
// stored from x (quantize_fused), computed by the op's own device function (pointwise.cuh).
// T: the storage type of the activations x, shift and scale (float or __nv_bfloat16), read
// through widen(): the op sees the same f32 values either way. The op's result is rounded as
// storing it in T would (as_stored), so the fused cast gives the codes of produce() then
// quantize() on bf16 activations too, and a recomputed input (selective recompute stores the
// op's output, then casts it) casts to the forward's codes.
template <typename T>
struct Source {
  Backend::CastInput::Op op;
  const T* x;
  int64_t ld;
  const float *mean, *rstd;   // layernorm_modulate: per row
  MatOf<T> shift, scale;      // layernorm_modulate: [B, cols], sample of row r = r / tokens; gated:
                              // scale is the gate
  FastDivisor per_sample;     // r / tokens without a 64-bit division per element
  const T* gelu_x = nullptr;  // gelu_tanh_backward: the GELU's input (x is dy), row stride gelu_ld
  int64_t gelu_ld = 0;
  bool shift_vec4 = false, scale_vec4 = false;  // shift/scale rows load 4 columns at once
  // CastInput::head: columns [0, split) are head's as they are; the op's column c is the cast's
  // split + c (split = 0: no head).
  const T* head = nullptr;
  int64_t head_ld = 0, split = 0;
  // gelu_tanh_backward's element from dy and the GELU's input x: the op kernel's dy · f'(x),
  // rounded as stored.
  __device__ static float gelu_backward_value(float dy, float x) { return as_stored<T>(dy * gelu_grad(x)); }
  // gated's element from the residual's gradient dx and the gate: gated_residual_backward's
  // g·dx in f32, rounded as stored.
  __device__ static float gated_value(float dx, float g) { return as_stored<T>(g * dx); }
  // Whether the op reads per-sample vectors (LayerNorm's shift and scale, the gate).
  __device__ bool per_sample_op() const {
    return op == Backend::CastInput::Op::layernorm_modulate || op == Backend::CastInput::Op::gated;
  }
  // The op kOp applied to v = x[r, c]; b = r / tokens (the sample, for the modulation).
  template <Backend::CastInput::Op kOp>
  __device__ float apply_op(float v, int64_t r, int64_t b, int64_t c) const {
    if constexpr (kOp == Backend::CastInput::Op::gelu_tanh) {
      return as_stored<T>(gelu_value(v));
    } else if constexpr (kOp == Backend::CastInput::Op::layernorm_modulate) {
      return as_stored<T>(layernorm_modulate_value(v, mean[r], rstd[r], widen(shift.at(b, c)), widen(scale.at(b, c))));
    } else if constexpr (kOp == Backend::CastInput::Op::gelu_tanh_backward) {
      return gelu_backward_value(v, widen(gelu_x[r * gelu_ld + c]));
    } else if constexpr (kOp == Backend::CastInput::Op::gated) {
      return gated_value(v, widen(scale.at(b, c)));
    } else {
      return v;
    }
  }
  // The same with the op known only at run time.
  __device__ float apply(float v, int64_t r, int64_t b, int64_t c) const {
    switch (op) {
      case Backend::CastInput::Op::gelu_tanh: return apply_op<Backend::CastInput::Op::gelu_tanh>(v, r, b, c);
      case Backend::CastInput::Op::layernorm_modulate:
        return apply_op<Backend::CastInput::Op::layernorm_modulate>(v, r, b, c);
      case Backend::CastInput::Op::gelu_tanh_backward:
        return apply_op<Backend::CastInput::Op::gelu_tanh_backward>(v, r, b, c);
      case Backend::CastInput::Op::gated: return apply_op<Backend::CastInput::Op::gated>(v, r, b, c);
      default: return v;
    }
  }
  __device__ float operator()(int64_t r, int64_t c) const {
    if (c < split) return widen(head[r * head_ld + c]);
    c -= split;
    return apply(widen(x[r * ld + c]), r, per_sample_op() ? per_sample.divide(static_cast<uint32_t>(r)) : 0, c);
  }
};

template <typename T>
struct CastArgs {
  Source<T> x;
  int64_t rows, cols;
  int64_t tiles_x;  // tiles per row of tiles
  Fp8Format format;
  bool pow2;
  const float* tensor_scale;  // per_tensor: the scale, in device memory (current: computed by
                              // the amax pass; delayed: the registry's, read in stream order)
  CastDst row, col;
  bool stats_from_col;      // CastStats describe the columnwise cast (no rowwise copy)
  StatsPartial* partials;   // [tiles] where the counts are wanted (totalled after the kernel), else null
  float* amax_target;       // without partials: the amax alone, max-accumulated here by one atomic per tile
  double* column_partials;  // [row tiles, cols]: each tile's column sums (Quantize::column_sums), or null
  bool x_vec4;              // x and its ld allow loading 4 columns as one access (per-tensor kernel)
  bool gelu_vec4;           // the same for the GELU input of gelu_tanh_backward
  bool head_vec4;           // the same for the head (CastInput::head)
  bool full_tiles;          // the per-tensor kernel's kFull path may take x's inner 128x128 tiles
};

__device__ inline uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

// Amaxes here are >= +0 and never NaN (amax_accumulate drops NaN): fmaxf is exact.
__device__ inline float warp_amax(float a) {
  for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(kFull, a, o));
  return a;
}

// The scale of a 1-D block from its amax, and what the QTensor stores for it.
// Block k of copy d (k: index into its scales).
__device__ inline float block_scale(Fp8Scaling s, float amax, Fp8Format f, bool pow2, const CastDst& d, int64_t k) {
  if (s == Fp8Scaling::mx_1x32) {
    const uint8_t e = e8m0_scale_for_amax(amax, fp8_max(f));
    d.e8m0[k] = e;
    return mx_scale(e);
  }
  const float scale = current_scale(amax, fp8_max(f), pow2);
  d.scale_inv[k] = scale_inverse(scale);
  return scale;
}

// This block's 128x128 tile of x: tile row ty, column tx, first element (r0, c0), nr x nc of it
// inside x (partial at the bottom and right edges).
struct Tile {
  int64_t ty, tx, r0, c0;
  int nr, nc;
};
template <typename T>
__device__ inline Tile tile_of(const CastArgs<T>& a) {
  Tile t;
  t.ty = blockIdx.x / a.tiles_x, t.tx = blockIdx.x % a.tiles_x;
  t.r0 = t.ty * kTile, t.c0 = t.tx * kTile;
  t.nr = static_cast<int>(a.rows - t.r0 < kTile ? a.rows - t.r0 : kTile);
  t.nc = static_cast<int>(a.cols - t.c0 < kTile ? a.cols - t.c0 : kTile);
  return t;
}

// The tile's share of the cast's statistics from each thread's amax (>= +0, never NaN) and
// counts: CastTally::finish_block (cast_stats.cuh), shared with the FP8-heads kernels — a
// partial where counts are wanted, else the amax alone by one atomic per block, which spares
// the amax-only casts (every delayed cast of a step without a telemetry report) the partials'
// write and the one-block totalling kernel after each cast. Every thread of the block calls it.
template <typename T>
__device__ inline void finish_tile_stats(const CastArgs<T>& a, uint32_t amax_bits, uint32_t nonzero, uint32_t saturated,
                                         uint32_t flushed) {
  CastTally<true> tally;
  tally.amax_bits = amax_bits;
  tally.nonzero = nonzero, tally.saturated = saturated, tally.flushed = flushed;
  tally.finish_block(a.partials, a.amax_target);
}

template <Fp8Scaling S, typename T>
__global__ void __launch_bounds__(kCastThreads) cast_tile_kernel(CastArgs<T> a) {
  static_assert(S != Fp8Scaling::per_tensor, "per-tensor casts run cast_per_tensor_kernel");
  extern __shared__ float tile[];                            // [kTile][kPitch]
  constexpr int kSeg = S == Fp8Scaling::mx_1x32 ? 32 : 128;  // 1-D block length
  constexpr int kNumSeg = kTile / kSeg;
  __shared__ float row_scale[kTile][kNumSeg];  // 1-D scalings: scale of (tile row, segment)
  __shared__ float col_scale[kTile][kNumSeg];  // ... of (tile column, segment of rows)
  __shared__ float tile_scale;                 // block_128x128
  __shared__ float red_amax[kWarps];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const auto [ty, tx, r0, c0, nr, nc] = tile_of(a);

  // Stage the tile; cells outside x hold 0, which changes no amax.
  float amax = 0.0f;
  for (int i = warp; i < kTile; i += kWarps)
    for (int q = 0; q < 4; ++q) {
      const int j = lane + 32 * q;
      const float v = i < nr && j < nc ? a.x(r0 + i, c0 + j) : 0.0f;
      tile[i * kPitch + j] = v;
      amax = amax_accumulate(amax, v);
    }
  const float block_amax_w = warp_amax(amax);
  if (lane == 0) red_amax[warp] = block_amax_w;
  __syncthreads();
  float tile_amax = 0.0f;
  for (int w = 0; w < kWarps; ++w) tile_amax = fmaxf(tile_amax, red_amax[w]);

  if constexpr (S == Fp8Scaling::block_128x128) {
    // One scale per tile; the columnwise copy's tile (tx, ty) holds the same elements.
    if (threadIdx.x == 0) {
      const float s = current_scale(tile_amax, fp8_max(a.format), a.pow2);
      tile_scale = s;
      if (a.row.codes) a.row.scale_inv[ty * a.row.scale_cols + tx] = scale_inverse(s);
      if (a.col.codes) a.col.scale_inv[tx * a.col.scale_cols + ty] = scale_inverse(s);
    }
  } else {
    // Rowwise blocks: a warp per tile row, lane holds columns lane + 32q (segment q for 1x32).
    if (a.row.codes)
      for (int i = warp; i < nr; i += kWarps) {
        float m[4];
        for (int q = 0; q < 4; ++q) m[q] = warp_amax(amax_accumulate(0.0f, tile[i * kPitch + lane + 32 * q]));
        if (kNumSeg == 1) m[0] = fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
        const int q = lane;
        if (q < kNumSeg && q * kSeg < nc) {
          const int64_t k = (r0 + i) * a.row.scale_cols + c0 / kSeg + q;
          row_scale[i][q] = block_scale(S, m[q], a.format, a.pow2, a.row, k);
        }
      }
    // Columnwise blocks (rows of xᵀ): a warp per tile column, lane holds rows lane + 32q.
    if (a.col.codes)
      for (int j = warp; j < nc; j += kWarps) {
        float m[4];
        for (int q = 0; q < 4; ++q) m[q] = warp_amax(amax_accumulate(0.0f, tile[(lane + 32 * q) * kPitch + j]));
        if (kNumSeg == 1) m[0] = fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
        const int q = lane;
        if (q < kNumSeg && q * kSeg < nr) {
          const int64_t k = (c0 + j) * a.col.scale_cols + r0 / kSeg + q;
          col_scale[j][q] = block_scale(S, m[q], a.format, a.pow2, a.col, k);
        }
      }
  }
  __syncthreads();

  // The tile's column sums (a bias gradient summed in the pass that casts the output
  // gradient): one thread per column, rows in order; the tiles are added in order afterwards.
  if (a.column_partials && threadIdx.x < nc) {
    double acc = 0;
    for (int i = 0; i < nr; ++i) acc += tile[i * kPitch + threadIdx.x];
    a.column_partials[ty * a.cols + c0 + threadIdx.x] = acc;
  }

  // Cast. The counts follow cast_span() in src/fp8/quantize.cpp exactly.
  const float bound = fp8_saturation_bound(a.format);
  uint32_t nonzero = 0, saturated = 0, flushed = 0;
  auto count = [&](float v, float s, uint8_t code) {
    if (v != 0.0f) {  // NaN != 0: counted as non-zero, neither saturated nor flushed
      ++nonzero;
      if (f32_abs(v * s) > bound)
        ++saturated;
      else if (!f32_is_nan(v) && (code & 0x7fu) == 0)
        ++flushed;
    }
  };
  // One copy's codes: a warp per row of the copy (a row of the tile, or a column for the
  // columnwise copy), each element with its block's scale.
  const auto cast_copy = [&]<bool kColumnwise>(uint8_t* codes, bool counted) {
    const int rows = kColumnwise ? nc : nr, cols = kColumnwise ? nr : nc;
    for (int o = warp; o < rows; o += kWarps)
      for (int q = 0; q < 4; ++q) {
        const int n = lane + 32 * q;
        if (n >= cols) break;
        const int i = kColumnwise ? n : o, j = kColumnwise ? o : n;
        const float v = tile[i * kPitch + j];
        float s;
        if constexpr (S == Fp8Scaling::block_128x128)
          s = tile_scale;
        else
          s = kColumnwise ? col_scale[j][i / kSeg] : row_scale[i][j / kSeg];
        const uint8_t code = static_cast<uint8_t>(encode_pair(v, 0.0f, s, a.format));
        codes[kColumnwise ? (c0 + j) * a.rows + r0 + i : (r0 + i) * a.cols + c0 + j] = code;
        if (counted) count(v, s, code);
      }
  };
  if (a.row.codes) cast_copy.template operator()<false>(a.row.codes, !a.stats_from_col);
  if (a.col.codes) cast_copy.template operator()<true>(a.col.codes, a.stats_from_col);

  finish_tile_stats(a, f32_bits(tile_amax), nonzero, saturated, flushed);
}

// Per-tensor scaling (delayed and tensorwise, the recipes that matter for speed): the scale is
// known before the tile is read, so each element is loaded once (4 columns per access where x
// allows: Quad), encoded once (two per conversion instruction), and its code goes straight to the
// rowwise copy (4 bytes per thread) and into a 16 KB byte tile from which the columnwise copy
// is written transposed. The generic kernel above stages 64 KB of f32 and encodes every
// element once per copy; this one runs at 8 blocks per SM. Same codes, scales, statistics and
// column sums (the column sums in another fixed order: per warp over its rows, then warps in
// order; the CPU comparison is to 1e-6, like the generic kernel's).
__device__ inline int swizzle(int row) { return (row >> 2) & 31; }

// The load side of cast_per_tensor_kernel: a thread's 4 columns of one row of x, read as one
// access where x allows (16 bytes of f32, 8 of bf16: a warp reads 256 consecutive bytes of a
// bf16 row) and kept as loaded until the row is encoded; columns past the edge read as +0.
template <typename T>
struct Quad;
template <>
struct Quad<float> {
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  __device__ void load(const float* p, int n, bool vec) {
    if (n == 4 && vec) {
      const float4 q = load4(p);
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (k < n) v[k] = p[k];
    }
  }
  __device__ float operator[](int k) const { return v[k]; }
};
template <>
struct Quad<__nv_bfloat16> {
  uint32_t w[2] = {0, 0};  // columns 2h (low half) and 2h + 1 (high half) in w[h]
  __device__ void load(const __nv_bfloat16* p, int n, bool vec) {
    if (n == 4 && vec) {
      const uint2 q = *reinterpret_cast<const uint2*>(p);
      w[0] = q.x, w[1] = q.y;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (k < n) w[k / 2] |= static_cast<uint32_t>(__bfloat16_as_ushort(p[k])) << (16 * (k % 2));
    }
  }
  // widen() of column k: an odd column's bits are already the high half of the word.
  __device__ float operator[](int k) const {
    const uint32_t h = w[k / 2];
    return k % 2 ? __uint_as_float(h & 0xFFFF0000u) : widen_bits(h & 0xFFFFu);
  }
};

// kCount: the telemetry counts (non-zero, saturated, flushed elements) are wanted (Quantize::
// stats). Without them the kernel keeps only the amax, a third fewer instructions per element,
// and training asks for the counts only on the steps that report them (fp8_stats_interval).
//
// kOp: the element-wise op of a fused cast (Source::op, fixed per instantiation so an identity
// cast carries none of the ops' code or registers). kFmt: the FP8 format (a run-time format
// issued both conversion instructions, one predicated off). A full quad of non-NaN values (the
// rule in training) takes the short path: its amax as the integer max of the |v| bit patterns
// (for non-negative floats and +inf the same order as the floats'; a NaN, above +inf, sends the
// quad to the element-wise path, which drops it from the amax as amax_accumulate does) and the
// bare conversion instruction, without the NaN fix-ups of encode_pair.
//
// kFull: the tile is 128x128 inside x, every access vectorised, offsets within the tile in 32
// bits, no counts. The general loop is bound by instruction issue, a third of it the 64-bit row
// addressing and the edge checks of each quad, and its LayerNorm cast loads shift and scale per
// element. Edge tiles and counted casts take the general loop (kFull false).
struct RowPassOut {
  uint32_t amax_bits = 0;  // the amax's bit pattern (of a non-negative, non-NaN float)
  uint32_t nonzero = 0, saturated = 0, flushed = 0;
  // Column sums of the thread's ≤ 16 rows of the tile in f32 (a double add per element cost a
  // conversion each, at a quarter of the f32 issue rate); the tile's warps add in double.
  float cs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
};

// One row segment of a thread: the 4 values v (the first nj real) encoded into a word of codes
// with scale s, their amax, counts (kCount) and, with `sums`, column sums added to `out`.
template <bool kCount, Fp8Format kFmt>
__device__ __forceinline__ uint32_t encode_quad(const float (&v)[4], int nj, float s, bool scale_ok, bool sums,
                                                RowPassOut& out) {
  [[maybe_unused]] const float bound = fp8_saturation_bound(kFmt);
  const uint32_t m = umax(umax(f32_bits(v[0]) & 0x7FFFFFFFu, f32_bits(v[1]) & 0x7FFFFFFFu),
                          umax(f32_bits(v[2]) & 0x7FFFFFFFu, f32_bits(v[3]) & 0x7FFFFFFFu));
  uint32_t word;
  if (!kCount && nj == 4 && scale_ok && m <= 0x7F800000u) {
    word = encode_pair_finite(v[0], v[1], s, kFmt) | (encode_pair_finite(v[2], v[3], s, kFmt) << 16);
    out.amax_bits = umax(out.amax_bits, m);
    if (sums)
#pragma unroll
      for (int k = 0; k < 4; ++k) out.cs[k] += v[k];
  } else {
    word = encode_pair(v[0], v[1], s, kFmt) | (encode_pair(v[2], v[3], s, kFmt) << 16);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k >= nj) break;
      const float x = v[k];
      if (!f32_is_nan(x)) out.amax_bits = umax(out.amax_bits, f32_bits(x) & 0x7FFFFFFFu);
      if constexpr (kCount) {
        if (x != 0.0f) {  // the counts of cast_span() in src/fp8/quantize.cpp; NaN is non-zero
          ++out.nonzero;
          if (f32_abs(x * s) > bound)
            ++out.saturated;
          else if (!f32_is_nan(x) && ((word >> (8 * k)) & 0x7Fu) == 0)
            ++out.flushed;
        }
      }
      if (sums) out.cs[k] += x;
    }
  }
  return word;
}

// The tile's elements come from `src` (a.x, or a head's identity source), whose columns start
// at sc0 for this tile (t.c0 in the cast's columns); x_vec: src.x and its ld allow vector loads.
template <typename T, bool kCount, Backend::CastInput::Op kOp, Fp8Format kFmt, bool kFull>
__device__ __forceinline__ void cast_rows(const CastArgs<T>& a, const Tile& t, const Source<T>& src, int64_t sc0,
                                          bool x_vec, float s, bool scale_ok, uint32_t (&codes)[kTile][kTile / 4],
                                          RowPassOut& out) {
  using Op = Backend::CastInput::Op;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j0 = 4 * lane;  // this thread's 4 columns of the tile
  const int nr = kFull ? kTile : t.nr;
  const int nj = kFull ? 4 : (t.nc - j0 < 4 ? (t.nc - j0 > 0 ? t.nc - j0 : 0) : 4);
  const bool vec = kFull || x_vec, gelu_vec = kFull || a.gelu_vec4;
  // Row strides: 32-bit in a full tile (the host checks that 128 rows of x fit), so that a row
  // further is one 32-bit multiply-add on the tile's base pointer.
  using Index = std::conditional_t<kFull, int32_t, int64_t>;
  const Index ld = static_cast<Index>(src.ld), cols = static_cast<Index>(a.cols);
  [[maybe_unused]] const Index gelu_ld = static_cast<Index>(src.gelu_ld);
  const T* const x_tile = src.x + t.r0 * src.ld + sc0 + j0;
  [[maybe_unused]] const T* const gelu_tile =
      kOp == Op::gelu_tanh_backward ? src.gelu_x + t.r0 * src.gelu_ld + sc0 + j0 : nullptr;
  uint8_t* const row_tile = a.row.codes ? a.row.codes + t.r0 * a.cols + t.c0 + j0 : nullptr;
  const bool row_word = row_tile && nj == 4 && (kFull || a.cols % 4 == 0);
  // LayerNorm: the thread's 4 columns of shift and scale (gated: of the gate, in scale),
  // reloaded only when the sample changes (a tile's rows are one or two samples).
  [[maybe_unused]] float shift[4] = {}, scale[4] = {};
  [[maybe_unused]] int64_t sample = -1;
  // Rows in groups of kAhead per thread: the group's loads are issued before any of its rows is
  // encoded, so each thread keeps kAhead loads in flight (rows are visited in the same order as
  // one at a time: the column sums add in the same order). The general loop takes 4 (8 rows
  // ahead for bf16 took 80 registers instead of 64 and was no faster while the loop was bound
  // by instruction issue); the lean kFull loop is bound by load latency (L1TEX scoreboard
  // stalls) and keeps 8 bf16 rows (8 bytes each) in flight where that
  // leaves 4 blocks per SM (≤ 64 registers: the identity cast and GELU's; LayerNorm's and GELU
  // backward's two inputs would take 78–108).
  constexpr int kAhead = kFull && sizeof(T) == 2 && (kOp == Op::identity || kOp == Op::gelu_tanh) ? 8 : 4;
#pragma unroll 1
  for (int i0 = warp; i0 < nr; i0 += kWarps * kAhead) {
    Quad<T> quad[kAhead];
    // gelu_tanh_backward: the GELU inputs of the same columns, loaded alongside.
    [[maybe_unused]] Quad<T> gelu_quad[kOp == Op::gelu_tanh_backward ? kAhead : 1];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int i = i0 + u * kWarps;
      if (!kFull && i >= nr) continue;
      quad[u].load(x_tile + i * ld, nj, vec);
      if constexpr (kOp == Op::gelu_tanh_backward) gelu_quad[u].load(gelu_tile + i * gelu_ld, nj, gelu_vec);
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int i = i0 + u * kWarps;
      if (!kFull && i >= nr) break;
      float v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) v[k] = quad[u][k];
      const int64_t r = t.r0 + i;
      if constexpr (kOp == Op::gelu_tanh_backward) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (k < nj) v[k] = Source<T>::gelu_backward_value(v[k], gelu_quad[u][k]);
      } else if constexpr (kOp == Op::layernorm_modulate) {
        const int64_t b = src.per_sample.divide(static_cast<uint32_t>(r));
        if (b != sample) {  // warp-uniform: a warp walks one row at a time
          sample = b;
          Quad<T> sq, cq;
          sq.load(src.shift.p + b * src.shift.ld + sc0 + j0, nj, src.shift_vec4);
          cq.load(src.scale.p + b * src.scale.ld + sc0 + j0, nj, src.scale_vec4);
#pragma unroll
          for (int k = 0; k < 4; ++k) shift[k] = sq[k], scale[k] = cq[k];
        }
        const float mu = src.mean[r], rs = src.rstd[r];
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (k < nj) v[k] = as_stored<T>(layernorm_modulate_value(v[k], mu, rs, shift[k], scale[k]));
      } else if constexpr (kOp == Op::gated) {
        const int64_t b = src.per_sample.divide(static_cast<uint32_t>(r));
        if (b != sample) {  // warp-uniform, as LayerNorm's
          sample = b;
          Quad<T> gq;
          gq.load(src.scale.p + b * src.scale.ld + sc0 + j0, nj, src.scale_vec4);
#pragma unroll
          for (int k = 0; k < 4; ++k) scale[k] = gq[k];
        }
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (k < nj) v[k] = Source<T>::gated_value(v[k], scale[k]);
      } else if constexpr (kOp != Op::identity) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (k < nj) v[k] = src.template apply_op<kOp>(v[k], r, 0, sc0 + j0 + k);
      }
      const uint32_t word = encode_quad<kCount, kFmt>(v, nj, s, scale_ok, a.column_partials != nullptr, out);
      codes[i][lane ^ swizzle(i)] = word;
      if (row_word) {
        *reinterpret_cast<uint32_t*>(row_tile + i * cols) = word;
      } else if (row_tile) {
        for (int k = 0; k < nj; ++k) row_tile[i * cols + k] = static_cast<uint8_t>(word >> (8 * k));
      }
    }
  }
}

template <typename T, bool kCount, Backend::CastInput::Op kOp, Fp8Format kFmt>
__global__ void __launch_bounds__(kCastThreads) cast_per_tensor_kernel(CastArgs<T> a) {
  // The tile's codes, 4 columns per word; word g of row i sits at column g ^ swizzle(i), so that
  // both the row pass (a warp writes one row's 32 words) and the column pass (a warp reads
  // word g of 32 groups of 4 rows) hit 32 different banks.
  __shared__ uint32_t codes[kTile][kTile / 4];
  __shared__ double col_sum[kWarps][kTile];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Tile tile = tile_of(a);
  const auto [ty, tx, r0, c0, nr, nc] = tile;
  const float s = *a.tensor_scale;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (a.row.codes) a.row.scale_inv[0] = scale_inverse(s);
    if (a.col.codes) a.col.scale_inv[0] = scale_inverse(s);
  }
  const bool scale_ok = !f32_is_nan(s);
  const int j0 = 4 * lane;  // this thread's 4 columns of the tile
  RowPassOut out;
  const bool full = !kCount && a.full_tiles && nr == kTile && nc == kTile;
  const auto rows = [&]<Backend::CastInput::Op kTileOp>(const Source<T>& src, int64_t sc0, bool x_vec) {
    if (full)
      cast_rows<T, kCount, kTileOp, kFmt, true>(a, tile, src, sc0, x_vec, s, scale_ok, codes, out);
    else
      cast_rows<T, kCount, kTileOp, kFmt, false>(a, tile, src, sc0, x_vec, s, scale_ok, codes, out);
  };
  // A head (CastInput::head, GELU casts only; split a multiple of the tile, so a tile is all
  // head or all op) is cast as it is.
  using Op = Backend::CastInput::Op;
  if constexpr (kOp == Op::gelu_tanh || kOp == Op::gelu_tanh_backward) {
    if (c0 < a.x.split) {
      Source<T> head{};
      head.op = Op::identity, head.x = a.x.head, head.ld = a.x.head_ld;
      rows.template operator()<Op::identity>(head, c0, a.head_vec4);
    } else {
      rows.template operator()<kOp>(a.x, c0 - a.x.split, a.x_vec4);
    }
  } else {
    rows.template operator()<kOp>(a.x, c0, a.x_vec4);
  }
  const float* cs = out.cs;
  if (a.column_partials)
#pragma unroll
    for (int k = 0; k < 4; ++k) col_sum[warp][j0 + k] = cs[k];
  __syncthreads();

  // The columnwise copy: a warp per group of 4 tile columns, lane t on rows 4t..4t+3. It reads
  // the 4x4 bytes of its rows and columns (4 words), transposes them in registers, and writes 4
  // bytes to each of the 4 rows of the transposed copy: each store of the warp is 128
  // consecutive bytes of one row of xᵀ.
  if (a.col.codes) {
    const int i0 = 4 * lane, ni = nr - i0 < 4 ? (nr - i0 > 0 ? nr - i0 : 0) : 4;
    const bool col_words = a.rows % 4 == 0 && ni == 4;
    for (int g = warp; 4 * g < nc; g += kWarps) {
      uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (k < ni) w[k] = codes[i0 + k][g ^ swizzle(i0 + k)];
      // rows -> columns: t0 = (r0.b0 r1.b0 r0.b1 r1.b1), t1 = (r0.b2 r1.b2 r0.b3 r1.b3), ...
      const uint32_t t0 = __byte_perm(w[0], w[1], 0x5140), t1 = __byte_perm(w[0], w[1], 0x7362);
      const uint32_t t2 = __byte_perm(w[2], w[3], 0x5140), t3 = __byte_perm(w[2], w[3], 0x7362);
      const uint32_t col[4] = {__byte_perm(t0, t2, 0x5410), __byte_perm(t0, t2, 0x7632), __byte_perm(t1, t3, 0x5410),
                               __byte_perm(t1, t3, 0x7632)};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (4 * g + c >= nc) break;
        uint8_t* dst = a.col.codes + (c0 + 4 * g + c) * a.rows + r0 + i0;
        if (col_words)
          *reinterpret_cast<uint32_t*>(dst) = col[c];
        else
          for (int k = 0; k < ni; ++k) dst[k] = static_cast<uint8_t>(col[c] >> (8 * k));
      }
    }
  }
  if (a.column_partials && threadIdx.x < nc) {
    double t = 0;
    for (int w = 0; w < kWarps; ++w) t += col_sum[w][threadIdx.x];
    a.column_partials[ty * a.cols + c0 + threadIdx.x] = t;
  }

  finish_tile_stats(a, out.amax_bits, out.nonzero, out.saturated, out.flushed);
}

// One block: Σ of the tiles' partials (thread t takes partials t, t + 256, ...; then a fixed tree)
// into *out (the host's telemetry, when wanted) and the amax max-accumulated into *amax (the
// delayed-scaling staging slot, in device memory, when given).
__global__ void __launch_bounds__(kCastThreads)
    stats_total_kernel(const StatsPartial* p, int64_t n, StatsTotal* out, float* amax_target) {
  __shared__ float sh_amax[kCastThreads];
  __shared__ unsigned long long sh[3][kCastThreads];
  float amax = 0.0f;
  unsigned long long c[3] = {0, 0, 0};
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    amax = fmaxf(amax, p[i].amax);
    c[0] += p[i].nonzero;
    c[1] += p[i].saturated;
    c[2] += p[i].flushed;
  }
  sh_amax[threadIdx.x] = amax;
  for (int k = 0; k < 3; ++k) sh[k][threadIdx.x] = c[k];
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      sh_amax[threadIdx.x] = fmaxf(sh_amax[threadIdx.x], sh_amax[threadIdx.x + s]);
      for (int k = 0; k < 3; ++k) sh[k][threadIdx.x] += sh[k][threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    if (out) *out = StatsTotal{sh_amax[0], sh[0][0], sh[1][0], sh[2][0]};
    if (amax_target) *amax_target = amax_accumulate(*amax_target, sh_amax[0]);
  }
}

// The delayed-scaling update of all slots (Backend::delayed_scaling_update): one block per 32
// slots, the lanes of a warp on adjacent slots (each history row is read 128 bytes at a time),
// the kUpdateWarps warps on consecutive chunks of the history rows 1..L-1. Same result as
// delayed_update_slot() per slot: the window max is a max (exact in any order), and the roll
// (rows 2..L-1 up by one) goes in three phases so that no row is overwritten before it is read:
// (1) every warp takes its chunk's max; (2) each thread moves its chunk up by one within the
// chunk, keeping the chunk's first row in a register; (3) after a barrier, it writes that row
// into the previous chunk's last row (row 1 is the oldest and drops out).
constexpr int kUpdateWarps = 32;
__global__ void __launch_bounds__(32 * kUpdateWarps)
    delayed_update_kernel(float* history, int64_t n, int64_t L, const float* fp8_max, AmaxAlgo algo, int margin,
                          float* scale, float* scale_inv) {
  __shared__ float chunk_max[kUpdateWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t slot = int64_t(blockIdx.x) * 32 + lane;
  const bool active = slot < n;
  float* h = history + (active ? slot : 0);
  const float last = active ? h[0] : 0.0f;
  const bool rolls = active && last != 0.0f;  // 0: not cast this step, nothing changes (NaN rolls)
  const int64_t per = (L - 1 + kUpdateWarps - 1) / kUpdateWarps;
  const int64_t begin = 1 + warp * per, end = begin + per < L ? begin + per : L;  // rows [begin, end)
  float m = 0.0f;
  if (rolls)
    for (int64_t r = begin; r < end; ++r) {
      const float a = h[r * n];
      if (a > m) m = a;  // NaN rows are ignored, as in delayed_update_slot
    }
  chunk_max[warp][lane] = m;
  __syncthreads();
  float first = 0.0f;
  if (rolls && begin < end) {
    first = h[begin * n];
    for (int64_t r = begin + 1; r < end; ++r) h[(r - 1) * n] = h[r * n];
  }
  __syncthreads();
  if (rolls && begin < end && begin > 1) h[(begin - 1) * n] = first;
  if (warp == 0 && rolls) {
    float window_max = last > 0.0f ? last : 0.0f;
    for (int w = 0; w < kUpdateWarps; ++w)
      if (chunk_max[w][lane] > window_max) window_max = chunk_max[w][lane];
    if (L > 1) h[(L - 1) * n] = last;  // the last row is no chunk's target: no race
    h[0] = 0.0f;
    const float amax = algo == AmaxAlgo::most_recent ? last : window_max;
    const float sc = delayed_scale(amax, scale[slot], fp8_max[slot], margin);
    scale[slot] = sc;
    scale_inv[slot] = scale_inverse(sc);
  }
}

// Per-tensor current scaling, pass 1: block b takes rows b, b + gridDim.x, ...
template <typename T>
__global__ void __launch_bounds__(kCastThreads)
    amax_partials_kernel(Source<T> x, int64_t rows, int64_t cols, float* partial) {
  __shared__ float sh[kWarps];
  float m = 0.0f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = amax_accumulate(m, x(r, c));
  m = warp_amax(m);
  if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) m = fmaxf(m, sh[w]);
    partial[blockIdx.x] = m;
  }
}

// Pass 2: the tensor's amax and current scale (left on the device for the cast kernel); either
// output may be null (cast_amax wants the amax, a cast given its whole tensor's amax the scale of
// its one partial).
__global__ void __launch_bounds__(kCastThreads)
    current_scale_kernel(const float* partial, int n, Fp8Format f, bool pow2, float* scale, float* amax) {
  __shared__ float sh[kWarps];
  float m = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, partial[i]);
  m = warp_amax(m);
  if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) m = fmaxf(m, sh[w]);
    if (scale) *scale = current_scale(m, fp8_max(f), pow2);
    if (amax) *amax = m;
  }
}

// cast_per_tensor_kernel for the source's op, with or without the telemetry counts.
template <typename T>
void launch_per_tensor(const CastArgs<T>& a, bool count, int64_t tiles, cudaStream_t stream) {
  using Op = Backend::CastInput::Op;
  const auto launch = [&]<bool kCount, Op kOp>() {
    const unsigned blocks = static_cast<unsigned>(tiles);
    if (a.format == Fp8Format::e4m3)
      cast_per_tensor_kernel<T, kCount, kOp, Fp8Format::e4m3><<<blocks, kCastThreads, 0, stream>>>(a);
    else
      cast_per_tensor_kernel<T, kCount, kOp, Fp8Format::e5m2><<<blocks, kCastThreads, 0, stream>>>(a);
    FLUX8_LAUNCH_CHECK(cast_per_tensor_kernel);
  };
  const auto with_op = [&]<bool kCount>() {
    switch (a.x.op) {
      case Op::identity: launch.template operator()<kCount, Op::identity>(); break;
      case Op::gelu_tanh: launch.template operator()<kCount, Op::gelu_tanh>(); break;
      case Op::layernorm_modulate: launch.template operator()<kCount, Op::layernorm_modulate>(); break;
      case Op::gelu_tanh_backward: launch.template operator()<kCount, Op::gelu_tanh_backward>(); break;
      case Op::gated: launch.template operator()<kCount, Op::gated>(); break;
    }
  };
  if (count)
    with_op.template operator()<true>();
  else
    with_op.template operator()<false>();
}

template <Fp8Scaling S, typename T>
void launch_cast(const CastArgs<T>& a, int64_t tiles, cudaStream_t stream) {
  // The tile needs 66 KB of shared memory: above the 48 KB a launch gets without asking.
  static const bool configured = [] {
    FLUX8_CUDA_CHECK(cudaFuncSetAttribute(cast_tile_kernel<S, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(kTileBytes)));
    return true;
  }();
  (void)configured;
  cast_tile_kernel<S, T><<<static_cast<unsigned>(tiles), kCastThreads, kTileBytes, stream>>>(a);
  FLUX8_LAUNCH_CHECK(cast_tile_kernel);
}

void check_output(std::string_view op, const QTensor& t, const Backend::Quantize& q, const char* which) {
  if (!t.defined()) return;
  if (t.format != q.format || t.scaling != q.scaling)
    fail("{}: the {} output is [{}, {}] {} {}, the cast gives {} {}", op, which, t.rows, t.cols,
         fp8_format_name(t.format), fp8_scaling_name(t.scaling), fp8_format_name(q.format),
         fp8_scaling_name(q.scaling));
  if (q.scaling == Fp8Scaling::mx_1x32 ? !t.scale_e8m0 : !t.scale_inv)
    fail("{}: the {} output [{}, {}] {} has no {} buffer", op, which, t.rows, t.cols, fp8_scaling_name(t.scaling),
         q.scaling == Fp8Scaling::mx_1x32 ? "E8M0 scale" : "scale_inv");
}

CastDst dst(const QTensor& t) {
  CastDst d;
  if (!t.defined()) return d;
  d.codes = t.codes;
  d.scale_inv = t.scale_inv;
  d.e8m0 = t.scale_e8m0;
  const int64_t bc = t.scaling == Fp8Scaling::mx_1x32 ? 32 : 128;
  d.scale_cols = t.scaling == Fp8Scaling::per_tensor ? 1 : (t.cols + bc - 1) / bc;
  return d;
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// The source of a cast whose activations (x; LayerNorm's shift and scale) are stored as T.
template <typename T>
Source<T> source_of(const Backend::CastInput& in, FastDivisor per_sample) {
  Source<T> s{in.op, static_cast<const T*>(in.x.data), in.x.ld, nullptr, nullptr, {}, {}, {}};
  if (in.op == Backend::CastInput::Op::layernorm_modulate) {
    s.mean = in.mean.ptr<float>();
    s.rstd = in.rstd.ptr<float>();
    s.shift = mat_of<T>(in.shift);
    s.scale = mat_of<T>(in.scale);
    s.per_sample = per_sample;
    s.shift_vec4 = vec4_aligned(s.shift.p) && s.shift.ld % 4 == 0;
    s.scale_vec4 = vec4_aligned(s.scale.p) && s.scale.ld % 4 == 0;
  }
  if (in.op == Backend::CastInput::Op::gelu_tanh_backward) {
    s.gelu_x = static_cast<const T*>(in.gelu_x.data);
    s.gelu_ld = in.gelu_x.ld;
  }
  if (in.op == Backend::CastInput::Op::gated) {
    s.scale = mat_of<T>(in.gate);
    s.per_sample = per_sample;
    s.scale_vec4 = vec4_aligned(s.scale.p) && s.scale.ld % 4 == 0;
  }
  if (in.head.defined()) {
    s.head = static_cast<const T*>(in.head.data);
    s.head_ld = in.head.ld;
    s.split = in.head.cols();
  }
  return s;
}

// Quantize::column_sums of the cast's elements on their own (no tiles to sum them in).
// The sums are a bias gradient: f32, or bf16 (Backend::gradient_dtype).
template <typename T>
void add_column_sums(CudaBackend& be, const Source<T>& src, int64_t rows, int64_t cols, const Tensor& sums,
                     bool accumulate) {
  const auto value = [=] __device__(int64_t, int64_t r, int64_t c) { return double(src(r, c)); };
  with_grad_storage(sums, [&](auto* out) { column_sums(be, 1, rows, cols, value, out, cols, accumulate); });
}

// dst [C, R] = src [R, C]ᵀ by 128x128 tiles of codes through shared memory. Where R and C are
// multiples of 16 (Flux's weights; the pointers 16-byte aligned), every global access is a
// 16-byte piece and every warp store writes whole 128-byte lines of dst:
// - load: a thread moves four 16-byte pieces of src rows into the tile, all in flight at once;
//   piece c of tile row i is kept at piece position c ^ ((i / 16) % 8) (an XOR swizzle);
// - store: a thread owns 4 adjacent columns (a quad) of the tile and 16 of its rows (band m):
//   it reads 16 words (one per row: 4 columns each), transposes them as 4x4 byte blocks
//   (__byte_perm) into four 16-byte pieces, one per dst row, and stores them. The 8 threads
//   with one quad and bands 0..7 write the 8 pieces of a dst row: a warp, 4 quads, writes 4
//   whole lines per store. Without the swizzle the 8 bands' words would sit in one bank (rows
//   16 apart); with it each band reads another 16-byte column of banks.
// (Storing each warp's pieces into 32 different dst rows, bytes gathered one by one, is far
// slower.) Other shapes go element by element. Block (0, 0) copies the scale_inv (the
// same scale: the columnwise copy of a per-tensor cast).
constexpr int kCodeTile = 128;
__device__ inline int swizzled_piece(int row, int piece) { return piece ^ ((row >> 4) & 7); }

__global__ void __launch_bounds__(kThreads)
    transpose_codes_kernel(uint8_t* dst, const uint8_t* src, int64_t R, int64_t C, float* dst_scale_inv,
                           const float* src_scale_inv, bool vec) {
  static_assert(kThreads == 256, "one (quad, band) job per thread: 32 quads x 8 bands");
  __shared__ __align__(16) uint8_t tile[kCodeTile][kCodeTile];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kCodeTile, c0 = static_cast<int64_t>(blockIdx.x) * kCodeTile;
  const int nr = static_cast<int>(R - r0 < kCodeTile ? R - r0 : kCodeTile);
  const int nc = static_cast<int>(C - c0 < kCodeTile ? C - c0 : kCodeTile);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *dst_scale_inv = *src_scale_inv;
  if (vec) {                                               // nr, nc multiples of 16
    constexpr int kPieces = kCodeTile / 16;                // 16-byte pieces a tile row
    constexpr int kEach = kCodeTile * kPieces / kThreads;  // pieces a thread loads
    uint4 piece[kEach];
#pragma unroll
    for (int k = 0; k < kEach; ++k) {
      const int q = threadIdx.x + kThreads * k, i = q / kPieces, c = q % kPieces;
      if (i < nr && 16 * c < nc) piece[k] = *reinterpret_cast<const uint4*>(src + (r0 + i) * C + c0 + 16 * c);
    }
#pragma unroll
    for (int k = 0; k < kEach; ++k) {
      const int q = threadIdx.x + kThreads * k, i = q / kPieces, c = q % kPieces;
      if (i < nr && 16 * c < nc) *reinterpret_cast<uint4*>(&tile[i][16 * swizzled_piece(i, c)]) = piece[k];
    }
    __syncthreads();
    const int m = threadIdx.x % 8, quad = threadIdx.x / 8;  // rows 16m.., columns 4quad..
    if (16 * m >= nr || 4 * quad >= nc) return;
    const int col_byte = 16 * swizzled_piece(16 * m, quad / 4) + 4 * (quad % 4);  // the same for the band's rows
    uint32_t w[16];
#pragma unroll
    for (int b = 0; b < 16; ++b) w[b] = *reinterpret_cast<const uint32_t*>(&tile[16 * m + b][col_byte]);
    uint32_t out[4][4];  // [column e of the quad][word a: rows 16m + 4a .. 4a+3]
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const uint32_t lo01 = __byte_perm(w[4 * a], w[4 * a + 1], 0x5140),
                     hi01 = __byte_perm(w[4 * a], w[4 * a + 1], 0x7362);
      const uint32_t lo23 = __byte_perm(w[4 * a + 2], w[4 * a + 3], 0x5140),
                     hi23 = __byte_perm(w[4 * a + 2], w[4 * a + 3], 0x7362);
      out[0][a] = __byte_perm(lo01, lo23, 0x5410);
      out[1][a] = __byte_perm(lo01, lo23, 0x7632);
      out[2][a] = __byte_perm(hi01, hi23, 0x5410);
      out[3][a] = __byte_perm(hi01, hi23, 0x7632);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e)
      *reinterpret_cast<uint4*>(dst + (c0 + 4 * quad + e) * R + r0 + 16 * m) =
          make_uint4(out[e][0], out[e][1], out[e][2], out[e][3]);
    return;
  }
  for (int q = threadIdx.x; q < kCodeTile * kCodeTile; q += blockDim.x) {
    const int i = q / kCodeTile, j = q % kCodeTile;
    if (i < nr && j < nc) tile[i][j] = src[(r0 + i) * C + c0 + j];
  }
  __syncthreads();
  for (int q = threadIdx.x; q < kCodeTile * kCodeTile; q += blockDim.x) {
    const int j = q / kCodeTile, i = q % kCodeTile;
    if (i < nr && j < nc) dst[(c0 + j) * R + r0 + i] = tile[i][j];
  }
}

}  // namespace
}  // namespace cuda

void CudaBackend::execute(const op::TransposeCodes& args) {
  ops::check("transpose_codes", args);
  if (args.src.numel() == 0) return;
  const dim3 grid(static_cast<unsigned>((args.src.cols + cuda::kCodeTile - 1) / cuda::kCodeTile),
                  static_cast<unsigned>((args.src.rows + cuda::kCodeTile - 1) / cuda::kCodeTile));
  if (grid.y > 65535) fail("transpose_codes: {} rows is more than this kernel's grid takes", args.src.rows);
  const bool vec = args.src.rows % 16 == 0 && args.src.cols % 16 == 0 && cuda::aligned16(args.src.codes) &&
                   cuda::aligned16(args.dst.codes);
  cuda::transpose_codes_kernel<<<grid, cuda::kThreads, 0, stream_>>>(
      args.dst.codes, args.src.codes, args.src.rows, args.src.cols, args.dst.scale_inv, args.src.scale_inv, vec);
  FLUX8_LAUNCH_CHECK(transpose_codes_kernel);
}

void CudaBackend::execute(const op::Quantize& args) {
  CastInput in;
  in.x = args.x;
  quantize_fused(args.rowwise, args.columnwise, in, args.q);
}

namespace {
// The fused input's checks beyond the cast's: x, and LayerNorm's shift and scale (columns of the
// modulation Linear's output), are activations, all f32 or all bf16 (`bf16`); the row statistics
// stay f32. LayerNorm and the gated input read per-sample vectors: `per_sample` divides a row by
// the `tokens` rows of a sample.
struct FusedInput {
  bool bf16 = false;
  int64_t tokens = 1;
  FastDivisor per_sample;
};
FusedInput check_fused_input(std::string_view op, const CastInput& in) {
  using namespace cuda;
  using Op = CastInput::Op;
  const Tensor& x = in.x;
  FusedInput f;
  if (in.op == Op::layernorm_modulate) {
    f.bf16 = activations_in_bf16(op, tensor_fields(in, {"x", "shift", "scale"}));
    require_f32(op, tensor_fields(in, {"mean", "rstd"}));
    const auto dims = ops::check(
        op, op::LayernormModulate{.mean = in.mean, .rstd = in.rstd, .x = x, .shift = in.shift, .scale = in.scale});
    f.tokens = dims.L > 0 ? dims.L : 1;
    f.per_sample = row_divisor(op, x.rows(), f.tokens);
  } else if (in.op == Op::gelu_tanh_backward) {
    ops::require_defined(op, {"gelu_x", in.gelu_x});
    f.bf16 = activations_in_bf16(op, tensor_fields(in, {"x", "gelu_x"}));
    require_same_matrix(op, {"gelu_x", in.gelu_x}, {"x", x});
  } else if (in.op == Op::gated) {  // x [B, L, H], gate [B, H]
    f.bf16 = activations_in_bf16(op, tensor_fields(in, {"x", "gate"}));
    require_rank(op, {"x", x}, 3);
    require_shape(op, {"gate", in.gate}, Shape{x.shape[0], x.shape[2]});
    f.tokens = x.shape[1] > 0 ? x.shape[1] : 1;
    f.per_sample = row_divisor(op, x.rows(), f.tokens);
  } else {
    f.bf16 = activations_in_bf16(op, {{"x", x}});
  }
  return f;
}

// The cast kernels' arguments for one call of quantize_fused over the R x C matrix `src` reads:
// `tensor_scale` the per-tensor scale (device memory), `partials` the tiles' statistics (null:
// no counts), `column_partials` the column sums' scratch (null: none).
template <typename T>
cuda::CastArgs<T> cast_args(const op::QuantizeFused& args, const cuda::Source<T>& src, int64_t R, int64_t C,
                            int64_t tiles_x, const float* tensor_scale, cuda::StatsPartial* partials,
                            double* column_partials) {
  using namespace cuda;
  using Op = CastInput::Op;
  const Tensor& x = args.in.x;
  CastArgs<T> a{};
  a.x = src;
  a.rows = R;
  a.cols = C;
  a.tiles_x = tiles_x;
  a.format = args.q.format;
  a.pow2 = args.q.pow2;
  a.tensor_scale = tensor_scale;
  a.row = dst(args.rowwise);
  a.col = dst(args.columnwise);
  a.stats_from_col = !args.rowwise.defined();
  a.partials = partials;
  a.amax_target = args.q.stats ? nullptr : args.q.amax;
  a.column_partials = column_partials;
  // A thread's 4 columns as one access: 16 bytes of f32, 8 of bf16 (Quad).
  a.x_vec4 = vec4_aligned(src.x) && x.ld % 4 == 0;
  a.gelu_vec4 = src.gelu_x && vec4_aligned(src.gelu_x) && src.gelu_ld % 4 == 0;
  a.head_vec4 = src.head && vec4_aligned(src.head) && src.head_ld % 4 == 0;
  // The kFull path: every access of an inner tile vectorised, its offsets in 32 bits.
  const int64_t max_ld = std::max({x.ld, C, src.gelu_ld, src.head_ld});
  a.full_tiles = a.x_vec4 && C % 4 == 0 && max_ld < (int64_t(1) << 31) / kTile && (!src.head || a.head_vec4) &&
                 (args.in.op != Op::gelu_tanh_backward || a.gelu_vec4) &&
                 (args.in.op != Op::layernorm_modulate || (src.shift_vec4 && src.scale_vec4)) &&
                 (args.in.op != Op::gated || src.scale_vec4);
  return a;
}

}  // namespace

void CudaBackend::execute(const op::QuantizeFused& args) {
  using namespace cuda;
  using Op = CastInput::Op;
  const bool plain = args.in.op == Op::identity && !args.in.head.defined();
  const std::string_view op = plain ? "quantize" : "quantize_fused";
  const Tensor& x = args.in.x;
  // With a head the cast's input is [head | op(x)], in.cols() wide (check_cast_input: x's rows
  // and dtype); the shape checks see that matrix.
  if (args.in.head.defined()) ops::check_cast_input(op, args.in);
  const Tensor whole = args.in.head.defined() ? Tensor(x.data, x.dtype, Shape{x.rows(), args.in.cols()}) : x;
  const bool any_copy = ops::check_quantize(op, args.rowwise, args.columnwise, whole, {DType::f32, DType::bf16});
  ops::check_quantize_spec(op, args.q);
  ops::check_column_sums(op, args.q.column_sums, whole.cols(), /*bf16_ok=*/true);
  const int64_t R = x.rows(), C = whole.cols(), split = args.in.head_cols();
  // The per-tensor kernel takes a head where no tile straddles it, for the GELU casts the model
  // fuses (Source covers the other kernels element by element); otherwise the op's output is
  // assembled first (Backend's default).
  if (args.in.head.defined() && args.q.scaling == Fp8Scaling::per_tensor && any_copy &&
      (split % kTile != 0 || (args.in.op != Op::gelu_tanh && args.in.op != Op::gelu_tanh_backward))) {
    Backend::execute(args);
    return;
  }
  const FusedInput fused = check_fused_input(op, args.in);
  const bool bf16 = fused.bf16;
  const FastDivisor per_sample = fused.per_sample;
  // f(source): the launches that read x, instantiated for its storage type.
  const auto with_source = [&](auto&& f) {
    if (bf16)
      f(source_of<__nv_bfloat16>(args.in, per_sample));
    else
      f(source_of<float>(args.in, per_sample));
  };
  if (args.q.column_sums.defined() && (!any_copy || R == 0 || C == 0)) {  // no tiles to sum in: on their own
    with_source(
        [&](const auto& src) { add_column_sums(*this, src, R, C, args.q.column_sums, args.q.column_sums_accumulate); });
  }
  if (!any_copy) return;
  check_output(op, args.rowwise, args.q, "rowwise");
  check_output(op, args.columnwise, args.q, "columnwise");

  const bool per_tensor = args.q.scaling == Fp8Scaling::per_tensor;
  const float fmax = fp8_max(args.q.format);
  if (R == 0 || C == 0) {
    // Nothing to cast; a per-tensor copy still records its scale_inv, as on the CPU.
    if (per_tensor) {
      const float* delayed = args.q.delayed_scale;
      const float* whole_amax = args.q.whole_amax;
      const bool pow2 = args.q.pow2;
      const float current_inv = scale_inverse(current_scale(0.0f, fmax, pow2));
      float* rp = args.rowwise.defined() ? args.rowwise.scale_inv : nullptr;
      float* cp = args.columnwise.defined() ? args.columnwise.scale_inv : nullptr;
      for_each(*this, 1, [=] __device__(int64_t) {
        const float inv = delayed      ? scale_inverse(*delayed)
                          : whole_amax ? scale_inverse(current_scale(*whole_amax, fmax, pow2))
                                       : current_inv;
        if (rp) *rp = inv;
        if (cp) *cp = inv;
      });
    }
    if (args.q.stats) args.q.stats->merge(CastStats{});
    return;
  }

  const int64_t tiles_x = (C + kTile - 1) / kTile, tiles = tiles_x * ((R + kTile - 1) / kTile);
  FLUX8_CHECK(tiles < (int64_t(1) << 31), "{}: {} tiles of 128x128 exceed one launch", op, tiles);
  const bool current = per_tensor && !args.q.delayed_scale;
  const int amax_blocks = static_cast<int>(R < kAmaxBlocks ? R : kAmaxBlocks);
  // Scratch: [scale][amax partials][tile partials], each 256-byte aligned.
  const size_t off_partial_amax = 256, off_tiles = off_partial_amax + align256(kAmaxBlocks * sizeof(float));
  char* s = static_cast<char*>(scratch(off_tiles + static_cast<size_t>(tiles) * sizeof(StatsPartial)));
  float* scale_dev = reinterpret_cast<float*>(s);
  auto* partials = reinterpret_cast<StatsPartial*>(s + off_tiles);

  const int64_t row_tiles = (R + kTile - 1) / kTile;
  double* column_partials =
      args.q.column_sums.defined()
          ? static_cast<double*>(reduction_scratch(static_cast<size_t>(row_tiles * C) * sizeof(double)))
          : nullptr;
  with_source([&]<typename T>(const Source<T>& src) {
    if (current && args.q.whole_amax) {  // the whole tensor's amax is given: its scale alone
      current_scale_kernel<<<1, kCastThreads, 0, stream()>>>(args.q.whole_amax, 1, args.q.format, args.q.pow2,
                                                             scale_dev, nullptr);
      FLUX8_LAUNCH_CHECK(current_scale_kernel);
    } else if (current) {
      float* amax_partial = reinterpret_cast<float*>(s + off_partial_amax);
      amax_partials_kernel<<<amax_blocks, kCastThreads, 0, stream()>>>(src, R, C, amax_partial);
      FLUX8_LAUNCH_CHECK(amax_partials_kernel);
      current_scale_kernel<<<1, kCastThreads, 0, stream()>>>(amax_partial, amax_blocks, args.q.format, args.q.pow2,
                                                             scale_dev, nullptr);
      FLUX8_LAUNCH_CHECK(current_scale_kernel);
    }

    CastArgs<T> a = cast_args(args, src, R, C, tiles_x, current ? scale_dev : args.q.delayed_scale,
                              args.q.stats ? partials : nullptr, column_partials);
    switch (args.q.scaling) {
      case Fp8Scaling::per_tensor: launch_per_tensor(a, args.q.stats != nullptr, tiles, stream()); break;
      case Fp8Scaling::block_1x128: launch_cast<Fp8Scaling::block_1x128>(a, tiles, stream()); break;
      case Fp8Scaling::block_128x128: launch_cast<Fp8Scaling::block_128x128>(a, tiles, stream()); break;
      case Fp8Scaling::mx_1x32: launch_cast<Fp8Scaling::mx_1x32>(a, tiles, stream()); break;
    }
  });
  if (column_partials)
    with_grad_storage(args.q.column_sums, [&](auto* out) {
      column_partials_total(*this, 1, C, row_tiles, column_partials, out, C, args.q.column_sums_accumulate);
    });
  if (args.q.stats) total_cast_stats(partials, tiles, R * C, args.q);  // else the amax went to q.amax by atomics
}

void CudaBackend::execute(const op::CastAmax& args) {
  using namespace cuda;
  constexpr std::string_view op = "cast_amax";
  ops::check(op, args, {DType::f32, DType::bf16});
  const FusedInput fused = check_fused_input(op, args.in);
  const int64_t R = args.in.x.rows(), C = args.in.cols();
  float* out = args.amax.ptr<float>();
  if (R == 0 || C == 0) {
    FLUX8_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(float), stream()));
    return;
  }
  const int blocks = static_cast<int>(R < kAmaxBlocks ? R : kAmaxBlocks);
  float* partial = static_cast<float*>(scratch(static_cast<size_t>(blocks) * sizeof(float)));
  const auto launch = [&](const auto& src) {
    amax_partials_kernel<<<blocks, kCastThreads, 0, stream()>>>(src, R, C, partial);
    FLUX8_LAUNCH_CHECK(amax_partials_kernel);
    current_scale_kernel<<<1, kCastThreads, 0, stream()>>>(partial, blocks, Fp8Format::e4m3, false, nullptr, out);
    FLUX8_LAUNCH_CHECK(current_scale_kernel);
  };
  if (fused.bf16)
    launch(source_of<__nv_bfloat16>(args.in, fused.per_sample));
  else
    launch(source_of<float>(args.in, fused.per_sample));
}

void CudaBackend::total_cast_stats(const void* partials, int64_t n, int64_t elements, const Quantize& q) {
  using cuda::StatsTotal;
  if (!q.amax && !q.stats) return;
  // The amax goes into the registry's staging slot on the device (q.amax is device memory).
  // The telemetry (q.stats) lives on the host: the cast's totals go to a device slot and reach
  // it at the next synchronize()/download() (one synchronisation per step, not one per cast).
  StatsTotal* total = nullptr;
  if (q.stats) {
    if (pending_stats_.size() == kPendingCastStats) flush_cast_stats();
    if (!stats_dev_) {
      FLUX8_CUDA_CHECK(cudaMalloc(&stats_dev_, kPendingCastStats * sizeof(StatsTotal)));
      FLUX8_CUDA_CHECK(cudaMallocHost(&stats_host_, kPendingCastStats * sizeof(StatsTotal)));
    }
    total = static_cast<StatsTotal*>(stats_dev_) + pending_stats_.size();
  }
  cuda::stats_total_kernel<<<1, cuda::kCastThreads, 0, stream()>>>(static_cast<const cuda::StatsPartial*>(partials), n,
                                                                   total, q.amax);
  FLUX8_LAUNCH_CHECK(stats_total_kernel);
  if (q.stats) pending_stats_.push_back(PendingCastStats{q.stats, elements});
}

void CudaBackend::execute(const op::DelayedScalingUpdate& args) {
  using cuda::delayed_update_kernel;
  const auto d = ops::check("delayed_scaling_update", args);
  if (d.n == 0) return;
  const int64_t blocks = (d.n + 31) / 32;
  delayed_update_kernel<<<static_cast<unsigned>(blocks), 32 * cuda::kUpdateWarps, 0, stream()>>>(
      args.amax_history.ptr<float>(), d.n, d.L, args.fp8_max.ptr<float>(), args.algo, args.margin,
      args.scale.ptr<float>(), args.scale_inv.ptr<float>());
  FLUX8_LAUNCH_CHECK(delayed_update_kernel);
}

void CudaBackend::flush_cast_stats() {
  using cuda::StatsTotal;
  if (pending_stats_.empty()) return;
  // Taken out first: if the synchronisation fails (a device error), the entries are dropped
  // rather than delivered later into targets that may be gone by then.
  const std::vector<PendingCastStats> pending = std::move(pending_stats_);
  pending_stats_.clear();
  const size_t n = pending.size();
  FLUX8_CUDA_CHECK(cudaMemcpyAsync(stats_host_, stats_dev_, n * sizeof(StatsTotal), cudaMemcpyDeviceToHost, stream()));
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream()));
  const auto* totals = static_cast<const StatsTotal*>(stats_host_);
  for (size_t i = 0; i < n; ++i) {  // in cast order, as the CPU backend merges them
    const PendingCastStats& p = pending[i];
    CastStats st;
    st.amax = totals[i].amax;
    st.elements = p.elements;
    st.nonzero = static_cast<int64_t>(totals[i].nonzero);
    st.saturated = static_cast<int64_t>(totals[i].saturated);
    st.flushed = static_cast<int64_t>(totals[i].flushed);
    p.stats->merge(st);
  }
}

}  // namespace flux8
