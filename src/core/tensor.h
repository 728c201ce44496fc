#pragma once
// A Tensor is a non-owning view: pointer, dtype, shape (up to 4 dims) and a row stride.
// Memory belongs to a backend (host for the CPU backend, device for CUDA) and is owned by
// flat buffers or arenas; views never free anything.
//
// Layout: row-major. A tensor is treated by matrix ops as rows() = prod(shape[:-1]) rows of
// cols() = shape[-1] elements, row r starting at data + r*ld. ld == cols() for contiguous
// tensors; ld > cols() for a column window of a wider matrix (e.g. the Q part of a fused
// [Q|K|V|MLP] projection output), which lets ops read and write slices without copies.
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/dtype.h"

namespace flux8 {

struct Shape {
  std::array<int64_t, 4> d{0, 0, 0, 0};
  int rank = 0;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  int64_t operator[](int i) const { return d[static_cast<size_t>(i < 0 ? rank + i : i)]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const;  // "[3072, 9216]"
};

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  Shape shape;
  int64_t ld = 0;  // row stride in elements

  Tensor() = default;
  Tensor(void* p, DType t, Shape s) : data(p), dtype(t), shape(s), ld(s.rank ? s[-1] : 1) {}

  bool defined() const { return data != nullptr; }
  int64_t numel() const { return shape.numel(); }
  int64_t cols() const { return shape.rank ? shape[-1] : 1; }
  int64_t rows() const { return cols() ? numel() / cols() : 0; }
  bool contiguous() const { return ld == cols(); }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }

  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }

  // Column window [begin, begin+width) of every row; same rows, same ld.
  Tensor cols_slice(int64_t begin, int64_t width) const;
  // Same memory seen with another shape (contiguous tensors only; numel must match).
  Tensor reshaped(Shape s) const;
  // Rows [begin, begin+count) of the [rows(), cols()] matrix, as a 2-D view.
  Tensor rows_slice(int64_t begin, int64_t count) const;

  std::string str() const;  // "f32[2, 5, 16]"
};

}  // namespace flux8
