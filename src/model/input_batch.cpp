#include "model/input_batch.h"

#include <fmt/format.h>

#include <initializer_list>
#include <limits>
#include <optional>
#include <utility>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "core/checked.h"
#include "core/error.h"
#include "io/safetensors.h"

namespace flux8 {

namespace {

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// Checks every input's presence, dtype and shape from the file's header alone: nothing is read
// or allocated until the shapes agree with each other and with the model, so a small file
// claiming a large batch fails here instead of in an allocation or a model op.
class InputCheck {
 public:
  InputCheck(const SafetensorsReader& file, const FluxConfig& cfg, const std::string& prefix)
      : file_(file), cfg_(cfg), prefix_(prefix) {}

  InputBatch::Extent run() {
    const std::vector<int64_t>& img = stored("img").shape;
    if (img.size() != 3 || img[2] != cfg_.in_channels)
      bad("img", img,
          fmt::format("must be [batch, image tokens, {}] (in_channels of model '{}')", cfg_.in_channels, cfg_.name));
    InputBatch::Extent e{img[0], img[1], 0};
    if (e.batch == 0) bad("img", img, "holds no sample: the batch must be at least 1");
    if (e.image_tokens == 0) bad("img", img, "holds no image tokens: each sample needs at least one");

    const std::vector<int64_t>& txt = stored("txt").shape;
    if (txt.size() != 3 || txt[0] != e.batch || txt[2] != cfg_.context_dim)
      bad("txt", txt,
          fmt::format("must be [{}, text tokens, {}] (the batch of 'img', context_dim of model '{}')", e.batch,
                      cfg_.context_dim, cfg_.name));
    e.text_tokens = txt[1];
    if (e.text_tokens == 0) bad("txt", txt, "holds no text tokens: each sample needs at least one");

    position_ids("img_ids", e.batch, e.image_tokens);
    position_ids("txt_ids", e.batch, e.text_tokens);
    per_sample("timesteps", e.batch);
    const std::vector<int64_t>& y = stored("y").shape;
    if (y != std::vector<int64_t>{e.batch, cfg_.vec_dim})
      bad("y", y,
          fmt::format("must be [{}, {}] (the batch of 'img', vec_dim of model '{}')", e.batch, cfg_.vec_dim,
                      cfg_.name));
    if (cfg_.guidance_embed) per_sample("guidance", e.batch);
    return e;
  }

 private:
  const SafetensorsTensor& stored(const std::string& name) const {
    const std::string full = prefix_ + name;
    if (!file_.contains(full))
      fail("inputs {}: tensor '{}' is missing (inputs are img, img_ids, txt, txt_ids, timesteps, y{})", file_.path(),
           full, cfg_.guidance_embed ? ", guidance" : "");
    const SafetensorsTensor& t = file_.tensor(full);
    if (!safetensors_converts(t.dtype))
      fail("inputs {}: tensor '{}' has dtype {}; inputs must be F32, F64, BF16, F16, I32 or I64", file_.path(), full,
           t.dtype);
    return t;
  }
  [[noreturn]] void bad(const std::string& name, const std::vector<int64_t>& shape, const std::string& rule) const {
    fail("inputs {}: tensor '{}{}' has shape {}; it {}", file_.path(), prefix_, name, shape_text(shape), rule);
  }
  // [L, 3] shared by the batch, or [B, L, 3].
  void position_ids(const std::string& name, int64_t batch, int64_t tokens) const {
    const std::vector<int64_t>& s = stored(name).shape;
    if (s != std::vector<int64_t>{tokens, 3} && s != std::vector<int64_t>{batch, tokens, 3})
      bad(name, s,
          fmt::format("must be [{}, 3] or [{}, {}, 3] (the tokens and batch of the features)", tokens, batch, tokens));
  }
  // [B], or one value ([1] or []) shared by the batch.
  void per_sample(const std::string& name, int64_t batch) const {
    const std::vector<int64_t>& s = stored(name).shape;
    const bool shared = s.empty() || s == std::vector<int64_t>{1};
    if (!shared && s != std::vector<int64_t>{batch})
      bad(name, s, fmt::format("must be [{}] (one value per sample) or [1] (one for all)", batch));
  }

  const SafetensorsReader& file_;
  const FluxConfig& cfg_;
  const std::string& prefix_;
};

// `v` repeated until it holds `n` values (a shared input broadcast over the batch); the checks
// above made n a multiple of v.size().
std::vector<double> tiled(std::vector<double> v, int64_t n) {
  const std::vector<double> one = std::move(v);
  std::vector<double> out;
  out.reserve(static_cast<size_t>(n));
  while (out.size() < static_cast<size_t>(n)) out.insert(out.end(), one.begin(), one.end());
  return out;
}

}  // namespace

Tensor InputBatch::make(Shape shape, const std::vector<double>& values) {
  const Tensor t = buffers_.make(shape);
  from_host(buffers_.backend(), t, values);
  return t;
}

InputBatch::Extent InputBatch::check(const SafetensorsReader& file, const FluxConfig& cfg, const std::string& prefix) {
  return InputCheck(file, cfg, prefix).run();
}

void InputBatch::load(const SafetensorsReader& file, const FluxConfig& cfg, const std::string& prefix) {
  const Extent e = check(file, cfg, prefix);
  // Sizes of the broadcast inputs: img holds B·Li·in_channels stored values, so these fit, but
  // they are products of numbers from the file and are computed as such.
  const auto count = [&](std::initializer_list<int64_t> dims) {
    const std::optional<uint64_t> n = checked_product(dims, uint64_t(std::numeric_limits<int64_t>::max()));
    if (!n)
      fail("inputs {}: batch {} with {} image and {} text tokens is too large", file.path(), e.batch, e.image_tokens,
           e.text_tokens);
    return static_cast<int64_t>(*n);
  };
  const auto values = [&](const std::string& name, int64_t n) {
    const std::string full = prefix + name;
    std::vector<double> v(static_cast<size_t>(file.tensor(full).numel()));
    file.read_f64(full, v.data());
    return tiled(std::move(v), n);
  };
  const int64_t B = e.batch, Li = e.image_tokens, Lt = e.text_tokens;
  inputs_.img = make(Shape{B, Li, cfg.in_channels}, values("img", count({B, Li, cfg.in_channels})));
  inputs_.txt = make(Shape{B, Lt, cfg.context_dim}, values("txt", count({B, Lt, cfg.context_dim})));
  inputs_.img_ids = make(Shape{B, Li, 3}, values("img_ids", count({B, Li, 3})));
  inputs_.txt_ids = make(Shape{B, Lt, 3}, values("txt_ids", count({B, Lt, 3})));
  inputs_.timesteps = make(Shape{B}, values("timesteps", B));
  inputs_.y = make(Shape{B, cfg.vec_dim}, values("y", count({B, cfg.vec_dim})));
  if (cfg.guidance_embed) inputs_.guidance = make(Shape{B}, values("guidance", B));
}

}  // namespace flux8
