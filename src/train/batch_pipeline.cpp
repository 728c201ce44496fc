#include "train/batch_pipeline.h"

#include <chrono>
#include <utility>

#include "backend/transfer.h"
#include "core/error.h"

namespace flux8 {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool same_shape(const StepShape& s, const HostBatch& b) {
  return s.batch == b.batch && s.txt_tokens == b.txt_tokens && s.img_tokens == b.img_tokens;
}
}  // namespace

BatchPipeline::BatchPipeline(Backend& be, DataLoader& loader, const BatchPipelineSpec& spec)
    : be_(be), loader_(loader), spec_(spec) {
  if (spec.micro < 1 || spec.global < spec.micro || spec.global % spec.micro)
    fail("a step of {} samples cannot be split into micro-batches of {}", spec.global, spec.micro);
  parts_ = spec.global / spec.micro;
  end_index_ = spec.end_step > spec.first_step ? (spec.end_step - spec.first_step) * parts_ : 0;
  queue_ = be.make_copy_queue();
  background_ = spec.mode == BatchPipelineSpec::Mode::thread ||
                (spec.mode == BatchPipelineSpec::Mode::automatic && queue_->asynchronous());
  for (Slot& s : slots_) {
    s.copied = be.make_event();
    s.read = be.make_event();
  }
  if (background_) producer_ = std::thread([this] { run(); });
}

BatchPipeline::~BatchPipeline() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (producer_.joinable()) producer_.join();
  queue_.reset();  // its copies into the slots are done
  for (Slot& s : slots_) release_slot(s);
  for (void* p : shared_owned_) be_.release(p);
}

void BatchPipeline::run() {
  for (int64_t index = 0; index < end_index_; ++index) {
    Slot& s = slots_[index % 2];
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return stopping_ || s.state == State::free; });
      if (stopping_) return;
      s.state = State::filling;
    }
    produce(s, index);  // publishes s.state under the lock
    const bool failed = static_cast<bool>(s.error);
    changed_.notify_all();
    if (failed) return;  // acquire() rethrows it; nothing after it is built
  }
}

void BatchPipeline::produce(Slot& s, int64_t index) {
  s.step = spec_.first_step + index / parts_;
  s.part = index % parts_;
  State next = State::host_ready;
  s.timing = DataTiming{};
  try {
    auto t0 = std::chrono::steady_clock::now();
    samples_.clear();
    for (int64_t i = 0; i < spec_.micro; ++i) samples_.push_back(loader_.next());
    s.loader_after = loader_.state();
    s.timing.read_s = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    make_train_batch(s.host, samples_, spec_.model, spec_.obj, spec_.empty, spec_.seed, static_cast<uint64_t>(s.step),
                     0, s.part * spec_.micro);
    s.timing.assemble_s = seconds_since(t0);
    if (same_shape(s.shape, s.host)) {  // else the training thread allocates and uploads
      t0 = std::chrono::steady_clock::now();
      if (s.read_recorded) queue_->wait_event(*s.read);
      upload(s, [&](void* dst, const void* src, size_t bytes) { queue_->upload(dst, src, bytes); });
      queue_->record_event(*s.copied);
      s.timing.upload_s = seconds_since(t0);
      next = State::ready;
    }
  } catch (...) {
    s.error = std::current_exception();
  }
  std::lock_guard lock(mutex_);
  s.state = next;
}

void BatchPipeline::upload(Slot& s, const Copy& copy) {
  const HostBatch& b = s.host;
  auto put = [&](const Tensor& t, const float* values, size_t count, const char* what) {
    FLUX8_CHECK(t.dtype == DType::f32 && static_cast<int64_t>(count) == t.numel(),
                "batch pipeline: {} values of {} for {}", count, what, t.str());
    copy(t.data, values, count * sizeof(float));
  };
  auto put_doubles = [&](const Tensor& t, const std::vector<double>& values, const char* what) {
    s.small.assign(values.begin(), values.end());
    put(t, s.small.data(), s.small.size(), what);
  };
  put(s.x0, b.x0.data(), b.x0.size(), "x0");
  put(s.in.txt, b.txt.data(), b.txt.size(), "txt");
  put(s.in.y, b.y.data(), b.y.size(), "y");
  put_doubles(s.in.img_ids, b.img_ids, "img_ids");
  put_doubles(s.in.txt_ids, b.txt_ids, "txt_ids");
  put_doubles(s.in.timesteps, b.t, "t");
  if (s.in.guidance.defined()) put_doubles(s.in.guidance, b.guidance, "guidance");
}

