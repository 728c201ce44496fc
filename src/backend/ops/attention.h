#pragma once
// The joint sequence's layouts, rotary embedding and attention (BF16 / f32 heads).
// Conventions shared by every op: backend/ops.h.
#include <cstdint>

#include "backend/ops/declare.h"
#include "core/tensor.h"

namespace flux8::op {

// ---- joint sequence: out [B, La+Lb, C] = per-sample cat(a [B, La, C], b [B, Lb, C]) -------------
FLUX8_OP(ConcatTokens, concat_tokens, void, (Tensor, out), (Tensor, a), (Tensor, b))
// Inverse; a or b may be undefined (skipped).
FLUX8_OP(SplitTokens, split_tokens, void, (Tensor, a), (Tensor, b), (Tensor, in))

// ---- layout: token-major [B, Ls, n·D] (any ld) <-> head-major [B, n, L, D] ----------------------
// heads[b, h, offset + l, :] = tokens[b, l, h·D : (h+1)·D], for l < Ls.
FLUX8_OP(TokensToHeads, tokens_to_heads, void, (Tensor, heads), (Tensor, tokens), (int64_t, token_offset))
FLUX8_OP(HeadsToTokens, heads_to_tokens, void, (Tensor, tokens), (Tensor, heads), (int64_t, token_offset))

// ---- rotary position embedding ------------------------------------------------------------------
// ids [B, L, 3] positions; pe [B, L, D/2, 2] = (cos, sin) of pos_i·θ^(−2k/d_i) for axis i of width
// d_i (axes concatenated in order), computed in double precision.
FLUX8_OP(RopeTable, rope_table, void, (Tensor, pe), (Tensor, ids), (List<int>, axes_dim), (double, theta))
// x [B, n, L, D] in place: each adjacent pair (2p, 2p+1) rotated by [[c, −s], [s, c]]; inverse = true
// rotates by the opposite angle, which is exactly the backward.
FLUX8_OP(Rope, rope, void, (Tensor, x), (Tensor, pe), (bool, inverse))

// ---- attention inputs: QK-norm + RoPE + head-major layout of one stream, fused ------------------
// q, k, v [B, Ls, n·D] (any ld: column windows of the qkv Linear's output) are one stream of the
// joint sequence, at positions token_offset .. token_offset + Ls of the head-major q_heads, k_heads,
// v_heads [B, n, L, D]; pe is the joint table of rope(). Equal to
//   rmsnorm_heads(q) → tokens_to_heads → rope, the same for k, and tokens_to_heads(v)
// (bit for bit on the CPU backend): q_heads[b, h, token_offset + l] = rope at that joint position of
// (RMSNorm of q[b, l, h·D : (h+1)·D]) · q_scale. q_rstd, k_rstd [B·Ls·n] as rmsnorm_heads saves
// them; either may be undefined (not saved: a recomputation). D even (RoPE pairs); the CUDA backend
// takes D ≤ 512.
FLUX8_OP(QkNormRopeToHeads, qk_norm_rope_to_heads, void, (Tensor, q_heads), (Tensor, k_heads), (Tensor, v_heads),
         (Tensor, q_rstd), (Tensor, k_rstd), (Tensor, q), (Tensor, k), (Tensor, v), (Tensor, q_scale),
         (Tensor, k_scale), (Tensor, pe), (int64_t, token_offset), (double, eps))
// Backward, from dq_heads, dk_heads, dv_heads (gradients of the joint q_heads, k_heads, v_heads),
// the forward's pre-norm q, k and statistics: dq, dk, dv [B, Ls, n·D] (any ld) overwritten;
// dq_scale, dk_scale [D] accumulated. Equal to rope(inverse) → heads_to_tokens →
// rmsnorm_heads_backward, and heads_to_tokens(dv_heads).
FLUX8_OP(QkNormRopeToHeadsBackward, qk_norm_rope_to_heads_backward, void, (Tensor, dq), (Tensor, dk), (Tensor, dv),
         (Tensor, dq_scale), (Tensor, dk_scale), (Tensor, dq_heads), (Tensor, dk_heads), (Tensor, dv_heads),
         (Tensor, q), (Tensor, k), (Tensor, q_rstd), (Tensor, k_rstd), (Tensor, q_scale), (Tensor, k_scale),
         (Tensor, pe), (int64_t, token_offset))

// ---- attention: q, k, v, o [B, n, L, D]; non-causal, no mask ------------------------------------
//   o = softmax(q·kᵀ·scale)·v;  lse [B, n, L] = log Σ_j exp(q·k_j·scale) saved.
// The heads' element type is PrecisionPolicy::attention_heads_dtype.
FLUX8_OP(Attention, attention, void, (Tensor, o), (Tensor, lse), (Tensor, q), (Tensor, k), (Tensor, v), (double, scale))
// dq, dk, dv overwritten.
FLUX8_OP(AttentionBackward, attention_backward, void, (Tensor, dq), (Tensor, dk), (Tensor, dv), (Tensor, dout),
         (Tensor, q), (Tensor, k), (Tensor, v), (Tensor, o), (Tensor, lse), (double, scale))

}  // namespace flux8::op
