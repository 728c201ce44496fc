#pragma once
// Single-stream block (docs/FLUX.md) on the joint sequence z = cat(txt, img): one fused
// Linear gives [q | k | v | mlp], attention and the MLP branch run in parallel, and one
// Linear maps cat(attention, GELU(mlp)) back to H.
#include "model/attention_saved.h"
#include "model/block_common.h"
#include "model/fp8_attention.h"

namespace flux8 {

struct SingleBlockParams {
  LinearSite mod, linear1, linear2;
  ScaleParam q_norm, k_norm;
  int fp8_attention = -1;  // Fp8Runtime's index of this block's attention when it runs in FP8
  static SingleBlockParams bind(ParamStore& store, int64_t index);
  std::vector<LinearSite*> sites() { return {&mod, &linear1, &linear2}; }
};

// The attention's q, k, v, o, lse and att8 are those of BlockAttentionSaved. What `recompute`
// drops the backward rebuilds in scratch: q, k, v from u (QK-norm, layout, RoPE; heads), cat from
// o and u's MLP part (layout and GELU; copies) and zm from z_in with its kept statistics
// (LayerNorm + modulation; norms) — in FP8 only the Linear inputs' transposed casts.
struct SingleBlockSaved : BlockAttentionSaved {
  Tensor z_in;              // block input (LayerNorm backward): the caller's tensor, not a copy
  SavedLinearInput mod_in;  // SiLU(vec) as the modulation Linear saw it
  Tensor mod;               // [B, 3H]: shift, scale, gate
  Tensor ln_mean, ln_rstd;  // modulated LayerNorm
  bool ln_ready = false;    // ln_* written by the block(s) before (NormStatsOut); the forward clears it
  SavedLinearInput zm;      // its output (linear1 input); not kept under recompute.norms
  Tensor u;                 // linear1 output [B, L, 3H + M]
  Tensor q_rstd, k_rstd;
  SavedLinearInput cat;  // [B, L, H + M] = cat(attention, GELU(mlp)) (linear2 input); not kept under recompute.copies
  Tensor out;            // linear2 output (gate gradient)
  // dtype: the activations'; heads: q, k, v and o (Backend::attention_heads_dtype).
  static SingleBlockSaved allocate(Arena& arena, const BlockWidths& widths, StepShape shape, DType dtype, DType heads,
                                   const SingleBlockParams& p, const Fp8Runtime* fp8, BlockRecompute recompute = {});
};

// The block on z [B, L, H], its output written to z_out (another tensor of z's shape). z is
// saved as the block's input (z_in): the caller must leave it unchanged until the block's
// backward has run. next: where the row statistics of z_out go for the LayerNorm after the
// block (the caller marks it ready), if anywhere.
void single_block_forward(const BlockContext& ctx, SingleBlockParams& p, SingleBlockSaved& saved, Tensor z,
                          Tensor z_out, NormStatsOut next = {});
// dz: gradient of the output in, of the input out. Parameter grads, d_silu_vec accumulated.
void single_block_backward(const BlockContext& ctx, SingleBlockParams& p, const SingleBlockSaved& saved, Tensor dz);

// Scratch memory the block needs at most (planning), as double_block_plan_scratch.
void single_block_plan_scratch(Arena& scratch, const BlockWidths& widths, StepShape shape, DType dtype,
                               const Fp8Config* fp8, BlockRecompute recompute = {});

}  // namespace flux8
