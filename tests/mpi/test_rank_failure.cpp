// A rank that dies, hangs or fails must end the whole job, promptly and saying which rank: each test
// starts a job of its own (`mpirun -np 2` of this binary, whose RankFailureWorker test runs
// collectives in a loop the way a trainer's steps do), does something to one rank, and checks how
// the job ends. The tests run in the suite's one-rank job only (they start their own).
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "backend/registry.h"
#include "core/error.h"
#include "dist/process_groups.h"
#include "dist/watchdog.h"
#include "mpi/mpi_test_util.h"
#include "train_test_util.h"

namespace flux8::testing {

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// What the acceptance criteria allow a broken job to take.
constexpr auto kJobMustEndWithin = 60s;

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// True for the variables by which a launcher tells a process that it is one of its ranks: a job
// started from inside this one must not see them, or its mpirun would take itself for a rank.
bool names_the_launch(std::string_view var) {
  for (std::string_view prefix : {"OMPI_", "PMIX_", "PMI_", "OPAL_", "ORTE_", "PRTE_", "HYDRA_", "SLURM_"})
    if (var.starts_with(prefix)) return true;
  return false;
}

// A process started from this one, its output in a file: `command` with this process's
// environment, less the launcher's variables, plus `extra_env`.
class Job {
 public:
  Job(const std::string& tag, std::vector<std::string> command, const std::vector<std::string>& extra_env)
      : log_(fs::temp_directory_path() / fmt::format("flux8_rank_failure_{}_{}.log", tag, ::getpid())) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e)
      if (!names_the_launch(*e)) env.emplace_back(*e);
    // The job runs on this node alone, where Open MPI never calls its remote-shell agent — but it
    // refuses to start when none is installed (containers without ssh): name one that exists.
    for (const char* keep : {"OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
                             "OMPI_MCA_btl_vader_single_copy_mechanism=none", "OMPI_MCA_plm_rsh_agent=false"})
      env.emplace_back(keep);
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    // Everything the child needs is built before fork(): after it, only async-signal-safe calls.
    std::vector<char*> argv, envp;
    for (std::string& a : command) argv.push_back(a.data());
    for (std::string& e : env) envp.push_back(e.data());
    argv.push_back(nullptr);
    envp.push_back(nullptr);
    const std::string log = log_.string();
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0 || ::dup2(fd, 1) < 0 || ::dup2(fd, 2) < 0) ::_exit(126);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
    EXPECT_GT(pid_, 0) << std::strerror(errno);
  }
  ~Job() {
    if (!exited_) {  // the test failed: leave nothing running
      for (int r = 0; r < 2; ++r)
        if (const pid_t p = rank_pid(r); p > 0) ::kill(p, SIGKILL);
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    fs::remove(log_);
  }
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  std::string output() const { return read_text(log_); }

  // Waits until the output says `marker`.
  bool wait_for_output(const std::string& marker, std::chrono::seconds at_most) const {
    const auto until = Clock::now() + at_most;
    while (Clock::now() < until) {
      if (output().find(marker) != std::string::npos) return true;
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }

  // Waits until every rank has printed `marker`.
  bool wait_for_ranks(const std::string& marker, std::chrono::seconds at_most) const {
    const auto until = Clock::now() + at_most;
    while (Clock::now() < until) {
      const std::string out = output();
      if (out.find("rank 0 of 2: " + marker) != std::string::npos &&
          out.find("rank 1 of 2: " + marker) != std::string::npos)
        return true;
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }

  // The process of rank `rank`: mpirun's child whose environment names that rank; -1 if none.
  pid_t rank_pid(int rank) const {
    const std::string want = fmt::format("OMPI_COMM_WORLD_RANK={}", rank);
    for (const auto& entry : fs::directory_iterator("/proc")) {
      const std::string name = entry.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::string stat = read_text(entry.path() / "stat");
      const size_t close = stat.rfind(')');
      if (close == std::string::npos) continue;
      std::istringstream fields(stat.substr(close + 2));
      char state = 0;
      pid_t ppid = 0;
      fields >> state >> ppid;
      if (ppid != pid_) continue;
      const std::string environment = read_text(entry.path() / "environ");
      std::string_view rest(environment);
      while (!rest.empty()) {
        const size_t end = rest.find('\0');
        if (rest.substr(0, end) == want) return static_cast<pid_t>(std::stol(name));
        if (end == std::string_view::npos) break;
        rest.remove_prefix(end + 1);
      }
    }
    return -1;
  }

  // mpirun's exit status, once it has exited within `at_most`; nullopt if it has not (the
  // destructor then kills the job).
  std::optional<int> exit_status(std::chrono::seconds at_most) {
    const auto until = Clock::now() + at_most;
    while (Clock::now() < until) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(50ms);
    }
    return std::nullopt;
  }

 private:
  fs::path log_;
  pid_t pid_ = -1;
  bool exited_ = false;
};

// `mpirun -np 2` of `command`.
std::vector<std::string> two_ranks(std::vector<std::string> command) {
  std::vector<std::string> launch = {FLUX8_MPIEXEC, "-np", "2", "--oversubscribe"};
  launch.insert(launch.end(), command.begin(), command.end());
  return launch;
}

// Two ranks of this binary's RankFailureWorker test in `mode`.
std::vector<std::string> worker_job() {
  return two_ranks({fs::read_symlink("/proc/self/exe").string(), "--gtest_filter=RankFailureWorker.*"});
}

// The end of a job's output, for failure messages (a trainer's progress lines run long).
std::string last_lines(const std::string& out) {
  return out.size() <= 4000 ? out : "..." + out.substr(out.size() - 4000);
}

void expect_mentions(const std::string& out, const std::string& what) {
  EXPECT_NE(out.find(what), std::string::npos) << "the job's output does not say \"" << what << "\":\n"
                                               << last_lines(out);
}

}  // namespace

