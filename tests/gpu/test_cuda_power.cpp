// The CUDA backend's energy counter (NVML, loaded at run time: backend/cuda/nvml.h) on the GPU
// machine: a reading is available wherever a usable GPU is (NVML ships with every driver), the
// counter moves forward while the GPU works, and the limit and clock are plausible numbers.
#include <gtest/gtest.h>

#include "gpu_test_util.h"

namespace flux8::testing {
namespace {

TEST(CudaPower, EnergyCounterMovesWhileTheGpuWorks) {
  FLUX8_REQUIRE_GPU();
  Backend& be = gpu_bf16_activations();
  const PowerReading before = be.power_reading();
  ASSERT_TRUE(before.available) << before.why;
  EXPECT_GT(before.power_limit_w, 50.0);
  EXPECT_LT(before.power_limit_w, 2000.0);
  // ~0.5 s of 4096 x 4096 x 4096 bf16 GEMMs (~0.2 ms each on an H200).
  Bf16Pair x({4096, 4096}), y({4096, 4096});
  Pair w({4096, 4096});
  x.randn(1), w.randn(2, 0.02);
  PowerReading busy;
  for (int i = 0; i < 2500; ++i) {
    be.linear(y.dev, x.dev, w.dev, Tensor{});
    if (i == 2000) busy = be.power_reading();  // hundreds of GEMMs still queued
  }
  be.synchronize();
  const PowerReading after = be.power_reading();
  ASSERT_TRUE(after.available) << after.why;
  ASSERT_TRUE(busy.available) << busy.why;
  EXPECT_GT(after.energy_j, before.energy_j) << "the counter must move forward over ~0.5 s of GEMMs";
  EXPECT_GT(busy.sm_clock_mhz, 500.0);
  EXPECT_LT(busy.sm_clock_mhz, 3000.0);
  EXPECT_EQ(busy.clock_reasons & 0x1, 0u) << "not idle while GEMMs run";
}

}  // namespace
}  // namespace flux8::testing
