#pragma once
// FP8 attention heads written or read in place by the kernels around cuDNN's FP8 attention
// (Backend::qk_norm_rope_to_heads_fp8 and friends): 8 consecutive elements of one head row at a
// time, the codes of a per-tensor cast [B·n·L, D] (contiguous: ld = D). A written value is first
// rounded as the plain op would store it in the heads' type H, then cast as quantize() casts it
// (the same scale, conversion and NaN codes: fp8_encode.cuh), and tallied for the amax and the
// counts (cast_stats.cuh); a read code is dequantized and rounded to H as dequantize() into H
// stores it. So the fused kernels give the bits of the plain op followed by the cast, or of the
// dequantize followed by the plain op.
#include "backend/backend.h"
#include "backend/cuda/cast_stats.cuh"
#include "backend/cuda/common.cuh"
#include "fp8/quantize.h"

namespace flux8::cuda {

struct Fp8HeadsOut {
  uint8_t* codes = nullptr;
  const float* scale = nullptr;  // the delayed scale (device memory)
  float* scale_inv = nullptr;    // written with 1/scale by the kernel's first thread
  Fp8Format format = Fp8Format::e4m3;
  StatsPartial* partials = nullptr;  // [blocks], or null: neither amax nor counts wanted
};
struct Fp8HeadsIn {
  const uint8_t* codes = nullptr;
  const float* scale_inv = nullptr;
  Fp8Format format = Fp8Format::e4m3;
};

inline Fp8HeadsIn fp8_heads_in(const QTensor& q) { return {q.codes, q.scale_inv, q.format}; }
// partials: the block partials' memory when the cast's amax or counts are wanted, else ignored.
inline Fp8HeadsOut fp8_heads_out(const Backend::Fp8Heads& h, StatsPartial* partials) {
  const bool wanted = h.q.amax || h.q.stats;
  return {h.codes.codes, h.q.delayed_scale, h.codes.scale_inv, h.codes.format, wanted ? partials : nullptr};
}

// codes[offset .. offset + 7] = the cast of y[0..7] as stored in H, with scale s (= *o.scale,
// read once per thread by the caller); one 8-byte store (offset a multiple of 8, codes 8-byte
// aligned).
template <typename H, bool kCount>
__device__ inline void store8_fp8(const Fp8HeadsOut& o, int64_t offset, const float (&y)[8], float s,
                                  CastTally<kCount>& tally) {
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float v0 = as_stored<H>(y[2 * j]), v1 = as_stored<H>(y[2 * j + 1]);
    const uint32_t pair = encode_pair(v0, v1, s, o.format);
    tally.add(v0, s, pair & 0xFFu, o.format);
    tally.add(v1, s, pair >> 8, o.format);
    w[j / 2] |= pair << (16 * (j % 2));
  }
  *reinterpret_cast<uint2*>(o.codes + offset) = make_uint2(w[0], w[1]);
}

// v[0..7] = codes[offset .. offset + 7] dequantized and rounded to H; one 8-byte load.
template <typename H>
__device__ inline void load8_dequantized(const Fp8HeadsIn& in, int64_t offset, float (&v)[8]) {
  const uint2 w = *reinterpret_cast<const uint2*>(in.codes + offset);
  const float s = *in.scale_inv;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t word = i < 4 ? w.x : w.y;
    v[i] = as_stored<H>(dequantize_value(static_cast<uint8_t>(word >> (8 * (i % 4))), s, in.format));
  }
}

// Whether FP8 heads can be moved 8 codes at a time: codes 8-byte aligned, D a multiple of 8.
inline bool fp8_heads_vec8(const QTensor& q) {
  return reinterpret_cast<uintptr_t>(q.codes) % 8 == 0 && q.cols % 8 == 0;
}

}  // namespace flux8::cuda
