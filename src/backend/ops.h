#pragma once
// The math interface: every op the Flux model, its objective and its optimizer run. Each op is
// declared once, as a struct of named fields, in backend/ops/ (grouped by family; declare.h says
// how), and listed once in FLUX8_OPS below. From those two the rest is generated: the positional
// call `ops.linear(y, x, w, b)`, the struct call `ops.run(op::Linear{.y = y, ...})`, the virtual
// `execute(const op::Linear&)` each backend implements, the variant AnyOp an interceptor sees.
//
// Conventions every implementation follows (the conformance tests check them):
// - Shapes are given by the tensors; an op checks them and fails naming the op and tensors.
// - Within one call all tensors share one dtype: f32 (or f64 on the CPU backend, used by the
//   finite-difference gradient checks). Saved statistics (mean, rstd, lse) use that dtype.
//   One exception: a backend whose activation_dtype() is bf16 (the CUDA backend with
//   bf16_activations) takes the ACTIVATION arguments — inputs, outputs and input gradients, named
//   per op — in bf16, all of one call in the same type, while parameters (w, b, scale), parameter
//   gradients and statistics stay in the compute dtype (parameter gradients: in gradient_dtype(),
//   which is bf16 with bf16_grads). Kernels compute in f32 and round each stored value to nearest
//   even: the values the CPU backend gives with round_activations_to_bf16 (up to summation order).
// - Outputs are overwritten, except: parameter gradients (dw, db, dscale) are ACCUMULATED (+=) so
//   that micro-batches and repeated uses of a parameter sum — or overwritten where the op has a flag
//   for it (linear_backward's accumulate_params, QuantizeSpec's column_sums_accumulate,
//   gemm_fp8_tn's accumulate): a step's first write of a gradient (ParamStore::first_write) needs no
//   zero-filled buffer; input gradients are accumulated when the op's `accumulate` flag is set
//   (residual streams).
// - Any gradient output may be an undefined Tensor, meaning "not needed"; it is skipped.
// - Tensors may be column windows (ld > cols) where the comment says "any ld".
// - Batched activations are rank 3 [B, L, C]; "per sample" vectors (shift, scale, gate) are [B, C]
//   with any ld, so they can be column windows of one modulation output [B, 6H].
// - With bf16 activation rounding on (BackendOptions), every activation or input-gradient output is
//   rounded to the nearest bf16 value, as the GPU stores them; statistics and parameter gradients
//   stay at full precision, and the generic fill/copy/add/accumulate never round (they also serve
//   parameter and gradient buffers).
// - Statistics (mean, rstd, lse) may be passed flat: any contiguous tensor of the stated size.
#include <functional>
#include <string_view>
#include <variant>

#include "backend/ops/attention.h"
#include "backend/ops/declare.h"
#include "backend/ops/elementwise.h"
#include "backend/ops/fp8.h"
#include "backend/ops/fp8_attention.h"
#include "backend/ops/linear.h"
#include "backend/ops/norms.h"
#include "backend/ops/training.h"

