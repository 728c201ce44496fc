#pragma once
// Bounded collective waits: a rank that dies or hangs must end the job, not leave the others
// waiting forever. Every collective in flight is known to the process's watchdog — a host
// collective (MPI) from its start to its return, a device collective (NCCL) from its enqueue until
// its completion event fires — and a thread of the watchdog's own checks them twice a second. One
// that has waited longer than the collective timeout, or a device queue that reports an error,
// ends the job with a message naming the waiting rank, the group and the collective.
//
// The job ends through abort_job (dist/mpi_runtime.h: MPI_Abort, after which the launcher stops
// every rank): a hung rank cannot be relied on to unwind.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backend/communicator.h"

namespace flux8 {

// The collective timeout: FLUX8_COLLECTIVE_TIMEOUT_S (seconds, for tests) when set, else the
// config's distributed_timeout_minutes. Fails naming the variable when it is not a positive number.
std::chrono::milliseconds collective_timeout(double distributed_timeout_minutes);

// A queue of device collectives (one NCCL communicator), polled from the watchdog's thread.
class WatchedQueue {
 public:
  struct Pending {
    std::string what;  // "all_reduce on nccl data-parallel (rank 1 of 2)"
    std::chrono::steady_clock::time_point since;
  };
  virtual ~WatchedQueue() = default;
  // Forgets what has completed and returns the oldest collective still in flight, if any.
  virtual std::optional<Pending> oldest_pending() = 0;
  // "" while healthy, else the queue's own error (NCCL's asynchronous error), naming its group.
  virtual std::string failure() = 0;
  // Stops the queue's work so that the device can be released (ncclCommAbort). Called once,
  // from the watchdog's thread, before the job ends.
  virtual void abort() = 0;
};

class CollectiveWatchdog {
 public:
  // What ends the job; the default is abort_job. Tests pass one that records the message.
  using EndJob = std::function<void(const std::string& message)>;
  explicit CollectiveWatchdog(std::chrono::milliseconds timeout, EndJob end = {});
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(timeout_ms_.load()); }
  void set_timeout(std::chrono::milliseconds timeout);

  // A host collective in flight for the lifetime of the returned guard.
  class HostWait {
   public:
    HostWait(HostWait&& o) noexcept : dog_(o.dog_), id_(o.id_) { o.dog_ = nullptr; }
    HostWait(const HostWait&) = delete;
    HostWait& operator=(const HostWait&) = delete;
    HostWait& operator=(HostWait&&) = delete;
    ~HostWait();

   private:
    friend class CollectiveWatchdog;
    HostWait(CollectiveWatchdog* dog, uint64_t id) : dog_(dog), id_(id) {}
    CollectiveWatchdog* dog_;
    uint64_t id_;
  };
  // `what`: the collective, its group and this rank in it ("all_reduce on mpi tensor-parallel
  // (rank 0 of 2)").
  [[nodiscard]] HostWait host_wait(std::string what);

  // Device queues polled until unwatched; unwatch before destroying the queue.
  void watch(WatchedQueue* queue);
  void unwatch(WatchedQueue* queue);

 private:
  void run();
  // The message that ends the job, or "" while every wait is within the timeout.
  std::string check(std::chrono::steady_clock::time_point now, std::vector<WatchedQueue*>& to_abort);
  void finish_host_wait(uint64_t id);

  struct HostEntry {
    uint64_t id;
    std::string what;
    std::chrono::steady_clock::time_point since;
  };
  std::atomic<int64_t> timeout_ms_;
  EndJob end_;
  std::mutex mutex_;
  std::vector<HostEntry> host_waits_;
  std::vector<WatchedQueue*> queues_;
  uint64_t next_id_ = 0;
  bool stopping_ = false;
  bool fired_ = false;
  std::condition_variable wake_;
  std::thread thread_;
};

// The process's watchdog, which the communicators of a job share; made at the first call with
// collective_timeout(10) (Megatron's default distributed_timeout_minutes) until the job sets its
// own with set_timeout.
CollectiveWatchdog& collective_watchdog();

// `host` (a communicator whose collectives are done when they return: MPI) with each collective a
// host wait of `watchdog` from its call to its return.
std::unique_ptr<Communicator> watch_host_collectives(std::unique_ptr<Communicator> host, CollectiveWatchdog& watchdog);

}  // namespace flux8
