// `flux8 data synthetic`'s shards: the MLPerf fields at the spec's shapes, deterministic in the
// seed, read by the loader and assembled into a training batch like real preprocessed data.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "data/loader.h"
#include "data/synthetic.h"
#include "test_util.h"
#include "train/objective.h"

namespace flux8 {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

SyntheticLatentSpec small_spec() {
  SyntheticLatentSpec s;
  s.latent_channels = 2;
  s.latent_side = 4;
  s.text_seq_len = 3;
  s.context_dim = 5;
  s.vec_dim = 6;
  s.samples = 5;
  s.samples_per_shard = 2;
  s.seed = 11;
  return s;
}

std::vector<Sample> read_all(const std::string& dir) {
  LoaderOptions o;
  o.source = dir + "/train-*.tar";
  o.single_pass = true;
  DataLoader loader(o);
  std::vector<Sample> out;
  for (Sample s; loader.next(s);) out.push_back(s);
  return out;
}

TEST(SyntheticData, ShardsHoldMlperfFieldsThatMakeATrainingBatch) {
  TempDir tmp;
  std::ofstream(tmp.path("train-000009.tar")) << "left by an earlier run";
  const SyntheticLatentSpec spec = small_spec();
  const uint64_t bytes = write_synthetic_latent_dataset(tmp.path(), spec);
  EXPECT_FALSE(fs::exists(tmp.path("train-000009.tar")));
  EXPECT_TRUE(fs::exists(tmp.path("train-000002.tar")));  // 5 samples, 2 a shard
  EXPECT_FALSE(fs::exists(tmp.path("train-000003.tar")));
  const std::vector<Sample> samples = read_all(tmp.path());
  ASSERT_EQ(samples.size(), 5u);
  EXPECT_GT(bytes, 5u * 4 * (2 * 16 + 15 + 6));  // the values, and the .npy headers
  for (const Sample& s : samples) {
    EXPECT_EQ(s.at("mean").shape, (std::vector<int64_t>{2, 4, 4}));
    EXPECT_EQ(s.at("logvar").shape, (std::vector<int64_t>{2, 4, 4}));
    EXPECT_EQ(s.at("t5").shape, (std::vector<int64_t>{3, 5}));
    EXPECT_EQ(s.at("clip").shape, (std::vector<int64_t>{6}));
    const auto [lo, hi] = std::minmax_element(s.at("logvar").data.begin(), s.at("logvar").data.end());
    EXPECT_GE(*lo, -7.0f);
    EXPECT_LE(*hi, -5.0f);
  }
  EXPECT_NE(samples[0].at("mean").data, samples[1].at("mean").data);

  // The same seed writes the same values; another seed others.
  TempDir again;
  write_synthetic_latent_dataset(again.path(), spec);
  EXPECT_EQ(read_all(again.path())[3].at("t5").data, samples[3].at("t5").data);
  SyntheticLatentSpec other = spec;
  other.seed = 12;
  write_synthetic_latent_dataset(again.path(), other);
  EXPECT_NE(read_all(again.path())[3].at("t5").data, samples[3].at("t5").data);

  // A batch for a model of these sizes: the VAE draw over (mean, logvar), 2x2 patches.
  FluxConfig m;
  m.latent_channels = 2;
  m.patch_size = 2;
  m.in_channels = 8;
  m.out_channels = 8;
  m.context_dim = 5;
  m.vec_dim = 6;
  m.text_seq_len = 3;
  const EmptyPrompt empty{HostTensor{{3, 5}, std::vector<float>(15)}, HostTensor{{6}, std::vector<float>(6)}};
  const HostBatch b = make_train_batch(samples, m, ObjectiveConfig{}, empty, 1, 0, 0, 0);
  EXPECT_EQ(b.batch, 5);
  EXPECT_EQ(b.img_tokens, 4);
  EXPECT_EQ(b.txt_tokens, 3);
  EXPECT_EQ(b.x0.size(), 5u * 4 * 8);
}

TEST(SyntheticData, RejectsBadSpec) {
  TempDir tmp;
  SyntheticLatentSpec spec = small_spec();
  spec.samples_per_shard = 0;
  EXPECT_NE(testing::error_of([&] { write_synthetic_latent_dataset(tmp.path(), spec); }).find("samples_per_shard"),
            std::string::npos);
  spec = small_spec();
  spec.context_dim = -1;
  EXPECT_THROW(write_synthetic_latent_dataset(tmp.path(), spec), Error);
}

}  // namespace
}  // namespace flux8
