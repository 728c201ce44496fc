#include "train/end_samples.h"

#include <fmt/core.h>

#include <filesystem>

#include "core/text_file.h"
#include "data/text_encoder.h"
#include "io/png.h"
#include "train/progress.h"
#include "train/sampler.h"

namespace flux8 {

void write_end_of_run_samples(const TrainConfig& cfg, FluxModel& model, int64_t step, Progress& progress) {
  const FluxConfig& m = cfg.model;
  const std::vector<std::string>& prompts = cfg.sample_prompts;
  if (prompts.empty()) return;
  if (m.vae_downsample != 1) {
    progress.note(
        "sample_prompts is set, but end-of-run samples need the built-in text encoder of pixel-space "
        "models; for latent models use `flux8 sample --text-embeddings` (skipped)");
    return;
  }
  const DemoTextEncoder encoder(m.text_seq_len, m.context_dim, m.vec_dim);
  std::vector<TextEncoding> enc;
  for (const std::string& p : prompts) enc.push_back(encoder.encode(p));
  SamplerOptions o;
  o.steps = cfg.sample_steps;
  o.shift = false;  // pixel-space demo: few tokens, no resolution shift
  o.seed = cfg.seed;
  o.images_per_prompt = cfg.samples_per_prompt;
  o.height = o.width = cfg.image_size / m.vae_downsample;
  const std::vector<HostTensor> images = sample_images(model, enc, nullptr, o);
  const std::string path = (std::filesystem::path(cfg.save_dir) / "samples.png").string();
  const int64_t scale = std::max<int64_t>(1, 128 / o.width);
  int64_t width = 0, height = 0;
  const std::vector<uint8_t> rgb =
      image_grid_rgb8(images, static_cast<int64_t>(prompts.size()), o.images_per_prompt, scale, 2, &width, &height);
  write_png_rgb8(path, width, height, rgb);
  progress.image("samples", step, read_text_or_fail(path, "sample grid"), static_cast<int>(width),
                 static_cast<int>(height));
  std::string rows;
  for (size_t i = 0; i < prompts.size(); ++i) rows += fmt::format("\n  row {}: {}", i + 1, prompts[i]);
  progress.event(fmt::format("wrote {} ({} steps, {} images per prompt):{}", path, o.steps, o.images_per_prompt, rows),
                 RecordKind::sample, {{"event", "samples"}, {"step", step}, {"path", path}, {"prompts", prompts}});
}

}  // namespace flux8
