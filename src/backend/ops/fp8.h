#pragma once
// FP8 casts, their fused inputs, the delayed-scaling update and the FP8 GEMM (src/fp8: the recipe
// math and the CPU reference quantizers). Conventions shared by every op: backend/ops.h.
#include <cstdint>

#include "backend/ops/declare.h"
#include "core/tensor.h"
#include "fp8/meta.h"
#include "fp8/qtensor.h"

namespace flux8 {

// How to cast one GEMM operand. Per-tensor scaling takes its scale from `delayed_scale` (delayed
// recipe: the registry's scale, computed from past steps) or, when that is null, from this tensor's
// amax (tensorwise/current scaling). Blockwise and MX scales always come from the block.
// `delayed_scale` and `amax` point into the backend's memory (device memory on the GPU: the scale
// is read and the amax written in stream order, never by the host). The cast's amax is
// max-accumulated into *amax (the registry's staging row) and its counts are merged into *stats
// (host memory) when given. A backend may deliver the counts late (the CUDA backend keeps them on
// the device until the next synchronize() or download()): the target must outlive the cast and is
// current after synchronize().
struct QuantizeSpec {
  Fp8Format format = Fp8Format::e4m3;
  Fp8Scaling scaling = Fp8Scaling::per_tensor;
  bool pow2 = false;                     // current/blockwise scales rounded down to 2^k
  const float* delayed_scale = nullptr;  // backend memory
  // Current per-tensor scaling only (no delayed_scale): the scale comes from *whole_amax (backend
  // memory) instead of x's own amax — the amax of the whole tensor x is one rank's part of, max-
  // reduced over the ranks that hold the parts (cast_amax), so every part is cast as the whole
  // tensor's cast would cast it. x's own amax still goes to *amax and *stats.
  const float* whole_amax = nullptr;
  float* amax = nullptr;                 // backend memory
  CastStats* stats = nullptr;            // host memory
  // Defined: column_sums[c] += Σ_r x[r, c] — the bias gradient of the Linear whose output gradient
  // x is, summed in the pass that casts it (contiguous vector of cols(x) in gradient_dtype(f32):
  // f32, or bf16); = instead of += when column_sums_accumulate is false (old contents never read).
  Tensor column_sums;
  bool column_sums_accumulate = true;
  FLUX8_FIELDS(format, scaling, pow2, delayed_scale, whole_amax, amax, stats, column_sums, column_sums_accumulate)
};
FLUX8_CHECK_FIELDS(QuantizeSpec);

// The input of a fused cast: the element-wise op that produces the tensor to cast, so the tensor
// between the op and the cast is never stored. identity: x itself; gelu_tanh: gelu_tanh(x);
// layernorm_modulate: layernorm_modulate's y from x [B, L, H], the mean and rstd it computed (with y
// undefined) and shift, scale [B, H]; gelu_tanh_backward: gelu_tanh_backward's dx from x = dy and
// gelu_x, the GELU's input (same shape); gated: the gated residual's branch gradient
// gated_residual_backward's dy = gate[b] ⊙ x from x = the residual's gradient [B, L, H] and
// gate [B, H].
// With a head the tensor cast is [head | op(x)]: head's columns as they are, then the op's (the
// single block's two-source tensors — linear2's input [attention output | GELU(h)] and linear1's
// output gradient [dq dk dv | GELU's backward] — cast without being assembled).
struct CastInput {
  enum class Op : uint8_t { identity, gelu_tanh, layernorm_modulate, gelu_tanh_backward, gated };
  Op op = Op::identity;
  Tensor x;
  Tensor mean, rstd, shift, scale;  // layernorm_modulate only
  double eps = 0.0;                 // layernorm_modulate: the eps mean/rstd were made with
  // layernorm_modulate: mean and rstd already hold x's statistics (gated_residual_stats wrote them
  // with x): the model need not compute them before the cast. Backends ignore it.
  bool statistics_ready = false;
  Tensor gelu_x;  // gelu_tanh_backward only
  Tensor gate;    // gated only
  Tensor head;    // optional: the first columns, x's rows and dtype, any ld
  FLUX8_FIELDS(op, x, mean, rstd, shift, scale, eps, statistics_ready, gelu_x, gate, head)

