#pragma once
// Model FLOPs by the convention of docs/WORKLOADS.md: 6 × multiply-adds of every Linear over the
// rows it sees (forward 2, backward 4) + 12·heads·L²·D per attention call (forward 4,
// backward 8). Modulation and embedder Linears see one row per sample.
#include "model/block_common.h"
#include "model/flux_config.h"

namespace flux8 {

struct ModelFlops {
  double linear_macs = 0;    // forward multiply-adds of all Linears, per step
  double attention_fwd = 0;  // forward attention FLOPs (4·n·L²·D per call), per step
  double forward() const { return 2 * linear_macs + attention_fwd; }
  // A training step's FLOPs of the Linears (forward 2, backward 4 a multiply-add) and of
  // attention (backward 2 forwards), and their sum.
  double linear_training() const { return 6 * linear_macs; }
  double attention_training() const { return 3 * attention_fwd; }
  double training() const { return linear_training() + attention_training(); }
};

ModelFlops model_flops(const FluxConfig& cfg, StepShape shape);

}  // namespace flux8
