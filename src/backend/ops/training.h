#pragma once
// The training objective and the optimizer (contiguous tensors).
// Conventions shared by every op: backend/ops.h.
#include <cmath>
#include <cstdint>

#include "backend/ops/declare.h"
#include "core/tensor.h"
#include "fp8/qtensor.h"

namespace flux8 {

// A weight gradient kept as factors instead of in the flat gradient buffer (ParamStore's low-rank
// gradients: a Linear that sees one row per sample, such as the modulation Linears, has the
// gradient Σ_r dy_r ⊗ x_r of a step's few rows). For the parameters [offset, offset + M·K), read as
// the row-major [M, K] weight:
//   g[m, k] = Σ_{r < R} a[r, m]·b[r, k]     a [R, M], b [R, K]: contiguous f32, R ≥ 1
// each product and sum rounded on its own in f32, r = 0, 1, ... in order: the same bits on every
// backend. Writing g costs 4 bytes a parameter, and the norm and AdamW each read them again; from
// the factors nobody does (the norm takes them from the factors' Gram matrices).
struct LowRankGrad {
  int64_t offset = 0;
  Tensor a, b;
  int64_t rank() const { return a.shape[0]; }
  int64_t size() const { return a.shape[1] * b.shape[1]; }  // M·K
  int64_t end() const { return offset + size(); }
  FLUX8_FIELDS(offset, a, b)
};
FLUX8_CHECK_FIELDS(LowRankGrad);

// AdamW's hyperparameters for one step (op::Adamw).
struct AdamWHyper {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, grad_scale = 0;
  int64_t step = 0;  // 1-based
  // The flat index of param[0] in the whole parameter buffer, for the bf16 moments' rounding
  // noise (drawn per flat index): an update of a slice (a distributed optimizer's shard, an
  // offloaded chunk) rounds as the update of the whole buffer does. Even.
  int64_t index_base = 0;
  FLUX8_FIELDS(lr, beta1, beta2, eps, weight_decay, grad_scale, step, index_base)
};
FLUX8_CHECK_FIELDS(AdamWHyper);

// The per-step constants of the update, in double (then rounded to the parameters' precision).
struct AdamWConstants {
  double decay;      // 1 − lr·wd
  double step_size;  // lr·√(1 − β2^step) / (1 − β1^step)
  double eps_hat;    // eps·√(1 − β2^step)
  static AdamWConstants of(const AdamWHyper& h) {
    const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
    const double bc2_sqrt = std::sqrt(1.0 - std::pow(h.beta2, static_cast<double>(h.step)));
    return {1.0 - h.lr * h.weight_decay, h.lr * bc2_sqrt / bc1, h.eps * bc2_sqrt};
  }
};

// A bf16 copy of the parameters [offset, offset + copy.numel()) of the flat f32 buffer (a Linear's
// weight operand, ParamStore::operand), written by adamw with the new values rounded to nearest
// even: the update already holds them, where a later conversion pass would read the 4-byte
// parameters again.
struct ParamCopy {
  int64_t offset = 0;
  Tensor copy;  // contiguous bf16
  FLUX8_FIELDS(offset, copy)
};
FLUX8_CHECK_FIELDS(ParamCopy);

// A per-tensor FP8 cast of the parameters [offset, offset + codes.numel()) (a Linear's weight,
// row-major [codes.rows, codes.cols]) written by adamw from the new values exactly as quantize()
// casts them with a delayed scale (QuantizeSpec::delayed_scale = scale, amax): the codes of
// x·*scale, codes.scale_inv[0] = 1/*scale, the amax max-accumulated into *amax; no telemetry
// counts. `scale` and `amax` point into the backend's memory. With the delayed recipe the next
// step's scale is known when the optimizer runs, so the weights' casts need not read the 4-byte
// parameters again (transpose_codes makes their columnwise copy).
struct ParamCast {
  int64_t offset = 0;
  QTensor codes;  // per_tensor
  const float* scale = nullptr;
  float* amax = nullptr;
  FLUX8_FIELDS(offset, codes, scale, amax)
};
FLUX8_CHECK_FIELDS(ParamCast);

// Elements [begin, begin + count) of a flat buffer.
struct ElementRange {
  int64_t begin = 0, count = 0;
  int64_t end() const { return begin + count; }
  FLUX8_FIELDS(begin, count)
};
FLUX8_CHECK_FIELDS(ElementRange);

namespace op {

// Rectified flow: for sample b of x0 [B, ...], ε[b, i] = rng_normal(seed, streams[b], i),
//   xt = (1 − t[b])·x0 + t[b]·ε,  target = ε − x0.
// The noise depends only on (seed, stream, element): the same on every backend.
FLUX8_OP(FlowMatchInputs, flow_match_inputs, void, (Tensor, xt), (Tensor, target), (Tensor, x0), (Tensor, t),
         (uint64_t, seed), (List<uint64_t>, streams))
// The stream ids travel through host memory: the CUDA backend uploads them, and waits.
template <>
inline constexpr bool waits_for_host<FlowMatchInputs> = true;
// Returns mean((pred − target)²) over all elements, accumulated in double; writes
// dpred = grad_scale · 2(pred − target)/numel.
FLUX8_OP(MseLoss, mse_loss, double, (Tensor, dpred), (Tensor, pred), (Tensor, target), (double, grad_scale))
// mse_loss with the mean written to `loss` — a contiguous one-element f64 tensor in backend memory,
// whatever the other tensors' type — instead of returned: nothing waits for the device, so a
// training step reads its micro-batches' losses once, after the backward, and the loss can be part
// of a captured graph (backend/step_graph.h). The same value mse_loss returns. The default runs
// mse_loss and uploads its result.
FLUX8_OP(MseLossInto, mse_loss_into, void, (Tensor, loss), (Tensor, dpred), (Tensor, pred), (Tensor, target),
         (double, grad_scale))
// Σ x² in double, summed in a fixed order (independent of thread count). NaN/inf propagate.
FLUX8_OP(SumSquares, sum_squares, double, (Tensor, x))
// Σ x² over the elements of `ranges` (inside the contiguous x; any may be empty) in double, in an
// order fixed by x's size and the ranges; NaN/inf propagate. On the CPU: sum_squares of each
// range's slice, added in list order, bit for bit. One read-back for all of them (the
// tensor-parallel gradient norm's runs of split parameters, a few hundred a step).
FLUX8_OP(RangesSumSquares, ranges_sum_squares, double, (Tensor, x), (List<ElementRange>, ranges))
// Σ g² over the flat gradients `grads` in double, where each `low_rank` range adds the squared norm
// of its gradient from the factors' Gram matrices instead of its elements,
//   ‖Σ_r a_r ⊗ b_r‖² = Σ_{r,s} (a_r·a_s)(b_r·b_s)      (dot products in double)
// — the norm of the gradient before its elements are rounded to f32 (within ~1e-7 of theirs), in
// R²(M + K) operations instead of M·K. The contents of `grads` at those ranges are never read.
// Without low-rank ranges it is sum_squares(grads).
FLUX8_OP(GradientSumSquares, gradient_sum_squares, double, (Tensor, grads), (List<LowRankGrad>, low_rank))
// AdamW (decoupled weight decay), elementwise over flat param/grad/m/v, computed in the parameters'
// precision (fp32 in training; fp64 in gradient checks):
//   g = grad_scale·grad;  m = β1·m + (1−β1)·g;  v = β2·v + (1−β2)·g²
//   p = p·decay − (step_size·m) / (√v + eps_hat)
// with the per-step constants of AdamWConstants::of (in double, then rounded to the precision).
// This is the bias-corrected update lr·m̂ / (√v̂ + eps) of PyTorch's AdamW with both bias corrections
// folded into the constants (Kingma & Ba's "more efficient" order): multiplying numerator and
// denominator by √(1 − β2^step) leaves the value exact and saves a division an element, which the
// memory-bound GPU kernel is partly issue-bound on.
// The moments m and v are in the parameters' type, or both bf16 with f32 parameters
// (adam_moment_precision: bf16): read widened, updated in f32 as above (p from the unrounded m, v),
// stored rounded stochastically — f32_to_bf16_bits_stochastic with the bits of adamw_pair_noise for
// (step, flat index / 2; the flat index counts from h.index_base), a byte for each of the pair's m and v
// (core/stochastic_rounding.h) — the same bits on every backend. `copies` and `casts` are written from the new values
// (ParamCopy, ParamCast); `low_rank`: ranges whose gradient comes from their factors, as gradient_sum_squares reads it
// (`grad` is not read there).
FLUX8_OP(Adamw, adamw, void, (Tensor, param), (Tensor, grad), (Tensor, m), (Tensor, v), (AdamWHyper, h),
         (List<ParamCopy>, copies), (List<ParamCast>, casts), (List<LowRankGrad>, low_rank))

}  // namespace op
}  // namespace flux8
