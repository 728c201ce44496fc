#pragma once
// FP8 attention (fp8_dot_product_attention: cuDNN's FP8 flash attention) and its neighbours, the
// head-layout ops that take or give FP8 heads. Conventions shared by every op: backend/ops.h.
#include <cstdint>

#include "backend/ops/declare.h"
#include "backend/ops/fp8.h"
#include "core/tensor.h"
#include "fp8/format.h"
#include "fp8/qtensor.h"

namespace flux8 {

// The delayed scales and amax slots of one FP8 attention call (see op::AttentionFp8).
struct Fp8AttentionScales {
  const float* o = nullptr;   // forward output
  const float* ds = nullptr;  // dS's scale and its inverse
  const float* ds_inv = nullptr;
  const float* dq = nullptr;  // backward outputs
  const float* dk = nullptr;
  const float* dv = nullptr;
  float* amax_s = nullptr;
  float* amax_o = nullptr;
  float* amax_ds = nullptr;
  float* amax_dq = nullptr;
  float* amax_dk = nullptr;
  float* amax_dv = nullptr;
  FLUX8_FIELDS(o, ds, ds_inv, dq, dk, dv, amax_s, amax_o, amax_ds, amax_dq, amax_dk, amax_dv)
  // P's fixed scale: the largest value of q's format.
  static float p_scale(Fp8Format qkv) { return fp8_max(qkv); }
};
FLUX8_CHECK_FIELDS(Fp8AttentionScales);

// With FP8 attention the heads exist only as per-tensor casts, QTensor [B·n·L, D] (n·D the token
// side's width, L the joint length: codes.rows / (B·n)). The ops below take or give them in place
// of heads tensors, so no heads of the activation type are stored and no cast or dequantize pass of
// their own runs. An FP8 output is exactly quantize(codes, {}, heads, q) of the heads the plain op
// would write (values of attention_heads_dtype(activations, D)) over the rows this call writes (one
// stream's): the same codes and scale_inv, the amax max-accumulated into *q.amax and the counts
// merged into *q.stats as one or more casts of those rows. An FP8 input is read as dequantize() into
// that type gives it. The defaults run just that, through temporaries (the CPU backend; the
// reference of the CUDA backend's fused kernels).
struct Fp8Heads {
  QTensor codes;   // per-tensor, [B·n·L, D]
  QuantizeSpec q;  // per-tensor, with delayed_scale
  FLUX8_FIELDS(codes, q)
};
FLUX8_CHECK_FIELDS(Fp8Heads);

namespace op {

// q, k, v, o and (backward) dout, dq, dk, dv are per-tensor FP8 casts of [B, n, L, D] head-major
// tensors: QTensors of B·n·L rows and D columns, `heads` = [B, n, L, D]; q, k, v share one format.
// The softmax P and the scores' gradient dS are cast inside the op, P in q's format, dS in dout's,
// with the delayed scales given. With every FP8 operand taken at its value (code · scale_inv) and
// f32 sums:
//   S = q·kᵀ·scale;  lse = log Σ_j exp S_j (f32 [B, n, L]);  P = softmax(S);  P8 = cast(P·s)
//   O = P8·v;  o = cast(O·scale_o)
//   δ = rowsum(dO ⊙ O);  dV = P8ᵀ·dO;  dS = P ⊙ (dO·vᵀ − δ)·scale;  dS8 = cast(dS·ds)
//   dQ = dS8·k;  dK = dS8ᵀ·q;  dq, dk, dv = casts of dQ, dK, dV with scale_dq, _dk, _dv
// where P in the backward is recomputed from lse, and P's scale s is fixed at the largest value of
// q's format (448 for E4M3), not a delayed scale: cuDNN's kernels cast exp(S − running max), which
// is 1 somewhere in every row, not the normalised P, so any larger scale saturates and the format's
// maximum uses its whole range. The outputs' scale_inv become 1/scale; the amax of P, O, dS, dQ,
// dK, dV before its cast is max-accumulated into its amax pointer (null: not recorded). Scales and
// amaxes point into the backend's memory. The CUDA backend runs cuDNN's FP8 graphs (Hopper: head
// dim 128; an unsupported call is an error saying why).
FLUX8_OP(AttentionFp8, attention_fp8, void, (QTensor, o), (Tensor, lse), (QTensor, q), (QTensor, k), (QTensor, v),
         (Shape, heads), (double, scale), (Fp8AttentionScales, sc))
FLUX8_OP(AttentionFp8Backward, attention_fp8_backward, void, (QTensor, dq), (QTensor, dk), (QTensor, dv),
         (QTensor, dout), (QTensor, q), (QTensor, k), (QTensor, v), (QTensor, o), (Tensor, lse), (Shape, heads),
         (double, scale), (Fp8AttentionScales, sc))

// qk_norm_rope_to_heads and its backward, tokens_to_heads and heads_to_tokens with FP8 heads.
FLUX8_OP(QkNormRopeToHeadsFp8, qk_norm_rope_to_heads_fp8, void, (Fp8Heads, q_heads), (Fp8Heads, k_heads),
         (Fp8Heads, v_heads), (Tensor, q_rstd), (Tensor, k_rstd), (Tensor, q), (Tensor, k), (Tensor, v),
         (Tensor, q_scale), (Tensor, k_scale), (Tensor, pe), (int64_t, token_offset), (double, eps))
FLUX8_OP(QkNormRopeToHeadsBackwardFp8, qk_norm_rope_to_heads_backward_fp8, void, (Tensor, dq), (Tensor, dk),
         (Tensor, dv), (Tensor, dq_scale), (Tensor, dk_scale), (QTensor, dq_heads), (QTensor, dk_heads),
         (QTensor, dv_heads), (Tensor, q), (Tensor, k), (Tensor, q_rstd), (Tensor, k_rstd), (Tensor, q_scale),
         (Tensor, k_scale), (Tensor, pe), (int64_t, token_offset))
FLUX8_OP(TokensToHeadsFp8, tokens_to_heads_fp8, void, (Fp8Heads, heads), (Tensor, tokens), (int64_t, token_offset))
FLUX8_OP(HeadsToTokensFp8, heads_to_tokens_fp8, void, (Tensor, tokens), (QTensor, heads), (int64_t, token_offset))

}  // namespace op
}  // namespace flux8
