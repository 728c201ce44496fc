#pragma once
// Helpers for the GPU conformance tests: every test runs an op on the CUDA backend and on the
// CPU backend with the same random inputs and compares. A machine without a usable GPU skips
// (the tests are built and listed in CI all the same).
//
// Pair<T> holds one host tensor (Buf, with optional column padding so strided views are
// exercised) and its device twin with the same shape and ld.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/factory.h"
#include "core/error.h"
#include "cpu_ops_util.h"
#include "test_util.h"

namespace flux8::testing {

// Skips the calling test when there is no GPU; else returns the shared CUDA backend.
#define FLUX8_REQUIRE_GPU()                                                       \
  do {                                                                            \
    if (const std::string why = ::flux8::cuda_unavailable_reason(); !why.empty()) \
      GTEST_SKIP() << "no usable GPU: " << why;                                   \
  } while (0)

inline Backend& gpu() {
  static std::unique_ptr<Backend> be = make_cuda_backend({});
  return *be;
}
// A second CUDA backend whose non-FP8 GEMMs run with bf16 operands (the training default).
inline Backend& gpu_bf16_gemm() {
  static std::unique_ptr<Backend> be = [] {
    BackendOptions o;
    o.bf16_gemm = true;
    return make_cuda_backend(o);
  }();
  return *be;
}
inline Backend& cpu() {
  static std::unique_ptr<Backend> be = make_backend("cpu");
  return *be;
}
// A CUDA backend that stores activations in bf16 (activation_precision: bf16) with bf16 GEMMs:
// the training configuration.
inline Backend& gpu_bf16_activations() {
  static std::unique_ptr<Backend> be = [] {
    BackendOptions o;
    o.bf16_gemm = true;
    o.bf16_activations = true;
    return make_cuda_backend(o);
  }();
  return *be;
}
// The training configuration with parameter gradients stored in bf16 (grad_precision: bf16).
inline Backend& gpu_bf16_grads() {
  static std::unique_ptr<Backend> be = [] {
    BackendOptions o;
    o.bf16_gemm = true;
    o.bf16_activations = true;
    o.bf16_grads = true;
    return make_cuda_backend(o);
  }();
  return *be;
}
// The CPU twin of bf16 activation storage: every activation output rounded to bf16.
inline Backend& cpu_bf16() {
  static std::unique_ptr<Backend> be = [] {
    BackendOptions o;
    o.round_activations_to_bf16 = true;
    return make_backend("cpu", o);
  }();
  return *be;
}

// A host f32 buffer and a device copy of the same layout (ld included).
struct Pair {
  Buf<float> host;
  Tensor dev;

  explicit Pair(Shape s, int64_t pad = 0) : host(s, pad) {
    const size_t bytes = host.mem.size() * sizeof(float);
    void* p = gpu().allocate(bytes ? bytes : 4);
    dev = host.t;
    dev.data = p;
  }
  ~Pair() { gpu().release(dev.data); }
  Pair(const Pair&) = delete;

