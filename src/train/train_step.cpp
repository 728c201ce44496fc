#include "train/train_step.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "core/error.h"
#include "model/flops.h"
#include "train/batch_pipeline.h"

namespace flux8 {

const FluxInputs& StepBuffers::upload(const HostBatch& b, const FluxConfig& m, uint64_t seed) {
  reserve(b, m);
  copy_in(b, [this](void* dst, const void* src, size_t bytes) { be_.upload(dst, src, bytes); });
  draw_noise(b, seed);
  return in;
}

bool StepBuffers::holds(const HostBatch& b) const {
  return b.batch == shape_.batch && b.txt_tokens == shape_.txt_tokens && b.img_tokens == shape_.img_tokens;
}

void StepBuffers::reserve(const HostBatch& b, const FluxConfig& m) {
  if (!holds(b)) allocate(b, m);
}

void StepBuffers::copy_in(const HostBatch& b, const Copy& copy) {
  // Each vector as it is when its type is the buffers' (f32 batches into f32 buffers), else
  // converted through staging_ (exactly: f32 -> f64, or rounded: f64 -> f32).
  auto put = [&](const Tensor& t, const auto& values, const char* what) {
    using V = typename std::decay_t<decltype(values)>::value_type;
    FLUX8_CHECK(static_cast<int64_t>(values.size()) == t.numel() && (t.dtype == DType::f32 || t.dtype == DType::f64),
                "step buffers: {} values of {} for {}", values.size(), what, t.str());
    if ((t.dtype == DType::f32) == std::is_same_v<V, float>) {
      copy(t.data, values.data(), values.size() * sizeof(V));
      return;
    }
    staging_.resize(values.size() * dtype_size(t.dtype));
    if (t.dtype == DType::f32)
      std::copy(values.begin(), values.end(), reinterpret_cast<float*>(staging_.data()));
    else
      std::copy(values.begin(), values.end(), reinterpret_cast<double*>(staging_.data()));
    copy(t.data, staging_.data(), staging_.size());
  };
  put(x0, b.x0, "x0");
  put(in.img_ids, b.img_ids, "img_ids");
  put(in.txt, b.txt, "txt");
  put(in.txt_ids, b.txt_ids, "txt_ids");
  put(in.timesteps, b.t, "t");
  put(in.y, b.y, "y");
  if (in.guidance.defined()) put(in.guidance, b.guidance, "guidance");
}

void StepBuffers::draw_noise(const HostBatch& b, uint64_t seed) {
  be_.flow_match_inputs(in.img, target, x0, in.timesteps, seed, b.noise_streams);
}

void StepBuffers::allocate(const HostBatch& b, const FluxConfig& m) {
  owned_.release();
  const auto make = [&](Shape s) { return owned_.make(s); };
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
    losses_owned_.release();
    losses_ = losses_owned_.make(Shape{n});
  }
  return Tensor(losses_.data, DType::f64, Shape{n});
}

namespace {
// One micro-batch's forward, loss (into the device f64 `loss`) and backward, in a graph region.
// `last`: the step's last micro-batch, whose backward tells ctx.final_gradients as it goes.
void micro_batch_gradients(const StepContext& ctx, const FluxInputs& in, Tensor target, Tensor dpred, Tensor loss,
                           double share, bool last) {
  StepGraph::Region region(ctx.graph);
  const Tensor pred = ctx.model.forward(in);
  ctx.model.backend().mse_loss_into(loss, dpred, pred, target, share);
  ctx.model.backward(dpred, last ? ctx.final_gradients : nullptr);
  region.end();
}

Tensor loss_of_part(const Tensor& losses, int64_t part) {
  return Tensor(static_cast<double*>(losses.data) + part, DType::f64, Shape{1});
}

// The step's mean loss: the parts' losses read once, after the last backward was queued.
double step_loss(Backend& be, const Tensor& losses, int64_t parts, double share) {
  std::vector<double> part_losses(static_cast<size_t>(parts));
  be.download(part_losses.data(), losses.data, part_losses.size() * sizeof(double));
  double loss = 0;
  for (const double l : part_losses) loss += share * l;
  return loss;
}
}  // namespace

