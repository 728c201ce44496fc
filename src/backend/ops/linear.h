#pragma once
// The Linear layer and its backward, with the GELU epilogues of an MLP's first layer.
// Conventions shared by every op: backend/ops.h.
#include "backend/ops/declare.h"
#include "core/tensor.h"

namespace flux8::op {

// y[N,M] = x[N,K] · w[M,K]ᵀ + b[M] (b may be undefined). x, y any ld.
// b is f32, or — for a bf16 y, on a backend whose weight_operand_dtype is bf16 — the model's bf16
// copy of it (ParamStore::bias_operand), which the GEMM's epilogue adds as it is (so does
// linear_gelu's, and gemm_fp8_tn's for a bf16 c).
FLUX8_OP(Linear, linear, void, (Tensor, y), (Tensor, x), (Tensor, w), (Tensor, b))
// y[N,M] += b[M] on every row (y any ld; b as linear's): the bias of a row-parallel Linear under
// tensor parallelism, added once after the ranks' partial products are summed.
FLUX8_OP(BiasAdd, bias_add, void, (Tensor, y), (Tensor, b))
// dx[N,K] = dy·w (+= if accumulate_dx); dw[M,K] += dyᵀ·x; db[M] += Σ_rows dy (dw and db overwritten
// instead when accumulate_params is false: their old contents are never read).
FLUX8_OP(LinearBackward, linear_backward, void, (Tensor, dx), (Tensor, dw), (Tensor, db), (Tensor, dy), (Tensor, x),
         (Tensor, w), (bool, accumulate_dx), (bool, accumulate_params))
// A Linear whose last output columns go through GELU (an MLP's first layer; the single block's
// linear1, whose MLP part follows q, k, v), the GELU in the GEMM's epilogue where the backend has
// one: h[N,M] = x·wᵀ + b (kept for the backward) and y[N,My] = gelu_tanh of h's last My columns
// (My = M: all of them). Fused, both round once from the same sum — y is the GELU of the unrounded
// value, so with bf16 activations it may differ by an ulp from gelu_tanh() of the stored h (the CPU
// reference computes it so); where a backend cannot fuse a call it takes the GELU of the stored h.
// Activations: y, h, x. Any ld.
FLUX8_OP(LinearGelu, linear_gelu, void, (Tensor, y), (Tensor, h), (Tensor, x), (Tensor, w), (Tensor, b))
// The input gradient of a Linear whose input was [x₀ | gelu_tanh(h)] (h the last Kh of its K
// columns), the GELU's derivative in the GEMM's epilogue where the backend has one: with
// P = dy·w [N,K], dx = P's first K−Kh columns (undefined when Kh = K) and dh = gelu_tanh'(h) ⊙ P's
// last Kh columns, both overwritten; fused (and on the CPU) each rounds once, P is not rounded
// before the derivative multiplies it (unfused: the stored P). The weight and bias gradients are
// linear_backward's (with dx undefined). Activations: dx, dh, dy, h. Any ld.
FLUX8_OP(LinearDgradGelu, linear_dgrad_gelu, void, (Tensor, dx), (Tensor, dh), (Tensor, dy), (Tensor, w), (Tensor, h))

}  // namespace flux8::op
