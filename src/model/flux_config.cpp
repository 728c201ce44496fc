#include "model/flux_config.h"

#include <fmt/ranges.h>

#include <array>
#include <optional>

#include "config/config.h"
#include "config/schema.h"
#include "core/checked.h"
#include "core/error.h"

namespace flux8 {

int64_t FluxConfig::image_tokens(int64_t pixels) const {
  // One token per patch_size x patch_size block of latent cells, each cell vae_downsample pixels.
  const std::optional<int64_t> cell = checked_mul(vae_downsample, patch_size);
  if (pixels <= 0 || !cell || *cell <= 0 || pixels % *cell != 0)
    fail(
        "model '{}': image size {} pixels is not a positive multiple of vae_downsample ({}) * "
        "patch_size ({}) = {}; pick image_size as a multiple of {}",
        name, pixels, vae_downsample, patch_size, cell.value_or(0), cell.value_or(0));
  const int64_t side = pixels / *cell;
  const std::optional<int64_t> tokens = checked_mul(side, side);
  if (!tokens) fail("model '{}': image size {} pixels gives more image tokens than flux8 can count", name, pixels);
  return *tokens;
}

FluxConfig FluxConfig::from_config(const Config& cfg) {
  FluxConfig m;
  m.name = cfg.get_string("model_name");
  m.hidden_size = cfg.get_int("hidden_size");
  m.num_heads = cfg.get_int("num_attention_heads");
  m.num_double_blocks = cfg.get_int("num_double_blocks");
  m.num_single_blocks = cfg.get_int("num_single_blocks");
  m.in_channels = cfg.get_int("in_channels");
  m.out_channels = cfg.get_int("out_channels");
  if (m.out_channels == 0) m.out_channels = m.in_channels;  // schema: 0 means "same as input"
  m.context_dim = cfg.get_int("context_dim");
  m.vec_dim = cfg.get_int("vec_dim");
  m.mlp_ratio = cfg.get_float("mlp_ratio");
  m.guidance_embed = cfg.get_bool("guidance_embed");
  m.qkv_bias = cfg.get_bool("qkv_bias");
  m.axes_dim.clear();
  for (int64_t d : cfg.get_int_list("axes_dim")) {
    // The schema's range keeps every entry well inside int.
    const std::optional<int> axis = checked_cast<int>(d);
    FLUX8_CHECK(axis, "axes_dim entry {} from {} fits an int", d, cfg.source("axes_dim"));
    m.axes_dim.push_back(*axis);
  }
  m.rope_theta = cfg.get_float("rope_theta");
  m.qk_norm_eps = cfg.get_float("qk_norm_eps");
  m.layernorm_eps = cfg.get_float("layernorm_eps");
  m.latent_channels = cfg.get_int("latent_channels");
  m.patch_size = cfg.get_int("patch_size");
  m.vae_downsample = cfg.get_int("vae_downsample");
  m.text_seq_len = cfg.get_int("text_seq_len");
  const std::string where = cfg.path().empty() ? "config" : cfg.path();
  m.validate(where);
  // Fails now, not at the first batch.
  m.check_step(cfg.get_int("micro_batch_size"), cfg.get_int("image_size"), where);
  return m;
}

void FluxConfig::validate(const std::string& where) const {
  // Single-key ranges are already checked by the schema for YAML input; repeated here, from the
  // same table, because a FluxConfig can also be built in code (tests, tools), and the derived
  // sizes (head dim, MLP width, tokens, parameter counts) rely on them.
  auto in_range = [&](const char* key, auto v) {
    const KeySpec* spec = find_config_key(key);
    FLUX8_CHECK(spec, "model key {} is registered in the schema", key);
    if (!spec->range.contains(static_cast<double>(v)))
      fail("model config {}: {} must be {}, got {}", where, key, describe_allowed(*spec), v);
  };
  in_range("hidden_size", hidden_size);
  in_range("num_attention_heads", num_heads);
  in_range("num_double_blocks", num_double_blocks);
  in_range("num_single_blocks", num_single_blocks);
  in_range("in_channels", in_channels);
  in_range("context_dim", context_dim);
  in_range("vec_dim", vec_dim);
  in_range("latent_channels", latent_channels);
  in_range("patch_size", patch_size);
  in_range("vae_downsample", vae_downsample);
  in_range("text_seq_len", text_seq_len);
  in_range("mlp_ratio", mlp_ratio);
  in_range("rope_theta", rope_theta);
  in_range("qk_norm_eps", qk_norm_eps);
  in_range("layernorm_eps", layernorm_eps);
  in_range("out_channels", out_channels);
  if (out_channels < 1)
    fail("model config {}: out_channels (0 in YAML means in_channels) must be >= 1, got {}", where, out_channels);
  if (mlp_hidden() < 1)
    fail("model config {}: mlp_ratio ({}) * hidden_size ({}) must give an MLP width >= 1", where, mlp_ratio,
         hidden_size);
  validate_heads_and_axes(where);
}

void FluxConfig::validate_heads_and_axes(const std::string& where) const {
  if (hidden_size % num_heads != 0)
    fail("model config {}: hidden_size ({}) must be divisible by num_attention_heads ({})", where, hidden_size,
         num_heads);
  const int64_t d = head_dim();
  // RoPE rotates adjacent pairs of each head vector, so every axis needs an even width.
  if (d % 2 != 0)
    fail(
        "model config {}: head dim hidden_size/num_attention_heads = {}/{} = {} must be even "
        "(RoPE rotates pairs)",
        where, hidden_size, num_heads, d);
  // A token's position id has kPositionAxes numbers (Flux: index, row, column), one per axis.
  if (axes_dim.size() != kPositionAxes)
    fail(
        "model config {}: axes_dim has {} entries but must have {}, one RoPE width per position axis "
        "(index, row, column), summing to the head dim {}",
        where, axes_dim.size(), kPositionAxes, d);
  int64_t sum = 0;
  for (size_t i = 0; i < axes_dim.size(); ++i) {
    if (axes_dim[i] <= 0 || axes_dim[i] % 2 != 0)
      fail("model config {}: axes_dim[{}] = {} must be a positive even number (RoPE rotates pairs)", where, i,
           axes_dim[i]);
    sum += axes_dim[i];
  }
  if (sum != d)
    fail(
        "model config {}: axes_dim [{}] sums to {} but must sum to the head dim "
        "hidden_size/num_attention_heads = {}",
        where, fmt::join(axes_dim, ", "), sum, d);
}

void FluxConfig::check_step(int64_t batch, int64_t pixels, const std::string& where) const {
  const KeySpec* batch_spec = find_config_key("micro_batch_size");
  FLUX8_CHECK(batch_spec, "micro_batch_size is registered in the schema");
  if (!batch_spec->range.contains(static_cast<double>(batch)))
    fail("model config {}: micro_batch_size must be {}, got {}", where, describe_allowed(*batch_spec), batch);
  const KeySpec* image_spec = find_config_key("image_size");
  FLUX8_CHECK(image_spec, "image_size is registered in the schema");
  if (!image_spec->range.contains(static_cast<double>(pixels)))
    fail("model config {}: image_size must be {}, got {}", where, describe_allowed(*image_spec), pixels);
  // Every factor is bounded by the schema's ranges (validate), so the sums cannot overflow;
  // the product can, and is checked.
  const int64_t img = image_tokens(pixels);
  const int64_t widths = hidden_size + mlp_hidden() + in_channels + context_dim + vec_dim;
  const std::array<int64_t, 4> dims{batch, text_seq_len + img, widths, num_blocks() + 1};
  if (!checked_product(dims, kMaxStepElements))
    fail(
        "model config {}: a step of micro_batch_size {} x ({} text + {} image tokens at image_size {}) on this "
        "model (hidden_size {}, MLP width {}, {} blocks) is beyond the 2^50 elements flux8 plans for a step; "
        "lower micro_batch_size or image_size",
        where, batch, text_seq_len, img, pixels, hidden_size, mlp_hidden(), num_blocks());
}

}  // namespace flux8
