#include "train/objective.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <tuple>
#include <utility>

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

namespace {
// The patch grid of x [C, h, w]: tokens (rows) and features a token (cols).
std::pair<int64_t, int64_t> patch_grid(const std::vector<int64_t>& shape, int64_t p) {
  if (shape.size() != 3) fail("expected a [channels, height, width] tensor, got rank {}", shape.size());
  const int64_t C = shape[0], h = shape[1], w = shape[2];
  if (h % p || w % p) fail("image/latent of {}x{} is not divisible by the patch size {}", h, w, p);
  return {(h / p) * (w / p), C * p * p};
}

template <typename T>
void pack_patches_to(const HostTensor& x, int64_t p, T* out) {
  const int64_t C = x.shape[0], h = x.shape[1], w = x.shape[2];
  const int64_t gw = w / p, F = C * p * p;
  for (int64_t c = 0; c < C; ++c)
    for (int64_t y = 0; y < h; ++y)
      for (int64_t xx = 0; xx < w; ++xx) {
        const int64_t token = (y / p) * gw + xx / p, feature = c * p * p + (y % p) * p + xx % p;
        out[token * F + feature] = x.data[static_cast<size_t>((c * h + y) * w + xx)];
      }
}
}  // namespace

std::vector<double> pack_patches(const HostTensor& x, int64_t p, int64_t* rows, int64_t* cols) {
  std::tie(*rows, *cols) = patch_grid(x.shape, p);
  std::vector<double> out(static_cast<size_t>(*rows * *cols));
  pack_patches_to(x, p, out.data());
  return out;
}

void pack_patches_into(const HostTensor& x, int64_t p, float* out) {
  patch_grid(x.shape, p);  // the checks
  pack_patches_to(x, p, out);
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

// The field x0 comes from (mean: the VAE posterior, with logvar; a latent; demo pixels), checked.
const HostTensor& image_field(const Sample& s) {
  if (s.has("mean")) {
    if (!s.has("logvar")) fail("sample {} in {} has a VAE mean but no logvar", s.key, s.shard);
    if (s.at("mean").shape != s.at("logvar").shape)
      fail("sample {} in {}: mean and logvar shapes differ", s.key, s.shard);
    return s.at("mean");
  }
  if (s.has("latent")) return s.at("latent");
  if (s.has("image")) return s.at("image");
  fail("sample {} in {} has no image data: expected mean+logvar (MLPerf), latent(s) or image", s.key, s.shard);
}

// x0 of a sample with a VAE posterior (mean and logvar, shapes checked by image_field): a draw
// from it, normalised.
HostTensor vae_draw(const Sample& s, const ObjectiveConfig& obj, uint64_t seed, uint64_t vae_stream) {
  const HostTensor& mean = s.at("mean");
  const HostTensor& logvar = s.at("logvar");
  HostTensor z{mean.shape, std::vector<float>(mean.data.size())};
  // Each draw is keyed by its element: the same values from any number of threads. (Threads
  // here only when the batch's samples are not already spread over them: W2's 2 samples of
  // 262k elements each.)
  const int64_t n = static_cast<int64_t>(z.data.size());
#pragma omp parallel for if (!omp_in_parallel() && n >= 65536)
  for (int64_t i = 0; i < n; ++i) {
    const size_t k = static_cast<size_t>(i);
    const double eps = rng_normal(seed, vae_stream, static_cast<uint64_t>(i));
    const double v = mean.data[k] + std::exp(0.5 * logvar.data[k]) * eps;
    z.data[k] = static_cast<float>(obj.vae_scale * (v - obj.vae_shift));
  }
  return z;
}

}  // namespace

