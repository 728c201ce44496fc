#pragma once
// Elementwise ops, copies, activations, the gated residual and the timestep embedding.
// Conventions shared by every op: backend/ops.h.
#include <cstdint>

#include "backend/ops/declare.h"
#include "core/tensor.h"

namespace flux8 {

// fill_random's distributions.
enum class Random : uint8_t { normal, uniform };

// One pair of copy_batch.
struct CopyPair {
  Tensor y, x;
  FLUX8_FIELDS(y, x)
};
FLUX8_CHECK_FIELDS(CopyPair);

namespace op {

// ---- elementwise / copies (same shape [rows, cols]; any ld) --------------------------------------
// Activations: every tensor (all of one type); copy() also converts, y's type from x's.
FLUX8_OP(Fill, fill, void, (Tensor, y), (double, value))
// y[i] = scale·N(0, 1) or scale·U(−1, 1) for every element i of the contiguous y, drawn from
// (seed, stream, i) by core/rng.h's counter-based generator, in double, rounded to y's type: the
// value depends on nothing else (thread count, backend). Parameter initialisation on the device.
// Uniform values are the same bits everywhere; normal ones go through logf/cosf, whose last bit may
// differ between the host's libm and the GPU (then 1 ulp of f32).
FLUX8_OP(FillRandom, fill_random, void, (Tensor, y), (Random, dist), (uint64_t, seed), (uint64_t, stream),
         (double, scale))
FLUX8_OP(Copy, copy, void, (Tensor, y), (Tensor, x))
// copy() of every pair, in one pass where the backend can (the CUDA backend: one launch a batch).
// For many small copies — the low-rank gradient factors' rows, a few a Linear — whose launches cost
// more than their bytes. No pair's y may overlap another pair's x or y.
FLUX8_OP(CopyBatch, copy_batch, void, (List<CopyPair>, pairs))
FLUX8_OP(Add, add, void, (Tensor, y), (Tensor, a), (Tensor, b))   // y = a + b
FLUX8_OP(Accumulate, accumulate, void, (Tensor, y), (Tensor, x))  // y += x

// ---- activations (any ld) ---------------------------------------------------------------------
FLUX8_OP(Silu, silu, void, (Tensor, y), (Tensor, x))  // x·σ(x)
FLUX8_OP(SiluBackward, silu_backward, void, (Tensor, dx), (Tensor, dy), (Tensor, x), (bool, accumulate_dx))
// GELU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
FLUX8_OP(GeluTanh, gelu_tanh, void, (Tensor, y), (Tensor, x))
FLUX8_OP(GeluTanhBackward, gelu_tanh_backward, void, (Tensor, dx), (Tensor, dy), (Tensor, x))

// ---- gated residual: out[B, L, H] = x + gate[b] ⊙ y[B, L, H]; gate [B, H] any ld -----------------
// out may be x (in place) or a separate tensor of x's shape: the blocks write their residual stream
// out of place, so the block input stays saved for the backward without a copy.
FLUX8_OP(GatedResidual, gated_residual, void, (Tensor, out), (Tensor, x), (Tensor, y), (Tensor, gate))
// gated_residual's out (not in place), then the row statistics layernorm_modulate computes of the
// stored out into mean, rstd [B, L] (any ld; the statistics' type): those of the LayerNorm that
// reads out next, which then need not read it again (in FP8 that LayerNorm runs inside its Linear's
// input cast and computes nothing but them). A window of a wider [B, L'] takes one stream's rows of
// the joint sequence. The default runs the two ops; a backend may fuse.
FLUX8_OP(GatedResidualStats, gated_residual_stats, void, (Tensor, out), (Tensor, mean), (Tensor, rstd), (Tensor, x),
         (Tensor, y), (Tensor, gate), (double, eps))
// dy = gate[b] ⊙ dx; dgate[b] = Σ_l dx ⊙ y (overwritten).
FLUX8_OP(GatedResidualBackward, gated_residual_backward, void, (Tensor, dy), (Tensor, dgate), (Tensor, dx), (Tensor, y),
         (Tensor, gate))

// ---- sinusoidal embedding: out [B, dim], t [B] -------------------------------------------------
//   t' = time_factor·t;  f_k = exp(−ln(max_period)·k/(dim/2));  out = [cos(t'f), sin(t'f)]
// Evaluated in double precision, then stored (the reference's f32 evaluation loses ~1e-4 at
// arguments near 10³).
FLUX8_OP(TimestepEmbedding, timestep_embedding, void, (Tensor, out), (Tensor, t), (double, time_factor),
         (double, max_period))

}  // namespace op
}  // namespace flux8
