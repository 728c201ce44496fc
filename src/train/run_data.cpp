#include "train/run_data.h"

#include <fmt/core.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "config/config.h"
#include "core/error.h"
#include "data/demo.h"
#include "data/loader.h"
#include "data/webdataset.h"
#include "io/safetensors.h"

namespace flux8 {

namespace fs = std::filesystem;

namespace {

DemoSpec demo_spec(const Config& cfg, const FluxConfig& m) {
  DemoSpec s;
  s.image_size = cfg.get_int("image_size");
  s.text_seq_len = m.text_seq_len;
  s.context_dim = m.context_dim;
  s.vec_dim = m.vec_dim;
  s.train_samples = cfg.get_int("demo_train_samples");
  s.val_samples = cfg.get_int("demo_val_samples");
  s.seed = static_cast<uint64_t>(cfg.get_int("seed"));
  return s;
}

HostTensor read_npy_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open {} (empty_prompt_file prefix + .t5.npy / .clip.npy)", path);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return decode_npy(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
}

}  // namespace

bool prepare_demo_data(const Config& cfg, const FluxConfig& m) {
  if (!cfg.get_bool("demo_data")) return false;
  if (m.vae_downsample != 1 || m.latent_channels != 3)
    fail("demo_data is on, but the model is not a pixel-space RGB model (set vae_downsample: 1 and "
         "latent_channels: 3, as configs/models/flux_tiny_demo.yaml does)");
  const std::string train = cfg.get_string("train_data");
  if (train.empty()) fail("demo_data is on but train_data is empty: set it to DIR/train-*.tar");
  const fs::path dir = fs::path(train).parent_path();
  const DemoSpec spec = demo_spec(cfg, m);
  if (demo_dataset_matches(dir.string(), spec)) return false;
  fmt::print("generating the demo dataset in {} ({} train + {} validation samples, {}x{} px)\n",
             dir.string(), spec.train_samples, spec.val_samples, spec.image_size, spec.image_size);
  std::fflush(stdout);
  write_demo_dataset(dir.string(), spec);
  return true;
}

EmptyPrompt load_empty_prompt(const Config& cfg, const FluxConfig& m) {
  const std::string path = cfg.get_string("empty_prompt_file");
  EmptyPrompt e;
  if (path.empty()) {
    e.t5 = HostTensor{{m.text_seq_len, m.context_dim}, std::vector<float>(static_cast<size_t>(m.text_seq_len * m.context_dim), 0.0f)};
    e.clip = HostTensor{{m.vec_dim}, std::vector<float>(static_cast<size_t>(m.vec_dim), 0.0f)};
    return e;
  }
  if (path.size() > 12 && path.substr(path.size() - 12) == ".safetensors") {
    const SafetensorsReader f(path);
    for (auto [name, dst] : {std::pair{"t5", &e.t5}, std::pair{"clip", &e.clip}}) {
      if (!f.contains(name)) fail("empty_prompt_file {}: no tensor '{}' (needs t5 and clip)", path, name);
      dst->shape = f.tensor(name).shape;
      dst->data.resize(static_cast<size_t>(f.tensor(name).numel()));
      f.read_f32(name, dst->data.data());
    }
  } else {
    e.t5 = read_npy_file(path + ".t5.npy");
    e.clip = read_npy_file(path + ".clip.npy");
  }
  if (e.t5.shape.size() != 2 || e.t5.shape[1] != m.context_dim || e.clip.numel() != m.vec_dim)
    fail("empty_prompt_file {}: t5 must be [tokens, {}] and clip [{}] for this model", path,
         m.context_dim, m.vec_dim);
  return e;
}

std::vector<Sample> load_validation_set(const Config& cfg) {
  std::vector<Sample> out;
  const std::string source = cfg.get_string("valid_data");
  if (source.empty()) return out;
  LoaderOptions o;
  o.source = source;
  o.single_pass = true;
  o.shuffle_buffer = 0;
  o.skip_corrupt = cfg.get_bool("data_skip_corrupt");
  DataLoader loader(o);
  const int64_t limit = cfg.get_int("eval_samples");
  Sample s;
  while ((limit == 0 || static_cast<int64_t>(out.size()) < limit) && loader.next(s)) out.push_back(std::move(s));
  return out;
}

}  // namespace flux8
