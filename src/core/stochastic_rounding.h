#pragma once
// Stochastic rounding of f32 to bf16 with reproducible random bits, for AdamW's moments stored
// in bf16 (adam_moment_precision: bf16). Rounding to nearest would drop every change smaller
// than half a bf16 ulp (2^-9 of the value): with β2 = 0.999, v = β2·v + (1 − β2)·g² moves by
// at most 0.1% a step, so a stored v could never decay. Rounding up with the probability of the
// dropped fraction keeps the stored value's expectation at the f32 result. The random bits are
// a hash of (step, flat element index) — not of a thread, chunk or launch — so a run is
// reproducible and the CPU backend computes the GPU's bits exactly (its twin in the tests).
#include <cstdint>
#include <cstring>

#include "core/dtype.h"  // FLUX8_HD, f32_to_bf16_bits

namespace flux8 {

// A 32-bit integer mixer (Chris Wellons' "lowbias32" constants): every output bit depends on
// every input bit, at 2 multiplies and 3 shift-xors.
FLUX8_HD inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// f32 -> bf16 bits, rounded away from zero with probability (dropped 16 bits) / 2^16 given 16
// uniform random bits `r` (the low 16 of r are used): E[result] = f for every finite f up to
// bf16's largest value. The dropped bits plus r carry into the kept ones exactly when r ≥
// 2^16 − dropped. ±inf and NaN are kept as f32_to_bf16_bits keeps them.
FLUX8_HD inline uint16_t f32_to_bf16_bits_stochastic(float f, uint32_t r) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return f32_to_bf16_bits(f);
  return static_cast<uint16_t>((u + (r & 0xffffu)) >> 16);
}

// AdamW's moment noise. adamw_step_key once per step (step ≥ 1); the elements of one 2^32 block
// of the flat index share adamw_block_key (a kernel computes it once per quad); then 32 bits per
// element: the low 16 round m, the high 16 round v.
FLUX8_HD inline uint32_t adamw_step_key(int64_t step) {
  return mix32(static_cast<uint32_t>(step) * 0x9e3779b9u + 0x632be5abu);
}
FLUX8_HD inline uint32_t adamw_block_key(uint32_t step_key, int64_t i) {
  return mix32(step_key + static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32));
}
FLUX8_HD inline uint32_t adamw_moment_noise(uint32_t block_key, int64_t i) {
  return mix32(static_cast<uint32_t>(i) ^ block_key);
}

}  // namespace flux8
