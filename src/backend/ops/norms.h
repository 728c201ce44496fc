#pragma once
// The modulated LayerNorm of the blocks and the QK-norm (RMSNorm per head), with backwards.
// Conventions shared by every op: backend/ops.h.
#include "backend/ops/declare.h"
#include "core/tensor.h"

namespace flux8::op {

// ---- modulated LayerNorm (no affine) over the last dim of x [B, L, H] ---------------------------
//   y = (1 + scale[b])·(x − μ)·rstd + shift[b],  rstd = 1/√(var + eps)  (biased var)
// mean, rstd: [B·L] saved for the backward. shift, scale: [B, H] any ld. y may be undefined: then
// only mean and rstd are computed (a fused cast, quantize_fused, makes y on the fly).
FLUX8_OP(LayernormModulate, layernorm_modulate, void, (Tensor, y), (Tensor, mean), (Tensor, rstd), (Tensor, x),
         (Tensor, shift), (Tensor, scale), (double, eps))
// dx (+= if accumulate_dx), dshift = Σ_l dy, dscale = Σ_l dy·x̂ (both [B, H], overwritten).
FLUX8_OP(LayernormModulateBackward, layernorm_modulate_backward, void, (Tensor, dx), (Tensor, dshift), (Tensor, dscale),
         (Tensor, dy), (Tensor, x), (Tensor, mean), (Tensor, rstd), (Tensor, scale), (bool, accumulate_dx))

// ---- QK-norm: RMSNorm of every D-wide head segment of x [rows, n·D] (any ld) --------------------
//   y = x / √(mean(x²) + eps) · scale[D];  rstd [rows·n] saved. D = scale.numel().
FLUX8_OP(RmsnormHeads, rmsnorm_heads, void, (Tensor, y), (Tensor, rstd), (Tensor, x), (Tensor, scale), (double, eps))
// dx overwritten; dscale[D] accumulated.
FLUX8_OP(RmsnormHeadsBackward, rmsnorm_heads_backward, void, (Tensor, dx), (Tensor, dscale), (Tensor, dy), (Tensor, x),
         (Tensor, rstd), (Tensor, scale))

}  // namespace flux8::op
