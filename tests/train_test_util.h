#pragma once
// A tiny demo training run in a temporary directory, for trainer tests.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "io/safetensors.h"
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

inline std::vector<double> step_losses(const fs::path& metrics) {
  std::vector<double> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  }
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

}  // namespace flux8::testing
