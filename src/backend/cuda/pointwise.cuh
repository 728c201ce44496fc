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
// backward sees them), in double like the CPU backend.
__device__ inline float layernorm_modulate_value(float x, float mean, float rstd, float shift, float scale) {
  const double xhat = (static_cast<double>(x) - mean) * rstd;
  return static_cast<float>((1.0 + scale) * xhat + shift);
}

}  // namespace flux8::cuda
