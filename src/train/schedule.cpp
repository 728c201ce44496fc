#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace flux8 {

double LrSchedule::at(int64_t step) const {
  if (warmup_iters > 0 && step <= warmup_iters)
    return lr * static_cast<double>(step) / static_cast<double>(warmup_iters);
  if (style == "constant") return lr;
  const int64_t span = decay_iters - warmup_iters;
  if (span <= 0 || step >= decay_iters) return min_lr;
  const double progress = static_cast<double>(step - warmup_iters) / static_cast<double>(span);
  if (style == "linear") return min_lr + (lr - min_lr) * (1.0 - progress);
  if (style == "cosine") return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  fail("lr_decay_style '{}' is not one of constant, cosine, linear", style);
}

}  // namespace flux8
