#include "model/input_batch.h"

#include <fmt/format.h>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "core/error.h"
#include "io/safetensors.h"

namespace flux8 {

Tensor InputBatch::make(Shape shape, const std::vector<double>& values) {
  const Tensor t = buffers_.make(shape);
  from_host(buffers_.backend(), t, values);
  return t;
}

void InputBatch::load(const SafetensorsReader& file, const FluxConfig& cfg, const std::string& prefix) {
  auto read = [&](const std::string& name, std::vector<int64_t>& shape) {
    const std::string full = prefix + name;
    if (!file.contains(full))
      fail(
          "inputs {}: tensor '{}' is missing (inputs are img, img_ids, txt, txt_ids, timesteps, "
          "y{})",
          file.path(), full, cfg.guidance_embed ? ", guidance" : "");
    const SafetensorsTensor& t = file.tensor(full);
    shape = t.shape;
    std::vector<double> v(static_cast<size_t>(t.numel()));
    file.read_f64(full, v.data());
    return v;
  };
  auto expect = [&](const std::string& name, const std::vector<int64_t>& got, const std::vector<int64_t>& want) {
    if (got != want)
      fail("inputs {}: tensor '{}{}' has shape [{}], expected [{}]", file.path(), prefix, name, fmt::join(got, ", "),
           fmt::join(want, ", "));
  };
  std::vector<int64_t> s;
  std::vector<double> img = read("img", s);
  if (s.size() != 3) fail("inputs {}: '{}img' must be [batch, image tokens, {}]", file.path(), prefix, cfg.in_channels);
  const int64_t B = s[0], Li = s[1];
  expect("img", s, {B, Li, cfg.in_channels});
  std::vector<double> txt = read("txt", s);
  if (s.size() != 3) fail("inputs {}: '{}txt' must be [batch, text tokens, {}]", file.path(), prefix, cfg.context_dim);
  const int64_t Lt = s[1];
  expect("txt", s, {B, Lt, cfg.context_dim});

  // Position ids: [L, 3] shared by the batch, or [B, L, 3].
  auto ids = [&](const std::string& name, int64_t L) {
    std::vector<double> v = read(name, s);
    if (s == std::vector<int64_t>{L, 3}) {
      std::vector<double> b;
      for (int64_t i = 0; i < B; ++i) b.insert(b.end(), v.begin(), v.end());
      return make(Shape{B, L, 3}, b);
    }
    expect(name, s, {B, L, 3});
    return make(Shape{B, L, 3}, v);
  };
  // Per-sample scalars: [B], or [1] / [] shared by the batch.
  auto per_sample = [&](const std::string& name) {
    std::vector<double> v = read(name, s);
    if (v.size() == 1 && B != 1)
      v.assign(static_cast<size_t>(B), v[0]);
    else
      expect(name, s, {B});
    return make(Shape{B}, v);
  };
  inputs_.img = make(Shape{B, Li, cfg.in_channels}, img);
  inputs_.txt = make(Shape{B, Lt, cfg.context_dim}, txt);
  inputs_.img_ids = ids("img_ids", Li);
  inputs_.txt_ids = ids("txt_ids", Lt);
  inputs_.timesteps = per_sample("timesteps");
  std::vector<double> y = read("y", s);
  expect("y", s, {B, cfg.vec_dim});
  inputs_.y = make(Shape{B, cfg.vec_dim}, y);
  if (cfg.guidance_embed) inputs_.guidance = per_sample("guidance");
}

}  // namespace flux8