// The worker, run by the tests below in jobs of their own (skipped in the suite's own runs): an
// all-reduce on the world group every millisecond, under the collective watchdog, as a trainer's
// steps; an error on a rank ends the job as flux8's main does (abort_job, naming the rank).
// FLUX8_TEST_RANK_FAILURE=throw makes rank 1 fail at its 50th step.
TEST(RankFailureWorker, CollectivesUntilTheJobEnds) {
  const char* mode_env = std::getenv("FLUX8_TEST_RANK_FAILURE");
  if (!mode_env) GTEST_SKIP() << "run by the RankFailure tests in jobs of their own";
  const std::string mode = mode_env;
  auto be = make_backend("cpu");
  collective_watchdog().set_timeout(collective_timeout(10.0));
  auto comm = make_group_communicator(MPI_COMM_WORLD, *be, "world");  // watched: make_group_communicator
  std::vector<double> values(1000, 1.0);
  const Tensor t(values.data(), DType::f64, Shape{1000});
  const auto until = Clock::now() + 120s;  // the tests end the job long before
  try {
    for (int step = 0; Clock::now() < until; ++step) {
      comm->all_reduce(t);
      if (values[0] != comm->size()) fail("step {}: the all-reduce gave {}", step, values[0]);
      std::fill(values.begin(), values.end(), 1.0);
      if (step == 0) {
        std::printf("%scollectives running\n", rank_prefix().c_str());
        std::fflush(stdout);
      }
      if (mode == "throw" && step == 50 && world_rank() == 1) fail("an error injected at step {}", step);
      std::this_thread::sleep_for(1ms);
    }
  } catch (const std::exception& e) {
    abort_job(fmt::format("error: {}", e.what()), 1);
  }
  ADD_FAILURE() << "the job outlived its two minutes";
}

TEST(RankFailure, AKilledRankEndsTheJobNamingIt) {
  FLUX8_REQUIRE_RANKS(1);
  Job job("killed", worker_job(), {"FLUX8_TEST_RANK_FAILURE=loop"});
  ASSERT_TRUE(job.wait_for_ranks("collectives running", 60s)) << last_lines(job.output());
  const pid_t victim = job.rank_pid(1);
  ASSERT_GT(victim, 0) << "rank 1's process was not found";
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  const std::optional<int> status = job.exit_status(kJobMustEndWithin);
  ASSERT_TRUE(status) << "the job still ran 60 s after rank 1 was killed:\n" << last_lines(job.output());
  EXPECT_NE(*status, 0);
  expect_mentions(job.output(), "process rank 1");  // Open MPI names the rank that died
}

