#pragma once
// Pieces shared by the Flux blocks: parameter bindings and the context a block runs in.
#include <string>

#include "backend/backend.h"
#include "model/arena.h"
#include "model/flux_config.h"
#include "model/linear_site.h"
#include "model/params.h"

namespace flux8 {

// Tokens of one step: every sample has txt_tokens text tokens then img_tokens image tokens.
struct StepShape {
  int64_t batch = 1;
  int64_t txt_tokens = 0;
  int64_t img_tokens = 0;
  int64_t tokens() const { return txt_tokens + img_tokens; }
};

// A norm scale and its gradient.
struct ScaleParam {
  Tensor s, ds;
  static ScaleParam bind(const ParamStore& store, const std::string& name);
};

// Everything a block's forward/backward needs besides its own parameters and activations.
struct BlockContext {
  Backend& be;
  const FluxConfig& cfg;
  StepShape shape;
  DType dtype;
  Arena& scratch;     // temporaries; every block releases what it takes
  Tensor pe;          // RoPE table of the joint sequence [B, L, D/2, 2]
  Tensor silu_vec;    // SiLU(vec) [B, H], the input of every modulation Linear
  Tensor d_silu_vec;  // its gradient, accumulated by every block's backward
  Fp8Runtime* fp8 = nullptr;  // FP8 state; null in BF16 runs
};

}  // namespace flux8
