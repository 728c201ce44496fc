#pragma once
// Learning-rate schedule: linear warmup from 0 over lr_warmup_iters steps, then constant, or
// cosine / linear decay from lr to min_lr over the remaining lr_decay_iters − warmup steps
// (Megatron semantics: after lr_decay_iters the rate stays at min_lr).
#include <cstdint>
#include <string>

namespace flux8 {

struct LrSchedule {
  double lr = 1e-4;
  double min_lr = 0.0;
  int64_t warmup_iters = 0;
  int64_t decay_iters = 0;         // step at which decay ends
  std::string style = "constant";  // constant | cosine | linear

  // Rate for the optimizer step `step` (1-based: the first update uses step 1).
  double at(int64_t step) const;
};

}  // namespace flux8
