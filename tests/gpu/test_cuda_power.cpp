// The CUDA backend's energy counter (NVML, loaded at run time: backend/cuda/nvml.h) on the GPU
// machine: a reading is available wherever a usable GPU is (NVML ships with every driver), the
// counter moves forward while the GPU works, and the limit and clock are plausible numbers.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "gpu_test_util.h"
#include "train/trainer.h"
#include "train_test_util.h"

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

// `flux8 train` on the GPU logs each logged step's energy (metrics.jsonl: energy_j_per_step,
// gpu_power_w over the steps since the last log line). The tiny model's steps take a few ms and
// the counter moves every 20-100 ms, so the windows are 50 steps long.
TEST(CudaPower, TrainerLogsTheEnergyOfItsSteps) {
  FLUX8_REQUIRE_GPU();
  const RunDir dir("cuda_energy");
  TrainOptions o = dir.options("run");
  for (const char* kv : {"backend=cuda", "train_iters=150", "log_interval=50"}) o.overrides.emplace_back(kv);
  ASSERT_EQ(run_training(o).steps_done, 150);
  int rows = 0, measured = 0;
  std::ifstream in(dir.root / "run" / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("step_time_s")) continue;
    ++rows;
    if (j["energy_j_per_step"].is_null()) continue;
    ++measured;
    EXPECT_GT(j["energy_j_per_step"].get<double>(), 0.0) << line;
    EXPECT_GT(j["gpu_power_w"].get<double>(), 10.0) << line;
    EXPECT_LT(j["gpu_power_w"].get<double>(), 2000.0) << line;
  }
  EXPECT_EQ(rows, 3);
  EXPECT_GE(measured, 2) << "the counter moves over 50 steps of a few ms";
}

}  // namespace
}  // namespace flux8::testing