// Every op: X(struct, method). FLUX8_DEFAULTED_OPS have a generic implementation in terms of the
// others (class Backend, backend/backend.cpp) that a backend may replace; every backend implements
// the rest.
#define FLUX8_REQUIRED_OPS(X)                                  \
  X(Fill, fill)                                                \
  X(FillRandom, fill_random)                                   \
  X(Copy, copy)                                                \
  X(Add, add)                                                  \
  X(Accumulate, accumulate)                                    \
  X(Linear, linear)                                            \
  X(BiasAdd, bias_add)                                         \
  X(LinearBackward, linear_backward)                           \
  X(LinearGelu, linear_gelu)                                   \
  X(LinearDgradGelu, linear_dgrad_gelu)                        \
  X(Silu, silu)                                                \
  X(SiluBackward, silu_backward)                               \
  X(GeluTanh, gelu_tanh)                                       \
  X(GeluTanhBackward, gelu_tanh_backward)                      \
  X(LayernormModulate, layernorm_modulate)                     \
  X(LayernormModulateBackward, layernorm_modulate_backward)    \
  X(RmsnormHeads, rmsnorm_heads)                               \
  X(RmsnormHeadsBackward, rmsnorm_heads_backward)              \
  X(TokensToHeads, tokens_to_heads)                            \
  X(HeadsToTokens, heads_to_tokens)                            \
  X(RopeTable, rope_table)                                     \
  X(Rope, rope)                                                \
  X(QkNormRopeToHeads, qk_norm_rope_to_heads)                  \
  X(QkNormRopeToHeadsBackward, qk_norm_rope_to_heads_backward) \
  X(Attention, attention)                                      \
  X(AttentionBackward, attention_backward)                     \
  X(GatedResidual, gated_residual)                             \
  X(GatedResidualBackward, gated_residual_backward)            \
  X(TimestepEmbedding, timestep_embedding)                     \
  X(ConcatTokens, concat_tokens)                               \
  X(SplitTokens, split_tokens)                                 \
  X(FlowMatchInputs, flow_match_inputs)                        \
  X(MseLoss, mse_loss)                                         \
  X(SumSquares, sum_squares)                                   \
  X(RangesSumSquares, ranges_sum_squares)                      \
  X(GradientSumSquares, gradient_sum_squares)                  \
  X(Adamw, adamw)                                              \
  X(Quantize, quantize)                                        \
  X(CastAmax, cast_amax)                                       \
  X(TransposeCodes, transpose_codes)                           \
  X(DelayedScalingUpdate, delayed_scaling_update)              \
  X(Dequantize, dequantize)                                    \
  X(AttentionFp8, attention_fp8)                               \
  X(AttentionFp8Backward, attention_fp8_backward)              \
  X(GemmFp8Tn, gemm_fp8_tn)
#define FLUX8_DEFAULTED_OPS(X)                                        \
  X(CopyBatch, copy_batch)                                            \
  X(GatedResidualStats, gated_residual_stats)                         \
  X(MseLossInto, mse_loss_into)                                       \
  X(QuantizeFused, quantize_fused)                                    \
  X(QkNormRopeToHeadsFp8, qk_norm_rope_to_heads_fp8)                  \
  X(QkNormRopeToHeadsBackwardFp8, qk_norm_rope_to_heads_backward_fp8) \
  X(TokensToHeadsFp8, tokens_to_heads_fp8)                            \
  X(HeadsToTokensFp8, heads_to_tokens_fp8)
#define FLUX8_OPS(X)    \
  FLUX8_REQUIRED_OPS(X) \
  FLUX8_DEFAULTED_OPS(X)

// In a backend's class: the declaration of execute() for each op it implements.
#define FLUX8_DECLARE_EXECUTE(Type, method) op::Type::result_type execute(const op::Type& a) override;

