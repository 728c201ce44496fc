#pragma once
// The Flux architecture hyper-parameters (docs/FLUX.md), resolved from a YAML config.
#include <cstdint>
#include <string>
#include <vector>

namespace flux8 {

class Config;

// The largest step check_step() accepts, counted as batch x tokens x (H + MLP width + input,
// text and pooled features) x (blocks + 1) elements: 2^50, several times a micro-batch of 256
// images of 4096 px on a 100B-parameter model, and low enough that the activation plans, which sum a few dozen such
// per-token terms in int64 bytes, cannot overflow.
inline constexpr uint64_t kMaxStepElements = 1ull << 50;
// Numbers in a token's position id (Flux: index, row, column); axes_dim has one width for each.
inline constexpr size_t kPositionAxes = 3;

struct FluxConfig {
  std::string name = "flux";
  int64_t hidden_size = 3072;  // H
  int64_t num_heads = 24;      // n; head dim D = H / n
  int64_t num_double_blocks = 19;
  int64_t num_single_blocks = 38;
  int64_t in_channels = 64;  // packed latent features per token (16 ch × 2×2)
  int64_t out_channels = 64;
  int64_t context_dim = 4096;   // T5 features per text token
  int64_t vec_dim = 768;        // CLIP pooled features
  double mlp_ratio = 4.0;       // M = mlp_ratio · H
  bool guidance_embed = false;  // dev models embed the guidance scale
  bool qkv_bias = true;
  std::vector<int> axes_dim{16, 56, 56};
  double rope_theta = 10000.0;
  double qk_norm_eps = 1e-6;
  double layernorm_eps = 1e-6;

  // Token geometry, used to turn a resolution into token counts (info, bench, data).
  int64_t latent_channels = 16;  // channels before 2×2 packing
  int64_t patch_size = 2;
  int64_t vae_downsample = 8;  // pixels per latent cell; 1 = pixel-space model
  int64_t text_seq_len = 256;

  // Derived sizes; they cannot overflow once validate() has passed (every key is within the
  // schema's range, src/config/schema.cpp).
  int64_t head_dim() const { return hidden_size / num_heads; }
  int64_t mlp_hidden() const { return static_cast<int64_t>(static_cast<double>(hidden_size) * mlp_ratio); }
  int64_t num_blocks() const { return num_double_blocks + num_single_blocks; }
  // Image tokens for a square image of `pixels` per side.
  int64_t image_tokens(int64_t pixels) const;

  // Reads the model keys of a resolved config and checks cross-key rules (H divisible by
  // heads, sum(axes_dim) = head dim, even axes, ...) and the step of image_size and
  // micro_batch_size (check_step), failing with the key names.
  static FluxConfig from_config(const Config& cfg);
  // Every key within the schema's range, and the cross-key rules.
  void validate(const std::string& where) const;
  // After validate(): a step of `batch` square images of `pixels` per side: the image tokens
  // exist (image_tokens)
  // and batch x tokens x widths x blocks stays within kMaxStepElements, so that the activation
  // plans and memory estimates of the step cannot overflow.
  void check_step(int64_t batch, int64_t pixels, const std::string& where) const;

 private:
  void validate_heads_and_axes(const std::string& where) const;
};

}  // namespace flux8
