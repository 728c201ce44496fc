#pragma once
// The files around sampling a latent model: the encoded prompts it reads (written by
// tools/encode_prompts.py) and the latents it writes (read by tools/decode_latents.py).
//
// Encoded prompts (.safetensors):
//   t5.<i>  [tokens, context_dim], clip.<i> [vec_dim]   prompt i = 0, 1, ...
//   t5.empty, clip.empty                                the empty prompt (optional; for CFG)
//   metadata "prompts": a JSON list of the prompts' text (optional; labels in logs and files)
// Latents (.safetensors):
//   latents [images, latent_channels, h, w] F32, prompt-major (image k of prompt p at p·K + k),
//   in the VAE's space: z = x / vae_scale_factor + vae_shift_factor
//   metadata: producer, model, prompts (JSON list), images_per_prompt, image_size, steps, shift,
//   cfg_scale, guidance (guidance_embed models), seed, vae_scale_factor, vae_shift_factor
#include <optional>
#include <string>
#include <vector>

#include "data/text_encoder.h"
#include "model/flux_config.h"
#include "train/sampler.h"

namespace flux8 {

struct EncodedPrompts {
  std::vector<TextEncoding> prompts;
  std::optional<TextEncoding> empty;
  std::vector<std::string> labels;  // the file's "prompts", else "<PATH t5.i>"
};

// Reads an encoded-prompts file; `who` ("sample: --text-embeddings", "sample_text_embeddings")
// starts every error message.
EncodedPrompts read_encoded_prompts(const std::string& path, const std::string& who);

struct LatentsFileInfo {
  std::string producer, model;
  std::vector<std::string> labels;
  int64_t image_size = 0;
  double vae_scale = 1, vae_shift = 0;
  bool guidance_embed = false;
};

// Writes `images` (the sampler's output, in the model's normalised space) as a latents file.
void write_sample_latents(const std::string& path, const std::vector<HostTensor>& images, const SamplerOptions& so,
                          const LatentsFileInfo& info);

}  // namespace flux8
