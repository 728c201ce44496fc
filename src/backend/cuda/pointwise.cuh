#pragma once
// Element values that more than one kernel computes: the op's own kernel and the FP8 cast that
// fuses the op (fp8.cu, quantize_fused). One definition, so the fused cast sees bit for bit the
// value the op would have stored.
#include <cuda_runtime.h>

#include <cstdint>

namespace flux8::cuda {

// GELU, tanh approximation, in f32: ½x(1 + tanh u) = x·σ(2u), u = √(2/π)(x + a·x³), with
// σ(2u) and 1 − σ(2u) taken from t = e^(−2|u|) ∈ [0, 1] and r = 1/(1 + t): r and t·r (which
// is which depends on u's sign), without overflow or cancellation. The exponential and the
// reciprocal are the hardware approximations (ex2.approx.ftz, __fdividef's rcp: a few ulps;
// 1 + t lies in [1, 2]); tanhf (the CPU backend's formula), or expf with an IEEE division,
// take so many instructions that GELU's backward is bound by the SM. GPU and CPU agree to ~1e-7 relative.
//
// The constants are folded so that an element costs 12 FP32 instructions and two MUFU ones for
// the derivative (a direct evaluation takes ~24, and the FP8 GELU-backward casts are bound by
// the SM's issue rate): u = x·(C + C·a·x²) (x² shared with the derivative), e^(−2|u|) as one
// multiply into ex2 — __expf's range fix-up for denormal results (a compare and two predicated
// multiplies) is not needed, as t underflowing to 0 gives the right limits r = 1, t·r = 0 — and
// σ(2u)(1 − σ(2u)) = t·r², the same whichever of r and t·r is σ(2u).
constexpr float kGeluC = 0.7978845608028654f;                                        // C = √(2/π)
constexpr float kGeluCA = static_cast<float>(0.7978845608028654 * 0.044715);         // C·a, a = 0.044715
constexpr float kGelu2C = static_cast<float>(2.0 * 0.7978845608028654);              // 2C
constexpr float kGelu6CA = static_cast<float>(6.0 * 0.7978845608028654 * 0.044715);  // 6C·a
constexpr float kMinus2Log2e = static_cast<float>(-2.0 * 1.4426950408889634);        // e^(−2v) = 2^(v·this)

__device__ inline float exp2_approx_ftz(float v) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(v));
  return y;
}

struct GeluTerms {
  float s;      // σ(2u)
  float s_oms;  // σ(2u)(1 − σ(2u))
};
// x2 = x·x.
__device__ inline GeluTerms gelu_terms(float x, float x2) {
  const float u = x * fmaf(kGeluCA, x2, kGeluC);
  const float t = exp2_approx_ftz(kMinus2Log2e * fabsf(u));
  const float r = __fdividef(1.0f, 1.0f + t);
  const float tr = t * r;
  return GeluTerms{u >= 0.0f ? r : tr, tr * r};
}
__device__ inline float gelu_value(float x) { return x * gelu_terms(x, x * x).s; }
// d/dx x·σ(2u) = σ(2u) + 2x·σ(2u)(1 − σ(2u))·C(1 + 3a·x²) = σ(2u) + x·σ(1 − σ)·(2C + 6C·a·x²).
__device__ inline float gelu_grad(float x) {
  const float x2 = x * x;
  const GeluTerms g = gelu_terms(x, x2);
  return fmaf(x * g.s_oms, fmaf(kGelu6CA, x2, kGelu2C), g.s);
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
