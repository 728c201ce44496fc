#include "core/tensor.h"

#include <fmt/format.h>

#include "core/error.h"

namespace flux8 {

Shape::Shape(std::initializer_list<int64_t> dims) {
  FLUX8_CHECK(dims.size() <= 4, "rank {} > 4", dims.size());
  for (int64_t v : dims) d[static_cast<size_t>(rank++)] = v;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= d[static_cast<size_t>(i)];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank != o.rank) return false;
  for (int i = 0; i < rank; ++i)
    if (d[static_cast<size_t>(i)] != o.d[static_cast<size_t>(i)]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) s += fmt::format("{}{}", i ? ", " : "", d[static_cast<size_t>(i)]);
  return s + "]";
}

Tensor Tensor::cols_slice(int64_t begin, int64_t width) const {
  FLUX8_CHECK(begin >= 0 && width >= 0 && begin + width <= cols(), "column slice [{}, +{}) of {}", begin, width, str());
  Tensor t = *this;
  t.data = static_cast<char*>(data) + static_cast<size_t>(begin) * dtype_size(dtype);
  t.shape.d[static_cast<size_t>(shape.rank - 1)] = width;
  return t;
}

Tensor Tensor::reshaped(Shape s) const {
  FLUX8_CHECK(contiguous() && s.numel() == numel(), "reshape {} to {}", str(), s.str());
  return Tensor(data, dtype, s);
}

Tensor Tensor::rows_slice(int64_t begin, int64_t count) const {
  FLUX8_CHECK(begin >= 0 && count >= 0 && begin + count <= rows(), "row slice [{}, +{}) of {}", begin, count, str());
  Tensor t = *this;
  t.data = static_cast<char*>(data) + static_cast<size_t>(begin * ld) * dtype_size(dtype);
  t.shape = Shape{count, cols()};
  return t;
}

std::string Tensor::str() const { return fmt::format("{}{}", dtype_name(dtype), shape.str()); }

}  // namespace flux8
