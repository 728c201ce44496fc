// The verdicts `flux8 bench` prints against flux8's own targets (src/bench/targets.h), the
// roofline's grouping of a profile and a run's energy summary.
#include <gtest/gtest.h>

#include "backend/energy.h"
#include "bench/roofline.h"
#include "bench/targets.h"

namespace flux8 {
namespace {

// W1 runs as an H200 gave them: BF16, FP8 delayed hybrid, and the first run of the process
// measured its launch.
std::vector<BenchRunSummary> w1_runs() {
  return {{"bf16", "", 41.95, 15.45, 1.11}, {"delayed", "hybrid", 28.13, 15.52, -1}};
}

TEST(BenchTargets, JudgesEachTargetTheRunsAllow) {
  const std::vector<TargetVerdict> v = judge_targets("W1", w1_runs());
  ASSERT_EQ(v.size(), 4u);
  EXPECT_EQ(v[0].target, "BF16 step");
  EXPECT_EQ(v[0].run, "BF16");
  EXPECT_TRUE(v[0].met);
  EXPECT_EQ(v[1].target, "FP8 step");
  EXPECT_EQ(v[1].run, "delayed hybrid");
  EXPECT_FALSE(v[1].met);
  EXPECT_DOUBLE_EQ(v[1].limit, 28.0);
  EXPECT_EQ(v[2].target, "FP8 peak memory");
  EXPECT_EQ(v[2].run, "delayed hybrid / BF16");
  EXPECT_NEAR(v[2].value, 15.52 / 15.45, 1e-12);
  EXPECT_FALSE(v[2].met);
  EXPECT_EQ(v[3].target, "launch to first step");
  EXPECT_EQ(v[3].run, "BF16");
  EXPECT_TRUE(v[3].met);
}

TEST(BenchTargets, DescribesByHowMuchATargetIsMissed) {
  const std::vector<TargetVerdict> v = judge_targets("W1", w1_runs());
  EXPECT_EQ(describe(v[0]), "BF16 step (BF16): 41.95 ms <= 42.00 ms, met");
  EXPECT_EQ(describe(v[1]), "FP8 step (delayed hybrid): 28.13 ms <= 28.00 ms, missed by 0.13 ms");
  EXPECT_EQ(describe(v[2]), "FP8 peak memory (delayed hybrid / BF16): 1.00x <= 0.80x, missed by 0.20x");
  EXPECT_EQ(describe(v[3]), "launch to first step (BF16): 1.11 s <= 3.00 s, met");
}

TEST(BenchTargets, W2HasItsOwnLimits) {
  const std::vector<TargetVerdict> v =
      judge_targets("W2", {{"bf16", "", 93.03, 30.17, -1}, {"delayed", "hybrid", 59.5, 23.0, -1}});
  ASSERT_EQ(v.size(), 3u);
  EXPECT_DOUBLE_EQ(v[0].limit, 85.0);
  EXPECT_FALSE(v[0].met);
  EXPECT_DOUBLE_EQ(v[1].limit, 60.0);
  EXPECT_TRUE(v[1].met);
  EXPECT_TRUE(v[2].met);  // 23.0 / 30.17 = 0.76x
}

// With the runs' energy (W2 runs on an H200: 64.0 J a step in BF16, 42.5 with FP8), the step
// verdicts say the joules a step the target allows at the power limit; the memory verdict and
// runs without a measurement say nothing of energy.
TEST(BenchTargets, StepVerdictsSayTheEnergyTheTargetAllows) {
  BenchRunSummary bf16{"bf16", "", 90.41, 22.85, -1}, fp8{"delayed", "hybrid", 59.49, 21.70, -1};
  bf16.joules_per_step = 64.0, bf16.power_limit_w = 700.0;
  fp8.joules_per_step = 42.5, fp8.power_limit_w = 700.0;
  const std::vector<TargetVerdict> v = judge_targets("W2", {bf16, fp8});
  ASSERT_EQ(v.size(), 3u);
  EXPECT_DOUBLE_EQ(v[0].joules, 64.0);
  EXPECT_DOUBLE_EQ(v[0].joules_allowed, 59.5);  // 85 ms at 700 W
  EXPECT_EQ(
      describe(v[0]),
      "BF16 step (BF16): 90.41 ms <= 85.00 ms, missed by 5.41 ms; 64.0 J a step, 59.5 J allowed at the 700 W limit");
  EXPECT_EQ(describe(v[1]),
            "FP8 step (delayed hybrid): 59.49 ms <= 60.00 ms, met; 42.5 J a step, 42.0 J allowed at the 700 W limit");
  EXPECT_LT(v[2].joules, 0.0);
  EXPECT_EQ(describe(v[2]).find(" J "), std::string::npos);
  EXPECT_EQ(judge_targets("W1", w1_runs())[0].joules, -1.0);
}

TEST(BenchTargets, OnlyTheTargetsTheRunsCanBeJudgedOn) {
  // No BF16 run: no memory ratio; other recipes and the e4m3 format are not what the FP8 target
  // names; a run without a launch measurement gives no launch verdict.
  const std::vector<TargetVerdict> v = judge_targets("W1", {{"delayed", "e4m3", 27.0, 15.0, -1},
                                                            {"blockwise", "hybrid", 27.0, 15.0, -1},
                                                            {"delayed", "hybrid", 27.9, 15.3, -1}});
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].target, "FP8 step");
  EXPECT_EQ(v[0].run, "delayed hybrid");
  EXPECT_TRUE(v[0].met);
  // A config's own model: no targets.
  EXPECT_TRUE(judge_targets("flux_535m", w1_runs()).empty());
  EXPECT_EQ(workload_targets("flux_535m"), nullptr);
  EXPECT_EQ(workload_targets("W3"), nullptr);
}

