// The exit status of `flux8 train`, as a scheduler reads it (cli/exit_codes.h): the real binary
// on the tiny demo model — finished, stopped with a checkpoint by --stop-after, a config error,
// a data error — and what --resume says when there is nothing to resume. SIGTERM's status is
// checked by tests/test_faults.cpp (Faults.SigtermSavesACheckpointAndExitsCleanly); the errors'
// kinds behind the other statuses here, in process.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "cli/exit_codes.h"
#include "core/error.h"
#include "test_util.h"
#include "train/signals.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace flux8::testing {
namespace {

struct TrainCli {
  RunDir dir{"exit_codes"};
  std::string log;
  int train(const std::string& save, const std::string& extra) {
    return run_flux8("train -c " + (dir.root / "exp.yaml").string() + " --set save_dir=" + (dir.root / save).string() +
                         " --set threads=1 " + extra,
                     (dir.root / (save + ".log")).string(), &log);
  }
};

TEST(ExitCodes, FinishedIsZeroAndStopAfterAsksForARequeue) {
  TrainCli cli;
  // --resume with nothing to resume says so, and trains from step 0.
  ASSERT_EQ(cli.train("run", "--set train_iters=2 --resume"), cli::kExitFinished) << cli.log;
  expect_mentions(cli.log, {"--resume: no checkpoint in " + (cli.dir.root / "run").string() + "; starting from step 0",
                            "done: 2 steps"});
  EXPECT_TRUE(std::filesystem::exists(cli.dir.root / "run" / "step-0000002"));

  EXPECT_EQ(cli.train("stopped", "--set train_iters=4 --stop-after 1"), kStoppedExitCode) << cli.log;
  EXPECT_EQ(kStoppedExitCode, 75);
  expect_mentions(cli.log, {"stopping at step 1 (--stop-after); resume with --resume"});
  EXPECT_TRUE(std::filesystem::exists(cli.dir.root / "stopped" / "step-0000001"));
  // The requeued job resumes and finishes.
  EXPECT_EQ(cli.train("stopped", "--set train_iters=4 --resume"), cli::kExitFinished) << cli.log;
  expect_mentions(cli.log, {"resumed from " + (cli.dir.root / "stopped" / "step-0000001").string()});
}

TEST(ExitCodes, ConfigAndDataErrorsHaveTheirOwn) {
  TrainCli cli;
  EXPECT_EQ(cli.train("a", "--set hiden_size=3"), cli::kExitConfigError) << cli.log;
  expect_mentions(cli.log, {"unknown config key 'hiden_size'"});
  EXPECT_EQ(cli.train("b", "--set global_batch_size=3"), cli::kExitConfigError) << cli.log;
  EXPECT_EQ(cli.train("c", "--set fp8_recipe=tensorwise"), cli::kExitConfigError) << cli.log;  // fp8 is none
  EXPECT_EQ(run_flux8("train -c /nonexistent/exp.yaml", (cli.dir.root / "d.log").string(), &cli.log),
            cli::kExitConfigError)
      << cli.log;
  EXPECT_EQ(run_flux8("train --no-such-option", (cli.dir.root / "e.log").string(), &cli.log), cli::kExitConfigError)
      << cli.log;

  const std::string missing = (cli.dir.root / "nowhere" / "train-*.tar").string();
  EXPECT_EQ(
      cli.train("f", "--set demo_data=false --set valid_data= --set empty_prompt_file= --set train_data=" + missing),
      cli::kExitDataError)
      << cli.log;
  expect_mentions(cli.log, {"flux8: error:", "nowhere"});
}

TEST(ExitCodes, HelpShowsTheTable) {
  TempDir dir;
  std::string log;
  for (const char* args : {"--help", "train --help"}) {
    ASSERT_EQ(run_flux8(args, dir.file("help.txt"), &log), 0) << log;
    expect_mentions(log, {"Exit status:", "  0  finished", "75  stopped after saving a checkpoint", "--resume",
                          "78  config error", "65  data error", "79  out of memory", "80  stopped on non-finite"});
  }
  // How to watch a run, where the run is started.
  ASSERT_EQ(run_flux8("train --help", dir.file("help.txt"), &log), 0) << log;
  expect_mentions(log, {"tensorboard --logdir SAVE_DIR/tensorboard", "SAVE_DIR/metrics.jsonl"});
}

// The kinds the statuses come from: a non-finite stop (nan_policy halt) and out of memory.
TEST(ExitCodes, ErrorKindsMapToTheirStatus) {
  RunDir dir("exit_codes_kinds");
  TrainOptions o = dir.options("run");
  o.overrides.push_back("nan_policy=halt");
  o.overrides.push_back("train_iters=2");
  o.nan_gradient = {"final_layer.linear.weight", {1}};
  try {
    run_training(o);
    ADD_FAILURE() << "expected a non-finite stop";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::nonfinite) << e.what();
    EXPECT_EQ(cli::exit_code_of(e.kind()), cli::kExitNonFinite);
  }
  EXPECT_EQ(cli::exit_code_of(OutOfMemoryError("x", 1, 0, 0).kind()), cli::kExitOutOfMemory);
  EXPECT_EQ(cli::exit_code_of(ErrorKind::general), cli::kExitError);
  const std::vector<int> codes = {cli::kExitFinished,    cli::kExitError,    cli::kExitUnexpected,
                                  cli::kExitDataError,   cli::kExitStopped,  cli::kExitConfigError,
                                  cli::kExitOutOfMemory, cli::kExitNonFinite};
  for (size_t i = 0; i < codes.size(); ++i)
    for (size_t j = i + 1; j < codes.size(); ++j) EXPECT_NE(codes[i], codes[j]);
}

}  // namespace
}  // namespace flux8::testing
