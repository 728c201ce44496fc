#include "dist/watchdog.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <string_view>
#include <utility>

#include "core/error.h"
#include "dist/mpi_runtime.h"

namespace flux8 {

namespace {

using Clock = std::chrono::steady_clock;

// At most twice a second (a quarter of a short timeout): a stall is seen within half a second of
// the timeout, at no measurable cost.
constexpr auto kPollInterval = std::chrono::milliseconds(500);
// A queue's abort (ncclCommAbort) may itself block on a broken peer: the job ends regardless.
constexpr auto kAbortBound = std::chrono::seconds(10);

double seconds(std::chrono::milliseconds ms) { return static_cast<double>(ms.count()) / 1000.0; }

// A host communicator's collectives, each a host wait while it runs.
class WatchedCommunicator final : public Communicator {
 public:
  WatchedCommunicator(std::unique_ptr<Communicator> inner, CollectiveWatchdog& dog)
      : inner_(std::move(inner)), dog_(dog) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string describe() const override { return inner_->describe(); }
  void all_reduce(const Tensor& t, ReduceOp op, bool async) override {
    const auto wait = watch("all_reduce");
    inner_->all_reduce(t, op, async);
  }
  void reduce_scatter(const Tensor& out, const Tensor& in, bool async) override {
    const auto wait = watch("reduce_scatter");
    inner_->reduce_scatter(out, in, async);
  }
  void reduce(const Tensor& t, int root, bool async) override {
    const auto wait = watch("reduce");
    inner_->reduce(t, root, async);
  }
  void all_gather(const Tensor& out, const Tensor& in, bool async) override {
    const auto wait = watch("all_gather");
    inner_->all_gather(out, in, async);
  }
  void broadcast(const Tensor& t, int root) override {
    const auto wait = watch("broadcast");
    inner_->broadcast(t, root);
  }
  void join() override {
    const auto wait = watch("join");
    inner_->join();
  }
  void barrier() override {
    const auto wait = watch("barrier");
    inner_->barrier();
  }

 private:
  CollectiveWatchdog::HostWait watch(std::string_view collective) {
    return dog_.host_wait(fmt::format("{} on {}", collective, inner_->describe()));
  }
  std::unique_ptr<Communicator> inner_;
  CollectiveWatchdog& dog_;
};

}  // namespace

std::chrono::milliseconds collective_timeout(double distributed_timeout_minutes) {
  if (const char* e = std::getenv("FLUX8_COLLECTIVE_TIMEOUT_S"); e && *e) {
    char* end = nullptr;
    const double s = std::strtod(e, &end);
    if (end == e || *end != '\0' || !(s > 0) || s > 1e7)
      fail(
          "FLUX8_COLLECTIVE_TIMEOUT_S={}: expected a positive number of seconds (or unset it to use the config's "
          "distributed_timeout_minutes)",
          e);
    return std::chrono::milliseconds(static_cast<int64_t>(s * 1000.0));
  }
  if (!(distributed_timeout_minutes > 0) || distributed_timeout_minutes > 1e5)
    fail("distributed_timeout_minutes: {} is not a positive number of minutes", distributed_timeout_minutes);
  return std::chrono::milliseconds(static_cast<int64_t>(distributed_timeout_minutes * 60000.0));
}

CollectiveWatchdog::CollectiveWatchdog(std::chrono::milliseconds timeout, EndJob end)
    : timeout_ms_(timeout.count()), end_(std::move(end)) {
  if (!end_) end_ = [](const std::string& message) { abort_job(message, 1); };
  thread_ = std::thread([this] { run(); });
}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void CollectiveWatchdog::set_timeout(std::chrono::milliseconds timeout) { timeout_ms_ = timeout.count(); }

CollectiveWatchdog::HostWait CollectiveWatchdog::host_wait(std::string what) {
  std::lock_guard lock(mutex_);
  const uint64_t id = next_id_++;
  host_waits_.push_back(HostEntry{id, std::move(what), Clock::now()});
  return HostWait(this, id);
}

CollectiveWatchdog::HostWait::~HostWait() {
  if (dog_) dog_->finish_host_wait(id_);
}

void CollectiveWatchdog::finish_host_wait(uint64_t id) {
  std::lock_guard lock(mutex_);
  std::erase_if(host_waits_, [id](const HostEntry& e) { return e.id == id; });
}

void CollectiveWatchdog::watch(WatchedQueue* queue) {
  std::lock_guard lock(mutex_);
  queues_.push_back(queue);
}

void CollectiveWatchdog::unwatch(WatchedQueue* queue) {
  std::lock_guard lock(mutex_);
  std::erase(queues_, queue);
}

std::string CollectiveWatchdog::check(Clock::time_point now, std::vector<WatchedQueue*>& to_abort) {
  const auto limit = timeout();
  const auto stalled = [&](std::string_view what, Clock::time_point since) {
    return fmt::format(
        "{} has waited {:.1f} s for the other ranks, longer than the collective timeout of {:g} s "
        "(distributed_timeout_minutes; FLUX8_COLLECTIVE_TIMEOUT_S overrides it): a rank of the group died or "
        "hangs; ending the job",
        what, std::chrono::duration<double>(now - since).count(), seconds(limit));
  };
  for (const HostEntry& e : host_waits_)
    if (now - e.since > limit) {
      to_abort = queues_;
      return stalled(e.what, e.since);
    }
  for (WatchedQueue* q : queues_) {
    if (std::string why = q->failure(); !why.empty()) {
      to_abort = queues_;
      return why + "; ending the job";
    }
    if (const auto pending = q->oldest_pending(); pending && now - pending->since > limit) {
      to_abort = queues_;
      return stalled(pending->what, pending->since);
    }
  }
  return "";
}

void CollectiveWatchdog::run() {
  std::unique_lock lock(mutex_);
  while (!stopping_ && !fired_) {
    const auto interval = std::clamp(timeout() / 4, std::chrono::milliseconds(10),
                                     std::chrono::duration_cast<std::chrono::milliseconds>(kPollInterval));
    wake_.wait_for(lock, interval, [this] { return stopping_; });
    if (stopping_) break;
    std::vector<WatchedQueue*> to_abort;
    const std::string message = check(Clock::now(), to_abort);
    if (message.empty()) continue;
    fired_ = true;
    lock.unlock();
    // The device's queues are stopped so that their kernels let the process go; on a thread of its
    // own, as a broken peer may hold an abort up too.
    auto done = std::make_shared<std::promise<void>>();
    std::future<void> aborted = done->get_future();
    std::thread([to_abort, done] {
      for (WatchedQueue* q : to_abort) q->abort();
      done->set_value();
    }).detach();
    aborted.wait_for(kAbortBound);
    end_(message);
    return;
  }
}

CollectiveWatchdog& collective_watchdog() {
  static CollectiveWatchdog dog(collective_timeout(10.0));
  return dog;
}

std::unique_ptr<Communicator> watch_host_collectives(std::unique_ptr<Communicator> host, CollectiveWatchdog& watchdog) {
  return std::make_unique<WatchedCommunicator>(std::move(host), watchdog);
}

}  // namespace flux8
