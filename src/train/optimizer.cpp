#include "train/optimizer.h"

#include <cmath>
#include <vector>

#include "backend/backend.h"
#include "config/config.h"
#include "core/error.h"

namespace flux8 {

AdamWConfig AdamWConfig::from_config(const Config& c) {
  AdamWConfig a;
  a.beta1 = c.get_float("adam_beta1");
  a.beta2 = c.get_float("adam_beta2");
  a.eps = c.get_float("adam_eps");
  a.weight_decay = c.get_float("weight_decay");
  a.clip_grad = c.get_float("clip_grad");
  a.moment_dtype = c.get_string("adam_moment_precision") == "bf16" ? DType::bf16 : DType::f32;
  return a;
}

AdamWOptimizer::AdamWOptimizer(ParamStore& store, AdamWConfig cfg) : store_(store), cfg_(cfg) {
  const Shape s{store.layout().total()};
  // adam_moment_precision bf16 applies to f32 parameters; the f64 models of the gradient
  // checks keep f64 moments (moment_dtype f32 means "the parameters' type").
  if (cfg.moment_dtype == DType::bf16 && store.dtype() != DType::f32)
    fail("adam_moment_precision bf16 needs f32 parameters; this model's are {}", dtype_name(store.dtype()));
  const DType dt = cfg.moment_dtype == DType::bf16 ? DType::bf16 : store.dtype();
  const size_t bytes = static_cast<size_t>(s.numel()) * dtype_size(dt);
  m_ = Tensor(store.backend().allocate(bytes), dt, s);
  v_ = Tensor(store.backend().allocate(bytes), dt, s);
}

AdamWOptimizer::~AdamWOptimizer() {
  store_.backend().release(m_.data);
  store_.backend().release(v_.data);
}

StepStats AdamWOptimizer::step(int64_t step, double lr, std::span<const Backend::ParamCast> casts) {
  Backend& be = store_.backend();
  StepStats s;
  s.lr = lr;
  // The per-sample Linears' gradients may be kept as factors (ParamStore::keep_low_rank_grads):
  // the norm and the update read them from there.
  const std::vector<Backend::LowRankGrad> low_rank = store_.low_rank_grads();
  s.grad_norm = std::sqrt(be.gradient_sum_squares(store_.flat_grads(), low_rank));
  if (!std::isfinite(s.grad_norm)) return s;
  // Clipping scales the gradient inside the update (no extra pass over the gradients).
  const double scale = cfg_.clip_grad > 0 && s.grad_norm > cfg_.clip_grad ? cfg_.clip_grad / s.grad_norm : 1.0;
  // The weights' bf16 operand copies are written with the new weights (a conversion pass less).
  const std::vector<Backend::ParamCopy> copies = store_.operand_copies();
  be.adamw(store_.flat_params(), store_.flat_grads(), m_, v_,
           Backend::AdamW{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay, scale, step}, copies, casts,
           low_rank);
  store_.params_updated();
  s.applied = true;
  return s;
}

}  // namespace flux8
