#pragma once
// Argument checks shared by every backend: each failure names the op, the tensor (by its name
// in the op's signature) and what was expected, so a shape bug in model code is found at once.
#include <algorithm>
#include <array>
#include <initializer_list>
#include <span>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "core/tensor.h"
#include "fp8/qtensor.h"

namespace flux8::ops {

// A tensor argument with the name it has in the op's signature, for error messages.
struct Named {
  std::string_view name;
  const Tensor& t;
};

// An FP8 tensor argument with its name.
struct NamedQ {
  std::string_view name;
  const QTensor& q;
};

// The fields of an op (or of an argument struct with FLUX8_FIELDS) of type T, each as
// Out{declared name, field}, in declaration order: the checks name tensors as the op declares them.
template <typename Out, typename T, typename S>
auto fields_of_type(const S& s);
// Those named in `only`, in the order of `only`; a name that is no such field of S fails.
template <typename Out, typename T, typename S>
std::vector<Out> fields_of_type(const S& s, std::initializer_list<std::string_view> only);
// Every Tensor field; every QTensor field.
template <typename S>
auto tensor_fields(const S& s) {
  return fields_of_type<Named, Tensor>(s);
}
template <typename S>
auto qtensor_fields(const S& s) {
  return fields_of_type<NamedQ, QTensor>(s);
}
// The Tensor fields named in `only` (one role among the op's tensors: its activations, its
// statistics), in the order of `only`; a name that is no Tensor field of S fails.
template <typename S>
std::vector<Named> tensor_fields(const S& s, std::initializer_list<std::string_view> only) {
  return fields_of_type<Named, Tensor>(s, only);
}
template <typename S>
std::vector<NamedQ> qtensor_fields(const S& s, std::initializer_list<std::string_view> only) {
  return fields_of_type<NamedQ, QTensor>(s, only);
}

// Checks that all defined tensors share one dtype, that it is one of `allowed` (a backend's
// compute types; `backend` names it in the message) and that ld >= cols; returns the dtype.
DType call_dtype(std::string_view op, std::span<const Named> tensors, std::initializer_list<DType> allowed,
                 std::string_view backend);
inline DType call_dtype(std::string_view op, std::initializer_list<Named> tensors, std::initializer_list<DType> allowed,
                        std::string_view backend) {
  return call_dtype(op, std::span<const Named>(tensors.begin(), tensors.size()), allowed, backend);
}
// The same over every Tensor field of the op, named as declared.
template <typename Op>
DType call_dtype(const Op& a, std::initializer_list<DType> allowed, std::string_view backend) {
  const auto tensors = tensor_fields(a);
  return call_dtype(Op::name, std::span<const Named>(tensors), allowed, backend);
}

void require_defined(std::string_view op, Named a);
void require_rank(std::string_view op, Named a, int rank);
void require_shape(std::string_view op, Named a, const Shape& expected);
// Same [rows, cols] matrix (the shapes may differ in how rows are grouped).
void require_same_matrix(std::string_view op, Named a, Named b);
// A contiguous vector of n elements (saved statistics: mean, rstd).
void require_vector(std::string_view op, Named a, int64_t n);
void require_contiguous(std::string_view op, Named a);
// A fused cast's input (Backend::CastInput): x defined; a head, where given, with x's rows and
// dtype and ld >= its columns.
void check_cast_input(std::string_view op, const Backend::CastInput& in);

// The argument checks of the ops, one overload an op: `op` names the call in the messages (an op
// whose check is another's, as linear_gelu's h is linear's y, passes its own name).

// flow_match_inputs: contiguous xt, target of x0's shape, t a vector and one noise stream per
// sample of x0. Returns the batch size.
int64_t check(std::string_view op, const op::FlowMatchInputs& a);

// tokens [B, Ls, n·D] against heads [B, n, L, D] with Ls + offset <= L.
void check_heads_tokens(std::string_view op, const Tensor& heads, const Tensor& tokens, int64_t offset);
void check(std::string_view op, const op::TokensToHeads& a);
void check(std::string_view op, const op::HeadsToTokens& a);
// The parts a [B, La, C], b [B, Lb, C] of the joint sequence [B, L, C] (concat_tokens' out,
// split_tokens' in): with both present they must tile it exactly; a lone part must fit.
void check(std::string_view op, const op::ConcatTokens& a);
void check(std::string_view op, const op::SplitTokens& a);

// qk_norm_rope_to_heads / its backward: one stream's token slices [B, Ls, n·D] (any ld) at
// token_offset in joint head-major tensors [B, n, L, D] with D even (RoPE turns adjacent pairs),
// statistics vectors of B·Ls·n, scales contiguous [D], pe contiguous [B, L, D/2, 2].
struct QkNormRopeDims {
  int64_t B, n, L, D, Ls;
};
QkNormRopeDims check(std::string_view op, const op::QkNormRopeToHeads& a);
QkNormRopeDims check(std::string_view op, const op::QkNormRopeToHeadsBackward& a);

// linear: x [N, K] (any ld), w [M, K], y [N, M], b undefined or a contiguous [M].
struct LinearDims {
  int64_t N, K, M;
};
LinearDims check(std::string_view op, const op::Linear& a);
// linear_gelu / linear_dgrad_gelu: the Linear's dims and the width of the GELU part (the last
// `gelu` columns of the output, or of the input).
struct LinearGeluDims {
  int64_t N, K, M, gelu;
};
// h [N, M] as linear's y for x, w, b; y [N, My] with 0 < My ≤ M.
LinearGeluDims check(std::string_view op, const op::LinearGelu& a);
// dy [N, M], w [M, K], h and dh [N, Kh] with 0 < Kh ≤ K, dx [N, K − Kh] (undefined iff Kh = K).
LinearGeluDims check(std::string_view op, const op::LinearDgradGelu& a);

// Modulated LayerNorm over x [B, L, H]: y like x (or undefined), mean/rstd vectors of B·L,
// shift/scale [B, H].
struct NormDims {
  int64_t B, L, H;
};
NormDims check(std::string_view op, const op::LayernormModulate& a);
// The backward's common part: dy like x [B, L, H], mean/rstd vectors of B·L.
NormDims check(std::string_view op, const op::LayernormModulateBackward& a);
// gated_residual_stats: x [B, L, H], out and y like x (out not x itself), gate [B, H], mean and
// rstd [B, L] of one floating type, any ld, two tensors. Returns B.
int64_t check(std::string_view op, const op::GatedResidualStats& a);
// QK-norm: rows of x are n·D with D = scale.numel() (contiguous scale), y (dy; dx when defined)
// the same matrix as x, rstd a vector of rows·n (dscale, when defined, of D).
struct RmsnormDims {
  int64_t D, n, rows;
};
RmsnormDims check(std::string_view op, const op::RmsnormHeads& a);
RmsnormDims check(std::string_view op, const op::RmsnormHeadsBackward& a);
// gated_residual: x [B, L, H], out and y like x, gate [B, H].
void check(std::string_view op, const op::GatedResidual& a);
// gated_residual_backward: dx [B, L, H]; with dy: dy like dx, gate [B, H]; with dgate: y like dx,
// dgate [B, H]. Returns {B, L, H}.
NormDims check(std::string_view op, const op::GatedResidualBackward& a);

// adamw's whole argument check: param, grad, m, v contiguous vectors of one length, m and v
// in the parameters' type or both bf16 with f32 parameters (the types of param and grad are
// each backend's to check), a 1-based step, each copy a contiguous bf16 tensor and each cast
// a per-tensor QTensor (with its scale and amax) inside the parameters, no two of them over
// the same parameters; the low-rank gradients as check_low_rank_grads checks them. Returns
// those by offset.
std::vector<Backend::LowRankGrad> check(std::string_view op, const op::Adamw& a);
// Backend::LowRankGrad ranges of a flat gradient of n elements: a [R, M], b [R, K] contiguous
// f32 with R ≥ 1, [offset, offset + M·K) inside [0, n), no two overlapping. Returns them sorted
// by offset (what the backends walk).
std::vector<Backend::LowRankGrad> check_low_rank_grads(std::string_view op, int64_t n,
                                                       std::span<const Backend::LowRankGrad> low_rank);
// gradient_sum_squares: its low-rank gradients inside `grads`. Returns them by offset.
std::vector<Backend::LowRankGrad> check(std::string_view op, const op::GradientSumSquares& a);
// ranges_sum_squares: contiguous x, every range inside it (count >= 0).
void check(std::string_view op, const op::RangesSumSquares& a);
// transpose_codes: per-tensor codes, dst [cols, rows] of src [rows, cols], one format.
void check(std::string_view op, const op::TransposeCodes& a);
// Quantize::column_sums: a contiguous f32 vector of `cols` elements (when defined); or bf16 where
// the backend stores parameter gradients so (`bf16_ok`: Backend::gradient_dtype).
void check_column_sums(std::string_view op, const Tensor& sums, int64_t cols, bool bf16_ok = false);

// Attention: the first tensor (q) is rank 4 [B, n, L, D]; every other defined one has its shape.
void check_attention_heads(std::string_view op, std::span<const Named> heads);
inline void check_attention_heads(std::string_view op, std::initializer_list<Named> heads) {
  check_attention_heads(op, std::span<const Named>(heads.begin(), heads.size()));
}
// attention / attention_backward: q, k, v, o (and dout; dq, dk, dv when defined) [B, n, L, D]
// alike, lse a vector of B·n·L. Returns {B, n, L, D}.
struct AttentionDims {
  int64_t B, n, L, D;
};
AttentionDims check(std::string_view op, const op::Attention& a);
AttentionDims check(std::string_view op, const op::AttentionBackward& a);

// FP8 attention (attention_fp8, attention_fp8_backward): `heads` rank 4 [B, n, L, D]; every
// QTensor field defined, per-tensor, B·n·L x D; q, k, v in one format; lse a contiguous f32
// vector of B·n·L; the scales the call reads given. Returns {B, n, L, D}.
AttentionDims check(std::string_view op, const op::AttentionFp8& a);
AttentionDims check(std::string_view op, const op::AttentionFp8Backward& a);
// The FP8-heads ops (qk_norm_rope_to_heads_fp8, tokens_to_heads_fp8, ...): every FP8 heads field
// defined, per-tensor with its scale_inv, all of one shape [B·n·L, D]; the tokens (`q` where the
// op has no `tokens`) [B, Ls, n·D] (any ld) one stream with Ls + token_offset <= L. Returns the
// heads' shape {B, n, L, D}.
Shape check(std::string_view op, const op::QkNormRopeToHeadsFp8& a);
Shape check(std::string_view op, const op::QkNormRopeToHeadsBackwardFp8& a);
Shape check(std::string_view op, const op::TokensToHeadsFp8& a);
Shape check(std::string_view op, const op::HeadsToTokensFp8& a);
// dequantize: per-tensor x, y f32 or bf16 of x.rows rows and x.cols columns (any ld).
void check(std::string_view op, const op::Dequantize& a);

// quantize(): x (any ld) of one of `x_types` (the backend's: f32 on the CPU; the CUDA backend
// also casts bf16 activations), rowwise [rows, cols] and columnwise [cols, rows] when defined.
// Returns false when there is nothing to cast (both outputs undefined).
bool check_quantize(std::string_view op, const QTensor& rowwise, const QTensor& columnwise, const Tensor& x,
                    std::initializer_list<DType> x_types = {DType::f32});
inline bool check(std::string_view op, const op::Quantize& a, std::initializer_list<DType> x_types = {DType::f32}) {
  return check_quantize(op, a.rowwise, a.columnwise, a.x, x_types);
}
// QuantizeSpec: whole_amax only with current per-tensor scaling (no delayed_scale).
void check_quantize_spec(std::string_view op, const QuantizeSpec& q);
// cast_amax: amax one contiguous f32 element; in as check_cast_input, x of one of `x_types`.
void check(std::string_view op, const op::CastAmax& a, std::initializer_list<DType> x_types = {DType::f32});

// delayed_scaling_update: contiguous f32 amax_history [L, n] (rank 2, L >= 1) and scale,
// scale_inv, fp8_max vectors of n. Returns {L, n}.
struct DelayedUpdateDims {
  int64_t L, n;
};
DelayedUpdateDims check(std::string_view op, const op::DelayedScalingUpdate& a);

// ---- field lists -----------------------------------------------------------------------------
// No lambdas in these inline templates: the CUDA backend's objects and the host objects would
// each compile their own closures of one instantiation (backend/device.h).
namespace detail {
template <typename T, typename Refs, size_t... I>
constexpr std::array<bool, sizeof...(I)> fields_are(std::index_sequence<I...>) {
  return {std::is_same_v<std::remove_cvref_t<std::tuple_element_t<I, Refs>>, T>...};
}
template <typename Out, typename S, auto Idx, typename Refs, size_t... I>
std::array<Out, sizeof...(I)> named_fields(const Refs& refs, std::index_sequence<I...>) {
  return {Out{S::field_names[Idx[I]], std::get<Idx[I]>(refs)}...};
}
// The indices of S's fields of type T, in declaration order.
template <typename T, typename S>
constexpr auto field_indices() {
  using Refs = decltype(std::declval<const S&>().fields());
  constexpr size_t n = std::tuple_size_v<Refs>;
  constexpr std::array<bool, n> is_t = fields_are<T, Refs>(std::make_index_sequence<n>{});
  constexpr size_t count = static_cast<size_t>(std::count(is_t.begin(), is_t.end(), true));
  std::array<size_t, count> out{};
  for (size_t i = 0, j = 0; i < n; ++i)
    if (is_t[i]) out[j++] = i;
  return out;
}
[[noreturn]] void fail_missing_field(std::string_view op, std::string_view name);
// An op's name; "argument struct" for the compound fields, which have none.
template <typename S>
constexpr std::string_view name_of() {
  if constexpr (requires { S::name; })
    return S::name;
  else
    return "argument struct";
}
}  // namespace detail

template <typename Out, typename T, typename S>
auto fields_of_type(const S& s) {
  constexpr auto idx = detail::field_indices<T, S>();
  return detail::named_fields<Out, S, idx>(s.fields(), std::make_index_sequence<idx.size()>{});
}

template <typename Out, typename T, typename S>
std::vector<Out> fields_of_type(const S& s, std::initializer_list<std::string_view> only) {
  const auto all = fields_of_type<Out, T>(s);
  std::vector<Out> out;
  out.reserve(only.size());
  for (std::string_view name : only) {
    const Out* found = nullptr;
    for (const Out& t : all)
      if (t.name == name) found = &t;
    if (!found) detail::fail_missing_field(detail::name_of<S>(), name);
    out.push_back(*found);
  }
  return out;
}

}  // namespace flux8::ops
