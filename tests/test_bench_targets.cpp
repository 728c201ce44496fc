// The verdicts `flux8 bench` prints against WORKLOADS.md's targets (src/bench/targets.h).
#include <gtest/gtest.h>

#include "bench/targets.h"

namespace flux8 {
namespace {

// The twenty-second session's W1 runs on the H200: BF16, FP8 delayed hybrid, and the first run
// of the process measured its launch.
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

TEST(BenchTargets, OnlyTheTargetsTheRunsCanBeJudgedOn) {
  // No BF16 run: no memory ratio; other recipes and the e4m3 format are not what the FP8 target
  // names; a run without a launch measurement gives no launch verdict.
  const std::vector<TargetVerdict> v = judge_targets(
      "W1", {{"delayed", "e4m3", 27.0, 15.0, -1}, {"blockwise", "hybrid", 27.0, 15.0, -1},
             {"delayed", "hybrid", 27.9, 15.3, -1}});
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].target, "FP8 step");
  EXPECT_EQ(v[0].run, "delayed hybrid");
  EXPECT_TRUE(v[0].met);
  // A config's own model: no targets, no peer.
  EXPECT_TRUE(judge_targets("flux_535m", w1_runs()).empty());
  EXPECT_EQ(peer_numbers("flux_535m"), nullptr);
  EXPECT_EQ(workload_targets("W3"), nullptr);
}

TEST(BenchTargets, MemoryAgainstThePeer) {
  const PeerNumbers* peer = peer_numbers("W1");
  ASSERT_NE(peer, nullptr);
  EXPECT_EQ(memory_vs_peer(*peer, 15.45),
            "allocated 15.45 GiB: 1.13x PyTorch eager (13.7), 1.30x compiled (11.9), 1.47x torchao FP8 (10.5)");
}

}  // namespace
}  // namespace flux8
