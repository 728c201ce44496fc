#include "conformance.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>

#include "backend/ops.h"
#include "core/dtype.h"
#include "core/rng.h"

namespace flux8::conformance {

namespace {

// Bytes before and after every buffer: a multiple of 256 so that the tensor itself keeps the
// allocation's alignment (vectorised kernels rely on it).
constexpr size_t kGuard = 256;
constexpr uint8_t kGuardByte = 0xA5;

void store(uint8_t* p, DType t, double v) {
  switch (t) {
    case DType::f64: std::memcpy(p, &v, 8); break;
    case DType::f32: {
      const float f = static_cast<float>(v);
      std::memcpy(p, &f, 4);
      break;
    }
    case DType::bf16: {
      const uint16_t b = f32_to_bf16_bits(static_cast<float>(v));
      std::memcpy(p, &b, 2);
      break;
    }
    case DType::u8: *p = static_cast<uint8_t>(v); break;
    default: throw std::logic_error("conformance: unsupported element type");
  }
}

double load(const uint8_t* p, DType t) {
  switch (t) {
    case DType::f64: {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case DType::f32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::bf16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return bf16_bits_to_f32(b);
    }
    case DType::u8: return *p;
    default: throw std::logic_error("conformance: unsupported element type");
  }
}

std::vector<Case>& case_list() {
  static std::vector<Case> cases;
  return cases;
}
std::vector<GradientCase>& gradient_list() {
  static std::vector<GradientCase> cases;
  return cases;
}

}  // namespace

// One allocation: [guard | rows × ld elements | guard], and the bytes it started with.
struct Run::Block {
  std::string name;  // "" when not compared
  Tensor t;
  void* mem = nullptr;
  std::vector<uint8_t> image;
  size_t elem = 0;
  int64_t rows = 0, cols = 0, ld = 0;
  uint8_t* window(size_t i) { return image.data() + kGuard + i * elem; }
};

Run::Run(Backend& b, DType c) : be(b), compute(c), stores_bf16_(b.options().round_activations_to_bf16) {}

Run::~Run() {
  be.synchronize();
  for (auto& b : blocks_) be.release(b->mem);
}

DType Run::dtype_of(Role role, int64_t cols) const {
  switch (role) {
    case Role::activation: return be.activation_dtype(compute);
    case Role::parameter: return compute;
    case Role::gradient: return be.gradient_dtype(compute);
    case Role::heads: return be.attention_heads_dtype(be.activation_dtype(compute), cols);
  }
  return compute;
}

Tensor Run::allocate(const std::string& name, Shape s, int64_t pad, DType dtype, bool compared) {
  auto b = std::make_unique<Block>();
  b->name = compared ? name : "";
  b->elem = dtype_size(dtype);
  b->cols = s.rank ? s[-1] : 1;
  b->rows = b->cols ? s.numel() / b->cols : 0;
  b->ld = b->cols + pad;
  const size_t bytes = static_cast<size_t>(b->rows * b->ld) * b->elem;
  b->image.assign(2 * kGuard + bytes, kGuardByte);
  // Padding columns hold NaN (an op that reads them spreads it), the window NaN until filled.
  for (size_t i = 0; i < static_cast<size_t>(b->rows * b->ld); ++i)
    store(b->window(i), dtype, dtype == DType::u8 ? 0xFF : std::numeric_limits<double>::quiet_NaN());
  b->mem = be.allocate(b->image.size());
  b->t = Tensor(static_cast<uint8_t*>(b->mem) + kGuard, dtype, s);
  b->t.ld = b->ld;
  stores_bf16_ = stores_bf16_ || dtype == DType::bf16;
  blocks_.push_back(std::move(b));
  be.upload(blocks_.back()->mem, blocks_.back()->image.data(), blocks_.back()->image.size());
  return blocks_.back()->t;
}

void Run::fill_window(Block& b, const std::function<double(size_t)>& value_at) {
  size_t k = 0;
  for (int64_t r = 0; r < b.rows; ++r)
    for (int64_t c = 0; c < b.cols; ++c) store(b.window(static_cast<size_t>(r * b.ld + c)), b.t.dtype, value_at(k++));
  be.upload(b.mem, b.image.data(), b.image.size());
}

Tensor Run::input(Shape s, uint64_t seed, double stddev, int64_t pad, Role role) {
  const Tensor t = allocate("", s, pad, dtype_of(role, s.rank ? s[-1] : 1), false);
  fill_window(*blocks_.back(),
              [&](size_t i) { return round_to_bf16(static_cast<float>(stddev * rng_normal(seed, 1, i))); });
  return t;
}

Tensor Run::input_typed(Shape s, uint64_t seed, double stddev, DType dtype) {
  const Tensor t = allocate("", s, 0, dtype, false);
  fill_window(*blocks_.back(),
              [&](size_t i) { return round_to_bf16(static_cast<float>(stddev * rng_normal(seed, 1, i))); });
  return t;
}

Tensor Run::input_values(Shape s, const std::vector<double>& values, Role role) {
  const Tensor t = allocate("", s, 0, dtype_of(role, s.rank ? s[-1] : 1), false);
  fill_window(*blocks_.back(), [&](size_t i) { return round_to_bf16(static_cast<float>(values.at(i))); });
  return t;
}

Tensor Run::output(const std::string& name, Shape s, int64_t pad, Role role) {
  return allocate(name, s, pad, dtype_of(role, s.rank ? s[-1] : 1), true);
}

Tensor Run::update(const std::string& name, Shape s, uint64_t seed, double stddev, int64_t pad, Role role) {
  const Tensor t = allocate(name, s, pad, dtype_of(role, s.rank ? s[-1] : 1), true);
  fill_window(*blocks_.back(),
              [&](size_t i) { return round_to_bf16(static_cast<float>(stddev * rng_normal(seed, 1, i))); });
  return t;
}

Tensor Run::update_values(const std::string& name, Shape s, const std::vector<double>& values, Role role) {
  const Tensor t = allocate(name, s, 0, dtype_of(role, s.rank ? s[-1] : 1), true);
  fill_window(*blocks_.back(), [&](size_t i) { return round_to_bf16(static_cast<float>(values.at(i))); });
  return t;
}

Tensor Run::output_typed(const std::string& name, Shape s, DType dtype) { return allocate(name, s, 0, dtype, true); }

Tensor Run::scratch(Shape s, Role role) {
  const Tensor t = allocate("", s, 0, dtype_of(role, s.rank ? s[-1] : 1), false);
  fill_window(*blocks_.back(), [](size_t) { return 0.0; });
  return t;
}

float* Run::scalars(const std::string& name, int64_t n, float value) {
  const Tensor t = allocate(name, Shape{n}, 0, DType::f32, !name.empty());
  fill_window(*blocks_.back(), [&](size_t) { return value; });
  return static_cast<float*>(t.data);
}

QTensor Run::qtensor(const std::string& name, int64_t rows, int64_t cols, Fp8Format format, Fp8Scaling scaling) {
  QTensor q;
  q.rows = rows, q.cols = cols, q.format = format, q.scaling = scaling;
  q.codes = static_cast<uint8_t*>(
      allocate(name.empty() ? "" : name + ".codes", Shape{rows, cols}, 0, DType::u8, !name.empty()).data);
  const int64_t n = QTensor::scale_count(scaling, rows, cols);
  const std::string scales = name.empty() ? "" : name + ".scales";
  if (scaling == Fp8Scaling::mx_1x32)
    q.scale_e8m0 = static_cast<uint8_t*>(allocate(scales, Shape{n}, 0, DType::u8, !name.empty()).data);
  else
    q.scale_inv = static_cast<float*>(allocate(scales, Shape{n}, 0, DType::f32, !name.empty()).data);
  return q;
}

void Run::value(const std::string& name, double v) { host_values_.push_back({name, {v}}); }

std::vector<Run::Output> Run::collect(std::vector<std::string>& damage) {
  be.synchronize();
  std::vector<Output> out;
  std::vector<uint8_t> now;
  for (auto& b : blocks_) {
    now.resize(b->image.size());
    be.download(now.data(), b->mem, now.size());
    const std::string what = b->name.empty() ? fmt::format("an input or scratch tensor {}", b->t.shape.str()) : b->name;
    if (std::memcmp(now.data(), b->image.data(), kGuard) != 0) damage.push_back(what + ": written before its start");
    if (std::memcmp(now.data() + now.size() - kGuard, b->image.data() + now.size() - kGuard, kGuard) != 0)
      damage.push_back(what + ": written past its end");
    bool padding_written = false;
    for (int64_t r = 0; r < b->rows; ++r)
      for (int64_t c = b->cols; c < b->ld; ++c) {
        const size_t at = kGuard + static_cast<size_t>(r * b->ld + c) * b->elem;
        padding_written = padding_written || std::memcmp(now.data() + at, b->image.data() + at, b->elem) != 0;
      }
    if (padding_written) damage.push_back(what + ": padding columns (ld > cols) written");
    if (b->name.empty()) continue;
    Output o{b->name, {}};
    for (int64_t r = 0; r < b->rows; ++r)
      for (int64_t c = 0; c < b->cols; ++c)
        o.values.push_back(load(now.data() + kGuard + static_cast<size_t>(r * b->ld + c) * b->elem, b->t.dtype));
    out.push_back(std::move(o));
  }
  out.insert(out.end(), host_values_.begin(), host_values_.end());
  return out;
}

Cases::Cases(std::vector<Case> cases) {
  for (Case& c : cases) case_list().push_back(std::move(c));
}
Cases::Cases(std::vector<Case> cases, std::vector<GradientCase> gradients) : Cases(std::move(cases)) {
  for (GradientCase& g : gradients) gradient_list().push_back(std::move(g));
}
const std::vector<Case>& all_cases() { return case_list(); }
const std::vector<GradientCase>& all_gradient_cases() { return gradient_list(); }

std::vector<std::string> listed_ops() {
  std::vector<std::string> names;
#define FLUX8_CONFORMANCE_NAME_(Type, method) names.push_back(#method);
  FLUX8_OPS(FLUX8_CONFORMANCE_NAME_)
#undef FLUX8_CONFORMANCE_NAME_
  return names;
}

}  // namespace flux8::conformance
