#pragma once
// What the backward of a step's last micro-batch tells as it goes: which parameters' gradients
// are final for the step. A data-parallel trainer starts reducing them while the backward
// continues (overlap_grad_reduce); the model knows nothing of who listens or why.
#include <cstddef>
#include <span>

namespace flux8 {

class FinalGradients {
 public:
  virtual ~FinalGradients() = default;
  // The gradients of `params` (indices into the model's ParamLayout::params()) are final: the ops
  // that write them are queued on the backend, and nothing later in the step writes them again.
  // Called in the order the backward finishes them (the final layer first, the embedders last);
  // every parameter is named exactly once a backward.
  virtual void gradients_final(std::span<const size_t> params) = 0;
};

}  // namespace flux8
