// `flux8 data demo`: write the embedded demo dataset as WebDataset shards (the same format and
// files a training run with demo_data generates on first use). `flux8 data synthetic`: random
// MLPerf-shaped latent shards for throughput runs at a model's real sizes.
#include <fmt/core.h>

#include "cli/commands.h"
#include "config/config.h"
#include "core/error.h"
#include "data/demo.h"
#include "data/synthetic.h"
#include "model/flux_config.h"

namespace flux8::cli {

Command add_data_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("data", "dataset tools");
  cmd->require_subcommand(1);
  auto* demo =
      cmd->add_subcommand("demo", "write the embedded demo dataset (coloured shapes with captions) as tar shards");
  struct Opts {
    std::string out, config = std::string(FLUX8_SOURCE_DIR) + "/configs/demo.yaml";
    std::vector<std::string> overrides;
    int64_t train = 0, val = 0, per_shard = 1000;
  };
  auto o = std::make_shared<Opts>();
  demo->add_option("--out", o->out, "output directory")->required();
  demo->add_option("-c,--config", o->config, "config giving image_size, text_seq_len, context_dim, vec_dim, seed")
      ->check(CLI::ExistingFile);
  demo->add_option("--set", o->overrides, "override a config key: --set key=value (repeatable)");
  demo->add_option("--train-samples", o->train, "training samples (default: config demo_train_samples)");
  demo->add_option("--val-samples", o->val, "validation samples (default: config demo_val_samples)");
  demo->add_option("--samples-per-shard", o->per_shard, "samples per tar shard");
  struct SyntheticOpts {
    std::string out, config;
    std::vector<std::string> overrides;
    int64_t samples = 256, per_shard = 64;
  };
  auto so = std::make_shared<SyntheticOpts>();
  auto* synthetic = cmd->add_subcommand(
      "synthetic",
      "write random training shards shaped like MLPerf's preprocessed CC12M for a model (VAE mean and logvar, "
      "T5 and CLIP features; nothing to learn): for measuring `flux8 train` throughput at real sizes");
  synthetic->add_option("--out", so->out, "output directory (its train-*.tar are replaced)")->required();
  synthetic
      ->add_option("-c,--config", so->config,
                   "config giving the model (latent_channels, context_dim, vec_dim, text_seq_len), image_size, "
                   "vae_downsample and seed")
      ->required()
      ->check(CLI::ExistingFile);
  synthetic->add_option("--set", so->overrides, "override a config key: --set key=value (repeatable)");
  synthetic->add_option("--samples", so->samples, "samples (default 256)");
  synthetic->add_option("--samples-per-shard", so->per_shard, "samples per tar shard (default 64)");
  auto write_synthetic = [so]() {
    const Config cfg = Config::load(so->config, so->overrides);
    const FluxConfig m = FluxConfig::from_config(cfg);
    const int64_t image = cfg.get_int("image_size");
    if (image % m.vae_downsample)
      fail("flux8 data synthetic: image_size {} ({}) is not a multiple of vae_downsample {}", image,
           cfg.source("image_size"), m.vae_downsample);
    SyntheticLatentSpec spec;
    spec.latent_channels = m.latent_channels;
    spec.latent_side = image / m.vae_downsample;
    spec.text_seq_len = m.text_seq_len;
    spec.context_dim = m.context_dim;
    spec.vec_dim = m.vec_dim;
    spec.samples = so->samples;
    spec.samples_per_shard = so->per_shard;
    spec.seed = static_cast<uint64_t>(cfg.get_int("seed"));
    const uint64_t bytes = write_synthetic_latent_dataset(so->out, spec);
    fmt::print("wrote {}: {} samples in train-*.tar ({:.1f} MB): mean, logvar [{}, {}, {}], t5 [{}, {}], clip [{}]\n",
               so->out, spec.samples, static_cast<double>(bytes) / 1e6, spec.latent_channels, spec.latent_side,
               spec.latent_side, spec.text_seq_len, spec.context_dim, spec.vec_dim);
    return 0;
  };
  return {cmd, [o, synthetic, write_synthetic]() {
            if (synthetic->parsed()) return write_synthetic();
            const Config cfg = Config::load(o->config, o->overrides);
            const FluxConfig m = FluxConfig::from_config(cfg);
            DemoSpec spec;
            spec.image_size = cfg.get_int("image_size");
            spec.text_seq_len = m.text_seq_len;
            spec.context_dim = m.context_dim;
            spec.vec_dim = m.vec_dim;
            spec.train_samples = o->train ? o->train : cfg.get_int("demo_train_samples");
            spec.val_samples = o->val ? o->val : cfg.get_int("demo_val_samples");
            spec.samples_per_shard = o->per_shard;
            spec.seed = static_cast<uint64_t>(cfg.get_int("seed"));
            write_demo_dataset(o->out, spec);
            fmt::print(
                "wrote {}: {} train + {} validation samples ({}x{} px) in train-*.tar / val-*.tar, "
                "empty_prompt.{{t5,clip}}.npy, manifest.json\n",
                o->out, spec.train_samples, spec.val_samples, spec.image_size, spec.image_size);
            return 0;
          }};
}

}  // namespace flux8::cli
