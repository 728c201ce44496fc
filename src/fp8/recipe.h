#pragma once
// FP8 recipe math, in one place (docs/FP8.md, Recipes). Every function here is FLUX8_HD: plain
// arithmetic on floats, no exceptions, no allocation, so the CUDA kernels call the very same
// code (per element, per block, per tensor slot) that the CPU reference runs.
//
// Exactness: scale = fp8_max / amax must be the IEEE round-to-nearest quotient on every
// backend, or the CPU twin and the GPU disagree by an ULP and cached weights drift. On the
// device that is __fdiv_rn (nvcc --use_fast_math would turn '/' into an approximation); on the
// host it is '/', and -ffast-math is refused at compile time below because it would allow
// x/y -> x*(1/y) and also break isfinite/isnan (finite-math-only). Finiteness and NaN tests
// are made on the bit pattern for the same reason.
#include <cstdint>
#include <cstring>

#include "core/dtype.h"  // FLUX8_HD
#include "fp8/format.h"

#if !defined(__CUDA_ARCH__) && defined(__FAST_MATH__)
#error "src/fp8/recipe.h needs IEEE float division and NaN tests; build host code without -ffast-math"
#endif

namespace flux8 {

// A scaled magnitude above this lost information to saturation: it would have rounded to a
// larger magnitude than fp8_max had the format gone further (fp8_max + half its ULP:
// 448 + 16, 57344 + 4096). Values between fp8_max and this bound round to fp8_max anyway.
FLUX8_HD constexpr float fp8_saturation_bound(Fp8Format f) { return f == Fp8Format::e4m3 ? 464.0f : 61440.0f; }

// How the delayed-scaling amax is taken from the history window.
enum class AmaxAlgo : uint8_t { most_recent, max };

// What a quantized GEMM operand is; the role picks the format (hybrid: E5M2 for grad_output).
enum class Fp8Role : uint8_t { input, weight, grad_output };

constexpr float kFltMax = 3.40282346638528859812e+38f;

FLUX8_HD inline uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
FLUX8_HD inline float f32_from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
FLUX8_HD inline bool f32_is_finite(float x) { return (f32_bits(x) & 0x7f800000u) != 0x7f800000u; }
FLUX8_HD inline bool f32_is_nan(float x) { return (f32_bits(x) & 0x7fffffffu) > 0x7f800000u; }
FLUX8_HD inline bool f32_is_inf(float x) { return (f32_bits(x) & 0x7fffffffu) == 0x7f800000u; }
FLUX8_HD inline float f32_abs(float x) { return f32_from_bits(f32_bits(x) & 0x7fffffffu); }

// a / b rounded to nearest even, whatever the fast-math setting of the device compile.
FLUX8_HD inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Running amax: max |x| with NaN elements ignored (a NaN compares false, so it never wins).
// +-inf does win: an overflowing tensor must be visible in the amax.
FLUX8_HD inline float amax_accumulate(float amax, float x) {
  const float a = f32_abs(x);
  return a > amax ? a : amax;
}

// 2^k * m (m >= 1) -> 2^k: clears the mantissa, i.e. rounds a positive normal scale DOWN to a
// power of two, so x*scale can only move further from overflow. FLT_MAX becomes 2^127.
FLUX8_HD inline float pow2_round_down(float scale) { return f32_from_bits(f32_bits(scale) & 0xff800000u); }

// Delayed scaling: the scale for the next steps from the window amax.
//   fp8_max * 2^-margin / amax   if amax is finite and > 0 (2^-margin scaling is exact),
//   old_scale                    otherwise (0: tensor unused; inf/NaN: nothing to learn from),
// and a quotient that overflows to inf (amax < fp8_max*2^-margin / FLT_MAX) becomes FLT_MAX.
// A negative margin is allowed (it lets the amax land above fp8_max) as in TE.
FLUX8_HD inline float delayed_scale(float amax, float old_scale, float fp8_max, int margin) {
  float scaled_max = fp8_max;
  for (int i = 0; i < margin; ++i) scaled_max *= 0.5f;
  for (int i = 0; i > margin; --i) scaled_max *= 2.0f;
  float scale = old_scale;
  if (f32_is_finite(amax) && amax > 0.0f) scale = div_rn(scaled_max, amax);
  if (f32_is_inf(scale)) scale = kFltMax;
  return scale;
}

// Current (tensorwise) and blockwise scaling: the scale from the amax of this tensor / block.
//   fp8_max / max(amax, amax_epsilon); 1.0 when that amax is 0, inf or NaN (a block of zeros
//   gets scale 1, so its codes are zeros and scale_inv is 1, never inf);
//   an overflowing quotient becomes FLT_MAX; pow2 rounds the result down to a power of two.
FLUX8_HD inline float current_scale(float amax, float fp8_max, bool pow2, float amax_epsilon = 0.0f) {
  if (amax < amax_epsilon) amax = amax_epsilon;
  if (!f32_is_finite(amax) || amax == 0.0f) return 1.0f;
  float scale = div_rn(fp8_max, amax);
  if (f32_is_inf(scale)) scale = kFltMax;
  return pow2 ? pow2_round_down(scale) : scale;
}

// The scale_inv a GEMM multiplies by. Exact for power-of-2 scales.
FLUX8_HD inline float scale_inverse(float scale) { return div_rn(1.0f, scale); }

// One delayed-scaling update of one tensor slot, in place.
//   history[r * stride], r = 0..L-1: row 0 is this step's staged (and already all-reduced)
//   amax; rows 1..L-1 are past steps, newest last.
// If row 0 is 0 the tensor was not cast this step: nothing changes (returns false).
// Otherwise the window is the last L steps — the current one and the L-1 past rows — and
// amax = current (most_recent) or the window max (max; NaN rows are ignored); then the history
// rolls: the oldest row (row 1) is dropped, rows 2..L-1 move up one, the current amax becomes
// row L-1, row 0 is zeroed. With L = 1 only the staging row exists and the window is the
// current step. (TE's kernel: the same, max taken over old rows 1..L-1 plus the current one.)
FLUX8_HD inline bool delayed_update_slot(float* history, int64_t stride, int history_len, AmaxAlgo algo, float fp8_max,
                                         int margin, float* scale, float* scale_inv) {
  const float last = history[0];
  if (last == 0.0f) return false;
  float window_max = last > 0.0f ? last : 0.0f;  // NaN last: ignored by max, kept in history
  for (int r = 1; r < history_len; ++r) {
    const float a = history[r * stride];
    if (a > window_max) window_max = a;
    if (r > 1) history[(r - 1) * stride] = a;
  }
  if (history_len > 1) history[(history_len - 1) * stride] = last;
  history[0] = 0.0f;
  const float amax = algo == AmaxAlgo::most_recent ? last : window_max;
  *scale = delayed_scale(amax, *scale, fp8_max, margin);
  *scale_inv = scale_inverse(*scale);
  return true;
}

// The whole step for n slots, as the fused kernel does it: delayed_update_slot() per slot over
// a history-major [L, n] buffer (stride n), fp8_max per slot (it depends on the slot's role).
// Returns the number of slots that rolled. Host twin of the CUDA bulk-update kernel.
int delayed_update_all(float* amax_history, int n, int history_len, const float* fp8_max_per_slot, AmaxAlgo algo,
                       int margin, float* scale, float* scale_inv);

const char* fp8_role_name(Fp8Role r);    // "input" | "weight" | "grad_output"
const char* amax_algo_name(AmaxAlgo a);  // "most_recent" | "max"

}  // namespace flux8
