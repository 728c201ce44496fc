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

// f32 -> bf16 bits, rounded away from zero with probability ⌊(d + 128)/256⌋/256 for the dropped 16
// bits d, given 8 uniform random bits (the low 8 of r): the dropped bits' top 8 decide, so the
// expectation is f within 1/512 of a bf16 ulp (8 bits of randomness, as stochastic rounding in
// hardware commonly takes, cost half the hashing of 16). A value bf16 holds is kept for every r;
// ±inf too (the sum cannot carry out of their exponent); every NaN becomes the quiet NaN 0x7fc0.
// bf16_stochastic_word is the 32-bit sum whose high half these bits are (`r8` = the random byte
// shifted left by 8), which the GPU kernel packs in pairs without shifting: no branch anywhere.
FLUX8_HD inline uint32_t bf16_stochastic_word(float f, uint32_t r8) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (f != f) u = 0x7fc00000u;  // the sum stays inside the NaN (a NaN's own bits could carry into the sign)
  return u + r8 + 0x80u;
}
FLUX8_HD inline uint16_t f32_to_bf16_bits_stochastic(float f, uint32_t r) {
  return static_cast<uint16_t>(bf16_stochastic_word(f, (r & 0xffu) << 8) >> 16);
}

// AdamW's moment noise: adamw_step_key once per step (step ≥ 1), then 32 random bits for each
// pair of flat elements 2p, 2p + 1 — byte 0 rounds m of element 2p, byte 1 m of 2p + 1, byte 2
// v of 2p, byte 3 v of 2p + 1 (adamw_moment_bits). The index's high half (models beyond 2^33
// parameters) enters through the key.
FLUX8_HD inline uint32_t adamw_step_key(int64_t step) {
  return mix32(static_cast<uint32_t>(step) * 0x9e3779b9u + 0x632be5abu);
}
FLUX8_HD inline uint32_t adamw_pair_noise(uint32_t step_key, int64_t pair) {
  const uint64_t q = static_cast<uint64_t>(pair);
  return mix32(static_cast<uint32_t>(q) ^ (step_key + static_cast<uint32_t>(q >> 32) * 0x27d4eb2fu));
}
// The bits that round element i's m (low 8) and, shifted by 16, its v, from its pair's noise.
FLUX8_HD inline uint32_t adamw_moment_bits(uint32_t pair_noise, int64_t i) { return pair_noise >> (8 * (i & 1)); }

}  // namespace flux8
