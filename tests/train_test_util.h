#pragma once
// A tiny demo training run in a temporary directory, for trainer tests.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/transfer.h"
#include "data/demo.h"
#include "data/loader.h"
#include "io/safetensors.h"
#include "train/batch_pipeline.h"
#include "train/objective.h"
#include "train/trainer.h"

namespace flux8::testing {

namespace fs = std::filesystem;

struct RunDir {
  fs::path root;
  explicit RunDir(const std::string& tag = "trainer")
      : root(fs::temp_directory_path() / ("flux8_" + tag + "_" + std::to_string(::getpid()))) {
    fs::remove_all(root);
    fs::create_directories(root);
    // backend: cpu — these tests check the CPU backend's exact behaviour even on a GPU machine.
    std::ofstream(root / "exp.yaml") << "include: " << FLUX8_SOURCE_DIR << "/configs/demo.yaml\n"
                                     << "backend: cpu\n"
                                     << "hidden_size: 24\nnum_attention_heads: 2\naxes_dim: [2, 4, 6]\n"
                                     << "num_double_blocks: 1\nnum_single_blocks: 1\ncontext_dim: 8\nvec_dim: 8\n"
                                     << "text_seq_len: 4\nimage_size: 8\nmicro_batch_size: 2\nglobal_batch_size: 4\n"
                                     << "train_iters: 6\nlr_warmup_iters: 2\ndemo_train_samples: 48\n"
                                     << "demo_val_samples: 8\ndata_shuffle_buffer: 16\nsave_interval: 0\n"
                                     << "eval_interval: 0\nlog_interval: 1\nsample_prompts: \"\"\nthreads: 2\n"
                                     << "train_data: " << (root / "data" / "train-*.tar").string() << "\n"
                                     << "valid_data: " << (root / "data" / "val-*.tar").string() << "\n"
                                     << "empty_prompt_file: " << (root / "data" / "empty_prompt").string() << "\n";
  }
  ~RunDir() { fs::remove_all(root); }
  TrainOptions options(const std::string& save) const {
    TrainOptions o;
    o.config_path = (root / "exp.yaml").string();
    o.overrides = {"save_dir=" + (root / save).string()};
    return o;
  }
};

// Every record of a metrics.jsonl.
inline std::vector<nlohmann::json> read_jsonl(const fs::path& metrics) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

inline std::vector<double> step_losses(const fs::path& metrics) {
  std::vector<double> out;
  for (const nlohmann::json& j : read_jsonl(metrics))
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  return out;
}

// The records of a metrics.jsonl's resume events, in order.
inline std::vector<nlohmann::json> resume_records(const fs::path& metrics) {
  std::vector<nlohmann::json> out;
  for (const nlohmann::json& j : read_jsonl(metrics))
    if (j.value("event", "") == "resume") out.push_back(j);
  return out;
}

inline void expect_same_tensors(const std::string& a, const std::string& b) {
  const SafetensorsReader fa(a), fb(b);
  ASSERT_EQ(fa.names(), fb.names());
  for (const std::string& n : fa.names()) {
    const auto &ta = fa.tensor(n), &tb = fb.tensor(n);
    ASSERT_EQ(ta.nbytes, tb.nbytes) << n;
    EXPECT_EQ(0, std::memcmp(ta.data, tb.data, ta.nbytes)) << n << " differs";
  }
}

// A run with data_overlap off against one with data_overlap `overlap` (on, auto) that stops
// after step 3 — the producer has read step 4's samples by then — and resumes: the same losses,
// final validation loss and step-6 checkpoint bit for bit. Both take the `extra` overrides and
// save under dir.root / "off" and "on".
// Trains `o` for `stop` steps, stops (save_interval must checkpoint there), resumes and trains to
// its end, `total` steps: the run that crosses a checkpoint and a resume.
inline void train_across_a_resume(TrainOptions o, int64_t stop, int64_t total) {
  o.stop_after = stop;
  EXPECT_TRUE(run_training(o).stopped_early);
  o.resume = true;
  o.stop_after = 0;
  EXPECT_EQ(run_training(o).steps_done, total);
}

inline void expect_overlap_changes_nothing(const RunDir& dir, const std::vector<std::string>& extra,
                                           const std::string& overlap) {
  auto options = [&](const char* save, const std::string& value) {
    TrainOptions o = dir.options(save);
    o.overrides.insert(o.overrides.end(), extra.begin(), extra.end());
    o.overrides.push_back("data_overlap=" + value);
    return o;
  };
  const TrainResult a = run_training(options("off", "off"));
  TrainOptions on = options("on", overlap);
  on.stop_after = 3;
  EXPECT_TRUE(run_training(on).stopped_early);
  on.resume = true;
  on.stop_after = 0;
  const TrainResult b = run_training(on);
  EXPECT_EQ(b.steps_done, 6);
  EXPECT_EQ(step_losses(dir.root / "on" / "metrics.jsonl"), step_losses(dir.root / "off" / "metrics.jsonl"));
  EXPECT_EQ(a.last_val_loss, b.last_val_loss);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    expect_same_tensors((dir.root / "off" / "step-0000006" / file).string(),
                        (dir.root / "on" / "step-0000006" / file).string());
}

// The demo model of RunDir's config as a FluxConfig (8 px images, 16 image tokens).
// `n` demo samples (8 px images) for the tiny model, from demo sample `first` on.
inline std::vector<Sample> demo_batch(const FluxConfig& cfg, int n, int first = 0) {
  DemoSpec spec;
  spec.image_size = 8;
  spec.text_seq_len = cfg.text_seq_len;
  spec.context_dim = cfg.context_dim;
  spec.vec_dim = cfg.vec_dim;
  std::vector<Sample> samples;
  for (int i = first; i < first + n; ++i) samples.push_back(demo_sample(spec, i));
  return samples;
}

// The empty prompt's encodings as zeros.
inline EmptyPrompt zero_prompt(const FluxConfig& cfg) {
  return EmptyPrompt{HostTensor{{cfg.text_seq_len, cfg.context_dim},
                                std::vector<float>(static_cast<size_t>(cfg.text_seq_len * cfg.context_dim), 0.0f)},
                     HostTensor{{cfg.vec_dim}, std::vector<float>(static_cast<size_t>(cfg.vec_dim), 0.0f)}};
}

#ifdef FLUX8_BINARY
// `flux8 train` of dir's config into dir.root / save, one OpenMP thread, then `extra`: a command
// line for run_mpi.
inline std::string train_args(const RunDir& dir, const std::string& save, const std::string& extra = "") {
  return std::string(FLUX8_BINARY) + " train -c " + (dir.root / "exp.yaml").string() +
         " --set save_dir=" + (dir.root / save).string() + " --set threads=1 " + extra;
}
#endif

#ifdef FLUX8_MPIEXEC
// Runs `mpirun -np N <args>` (FLUX8_MPIEXEC: the launcher CMake found; one OpenMP thread a rank,
// Open MPI allowed as root and in containers; no leak check under AddressSanitizer, as for
// tests/mpi: cmake/mpi_tests.cmake says why)
// with its output in `log_file` and *log; returns the exit status (-1 if it did not exit).
inline int run_mpi(int np, const std::string& args, const fs::path& log_file, std::string* log) {
  const std::string cmd = std::string("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ") +
                          "OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1 " +
                          "ASAN_OPTIONS=detect_leaks=0 " + FLUX8_MPIEXEC + " -np " + std::to_string(np) +
                          " --oversubscribe " + args + " > " + log_file.string() + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(log_file);
  *log = std::string(std::istreambuf_iterator<char>(in), {});
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}
#endif

inline FluxConfig tiny_demo_model() {
  FluxConfig c;
  c.name = "tiny";
  c.hidden_size = 24;
  c.num_heads = 2;
  c.num_double_blocks = 1;
  c.num_single_blocks = 1;
  c.in_channels = 12;
  c.out_channels = 12;
  c.context_dim = 8;
  c.vec_dim = 8;
  c.axes_dim = {2, 4, 6};
  c.latent_channels = 3;
  c.vae_downsample = 1;
  c.text_seq_len = 4;
  return c;
}

// The tiny demo model and a demo dataset for it in a temporary directory (the batch pipeline
// tests).
struct PipelineFixture {
  testing::RunDir dir{"batch_pipeline"};
  FluxConfig model = tiny_demo_model();
  ObjectiveConfig obj;
  EmptyPrompt empty;
  PipelineFixture() {
    DemoSpec spec;
    spec.image_size = 8;
    spec.text_seq_len = model.text_seq_len;
    spec.context_dim = model.context_dim;
    spec.vec_dim = model.vec_dim;
    spec.train_samples = 23;
    spec.val_samples = 2;
    spec.samples_per_shard = 5;
    write_demo_dataset((dir.root / "data").string(), spec);
    empty =
        EmptyPrompt{HostTensor{{model.text_seq_len, model.context_dim},
                               std::vector<float>(static_cast<size_t>(model.text_seq_len * model.context_dim), 0.5f)},
                    HostTensor{{model.vec_dim}, std::vector<float>(static_cast<size_t>(model.vec_dim), -0.5f)}};
    obj.text_dropout = 0.3;  // some samples take the empty prompt
  }
  LoaderOptions loader_options(bool single_pass = false) const {
    LoaderOptions o;
    o.source = (dir.root / "data" / "train-*.tar").string();
    o.seed = 5;
    o.shuffle_buffer = single_pass ? 0 : 7;
    o.prefetch = 3;
    o.single_pass = single_pass;
    return o;
  }
  BatchPipelineSpec spec(BatchPipelineSpec::Mode mode, int64_t global, int64_t micro, int64_t first,
                         int64_t end) const {
    BatchPipelineSpec s{model, obj, empty, 99, global, micro, first, end};
    s.mode = mode;
    return s;
  }
};

// Everything a micro-batch puts on the device, read back.
struct Downloaded {
  std::vector<double> img, target, img_ids, txt, txt_ids, t, y;
  bool operator==(const Downloaded&) const = default;
};
inline Downloaded download(Backend& be, const FluxInputs& in, const Tensor& target) {
  return Downloaded{to_host(be, in.img),     to_host(be, target),       to_host(be, in.img_ids), to_host(be, in.txt),
                    to_host(be, in.txt_ids), to_host(be, in.timesteps), to_host(be, in.y)};
}

}  // namespace flux8::testing
