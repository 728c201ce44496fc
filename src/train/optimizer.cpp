#include "train/optimizer.h"

#include <algorithm>
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
  // adam_moment_precision bf16 applies to f32 parameters; the f64 models of the gradient
  // checks keep f64 moments (moment_dtype f32 means "the parameters' type").
  if (cfg.moment_dtype == DType::bf16 && store.dtype() != DType::f32)
    fail("adam_moment_precision bf16 needs f32 parameters; this model's are {}", dtype_name(store.dtype()));
  owned_ = FlatRange{0, store.layout().total()};
  m_ = allocate_moment(owned_.count);
  v_ = allocate_moment(owned_.count);
}

Tensor AdamWOptimizer::allocate_moment(int64_t n) {
  const DType dt = cfg_.moment_dtype == DType::bf16 ? DType::bf16 : store_.dtype();
  return Tensor(store_.backend().allocate(static_cast<size_t>(n) * dtype_size(dt)), dt, Shape{n});
}

AdamWOptimizer::~AdamWOptimizer() {
  release_full_moments();
  store_.backend().release(m_.data);
  store_.backend().release(v_.data);
}

void AdamWOptimizer::set_data_parallel(DataParallel* dp, bool distributed) {
  dp_ = dp && dp->size() > 1 ? dp : nullptr;
  const bool shard = dp_ && distributed;
  if (shard == sharded_) return;
  sharded_ = shard;
  Backend& be = store_.backend();
  be.release(m_.data);
  be.release(v_.data);
  const int64_t total = store_.layout().total();
  sharding_ = FlatSharding::of(total, shard ? dp_->size() : 1);
  owned_ = shard ? sharding_.owned(dp_->rank()) : FlatRange{0, total};
  m_ = allocate_moment(owned_.count);
  v_ = allocate_moment(owned_.count);
}

void AdamWOptimizer::allocate_full_moments() {
  if (!sharded_ || full_m_.defined()) return;
  full_m_ = allocate_moment(sharding_.total);
  full_v_ = allocate_moment(sharding_.total);
}

void AdamWOptimizer::gather_moments() {
  if (!sharded_) return;
  allocate_full_moments();
  Backend& be = store_.backend();
  for (auto [mine, full] : {std::pair{m_, full_m_}, std::pair{v_, full_v_}}) {
    be.copy(flat_slice(full, owned_), mine);
    dp_->all_gather_params(full, sharding_);
  }
}

void AdamWOptimizer::scatter_moments() {
  if (!sharded_) return;
  Backend& be = store_.backend();
  be.copy(m_, flat_slice(full_m_, owned_));
  be.copy(v_, flat_slice(full_v_, owned_));
}

void AdamWOptimizer::release_full_moments() {
  if (!full_m_.defined()) return;
  store_.backend().release(full_m_.data);
  store_.backend().release(full_v_.data);
  full_m_ = full_v_ = Tensor{};
}

void AdamWOptimizer::set_tensor_parallel(DataParallel* tp) {
  tp_ = tp && tp->size() > 1 ? tp : nullptr;
  split_runs_.clear();
  if (!tp_) return;
  for (const ParamInfo& p : store_.layout().params()) {
    if (!p.shard.sharded()) continue;
    if (!split_runs_.empty() && split_runs_.back().end() == p.offset)
      split_runs_.back().count += p.shape.numel();
    else
      split_runs_.push_back({p.offset, p.shape.numel()});
  }
}

double AdamWOptimizer::job_sum_squares(FlatRange range, const std::vector<Backend::LowRankGrad>& low_rank) {
  Backend& be = store_.backend();
  const Tensor grads = store_.flat_grads();
  // [0]: everything in range; [1]: the split parameters' part of it, to be summed over the
  // tensor-parallel group while the replicated rest counts once.
  std::vector<double> local{be.gradient_sum_squares(flat_slice(grads, range), low_rank), 0.0};
  for (const FlatRange& run : split_runs_) {
    const int64_t begin = std::max(run.begin, range.begin), end = std::min(run.end(), range.end());
    if (end > begin) local[1] += be.sum_squares(flat_slice(grads, {begin, end - begin}));
  }
  if (sharded_) dp_->sum(local);  // the data-parallel shards of the buffer
  if (!tp_) return local[0];
  std::vector<double> split{local[1]};
  tp_->sum(split);
  return (local[0] - local[1]) + split[0];
}

StepStats AdamWOptimizer::sharded_step(int64_t step, double lr) {
  Backend& be = store_.backend();
  StepStats s;
  s.lr = lr;
  const Tensor grads = store_.flat_grads(), params = store_.flat_params();
  dp_->reduce_scatter_gradients(grads, sharding_);
  s.grad_norm = std::sqrt(job_sum_squares(owned_, {}));
  if (!std::isfinite(s.grad_norm)) return s;
  const double scale = cfg_.clip_grad > 0 && s.grad_norm > cfg_.clip_grad ? cfg_.clip_grad / s.grad_norm : 1.0;
  be.adamw(flat_slice(params, owned_), flat_slice(grads, owned_), m_, v_,
           Backend::AdamW{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay, scale, step}, {}, {}, {});
  dp_->all_gather_params(params, sharding_);
  store_.params_changed();  // operand copies are made again from the gathered weights
  s.applied = true;
  return s;
}

StepStats AdamWOptimizer::step(int64_t step, double lr, std::span<const Backend::ParamCast> casts) {
  if (sharded_) return sharded_step(step, lr);
  Backend& be = store_.backend();
  if (dp_) dp_->all_reduce_gradients(store_.flat_grads());
  StepStats s;
  s.lr = lr;
  // The per-sample Linears' gradients may be kept as factors (ParamStore::keep_low_rank_grads):
  // the norm and the update read them from there.
  const std::vector<Backend::LowRankGrad> low_rank = store_.low_rank_grads();
  s.grad_norm = std::sqrt(job_sum_squares(FlatRange{0, store_.layout().total()}, low_rank));
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
  s.casts_written = !casts.empty();
  return s;
}

}  // namespace flux8
