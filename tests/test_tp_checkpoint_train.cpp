// `flux8 train` under mpirun at TP=2 x DP=2 with the distributed optimizer (the CPU backend, four
// ranks of one OpenMP thread): its checkpoint resumes bit for bit at that layout, and one process
// resumes from it and goes on where the job would; the AdamW moments offloaded to host memory
// change nothing.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "model_test_util.h"
#include "test_util.h"
#include "train/signals.h"
#include "train_test_util.h"

namespace flux8 {
namespace {

namespace fs = std::filesystem;

using testing::run_mpi;

std::string tp_train_args(const testing::RunDir& dir, const std::string& save, const std::string& extra = "") {
  return testing::train_args(dir, save,
                             "--set tensor_model_parallel_size=2 --set use_distributed_optimizer=true " + extra);
}

std::string checkpoint_file(const testing::RunDir& dir, const std::string& run, int step, const char* file) {
  return (dir.root / run / fmt::format("step-{:07d}", step) / file).string();
}

TEST(TensorParallelTrain, CheckpointResumesAtTheSameLayoutAndAtOneRank) {
  const testing::RunDir dir("tp_resume");
  std::string log;
  ASSERT_EQ(0, run_mpi(4, tp_train_args(dir, "straight"), dir.root / "a.log", &log)) << log;
  EXPECT_NE(log.find("TP=2 x DP=2"), std::string::npos) << log;
  ASSERT_EQ(kStoppedExitCode, run_mpi(4, tp_train_args(dir, "resumed", "--stop-after 3"), dir.root / "b.log", &log))
      << log;
  fs::copy(dir.root / "resumed", dir.root / "alone", fs::copy_options::recursive);
  ASSERT_EQ(0, run_mpi(4, tp_train_args(dir, "resumed", "--resume"), dir.root / "c.log", &log)) << log;
  EXPECT_NE(log.find("resumed from"), std::string::npos) << log;
  EXPECT_EQ(testing::step_losses(dir.root / "straight" / "metrics.jsonl"),
            testing::step_losses(dir.root / "resumed" / "metrics.jsonl"));
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    testing::expect_same_tensors(checkpoint_file(dir, "straight", 6, file), checkpoint_file(dir, "resumed", 6, file));

  TrainOptions alone = dir.options("alone");
  alone.overrides.push_back("threads=1");
  alone.resume = true;
  EXPECT_EQ(run_training(alone).steps_done, 6);
  const std::vector<double> job = testing::step_losses(dir.root / "straight" / "metrics.jsonl");
  const std::vector<double> one = testing::step_losses(dir.root / "alone" / "metrics.jsonl");
  ASSERT_EQ(one.size(), job.size());
  // f32: the split GEMMs sum in another order than one process's.
  EXPECT_LT(testing::max_rel_error(one, job), 1e-6);
}

// optimizer_offload: moments under tensor parallelism: each rank keeps its shard's moments in host
// memory (with the distributed optimizer, its data-parallel shard of them), and the checkpoint's
// tensor-parallel gather reads them there. TP=2 x DP=2 and TP=2 x DP=1 train as with the moments
// on the backend, bit for bit, bf16 moments included; the offloaded job stopped at step 3 resumes
// bit for bit.
TEST(TensorParallelTrain, OffloadedMomentsFollowMomentsOnTheBackend) {
  const testing::RunDir dir("tp_offload");
  const std::string bf16 = "--set adam_moment_precision=bf16 ";
  const std::string offload = "--set optimizer_offload=moments --set optimizer_offload_chunk=256 ";
  const std::string tp_only = "--set tensor_model_parallel_size=2 ";
  std::string log;
  for (const auto& [run, ranks, args] :
       {std::tuple{"backend", 4, tp_train_args(dir, "backend", bf16)},
        std::tuple{"offload", 4, tp_train_args(dir, "offload", bf16 + offload)},
        std::tuple{"tp_backend", 2, testing::train_args(dir, "tp_backend", tp_only)},
        std::tuple{"tp_offload", 2, testing::train_args(dir, "tp_offload", tp_only + offload)},
        std::tuple{"resumed", 4, tp_train_args(dir, "resumed", bf16 + offload + "--stop-after 3")}})
    ASSERT_EQ(std::string(run) == "resumed" ? kStoppedExitCode : 0,
              run_mpi(ranks, args, dir.root / (std::string(run) + ".log"), &log))
        << log;
  ASSERT_EQ(0, run_mpi(4, tp_train_args(dir, "resumed", bf16 + offload + "--resume"), dir.root / "c.log", &log)) << log;
  EXPECT_NE(log.find("resumed from"), std::string::npos) << log;
  for (const auto& [run, base] :
       {std::pair{"offload", "backend"}, std::pair{"tp_offload", "tp_backend"}, std::pair{"resumed", "backend"}}) {
    SCOPED_TRACE(run);
    EXPECT_EQ(testing::step_losses(dir.root / run / "metrics.jsonl"),
              testing::step_losses(dir.root / base / "metrics.jsonl"));
    for (const char* file : {"model.safetensors", "optimizer.safetensors"})
      testing::expect_same_tensors(checkpoint_file(dir, run, 6, file), checkpoint_file(dir, base, 6, file));
  }
}

}  // namespace
}  // namespace flux8
