#pragma once
// Helpers for the GPU tests of the FP8 casts (test_cuda_fp8.cpp on f32 activations,
// test_cuda_bf16_casts.cpp on bf16 ones): a QTensor on both backends, byte-exact comparisons
// of codes, scales and CastStats, the cast recipes and their inputs.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "gpu_test_util.h"

namespace flux8::testing {

// A QTensor in host memory (what the CPU backend writes) and its device twin. Both start filled
// with a sentinel (codes 0xA5, scales NaN or 0xA5), so an output element the GPU never writes
// differs.
struct QPair {
  QTensor host, dev;
  std::vector<uint8_t> codes, e8m0;
  std::vector<float> scales;

  QPair(int64_t rows, int64_t cols, Fp8Format f, Fp8Scaling s) {
    host.rows = dev.rows = rows;
    host.cols = dev.cols = cols;
    host.format = dev.format = f;
    host.scaling = dev.scaling = s;
    const auto n = static_cast<size_t>(rows * cols);
    const auto ns = static_cast<size_t>(QTensor::scale_count(s, rows, cols));
    codes.assign(n, 0xA5);
    host.codes = codes.data();
    dev.codes = static_cast<uint8_t*>(gpu().allocate(n + 16));
    if (s == Fp8Scaling::mx_1x32) {
      e8m0.assign(ns, 0xA5);
      host.scale_e8m0 = e8m0.data();
      dev.scale_e8m0 = static_cast<uint8_t*>(gpu().allocate(ns + 16));
    } else {
      scales.assign(ns, std::numeric_limits<float>::quiet_NaN());
      host.scale_inv = scales.data();
      dev.scale_inv = static_cast<float*>(gpu().allocate(ns * sizeof(float) + 16));
    }
    upload();
  }
  ~QPair() {
    gpu().release(dev.codes);
    gpu().release(dev.scale_inv ? static_cast<void*>(dev.scale_inv) : dev.scale_e8m0);
  }
  QPair(const QPair&) = delete;

  // host -> device (the GEMM tests give both backends the very same operand)
  void upload() {
    gpu().upload(dev.codes, codes.data(), codes.size());
    if (dev.scale_e8m0) gpu().upload(dev.scale_e8m0, e8m0.data(), e8m0.size());
    if (dev.scale_inv) gpu().upload(dev.scale_inv, scales.data(), scales.size() * sizeof(float));
  }
  // The copy to hand to a cast: the device one for the GPU run, the host one for the CPU run.
  const QTensor& on(bool gpu_side) const { return gpu_side ? dev : host; }
  size_t scale_size() const { return host.scale_e8m0 ? 1 : sizeof(float); }
  std::vector<uint8_t> dev_codes() const {
    std::vector<uint8_t> v(codes.size());
    gpu().download(v.data(), dev.codes, v.size());
    return v;
  }
  // Scales as bytes (E8M0, or the f32 bit patterns): compared exactly.
  std::vector<uint8_t> host_scale_bytes() const {
    if (host.scale_e8m0) return e8m0;
    std::vector<uint8_t> v(scales.size() * sizeof(float));
    std::memcpy(v.data(), scales.data(), v.size());
    return v;
  }
  std::vector<uint8_t> dev_scale_bytes() const {
    std::vector<uint8_t> v(host.scale_e8m0 ? e8m0.size() : scales.size() * sizeof(float));
    gpu().download(v.data(), dev.scale_e8m0 ? static_cast<void*>(dev.scale_e8m0) : dev.scale_inv, v.size());
    return v;
  }
};

// "" when equal, else where they first differ (elements of element_bytes, printed as hex).
inline std::string first_difference(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                                    size_t element_bytes) {
  if (got.size() != want.size()) return fmt::format("sizes differ: {} vs {}", got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) {
      const size_t e = i / element_bytes;
      std::string g, w;
      for (size_t b = 0; b < element_bytes; ++b) {
        g += fmt::format("{:02x}", got[e * element_bytes + element_bytes - 1 - b]);
        w += fmt::format("{:02x}", want[e * element_bytes + element_bytes - 1 - b]);
      }
      return fmt::format("element {}: 0x{} vs 0x{}", e, g, w);
    }
  return "";
}

inline uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }

inline std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> b;
  for (const float f : v) b.push_back(bits(f));
  return b;
}

// The device copy against the CPU's, byte for byte.
inline void expect_equals_cpu(const QPair& p, const char* which) {
  EXPECT_EQ(first_difference(p.dev_codes(), p.codes, 1), "") << which << " codes";
  EXPECT_EQ(first_difference(p.dev_scale_bytes(), p.host_scale_bytes(), p.scale_size()), "") << which << " scales";
}
// Two device copies, byte for byte.
inline void expect_same_on_gpu(const QPair& got, const QPair& want, const char* which) {
  EXPECT_EQ(first_difference(got.dev_codes(), want.dev_codes(), 1), "") << which << " codes";
  EXPECT_EQ(first_difference(got.dev_scale_bytes(), want.dev_scale_bytes(), got.scale_size()), "")
      << which << " scales";
}
inline void expect_same_stats(const CastStats& got, const CastStats& want) {
  EXPECT_EQ(bits(got.amax), bits(want.amax)) << got.amax << " vs " << want.amax;
  EXPECT_EQ(got.elements, want.elements);
  EXPECT_EQ(got.nonzero, want.nonzero);
  EXPECT_EQ(got.saturated, want.saturated);
  EXPECT_EQ(got.flushed, want.flushed);
}

// A float in both backends' memory: Quantize::delayed_scale and ::amax point into the memory of
// the backend that casts (device memory for the GPU).
struct Scalar {
  Pair p{Shape{1}};
  explicit Scalar(float v) {
    p.host.mem[0] = v;
    p.up();
  }
  float* on(bool gpu_side) { return gpu_side ? p.dev.ptr<float>() : p.host.mem.data(); }
  float cpu_value() const { return p.host.mem[0]; }
  float gpu_value() const { return p.down()[0]; }
};

struct Recipe {
  const char* name;
  Fp8Scaling scaling;
  bool delayed;  // per_tensor: the registry's scale (kDelayedScale) instead of the current one
  bool pow2;
};
// Not a power of two, so scale_inv = 1/37 is inexact and its rounding is compared too; large
// enough that the planted -2000 and the outlier saturate.
constexpr float kDelayedScale = 37.0f;

// kDelayedScale in the memory of the GPU or of the CPU backend (lives as long as the tests).
inline const float* delayed_scale_on(bool gpu_side) {
  static Scalar scale(kDelayedScale);
  return scale.on(gpu_side);
}

// A fused cast's op by name, for test traces.
inline const char* cast_op_name(Backend::CastInput::Op op) {
  static constexpr const char* kNames[] = {"identity", "gelu_tanh", "layernorm_modulate", "gelu_tanh_backward",
                                           "gated"};
  static_assert(static_cast<int>(Backend::CastInput::Op::gated) == 4 && std::size(kNames) == 5);
  return kNames[static_cast<int>(op)];
}

// Every recipe the casts support: per-tensor delayed and current (tensorwise) scaling, 1x128
// and 128x128 blocks with power-of-2 or exact scales, MXFP8.
inline const Recipe kRecipes[] = {
    {"delayed", Fp8Scaling::per_tensor, true, false},
    {"current", Fp8Scaling::per_tensor, false, false},
    {"current_pow2", Fp8Scaling::per_tensor, false, true},
    {"block_1x128", Fp8Scaling::block_1x128, false, true},
    {"block_1x128_exact", Fp8Scaling::block_1x128, false, false},
    {"block_128x128", Fp8Scaling::block_128x128, false, true},
    {"block_128x128_exact", Fp8Scaling::block_128x128, false, false},
    {"mx_1x32", Fp8Scaling::mx_1x32, false, false},
};

