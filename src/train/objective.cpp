#include "train/objective.h"

#include <cmath>
#include <functional>

#include "config/config.h"
#include "core/error.h"
#include "core/rng.h"

namespace flux8 {

ObjectiveConfig ObjectiveConfig::from_config(const Config& c) {
  ObjectiveConfig o;
  o.timestep_sampling = c.get_string("timestep_sampling");
  o.logit_mean = c.get_float("logit_mean");
  o.logit_std = c.get_float("logit_std");
  o.timestep_shift = c.get_bool("timestep_shift");
  o.text_dropout = c.get_float("text_dropout");
  o.vae_scale = c.get_float("vae_scale_factor");
  o.vae_shift = c.get_float("vae_shift_factor");
  o.train_guidance = c.get_float("train_guidance");
  return o;
}

uint64_t train_stream(uint64_t step, uint64_t rank, uint64_t index, Draw what) {
  return rng_stream(0x747261696eull /*"train"*/ ^ static_cast<uint64_t>(what), step, rank, index);
}

uint64_t validation_stream(uint64_t j, Draw what) {
  return rng_stream(0x76616cull /*"val"*/ ^ static_cast<uint64_t>(what), j);
}

std::vector<double> pack_patches(const HostTensor& x, int64_t p, int64_t* rows, int64_t* cols) {
  if (x.shape.size() != 3) fail("expected a [channels, height, width] tensor, got rank {}", x.shape.size());
  const int64_t C = x.shape[0], h = x.shape[1], w = x.shape[2];
  if (h % p || w % p) fail("image/latent of {}x{} is not divisible by the patch size {}", h, w, p);
  const int64_t gh = h / p, gw = w / p, F = C * p * p;
  std::vector<double> out(static_cast<size_t>(gh * gw * F));
  for (int64_t c = 0; c < C; ++c)
    for (int64_t y = 0; y < h; ++y)
      for (int64_t xx = 0; xx < w; ++xx) {
        const int64_t token = (y / p) * gw + xx / p, feature = c * p * p + (y % p) * p + xx % p;
        out[static_cast<size_t>(token * F + feature)] = x.data[static_cast<size_t>((c * h + y) * w + xx)];
      }
  *rows = gh * gw;
  *cols = F;
  return out;
}

std::vector<double> unpack_patches(const double* tokens, int64_t C, int64_t h, int64_t w, int64_t p) {
  const int64_t gw = w / p, F = C * p * p;
  std::vector<double> out(static_cast<size_t>(C * h * w));
  for (int64_t c = 0; c < C; ++c)
    for (int64_t y = 0; y < h; ++y)
      for (int64_t xx = 0; xx < w; ++xx)
        out[static_cast<size_t>((c * h + y) * w + xx)] =
            tokens[(y / p) * gw * F + (xx / p) * F + c * p * p + (y % p) * p + xx % p];
  return out;
}

std::vector<double> image_position_ids(int64_t h, int64_t w, int64_t p) {
  std::vector<double> ids;
  for (int64_t r = 0; r < h / p; ++r)
    for (int64_t c = 0; c < w / p; ++c) ids.insert(ids.end(), {0.0, double(r), double(c)});
  return ids;
}

double shift_timestep(double t, int64_t image_tokens) {
  const double mu = 0.5 + 0.65 * static_cast<double>(image_tokens - 256) / 3840.0;
  if (t <= 0) return 0;
  return std::exp(mu) / (std::exp(mu) + 1.0 / t - 1.0);
}

namespace {

// The clean sample x0 as [C, h, w]: VAE posterior resampled and normalised, a latent as is,
// or demo pixels as they are.
HostTensor clean_sample(const Sample& s, const ObjectiveConfig& obj, uint64_t seed, uint64_t vae_stream) {
  if (s.has("mean")) {
    const HostTensor& mean = s.at("mean");
    const HostTensor& logvar = s.at("logvar");
    if (mean.shape != logvar.shape)
      fail("sample {} in {}: mean and logvar shapes differ", s.key, s.shard);
    HostTensor z{mean.shape, std::vector<float>(mean.data.size())};
    for (size_t i = 0; i < z.data.size(); ++i) {
      const double eps = rng_normal(seed, vae_stream, i);
      const double v = mean.data[i] + std::exp(0.5 * logvar.data[i]) * eps;
      z.data[i] = static_cast<float>(obj.vae_scale * (v - obj.vae_shift));
    }
    return z;
  }
  if (s.has("latent")) return s.at("latent");
  if (s.has("image")) return s.at("image");
  fail("sample {} in {} has no image data: expected mean+logvar (MLPerf), latent(s) or image", s.key, s.shard);
}

struct PerSample {
  double t;
  bool drop_text;
  uint64_t vae_stream, flow_stream;
};

HostBatch assemble(const std::vector<Sample>& samples, const FluxConfig& m, const ObjectiveConfig& obj,
                   const EmptyPrompt* empty, uint64_t seed, const std::function<PerSample(size_t)>& draw) {
  if (samples.empty()) fail("empty batch");
  HostBatch b;
  b.batch = static_cast<int64_t>(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    const Sample& s = samples[i];
    const PerSample d = draw(i);
    const HostTensor x = clean_sample(s, obj, seed, d.vae_stream);
    int64_t rows = 0, cols = 0;
    const std::vector<double> tokens = pack_patches(x, m.patch_size, &rows, &cols);
    if (cols != m.in_channels)
      fail("sample {} in {}: {} channels x {}x{} patches = {} features per token, but the model's "
           "in_channels is {}", s.key, s.shard, x.shape[0], m.patch_size, m.patch_size, cols, m.in_channels);
    const HostTensor& t5 = d.drop_text ? empty->t5 : s.at("t5");
    const HostTensor& clip = d.drop_text ? empty->clip : s.at("clip");
    if (t5.shape.size() != 2 || t5.shape[1] != m.context_dim)
      fail("sample {} in {}: t5 must be [tokens, {}] (context_dim)", s.key, s.shard, m.context_dim);
    if (clip.numel() != m.vec_dim)
      fail("sample {} in {}: clip has {} values, the model's vec_dim is {}", s.key, s.shard, clip.numel(), m.vec_dim);
    if (i == 0) {
      b.img_tokens = rows;
      b.txt_tokens = t5.shape[0];
    } else if (rows != b.img_tokens || t5.shape[0] != b.txt_tokens) {
      fail("sample {} in {}: {} image and {} text tokens, but this batch has {} and {}; samples of one "
           "batch must share their resolution and text length", s.key, s.shard, rows, t5.shape[0],
           b.img_tokens, b.txt_tokens);
    }
    b.x0.insert(b.x0.end(), tokens.begin(), tokens.end());
    const std::vector<double> ids = image_position_ids(x.shape[1], x.shape[2], m.patch_size);
    b.img_ids.insert(b.img_ids.end(), ids.begin(), ids.end());
    b.txt.insert(b.txt.end(), t5.data.begin(), t5.data.end());
    b.y.insert(b.y.end(), clip.data.begin(), clip.data.end());
    b.t.push_back(d.t);
    b.guidance.push_back(obj.train_guidance);
    b.noise_streams.push_back(d.flow_stream);
  }
  b.txt_ids.assign(static_cast<size_t>(b.batch * b.txt_tokens * 3), 0.0);
  return b;
}

}  // namespace

HostBatch make_train_batch(const std::vector<Sample>& samples, const FluxConfig& m,
                           const ObjectiveConfig& obj, const EmptyPrompt& empty, uint64_t seed,
                           uint64_t step, uint64_t rank, int64_t first_index) {
  if (obj.timestep_sampling != "uniform" && obj.timestep_sampling != "logit_normal")
    fail("timestep_sampling '{}' is not one of uniform, logit_normal", obj.timestep_sampling);
  int64_t img_tokens = -1;  // for the shift; known after packing the first sample
  HostBatch b = assemble(samples, m, obj, &empty, seed, [&](size_t i) {
    const uint64_t index = static_cast<uint64_t>(first_index) + i;
    PerSample d;
    const uint64_t ts = train_stream(step, rank, index, Draw::timestep);
    if (obj.timestep_sampling == "uniform") {
      d.t = rng_uniform(seed, ts, 0);
    } else {
      const double n = rng_normal(seed, ts, 0);
      d.t = 1.0 / (1.0 + std::exp(-(obj.logit_mean + obj.logit_std * n)));
    }
    d.drop_text = rng_uniform(seed, train_stream(step, rank, index, Draw::text_dropout), 0) < obj.text_dropout;
    d.vae_stream = train_stream(step, rank, index, Draw::vae_noise);
    d.flow_stream = train_stream(step, rank, index, Draw::flow_noise);
    return d;
  });
  img_tokens = b.img_tokens;
  if (obj.timestep_shift)
    for (double& t : b.t) t = shift_timestep(t, img_tokens);
  return b;
}

HostBatch make_validation_batch(const std::vector<Sample>& samples, const FluxConfig& m,
                                const ObjectiveConfig& obj, uint64_t seed, int64_t first_index) {
  return assemble(samples, m, obj, nullptr, seed, [&](size_t i) {
    const uint64_t j = static_cast<uint64_t>(first_index) + i;
    // MLPerf's COCO validation samples carry their bucket ("timestep": 0..7) in the json.
    const Sample& s = samples[i];
    const double bucket = s.has("timestep") && !s.at("timestep").data.empty()
                              ? static_cast<double>(s.at("timestep").data[0])
                              : static_cast<double>(j % 8);
    if (bucket < 0 || bucket > 7 || bucket != std::floor(bucket))
      fail("validation sample {} in {}: timestep bucket {} is not an integer in 0..7", s.key, s.shard, bucket);
    return PerSample{bucket / 8.0, false, validation_stream(j, Draw::vae_noise), validation_stream(j, Draw::flow_noise)};
  });
}

}  // namespace flux8
