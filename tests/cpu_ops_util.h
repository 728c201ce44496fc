#pragma once
// Test helpers for the CPU op tests: host buffers viewed as Tensors (optionally as column
// windows of a wider row), deterministic random fill, and reference reductions.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "backend/backend.h"
#include "core/rng.h"

namespace flux8::testing {

template <typename T>
constexpr DType dtype_of = std::is_same_v<T, float> ? DType::f32 : DType::f64;

// Host storage plus a Tensor view. `pad` extra elements per row make the view a column window
// (ld = cols + pad) so ops are exercised on strided rows. The CPU backend works on host memory,
// so these views can be passed to it directly.
template <typename T>
class Buf {
 public:
  std::vector<T> mem;
  Tensor t;

  explicit Buf(Shape s, int64_t pad = 0) {
    const int64_t cols = s.rank ? s[-1] : 1, rows = cols ? s.numel() / cols : 0;
    mem.assign(static_cast<size_t>(rows * (cols + pad)), T(0));
    t = Tensor(mem.data(), dtype_of<T>, s);
    t.ld = cols + pad;
  }
  Buf(const Buf&) = delete;
  Buf(Buf&&) = default;

  // N(0, stddev²) values over the whole storage, padding included (ops must not read it).
  // Values depend only on (seed, index), so f32 and f64 buffers get the same numbers.
  Buf& randn(uint64_t seed, double stddev = 1.0) {
    for (size_t i = 0; i < mem.size(); ++i) mem[i] = static_cast<T>(stddev * rng_normal(seed, 1, i));
    return *this;
  }
  // Sets the padding (the elements outside the window) to v, to detect stray writes.
  Buf& fill_padding(T v) {
    for (int64_t r = 0; r < t.rows(); ++r)
      for (int64_t c = t.cols(); c < t.ld; ++c) mem[static_cast<size_t>(r * t.ld + c)] = v;
    return *this;
  }
  bool padding_is_nan() const {
    for (int64_t r = 0; r < t.rows(); ++r)
      for (int64_t c = t.cols(); c < t.ld; ++c)
        if (!std::isnan(mem[static_cast<size_t>(r * t.ld + c)])) return false;
    return true;
  }
  T& at(int64_t r, int64_t c) { return mem[static_cast<size_t>(r * t.ld + c)]; }
  T at(int64_t r, int64_t c) const { return mem[static_cast<size_t>(r * t.ld + c)]; }
  // The window's values, row by row (padding excluded).
  std::vector<T> values() const {
    std::vector<T> v;
    for (int64_t r = 0; r < t.rows(); ++r)
      for (int64_t c = 0; c < t.cols(); ++c) v.push_back(at(r, c));
    return v;
  }
};

// Σ a ⊙ b over the window, in double: the probe loss of the gradient checks.
template <typename T>
double probe_loss(const Buf<T>& y, const Buf<T>& probe) {
  double s = 0;
  for (int64_t r = 0; r < y.t.rows(); ++r)
    for (int64_t c = 0; c < y.t.cols(); ++c) s += static_cast<double>(y.at(r, c)) * static_cast<double>(probe.at(r, c));
  return s;
}

// ‖a − b‖∞ / ‖b‖∞: normwise relative difference, meaningful also where elements are near 0.
template <typename A, typename B>
double rel_diff(const std::vector<A>& a, const std::vector<B>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    den = std::max(den, std::abs(static_cast<double>(b[i])));
  }
  return num / std::max(den, std::numeric_limits<double>::min());
}

}  // namespace flux8::testing
