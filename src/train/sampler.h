#pragma once
// Euler sampling of a rectified-flow model (docs/FLUX.md): the model predicts the velocity
// v = ε − x0, so integrating dx/dt = v from t = 1 (pure noise) to t = 0 gives an image.
//
//   t_i = 1 − i/N, i = 0..N        (optionally shifted: t ← shift_timestep(t, image tokens))
//   x   = ε ~ N(0, 1)              (keyed as sampler_noise() says)
//   x  += (t_{i+1} − t_i) · v(x, t_i)
//
// with true classifier-free guidance v = v_u + s·(v_c − v_u) when cfg_scale s ≠ 1 (v_u with
// the empty prompt), and the guidance-embedding input set to `guidance` on guidance_embed
// models. All images of one prompt run as one batch (two forwards per step with CFG).
#include <cstdint>
#include <vector>

#include "data/sample.h"
#include "data/text_encoder.h"  // TextEncoding

namespace flux8 {

class FluxModel;

struct SamplerOptions {
  int64_t steps = 20;
  bool shift = true;       // resolution-dependent timestep shift
  double guidance = 3.5;   // guidance-embedding input; ignored by other models
  double cfg_scale = 1.0;  // classifier-free guidance scale; 1 = off (one forward/step)
  uint64_t seed = 0;
  int64_t images_per_prompt = 4;
  int64_t height = 0, width = 0;  // in latent cells: image pixels / vae_downsample
};

// The starting noise of image `image` of prompt `prompt`: element i of the [C, h, w] array
// (row-major) is rng_normal(seed, rng_stream("sample", prompt, image), i). Keying by
// (prompt, image) makes an image independent of how many prompts or images are sampled with
// it, and of the batch it runs in.
HostTensor sampler_noise(uint64_t seed, int64_t prompt, int64_t image, int64_t channels, int64_t h, int64_t w);

// Samples opts.images_per_prompt images for each prompt. `empty` (the empty prompt's
// encodings) is needed only when cfg_scale ≠ 1. Returns the images prompt-major (image k of
// prompt p at p·K + k), each [latent_channels, height, width] in the model's space
// (normalised latents, or pixels for pixel-space models). Fails naming the prompt on a
// wrong-shaped encoding and on sizes that do not fit the model.
std::vector<HostTensor> sample_images(FluxModel& model, const std::vector<TextEncoding>& prompts,
                                      const TextEncoding* empty, const SamplerOptions& opts);

// The N + 1 timesteps from 1 to 0, shifted for `image_tokens` when `shift`.
std::vector<double> sampling_timesteps(int64_t steps, bool shift, int64_t image_tokens);

}  // namespace flux8
