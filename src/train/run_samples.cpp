#include "train/run_samples.h"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "core/error.h"
#include "core/text_file.h"
#include "io/png.h"
#include "train/progress.h"
#include "train/sample_files.h"
#include "train/sampler.h"

namespace flux8 {

namespace fs = std::filesystem;

namespace {

// A PNG's width and height from its IHDR chunk (bytes 16..23, big-endian); 0 when the bytes are
// not a PNG.
std::pair<int64_t, int64_t> png_size(const std::string& bytes) {
  if (bytes.size() < 24 || bytes.compare(1, 3, "PNG") != 0 || bytes.compare(12, 4, "IHDR") != 0) return {0, 0};
  auto be32 = [&](size_t at) {
    int64_t v = 0;
    for (size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(bytes[at + i]);
    return v;
  };
  return {be32(16), be32(20)};
}

}  // namespace

RunSamples::RunSamples(const TrainConfig& cfg, const std::string& decode_script, Progress& progress)
    : cfg_(cfg), progress_(progress), pixel_(cfg.model.vae_downsample == 1) {
  const FluxConfig& m = cfg.model;
  if (!cfg.sample_text_embeddings.empty()) {
    EncodedPrompts e = read_encoded_prompts(cfg.sample_text_embeddings, "sample_text_embeddings");
    for (size_t i = 0; i < e.prompts.size(); ++i) {
      const TextEncoding& p = e.prompts[i];
      if (p.t5.shape.size() != 2 || p.t5.shape[1] != m.context_dim || p.clip.numel() != m.vec_dim)
        fail(
            "sample_text_embeddings {}: prompt {} ({}) has t5 [{}] and clip of {} values; model {} needs t5 "
            "[tokens, {}] and clip [{}]: encode the prompts with the text encoders the training data used",
            cfg.sample_text_embeddings, i, e.labels[i], fmt::join(p.t5.shape, ", "), p.clip.numel(), m.name,
            m.context_dim, m.vec_dim);
    }
    prompts_ = std::move(e.prompts);
    labels_ = std::move(e.labels);
  } else if (pixel_) {
    const DemoTextEncoder encoder(m.text_seq_len, m.context_dim, m.vec_dim);
    for (const std::string& p : cfg.sample_prompts) prompts_.push_back(encoder.encode(p));
    labels_ = cfg.sample_prompts;
  } else if (!cfg.sample_prompts.empty()) {
    progress.note(
        "sample_prompts is set, but a latent model samples from encoded prompts: set sample_text_embeddings to a "
        "file written by tools/encode_prompts.py (no samples in this run)");
  }
  if (pixel_ || prompts_.empty()) return;
  if (cfg.sample_vae.empty()) {
    progress.note(
        "samples: no sample_vae in the config, so samples are kept as latents (STEM.latents.safetensors); set "
        "sample_vae to the Flux VAE to get PNGs, or decode them later with tools/decode_latents.py");
    return;
  }
  LatentDecoder d{decode_script, cfg.sample_vae};
  const DecodeOutcome check = check_latent_decoder(d);
  if (check.ok()) {
    decoder_ = d;
    return;
  }
  // A VAE that will not load is a setting to fix now; missing Python packages leave latents.
  if (check.status == DecodeOutcome::Status::failed)
    fail("sample_vae {}: the decoder cannot run: {}; fix sample_vae or leave it empty to keep latents", cfg.sample_vae,
         check.reason);
  progress.note(fmt::format("samples: kept as latents, not decoded to PNG: {}", check.reason));
}

bool RunSamples::preview_due(int64_t step) const {
  return has_prompts() && cfg_.sample_interval > 0 && step % cfg_.sample_interval == 0;
}

void RunSamples::write_preview(FluxModel& model, int64_t step) {
  const fs::path dir = fs::path(cfg_.save_dir) / "samples";
  fs::create_directories(dir);
  draw(model, (dir / fmt::format("step-{:07d}", step)).string(), step, "samples/preview");
}

void RunSamples::write_end_of_run(FluxModel& model, int64_t step) {
  if (has_prompts()) draw(model, (fs::path(cfg_.save_dir) / "samples").string(), step, "samples/final");
}

void RunSamples::draw(FluxModel& model, const std::string& stem, int64_t step, const std::string& tag) {
  const auto t0 = std::chrono::steady_clock::now();
  const FluxConfig& m = cfg_.model;
  SamplerOptions o;
  o.steps = cfg_.sample_steps;
  o.shift = !pixel_;  // the pixel-space demo has too few tokens for the resolution shift
  o.guidance = cfg_.sample_guidance;
  o.seed = cfg_.seed;
  o.images_per_prompt = cfg_.samples_per_prompt;
  o.height = o.width = cfg_.image_size / m.vae_downsample;
  const std::vector<HostTensor> images = sample_images(model, prompts_, nullptr, o);
  const auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  const std::string png = stem + ".png";
  if (pixel_) {
    const int64_t scale = std::max<int64_t>(1, 128 / o.width);
    write_image_grid(png, images, static_cast<int64_t>(prompts_.size()), o.images_per_prompt, scale);
    publish(png, step, tag, seconds());
    return;
  }
  const std::string latents = stem + ".latents.safetensors";
  write_sample_latents(latents, images, o,
                       {"flux8 train", m.name, labels_, cfg_.image_size, cfg_.objective.vae_scale,
                        cfg_.objective.vae_shift, m.guidance_embed});
  const DecodeOutcome decoded = decoder_ ? decode_latents_to_png(*decoder_, latents, png) : DecodeOutcome{};
  if (decoded.ok()) {
    publish(png, step, tag, seconds());
    return;
  }
  progress_.event(fmt::format("samples at step {}: wrote {}{}", step, latents,
                              decoder_ ? fmt::format(" (not decoded: {})", decoded.reason) : ""),
                  RecordKind::sample, {{"event", "sample"}, {"step", step}, {"tag", tag}, {"latents", latents}});
}

void RunSamples::publish(const std::string& png, int64_t step, const std::string& tag, double seconds) {
  std::string error;
  const std::optional<std::string> bytes = read_file_text(png, error, uint64_t{1} << 30);
  if (!bytes) fail("samples: cannot read back {}: {}", png, error);
  const auto [width, height] = png_size(*bytes);
  if (width == 0) fail("samples: {} is not a PNG file", png);
  std::string rows;
  for (size_t i = 0; i < labels_.size(); ++i) rows += fmt::format("\n  row {}: {}", i + 1, labels_[i]);
  progress_.image(tag, step, *bytes, static_cast<int>(width), static_cast<int>(height));
  progress_.event(fmt::format("samples at step {}: wrote {} ({}x{} px, {} images per prompt, {:.1f} s):{}", step, png,
                              width, height, cfg_.samples_per_prompt, seconds, rows),
                  RecordKind::sample,
                  {{"event", "sample"},
                   {"step", step},
                   {"tag", tag},
                   {"path", png},
                   {"width", width},
                   {"height", height},
                   {"prompts", labels_},
                   {"seconds", seconds}});
}

}  // namespace flux8
