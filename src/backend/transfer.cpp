#include "backend/transfer.h"

#include <cstring>

#include "backend/backend.h"
#include "core/error.h"

namespace flux8 {

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
  FLUX8_CHECK(t.contiguous() && static_cast<int64_t>(values.size()) == t.numel(), "from_host of {} values into {}",
              values.size(), t.str());
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
  FLUX8_CHECK(t.contiguous() && static_cast<int64_t>(values.size()) == t.numel(), "from_host of {} values into {}",
              values.size(), t.str());
  std::vector<uint8_t> scratch;
  upload_f32(backend, t, values.data(), scratch);
}

void upload_f32(Backend& backend, const Tensor& t, const float* values, std::vector<uint8_t>& scratch) {
  FLUX8_CHECK(t.contiguous(), "upload_f32 into a strided tensor {}", t.str());
  FLUX8_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64 || t.dtype == DType::bf16, "upload_f32 into {}", t.str());
  const size_t n = static_cast<size_t>(t.numel());
  if (t.dtype == DType::f32) {
    backend.upload(t.data, values, n * 4);
    return;
  }
  // A 12B model's bf16 moments are ~24G values: converted over the cores.
  scratch.resize(n * dtype_size(t.dtype));
  convert_elements(values, DType::f32, n, t.dtype, scratch.data());
  backend.upload(t.data, scratch.data(), scratch.size());
}

void download_as(Backend& backend, const Tensor& t, size_t first, size_t count, DType dst_dtype, void* dst,
                 std::vector<uint8_t>& scratch) {
  FLUX8_CHECK(t.contiguous() && first + count <= static_cast<size_t>(t.numel()),
              "download_as of elements [{}, {}) of {}", first, first + count, t.str());
  FLUX8_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64 || t.dtype == DType::bf16, "download_as of {}", t.str());
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

}  // namespace flux8