namespace flux8 {

// Any op call, its arguments owned.
#define FLUX8_OP_ALTERNATIVE_(Type, method) op::Type,
using AnyOp = std::variant<FLUX8_OPS(FLUX8_OP_ALTERNATIVE_) std::monostate>;
#undef FLUX8_OP_ALTERNATIVE_

// The op's name ("linear"); "" for the empty AnyOp.
std::string_view op_name(const AnyOp& op);

class Ops;

// Sees every op call of the backend it is installed on (Ops::set_interceptor), in place of running
// it: the graph recorder (backend/step_graph.h) and the per-op profiler (bench/op_profiler.h). Ops
// it issues itself, and those an op's implementation calls, go straight to the backend.
// What the host does past the queued ops (backend/device.h): each must see every op called before
// it issued.
enum class HostAccess : uint8_t { release, upload, download, synchronize, record_event, wait_event, timing_mark };
std::string_view host_access_name(HostAccess what);

class OpInterceptor {
 public:
  virtual ~OpInterceptor() = default;
  // An op call. Run it with Ops::execute_any, now or (an op without a result) later, in order with
  // the others; return what execute_any returned (0 for an op without a result).
  virtual double intercept(Ops& ops, AnyOp&& op) = 0;
  // The host reaches past the ops: `access` does it. Whatever was held back must be issued first.
  virtual void host_access(HostAccess what, const std::function<void()>& access) { access(); }
};

// The last base of Ops (closes the generated base list).
struct PositionalCallsEnd {};

// The positional call of each op, ops.linear(y, x, w, b) = run(op::Linear{y, x, w, b}): a base of
// Ops per op whose one method takes the op's fields in order, with their declared types (so an
// argument converts as it would to the field, a braced list included).
namespace detail {
template <typename Op>
using OpFieldRefs = decltype(std::declval<Op&>().fields());
}  // namespace detail
#define FLUX8_OP_POSITIONAL_(Type, method)                                  \
  template <typename Self, typename Fields = detail::OpFieldRefs<op::Type>> \
  struct Positional_##method;                                               \
  template <typename Self, typename... F>                                   \
  struct Positional_##method<Self, std::tuple<F&...>> {                     \
    op::Type::result_type method(const std::remove_cvref_t<F>&... fields) { \
      return static_cast<Self*>(this)->run(op::Type{fields...});            \
    }                                                                       \
  };
FLUX8_OPS(FLUX8_OP_POSITIONAL_)
#undef FLUX8_OP_POSITIONAL_

#define FLUX8_OP_POSITIONAL_BASE_(Type, method) \
 public                                         \
  Positional_##method<Ops>,
class Ops : FLUX8_OPS(FLUX8_OP_POSITIONAL_BASE_) public PositionalCallsEnd {
#undef FLUX8_OP_POSITIONAL_BASE_
 public:
  virtual ~Ops() = default;

  // The names the model and tests know the argument structs by.
  using Quantize = QuantizeSpec;
  using AdamW = AdamWHyper;
  using CastInput = flux8::CastInput;
  using CopyPair = flux8::CopyPair;
  using LowRankGrad = flux8::LowRankGrad;
  using ElementRange = flux8::ElementRange;
  using ParamCopy = flux8::ParamCopy;
  using ParamCast = flux8::ParamCast;
  using Fp8Heads = flux8::Fp8Heads;
  using Fp8AttentionScales = flux8::Fp8AttentionScales;
  using Random = flux8::Random;

  // Runs an op: through the interceptor when one is installed, else at once.
  template <typename Op>
  typename Op::result_type run(const Op& op) {
    if (interceptor_ && !inside_interceptor_) {
      const double r = interceptor_->intercept(*this, AnyOp(op));
      if constexpr (std::is_void_v<typename Op::result_type>)
        return;
      else
        return static_cast<typename Op::result_type>(r);
    }
    return execute(op);
  }

  // Runs an op here and now, past any interceptor (which calls this); ops the implementation calls
  // run at once too. Returns the op's result, 0 for an op without one.
  double execute_any(const AnyOp& op);

  // At most one interceptor at a time; null removes it.
  void set_interceptor(OpInterceptor* interceptor);
  OpInterceptor* interceptor() const { return interceptor_; }

  // The implementations (Backend has the defaults of FLUX8_DEFAULTED_OPS).
#define FLUX8_OP_EXECUTE_(Type, method) virtual op::Type::result_type execute(const op::Type& a) = 0;
  FLUX8_OPS(FLUX8_OP_EXECUTE_)
#undef FLUX8_OP_EXECUTE_

 protected:
  // True while execute_any runs an op for the interceptor: what the op calls bypasses it.
  bool executing_for_interceptor() const { return inside_interceptor_; }

 private:
  OpInterceptor* interceptor_ = nullptr;
  bool inside_interceptor_ = false;
};

}  // namespace flux8