void BatchPipeline::allocate(Slot& s) {
  release_slot(s);
  const HostBatch& b = s.host;
  const FluxConfig& m = spec_.model;
  auto make = [&](Shape shape) {
    Tensor t(be_.allocate(static_cast<size_t>(shape.numel()) * sizeof(float)), DType::f32, shape);
    s.owned.push_back(t.data);
    return t;
  };
  const int64_t B = b.batch;
  s.x0 = make(Shape{B, b.img_tokens, m.in_channels});
  s.in.img_ids = make(Shape{B, b.img_tokens, 3});
  s.in.txt = make(Shape{B, b.txt_tokens, m.context_dim});
  s.in.txt_ids = make(Shape{B, b.txt_tokens, 3});
  s.in.timesteps = make(Shape{B});
  s.in.y = make(Shape{B, m.vec_dim});
  s.in.guidance = m.guidance_embed ? make(Shape{B}) : Tensor{};
  s.shape = StepShape{B, b.txt_tokens, b.img_tokens};
}

void BatchPipeline::release_slot(Slot& s) {
  for (void* p : s.owned) be_.release(p);
  s.owned.clear();
  s.shape = StepShape{0, 0, 0};
  s.read_recorded = false;
}

void BatchPipeline::ensure_shared(const HostBatch& b) {
  if (same_shape(shared_shape_, b)) return;
  for (void* p : shared_owned_) be_.release(p);
  shared_owned_.clear();
  auto make = [&](Shape shape) {
    Tensor t(be_.allocate(static_cast<size_t>(shape.numel()) * sizeof(float)), DType::f32, shape);
    shared_owned_.push_back(t.data);
    return t;
  };
  xt_ = make(Shape{b.batch, b.img_tokens, spec_.model.in_channels});
  target_ = make(xt_.shape);
  dpred_ = make(Shape{b.batch, b.img_tokens, spec_.model.out_channels});
  shared_shape_ = StepShape{b.batch, b.txt_tokens, b.img_tokens};
}

BatchPipeline::MicroBatch BatchPipeline::acquire() {
  if (error_) std::rethrow_exception(error_);
  if (acquired_) fail("batch pipeline: acquire() twice without release()");
  if (consumed_ >= end_index_)
    fail("batch pipeline: no micro-batch after step {} (the run ends there)", spec_.end_step);
  Slot& s = slots_[consumed_ % 2];
  const auto t0 = std::chrono::steady_clock::now();
  if (background_) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return s.state == State::host_ready || s.state == State::ready; });
  } else {
    s.state = State::filling;
    produce(s, consumed_);
  }
  if (s.error) {
    error_ = s.error;
    std::rethrow_exception(error_);
  }
  if (s.state == State::host_ready) {
    // First fill, or a new shape: allocated and copied here, on the backend's own queue (the
    // copy queue may be the producer's right now).
    allocate(s);
    const auto t1 = std::chrono::steady_clock::now();
    upload(s, [&](void* dst, const void* src, size_t bytes) { be_.upload(dst, src, bytes); });
    s.timing.upload_s += seconds_since(t1);
  } else {
    be_.wait_event(*s.copied);
  }
  ensure_shared(s.host);
  in_ = s.in;
  in_.img = xt_;
  be_.flow_match_inputs(xt_, target_, s.x0, s.in.timesteps, spec_.seed, s.host.noise_streams);
  {
    std::lock_guard lock(mutex_);
    s.state = State::in_use;
  }
  acquired_ = true;
  s.timing.wait_s = seconds_since(t0);
  return MicroBatch{&in_, target_, dpred_, &s.host, s.step, s.part, s.loader_after, s.timing};
}

void BatchPipeline::release() {
  if (!acquired_) fail("batch pipeline: release() without acquire()");
  Slot& s = slots_[consumed_ % 2];
  be_.record_event(*s.read);
  s.read_recorded = true;
  {
    std::lock_guard lock(mutex_);
    s.state = State::free;
    ++consumed_;
    acquired_ = false;
  }
  changed_.notify_all();
}

}  // namespace flux8
