#pragma once
// Arithmetic on sizes that come from files and configs. Those numbers are untrusted: a product
// of a crafted shape must not wrap modulo 2^64 and pass a bounds check, and a config value must
// not overflow a signed int. Each helper returns nullopt instead of wrapping; the caller knows
// which file, tensor or key to name in its error.
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

namespace flux8 {

template <typename T>
std::optional<T> checked_add(T a, T b) {
  static_assert(std::is_integral_v<T>);
  T r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

template <typename T>
std::optional<T> checked_mul(T a, T b) {
  static_assert(std::is_integral_v<T>);
  T r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// The product of `dims` (an element count), or nullopt when a dimension is negative or the
// product exceeds `limit`.
template <typename Range>
std::optional<uint64_t> checked_product(const Range& dims, uint64_t limit = std::numeric_limits<uint64_t>::max()) {
  uint64_t n = 1;
  for (auto d : dims) {
    if constexpr (std::is_signed_v<decltype(d)>)
      if (d < 0) return std::nullopt;
    const std::optional<uint64_t> next = checked_mul<uint64_t>(n, static_cast<uint64_t>(d));
    if (!next || *next > limit) return std::nullopt;
    n = *next;
  }
  return n;
}

// `v` converted to To when it fits exactly.
template <typename To, typename From>
std::optional<To> checked_cast(From v) {
  if (!std::in_range<To>(v)) return std::nullopt;
  return static_cast<To>(v);
}

}  // namespace flux8
