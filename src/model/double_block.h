#pragma once
// Double-stream block (docs/FLUX.md): text and image tokens keep separate weights and meet
// only in one joint attention over cat(txt, img), text first.
#include "model/attention_saved.h"
#include "model/block_common.h"
#include "model/fp8_attention.h"

namespace flux8 {

struct DoubleStreamParams {
  LinearSite mod, qkv, proj, mlp_in, mlp_out;
  ScaleParam q_norm, k_norm;
};

struct DoubleBlockParams {
  DoubleStreamParams txt, img;
  int fp8_attention = -1;  // Fp8Runtime's index of this block's attention when it runs in FP8
  static DoubleBlockParams bind(ParamStore& store, int64_t index);
  // The block's Linears, for FP8 registration (modulation first in each stream).
  std::vector<LinearSite*> sites();
};

// Activations saved by the forward for the backward, per stream.
struct DoubleStreamSaved {
  Tensor x_in;                // block input (LayerNorm 1 backward): the caller's tensor, not a copy
  SavedLinearInput mod_in;    // SiLU(vec) as the modulation Linear saw it
  Tensor mod;                 // [B, 6H]: shift1 scale1 gate1 shift2 scale2 gate2
  Tensor ln1_mean, ln1_rstd;  // modulated LayerNorm 1
  bool ln1_ready = false;     // ln1_* written by the block before (NormStatsOut); the forward clears it
  SavedLinearInput xm1;       // its output (qkv input); not kept under recompute.norms
  Tensor qkv;                 // [B, Ls, 3H] before QK-norm
  Tensor q_rstd, k_rstd;
  SavedLinearInput attn;  // attention output in token layout (proj input); not kept under recompute.copies
  Tensor proj_out;        // (gate1 gradient)
  Tensor x_mid;           // residual after attention (LayerNorm 2 backward); not kept under recompute.norms
  Tensor ln2_mean, ln2_rstd;
  SavedLinearInput xm2;    // (mlp_in input); not kept under recompute.norms
  Tensor mlp_h;            // GELU input
  SavedLinearInput mlp_g;  // GELU output (mlp_out input); not kept under recompute.copies
  Tensor mlp_out;          // (gate2 gradient)
};

// The joint attention's q, k, v, o, lse and att8 are those of BlockAttentionSaved. What
// `recompute` drops the backward rebuilds in scratch: q, k, v from qkv (QK-norm, layout, RoPE;
// heads), attn from o (layout; with FP8 attention from the FP8 o) and mlp_g from mlp_h (GELU;
// copies), x_mid from x_in, proj_out and gate1 (the gated residual) and xm1, xm2 from x_in, x_mid
// with their kept statistics (LayerNorm + modulation; norms) — in FP8 only the Linear inputs'
// transposed casts, the op run inside the cast.
struct DoubleBlockSaved : BlockAttentionSaved {
  DoubleStreamSaved txt, img;
  // dtype: the activations'; heads: q, k, v and o (Backend::attention_heads_dtype).
  static DoubleBlockSaved allocate(Arena& arena, const BlockWidths& widths, StepShape shape, DType dtype, DType heads,
                                   const DoubleBlockParams& p, const Fp8Runtime* fp8, BlockRecompute recompute = {});
};

// The block on txt [B, Lt, H] and img [B, Li, H], its output written to txt_out and img_out
// (other tensors of the same shapes). txt and img are saved as the block's inputs (x_in): the
// caller must leave them unchanged until the block's backward has run. next_txt, next_img: where
// the row statistics of txt_out and img_out go for the LayerNorm after the block (the caller
// marks it ready), if anywhere.
void double_block_forward(const BlockContext& ctx, DoubleBlockParams& p, DoubleBlockSaved& saved, Tensor txt,
                          Tensor img, Tensor txt_out, Tensor img_out, NormStatsOut next_txt = {},
                          NormStatsOut next_img = {});
// dtxt/dimg hold the gradient of the block output and become that of its input. Parameter
// gradients and ctx.d_silu_vec are accumulated.
void double_block_backward(const BlockContext& ctx, DoubleBlockParams& p, const DoubleBlockSaved& saved, Tensor dtxt,
                           Tensor dimg);

// Scratch memory the block needs at most (planning): its forward's and backward's allocations, in
// their order. fp8: the (enabled) FP8 config of a block whose Linears run in FP8, their casts
// planned too; null for a BF16 block.
void double_block_plan_scratch(Arena& scratch, const BlockWidths& widths, StepShape shape, DType dtype,
                               const Fp8Config* fp8, BlockRecompute recompute = {});

}  // namespace flux8
