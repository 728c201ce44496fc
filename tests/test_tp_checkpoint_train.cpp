// `flux8 train` under mpirun at TP=2 x DP=2 with the distributed optimizer (the CPU backend, four
// ranks of one OpenMP thread): its checkpoint resumes bit for bit at that layout, and one process
// resumes from it and goes on where the job would.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
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

}  // namespace
}  // namespace flux8