TEST(RankFailure, AHungRankEndsTheJobAtTheCollectiveTimeout) {
  FLUX8_REQUIRE_RANKS(1);
  Job job("hung", worker_job(), {"FLUX8_TEST_RANK_FAILURE=loop", "FLUX8_COLLECTIVE_TIMEOUT_S=2"});
  ASSERT_TRUE(job.wait_for_ranks("collectives running", 60s)) << last_lines(job.output());
  const pid_t victim = job.rank_pid(1);
  ASSERT_GT(victim, 0) << "rank 1's process was not found";
  ASSERT_EQ(::kill(victim, SIGSTOP), 0);  // alive, but never reaches its next collective
  const std::optional<int> status = job.exit_status(kJobMustEndWithin);
  if (!status) ::kill(victim, SIGCONT);
  ASSERT_TRUE(status) << "the job still ran 60 s after rank 1 stopped:\n" << last_lines(job.output());
  EXPECT_NE(*status, 0);
  const std::string out = job.output();
  expect_mentions(out, "rank 0 of 2: all_reduce on world group");
  expect_mentions(out, "longer than the collective timeout of 2 s");
}

TEST(RankFailure, AnErrorOnOneRankEndsTheJobNamingIt) {
  FLUX8_REQUIRE_RANKS(1);
  Job job("error", worker_job(), {"FLUX8_TEST_RANK_FAILURE=throw"});
  const std::optional<int> status = job.exit_status(kJobMustEndWithin);
  ASSERT_TRUE(status) << "the job still ran 60 s after rank 1's error:\n" << last_lines(job.output());
  EXPECT_NE(*status, 0);
  expect_mentions(job.output(), "rank 1 of 2: error: an error injected at step 50");
}

// The same on the real trainer: `mpirun -np 2 flux8 train` of the tiny demo model (data parallel
// over two ranks), with the demo's data written before.
class TrainingJob {
 public:
  explicit TrainingJob(const std::vector<std::string>& extra_env) : dir_("rank_failure") {
    const std::string config = (dir_.root / "exp.yaml").string();
    {
      Job data("data", {FLUX8_BINARY, "data", "demo", "--out", (dir_.root / "data").string(), "-c", config}, {});
      const std::optional<int> status = data.exit_status(120s);
      EXPECT_TRUE(status && *status == 0) << last_lines(data.output());
    }
    job_ = std::make_unique<Job>(
        "train",
        two_ranks({FLUX8_BINARY, "train", "-c", config, "--set", "save_dir=" + (dir_.root / "run").string(), "--set",
                   "train_iters=1000000", "--set", "threads=1"}),
        extra_env);
  }
  Job& job() { return *job_; }

 private:
  RunDir dir_;
  std::unique_ptr<Job> job_;
};

TEST(RankFailure, AKilledRankEndsATrainingJobNamingIt) {
  FLUX8_REQUIRE_RANKS(1);
  TrainingJob training({});
  Job& job = training.job();
  ASSERT_TRUE(job.wait_for_output("first step done", 60s)) << last_lines(job.output());
  const pid_t victim = job.rank_pid(1);
  ASSERT_GT(victim, 0) << "rank 1's process was not found";
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  const std::optional<int> status = job.exit_status(kJobMustEndWithin);
  ASSERT_TRUE(status) << "the training job still ran 60 s after rank 1 was killed:\n" << last_lines(job.output());
  EXPECT_NE(*status, 0);
  expect_mentions(job.output(), "process rank 1");  // Open MPI names the rank that died
}

// Rank 1 stopped in the middle of training: rank 0 waits in its next gradient reduction until the
// collective timeout, then ends the job saying where it waited.
TEST(RankFailure, AHungRankEndsATrainingJobAtTheCollectiveTimeout) {
  FLUX8_REQUIRE_RANKS(1);
  TrainingJob training({"FLUX8_COLLECTIVE_TIMEOUT_S=3"});
  Job& job = training.job();
  ASSERT_TRUE(job.wait_for_output("first step done", 60s)) << last_lines(job.output());
  const pid_t victim = job.rank_pid(1);
  ASSERT_GT(victim, 0) << "rank 1's process was not found";
  ASSERT_EQ(::kill(victim, SIGSTOP), 0);
  const std::optional<int> status = job.exit_status(kJobMustEndWithin);
  if (!status) ::kill(victim, SIGCONT);
  ASSERT_TRUE(status) << "the training job still ran 60 s after rank 1 stopped:\n" << last_lines(job.output());
  EXPECT_NE(*status, 0);
  const std::string out = job.output();
  expect_mentions(out, "rank 0 of 2: ");
  expect_mentions(out, "group (MPI, rank 0 of 2) has waited");
  expect_mentions(out, "longer than the collective timeout of 3 s");
}

}  // namespace flux8::testing
