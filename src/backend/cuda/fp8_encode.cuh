#pragma once
// FP8 codes on the device, the same as the CPU's integer encoder (src/fp8/format.h) gives: the
// per-tensor cast (fp8.cu) and AdamW's casts of the new weights (training.cu) share them.
#include <cuda_fp8.h>

#include <cstdint>

#include "fp8/format.h"
#include "fp8/recipe.h"

namespace flux8::cuda {

// The integer encoder's code for a NaN (fp8_encode of it): the format's NaN code with the NaN's
// sign. Written out rather than calling fp8_encode: the compiler predicates the rare NaN branch
// instead of jumping over it, so the whole inlined encoder would be issued for every pair of
// every cast (~90 instructions an element; docs/PERFORMANCE.md, Measurements behind the kernels).
__device__ inline uint32_t nan_code(float nan, Fp8Format f) {
  return ((__float_as_uint(nan) >> 31) << 7) | fp8_detail::params(f).nan_code;
}

// quantize_value(v0, s, f) | quantize_value(v1, s, f) << 8 by the FP8 conversion instruction of
// sm_89+ (cvt.rn.satfinite: round to nearest even, |v·s| past the largest finite value and ±inf
// to ±max, subnormal results exact), two values per instruction: the same codes as the CPU's
// integer encoder (src/fp8/format.h). Except for NaN: the GPU's multiply returns the canonical
// (positive) NaN where the CPU's returns its NaN operand (x first), and the instruction has its
// own NaN code, so a NaN product takes the encoder's code of that operand: v, else the scale
// (an MX block whose amax is inf has a NaN scale). encode_pair_finite is the conversion alone,
// for values and a scale known not to be NaN; encode_pair adds the NaN codes.
__device__ inline uint32_t encode_pair_finite(float v0, float v1, float s, Fp8Format f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return __nv_cvt_float2_to_fp8x2(make_float2(v0 * s, v1 * s), __NV_SATFINITE,
                                  f == Fp8Format::e4m3 ? __NV_E4M3 : __NV_E5M2);
#else
  return fp8_encode(v0 * s, f) | (static_cast<uint32_t>(fp8_encode(v1 * s, f)) << 8);
#endif
}
__device__ inline uint32_t encode_pair(float v0, float v1, float s, Fp8Format f) {
  const uint32_t c = encode_pair_finite(v0, v1, s, f);
  uint32_t lo = c & 0xFFu, hi = (c >> 8) & 0xFFu;
  if (f32_is_nan(v0) || f32_is_nan(s)) lo = nan_code(f32_is_nan(v0) ? v0 : s, f);
  if (f32_is_nan(v1) || f32_is_nan(s)) hi = nan_code(f32_is_nan(v1) ? v1 : s, f);
  return lo | (hi << 8);
}

}  // namespace flux8::cuda
