#pragma once
// Interop with Hugging Face diffusers' FluxTransformer2DModel state dicts. diffusers splits
// fused projections (q/k/v, and q/k/v/mlp in single blocks) into separate Linears and stores
// the final layer's modulation as [scale; shift] where the reference has [shift; scale]. Both
// are row ranges, so one table of row pieces maps either direction.
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/params.h"

namespace flux8 {

// Rows [diffusers_row, +rows) of diffusers tensor `diffusers` are rows [bfl_row, +rows) of
// the reference tensor (dim 0; for 1-D tensors rows are elements).
struct NamePiece {
  std::string diffusers;
  int64_t diffusers_row = 0;
  int64_t bfl_row = 0;
  int64_t rows = 0;
};

std::vector<NamePiece> diffusers_pieces(const ParamInfo& param, const FluxConfig& cfg);

struct DiffusersTensor {
  std::string name;
  Shape shape;
};
// Every diffusers tensor of the model, in reference order, with its shape.
std::vector<DiffusersTensor> diffusers_tensors(const ParamLayout& layout, const FluxConfig& cfg);

}  // namespace flux8
