// `flux8 train` under mpirun: data-parallel runs against one process, checkpoints across job
// sizes, and the errors of a misconfigured job. The CPU backend, two ranks of one OpenMP thread.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "io/safetensors.h"
#include "model_test_util.h"
#include "test_util.h"
#include "train/signals.h"
#include "train_test_util.h"

namespace flux8 {
namespace {

namespace fs = std::filesystem;

using testing::run_mpi;

using testing::train_args;

std::vector<double> tensor_values(const std::string& file) {
  const SafetensorsReader r(file);
  std::vector<double> out;
  for (const std::string& n : r.names()) {
    const auto& t = r.tensor(n);
    const float* p = reinterpret_cast<const float*>(t.data);
    out.insert(out.end(), p, p + t.nbytes / sizeof(float));
  }
  return out;
}

std::string model_file(const testing::RunDir& dir, const std::string& run, int step) {
  return (dir.root / run / fmt::format("step-{:07d}", step) / "model.safetensors").string();
}

TEST(DataParallelTrain, TwoRanksFollowOneProcess) {
  const testing::RunDir dir("dp_train");
  TrainOptions one = dir.options("one");
  one.overrides.push_back("threads=1");
  run_training(one);
  std::string log;
  ASSERT_EQ(0, run_mpi(2, train_args(dir, "two"), dir.root / "two.log", &log)) << log;
  ASSERT_EQ(0, run_mpi(2, train_args(dir, "zero", "--set use_distributed_optimizer=true"), dir.root / "zero.log", &log))
      << log;
  EXPECT_NE(log.find("TP=1 x DP=2"), std::string::npos) << log;
  const std::vector<double> l1 = testing::step_losses(dir.root / "one" / "metrics.jsonl");
  ASSERT_EQ(l1.size(), 6u);
  for (const char* run : {"two", "zero"}) {
    SCOPED_TRACE(run);
    // f32: the gradients are summed in another order than one process's micro-batches.
    const std::vector<double> l2 = testing::step_losses(dir.root / run / "metrics.jsonl");
    ASSERT_EQ(l2.size(), l1.size());
    EXPECT_LT(testing::max_rel_error(l2, l1), 1e-6);
    EXPECT_LT(testing::max_rel_error(tensor_values(model_file(dir, run, 6)), tensor_values(model_file(dir, "one", 6))),
              1e-5);
  }
}

// FP8 (delayed): every checkpoint compares the ranks' scales and amax histories with rank 0's
// (the copy the checkpoint keeps), logged once and recorded in the metrics at every save.
TEST(DataParallelTrain, Fp8RanksAgreeAtEveryCheckpoint) {
  const testing::RunDir dir("dp_fp8_agree");
  std::string log;
  ASSERT_EQ(0, run_mpi(2, train_args(dir, "fp8", "--set fp8=hybrid --set save_interval=3"), dir.root / "fp8.log", &log))
      << log;
  EXPECT_NE(log.find("scales and amax histories) identical on all 2 ranks at step 3"), std::string::npos) << log;
  std::vector<int64_t> steps;
  for (const nlohmann::json& rec : testing::read_jsonl(dir.root / "fp8" / "metrics.jsonl"))
    if (rec.value("event", "") == "fp8_ranks_agree") {
      steps.push_back(rec["step"].get<int64_t>());
      EXPECT_EQ(rec["ranks"], 2);
      EXPECT_TRUE(rec["differing_ranks"].empty());
    }
  EXPECT_EQ(steps, (std::vector<int64_t>{3, 6}));
}

// A checkpoint of a 2-rank job with the distributed optimizer resumes bit for bit at 2 ranks, and
// at 1 rank (one process, the same files) goes on where one process would.
TEST(DataParallelTrain, CheckpointResumesAtTheSameAndAnotherJobSize) {
  const testing::RunDir dir("dp_resume");
  const std::string zero = "--set use_distributed_optimizer=true";
  std::string log;
  ASSERT_EQ(0, run_mpi(2, train_args(dir, "straight", zero), dir.root / "a.log", &log)) << log;
  ASSERT_EQ(kStoppedExitCode,
            run_mpi(2, train_args(dir, "resumed", zero + " --stop-after 3"), dir.root / "b.log", &log))
      << log;
  fs::copy(dir.root / "resumed", dir.root / "alone", fs::copy_options::recursive);
  ASSERT_EQ(0, run_mpi(2, train_args(dir, "resumed", zero + " --resume"), dir.root / "c.log", &log)) << log;
  EXPECT_NE(log.find("resumed from"), std::string::npos) << log;
  EXPECT_EQ(testing::step_losses(dir.root / "straight" / "metrics.jsonl"),
            testing::step_losses(dir.root / "resumed" / "metrics.jsonl"));
  testing::expect_same_tensors(model_file(dir, "straight", 6), model_file(dir, "resumed", 6));
  testing::expect_same_tensors((dir.root / "straight" / "step-0000006" / "optimizer.safetensors").string(),
                               (dir.root / "resumed" / "step-0000006" / "optimizer.safetensors").string());

  TrainOptions alone = dir.options("alone");
  alone.overrides.push_back("threads=1");
  alone.resume = true;
  EXPECT_EQ(run_training(alone).steps_done, 6);
  const std::vector<double> two = testing::step_losses(dir.root / "straight" / "metrics.jsonl");
  const std::vector<double> one = testing::step_losses(dir.root / "alone" / "metrics.jsonl");
  ASSERT_EQ(one.size(), two.size());
  EXPECT_LT(testing::max_rel_error(one, two), 1e-6);
}

// overlap_grad_reduce starts each gradient bucket's collective inside the last micro-batch's
// backward instead of after it: the same collectives on the same bytes, so the same run bit for
// bit — with gradient accumulation (two micro-batches a rank), the distributed optimizer, and at
// TP=2 x DP=2.
TEST(DataParallelTrain, OverlappedGradientReductionChangesNothing) {
  const testing::RunDir dir("dp_overlap");
  const std::string base = "--set global_batch_size=8 --set use_distributed_optimizer=true ";
  const std::string overlap = "--set overlap_grad_reduce=true ";
  const std::string tp = "--set tensor_model_parallel_size=2 ";
  std::string log;
  for (const auto& [np, run, args] :
       {std::tuple{2, "off", base}, std::tuple{2, "on", base + overlap}, std::tuple{4, "tp_off", base + tp},
        std::tuple{4, "tp_on", base + tp + overlap}}) {
    ASSERT_EQ(0, run_mpi(np, train_args(dir, run, args), dir.root / (std::string(run) + ".log"), &log)) << log;
    const bool on = std::string(run).ends_with("on");
    EXPECT_EQ(on, log.find("started during the last micro-batch's backward") != std::string::npos) << log;
  }
  for (const auto& [on, off] : {std::pair{"on", "off"}, std::pair{"tp_on", "tp_off"}}) {
    SCOPED_TRACE(on);
    EXPECT_EQ(testing::step_losses(dir.root / on / "metrics.jsonl"),
              testing::step_losses(dir.root / off / "metrics.jsonl"));
    for (const char* file : {"model.safetensors", "optimizer.safetensors"})
      testing::expect_same_tensors((dir.root / on / "step-0000006" / file).string(),
                                   (dir.root / off / "step-0000006" / file).string());
  }
}

// The distributed optimizer's update of a shard rounds bf16 moments as the whole buffer's update
// does (AdamWHyper::index_base), and offloaded shards (each rank's in its host memory, gathered
// for the checkpoint through the backend) train as shards on the backend: bit for bit.
TEST(DataParallelTrain, ShardedAndOffloadedMomentsFollowWholeOnes) {
  const testing::RunDir dir("dp_offload");
  const std::string bf16 = "--set adam_moment_precision=bf16 ";
  const std::string zero = "--set use_distributed_optimizer=true ";
  const std::string offload = "--set optimizer_offload=moments --set optimizer_offload_chunk=256 ";
  std::string log;
  for (const auto& [run, args] :
       {std::pair{"whole", bf16}, std::pair{"zero", bf16 + zero}, std::pair{"offload", bf16 + zero + offload},
        std::pair{"f32_zero", zero}, std::pair{"f32_offload", zero + offload}})
    ASSERT_EQ(0, run_mpi(2, train_args(dir, run, args), dir.root / (std::string(run) + ".log"), &log)) << log;
  for (const auto& [run, base] :
       {std::pair{"zero", "whole"}, std::pair{"offload", "whole"}, std::pair{"f32_offload", "f32_zero"}}) {
    SCOPED_TRACE(run);
    EXPECT_EQ(testing::step_losses(dir.root / run / "metrics.jsonl"),
              testing::step_losses(dir.root / base / "metrics.jsonl"));
    for (const char* file : {"model.safetensors", "optimizer.safetensors"})
      testing::expect_same_tensors((dir.root / run / "step-0000006" / file).string(),
                                   (dir.root / base / "step-0000006" / file).string());
  }
}

// `flux8 bench` under mpirun runs the trainer's data parallelism: the distributed optimizer's
// sharded masters and the gradient buckets. Its first loss is one process's (the same weights and
// synthetic data on every rank), and every step's loss stays finite.
TEST(DataParallelTrain, BenchUnderALauncherReducesAsTheTrainer) {
  const testing::RunDir dir("dp_bench");
  const std::string bench = std::string(FLUX8_BINARY) + " bench -c " + (dir.root / "exp.yaml").string() +
                            " --backend cpu --precision bf16 --steps 2 --warmup 1 --set threads=1 --json ";
  std::string log;
  ASSERT_EQ(0,
            std::system((bench + (dir.root / "one.json").string() + " > " + (dir.root / "one.log").string()).c_str()));
  ASSERT_EQ(0, run_mpi(2, bench + (dir.root / "two.json").string() + " --set use_distributed_optimizer=true",
                       dir.root / "two.log", &log))
      << log;
  const auto read = [&](const char* name) {
    std::ifstream in(dir.root / name);
    return nlohmann::json::parse(in)["steps"].at(0);
  };
  const nlohmann::json one = read("one.json"), two = read("two.json");
  EXPECT_EQ(two["parallel"], "TP=1 x DP=2 (2 ranks)");
  EXPECT_EQ(one["gradient_buckets"], 0);
  EXPECT_GE(two["gradient_buckets"].get<int>(), 1);
  EXPECT_LE(two["buckets_started_in_backward"].get<int>(), two["gradient_buckets"].get<int>());
  EXPECT_EQ(two["losses"].at(0), one["losses"].at(0));
  for (const nlohmann::json& l : two["losses"]) EXPECT_TRUE(std::isfinite(l.get<double>())) << two["losses"];
  testing::expect_mentions(log, {"gradients summed in"});
}

TEST(DataParallelTrain, RefusesRanksWithDifferentConfigs) {
  const testing::RunDir dir("dp_config");
  std::string log;
  const std::string a = train_args(dir, "x", "--set lr=1e-3"), b = train_args(dir, "x", "--set lr=2e-3");
  EXPECT_NE(0, run_mpi(1, a + " : -np 1 " + b, dir.root / "log", &log));
  testing::expect_mentions(log, {"differs between ranks", "rank 1 of 2"});
}

TEST(DataParallelTrain, RefusesSizesThatDoNotSplit) {
  const testing::RunDir dir("dp_sizes");
  std::string log;
  EXPECT_NE(0, run_mpi(2, train_args(dir, "x", "--set tensor_model_parallel_size=3"), dir.root / "log", &log));
  testing::expect_mentions(log, {"tensor_model_parallel_size: 3 does not divide the job's 2 ranks"});
  EXPECT_NE(0, run_mpi(2, train_args(dir, "x", "--set global_batch_size=2"), dir.root / "log", &log));
  testing::expect_mentions(log, {"global_batch_size 2", "make it a multiple of 4"});
  EXPECT_NE(0, run_mpi(1, train_args(dir, "x", "--set pipeline_model_parallel_size=2"), dir.root / "log", &log));
  testing::expect_mentions(log, {"pipeline_model_parallel_size is 2"});
}

}  // namespace
}  // namespace flux8
