#pragma once
// Host <-> backend copies of whole tensors as f64 values, whatever the tensor's dtype (f32,
// f64, or bf16: an activation in bf16 storage, rounded to nearest even on the way in). Used for checkpoints, CLI inputs/outputs and tests; never on a hot path.
#include <vector>

#include "core/tensor.h"

namespace flux8 {

class Backend;

std::vector<double> to_host(Backend& backend, const Tensor& t);
void from_host(Backend& backend, const Tensor& t, const std::vector<double>& values);
// The same from f32 values: uploaded as they are into an f32 tensor (no conversion pass).
void from_host(Backend& backend, const Tensor& t, const std::vector<float>& values);

}  // namespace flux8