void check_sample_fits(const Sample& s, const FluxConfig& m) {
  const HostTensor& image = image_field(s);
  const int64_t features = patch_grid(image.shape, m.patch_size).second;
  if (features != m.in_channels)
    fail("sample {} in {}: {} channels x {}x{} patches = {} features per token, but the model's in_channels is {}",
         s.key, s.shard, image.shape[0], m.patch_size, m.patch_size, features, m.in_channels);
  const HostTensor& t5 = s.at("t5");
  if (t5.shape.size() != 2 || t5.shape[1] != m.context_dim)
    fail("sample {} in {}: t5 must be [tokens, {}] (context_dim)", s.key, s.shard, m.context_dim);
  if (s.at("clip").numel() != m.vec_dim)
    fail("sample {} in {}: clip has {} values, the model's vec_dim is {}", s.key, s.shard, s.at("clip").numel(),
         m.vec_dim);
}

namespace {

struct PerSample {
  double t;
  bool drop_text;
  uint64_t vae_stream, flow_stream;
};

// Every sample checked and the batch sized first (in order: the first sample that does not fit is
// the one named), then each sample's VAE draw, patches and features written into its rows by
// the CPU's threads — W1's batch is 32 samples of 4 MB of text features. Each sample's values
// depend on its draws only, so the batch is the same whatever the threads.
// Into `b`, whose vectors are reused: a batch of the last one's size is written in place, without
// allocating (or the kernel zeroing) W1's 134 MB of text features again.
void assemble(HostBatch& b, const std::vector<Sample>& samples, const FluxConfig& m, const ObjectiveConfig& obj,
              const EmptyPrompt* empty, uint64_t seed, const std::function<PerSample(size_t)>& draw) {
  if (samples.empty()) fail("empty batch");
  const size_t n = samples.size();
  b.batch = static_cast<int64_t>(n);
  b.t.clear();
  b.guidance.clear();
  b.noise_streams.clear();
  std::vector<PerSample> draws(n);
  std::vector<const HostTensor*> images(n), t5s(n), clips(n);
  int64_t cols = 0;
  for (size_t i = 0; i < n; ++i) {
    const Sample& s = samples[i];
    draws[i] = draw(i);
    const HostTensor& image = *(images[i] = &image_field(s));
    const auto [rows, features] = patch_grid(image.shape, m.patch_size);
    if (features != m.in_channels)
      fail(
          "sample {} in {}: {} channels x {}x{} patches = {} features per token, but the model's "
          "in_channels is {}",
          s.key, s.shard, image.shape[0], m.patch_size, m.patch_size, features, m.in_channels);
    const HostTensor& t5 = draws[i].drop_text ? empty->t5 : s.at("t5");
    const HostTensor& clip = draws[i].drop_text ? empty->clip : s.at("clip");
    if (t5.shape.size() != 2 || t5.shape[1] != m.context_dim)
      fail("sample {} in {}: t5 must be [tokens, {}] (context_dim)", s.key, s.shard, m.context_dim);
    if (clip.numel() != m.vec_dim)
      fail("sample {} in {}: clip has {} values, the model's vec_dim is {}", s.key, s.shard, clip.numel(), m.vec_dim);
    if (i == 0) {
      b.img_tokens = rows;
      b.txt_tokens = t5.shape[0];
      cols = features;
    } else if (rows != b.img_tokens || t5.shape[0] != b.txt_tokens) {
      fail(
          "sample {} in {}: {} image and {} text tokens, but this batch has {} and {}; samples of one "
          "batch must share their resolution and text length",
          s.key, s.shard, rows, t5.shape[0], b.img_tokens, b.txt_tokens);
    }
    t5s[i] = &t5;
    clips[i] = &clip;
    b.t.push_back(draws[i].t);
    b.guidance.push_back(obj.train_guidance);
    b.noise_streams.push_back(draws[i].flow_stream);
  }
  const size_t x_per = static_cast<size_t>(b.img_tokens * cols), ids_per = static_cast<size_t>(b.img_tokens * 3);
  const size_t t_per = static_cast<size_t>(b.txt_tokens * m.context_dim), y_per = static_cast<size_t>(m.vec_dim);
  b.x0.resize(n * x_per);
  b.img_ids.resize(n * ids_per);
  b.txt.resize(n * t_per);
  b.y.resize(n * y_per);
  std::vector<std::exception_ptr> errors(n);
  // Sample by sample over the threads when there are enough samples to share; with a few (W2's
  // 2) each sample's VAE draw spreads over them instead (vae_draw).
#pragma omp parallel for schedule(dynamic) if (2 * static_cast <int>(n) >= omp_get_max_threads())
  for (int64_t k = 0; k < static_cast<int64_t>(n); ++k) {
    const size_t i = static_cast<size_t>(k);
    try {
      // A VAE posterior is drawn from; a latent or demo pixels are packed as they are.
      HostTensor drawn;
      const HostTensor& x =
          samples[i].has("mean") ? (drawn = vae_draw(samples[i], obj, seed, draws[i].vae_stream)) : *images[i];
      pack_patches_into(x, m.patch_size, b.x0.data() + i * x_per);
      const std::vector<double> ids = image_position_ids(x.shape[1], x.shape[2], m.patch_size);
      std::copy(ids.begin(), ids.end(), b.img_ids.begin() + static_cast<std::ptrdiff_t>(i * ids_per));
      std::copy(t5s[i]->data.begin(), t5s[i]->data.end(), b.txt.begin() + static_cast<std::ptrdiff_t>(i * t_per));
      std::copy(clips[i]->data.begin(), clips[i]->data.end(), b.y.begin() + static_cast<std::ptrdiff_t>(i * y_per));
    } catch (...) {
      errors[i] = std::current_exception();
    }
  }
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  b.txt_ids.assign(static_cast<size_t>(b.batch * b.txt_tokens * 3), 0.0);
}

}  // namespace

