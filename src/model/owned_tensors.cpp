#include "model/owned_tensors.h"

#include "backend/backend.h"

namespace flux8 {

Tensor OwnedTensors::make(Shape shape) {
  Tensor t(be_.allocate(static_cast<size_t>(shape.numel()) * dtype_size(dtype_)), dtype_, shape);
  owned_.push_back(t.data);
  return t;
}

void OwnedTensors::release() {
  for (void* p : owned_) be_.release(p);
  owned_.clear();
}

}  // namespace flux8