  Pair& randn(uint64_t seed, double stddev = 1.0) {
    host.randn(seed, stddev);
    return up();
  }
  Pair& fill(float v) {
    std::fill(host.mem.begin(), host.mem.end(), v);
    return up();
  }
  // host -> device (whole storage, padding included)
  Pair& up() {
    gpu().upload(dev.data, host.mem.data(), host.mem.size() * sizeof(float));
    return *this;
  }
  // The device tensor's window, row by row.
  std::vector<float> down() const {
    std::vector<float> all(host.mem.size());
    gpu().download(all.data(), dev.data, all.size() * sizeof(float));
    std::vector<float> v;
    for (int64_t r = 0; r < dev.rows(); ++r)
      for (int64_t c = 0; c < dev.cols(); ++c) v.push_back(all[static_cast<size_t>(r * dev.ld + c)]);
    return v;
  }
  // The device storage's padding must be untouched (still what host holds there).
  bool padding_untouched() const {
    std::vector<float> all(host.mem.size());
    gpu().download(all.data(), dev.data, all.size() * sizeof(float));
    for (int64_t r = 0; r < dev.rows(); ++r)
      for (int64_t c = dev.cols(); c < dev.ld; ++c) {
        const size_t i = static_cast<size_t>(r * dev.ld + c);
        if (std::memcmp(&all[i], &host.mem[i], sizeof(float)) != 0) return false;
      }
    return true;
  }
  std::vector<float> cpu_values() const { return host.values(); }
  // The view to hand to an op: the device tensor for the GPU run, the host one for the CPU run.
  Tensor t(bool on_gpu) const { return on_gpu ? dev : host.t; }
};

// Runs op(backend, on_gpu) on the CPU backend (host views) and on the GPU (device views): each
// Pair's host copy then holds the CPU result and its device copy the GPU result.
template <typename Op>
void run_both(Op op) {
  op(cpu(), false);
  op(gpu(), true);
  gpu().synchronize();
}

// ‖a − b‖₂ / ‖b‖₂ (b the CPU reference).
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += d * d;
    den += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  if (a.size() != b.size()) return INFINITY;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Device result of `p` vs its host (CPU-computed) values.
inline double gpu_vs_cpu(const Pair& p) { return rel_l2(p.down(), p.cpu_values()); }

// Window i of every row (`row_len` values a row, as down() and cpu_values() give them): its
// columns [i·width, (i + 1)·width), row after row.
inline std::vector<float> window_of_rows(const std::vector<float>& all, int64_t row_len, int64_t i, int64_t width) {
  std::vector<float> w;
  for (size_t r = 0; r < all.size() / static_cast<size_t>(row_len); ++r)
    w.insert(w.end(), all.begin() + static_cast<int64_t>(r) * row_len + i * width,
             all.begin() + static_cast<int64_t>(r) * row_len + (i + 1) * width);
  return w;
}

// f32 values -> the bf16 bit patterns they round to (nearest even).
inline std::vector<uint16_t> bf16_bits_of(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = f32_to_bf16_bits(v[i]);
  return b;
}

// Elements of `got` (bf16 values) more than one bf16 ulp (2⁻⁷ of the larger magnitude: one ulp
// at the top of a binade) from `want` (f32 values) rounded to bf16; float or double vectors.
template <typename V>
int64_t beyond_one_bf16_ulp(const std::vector<V>& got, const std::vector<V>& want) {
  EXPECT_EQ(got.size(), want.size());
  int64_t n = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double w = round_to_bf16(static_cast<float>(want[i])), g = static_cast<double>(got[i]);
    if (!(std::abs(g - w) <= std::ldexp(std::max(std::abs(w), std::abs(g)), -7))) ++n;
  }
  return n;
}

// A contiguous bf16 device tensor (attention heads in bf16: Backend::attention_heads_dtype).
struct Bf16Dev {
  Tensor t;
  explicit Bf16Dev(Shape s)
      : t(gpu().allocate(static_cast<size_t>(s.numel() > 0 ? s.numel() : 1) * 2), DType::bf16, s) {}
  ~Bf16Dev() { gpu().release(t.data); }
  Bf16Dev(const Bf16Dev&) = delete;
  // Each value rounded to nearest even.
  void up(const std::vector<float>& v) {
    const std::vector<uint16_t> b = bf16_bits_of(v);
    gpu().upload(t.data, b.data(), b.size() * 2);
  }
  std::vector<uint16_t> bits() const {
    std::vector<uint16_t> b(static_cast<size_t>(t.numel()));
    gpu().download(b.data(), t.data, b.size() * 2);
    return b;
  }
  std::vector<float> down() const {
    std::vector<float> v;
    for (uint16_t b : bits()) v.push_back(bf16_bits_to_f32(b));
    return v;
  }
};

// An activation in bf16 storage: a host f32 buffer holding bf16 values (the CPU backend's
// view) and a bf16 device twin with the same shape and ld (padding included, so strided views
// are exercised). Values written by the CPU run stay f32 on the host; down() gives the GPU's.
struct Bf16Pair {
  Buf<float> host;
  Tensor dev;

  explicit Bf16Pair(Shape s, int64_t pad = 0) : host(s, pad) {
    const size_t bytes = host.mem.size() * 2;
    dev = host.t;
    dev.dtype = DType::bf16;
    dev.data = gpu().allocate(bytes ? bytes : 2);
  }
  ~Bf16Pair() { gpu().release(dev.data); }
  Bf16Pair(const Bf16Pair&) = delete;

