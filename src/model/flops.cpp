#include "model/flops.h"

namespace flux8 {

ModelFlops model_flops(const FluxConfig& c, StepShape s) {
  const double B = static_cast<double>(s.batch), Lt = static_cast<double>(s.txt_tokens),
               Li = static_cast<double>(s.img_tokens), L = Lt + Li;
  const double H = static_cast<double>(c.hidden_size), M = static_cast<double>(c.mlp_hidden());
  const double n = static_cast<double>(c.num_heads), D = static_cast<double>(c.head_dim());
  double macs = 0;
  // Embedders: one row per sample.
  macs += 256 * H + H * H + static_cast<double>(c.vec_dim) * H + H * H;
  if (c.guidance_embed) macs += 256 * H + H * H;
  macs *= B;
  macs += B * Li * static_cast<double>(c.in_channels) * H + B * Lt * static_cast<double>(c.context_dim) * H;
  const double attention_call = 4 * B * n * L * L * D;
  double attn = 0;
  for (int64_t i = 0; i < c.num_double_blocks; ++i) {
    for (double Ls : {Lt, Li}) macs += B * (H * 6 * H) + B * Ls * (3 * H * H + H * H + 2 * H * M);
    attn += attention_call;
  }
  for (int64_t i = 0; i < c.num_single_blocks; ++i) {
    macs += B * (H * 3 * H) + B * L * (H * (3 * H + M) + (H + M) * H);
    attn += attention_call;
  }
  macs += B * H * 2 * H + B * Li * H * static_cast<double>(c.out_channels);
  return {macs, attn};
}

}  // namespace flux8
