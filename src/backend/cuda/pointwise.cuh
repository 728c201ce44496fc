#pragma once
// Element values that more than one kernel computes: the op's own kernel and the FP8 cast that
// fuses the op (fp8.cu, quantize_fused). One definition, so the fused cast sees bit for bit the
// value the op would have stored.
#include <cuda_runtime.h>

#include <cstdint>

namespace flux8::cuda {

constexpr float kGeluC = 0.7978845608028654f;  // √(2/π)
constexpr float kGeluA = 0.044715f;

// GELU, tanh approximation, in f32 (the CPU backend's formula).
__device__ inline float gelu_value(float x) {
  const float u = kGeluC * (x + kGeluA * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}

// One element of modulated LayerNorm from the stored row statistics (f32 mean and rstd, as the
// backward sees them), in f32: the CPU backend's double formula rounded once differs by an ulp
// now and then, far inside the LayerNorm tests' tolerance, and the double version cost two
// conversions and three f64 operations per element (f64 conversions issue at a quarter of the
// f32 rate on Hopper), which made the fused LayerNorm cast and the LayerNorm kernels
// instruction-bound.
__device__ inline float layernorm_modulate_value(float x, float mean, float rstd, float shift, float scale) {
  const float xhat = (x - mean) * rstd;
  return (1.0f + scale) * xhat + shift;
}

}  // namespace flux8::cuda
