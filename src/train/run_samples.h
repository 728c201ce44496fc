#pragma once
// The pictures a training run draws of its own progress: a preview grid every sample_interval
// steps into save_dir/samples/step-NNNNNNN.png, and the grid at the end, save_dir/samples.png.
// One row per prompt, samples_per_prompt images each, sample_steps Euler steps.
//
// Prompts: pixel-space models encode sample_prompts with the demo's text encoder; latent models
// read sample_text_embeddings (tools/encode_prompts.py), whose prompts' text labels the rows.
// Latent samples are written as STEM.latents.safetensors and decoded to STEM.png through
// tools/decode_latents.py with sample_vae (train/latent_decoder.h); when that cannot run (no
// sample_vae, no Python with diffusers) the run says why once, at the start, and keeps the
// latents. Each picture is one metrics.jsonl record of kind "sample".
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/text_encoder.h"
#include "model/flux_model.h"
#include "train/latent_decoder.h"
#include "train/train_config.h"

namespace flux8 {

class Progress;

class RunSamples {
 public:
  // Reads the prompts and, for latent models, checks once that the decoder runs. Call on the
  // rank that writes (rank 0). `decode_script` is tools/decode_latents.py.
  RunSamples(const TrainConfig& cfg, const std::string& decode_script, Progress& progress);

  // Whether the run has prompts to draw, and a preview is due after `step`.
  bool has_prompts() const { return !prompts_.empty(); }
  bool preview_due(int64_t step) const;

  // save_dir/samples/step-NNNNNNN.png (or .latents.safetensors) of the model as it is.
  void write_preview(FluxModel& model, int64_t step);
  // save_dir/samples.png (or samples.latents.safetensors).
  void write_end_of_run(FluxModel& model, int64_t step);

 private:
  // Samples the prompts into STEM.png, through STEM.latents.safetensors for latent models.
  void draw(FluxModel& model, const std::string& stem, int64_t step, const std::string& tag);
  // The one place a picture is published: its log line and metrics record (and any other sink
  // of images, which gets the PNG's bytes and size here).
  void publish(const std::string& png, int64_t step, const std::string& tag, double seconds);

  const TrainConfig& cfg_;
  Progress& progress_;
  bool pixel_ = false;
  std::vector<TextEncoding> prompts_;
  std::vector<std::string> labels_;
  std::optional<LatentDecoder> decoder_;  // latent models whose decoder runs
};

}  // namespace flux8
