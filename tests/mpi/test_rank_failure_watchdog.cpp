// The collective watchdog on its own (dist/watchdog.h): what it reports and when, with an end of the
// job that records the message instead of ending the process.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "backend/communicator.h"
#include "core/error.h"
#include "dist/watchdog.h"

namespace flux8::testing {

namespace {

using namespace std::chrono_literals;

// The message the watchdog ended the job with, once it has.
struct Ending {
  std::mutex mutex;
  std::optional<std::string> message;
  CollectiveWatchdog::EndJob recorder() {
    return [this](const std::string& m) {
      std::lock_guard lock(mutex);
      message = m;
    };
  }
  std::optional<std::string> wait(std::chrono::milliseconds at_most) {
    const auto until = std::chrono::steady_clock::now() + at_most;
    while (std::chrono::steady_clock::now() < until) {
      {
        std::lock_guard lock(mutex);
        if (message) return message;
      }
      std::this_thread::sleep_for(5ms);
    }
    std::lock_guard lock(mutex);
    return message;
  }
};

// A queue whose state the test sets (under its lock: the watchdog's thread reads it).
struct FakeQueue final : WatchedQueue {
  std::mutex mutex;
  std::optional<Pending> pending;
  std::string error;
  std::atomic<int> aborts{0};
  std::optional<Pending> oldest_pending() override {
    std::lock_guard lock(mutex);
    return pending;
  }
  std::string failure() override {
    std::lock_guard lock(mutex);
    return error;
  }
  void fail_with(std::string e) {
    std::lock_guard lock(mutex);
    error = std::move(e);
  }
  void abort() override { ++aborts; }
};

}  // namespace

TEST(CollectiveWatchdog, AHostWaitPastTheTimeoutEndsTheJobNamingIt) {
  Ending ending;
  CollectiveWatchdog dog(100ms, ending.recorder());
  const auto wait = dog.host_wait("all_reduce on mpi data-parallel (rank 1 of 2)");
  const std::optional<std::string> m = ending.wait(5000ms);
  ASSERT_TRUE(m) << "a wait of 5 s against a timeout of 0.1 s was not reported";
  EXPECT_NE(m->find("all_reduce on mpi data-parallel (rank 1 of 2)"), std::string::npos) << *m;
  EXPECT_NE(m->find("collective timeout of 0.1 s"), std::string::npos) << *m;
  EXPECT_NE(m->find("distributed_timeout_minutes"), std::string::npos) << *m;
}

TEST(CollectiveWatchdog, WaitsWithinTheTimeoutEndNothing) {
  Ending ending;
  CollectiveWatchdog dog(300ms, ending.recorder());
  for (int i = 0; i < 20; ++i) {
    const auto wait = dog.host_wait("barrier on mpi world (rank 0 of 1)");
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_FALSE(ending.wait(600ms)) << *ending.message;
}

TEST(CollectiveWatchdog, AStalledDeviceQueueIsAbortedAndNamed) {
  Ending ending;
  FakeQueue queue;
  queue.pending =
      WatchedQueue::Pending{"reduce_scatter on nccl data-parallel (rank 3 of 4)", std::chrono::steady_clock::now()};
  CollectiveWatchdog dog(100ms, ending.recorder());
  dog.watch(&queue);
  const std::optional<std::string> m = ending.wait(5000ms);
  ASSERT_TRUE(m);
  EXPECT_NE(m->find("reduce_scatter on nccl data-parallel (rank 3 of 4)"), std::string::npos) << *m;
  EXPECT_EQ(queue.aborts.load(), 1);
  dog.unwatch(&queue);
}

TEST(CollectiveWatchdog, AQueueErrorEndsTheJobAtOnce) {
  Ending ending;
  FakeQueue queue;
  CollectiveWatchdog dog(std::chrono::minutes(10), ending.recorder());
  dog.watch(&queue);
  EXPECT_FALSE(ending.wait(100ms));  // healthy and idle
  queue.fail_with(
      "nccl tensor-parallel (rank 0 of 2): NCCL reports remote process exited or there was a network error");
  // A ten-minute timeout polls twice a second.
  const std::optional<std::string> m = ending.wait(3000ms);
  ASSERT_TRUE(m);
  EXPECT_NE(m->find("nccl tensor-parallel (rank 0 of 2): NCCL reports"), std::string::npos) << *m;
  EXPECT_EQ(queue.aborts.load(), 1);
  dog.unwatch(&queue);
}

// A host communicator whose all-reduce takes as long as the test says (and does nothing else).
class SlowCommunicator final : public Communicator {
 public:
  explicit SlowCommunicator(std::chrono::milliseconds takes) : takes_(takes) {}
  int rank() const override { return 1; }
  int size() const override { return 2; }
  std::string describe() const override { return "data-parallel group (MPI, rank 1 of 2)"; }
  void all_reduce(const Tensor&, ReduceOp, bool) override { std::this_thread::sleep_for(takes_); }
  void reduce_scatter(const Tensor&, const Tensor&, bool) override {}
  void reduce(const Tensor&, int, bool) override {}
  void all_gather(const Tensor&, const Tensor&, bool) override {}
  void broadcast(const Tensor&, int) override {}
  void barrier() override {}

 private:
  std::chrono::milliseconds takes_;
};

TEST(CollectiveWatchdog, WatchesEachCollectiveOfAHostCommunicator) {
  Ending ending;
  CollectiveWatchdog dog(200ms, ending.recorder());
  auto quick = watch_host_collectives(std::make_unique<SlowCommunicator>(10ms), dog);
  for (int i = 0; i < 10; ++i) quick->all_reduce(Tensor());
  EXPECT_EQ(quick->describe(), "data-parallel group (MPI, rank 1 of 2)");
  EXPECT_FALSE(ending.wait(300ms)) << *ending.message;
  auto slow = watch_host_collectives(std::make_unique<SlowCommunicator>(1500ms), dog);
  slow->all_reduce(Tensor());
  const std::optional<std::string> m = ending.wait(100ms);
  ASSERT_TRUE(m) << "an all-reduce of 1.5 s against a timeout of 0.2 s was not reported";
  EXPECT_NE(m->find("all_reduce on data-parallel group (MPI, rank 1 of 2) has waited"), std::string::npos) << *m;
}

TEST(CollectiveWatchdog, TimeoutFromTheConfigOrTheEnvironment) {
  const char* saved = std::getenv("FLUX8_COLLECTIVE_TIMEOUT_S");
  const std::string restore = saved ? saved : "";
  unsetenv("FLUX8_COLLECTIVE_TIMEOUT_S");
  EXPECT_EQ(collective_timeout(10.0), std::chrono::minutes(10));
  EXPECT_EQ(collective_timeout(0.5), 30s);
  EXPECT_THROW(collective_timeout(0.0), Error);
  setenv("FLUX8_COLLECTIVE_TIMEOUT_S", "2.5", 1);
  EXPECT_EQ(collective_timeout(10.0), 2500ms);
  setenv("FLUX8_COLLECTIVE_TIMEOUT_S", "soon", 1);
  try {
    collective_timeout(10.0);
    ADD_FAILURE() << "FLUX8_COLLECTIVE_TIMEOUT_S=soon was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("FLUX8_COLLECTIVE_TIMEOUT_S=soon"), std::string::npos) << e.what();
  }
  if (saved)
    setenv("FLUX8_COLLECTIVE_TIMEOUT_S", restore.c_str(), 1);
  else
    unsetenv("FLUX8_COLLECTIVE_TIMEOUT_S");
}

}  // namespace flux8::testing
