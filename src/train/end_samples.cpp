#include "train/end_samples.h"

#include <fmt/core.h>

#include <filesystem>
#include <sstream>

#include "config/config.h"
#include "data/text_encoder.h"
#include "io/png.h"
#include "train/progress.h"
#include "train/sampler.h"

namespace flux8 {

namespace {

std::vector<std::string> split_prompts(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string p;
  while (std::getline(ss, p, ';')) {
    const size_t a = p.find_first_not_of(" \t"), b = p.find_last_not_of(" \t");
    if (a != std::string::npos) out.push_back(p.substr(a, b - a + 1));
  }
  return out;
}

}  // namespace

void write_end_of_run_samples(const Config& cfg, const FluxConfig& m, FluxModel& model,
                              const std::string& save_dir, Progress& progress) {
  const std::vector<std::string> prompts = split_prompts(cfg.get_string("sample_prompts"));
  if (prompts.empty()) return;
  if (m.vae_downsample != 1) {
    progress.event("sample_prompts is set, but end-of-run samples need the built-in text encoder of pixel-space "
                   "models; for latent models use `flux8 sample --text-embeddings` (skipped)",
                   nullptr);
    return;
  }
  const DemoTextEncoder encoder(m.text_seq_len, m.context_dim, m.vec_dim);
  std::vector<TextEncoding> enc;
  for (const std::string& p : prompts) enc.push_back(encoder.encode(p));
  SamplerOptions o;
  o.steps = cfg.get_int("sample_steps");
  o.shift = false;  // pixel-space demo: few tokens, no resolution shift
  o.seed = static_cast<uint64_t>(cfg.get_int("seed"));
  o.images_per_prompt = cfg.get_int("samples_per_prompt");
  o.height = o.width = cfg.get_int("image_size") / m.vae_downsample;
  const std::vector<HostTensor> images = sample_images(model, enc, nullptr, o);
  const std::string path = (std::filesystem::path(save_dir) / "samples.png").string();
  const int64_t scale = std::max<int64_t>(1, 128 / o.width);
  write_image_grid(path, images, static_cast<int64_t>(prompts.size()), o.images_per_prompt, scale);
  std::string rows;
  for (size_t i = 0; i < prompts.size(); ++i) rows += fmt::format("\n  row {}: {}", i + 1, prompts[i]);
  progress.event(fmt::format("wrote {} ({} steps, {} images per prompt):{}", path, o.steps, o.images_per_prompt, rows),
                 {{"event", "samples"}, {"path", path}, {"prompts", prompts}});
}

}  // namespace flux8
