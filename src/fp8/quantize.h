#pragma once
// CPU quantizers for every FP8 recipe (docs/FP8.md, Recipes), the reference the CUDA cast kernels are
// tested against, and the dequantizers that let the CPU backend emulate an FP8 GEMM exactly
// (a product of two FP8 values is exact in fp32, so dequantize-then-sgemm differs from the
// tensor core only in accumulation order).
//
// Input: f32 [rows, cols], row-major, contiguous. Per element the cast is
//   code = fp8_encode(x * scale)   (fp32 product, then RNE + saturation: TE's cast)
//   x'   = fp8_decode(code) * scale_inv
// and the recipes differ only in where `scale` comes from:
//   per_tensor     one scale: the registry's (delayed) or fp8_max/amax of this tensor (current)
//   block_1x128    one scale per 128 consecutive elements of a row (activations, gradients)
//   block_128x128  one scale per 128x128 tile (weights)
//   mx_1x32        one E8M0 scale 2^e per 32 consecutive elements of a row, e from
//                  e8m0_scale_for_amax(amax, fp8_max) (MXFP8; Blackwell-native, emulated here)
// Blocks at the right/bottom edge of a shape that is not a multiple of the block are partial
// blocks with their own scale. A block whose amax is 0 (all zeros, or all NaN) gets scale 1.
// The FP8 transposed copy that Hopper GEMMs need is not made on the CPU: the emulated GEMM
// reads the dequantized values in any layout.
#include <cstdint>
#include <vector>

#include "fp8/meta.h"
#include "fp8/recipe.h"

namespace flux8 {

enum class Fp8Scaling : uint8_t { per_tensor, block_1x128, block_128x128, mx_1x32 };
const char* fp8_scaling_name(Fp8Scaling s);

// One element, FLUX8_HD so the kernels share it.
// A NaN product takes the code of its NaN operand, x first (the value, else an MX block's NaN
// scale), written out: which NaN a multiply returns is not fixed (x86 returns its first
// operand's and a compiler may swap the operands; the GPU returns a canonical one), and a NaN's
// FP8 code carries its sign.
FLUX8_HD inline uint8_t quantize_value(float x, float scale, Fp8Format f) {
  if (x != x) return fp8_encode(x, f);
  if (scale != scale) return fp8_encode(scale, f);
  return fp8_encode(x * scale, f);
}
FLUX8_HD inline float dequantize_value(uint8_t code, float scale_inv, Fp8Format f) {
  return fp8_decode(code, f) * scale_inv;
}
// The multiplier of an MX block: 2^-(e-127), exact for every finite E8M0 value (2^-127 is a
// float subnormal); x * it == x / 2^(e-127) exactly.
FLUX8_HD inline float mx_scale(uint8_t e8m0) { return scale_inverse(e8m0_decode(e8m0)); }

struct QuantizedTensor {
  Fp8Scaling scaling = Fp8Scaling::per_tensor;
  Fp8Format format = Fp8Format::e4m3;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> codes;  // rows x cols, row-major
  // per_tensor: [1]; block_1x128: [rows, ceil(cols/128)]; block_128x128:
  // [ceil(rows/128), ceil(cols/128)]; row-major. Empty for mx_1x32.
  std::vector<float> scale_inv;
  std::vector<uint8_t> scale_e8m0;  // mx_1x32: [rows, ceil(cols/32)], row-major

  int64_t block_rows() const;  // 1, 1, 128, 1 (per_tensor: rows)
  int64_t block_cols() const;  // cols, 128, 128, 32
  int64_t scale_cols() const { return (cols + block_cols() - 1) / block_cols(); }
  // The scale_inv that multiplies element (r, c): for MX the decoded 2^(e-127).
  float scale_inv_at(int64_t r, int64_t c) const;
};

struct CurrentScalingOptions {
  bool pow2 = false;          // round scales down to 2^k (fp8_scale_rounding: pow2)
  float amax_epsilon = 0.0f;  // floor for amax before fp8_max/amax (TE's amax_epsilon)
};

// max |x| over n elements, NaN ignored.
float tensor_amax(const float* x, int64_t n);

// Per tensor with a given scale; scale_inv = 1/scale is recorded in the result.
QuantizedTensor quantize_per_tensor(const float* x, int64_t rows, int64_t cols, Fp8Format fmt, float scale,
                                    CastStats* stats = nullptr);

// Delayed scaling: casts with the registry's current scale of `slot` (computed from past steps),
// records scale_inv at cast time, and records this cast's amax (staging row) and stats.
QuantizedTensor quantize_delayed(const float* x, int64_t rows, int64_t cols, Fp8Format fmt, Fp8MetaRegistry& reg,
                                 int slot);

// Tensorwise (current) scaling: scale = current_scale(amax of x).
QuantizedTensor quantize_tensorwise(const float* x, int64_t rows, int64_t cols, Fp8Format fmt,
                                    CurrentScalingOptions opt = {}, CastStats* stats = nullptr);

// Blockwise scaling, `blocks` = block_1x128 or block_128x128. Power-of-2 scales by default
// (DeepSeek-V3 / TE Float8BlockScaling); pow2 = false gives exact fp8_max/amax scales.
QuantizedTensor quantize_blockwise(const float* x, int64_t rows, int64_t cols, Fp8Format fmt, Fp8Scaling blocks,
                                   CurrentScalingOptions opt = {.pow2 = true}, CastStats* stats = nullptr);

// MXFP8: 1x32 blocks with E8M0 scales; E4M3 data unless fmt says otherwise.
QuantizedTensor quantize_mxfp8(const float* x, int64_t rows, int64_t cols, Fp8Format fmt = Fp8Format::e4m3,
                               CastStats* stats = nullptr);

// x' = decode(code) * scale_inv of the element's block, for every recipe.
void dequantize(const QuantizedTensor& q, float* out);
std::vector<float> dequantize(const QuantizedTensor& q);

}  // namespace flux8
