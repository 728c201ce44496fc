#include "train/train_step.h"

#include <cmath>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "core/error.h"

namespace flux8 {

const FluxInputs& StepBuffers::upload(const HostBatch& b, const FluxConfig& m, uint64_t seed) {
  if (b.batch != shape_.batch || b.txt_tokens != shape_.txt_tokens || b.img_tokens != shape_.img_tokens)
    allocate(b, m);
  from_host(be_, x0, b.x0);
  from_host(be_, in.img_ids, b.img_ids);
  from_host(be_, in.txt, b.txt);
  from_host(be_, in.txt_ids, b.txt_ids);
  from_host(be_, in.timesteps, b.t);
  from_host(be_, in.y, b.y);
  if (in.guidance.defined()) from_host(be_, in.guidance, b.guidance);
  be_.flow_match_inputs(in.img, target, x0, in.timesteps, seed, b.noise_streams);
  return in;
}

Tensor StepBuffers::make(Shape s) {
  Tensor t(be_.allocate(static_cast<size_t>(s.numel()) * dtype_size(dtype_)), dtype_, s);
  owned_.push_back(t.data);
  return t;
}

void StepBuffers::allocate(const HostBatch& b, const FluxConfig& m) {
  release();
  const int64_t B = b.batch;
  shape_ = StepShape{B, b.txt_tokens, b.img_tokens};
  x0 = make(Shape{B, b.img_tokens, m.in_channels});
  target = make(x0.shape);
  dpred = make(Shape{B, b.img_tokens, m.out_channels});
  in.img = make(x0.shape);
  in.img_ids = make(Shape{B, b.img_tokens, 3});
  in.txt = make(Shape{B, b.txt_tokens, m.context_dim});
  in.txt_ids = make(Shape{B, b.txt_tokens, 3});
  in.timesteps = make(Shape{B});
  in.y = make(Shape{B, m.vec_dim});
  in.guidance = m.guidance_embed ? make(Shape{B}) : Tensor{};
}

Tensor StepBuffers::losses(int64_t n) {
  if (!losses_.defined() || losses_.numel() < n) {
    if (losses_.defined()) be_.release(losses_.data);
    losses_ = Tensor(be_.allocate(static_cast<size_t>(n) * sizeof(double)), DType::f64, Shape{n});
  }
  return Tensor(losses_.data, DType::f64, Shape{n});
}

void StepBuffers::release() {
  for (void* p : owned_) be_.release(p);
  owned_.clear();
}

StepBuffers::~StepBuffers() {
  release();
  if (losses_.defined()) be_.release(losses_.data);
}

StepLoss accumulate_step_gradients(const StepContext& ctx, const std::vector<Sample>& samples,
                                   int64_t micro, uint64_t step) {
  const int64_t global = static_cast<int64_t>(samples.size());
  if (micro < 1 || global % micro) fail("a step of {} samples cannot be split into micro-batches of {}", global, micro);
  Backend& be = ctx.model.backend();
  ctx.model.params().zero_grads();
  StepLoss out;
  const double share = static_cast<double>(micro) / static_cast<double>(global);
  const int64_t parts = global / micro;
  const Tensor losses = ctx.buffers.losses(parts);
  for (int64_t first = 0, part_index = 0; first < global; first += micro, ++part_index) {
    const std::vector<Sample> part(samples.begin() + first, samples.begin() + first + micro);
    HostBatch& hb = ctx.buffers.host;
    make_train_batch(hb, part, ctx.cfg, ctx.obj, ctx.empty, ctx.seed, step, 0, first);
    const FluxInputs& in = ctx.buffers.upload(hb, ctx.cfg, ctx.seed);
    StepGraph::Region region(ctx.graph);
    const Tensor pred = ctx.model.forward(in);
    const Tensor loss(static_cast<double*>(losses.data) + part_index, DType::f64, Shape{1});
    be.mse_loss_into(loss, ctx.buffers.dpred, pred, ctx.buffers.target, share);
    ctx.model.backward(ctx.buffers.dpred);
    region.end();
    out.tokens += hb.batch * (hb.img_tokens + hb.txt_tokens);
  }
  std::vector<double> part_losses(static_cast<size_t>(parts));
  be.download(part_losses.data(), losses.data, part_losses.size() * sizeof(double));
  for (const double l : part_losses) out.loss += share * l;
  return out;
}

StepStats apply_optimizer_step(FluxModel& model, AdamWOptimizer& opt, int64_t step, double lr, bool finite_loss) {
  model.before_optimizer_step();
  const std::vector<Backend::ParamCast> casts = model.weight_casts();
  const StepStats st = finite_loss ? opt.step(step, lr, casts) : StepStats{NAN, lr, false};
  model.after_optimizer_step(st.applied && !casts.empty());
  return st;
}

}  // namespace flux8
