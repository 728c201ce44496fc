#pragma once
// Division of row indices by a fixed divisor (tokens per sample, heads per token) without a
// division instruction. A 64-bit integer division costs the GPU ~40-70 instructions; the
// memory-bound kernels need the sample of each row, per element, and the division cost more
// than their memory traffic. q = x / d for 0 <= x < 2^31 and 1 <= d < 2^31 by one multiply-high,
// an add and a shift (the round-up method of Granlund and Montgomery):
//   s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1, q = (mulhi(x, m) + x) >> s.
// Host and device share the code, so the CPU tests check it exhaustively over small operands
// and at the edges.
#include <cstdint>
#include <stdexcept>

#include "core/dtype.h"  // FLUX8_HD

namespace flux8 {

class FastDivisor {
 public:
  FastDivisor() = default;
  explicit FastDivisor(uint32_t d) : d_(d) {
    if (d == 0) throw std::invalid_argument("FastDivisor: division by zero");
    while (shift_ < 31 && (uint32_t(1) << shift_) < d) ++shift_;
    magic_ = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift_) - d)) / d + 1);
  }
  FLUX8_HD uint32_t divide(uint32_t x) const { return (mulhi(x, magic_) + x) >> shift_; }
  FLUX8_HD uint32_t divisor() const { return d_; }

 private:
  FLUX8_HD static uint32_t mulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
    return __umulhi(a, b);
#else
    return static_cast<uint32_t>((uint64_t(a) * b) >> 32);
#endif
  }
  uint32_t d_ = 1, magic_ = 1, shift_ = 0;
};

}  // namespace flux8
