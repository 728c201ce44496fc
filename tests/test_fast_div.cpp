// FastDivisor (src/backend/cuda/fast_div.h): the CUDA kernels' replacement for dividing row
// indices by tokens per sample. Host and device run the same code; here every x < 2^16 for
// every d < 2^12, then the edges of the range (x near 2^31, d near 2^31, powers of two and
// their neighbours) and random operands, against the integer division.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "backend/cuda/fast_div.h"

namespace flux8 {
namespace {

TEST(FastDivisor, EqualsIntegerDivision) {
  for (uint32_t d = 1; d < 4096; ++d) {
    const FastDivisor f(d);
    for (uint32_t x = 0; x < 65536; ++x) ASSERT_EQ(f.divide(x), x / d) << x << " / " << d;
  }
  std::vector<uint32_t> divisors = {4608, 9216, 16384, 65535, 65536, 65537, (1u << 31) - 1, 1u << 30, (1u << 30) + 1};
  for (int k = 1; k < 31; ++k) divisors.insert(divisors.end(), {(1u << k) - 1, 1u << k, (1u << k) + 1});
  std::mt19937 rng(3);
  for (int i = 0; i < 2000; ++i) divisors.push_back(1 + rng() % ((1u << 31) - 1));
  const uint32_t top = (1u << 31) - 1;
  for (const uint32_t d : divisors) {
    const FastDivisor f(d);
    std::vector<uint32_t> xs = {0, 1, d - 1, d, d + 1, top, top - 1, top / d * d, top / d * d - 1};
    for (int i = 0; i < 200; ++i) xs.push_back(rng() & top);
    for (const uint32_t x : xs)
      if (x <= top) ASSERT_EQ(f.divide(x), x / d) << x << " / " << d;
  }
}

}  // namespace
}  // namespace flux8
