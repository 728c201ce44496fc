#include "model/flux_config.h"

#include <fmt/ranges.h>

#include "config/config.h"
#include "core/error.h"

namespace flux8 {

int64_t FluxConfig::image_tokens(int64_t pixels) const {
  // One token per patch_size x patch_size block of latent cells, each cell vae_downsample pixels.
  const int64_t cell = vae_downsample * patch_size;
  if (pixels <= 0 || cell <= 0 || pixels % cell != 0)
    fail(
        "model '{}': image size {} pixels is not a positive multiple of vae_downsample ({}) * "
        "patch_size ({}) = {}; pick image_size as a multiple of {}",
        name, pixels, vae_downsample, patch_size, cell, cell);
  const int64_t side = pixels / cell;
  return side * side;
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
  for (int64_t d : cfg.get_int_list("axes_dim")) m.axes_dim.push_back(static_cast<int>(d));
  m.rope_theta = cfg.get_float("rope_theta");
  m.qk_norm_eps = cfg.get_float("qk_norm_eps");
  m.layernorm_eps = cfg.get_float("layernorm_eps");
  m.latent_channels = cfg.get_int("latent_channels");
  m.patch_size = cfg.get_int("patch_size");
  m.vae_downsample = cfg.get_int("vae_downsample");
  m.text_seq_len = cfg.get_int("text_seq_len");
  m.validate(cfg.path().empty() ? "config" : cfg.path());
  m.image_tokens(cfg.get_int("image_size"));  // fails now, not at the first batch
  return m;
}

void FluxConfig::validate(const std::string& where) const {
  // Single-key ranges are already checked by the schema for YAML input; repeated here because a
  // FluxConfig can also be built in code (tests, tools).
  auto positive = [&](const char* key, int64_t v) {
    if (v < 1) fail("model config {}: {} must be >= 1, got {}", where, key, v);
  };
  positive("hidden_size", hidden_size);
  positive("num_attention_heads", num_heads);
  positive("in_channels", in_channels);
  positive("out_channels (0 in YAML means in_channels)", out_channels);
  positive("context_dim", context_dim);
  positive("vec_dim", vec_dim);
  positive("latent_channels", latent_channels);
  positive("patch_size", patch_size);
  positive("vae_downsample", vae_downsample);
  positive("text_seq_len", text_seq_len);
  if (num_double_blocks < 0 || num_single_blocks < 0)
    fail("model config {}: num_double_blocks ({}) and num_single_blocks ({}) must be >= 0", where, num_double_blocks,
         num_single_blocks);
  if (!(mlp_ratio > 0) || mlp_hidden() < 1)
    fail("model config {}: mlp_ratio ({}) must give an MLP width >= 1", where, mlp_ratio);

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
  if (axes_dim.empty()) fail("model config {}: axes_dim must not be empty", where);
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
  if (!(rope_theta > 0) || !(qk_norm_eps > 0) || !(layernorm_eps > 0))
    fail("model config {}: rope_theta ({}), qk_norm_eps ({}) and layernorm_eps ({}) must be > 0", where, rope_theta,
         qk_norm_eps, layernorm_eps);
}

}  // namespace flux8
