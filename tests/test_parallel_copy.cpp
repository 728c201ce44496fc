// parallel_copy: every byte arrives, for copies below, at and above the size where it splits,
// pieces that do not divide the size, and any thread count.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/parallel_copy.h"

namespace flux8 {
namespace {

TEST(ParallelCopy, EveryByteArrivesForAnySizeAndThreadCount) {
  constexpr size_t MiB = size_t(1) << 20;
  for (const size_t n : {size_t(0), size_t(1), 4 * MiB - 1, 4 * MiB, 4 * MiB + 3, 9 * MiB + MiB / 2 + 7}) {
    std::vector<uint8_t> src(n + 2), dst(n + 2, 0xAB);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
    for (const int threads : {1, 3, 8}) {
      std::fill(dst.begin(), dst.end(), 0xAB);
      parallel_copy(dst.data() + 1, src.data() + 1, n, threads);  // unaligned both sides
      EXPECT_EQ(dst[0], 0xAB) << n;
      EXPECT_EQ(dst[n + 1], 0xAB) << n << ": wrote past the end";
      EXPECT_TRUE(std::equal(dst.begin() + 1, dst.begin() + 1 + static_cast<std::ptrdiff_t>(n), src.begin() + 1))
          << n << " bytes over " << threads << " threads";
    }
  }
}

}  // namespace
}  // namespace flux8
