// seconds_since_process_start: the launch-to-first-step clock of `flux8 bench` and the trainer.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/process_clock.h"

namespace flux8 {
namespace {

// The process started before this test (its runner loaded, gtest initialised), so the clock is
// positive, advances with the wall clock, and is far from a bogus reading (boot time, or 0).
TEST(ProcessClock, CountsFromTheProcessStart) {
  const double a = seconds_since_process_start();
  EXPECT_GT(a, 0.0);
  EXPECT_LT(a, 24 * 3600.0) << "reads like seconds since boot, not since the process started";
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  const double b = seconds_since_process_start();
  EXPECT_GE(b - a, 0.04);  // the tick resolution (10 ms) does not affect differences of now
  EXPECT_LT(b - a, 5.0);
}

}  // namespace
}  // namespace flux8