  // N(0, stddev²) values rounded to bf16, on both sides.
  Bf16Pair& randn(uint64_t seed, double stddev = 1.0) {
    host.randn(seed, stddev);
    return up();
  }
  Bf16Pair& fill(float v) {
    std::fill(host.mem.begin(), host.mem.end(), v);
    return up();
  }
  // Rounds the host values to bf16 and uploads them (whole storage, padding included).
  Bf16Pair& up() {
    for (float& x : host.mem) x = round_to_bf16(x);
    const std::vector<uint16_t> b = bf16_bits_of(host.mem);
    gpu().upload(dev.data, b.data(), b.size() * 2);
    return *this;
  }
  std::vector<uint16_t> all_bits() const {
    std::vector<uint16_t> all(host.mem.size());
    gpu().download(all.data(), dev.data, all.size() * 2);
    return all;
  }
  // The device tensor's window, row by row, as f32 values.
  std::vector<float> down() const {
    const std::vector<uint16_t> all = all_bits();
    std::vector<float> v;
    for (int64_t r = 0; r < dev.rows(); ++r)
      for (int64_t c = 0; c < dev.cols(); ++c) v.push_back(bf16_bits_to_f32(all[static_cast<size_t>(r * dev.ld + c)]));
    return v;
  }
  // The padding must still hold what up() put there.
  bool padding_untouched() const {
    const std::vector<uint16_t> all = all_bits();
    for (int64_t r = 0; r < dev.rows(); ++r)
      for (int64_t c = dev.cols(); c < dev.ld; ++c) {
        const size_t i = static_cast<size_t>(r * dev.ld + c);
        if (all[i] != f32_to_bf16_bits(host.mem[i])) return false;
      }
    return true;
  }
  // The CPU result rounded to bf16, as the GPU stores it (ops that the CPU twin does not round,
  // e.g. copy/add/accumulate, are compared with what bf16 storage of their result gives).
  std::vector<float> cpu_values() const {
    std::vector<float> v = host.values();
    for (float& x : v) x = round_to_bf16(x);
    return v;
  }
  Tensor t(bool on_gpu) const { return on_gpu ? dev : host.t; }
};

inline double gpu_vs_cpu(const Bf16Pair& p) { return rel_l2(p.down(), p.cpu_values()); }

// Low-rank gradients (Backend::LowRankGrad) over a flat gradient buffer on both backends: per
// range its offset and factors a [R, M] (N(0, 0.1²)) and b [R, K] (N(0, 1)), and the flat
// buffer's elements at the ranges set to NaN (plant_nan: a kernel that reads them shows it).
struct LowRankFactors {
  struct Spec {
    int64_t offset, R, M, K;
  };
  std::vector<Spec> specs;
  std::vector<std::unique_ptr<Pair>> a, b;

  LowRankFactors(std::vector<Spec> s, uint64_t seed) : specs(std::move(s)) {
    for (size_t i = 0; i < specs.size(); ++i) {
      a.push_back(std::make_unique<Pair>(Shape{specs[i].R, specs[i].M}));
      b.push_back(std::make_unique<Pair>(Shape{specs[i].R, specs[i].K}));
      a.back()->randn(seed + i, 0.1);
      b.back()->randn(seed + 10 + i);
    }
  }
  // The ranges' elements of a flat gradient buffer (Pair or Bf16Pair) set to NaN on both sides.
  template <typename Flat>
  void plant_nan(Flat& grads) const {
    for (const Spec& s : specs)
      std::fill(grads.host.mem.begin() + s.offset, grads.host.mem.begin() + s.offset + s.M * s.K, NAN);
    grads.up();
  }
  std::vector<Backend::LowRankGrad> on(bool gpu_side) const {
    std::vector<Backend::LowRankGrad> lr;
    for (size_t i = 0; i < specs.size(); ++i) lr.push_back({specs[i].offset, a[i]->t(gpu_side), b[i]->t(gpu_side)});
    return lr;
  }
};

// A flat bf16 buffer on both backends (AdamW's moments with adam_moment_precision bf16): the
// CPU backend's bits in host.mem (named as Pair's buffer) and a device twin, filled alike.
struct Bf16Flat {
  struct {
    std::vector<uint16_t> mem;
  } host;
  Bf16Dev dev;