// The cast arguments of a recipe (no amax or statistics targets) for the GPU or the CPU backend.
inline Backend::Quantize quantize_for(const Recipe& recipe, Fp8Format format, bool gpu_side) {
  Backend::Quantize q;
  q.format = format;
  q.scaling = recipe.scaling;
  q.pow2 = recipe.pow2;
  q.delayed_scale = recipe.delayed ? delayed_scale_on(gpu_side) : nullptr;
  return q;
}

// What exercises the counts and scales, planted into N(0,1) values of an R x C input (at(r, c):
// its element): a zero row segment (whole 1x128 and 1x32 blocks) and, when x has two column
// tiles, an all-zero 128x128 tile; one huge outlier (per-tensor scales shrink, small values
// flush); a tiny value that flushes under any scale; a value that saturates under the delayed
// scale; a NaN; optionally +inf (amax inf: scale 1 for its tensor/blocks, NaN E8M0 scale for its
// MX block). Inputs of fewer than 8 elements stay as they are.
template <typename At>
void plant_cast_extremes(At at, int64_t R, int64_t C, bool with_inf) {
  if (R * C < 8) return;
  for (int64_t c = 0; c < std::min<int64_t>(C, 128); ++c) at(0, c) = 0.0f;
  if (C > 128)
    for (int64_t r = 0; r < std::min<int64_t>(R, 128); ++r)
      for (int64_t c = 128; c < std::min<int64_t>(C, 256); ++c) at(r, c) = 0.0f;
  at(R / 2, C / 2) = 5.0e4f;
  at(R - 1, 0) = 1.0e-30f;
  at(1, C - 2) = -2.0e3f;
  at(R - 1, C - 1) = std::numeric_limits<float>::quiet_NaN();
  if (with_inf) at(R / 3, C / 3) = std::numeric_limits<float>::infinity();
}

// Quantize::column_sums over x of type X (Pair: f32 activations, Bf16Pair: bf16 ones) against
// the CPU's: every recipe, partial tiles, a strided input, and the path with no FP8 copy (the
// sums on their own); the copies that are made equal the CPU's byte for byte.
// Sums: Pair (f32 sums) or Bf16Pair (a bf16 bias gradient, grad_precision: bf16: the same
// double sums rounded to f32 and then to bf16 on both sides).
template <typename X, typename Sums = Pair>
void expect_column_sums_match_cpu() {
  for (const Recipe& recipe : kRecipes)
    for (const auto [R, C] : {std::array<int64_t, 2>{300, 257}, {5, 3}, {128, 256}})
      for (const int copies : {0, 1, 2, 3})
        for (const bool accumulate : {true, false}) {
          SCOPED_TRACE(fmt::format("{} [{}, {}] copies {} {}", recipe.name, R, C, copies,
                                   accumulate ? "accumulated" : "overwritten (old sums NaN)"));
          X x({R, C}, 3);
          x.randn(71, 3.0);
          Sums sums({C});
          sums.randn(72);
          if (!accumulate) sums.fill(std::numeric_limits<float>::quiet_NaN());  // never read
          QPair row(R, C, Fp8Format::e5m2, recipe.scaling), col(C, R, Fp8Format::e5m2, recipe.scaling);
          for (const bool g : {false, true}) {
            Backend::Quantize q = quantize_for(recipe, Fp8Format::e5m2, g);
            q.column_sums = sums.t(g);
            q.column_sums_accumulate = accumulate;
            (g ? gpu() : cpu())
                .quantize(copies & 1 ? row.on(g) : QTensor{}, copies & 2 ? col.on(g) : QTensor{}, x.t(g), q);
          }
          if constexpr (std::is_same_v<Sums, Pair>)
            EXPECT_LE(gpu_vs_cpu(sums), 1e-6);  // double sums in another order, rounded to f32
          else  // ... then to bf16: equal but where the f32 values straddle a bf16 rounding boundary
            EXPECT_LE(bf16_mismatches(sums), 1);
          if (copies & 1) expect_equals_cpu(row, "rowwise");
          if (copies & 2) expect_equals_cpu(col, "columnwise");
        }
}

}  // namespace flux8::testing
