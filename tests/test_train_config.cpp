// TrainConfig: the training keys read once, typed, with the checks that span several keys;
// errors name the keys and where they were set.
#include <gtest/gtest.h>

#include <string>

#include "config/config.h"
#include "core/error.h"
#include "test_util.h"
#include "train/train_config.h"

namespace flux8 {
namespace {

std::string demo_config() { return std::string(FLUX8_SOURCE_DIR) + "/configs/demo.yaml"; }

TEST(TrainConfig, ReadsTheDemoConfig) {
  const TrainConfig t = TrainConfig::from_config(Config::load(demo_config(), {}));
  EXPECT_EQ(t.backend, "auto");
  EXPECT_EQ(t.micro_batch, 16);
  EXPECT_EQ(t.global_batch, 16);  // global_batch_size 0: one micro-batch a step
  EXPECT_EQ(t.accumulation, 1);
  EXPECT_EQ(t.train_iters, 600);
  EXPECT_DOUBLE_EQ(t.schedule.lr, 1e-3);
  EXPECT_DOUBLE_EQ(t.schedule.min_lr, 1e-4);
  EXPECT_EQ(t.schedule.warmup_iters, 30);
  EXPECT_EQ(t.schedule.decay_iters, 600);  // lr_decay_iters 0: train_iters
  EXPECT_EQ(t.schedule.style, "cosine");
  EXPECT_TRUE(t.demo_data);
  EXPECT_EQ(t.train_data, "runs/demo/data/train-*.tar");
  EXPECT_EQ(t.save_dir, "runs/demo");
  EXPECT_EQ(t.keep_last_checkpoints, 2);
  EXPECT_EQ(t.eval_interval, 100);
  EXPECT_EQ(t.model.vae_downsample, 1);
  EXPECT_FALSE(t.cuda_graph_set);
  EXPECT_NE(t.config_yaml.find("micro_batch_size"), std::string::npos);
}

TEST(TrainConfig, TypesChoicesAndLists) {
  const TrainConfig t = TrainConfig::from_config(Config::load(
      demo_config(), {"global_batch_size=64", "micro_batch_size=16", "lr_decay_iters=500", "data_overlap=off",
                      "async_save=on", "nan_policy=halt", "cuda_graph=true", "recompute_granularity=full",
                      "sample_prompts='red circle ; ;  blue square top left  '"}));
  EXPECT_EQ(t.global_batch, 64);
  EXPECT_EQ(t.accumulation, 4);
  EXPECT_EQ(t.schedule.decay_iters, 500);
  EXPECT_EQ(t.data_overlap, BatchPipelineSpec::Mode::caller);
  EXPECT_EQ(t.async_save, TrainConfig::AsyncSave::on);
  EXPECT_EQ(t.nan_policy, TrainConfig::NanPolicy::halt);
  EXPECT_TRUE(t.cuda_graph_set);
  EXPECT_EQ(t.recompute, Recompute::full);
  EXPECT_EQ(t.sample_prompts, (std::vector<std::string>{"red circle", "blue square top left"}));
}

TEST(TrainConfig, GlobalBatchMustBeAMultipleOfTheMicroBatch) {
  const std::string msg = testing::error_of([] {
    TrainConfig::from_config(Config::load(demo_config(), {"global_batch_size=24", "micro_batch_size=16"}));
  });
  testing::expect_mentions(msg, {"global_batch_size 24", "micro_batch_size 16", "--set"});
}

TEST(TrainConfig, TrainDataMustBeSet) {
  testing::expect_refused("train_data is empty", [] {
    TrainConfig::from_config(Config::load(demo_config(), {"demo_data=false", "train_data=''"}));
  });
  testing::expect_refused("demo_data is on but train_data is empty",
                          [] { TrainConfig::from_config(Config::load(demo_config(), {"train_data=''"})); });
}

TEST(TrainConfig, DemoDataNeedsAPixelSpaceModel) {
  const std::string msg = testing::error_of([] {
    TrainConfig::from_config(Config::load(demo_config(), {"vae_downsample=8", "latent_channels=16"}));
  });
  testing::expect_mentions(msg, {"demo_data is on", "demo.yaml", "vae_downsample: 1"});
}

}  // namespace
}  // namespace flux8
