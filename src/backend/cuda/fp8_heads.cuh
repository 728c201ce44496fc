#pragma once
// FP8 attention heads written or read in place by the kernels around cuDNN's FP8 attention
// (Backend::qk_norm_rope_to_heads_fp8 and friends): 8 consecutive elements of one head row at a
// time, the codes of a per-tensor cast [B·n·L, D] (contiguous: ld = D). A written value is first
// rounded as the plain op would store it in the heads' type H, then cast as quantize() casts it
// (the same scale, conversion and NaN codes: fp8_encode.cuh), and tallied for the amax and the
// counts (cast_stats.cuh); a read code is dequantized and rounded to H as dequantize() into H
// stores it. So the fused kernels give the bits of the plain op followed by the cast, or of the
// dequantize followed by the plain op.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

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
  // Counts wanted (a report step): a partial per block ([blocks]), totalled after the kernel;
  // else the amax alone, max-accumulated by an atomic per block. Either may be null (not wanted).
  StatsPartial* partials = nullptr;
  float* amax = nullptr;

  // The block's share of the cast's statistics (every thread of the block calls it).
  template <bool kCount>
  __device__ void finish_block(const CastTally<kCount>& t) const {
    t.finish_block(partials, amax);
  }
};
struct Fp8HeadsIn {
  const uint8_t* codes = nullptr;
  const float* scale_inv = nullptr;
  Fp8Format format = Fp8Format::e4m3;
};

inline Fp8HeadsIn fp8_heads_in(const QTensor& q) { return {q.codes, q.scale_inv, q.format}; }
// count: the kernel runs with counts (some tensor of the call wants them); then `partials` (the
// block partials' memory) is used where this cast's amax or counts are wanted, else the amax
// goes to its target by atomics.
inline Fp8HeadsOut fp8_heads_out(const Backend::Fp8Heads& h, bool count, StatsPartial* partials) {
  Fp8HeadsOut o{h.codes.codes, h.q.delayed_scale, h.codes.scale_inv, h.codes.format};
  if (count && (h.q.amax || h.q.stats))
    o.partials = partials;
  else if (!count)
    o.amax = h.q.amax;
  return o;
}

// codes[offset .. offset + 7] = the cast of y[0..7] as stored in H, with scale s (= *o.scale,
// read once per thread by the caller); one 8-byte store (offset a multiple of 8, codes 8-byte
// aligned).
// Without counts, 8 values with no NaN among them and a non-NaN scale (the rule in training) take
// the short path, as the per-tensor cast's quads do (fp8.cu): the bare conversion instruction
// and the amax as the integer max of the |v| bit patterns.
template <typename H, bool kCount>
__device__ inline void store8_fp8(const Fp8HeadsOut& o, int64_t offset, const float (&y)[8], float s,
                                  CastTally<kCount>& tally) {
  float v[8];
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] = as_stored<H>(y[i]);
    const uint32_t a = f32_bits(v[i]) & 0x7FFFFFFFu;
    m = m > a ? m : a;
  }
  uint32_t w[2] = {0, 0};
  if (!kCount && m <= 0x7F800000u && !f32_is_nan(s)) {
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j / 2] |= encode_pair_finite(v[2 * j], v[2 * j + 1], s, o.format) << (16 * (j % 2));
    tally.amax_bits = tally.amax_bits > m ? tally.amax_bits : m;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t pair = encode_pair(v[2 * j], v[2 * j + 1], s, o.format);
      tally.add(v[2 * j], s, pair & 0xFFu, o.format);
      tally.add(v[2 * j + 1], s, pair >> 8, o.format);
      w[j / 2] |= pair << (16 * (j % 2));
    }
  }
  *reinterpret_cast<uint2*>(o.codes + offset) = make_uint2(w[0], w[1]);
}

// Two codes (the low 16 bits of `pair`) as f32 by the conversion instruction of sm_89+ (to half,
// which holds every E4M3 and E5M2 value, infinities included, exactly): fp8_decode's values for
// every non-NaN code, in 2 instructions where the integer decoder took ~15 per code.
__device__ inline float2 decode_pair(uint32_t pair, Fp8Format f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu),
                                                   f == Fp8Format::e4m3 ? __NV_E4M3 : __NV_E5M2);
  return __half22float2(__half2(h));
#else
  return make_float2(fp8_decode(static_cast<uint8_t>(pair), f), fp8_decode(static_cast<uint8_t>(pair >> 8), f));
#endif
}
// Whether any of the 4 codes of w is a NaN code of f (E4M3: S.1111.111; E5M2: S.11111.xx, xx ≠ 0).
__device__ inline bool has_nan_code(uint32_t w, Fp8Format f) {
  return __vcmpgtu4(w & 0x7F7F7F7Fu, f == Fp8Format::e4m3 ? 0x7E7E7E7Eu : 0x7C7C7C7Cu) != 0;
}

// v[0..7] = the 8 codes of w dequantized (dequantize_value: decode · s, s the tensor's
// scale_inv) and rounded to H. NaN codes (a diverged step) take the integer decoder, whose NaN
// keeps the code's sign.
template <typename H>
__device__ inline void dequantize8(uint2 w, float s, Fp8Format f, float (&v)[8]) {
  if (!has_nan_code(w.x, f) && !has_nan_code(w.y, f)) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 d = decode_pair((j < 2 ? w.x : w.y) >> (16 * (j % 2)), f);
      v[2 * j] = as_stored<H>(d.x * s);
      v[2 * j + 1] = as_stored<H>(d.y * s);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t word = i < 4 ? w.x : w.y;
    v[i] = as_stored<H>(dequantize_value(static_cast<uint8_t>(word >> (8 * (i % 4))), s, f));
  }
}
// The 8 codes at codes[offset] (one 8-byte load), for dequantize8.
__device__ inline uint2 load8_codes(const Fp8HeadsIn& in, int64_t offset) {
  return *reinterpret_cast<const uint2*>(in.codes + offset);
}
// v[0..7] = codes[offset .. offset + 7] dequantized and rounded to H (dequantize8).
template <typename H>
__device__ inline void load8_dequantized(const Fp8HeadsIn& in, int64_t offset, float (&v)[8]) {
  dequantize8<H>(load8_codes(in, offset), *in.scale_inv, in.format, v);
}

// Whether FP8 heads can be moved 8 codes at a time: codes 8-byte aligned, D a multiple of 8.
inline bool fp8_heads_vec8(const QTensor& q) {
  return reinterpret_cast<uintptr_t>(q.codes) % 8 == 0 && q.cols % 8 == 0;
}

}  // namespace flux8::cuda