namespace {
// A micro-batch's tokens and model FLOPs, added to its step's.
void count_micro_batch(StepLoss& step, const HostBatch& hb, const FluxConfig& cfg) {
  step.tokens += hb.batch * (hb.img_tokens + hb.txt_tokens);
  step.model_flops += model_flops(cfg, StepShape{hb.batch, hb.txt_tokens, hb.img_tokens}).training();
}
}  // namespace

StepLoss accumulate_step_gradients(const StepContext& ctx, const std::vector<Sample>& samples, int64_t micro,
                                   uint64_t step, int64_t first_index, int64_t global_samples) {
  const int64_t local = static_cast<int64_t>(samples.size());
  const int64_t global = global_samples > 0 ? global_samples : local;
  if (micro < 1 || local % micro) fail("a step of {} samples cannot be split into micro-batches of {}", local, micro);
  ctx.model.params().zero_grads();
  StepLoss out;
  const double share = static_cast<double>(micro) / static_cast<double>(global);
  const int64_t parts = local / micro;
  const Tensor losses = ctx.buffers.losses(parts);
  for (int64_t first = 0, part_index = 0; first < local; first += micro, ++part_index) {
    const std::vector<Sample> part(samples.begin() + first, samples.begin() + first + micro);
    HostBatch& hb = ctx.buffers.host;
    make_train_batch(hb, part, ctx.cfg, ctx.obj, ctx.empty, ctx.seed, step, 0, first_index + first);
    const FluxInputs& in = ctx.buffers.upload(hb, ctx.cfg, ctx.seed);
    micro_batch_gradients(ctx, in, ctx.buffers.target, ctx.buffers.dpred, loss_of_part(losses, part_index), share,
                          part_index == parts - 1);
    count_micro_batch(out, hb, ctx.cfg);
  }
  if (ctx.data_parallel) ctx.data_parallel->all_reduce(losses);
  out.loss = step_loss(ctx.model.backend(), losses, parts, share);
  return out;
}

StepLoss accumulate_step_gradients(const StepContext& ctx, BatchPipeline& pipeline, int64_t step,
                                   LoaderState* loader_after) {
  const BatchPipelineSpec& spec = pipeline.spec();
  ctx.model.params().zero_grads();
  StepLoss out;
  // Each part's loss gradient is scaled by its share of the whole step (all ranks): the sum of
  // the ranks' gradients is the gradient of the step's mean loss.
  const double share = static_cast<double>(spec.micro) / static_cast<double>(spec.global);
  const int64_t parts = pipeline.parts();
  const Tensor losses = ctx.buffers.losses(parts);
  for (int64_t part = 0; part < parts; ++part) {
    const BatchPipeline::MicroBatch mb = pipeline.acquire();
    FLUX8_CHECK(mb.step == step && mb.part == part, "batch pipeline: micro-batch {} of step {} where {} of {} was due",
                mb.part, mb.step, part, step);
    const HostBatch& hb = *mb.host;  // the slot's: read before release() lets it be refilled
    count_micro_batch(out, hb, ctx.cfg);
    out.data += mb.timing;
    micro_batch_gradients(ctx, *mb.in, mb.target, mb.dpred, loss_of_part(losses, part), share, part == parts - 1);
    pipeline.release();
    if (loader_after) *loader_after = mb.loader_after;
  }
  // Every rank's parts' losses, summed part by part over the ranks: the step's loss is then the
  // same on every rank.
  if (ctx.data_parallel) ctx.data_parallel->all_reduce(losses);
  out.loss = step_loss(ctx.model.backend(), losses, parts, share);
  return out;
}

StepStats apply_optimizer_step(FluxModel& model, AdamWOptimizer& opt, int64_t step, double lr, bool finite_loss) {
  model.before_optimizer_step();
  const std::vector<Backend::ParamCast> casts = model.weight_casts();
  const StepStats st = finite_loss ? opt.step(step, lr, casts) : StepStats{NAN, lr, false};
  model.after_optimizer_step(st.applied && st.casts_written, st.applied);
  return st;
}

}  // namespace flux8
