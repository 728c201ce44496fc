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
