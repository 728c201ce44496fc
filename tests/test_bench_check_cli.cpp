// `flux8 bench`, `flux8 check` and `flux8 info` on the CPU machine: the benchmark's step loop,
// numbers and JSON on the CPU backend with a tiny model, check's report where no GPU is usable,
// and what info says about checkpoints.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "config/config.h"
#include "core/error.h"
#include "test_util.h"
#if FLUX8_HAVE_CUDA
#include "backend/cuda/factory.h"
#endif

namespace flux8::testing {
namespace {

struct Cli {
  TempDir dir;
  std::string log;
  int run(const std::string& args) { return run_flux8(args, dir.file("log.txt"), &log); }
  // A tiny model at a small shape (2 samples, 64 image + 8 text tokens).
  std::string tiny_config() {
    return dir.write("tiny.yaml", "include: " + std::string(FLUX8_SOURCE_DIR) +
                                      "/configs/models/flux_tiny_demo.yaml\n"
                                      "micro_batch_size: 2\nimage_size: 16\ntext_seq_len: 8\n");
  }
  // Runs `bench --backend cpu -c tiny <args> --json F` and returns the parsed JSON.
  nlohmann::json bench(const std::string& args) {
    const std::string json = dir.file("bench.json");
    EXPECT_EQ(run("bench --backend cpu -c " + tiny_config() + " " + args + " --json " + json), 0) << log;
    std::ifstream in(json);
    return in ? nlohmann::json::parse(in) : nlohmann::json::object();
  }
};

TEST(BenchCli, TimesTrainingStepsInEachPrecisionAndWritesJson) {
  Cli cli;
  const nlohmann::json j = cli.bench("--precision bf16,delayed,blockwise --steps 3 --warmup 1");
  ASSERT_EQ(j["steps"].size(), 3u) << j.dump();
  const char* precisions[] = {"bf16", "delayed", "blockwise"};
  for (size_t i = 0; i < 3; ++i) {
    const auto& r = j["steps"][i];
    EXPECT_EQ(r["precision"], precisions[i]);
    EXPECT_EQ(r["step_ms"].size(), 3u);
    EXPECT_EQ(r["losses"].size(), 4u) << "warm-up steps are in the loss curve";
    EXPECT_GT(r["median_step_ms"].get<double>(), 0.0);
    EXPECT_GT(r["model_tflop_per_step"].get<double>(), 0.0);
    EXPECT_GT(r["peak_allocated_gib"].get<double>(), 0.0);
    EXPECT_EQ(r["non_finite_steps"], 0);
    for (double l : r["losses"]) EXPECT_TRUE(std::isfinite(l) && l > 0.1 && l < 10.0) << l;
  }
  // The same seed and data: every precision starts from the same first loss (up to FP8 error).
  const double l0 = j["steps"][0]["first_loss"], l1 = j["steps"][1]["first_loss"];
  EXPECT_NEAR(l1, l0, 0.05 * l0);
  EXPECT_NE(cli.log.find("BF16"), std::string::npos) << cli.log;
  // Launch to first step: the process's first run only, from the process's start, so at least
  // as long as that run's first step and its wait for the backend.
  const auto& first = j["steps"][0];
  ASSERT_TRUE(first["launch_to_first_step_s"].is_number()) << first.dump();
  EXPECT_GE(first["launch_to_first_step_s"].get<double>(), first["first_step_s"].get<double>() - 0.05);
  EXPECT_TRUE(j["steps"][1]["launch_to_first_step_s"].is_null());
  // The CPU backend has no energy counter: the JSON says so, with the reason.
  EXPECT_EQ(first["energy"]["measured"], false) << first.dump();
  EXPECT_EQ(first["energy"]["why"], "cpu backend: no energy counter");
  EXPECT_EQ(cli.log.find("launch to first step"), cli.log.rfind("launch to first step")) << "printed once";
  EXPECT_NE(cli.log.find("launch to first step"), std::string::npos) << cli.log;
}

// --data structured: fresh latents every step tied to the text; the model learns (the loss
// falls) without a memorised set; a run of >= 100 steps prints its loss per 50 steps.
TEST(BenchCli, StructuredDataIsLearnedAndTheCurveIsPrinted) {
  Cli cli;
  const nlohmann::json j = cli.bench("--data structured --precision bf16 --steps 100 --warmup 0 --lr 1e-3");
  const auto& r = j["steps"][0];
  EXPECT_EQ(r["data"], "structured");
  const std::vector<double> losses = r["losses"];
  ASSERT_EQ(losses.size(), 100u);
  double first = 0, last = 0;
  for (int i = 0; i < 20; ++i) first += losses[i] / 20, last += losses[80 + i] / 20;
  EXPECT_LT(last, 0.9 * first) << "the structured data has something to learn";
  EXPECT_GT(last, 0.05) << "and a floor (the noise the text does not carry)";
  const size_t line = cli.log.find("loss per 50 steps:");
  ASSERT_NE(line, std::string::npos) << cli.log;
  const nlohmann::json p = cli.bench("--precision bf16 --steps 2 --warmup 0");
  EXPECT_NE(p["steps"][0]["first_loss"].get<double>(), r["first_loss"].get<double>()) << "another data set";
}

TEST(BenchCli, ProfileTimesEveryOpOfTheStep) {
  Cli cli;
  const nlohmann::json step = cli.bench("--precision tensorwise --steps 2 --warmup 1 --profile")["steps"][0];
  const nlohmann::json& ops = step["ops"];
  ASSERT_FALSE(ops.empty()) << cli.log;
  double total = 0, previous = 1e300;
  bool saw_fp8_gemm = false, saw_attention = false;
  for (const auto& op : ops) {
    const double ms = op["ms_per_step"];
    EXPECT_LE(ms, previous) << "largest first";
    previous = ms;
    total += ms;
    saw_fp8_gemm |= op["op"] == "gemm_fp8_tn";
    saw_attention |= op["op"] == "attention_backward";
  }
  EXPECT_TRUE(saw_fp8_gemm && saw_attention) << ops.dump();
  EXPECT_GT(total, 0.0);
  EXPECT_NE(cli.log.find("share"), std::string::npos) << cli.log;
  // The idle row, split by the op each wait ended with, adds up to it.
  double idle = -1, split = 0;
  for (const auto& op : ops)
    if (op["op"] == "(device idle between ops)") idle = op["ms_per_step"];
  for (const auto& w : step["idle_before"]) split += w["ms_per_step"].get<double>();
  ASSERT_GE(idle, 0.0) << ops.dump();
  EXPECT_NEAR(split, idle, 1e-6 + 1e-9 * idle);
  EXPECT_NE(cli.log.find("idle before (ms/step):"), std::string::npos) << cli.log;
  // The roofline's parts add up to the rows, the GEMMs' and attention's rates from model FLOPs.
  double parts = 0;
  for (const auto& part : step["roofline"]) parts += part["ms_per_step"].get<double>();
  ASSERT_EQ(step["roofline"].size(), 5u) << step.dump();
  EXPECT_NEAR(parts, total, 1e-9 * total);
  EXPECT_EQ(step["roofline"][0]["part"], "GEMMs");
  EXPECT_GT(step["roofline"][0]["model_tflops"].get<double>(), 0.0);
  EXPECT_GT(step["roofline"][3]["ms_per_step"].get<double>(), 0.0) << "tensorwise FP8: casts";
  EXPECT_NE(cli.log.find("roofline parts"), std::string::npos) << cli.log;
}

// --micro-batches N: gradient accumulation, N forward and backward passes a step — N times the
// attention and GEMM calls of one, the model FLOPs of N, one optimizer update.
TEST(BenchCli, MicroBatchesAccumulateGradientsWithinAStep) {
  Cli cli;
  const auto calls = [](const nlohmann::json& step, const std::string& op) {
    for (const auto& o : step["ops"])
      if (o["op"] == op) return o["calls_per_step"].get<double>();
    return 0.0;
  };
  const nlohmann::json one = cli.bench("--precision bf16 --steps 2 --warmup 1 --profile")["steps"][0];
  const nlohmann::json three =
      cli.bench("--precision bf16 --steps 2 --warmup 1 --profile --micro-batches 3")["steps"][0];
  EXPECT_EQ(one["micro_batches"], 1);
  EXPECT_EQ(three["micro_batches"], 3);
  ASSERT_GT(calls(one, "attention_backward"), 0.0) << one["ops"].dump();
  EXPECT_EQ(calls(three, "attention_backward"), 3 * calls(one, "attention_backward"));
  ASSERT_GT(calls(one, "adamw"), 0.0) << one["ops"].dump();
  EXPECT_EQ(calls(three, "adamw"), calls(one, "adamw")) << three["ops"].dump();
  EXPECT_DOUBLE_EQ(three["model_tflop_per_step"].get<double>(), 3 * one["model_tflop_per_step"].get<double>());
}

// --data-path: the trainer's host work before a step (batch assembly, upload) timed at the shape
// and reported beside the step; without it the fields are null. --set cuda_graph=true on the CPU:
// no graphs there, the run says so in its JSON.
TEST(BenchCli, DataPathIsTimedOnRequest) {
  Cli cli;
  const nlohmann::json with = cli.bench("--precision bf16 --steps 1 --warmup 0 --data-path --set cuda_graph=true");
  const auto& r = with["steps"][0];
  ASSERT_TRUE(r["data_assemble_ms"].is_number()) << r.dump();
  EXPECT_GT(r["data_assemble_ms"].get<double>(), 0.0);
  EXPECT_GT(r["data_upload_ms"].get<double>(), 0.0);
  EXPECT_NE(cli.log.find("trainer data path"), std::string::npos) << cli.log;
  EXPECT_EQ(r["cuda_graph"], false);
  const nlohmann::json without = cli.bench("--precision bf16 --steps 1 --warmup 0");
  EXPECT_TRUE(without["steps"][0]["data_assemble_ms"].is_null());
}

TEST(BenchCli, UnknownPrecisionIsAnError) {
  Cli cli;
  EXPECT_NE(cli.run("bench --backend cpu --precision fp4"), 0);
  EXPECT_NE(cli.log.find("unknown precision 'fp4'"), std::string::npos) << cli.log;
}

TEST(CheckCli, ReportsWhyTheGpuCannotRunHere) {
  Cli cli;
  const int rc = cli.run("check");
  EXPECT_NE(cli.log.find("CPU backend"), std::string::npos) << cli.log;
  EXPECT_NE(cli.log.find("CUDA backend"), std::string::npos) << cli.log;
  if (rc == 0) {  // a GPU machine: every recipe is reported
    for (const char* r : {"delayed", "tensorwise", "blockwise", "mxfp8", "FP8 attention"})
      EXPECT_NE(cli.log.find(r), std::string::npos) << cli.log;
  } else {
    EXPECT_EQ(rc, 1) << cli.log;
    EXPECT_TRUE(cli.log.find("not usable") != std::string::npos || cli.log.find("not built") != std::string::npos)
        << cli.log;
  }
}

#if FLUX8_HAVE_CUDA
// The driver's JIT cache (where cuDNN's runtime-compiled attention kernels go): an empty one is
// named as such with what it costs, a filled one counted, a disabled one said.
TEST(CheckCli, ReportsTheDriverJitCache) {
  Cli cli;
  const std::string cache = cli.dir.file("jit");
  std::filesystem::create_directories(cache);
  struct EnvScope {
    ~EnvScope() {
      unsetenv("CUDA_CACHE_PATH");
      unsetenv("CUDA_CACHE_DISABLE");
    }
  } restore;
  setenv("CUDA_CACHE_PATH", cache.c_str(), 1);
  cli.run("check");
  EXPECT_NE(cli.log.find(cache + " (CUDA_CACHE_PATH): empty"), std::string::npos) << cli.log;
  // A cache of its own: on a GPU machine the first check's FP8-attention probe compiled kernels
  // into the first one (after reading it).
  const std::string filled = cli.dir.file("jit_filled");
  std::filesystem::create_directories(filled + "/sub");
  std::ofstream(filled + "/a.bin") << std::string(1500000, 'x');
  std::ofstream(filled + "/sub/b.bin") << std::string(500000, 'y');
  setenv("CUDA_CACHE_PATH", filled.c_str(), 1);
  cli.run("check");
  EXPECT_NE(cli.log.find(filled + " (CUDA_CACHE_PATH): 2 files, 2.0 MB"), std::string::npos) << cli.log;
  setenv("CUDA_CACHE_DISABLE", "1", 1);
  cli.run("check");
  EXPECT_NE(cli.log.find("JIT cache            disabled (CUDA_CACHE_DISABLE=1)"), std::string::npos) << cli.log;
}
#endif

TEST(BackendAuto, PicksCudaOnlyWhereItCanRun) {
  const std::unique_ptr<Backend> be = make_backend("auto");
#if FLUX8_HAVE_CUDA
  EXPECT_EQ(be->name(), cuda_unavailable_reason().empty() ? "cuda" : "cpu");
#else
  EXPECT_EQ(be->name(), "cpu");
#endif
  try {
    make_backend("tpu");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'auto'"), std::string::npos) << e.what();
  }
}

// `flux8 info` says what a checkpoint of the model weighs on disk (f32 weights and moments) and
// how much host memory async_save's copy takes (f32 weights, the moments as stored), and whether
// that copy fits this machine (the trainer's rule: half the memory available).
TEST(InfoCli, SaysTheCheckpointsSizeAndItsHostCopy) {
  Cli cli;
  for (const auto& [moments, copy_bytes_per_param] : {std::pair{"f32", 12.0}, std::pair{"bf16", 8.0}}) {
    ASSERT_EQ(cli.run("info -c " + cli.tiny_config() + " --set adam_moment_precision=" + moments + " --json"), 0)
        << cli.log;
    const nlohmann::json j = nlohmann::json::parse(cli.log);
    const double params = j["parameters"].get<double>();
    EXPECT_EQ(j["checkpoint_bytes"].get<double>(), 12.0 * params) << moments;
    EXPECT_EQ(j["async_save_host_copy_bytes"].get<double>(), copy_bytes_per_param * params) << moments;
    EXPECT_TRUE(j["async_save_copy_fits_this_host"].get<bool>()) << moments;  // a tiny model
  }
  ASSERT_EQ(cli.run("info -c " + cli.tiny_config()), 0) << cli.log;
  EXPECT_NE(cli.log.find("written behind\n  training (async_save) from a host copy of"), std::string::npos) << cli.log;
}

// `flux8 info` counts the deterministic attention backward's workspace (B·heads·L² bf16 for dP,
// outside the table), and none with deterministic_attention: false.
TEST(InfoCli, CountsTheDeterministicAttentionWorkspace) {
  Cli cli;
  ASSERT_EQ(cli.run("info -c " + cli.tiny_config() + " --json"), 0) << cli.log;
  nlohmann::json j = nlohmann::json::parse(cli.log);
  const double L = j["text_tokens"].get<double>() + j["image_tokens"].get<double>();
  const double heads = static_cast<double>(Config::load(cli.tiny_config(), {}).get_int("num_attention_heads"));
  EXPECT_EQ(j["deterministic_attention_workspace_bytes"].get<double>(), 2.0 * j["batch"].get<double>() * heads * L * L);
  ASSERT_EQ(cli.run("info -c " + cli.tiny_config() + " --set deterministic_attention=false --json"), 0) << cli.log;
  j = nlohmann::json::parse(cli.log);
  EXPECT_EQ(j["deterministic_attention_workspace_bytes"].get<double>(), 0.0);
  ASSERT_EQ(cli.run("info -c " + cli.tiny_config()), 0) << cli.log;
  EXPECT_NE(cli.log.find("keeps dP in a workspace of"), std::string::npos) << cli.log;
}

}  // namespace
}  // namespace flux8::testing
