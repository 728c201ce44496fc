#pragma once
// AdamW over the flat parameter buffer, with global-norm gradient clipping. The moments are
// two more flat buffers laid out like the parameters (on the CPU backend the f32 parameters
// are themselves the master weights), in the parameters' type or, with adam_moment_precision
// bf16, in bf16 (stochastically rounded: Backend::AdamW).
#include <span>

#include "backend/backend.h"
#include "model/params.h"
#include "train/schedule.h"

namespace flux8 {

class Config;

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  double clip_grad = 1.0;  // 0 = no clipping
  // Storage of the moments: the parameters' type (f32), or bf16 (f32 parameters only):
  // adam_moment_precision.
  DType moment_dtype = DType::f32;
  static AdamWConfig from_config(const Config& cfg);
};

struct StepStats {
  double grad_norm = 0;  // before clipping
  double lr = 0;
  bool applied = false;  // false: non-finite gradient, weights unchanged
};

class AdamWOptimizer {
 public:
  AdamWOptimizer(ParamStore& store, AdamWConfig cfg);
  ~AdamWOptimizer();
  AdamWOptimizer(const AdamWOptimizer&) = delete;
  AdamWOptimizer& operator=(const AdamWOptimizer&) = delete;

  // One update from the accumulated gradients; `step` is 1-based (bias correction, schedule).
  // A non-finite gradient norm skips the update and leaves weights and moments unchanged.
  // `casts`: FP8 casts of the new weights to write with them (FluxModel::weight_casts).
  StepStats step(int64_t step, double lr, std::span<const Backend::ParamCast> casts = {});

  // The moments (in moment_dtype(); checkpoints store them as f32).
  DType moment_dtype() const { return m_.dtype; }
  Tensor exp_avg() const { return m_; }
  Tensor exp_avg_sq() const { return v_; }

 private:
  ParamStore& store_;
  AdamWConfig cfg_;
  Tensor m_, v_;
};

}  // namespace flux8
