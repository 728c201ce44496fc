#include "train/sampler.h"

#include "backend/transfer.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/flux_model.h"
#include "model/input_batch.h"
#include "train/objective.h"

namespace flux8 {

namespace {

constexpr uint64_t kSampleTag = 0x73616D706C65ull;  // "sample"

// `v` repeated `times` times.
std::vector<double> repeat(const std::vector<float>& v, int64_t times) {
  std::vector<double> out;
  out.reserve(v.size() * static_cast<size_t>(times));
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), v.begin(), v.end());
  return out;
}

void check_encoding(const TextEncoding& e, const FluxConfig& c, const std::string& what) {
  if (e.t5.shape.size() != 2 || e.t5.shape[1] != c.context_dim || e.t5.shape[0] < 1)
    fail("sampler: {}: t5 must be [tokens, {}] (the model's context_dim), got rank {} [{}]", what, c.context_dim,
         e.t5.shape.size(), e.t5.shape.empty() ? 0 : e.t5.shape.back());
  if (e.clip.numel() != c.vec_dim)
    fail("sampler: {}: clip has {} values, the model's vec_dim is {}", what, e.clip.numel(), c.vec_dim);
}

// Text conditioning of a K-image batch.
struct TextInputs {
  Tensor txt, txt_ids, y;
};
TextInputs upload_text(InputBatch& batch, const TextEncoding& e, int64_t K, const FluxConfig& c) {
  const int64_t Lt = e.t5.shape[0];
  return {batch.make(Shape{K, Lt, c.context_dim}, repeat(e.t5.data, K)),
          batch.make(Shape{K, Lt, 3}, std::vector<double>(static_cast<size_t>(K * Lt * 3), 0.0)),
          batch.make(Shape{K, c.vec_dim}, repeat(e.clip.data, K))};
}

}  // namespace

HostTensor sampler_noise(uint64_t seed, int64_t prompt, int64_t image, int64_t channels, int64_t h, int64_t w) {
  HostTensor x{{channels, h, w}, std::vector<float>(static_cast<size_t>(channels * h * w))};
  const uint64_t stream = rng_stream(kSampleTag, static_cast<uint64_t>(prompt), static_cast<uint64_t>(image));
  for (size_t i = 0; i < x.data.size(); ++i) x.data[i] = rng_normal(seed, stream, i);
  return x;
}

std::vector<double> sampling_timesteps(int64_t steps, bool shift, int64_t image_tokens) {
  if (steps < 1) fail("sampler: steps must be at least 1, got {}", steps);
  std::vector<double> t(static_cast<size_t>(steps + 1));
  for (int64_t i = 0; i <= steps; ++i) {
    const double u = 1.0 - static_cast<double>(i) / static_cast<double>(steps);
    t[static_cast<size_t>(i)] = shift ? shift_timestep(u, image_tokens) : u;
  }
  return t;
}

std::vector<HostTensor> sample_images(FluxModel& model, const std::vector<TextEncoding>& prompts,
                                      const TextEncoding* empty, const SamplerOptions& o) {
  const FluxConfig& c = model.config();
  const int64_t C = c.latent_channels, p = c.patch_size, K = o.images_per_prompt;
  const int64_t h = o.height, w = o.width;
  if (K < 1) fail("sampler: images per prompt must be at least 1, got {}", K);
  if (h < 1 || w < 1 || h % p || w % p)
    fail(
        "sampler: a {}x{} latent grid is not a positive multiple of the patch size {} (image "
        "side in pixels must be a multiple of patch_size * vae_downsample = {})",
        h, w, p, p * c.vae_downsample);
  if (C * p * p != c.in_channels || c.out_channels != c.in_channels)
    fail(
        "sampler: model {}: latent_channels {} x patch {}x{} = {} features per token, but "
        "in_channels is {} and out_channels {}; they must all agree to sample",
        c.name, C, p, p, C * p * p, c.in_channels, c.out_channels);
  const bool cfg = o.cfg_scale != 1.0;
  if (cfg && !empty) fail("sampler: cfg_scale {} needs the empty prompt's encodings", o.cfg_scale);
  for (size_t i = 0; i < prompts.size(); ++i) check_encoding(prompts[i], c, fmt::format("prompt {}", i));
  if (cfg) check_encoding(*empty, c, "empty prompt");

  const int64_t Li = (h / p) * (w / p), F = c.in_channels;
  const std::vector<double> ts = sampling_timesteps(o.steps, o.shift, Li);
  const std::vector<double> ids = image_position_ids(h, w, p);
  Backend& be = model.backend();
  std::vector<HostTensor> out;
  for (size_t pi = 0; pi < prompts.size(); ++pi) {
    // x: the K images' packed tokens [K, Li, F].
    std::vector<double> x;
    x.reserve(static_cast<size_t>(K * Li * F));
    for (int64_t k = 0; k < K; ++k) {
      int64_t rows = 0, cols = 0;
      const std::vector<double> tok =
          pack_patches(sampler_noise(o.seed, static_cast<int64_t>(pi), k, C, h, w), p, &rows, &cols);
      x.insert(x.end(), tok.begin(), tok.end());
    }
    InputBatch batch(be, model.dtype());
    FluxInputs cond;
    cond.img = batch.make(Shape{K, Li, F}, x);
    std::vector<double> all_ids;
    for (int64_t k = 0; k < K; ++k) all_ids.insert(all_ids.end(), ids.begin(), ids.end());
    cond.img_ids = batch.make(Shape{K, Li, 3}, all_ids);
    cond.timesteps = batch.make(Shape{K}, std::vector<double>(static_cast<size_t>(K), 1.0));
    if (c.guidance_embed) cond.guidance = batch.make(Shape{K}, std::vector<double>(static_cast<size_t>(K), o.guidance));
    const TextInputs tc = upload_text(batch, prompts[pi], K, c);
    cond.txt = tc.txt, cond.txt_ids = tc.txt_ids, cond.y = tc.y;
    FluxInputs uncond = cond;
    if (cfg) {
      const TextInputs tu = upload_text(batch, *empty, K, c);
      uncond.txt = tu.txt, uncond.txt_ids = tu.txt_ids, uncond.y = tu.y;
    }

    for (int64_t i = 0; i < o.steps; ++i) {
      const double t_cur = ts[static_cast<size_t>(i)], t_next = ts[static_cast<size_t>(i + 1)];
      from_host(be, cond.img, x);
      from_host(be, cond.timesteps, std::vector<double>(static_cast<size_t>(K), t_cur));
      std::vector<double> v = to_host(be, model.forward(cond));
      if (cfg) {
        const std::vector<double> vu = to_host(be, model.forward(uncond));
        for (size_t j = 0; j < v.size(); ++j) v[j] = vu[j] + o.cfg_scale * (v[j] - vu[j]);
      }
      for (size_t j = 0; j < x.size(); ++j) x[j] += (t_next - t_cur) * v[j];
    }
    for (int64_t k = 0; k < K; ++k) {
      const std::vector<double> img = unpack_patches(x.data() + k * Li * F, C, h, w, p);
      out.push_back(HostTensor{{C, h, w}, std::vector<float>(img.begin(), img.end())});
    }
  }
  return out;
}

}  // namespace flux8
