#include "train/batch_pipeline.h"

#include <chrono>
#include <utility>

#include "core/error.h"
#include "core/process_clock.h"

namespace flux8 {

BatchPipeline::BatchPipeline(Backend& be, DataLoader& loader, const BatchPipelineSpec& spec)
    : be_(be), loader_(loader), spec_(spec) {
  if (spec.micro < 1 || spec.global < spec.micro || spec.global % spec.micro)
    fail("a step of {} samples cannot be split into micro-batches of {}", spec.global, spec.micro);
  if (spec.dp_size < 1 || spec.dp_rank < 0 || spec.dp_rank >= spec.dp_size)
    fail("batch pipeline: data-parallel rank {} of {}", spec.dp_rank, spec.dp_size);
  if (spec.global % (spec.micro * spec.dp_size))
    fail(
        "global_batch_size {} cannot be split into {} data-parallel ranks of micro-batches of {} (micro_batch_size); "
        "make it a multiple of {}",
        spec.global, spec.dp_size, spec.micro, spec.micro * spec.dp_size);
  parts_ = spec.global / spec.dp_size / spec.micro;
  end_index_ = spec.end_step > spec.first_step ? (spec.end_step - spec.first_step) * parts_ : 0;
  queue_ = be.make_copy_queue();
  background_ = spec.mode == BatchPipelineSpec::Mode::thread ||
                (spec.mode == BatchPipelineSpec::Mode::automatic && queue_->asynchronous());
  for (Slot& s : slots_) {
    s.buffers = std::make_unique<StepBuffers>(be, DType::f32);
    s.copied = be.make_event();
    s.read = be.make_event();  // waiting for one never recorded waits for nothing
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
  queue_.reset();  // its copies into the slots are done before the slots' buffers go
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
    // The other ranks' samples of the step, before and after this rank's share, are read and
    // dropped: the loader's position after a step is then the same on every rank.
    const int64_t share = spec_.global / spec_.dp_size;
    if (s.part == 0)
      for (int64_t i = 0; i < share * spec_.dp_rank; ++i) loader_.next();
    for (int64_t i = 0; i < spec_.micro; ++i) samples_.push_back(loader_.next());
    if (s.part == parts_ - 1)
      for (int64_t i = 0; i < share * (spec_.dp_size - 1 - spec_.dp_rank); ++i) loader_.next();
    s.loader_after = loader_.state();
    s.timing.read_s = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    HostBatch& host = s.buffers->host;
    make_train_batch(host, samples_, spec_.model, spec_.obj, spec_.empty, spec_.seed, static_cast<uint64_t>(s.step), 0,
                     share * spec_.dp_rank + s.part * spec_.micro);
    s.timing.assemble_s = seconds_since(t0);
    if (s.buffers->holds(host)) {  // else the training thread allocates and uploads
      t0 = std::chrono::steady_clock::now();
      queue_->wait_event(*s.read);
      s.buffers->copy_in(host, [&](void* dst, const void* src, size_t bytes) { queue_->upload(dst, src, bytes); });
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
  StepBuffers& buffers = *s.buffers;
  if (s.state == State::host_ready) {
    // First fill, or a new shape: allocated and copied here, on the backend's own queue (the
    // copy queue may be the producer's right now).
    buffers.reserve(buffers.host, spec_.model);
    const auto t1 = std::chrono::steady_clock::now();
    buffers.copy_in(buffers.host, [&](void* dst, const void* src, size_t bytes) { be_.upload(dst, src, bytes); });
    s.timing.upload_s += seconds_since(t1);
  } else {
    be_.wait_event(*s.copied);
  }
  buffers.draw_noise(buffers.host, spec_.seed);
  {
    std::lock_guard lock(mutex_);
    s.state = State::in_use;
  }
  acquired_ = true;
  s.timing.wait_s = seconds_since(t0);
  return MicroBatch{&buffers.in, buffers.target, buffers.dpred,  &buffers.host,
                    s.step,      s.part,         s.loader_after, s.timing};
}

void BatchPipeline::release() {
  if (!acquired_) fail("batch pipeline: release() without acquire()");
  Slot& s = slots_[consumed_ % 2];
  be_.record_event(*s.read);
  {
    std::lock_guard lock(mutex_);
    s.state = State::free;
    ++consumed_;
    acquired_ = false;
  }
  changed_.notify_all();
}

}  // namespace flux8
