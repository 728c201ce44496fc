#include "backend/transfer.h"

#include <cstring>

#include "backend/backend.h"
#include "core/error.h"

namespace flux8 {

namespace {
// Conversions of at least this many elements run over the CPU's threads (elementwise: the same
// bits from any number of threads).
constexpr int64_t kParallelElements = int64_t{1} << 20;
}  // namespace

std::vector<double> to_host(Backend& backend, const Tensor& t) {
  FLUX8_CHECK(t.contiguous(), "to_host of a strided tensor {}", t.str());
  const size_t n = static_cast<size_t>(t.numel());
  std::vector<double> out(n);
  if (t.dtype == DType::f64) {
    backend.download(out.data(), t.data, n * 8);
  } else if (t.dtype == DType::bf16) {  // an activation in bf16 storage: widened exactly
    std::vector<uint16_t> tmp(n);
    backend.download(tmp.data(), t.data, n * 2);
    for (size_t i = 0; i < n; ++i) out[i] = bf16_bits_to_f32(tmp[i]);
  } else {
    FLUX8_CHECK(t.dtype == DType::f32, "to_host of {}", t.str());
    std::vector<float> tmp(n);
    backend.download(tmp.data(), t.data, n * 4);
    for (size_t i = 0; i < n; ++i) out[i] = tmp[i];
  }
  return out;
}

void from_host(Backend& backend, const Tensor& t, const std::vector<double>& values) {
  FLUX8_CHECK(t.contiguous() && static_cast<int64_t>(values.size()) == t.numel(),
              "from_host of {} values into {}", values.size(), t.str());
  if (t.dtype == DType::f64) {
    backend.upload(t.data, values.data(), values.size() * 8);
  } else if (t.dtype == DType::bf16) {  // rounded to nearest even through f32
    std::vector<uint16_t> tmp(values.size());
    for (size_t i = 0; i < values.size(); ++i) tmp[i] = f32_to_bf16_bits(static_cast<float>(values[i]));
    backend.upload(t.data, tmp.data(), tmp.size() * 2);
  } else {
    FLUX8_CHECK(t.dtype == DType::f32, "from_host into {}", t.str());
    std::vector<float> tmp(values.begin(), values.end());
    backend.upload(t.data, tmp.data(), tmp.size() * 4);
  }
}

void from_host(Backend& backend, const Tensor& t, const std::vector<float>& values) {
  FLUX8_CHECK(t.contiguous() && static_cast<int64_t>(values.size()) == t.numel(),
              "from_host of {} values into {}", values.size(), t.str());
  std::vector<uint8_t> scratch;
  upload_f32(backend, t, values.data(), scratch);
}

void upload_f32(Backend& backend, const Tensor& t, const float* values, std::vector<uint8_t>& scratch) {
  FLUX8_CHECK(t.contiguous(), "upload_f32 into a strided tensor {}", t.str());
  FLUX8_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64 || t.dtype == DType::bf16, "upload_f32 into {}",
              t.str());
  const size_t n = static_cast<size_t>(t.numel());
  if (t.dtype == DType::f32) {
    backend.upload(t.data, values, n * 4);
    return;
  }
  // A 12B model's bf16 moments are ~24G values: converted over the cores.
  scratch.resize(n * dtype_size(t.dtype));
  const auto count = static_cast<int64_t>(n);
#pragma omp parallel for schedule(static) if (count >= kParallelElements)
  for (int64_t i = 0; i < count; ++i) store_f32_as(values[i], t.dtype, scratch.data(), static_cast<size_t>(i));
  backend.upload(t.data, scratch.data(), scratch.size());
}

void download_as(Backend& backend, const Tensor& t, size_t first, size_t count, DType dst_dtype, void* dst,
                 std::vector<uint8_t>& scratch) {
  FLUX8_CHECK(t.contiguous() && first + count <= static_cast<size_t>(t.numel()),
              "download_as of elements [{}, {}) of {}", first, first + count, t.str());
  FLUX8_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64 || t.dtype == DType::bf16, "download_as of {}",
              t.str());
  const size_t esize = dtype_size(t.dtype);
  const void* src = static_cast<const char*>(t.data) + first * esize;
  if (t.dtype == dst_dtype) {
    backend.download(dst, src, count * esize);
    return;
  }
  scratch.resize(count * esize);
  backend.download(scratch.data(), src, count * esize);
  convert_elements(scratch.data(), t.dtype, count, dst_dtype, dst);
}

void convert_elements(const void* src, DType src_dtype, size_t count, DType dst_dtype, void* dst) {
  FLUX8_CHECK(src_dtype == DType::f32 || src_dtype == DType::f64 || src_dtype == DType::bf16,
              "convert_elements from {}", dtype_name(src_dtype));
  FLUX8_CHECK(dst_dtype == DType::f32 || dst_dtype == DType::f64 || dst_dtype == DType::bf16 ||
                  dst_dtype == DType::f16,
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
#pragma omp parallel for schedule(static) if (n >= kParallelElements)
  for (int64_t i = 0; i < n; ++i) store_f32_as(value(static_cast<size_t>(i)), dst_dtype, dst, static_cast<size_t>(i));
}

}  // namespace flux8
