#pragma once
// Counter-based random numbers (Philox-4x32-10, Salmon et al., SC'11). A draw is a pure
// function of (seed, stream, index): results never depend on thread count, scheduling or
// backend, so the CPU and CUDA backends produce identical noise and a resumed run continues
// exactly. `stream` names what the numbers are for (e.g. a hash of (step, rank, purpose)),
// `index` is the element number within that stream.
#include <cmath>
#include <cstdint>

#include "core/dtype.h"  // FLUX8_HD

namespace flux8 {

struct Philox {
  FLUX8_HD static void round(uint32_t c[4], const uint32_t k[2]) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    const uint32_t n0 = hi1 ^ c[1] ^ k[0], n2 = hi0 ^ c[3] ^ k[1];
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
  }
  // Four 32-bit words for counter (stream, block) under key seed.
  FLUX8_HD static void generate(uint64_t seed, uint64_t stream, uint64_t block, uint32_t out[4]) {
    uint32_t k[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
    out[0] = static_cast<uint32_t>(block);
    out[1] = static_cast<uint32_t>(block >> 32);
    out[2] = static_cast<uint32_t>(stream);
    out[3] = static_cast<uint32_t>(stream >> 32);
    for (int r = 0; r < 10; ++r) {
      round(out, k);
      k[0] += 0x9E3779B9u;
      k[1] += 0xBB67AE85u;
    }
  }
};

// Uniform in [0, 1): top 24 bits of word (index % 4) of block index/4.
FLUX8_HD inline float rng_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  uint32_t w[4];
  Philox::generate(seed, stream, index >> 2, w);
  return static_cast<float>(w[index & 3] >> 8) * (1.0f / 16777216.0f);
}

// Standard normal via Box-Muller on two words of the element's own block: element i uses
// block i, so every element is independent of how the work is split.
FLUX8_HD inline float rng_normal(uint64_t seed, uint64_t stream, uint64_t index) {
  uint32_t w[4];
  Philox::generate(seed, stream ^ 0x6E6F726D616C0000ull, index, w);                // "normal" domain
  const float u1 = (static_cast<float>(w[0] >> 8) + 1.0f) * (1.0f / 16777216.0f);  // (0,1]
  const float u2 = static_cast<float>(w[1] >> 8) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853071795864769f * u2);
}

// Mixes several ids into one stream number (splitmix64 finaliser over a running hash).
FLUX8_HD inline uint64_t rng_stream(uint64_t a, uint64_t b = 0, uint64_t c = 0, uint64_t d = 0) {
  uint64_t h = 0x9E3779B97F4A7C15ull;
  const uint64_t v[4] = {a, b, c, d};
  for (int i = 0; i < 4; ++i) {
    h ^= v[i] + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
  }
  return h;
}

}  // namespace flux8