HostBatch make_train_batch(const std::vector<Sample>& samples, const FluxConfig& m, const ObjectiveConfig& obj,
                           const EmptyPrompt& empty, uint64_t seed, uint64_t step, uint64_t rank, int64_t first_index) {
  HostBatch b;
  make_train_batch(b, samples, m, obj, empty, seed, step, rank, first_index);
  return b;
}

void make_train_batch(HostBatch& b, const std::vector<Sample>& samples, const FluxConfig& m, const ObjectiveConfig& obj,
                      const EmptyPrompt& empty, uint64_t seed, uint64_t step, uint64_t rank, int64_t first_index) {
  if (obj.timestep_sampling != "uniform" && obj.timestep_sampling != "logit_normal")
    fail("timestep_sampling '{}' is not one of uniform, logit_normal", obj.timestep_sampling);
  int64_t img_tokens = -1;  // for the shift; known after packing the first sample
  assemble(b, samples, m, obj, &empty, seed, [&](size_t i) {
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
}

HostBatch make_validation_batch(const std::vector<Sample>& samples, const FluxConfig& m, const ObjectiveConfig& obj,
                                uint64_t seed, int64_t first_index) {
  HostBatch b;
  assemble(b, samples, m, obj, nullptr, seed, [&](size_t i) {
    const uint64_t j = static_cast<uint64_t>(first_index) + i;
    // MLPerf's COCO validation samples carry their bucket ("timestep": 0..7) in the json.
    const Sample& s = samples[i];
    const double bucket = s.has("timestep") && !s.at("timestep").data.empty()
                              ? static_cast<double>(s.at("timestep").data[0])
                              : static_cast<double>(j % 8);
    if (bucket < 0 || bucket > 7 || bucket != std::floor(bucket))
      fail("validation sample {} in {}: timestep bucket {} is not an integer in 0..7", s.key, s.shard, bucket);
    return PerSample{bucket / 8.0, false, validation_stream(j, Draw::vae_noise),
                     validation_stream(j, Draw::flow_noise)};
  });
  return b;
}

}  // namespace flux8
