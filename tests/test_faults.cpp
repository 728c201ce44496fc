// Faults injected into training runs of the tiny demo model, each checked end to end: `flux8
// train` killed with SIGKILL in the middle of a save, stopped by SIGTERM, and out of disk space
// during a save (child processes of the real binary); --resume over checkpoints of which none
// verifies; a NaN in a gradient (in process, through TrainOptions::nan_gradient).
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/signals.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace flux8 {
namespace {

namespace fs = std::filesystem;
using testing::expect_mentions;
using testing::read_bytes;

// A `flux8 train` child of this process: its output goes to `log`; FLUX8_TEST_STOP_IN_SAVE is
// set to `stop_in_save` when given; with `file_size_limit`, files it writes cannot grow past that
// many bytes (RLIMIT_FSIZE, SIGXFSZ ignored: a write past it fails with EFBIG, as on a full disk).
struct Flux8Train {
  pid_t pid = -1;
  std::string log;

  Flux8Train(const testing::RunDir& dir, const std::string& save_dir, const std::vector<std::string>& extra,
             std::optional<int64_t> stop_in_save = std::nullopt, std::optional<rlim_t> file_size_limit = std::nullopt)
      : log((dir.root / fmt::format("{}-{}.log", save_dir, next_log_number())).string()) {
    std::vector<std::string> args = {FLUX8_BINARY, "train",
                                     "-c",         (dir.root / "exp.yaml").string(),
                                     "--set",      "save_dir=" + (dir.root / save_dir).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e)
      if (std::strncmp(*e, "FLUX8_TEST_", 11) != 0) env.emplace_back(*e);
    if (stop_in_save) env.push_back("FLUX8_TEST_STOP_IN_SAVE=" + std::to_string(*stop_in_save));
    // Everything the child needs is built before fork(): after it, only async-signal-safe calls.
    std::vector<char*> argv, envp;
    for (std::string& a : args) argv.push_back(a.data());
    for (std::string& e : env) envp.push_back(e.data());
    argv.push_back(nullptr);
    envp.push_back(nullptr);
    pid = ::fork();
    if (pid == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      if (fd < 0 || ::dup2(fd, 1) < 0 || ::dup2(fd, 2) < 0) ::_exit(126);
      if (file_size_limit) {
        ::signal(SIGXFSZ, SIG_IGN);
        struct rlimit lim;
        ::getrlimit(RLIMIT_FSIZE, &lim);
        lim.rlim_cur = *file_size_limit;
        if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) ::_exit(126);
      }
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
    EXPECT_GT(pid, 0) << std::strerror(errno);
  }
  // The next change of the child's state (exited, killed, or stopped).
  int wait_for_change() {
    int status = 0;
    EXPECT_EQ(::waitpid(pid, &status, WUNTRACED), pid);
    return status;
  }
  // Runs to the end; its exit status, or -1 when a signal ended it.
  int exit_status() {
    const int status = wait_for_change();
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  std::string output() const { return read_bytes(log); }

 private:
  static int next_log_number() {
    static int n = 0;
    return ++n;
  }
};

// Runs `flux8 train` to its end with these arguments; its exit status and output.
std::pair<int, std::string> run_train(const testing::RunDir& dir, const std::string& save_dir,
                                      const std::vector<std::string>& extra) {
  Flux8Train child(dir, save_dir, extra);
  const int rc = child.exit_status();
  return {rc, child.output()};
}

// Every file of two checkpoint directories identical, byte for byte.
void expect_same_checkpoint(const fs::path& a, const fs::path& b) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(a)) names.push_back(e.path().filename().string());
  ASSERT_EQ(names.size(), static_cast<size_t>(std::distance(fs::directory_iterator(b), fs::directory_iterator())));
  for (const std::string& n : names) {
    ASSERT_TRUE(fs::is_regular_file(b / n)) << b / n;
    EXPECT_TRUE(read_bytes((a / n).string()) == read_bytes((b / n).string())) << a / n << " differs from " << b / n;
  }
}

std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The uninterrupted run: 6 steps, a checkpoint every 2, in save_dir "run" and then moved to
// "straight", so that an interrupted run in "run" has the same config (save_dir included) and
// must write the same bytes.
const std::vector<std::string> kEverySecondStep = {"--set", "save_interval=2"};
void run_straight(const testing::RunDir& dir) {
  const auto [rc, out] = run_train(dir, "run", kEverySecondStep);
  ASSERT_EQ(rc, 0) << out;
  fs::rename(dir.root / "run", dir.root / "straight");
}

// Killed (SIGKILL) while it writes step 4's checkpoint: the step-4 files are in the temporary
// directory, the manifest is not. --resume continues from step 2, removes the dead run's
// temporary directory, and ends with checkpoints and losses identical to the uninterrupted run.
TEST(Faults, KillDuringSaveThenResumeIsBitExact) {
  const testing::RunDir dir("faults_kill");
  run_straight(dir);
  Flux8Train child(dir, "run", kEverySecondStep, /*stop_in_save=*/4);
  const int status = child.wait_for_change();
  ASSERT_TRUE(WIFSTOPPED(status)) << child.output();
  const fs::path tmp = dir.root / "run" / fmt::format(".tmp-step-0000004-{}", child.pid);
  EXPECT_TRUE(fs::is_regular_file(tmp / "model.safetensors"));
  EXPECT_FALSE(fs::exists(tmp / "manifest.json"));
  ASSERT_EQ(::kill(child.pid, SIGKILL), 0);
  const int killed = child.wait_for_change();
  ASSERT_TRUE(WIFSIGNALED(killed) && WTERMSIG(killed) == SIGKILL);
  EXPECT_EQ(listing(dir.root / "run"),
            (std::vector<std::string>{tmp.filename().string(), "metrics.jsonl", "step-0000002", "tensorboard"}));

  const auto [rc, out] = run_train(dir, "run", {"--set", "save_interval=2", "--resume"});
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("resumed from " + (dir.root / "run" / "step-0000002").string()), std::string::npos) << out;
  EXPECT_EQ(listing(dir.root / "run"),
            (std::vector<std::string>{"metrics.jsonl", "step-0000004", "step-0000006", "tensorboard"}));
  for (const char* step : {"step-0000004", "step-0000006"})
    expect_same_checkpoint(dir.root / "straight" / step, dir.root / "run" / step);
  // The killed run logged steps 1-4, the resumed one 3-6 after dropping the killed run's 3 and 4:
  // each step once, as in the uninterrupted run.
  const std::vector<double> straight = testing::step_losses(dir.root / "straight" / "metrics.jsonl");
  const std::vector<double> resumed = testing::step_losses(dir.root / "run" / "metrics.jsonl");
  ASSERT_EQ(straight.size(), 6u);
  EXPECT_EQ(resumed, straight);
}

