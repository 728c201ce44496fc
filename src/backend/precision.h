#pragma once
// The element types a backend stores a model's tensors in, given the type the model computes in
// (f32 in training, f64 in the gradient checks). The model sizes its buffers from these; the ops
// then take their arguments in them (backend/ops.h).
#include <cstdint>

#include "core/dtype.h"

namespace flux8 {

class PrecisionPolicy {
 public:
  virtual ~PrecisionPolicy() = default;
  // Activations and their gradients: `compute` itself, or bf16 (CUDA backend, bf16_activations,
  // compute f32).
  virtual DType activation_dtype(DType compute) const { return compute; }
  // The type linear/linear_backward run their GEMM operands in: `compute` itself, or bf16 (CUDA
  // backend with bf16 activations or bf16_gemm). A weight `w` may be passed in this type as well as
  // in `compute` — the rounded copy a model keeps per optimizer step (ParamStore::operand), which
  // the op would otherwise make per call.
  virtual DType weight_operand_dtype(DType compute) const { return compute; }
  // The parameter gradients (ParamStore's gradient buffer): `compute` itself, or bf16 (CUDA
  // backend, bf16_grads, compute f32). The ops that write parameter gradients (linear_backward's dw
  // and db, gemm_fp8_tn's c, QuantizeSpec::column_sums, the QK-norm backward's dscale) then take
  // them in that type — each stored value the f32 (or double) sum rounded to nearest even, with +=
  // read back from bf16 — and gradient_sum_squares and adamw read them in it.
  virtual DType gradient_dtype(DType compute) const { return compute; }
  // The attention heads (q, k, v, o, their gradients and dO; written by qk_norm_rope_to_heads and
  // tokens_to_heads, read by heads_to_tokens): the activation type, or bf16 where this backend's
  // attention computes on bf16 heads anyway (the CUDA backend's cuDNN path), so no conversion passes
  // run and the results are the same bits (should cuDNN refuse a shape when it builds the plan, the
  // reference kernel then computes on the bf16 values).
  virtual DType attention_heads_dtype(DType activations, int64_t head_dim) const { return activations; }
};

}  // namespace flux8
