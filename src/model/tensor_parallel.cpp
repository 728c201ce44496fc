#include "model/tensor_parallel.h"

#include "core/error.h"

namespace flux8 {

void check_tensor_parallel(const FluxConfig& cfg, int tp_size) {
  if (tp_size < 1) fail("tensor_model_parallel_size {}: it must be at least 1", tp_size);
  if (cfg.num_heads % tp_size != 0)
    fail(
        "model '{}': num_heads {} is not divisible by tensor_model_parallel_size {} (every rank runs whole "
        "attention heads); choose a tensor-parallel size that divides {}",
        cfg.name, cfg.num_heads, tp_size, cfg.num_heads);
  if (cfg.mlp_hidden() % tp_size != 0)
    fail(
        "model '{}': the MLP width {} (hidden_size {} x mlp_ratio {}) is not divisible by "
        "tensor_model_parallel_size {}; choose a tensor-parallel size that divides {}",
        cfg.name, cfg.mlp_hidden(), cfg.hidden_size, cfg.mlp_ratio, tp_size, cfg.mlp_hidden());
}

void check_fp8_tensor_parallel(const FluxConfig& cfg, const Fp8Config& fp8, int tp_size) {
  if (!fp8.enabled || tp_size <= 1) return;
  const int64_t block = fp8.recipe == Fp8Recipe::blockwise ? 128 : fp8.recipe == Fp8Recipe::mxfp8 ? 32 : 0;
  if (block == 0) return;
  const BlockWidths w = BlockWidths::of(cfg, tp_size);
  if (w.attention % block == 0 && w.mlp % block == 0) return;
  fail(
      "model '{}' with fp8_recipe {} at tensor_model_parallel_size {}: a rank's share of the attention width ({} of "
      "hidden_size {}) and of the MLP width ({} of {}) must be multiples of the recipe's {}-element scaling blocks, "
      "or a rank's block scales would differ from the whole tensor's; choose a tensor-parallel size that leaves "
      "multiples of {}, or fp8_recipe tensorwise or delayed (their amaxes are reduced over the ranks)",
      cfg.name, fp8_recipe_name(fp8.recipe), tp_size, w.attention, cfg.hidden_size, w.mlp, cfg.mlp_hidden(), block,
      block);
}

BlockWidths BlockWidths::of(const FluxConfig& cfg, int tp_size) {
  check_tensor_parallel(cfg, tp_size);
  BlockWidths w;
  w.hidden = cfg.hidden_size;
  w.heads = cfg.num_heads / tp_size;
  w.head_dim = cfg.head_dim();
  w.attention = w.heads * w.head_dim;
  w.mlp = cfg.mlp_hidden() / tp_size;
  return w;
}

}  // namespace flux8
