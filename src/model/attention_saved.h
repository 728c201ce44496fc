#pragma once
// The attention part of a block's saved activations: the same in the double and single blocks.
#include "model/fp8_attention.h"

namespace flux8 {

// What a block rebuilds in its backward instead of keeping it from the forward (docs/MEMORY.md,
// "What a block saves"). Each is an element-wise or layout op of tensors the block keeps, run
// again on the same inputs, so the gradients are the same bits; FP8 re-casts use the step's
// scales and are not recorded. The forward still makes them, in scratch.
struct BlockRecompute {
  bool heads = false;   // q, k, v: QK-norm + RoPE + head layout of the kept qkv (single block: u)
  bool copies = false;  // Linear inputs that are o in token layout or the GELU of a kept pre-activation
  bool norms = false;   // Linear inputs made by LayerNorm + modulation; the double block's x_mid
  bool any() const { return heads || copies || norms; }
  bool operator==(const BlockRecompute&) const = default;
};

struct BlockAttentionSaved {
  Tensor q, k, v, o, lse;  // head-major [B, n, L, D], after QK-norm and RoPE
  // FP8 attention (the block params' fp8_attention >= 0): q, k, v and o exist only as these FP8
  // casts (the tensors above stay undefined); recompute.heads keeps the casts too (no q, k, v
  // recompute).
  Fp8AttentionSaved att8;
  // What the block does not keep (each block lists its tensors): the backward rebuilds them in scratch.
  BlockRecompute recompute;
  // recompute.heads: the forward still writes q, k, v. Points them at scratch for one forward;
  // the caller releases the scratch after it and calls forget_recomputed().
  void place_recomputed(Arena& scratch, const BlockWidths& widths, StepShape shape, DType heads);
  void forget_recomputed() { q = k = v = Tensor{}; }
};

}  // namespace flux8
