#pragma once
// The attention part of a block's saved activations: the same in the double and single blocks.
#include "model/fp8_attention.h"

namespace flux8 {

struct BlockAttentionSaved {
  Tensor q, k, v, o, lse;  // head-major [B, n, L, D], after QK-norm and RoPE
  // FP8 attention (the block params' fp8_attention >= 0): q, k, v and o exist only as these FP8
  // casts (the tensors above stay undefined); selective recomputation keeps the casts too (no q,
  // k, v recompute).
  Fp8AttentionSaved att8;
  // recompute_granularity: selective. q, k, v (and what each block lists beside them) are not
  // kept; the backward recomputes them in scratch.
  bool selective = false;
  // Selective: the forward still writes q, k, v. Points them at scratch for one forward; the
  // caller releases the scratch after it and calls forget_recomputed().
  void place_recomputed(Arena& scratch, const BlockWidths& widths, StepShape shape, DType heads);
  void forget_recomputed() { q = k = v = Tensor{}; }
};

}  // namespace flux8
