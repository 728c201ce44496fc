#include "core/dtype.h"

#include <cmath>
#include <cstring>

#include "core/error.h"

namespace flux8 {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::u8: return 1;
  }
  fail("unknown dtype {}", static_cast<int>(t));
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::u8: return "u8";
  }
  return "?";
}

uint16_t f32_to_f16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (absu >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (absu < 0x38800000u) {
    // Subnormal half (or zero): value = m * 2^-24, round the f32 value to that grid.
    float a;
    std::memcpy(&a, &absu, 4);
    const float q = std::nearbyint(a * 16777216.0f);  // exact: a*2^24 < 2^10
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(q));
  }
  // Normal: rebias exponent, round mantissa 23 -> 10 bits to nearest even.
  uint32_t h = ((absu - 0x38000000u) >> 13);
  const uint32_t rem = absu & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    mag = man ? NAN : INFINITY;
  } else {
    mag = std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  }
  uint32_t u;
  std::memcpy(&u, &mag, 4);
  u |= sign;
  std::memcpy(&mag, &u, 4);
  return mag;
}

namespace {
// Conversions of at least this many elements run over the CPU's threads (elementwise: the same
// bits from any number of threads).
constexpr int64_t kParallelConvertElements = int64_t{1} << 20;
}  // namespace

void convert_elements(const void* src, DType src_dtype, size_t count, DType dst_dtype, void* dst) {
  FLUX8_CHECK(src_dtype == DType::f32 || src_dtype == DType::f64 || src_dtype == DType::bf16,
              "convert_elements from {}", dtype_name(src_dtype));
  FLUX8_CHECK(dst_dtype == DType::f32 || dst_dtype == DType::f64 || dst_dtype == DType::bf16 || dst_dtype == DType::f16,
              "convert_elements into {}", dtype_name(dst_dtype));
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, count * dtype_size(src_dtype));
    return;
  }
  const auto* bytes = static_cast<const uint8_t*>(src);
  auto value = [&](size_t i) -> float {  // element i as f32
    if (src_dtype == DType::bf16) {
      uint16_t b;
      std::memcpy(&b, bytes + 2 * i, 2);
      return bf16_bits_to_f32(b);
    }
    if (src_dtype == DType::f64) {
      double d;
      std::memcpy(&d, bytes + 8 * i, 8);
      return static_cast<float>(d);
    }
    float f;
    std::memcpy(&f, bytes + 4 * i, 4);
    return f;
  };
  const auto n = static_cast<int64_t>(count);
#pragma omp parallel for schedule(static) if (n >= kParallelConvertElements)
  for (int64_t i = 0; i < n; ++i) store_f32_as(value(static_cast<size_t>(i)), dst_dtype, dst, static_cast<size_t>(i));
}

}  // namespace flux8