  // The cast tensor's columns and shape (x's, widened by the head's columns).
  int64_t head_cols() const { return head.defined() ? head.cols() : 0; }
  int64_t cols() const { return head_cols() + x.cols(); }
  Shape shape() const {
    Shape s = x.shape;
    if (s.rank > 0) s.d[static_cast<size_t>(s.rank - 1)] = cols();
    return s;
  }
  CastInput with_head(Tensor h) const {
    CastInput in = *this;
    in.head = h;
    return in;
  }
  static CastInput gelu_tanh_of(Tensor x) {
    CastInput in;
    in.op = Op::gelu_tanh;
    in.x = x;
    return in;
  }
  static CastInput gelu_tanh_backward_of(Tensor dy, Tensor gelu_x) {
    CastInput in;
    in.op = Op::gelu_tanh_backward;
    in.x = dy, in.gelu_x = gelu_x;
    return in;
  }
  static CastInput gated_of(Tensor dx, Tensor gate) {
    CastInput in;
    in.op = Op::gated;
    in.x = dx, in.gate = gate;
    return in;
  }
  static CastInput layernorm_modulate_of(Tensor x, Tensor mean, Tensor rstd, Tensor shift, Tensor scale, double eps) {
    CastInput in;
    in.op = Op::layernorm_modulate;
    in.x = x, in.mean = mean, in.rstd = rstd, in.shift = shift, in.scale = scale, in.eps = eps;
    return in;
  }
};
FLUX8_CHECK_FIELDS(CastInput);

namespace op {

// x [rows, cols] (any ld) -> `rowwise` [rows, cols] and/or `columnwise` [cols, rows] (the quantized
// transpose: xᵀ's blocks run along x's columns); either may be undefined. With per-tensor scaling
// both copies share one scale; 128x128 tiles transpose with their scales.
FLUX8_OP(Quantize, quantize, void, (QTensor, rowwise), (QTensor, columnwise), (Tensor, x), (QuantizeSpec, q))
// amax (one f32 in backend memory) = max |v| over the tensor a cast of `in` quantizes — [head |
// op(x)], the op's output rounded as quantize_fused rounds it — NaN ignored, ±inf kept
// (amax_accumulate); overwritten. The amax a current per-tensor cast takes its scale from: a
// tensor split over ranks is cast with the max of its parts' amaxes (QuantizeSpec::whole_amax).
FLUX8_OP(CastAmax, cast_amax, void, (Tensor, amax), (CastInput, in))
// dst [cols, rows] = src [rows, cols] transposed, codes and (per-tensor) scale_inv: the columnwise
// copy of a weight whose rowwise cast adamw wrote (ParamCast).
FLUX8_OP(TransposeCodes, transpose_codes, void, (QTensor, dst), (QTensor, src))
// quantize() of the op's output, which must give the same codes, scales and statistics as running
// the op (Backend::produce) and then quantize() on this backend — with bf16 activations too: the
// op's output is rounded to bf16 as storing it would, then cast. The default does just that,
// through a temporary; the CUDA backend computes the op inside the cast kernel.
FLUX8_OP(QuantizeFused, quantize_fused, void, (QTensor, rowwise), (QTensor, columnwise), (CastInput, in),
         (QuantizeSpec, q))
// The delayed-scaling update of every tensor of a model in one pass (one launch on the GPU), over
// the registry's flat buffers in backend memory (fp8/meta.h): amax_history [L, n] (history-major;
// row 0 is the step's staged, already all-reduced amax), scale, scale_inv and fp8_max [n] (the
// largest finite value of each slot's format). delayed_update_slot() in fp8/recipe.h per slot:
// bit-equal on every backend.
FLUX8_OP(DelayedScalingUpdate, delayed_scaling_update, void, (Tensor, amax_history), (Tensor, scale),
         (Tensor, scale_inv), (Tensor, fp8_max), (AmaxAlgo, algo), (int, margin))
// y = x dequantized (per-tensor scaling): y[r, c] = decode(x.codes[r, c])·x.scale_inv[0], in y's
// type (f32, or bf16 rounded to nearest even); y [x.rows, x.cols] any ld, or any shape with those
// rows and cols.
FLUX8_OP(Dequantize, dequantize, void, (Tensor, y), (QTensor, x))
// c[m, n] (= or += when accumulate) a[m, k] · b[n, k]ᵀ (+ bias[n]): the TN FP8 GEMM. Exact products;
// the summation order is backend-specific and its precision `sum` (fp32, or the tensor cores' fast
// accumulation where the backend has it: Fp8Accumulation).
FLUX8_OP(GemmFp8Tn, gemm_fp8_tn, void, (Tensor, c), (QTensor, a), (QTensor, b), (Tensor, bias), (bool, accumulate),
         (Fp8Accumulation, sum))

}  // namespace op
}  // namespace flux8
