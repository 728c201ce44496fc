#include "train/run_data.h"

#include <fmt/core.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/error.h"
#include "core/text_file.h"
#include "data/demo.h"
#include "data/loader.h"
#include "data/webdataset.h"
#include "io/safetensors.h"

namespace flux8 {

namespace fs = std::filesystem;

namespace {

DemoSpec demo_spec(const TrainConfig& cfg) {
  DemoSpec s;
  s.image_size = cfg.image_size;
  s.text_seq_len = cfg.model.text_seq_len;
  s.context_dim = cfg.model.context_dim;
  s.vec_dim = cfg.model.vec_dim;
  s.train_samples = cfg.demo_train_samples;
  s.val_samples = cfg.demo_val_samples;
  s.seed = cfg.seed;
  return s;
}

// An empty prompt's embedding: a few hundred KB for any real text encoder, bounded like the
// other small files flux8 reads whole.
HostTensor read_npy_file(const std::string& path) {
  const std::string bytes = read_text_or_fail(path, "empty_prompt_file (prefix + .t5.npy / .clip.npy)");
  return decode_npy(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
}

}  // namespace

bool prepare_demo_data(const TrainConfig& cfg) {
  if (!cfg.demo_data) return false;  // (TrainConfig checked the model and train_data)
  const fs::path dir = fs::path(cfg.train_data).parent_path();
  const DemoSpec spec = demo_spec(cfg);
  if (demo_dataset_matches(dir.string(), spec)) return false;
  fmt::print("generating the demo dataset in {} ({} train + {} validation samples, {}x{} px)\n", dir.string(),
             spec.train_samples, spec.val_samples, spec.image_size, spec.image_size);
  std::fflush(stdout);
  write_demo_dataset(dir.string(), spec);
  return true;
}

EmptyPrompt load_empty_prompt(const TrainConfig& cfg) {
  const FluxConfig& m = cfg.model;
  const std::string& path = cfg.empty_prompt_file;
  EmptyPrompt e;
  if (path.empty()) {
    e.t5 = HostTensor{{m.text_seq_len, m.context_dim},
                      std::vector<float>(static_cast<size_t>(m.text_seq_len * m.context_dim), 0.0f)};
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
    fail("empty_prompt_file {}: t5 must be [tokens, {}] and clip [{}] for this model", path, m.context_dim, m.vec_dim);
  return e;
}

std::vector<Sample> load_validation_set(const TrainConfig& cfg) {
  std::vector<Sample> out;
  const std::string& source = cfg.valid_data;
  if (source.empty()) return out;
  LoaderOptions o;
  o.source = source;
  o.single_pass = true;
  o.shuffle_buffer = 0;
  o.skip_corrupt = cfg.data_skip_corrupt;
  o.check = [&model = cfg.model](const Sample& s) { check_sample_fits(s, model); };
  DataLoader loader(o);
  const int64_t limit = cfg.eval_samples;
  Sample s;
  while ((limit == 0 || static_cast<int64_t>(out.size()) < limit) && loader.next(s)) out.push_back(std::move(s));
  return out;
}

}  // namespace flux8