// The profile's rows grouped as the roofline's parts (bench/roofline.h): every row in exactly one
// part, the GEMMs and attention with their model FLOPs and the rate those rows reached — here
// part of a W2 BF16 profile (atomic attention backward) on an H200.
TEST(BenchRoofline, GroupsTheProfileIntoItsParts) {
  EXPECT_EQ(roofline_part_of("gemm_fp8_tn (fast accumulation)"), "GEMMs");
  EXPECT_EQ(roofline_part_of("linear_dgrad_gelu"), "GEMMs");
  EXPECT_EQ(roofline_part_of("attention_fp8_backward"), "attention");
  EXPECT_EQ(roofline_part_of("quantize_fused (gelu_tanh + fp8 cast)"), "FP8 casts");
  EXPECT_EQ(roofline_part_of("transpose_codes"), "FP8 casts");
  EXPECT_EQ(roofline_part_of("adamw"), "AdamW");
  EXPECT_EQ(roofline_part_of("qk_norm_rope_to_heads_backward"), "everything else");
  EXPECT_EQ(roofline_part_of("(device idle between ops)"), "everything else");
  const std::vector<OpTime> ops = {{"linear_backward", 42, 28.397}, {"attention_backward", 6, 16.487},
                                   {"linear_gelu", 8, 8.886},       {"linear", 34, 8.727},
                                   {"linear_dgrad_gelu", 8, 7.786}, {"adamw", 1, 6.522},
                                   {"attention", 6, 5.274},         {"layernorm_modulate_backward", 13, 0.981},
                                   {"sum_squares", 1, 0.478},       {"(device idle between ops)", 0, 0.416}};
  const ModelFlops flops{37.68e12 / 6, 9.39e12 / 3};
  const std::vector<RooflinePart> parts = roofline_parts(ops, flops);
  ASSERT_EQ(parts.size(), 5u);
  EXPECT_EQ(parts[0].name, "GEMMs");
  EXPECT_NEAR(parts[0].ms_per_step, 28.397 + 8.886 + 8.727 + 7.786, 1e-9);
  EXPECT_NEAR(parts[0].model_tflop, 37.68, 1e-9);
  EXPECT_NEAR(parts[0].tflops(), 37.68 / 53.796e-3, 1e-6);  // ~700
  EXPECT_NEAR(parts[1].ms_per_step, 16.487 + 5.274, 1e-9);
  EXPECT_NEAR(parts[1].tflops(), 9.39 / 21.761e-3, 1e-6);  // ~432
  EXPECT_NEAR(parts[2].ms_per_step, 6.522, 1e-9);
  EXPECT_EQ(parts[2].tflops(), 0.0) << "AdamW has no model FLOPs";
  EXPECT_EQ(parts[3].ms_per_step, 0.0) << "a BF16 step has no casts";
  EXPECT_NEAR(parts[4].ms_per_step, 0.981 + 0.478 + 0.416, 1e-9);
}

// A run's energy from the counter's readings around its timed steps (backend/energy.h): joules a
// step, mean power, the step time that energy allows at the limit, and the clock's limiters as
// read while the last step ran.
TEST(BenchEnergy, SummarisesTheTimedStepsReadings) {
  const PowerReading start{.available = true, .energy_j = 1000.0, .power_limit_w = 700.0, .sm_clock_mhz = 1980},
      busy{.available = true, .energy_j = 1050.0, .power_limit_w = 700.0, .sm_clock_mhz = 1560, .clock_reasons = 0x4},
      end{.available = true, .energy_j = 1630.0, .power_limit_w = 700.0, .sm_clock_mhz = 1755};
  const EnergySummary e = summarize_energy(start, end, busy, 10, 0.92);
  ASSERT_TRUE(e.available) << e.why;
  EXPECT_DOUBLE_EQ(e.joules_per_step, 63.0);
  EXPECT_NEAR(e.mean_power_w, 630.0 / 0.92, 1e-9);
  EXPECT_DOUBLE_EQ(e.window_s, 0.92);
  EXPECT_DOUBLE_EQ(e.power_limit_w, 700.0);
  EXPECT_NEAR(e.ms_at_power_limit, 90.0, 1e-9);  // 63 J at 700 W
  EXPECT_DOUBLE_EQ(e.sm_clock_mhz, 1560.0);
  EXPECT_EQ(e.clock_limiters, std::vector<std::string>{"power cap (software)"});

  // Unavailable anywhere: the reason comes through; a counter that did not move is no measurement.
  const PowerReading none{.why = "cpu backend: no energy counter"};
  EXPECT_EQ(summarize_energy(none, end, busy, 10, 0.92).why, "cpu backend: no energy counter");
  EXPECT_FALSE(summarize_energy(start, end, none, 10, 0.92).available);
  const EnergySummary still = summarize_energy(start, start, busy, 10, 0.92);
  EXPECT_FALSE(still.available);
  EXPECT_NE(still.why.find("did not move"), std::string::npos) << still.why;
  EXPECT_FALSE(summarize_energy(start, end, busy, 0, 0.0).available);
}

TEST(BenchEnergy, NamesTheClockLimiters) {
  EXPECT_TRUE(clock_limiter_names(0).empty());
  EXPECT_EQ(clock_limiter_names(0x4 | 0x40),
            (std::vector<std::string>{"power cap (software)", "thermal slowdown (hardware)"}));
  EXPECT_EQ(clock_limiter_names(0x1 | 0x1000), (std::vector<std::string>{"idle", "0x1000"}));
}

}  // namespace
}  // namespace flux8
