#pragma once
// A block's attention in FP8 (fp8_dot_product_attention, docs/FP8.md). The heads exist only as
// per-tensor FP8 casts: QK-norm + RoPE writes the E4M3 q, k, v with their delayed scales
// (Backend::qk_norm_rope_to_heads_fp8), cuDNN's FP8 attention (Backend::attention_fp8) writes an
// E4M3 o, and the layout op that feeds the output projection reads it (heads_to_tokens_fp8).
// The backward mirrors it: the layout op writes the E5M2 dO (tokens_to_heads_fp8), the FP8
// backward writes E5M2 dq, dk, dv, and QK-norm's backward reads them
// (qk_norm_rope_to_heads_backward_fp8). No heads of the activation type are stored and no cast
// or dequantize pass runs of its own. What the block keeps for its backward is the FP8 q, k, v
// and o (one byte per element: half of bf16 heads).
#include "model/block_common.h"

namespace flux8 {

struct Fp8AttentionSaved {
  QTensor q, k, v, o;  // [B·n·L, D] per-tensor casts of the head-major heads
  bool defined() const { return q.defined(); }
  // fp8 null: planning without a runtime (the estimates); the codes' sizes do not depend on it.
  static Fp8AttentionSaved allocate(Arena& arena, const BlockWidths& widths, StepShape shape, const Fp8Runtime* fp8);
};

// The backward's FP8 heads, in scratch: dO (written per stream by fp8_attention_dout), and dq,
// dk, dv (written by fp8_attention_backward, read per stream by QK-norm's backward). The blocks'
// scratch plans call allocate() too, so plan and use cannot drift apart.
struct Fp8AttentionGrads {
  QTensor dout, dq, dk, dv;
  bool defined() const { return dout.defined(); }
  static Fp8AttentionGrads allocate(Arena& scratch, const BlockWidths& widths, StepShape shape, const Fp8Config& fp8);
};

// A block's attention head gradients for its backward, in ctx.scratch: dO, dq, dk, dv as heads
// of ctx.heads_dtype, or with FP8 attention (fp8_attention) only their FP8 casts in `fp8`.
struct AttentionHeadGrads {
  Tensor o, q, k, v;
  Fp8AttentionGrads fp8;
  static AttentionHeadGrads allocate(const BlockContext& ctx, bool fp8_attention);
};

// One stream's q, k, v [B, Ls, n·D] (token side, pre-norm) into the joint FP8 heads of `saved` at
// token_offset: QK-norm, RoPE, layout and cast in one op. `index`: Fp8Runtime::add_attention's.
void fp8_attention_qkv(const BlockContext& ctx, int index, const Fp8AttentionSaved& saved, Tensor q_rstd, Tensor k_rstd,
                       Tensor q, Tensor k, Tensor v, Tensor q_scale, Tensor k_scale, int64_t token_offset);
// saved.o and lse (as Backend::attention writes it) from saved.q, k, v.
void fp8_attention_forward(const BlockContext& ctx, int index, const Fp8AttentionSaved& saved, Tensor lse);
// One stream's attention-output gradient d_attn [B, Ls, n·D] into the joint FP8 dO at token_offset.
void fp8_attention_dout(const BlockContext& ctx, int index, const Fp8AttentionGrads& grads, Tensor d_attn,
                        int64_t token_offset);
// The attention output at token_offset into `tokens` (token layout): the heads o by the plain
// layout op, or, where the attention ran in FP8 (att8 defined), att8.o dequantized in the layout op.
void attention_output_to_tokens(Backend& be, const Tensor& tokens, const Fp8AttentionSaved& att8, const Tensor& o,
                                int64_t token_offset);
// grads.dq, dk, dv from grads.dout and what the forward kept.
void fp8_attention_backward(const BlockContext& ctx, int index, const Fp8AttentionSaved& saved, Tensor lse,
                            const Fp8AttentionGrads& grads);

}  // namespace flux8
