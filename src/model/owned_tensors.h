#pragma once
// Backend tensors of one dtype, allocated one at a time and released together (on release() and
// when the owner goes away): the buffers a batch of inputs or a training step's micro-batch holds.
#include <vector>

#include "core/tensor.h"

namespace flux8 {

class Backend;

class OwnedTensors {
 public:
  OwnedTensors(Backend& backend, DType dtype) : be_(backend), dtype_(dtype) {}
  ~OwnedTensors() { release(); }
  OwnedTensors(const OwnedTensors&) = delete;
  OwnedTensors& operator=(const OwnedTensors&) = delete;

  // A new tensor of `shape` (contents undefined), held until release().
  Tensor make(Shape shape);
  void release();
  Backend& backend() const { return be_; }

 private:
  Backend& be_;
  DType dtype_;
  std::vector<void*> owned_;
};

}  // namespace flux8
