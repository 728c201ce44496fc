#pragma once
// A contiguous 1-D tensor in a backend's memory, released with the object (for tests that
// copy to and from a backend).
#include "backend/backend.h"

namespace flux8::testing {

struct BackendBuffer {
  Backend& be;
  void* mem;
  Tensor t;
  BackendBuffer(Backend& b, DType dtype, int64_t n)
      : be(b), mem(b.allocate(static_cast<size_t>(n) * dtype_size(dtype))), t(mem, dtype, Shape{n}) {}
  ~BackendBuffer() { be.release(mem); }
  BackendBuffer(const BackendBuffer&) = delete;
  BackendBuffer& operator=(const BackendBuffer&) = delete;
};

}  // namespace flux8::testing
