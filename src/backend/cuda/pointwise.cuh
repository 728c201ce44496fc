#pragma once
// Element values that more than one kernel computes: the op's own kernel and the FP8 cast that
// fuses the op (fp8.cu, quantize_fused). One definition, so the fused cast sees bit for bit the
// value the op would have stored.
#include <cuda_runtime.h>

#include <cstdint>

namespace flux8::cuda {

constexpr float kGeluC = 0.7978845608028654f;  // √(2/π)
constexpr float kGeluA = 0.044715f;

// GELU, tanh approximation, in f32: ½x(1 + tanh u) = x·σ(2u), u = √(2/π)(x + a·x³), with the
// logistic σ(2u) and 1 − σ(2u) from t = e^(−2|u|) ∈ (0, 1]: 1/(1 + t) and t/(1 + t), without
// overflow or cancellation. The exponential and the reciprocal are the hardware approximations
// (__expf, __fdividef: a few ulps; 1 + t lies in [1, 2]): tanhf (the CPU backend's formula), or
// expf with an IEEE division, took so many instructions that GELU's backward was bound by the
// SM (Nsight Compute: SM 87%, DRAM 52%). GPU and CPU agree to ~1e-7 relative.
struct GeluTerms {
  float s, one_minus_s;  // σ(2u), 1 − σ(2u)
};
__device__ inline GeluTerms gelu_terms(float x) {
  const float u = kGeluC * (x + kGeluA * x * x * x);
  const float t = __expf(-2.0f * fabsf(u));
  const float r = __fdividef(1.0f, 1.0f + t);
  const float tr = t * r;
  return u >= 0.0f ? GeluTerms{r, tr} : GeluTerms{tr, r};
}
__device__ inline float gelu_value(float x) { return x * gelu_terms(x).s; }
// d/dx x·σ(2u) = σ(2u) + 2x·σ(2u)(1 − σ(2u))·√(2/π)(1 + 3a·x²).
__device__ inline float gelu_grad(float x) {
  const GeluTerms g = gelu_terms(x);
  return g.s + 2.0f * x * g.s * g.one_minus_s * kGeluC * (1.0f + 3.0f * kGeluA * x * x);
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