  explicit Bf16Flat(Shape s) : dev(s) { host.mem.resize(static_cast<size_t>(s.numel())); }
  Bf16Flat& randn(uint64_t seed, double stddev = 1.0) {
    Buf<float> b(dev.t.shape);
    b.randn(seed, stddev);
    return set(b.mem);
  }
  Bf16Flat& fill(float x) { return set(std::vector<float>(host.mem.size(), x)); }
  // Each value rounded to nearest even, on both sides.
  Bf16Flat& set(const std::vector<float>& values) {
    host.mem = bf16_bits_of(values);
    gpu().upload(dev.t.data, host.mem.data(), host.mem.size() * 2);
    return *this;
  }
  std::vector<uint16_t> down() const { return dev.bits(); }
  Tensor t(bool on_gpu) const {
    return on_gpu ? dev.t : Tensor(const_cast<uint16_t*>(host.mem.data()), DType::bf16, dev.t.shape);
  }
};

// The gradient norm and two AdamW steps over the flat gradients `gr` (Pair: f32; Bf16Pair: bf16
// gradients) with these low-rank ranges, on both backends: the norm equal up to the order of
// its double sums, AdamW bit for bit, with a bf16 operand copy of the parameters at [20000,
// 20000 + 300·512) (over the third range of the tests' specs) written alike. Moments: Pair
// (f32) or Bf16Flat (bf16, stochastically rounded with the CPU's bits).
template <typename Grads, typename Moments = Pair>
void expect_norm_and_adamw_match_cpu(const Grads& gr, const LowRankFactors& factors) {
  const int64_t n = gr.dev.numel();
  double sq[2];
  run_both([&](Backend& be, bool g) { sq[g] = be.gradient_sum_squares(gr.t(g), factors.on(g)); });
  ASSERT_TRUE(std::isfinite(sq[0]));
  EXPECT_NEAR(sq[1], sq[0], 1e-12 * sq[0]);  // the same f32 values summed in double: order only

  Pair p({n});
  Moments m({n}), v({n});
  p.randn(61), m.randn(62, 0.001), v.fill(1e-6f);
  std::vector<uint16_t> host_copy(300 * 512, 0xFFFF);
  Bf16Dev dev_copy(Shape{300, 512});
  for (int64_t step = 1; step <= 2; ++step) {
    const Backend::AdamW h{1e-3, 0.9, 0.95, 1e-8, 0.1, 0.6, step};
    run_both([&](Backend& be, bool g) {
      const Backend::ParamCopy copy{20000, g ? dev_copy.t : Tensor(host_copy.data(), DType::bf16, Shape{300, 512})};
      be.adamw(p.t(g), gr.t(g), m.t(g), v.t(g), h, std::span(&copy, 1), {}, factors.on(g));
    });
  }
  EXPECT_EQ(p.down(), p.host.mem);
  EXPECT_EQ(m.down(), m.host.mem);
  EXPECT_EQ(v.down(), v.host.mem);
  EXPECT_EQ(dev_copy.bits(), host_copy);
  for (float x : p.host.mem) ASSERT_TRUE(std::isfinite(x));
}

// Elements where the GPU's bf16 result and the CPU's bf16-rounded one differ in their bits.
inline int64_t bf16_mismatches(const Bf16Pair& p) {
  const std::vector<float> g = p.down(), c = p.cpu_values();
  int64_t n = 0;
  for (size_t i = 0; i < g.size(); ++i) n += f32_to_bf16_bits(g[i]) != f32_to_bf16_bits(c[i]);
  return n;
}

// run_both for bf16 activations: the CPU backend that rounds activations to bf16 (host views),
// then the GPU (device views, bf16 activations).
template <typename Op>
void run_both_bf16(Op op) {
  op(cpu_bf16(), false);
  op(gpu(), true);
  gpu().synchronize();
}

// Round a host tensor's values to bf16 in place (so f32 and bf16 runs get the same inputs).
inline void round_host_to_bf16(Pair& p) {
  for (float& x : p.host.mem) x = round_to_bf16(x);
  p.up();
}

}  // namespace flux8::testing