// --resume PATH: a run in an empty save_dir continues from the chosen checkpoint of another
// run (step 4 of the uninterrupted one) and writes step 6 byte for byte as that run did.
TEST(Faults, ResumeFromAChosenCheckpointIsBitExact) {
  const testing::RunDir dir("faults_resume_path");
  run_straight(dir);
  const std::string chosen = (dir.root / "straight" / "step-0000004").string();
  const auto [rc, out] = run_train(dir, "run", {"--set", "save_interval=2", "--resume", chosen});
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("resumed from " + chosen), std::string::npos) << out;
  EXPECT_EQ(listing(dir.root / "run"), (std::vector<std::string>{"metrics.jsonl", "step-0000006", "tensorboard"}));
  expect_same_checkpoint(dir.root / "straight" / "step-0000006", dir.root / "run" / "step-0000006");
}

// SIGTERM (a scheduler's preemption) arrives during step 2's save: the run finishes that save,
// takes one more step, saves step 3 and exits with kStoppedExitCode (75: requeue me); --resume
// then ends exactly where the uninterrupted run does.
TEST(Faults, SigtermSavesACheckpointAndExitsCleanly) {
  const testing::RunDir dir("faults_sigterm");
  run_straight(dir);
  Flux8Train child(dir, "run", kEverySecondStep, /*stop_in_save=*/2);
  ASSERT_TRUE(WIFSTOPPED(child.wait_for_change())) << child.output();
  ASSERT_EQ(::kill(child.pid, SIGTERM), 0);  // pending while the child is stopped
  ASSERT_EQ(::kill(child.pid, SIGCONT), 0);
  const int rc = child.exit_status();
  const std::string out = child.output();
  EXPECT_EQ(rc, kStoppedExitCode) << out;
  expect_mentions(out, {"SIGTERM received: stopping after this step with a checkpoint",
                        "stopping at step 3 (SIGTERM); resume with --resume"});
  EXPECT_EQ(listing(dir.root / "run"),
            (std::vector<std::string>{"metrics.jsonl", "step-0000002", "step-0000003", "tensorboard"}));
  EXPECT_NO_THROW(verify_checkpoint((dir.root / "run" / "step-0000003").string()));

  const auto [rc2, out2] = run_train(dir, "run", {"--set", "save_interval=2", "--resume"});
  ASSERT_EQ(rc2, 0) << out2;
  expect_same_checkpoint(dir.root / "straight" / "step-0000006", dir.root / "run" / "step-0000006");
}

