#pragma once
// A block's attention in FP8 (fp8_dot_product_attention, DESIGN.md §4): after QK-norm + RoPE
// the bf16 (or f32) q, k, v heads are cast to E4M3 with their delayed scales, cuDNN's FP8
// attention (Backend::attention_fp8) writes an E4M3 o, which is dequantized for the output
// projection; the backward casts dO to E5M2, runs the FP8 backward and dequantizes dq, dk, dv.
// What the block keeps for its backward is the FP8 q, k, v and o (one byte per element: half
// of bf16 heads), so q, k, v and o in the activation type are only temporaries.
#include "model/block_common.h"

namespace flux8 {

struct Fp8AttentionSaved {
  QTensor q, k, v, o;  // [B·n·L, D] per-tensor casts of the head-major heads
  bool defined() const { return q.defined(); }
  // fp8 null: planning without a runtime (the estimates); the codes' sizes do not depend on it.
  static Fp8AttentionSaved allocate(Arena& arena, const FluxConfig& cfg, StepShape shape, const Fp8Runtime* fp8);
};

// o (heads, the activation heads type) = dequantized FP8 attention of q, k, v, whose casts and o's
// are kept in `saved`; lse as Backend::attention writes it. `index`: Fp8Runtime::add_attention's.
void fp8_attention_forward(const BlockContext& ctx, int index, Fp8AttentionSaved& saved, Tensor o, Tensor lse,
                           Tensor q, Tensor k, Tensor v);
// dq, dk, dv (overwritten) from dout and what the forward kept; FP8 temporaries in ctx.scratch.
void fp8_attention_backward(const BlockContext& ctx, int index, const Fp8AttentionSaved& saved, Tensor lse,
                            Tensor dq, Tensor dk, Tensor dv, Tensor dout);
// Scratch fp8_attention_backward takes (planning).
void plan_fp8_attention_scratch(Arena& scratch, const FluxConfig& cfg, StepShape shape);

}  // namespace flux8
