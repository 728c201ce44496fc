#include "train/async_checkpoint.h"

#include <fmt/core.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <utility>

#include "core/error.h"
#include "core/process_clock.h"

namespace flux8 {

namespace fs = std::filesystem;

std::optional<uint64_t> host_memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string key, unit;
    uint64_t kib = 0;
    if (fields >> key >> kib >> unit && key == "MemAvailable:" && unit == "kB") return kib * 1024;
  }
  return std::nullopt;
}

bool AsyncCheckpointer::fits(uint64_t bytes, std::optional<uint64_t> available) {
  return !available || bytes <= *available / 2;
}

AsyncCheckpointer::AsyncCheckpointer(std::string root, int keep_last) : root_(std::move(root)), keep_last_(keep_last) {}

AsyncCheckpointer::~AsyncCheckpointer() {
  if (preparing_.valid()) preparing_.wait();
  if (!pending_.valid()) return;
  try {
    pending_.get();
  } catch (const std::exception& e) {  // nobody is left to report it to: the log says it
    std::cerr << fmt::format("flux8: warning: the checkpoint of step {} written in the background failed: {}\n",
                             pending_step_, e.what());
  }
}

AsyncCheckpointer::Finished AsyncCheckpointer::collect() {
  const int64_t step = pending_step_;
  pending_step_ = -1;
  try {
    return pending_.get();  // leaves pending_ invalid
  } catch (const std::exception& e) {
    fail("checkpoint of step {} (written in the background, async_save): {}", step, e.what());
  }
}

void AsyncCheckpointer::prepare(const ParamStore& store, const Tensor& adam_m, const Tensor& adam_v) {
  FLUX8_CHECK(!preparing_.valid() && !pending_.valid(), "AsyncCheckpointer::prepare after a save started");
  preparing_ =
      std::async(std::launch::async, [this, &store, m = adam_m, v = adam_v] { snapshot_.reserve(store, m, v); });
}

void AsyncCheckpointer::prepare(const ParamStore& store, DType moment_dtype) {
  FLUX8_CHECK(!preparing_.valid() && !pending_.valid(), "AsyncCheckpointer::prepare after a save started");
  preparing_ = std::async(std::launch::async, [this, &store, moment_dtype] { snapshot_.reserve(store, moment_dtype); });
}

std::optional<AsyncCheckpointer::Finished> AsyncCheckpointer::poll() {
  if (!pending_.valid() || pending_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return std::nullopt;
  return collect();
}

std::optional<AsyncCheckpointer::Finished> AsyncCheckpointer::wait() {
  if (!pending_.valid()) return std::nullopt;
  return collect();
}

AsyncCheckpointer::Started AsyncCheckpointer::start(const TrainerState& state, const ParamStore& store,
                                                    const Tensor& adam_m, const Tensor& adam_v,
                                                    const Fp8MetaRegistry* fp8) {
  return start(state, store, CheckpointFlats::of(store, adam_m, adam_v), fp8);
}

AsyncCheckpointer::Started AsyncCheckpointer::start(const TrainerState& state, const ParamStore& store,
                                                    const CheckpointFlats& flats, const Fp8MetaRegistry* fp8) {
  Started s;
  const auto t0 = std::chrono::steady_clock::now();
  if (preparing_.valid()) preparing_.get();  // throws what the allocation threw
  if (pending_.valid()) s.previous = collect();
  s.wait_seconds = seconds_since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  snapshot_.take(state, store, flats, fp8);
  s.snapshot_seconds = seconds_since(t1);
  s.snapshot_bytes = snapshot_.bytes();
  s.dir = (fs::path(root_) / checkpoint_dir_name(state.step)).string();
  pending_step_ = state.step;
  pending_ = std::async(std::launch::async, [this] {
    const auto t = std::chrono::steady_clock::now();
    Finished f;
    f.step = snapshot_.step();
    f.dir = snapshot_.write(root_, keep_last_);
    f.write_seconds = seconds_since(t);
    f.bytes = checkpoint_bytes(f.dir);
    return f;
  });
  return s;
}

}  // namespace flux8