// The disk fills up during step 4's save (stand-in: RLIMIT_FSIZE below the optimizer file's
// size, which makes its writes fail with EFBIG as ENOSPC would; a small tmpfs needs root). The
// run stops with an error naming the checkpoint and the file, the step-2 checkpoint is intact
// and still the newest, and nothing of the failed save is left.
TEST(Faults, DiskFullDuringSaveKeepsThePreviousCheckpoint) {
  const testing::RunDir dir("faults_disk_full");
  const auto [rc, out] = run_train(dir, "run", {"--set", "save_interval=2", "--stop-after", "2"});
  ASSERT_EQ(rc, kStoppedExitCode) << out;
  const fs::path step2 = dir.root / "run" / "step-0000002";
  const uint64_t model = fs::file_size(step2 / "model.safetensors");
  const uint64_t optimizer = fs::file_size(step2 / "optimizer.safetensors");
  ASSERT_LT(model, optimizer);
  const std::string before = read_bytes((step2 / "model.safetensors").string());

  Flux8Train child(dir, "run", {"--set", "save_interval=2", "--resume"}, std::nullopt, (model + optimizer) / 2);
  const int rc2 = child.exit_status();
  const std::string out2 = child.output();
  EXPECT_EQ(rc2, 1) << out2;
  expect_mentions(out2, {"flux8: error: saving checkpoint " + (dir.root / "run" / "step-0000004").string() + " failed",
                         "optimizer.safetensors", std::strerror(EFBIG), "the checkpoints before it are intact"});
  EXPECT_EQ(listing(dir.root / "run"), (std::vector<std::string>{"metrics.jsonl", "step-0000002", "tensorboard"}));
  EXPECT_NO_THROW(verify_checkpoint(step2.string()));
  EXPECT_TRUE(read_bytes((step2 / "model.safetensors").string()) == before);
  EXPECT_EQ(find_latest_checkpoint((dir.root / "run").string()), step2.string());
}

// --resume over checkpoints of which none verifies refuses to start, names each one and its
// problem, and leaves metrics.jsonl and the checkpoints as they were.
TEST(Faults, ResumeWithoutAVerifiedCheckpointRefusesToStart) {
  const testing::RunDir dir("faults_no_good_checkpoint");
  const auto [rc, out] = run_train(dir, "run", kEverySecondStep);
  ASSERT_EQ(rc, 0) << out;
  const fs::path run = dir.root / "run";
  for (const char* step : {"step-0000004", "step-0000006"}) {
    const fs::path model = run / step / "model.safetensors";
    std::string bytes = read_bytes(model.string());
    bytes[bytes.size() - 20] ^= 0x10;
    testing::write_bytes(model.string(), bytes);
  }
  const std::string metrics = read_bytes((run / "metrics.jsonl").string());
  const auto [rc2, out2] = run_train(dir, "run", {"--set", "save_interval=2", "--resume"});
  EXPECT_EQ(rc2, 1) << out2;
  expect_mentions(out2, {"--resume: " + run.string() + " holds 2 checkpoints, and none verifies",
                         (run / "step-0000006").string() + ": model.safetensors bytes [",
                         (run / "step-0000004").string() + ": model.safetensors bytes ["});
  EXPECT_TRUE(read_bytes((run / "metrics.jsonl").string()) == metrics);
  EXPECT_EQ(listing(run), (std::vector<std::string>{"metrics.jsonl", "step-0000004", "step-0000006", "tensorboard"}));
}

// A NaN in one gradient: the step is skipped, the tensor named, the weights kept; the run halts
// after nan_max_consecutive_skips such steps in a row.
std::vector<nlohmann::json> skipped_steps(const fs::path& metrics) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "skipped_step") out.push_back(j);
  }
  return out;
}

TEST(Faults, NanGradientSkipsTheStepAndHaltsAfterTheConfiguredCount) {
  const testing::RunDir dir("faults_nan");
  const std::string param = "double_blocks.0.img_mlp.0.weight";
  TrainOptions once = dir.options("once");
  once.overrides.insert(once.overrides.end(),
                        {"save_interval=1", "keep_last_checkpoints=0", "nan_max_consecutive_skips=2"});
  once.nan_gradient = {param, {3}};
  ::testing::internal::CaptureStdout();
  const TrainResult r = run_training(once);
  const std::string log = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(r.steps_done, 6);
  EXPECT_NE(log.find("step 3: non-finite gradient (first non-finite gradient: " + param + "); step skipped"),
            std::string::npos)
      << log;
  const std::vector<nlohmann::json> skipped = skipped_steps(dir.root / "once" / "metrics.jsonl");
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0]["step"], 3);
  EXPECT_EQ(skipped[0]["first_nonfinite"], param);
  testing::expect_same_tensors((dir.root / "once" / "step-0000002" / "model.safetensors").string(),
                               (dir.root / "once" / "step-0000003" / "model.safetensors").string());
  const nlohmann::json state =
      nlohmann::json::parse(std::ifstream(dir.root / "once" / "step-0000006" / "trainer_state.json"));
  EXPECT_EQ(state["skipped_steps"], 1);

  TrainOptions twice = once;
  twice.overrides[0] = "save_dir=" + (dir.root / "twice").string();
  twice.nan_gradient.steps = {3, 4};
  ::testing::internal::CaptureStdout();
  const std::string e = testing::error_of([&] { run_training(twice); });
  ::testing::internal::GetCapturedStdout();
  expect_mentions(
      e, {"2 consecutive steps had a non-finite loss or gradient (last at step 4)", "the last checkpoint is intact"});
  const std::vector<nlohmann::json> both = skipped_steps(dir.root / "twice" / "metrics.jsonl");
  ASSERT_EQ(both.size(), 2u);
  for (const nlohmann::json& j : both) EXPECT_EQ(j["first_nonfinite"], param);
  EXPECT_EQ(listing(dir.root / "twice"),
            (std::vector<std::string>{"metrics.jsonl", "step-0000001", "step-0000002", "step-0000003", "tensorboard"}));
}

}  // namespace
}  // namespace flux8
