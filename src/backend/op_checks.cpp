#include "backend/op_checks.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace flux8::ops {

namespace detail {
void fail_missing_field(std::string_view op, std::string_view name) {
  fail("{}: the op has no tensor field '{}' (a backend's check names a field the op does not declare)", op, name);
}
}  // namespace detail

DType call_dtype(std::string_view op, std::span<const Named> tensors, std::initializer_list<DType> allowed,
                 std::string_view backend) {
  const Named* first = nullptr;
  for (const Named& a : tensors) {
    if (!a.t.defined()) continue;
    if (std::find(allowed.begin(), allowed.end(), a.t.dtype) == allowed.end()) {
      std::string names;
      for (DType d : allowed) names += std::string(names.empty() ? "" : " or ") + std::string(dtype_name(d));
      fail("{}: tensor '{}' is {}; the {} backend computes this op in {} (convert storage types first)", op, a.name,
           a.t.str(), backend, names);
    }
    if (first && a.t.dtype != first->t.dtype)
      fail("{}: tensor '{}' is {} but '{}' is {}; all tensors of one call must share one dtype", op, a.name, a.t.str(),
           first->name, first->t.str());
    if (a.t.ld < a.t.cols())
      fail("{}: tensor '{}' ({}) has row stride {} smaller than its {} columns", op, a.name, a.t.str(), a.t.ld,
           a.t.cols());
    if (!first) first = &a;
  }
  if (!first) fail("{}: no tensor argument is defined", op);
  return first->t.dtype;
}

void require_defined(std::string_view op, Named a) {
  if (!a.t.defined()) fail("{}: tensor '{}' is required but undefined", op, a.name);
}

void require_rank(std::string_view op, Named a, int rank) {
  require_defined(op, a);
  if (a.t.shape.rank != rank) fail("{}: tensor '{}' is {} but must have rank {}", op, a.name, a.t.str(), rank);
}

void require_shape(std::string_view op, Named a, const Shape& expected) {
  require_defined(op, a);
  if (a.t.shape != expected)
    fail("{}: tensor '{}' is {} but must have shape {}", op, a.name, a.t.str(), expected.str());
}

void require_same_matrix(std::string_view op, Named a, Named b) {
  require_defined(op, a);
  require_defined(op, b);
  if (a.t.rows() != b.t.rows() || a.t.cols() != b.t.cols())
    fail("{}: tensors '{}' {} and '{}' {} must have the same [rows, cols]", op, a.name, a.t.str(), b.name, b.t.str());
}

void require_vector(std::string_view op, Named a, int64_t n) {
  require_defined(op, a);
  if (a.t.numel() != n || !a.t.contiguous())
    fail("{}: tensor '{}' is {} (ld {}) but must be a contiguous vector of {} elements", op, a.name, a.t.str(), a.t.ld,
         n);
}

void require_contiguous(std::string_view op, Named a) {
  if (a.t.defined() && !a.t.contiguous()) fail("{}: tensor '{}' ({}) must be contiguous", op, a.name, a.t.str());
}

void check_heads_tokens(std::string_view op, const Tensor& heads, const Tensor& tokens, int64_t offset) {
  require_rank(op, {"heads", heads}, 4);
  require_rank(op, {"tokens", tokens}, 3);
  const int64_t B = heads.shape[0], n = heads.shape[1], L = heads.shape[2], D = heads.shape[3];
  if (tokens.shape[0] != B || tokens.shape[2] != n * D)
    fail("{}: tokens {} do not match heads {}: expected [{}, Ls, {}]", op, tokens.str(), heads.str(), B, n * D);
  if (offset < 0 || offset + tokens.shape[1] > L)
    fail("{}: tokens {} at token_offset {} do not fit in the {} positions of heads {}", op, tokens.str(), offset, L,
         heads.str());
}

int64_t check(std::string_view op, const op::FlowMatchInputs& a) {
  for (Named n : {Named{"xt", a.xt}, Named{"target", a.target}, Named{"x0", a.x0}}) require_contiguous(op, n);
  require_shape(op, {"xt", a.xt}, a.x0.shape);
  require_shape(op, {"target", a.target}, a.x0.shape);
  const int64_t B = a.x0.shape[0];
  require_vector(op, {"t", a.t}, B);
  if (static_cast<int64_t>(a.streams.size()) != B)
    fail("{}: {} noise streams for a batch of {}", op, a.streams.size(), B);
  return B;
}

void check(std::string_view op, const op::TokensToHeads& a) {
  check_heads_tokens(op, a.heads, a.tokens, a.token_offset);
}

void check(std::string_view op, const op::HeadsToTokens& a) {
  check_heads_tokens(op, a.heads, a.tokens, a.token_offset);
}

namespace {

// What both directions of qk_norm_rope_to_heads check. The first tensor of `heads` and of
// `tokens` gives the shapes (required); the other tensors of every list are checked when defined.
QkNormRopeDims check_qk_norm_rope(std::string_view op, std::span<const Named> heads, std::span<const Named> tokens,
                                  std::span<const Named> stats, std::span<const Named> scales, const Tensor& pe,
                                  int64_t offset) {
  check_attention_heads(op, heads);  // rank 4, all alike
  const Named& h = *heads.begin();
  QkNormRopeDims d{h.t.shape[0], h.t.shape[1], h.t.shape[2], h.t.shape[3], 0};
  if (d.D % 2 != 0)
    fail("{}: head dim {} of '{}' {} must be even (RoPE turns adjacent pairs)", op, d.D, h.name, h.t.str());
  require_rank(op, *tokens.begin(), 3);
  d.Ls = tokens.begin()->t.shape[1];
  const Shape tok{d.B, d.Ls, d.n * d.D};
  for (const Named& a : tokens)
    if (a.t.defined() && a.t.shape != tok)
      fail("{}: tensor '{}' is {} but must be [B, Ls, n·D] = {} to match '{}' {}", op, a.name, a.t.str(), tok.str(),
           h.name, h.t.str());
  if (offset < 0 || offset + d.Ls > d.L)
    fail("{}: {} tokens at token_offset {} do not fit in the {} positions of '{}' {}", op, d.Ls, offset, d.L, h.name,
         h.t.str());
  for (const Named& a : stats)
    if (a.t.defined()) require_vector(op, a, d.B * d.Ls * d.n);
  for (const Named& a : scales)
    if (a.t.defined()) require_vector(op, a, d.D);
  require_shape(op, {"pe", pe}, Shape{d.B, d.L, d.D / 2, 2});
  require_contiguous(op, {"pe", pe});
  return d;
}

}  // namespace

QkNormRopeDims check(std::string_view op, const op::QkNormRopeToHeads& a) {
  // The statistics may be undefined (not saved: recomputation already has them).
  for (const Named& t : tensor_fields(a, {"q_heads", "k_heads", "v_heads", "q", "k", "v", "q_scale", "k_scale"}))
    require_defined(op, t);
  return check_qk_norm_rope(op, tensor_fields(a, {"q_heads", "k_heads", "v_heads"}), tensor_fields(a, {"q", "k", "v"}),
                            tensor_fields(a, {"q_rstd", "k_rstd"}), tensor_fields(a, {"q_scale", "k_scale"}), a.pe,
                            a.token_offset);
}

QkNormRopeDims check(std::string_view op, const op::QkNormRopeToHeadsBackward& a) {
  // Every gradient output may be undefined (skipped); dv_heads is needed only for dv.
  for (const Named& t : tensor_fields(a, {"dq_heads", "dk_heads", "q", "k", "q_rstd", "k_rstd", "q_scale", "k_scale"}))
    require_defined(op, t);
  if (a.dv.defined()) require_defined(op, {"dv_heads", a.dv_heads});
  return check_qk_norm_rope(op, tensor_fields(a, {"dq_heads", "dk_heads", "dv_heads"}),
                            tensor_fields(a, {"q", "k", "dq", "dk", "dv"}), tensor_fields(a, {"q_rstd", "k_rstd"}),
                            tensor_fields(a, {"q_scale", "k_scale", "dq_scale", "dk_scale"}), a.pe, a.token_offset);
}

namespace {
void check_joint(std::string_view op, Named joint_arg, const Tensor& a, const Tensor& b) {
  const Tensor& joint = joint_arg.t;
  require_rank(op, joint_arg, 3);
  const int64_t B = joint.shape[0], C = joint.shape[2];
  int64_t L = 0;
  for (const Named& p : {Named{"a", a}, Named{"b", b}}) {
    if (!p.t.defined()) continue;
    require_rank(op, p, 3);
    if (p.t.shape[0] != B || p.t.shape[2] != C)
      fail("{}: tensor '{}' {} must be [{}, L, {}] to match '{}' {}", op, p.name, p.t.str(), B, C, joint_arg.name,
           joint.str());
    L += p.t.shape[1];
  }
  // With both parts present they must tile the joint sequence exactly; a lone part must fit.
  if ((a.defined() && b.defined()) ? L != joint.shape[1] : L > joint.shape[1])
    fail("{}: parts a {} and b {} do not tile the sequence of '{}' {}", op, a.defined() ? a.str() : "undefined",
         b.defined() ? b.str() : "undefined", joint_arg.name, joint.str());
}
}  // namespace

void check(std::string_view op, const op::ConcatTokens& a) { check_joint(op, {"out", a.out}, a.a, a.b); }

void check(std::string_view op, const op::SplitTokens& a) { check_joint(op, {"in", a.in}, a.a, a.b); }

LinearDims check(std::string_view op, const op::Linear& a) {
  require_defined(op, {"x", a.x});
  require_rank(op, {"w", a.w}, 2);
  const int64_t N = a.x.rows(), K = a.x.cols(), M = a.w.shape[0];
  if (a.w.shape[1] != K) fail("{}: weight 'w' {} must be [M, {}] to match input 'x' {}", op, a.w.str(), K, a.x.str());
  require_defined(op, {"y", a.y});
  if (a.y.rows() != N || a.y.cols() != M)
    fail("{}: output 'y' {} must have {} rows of {} columns for x {} and w {}", op, a.y.str(), N, M, a.x.str(),
         a.w.str());
  if (a.b.defined() && (a.b.numel() != M || !a.b.contiguous()))
    fail("{}: bias 'b' {} must be a contiguous vector of {} elements", op, a.b.str(), M);
  return {N, K, M};
}

LinearGeluDims check(std::string_view op, const op::LinearGelu& a) {
  const auto [N, K, M] = check(op, op::Linear{a.h, a.x, a.w, a.b});
  require_defined(op, {"y", a.y});
  if (a.y.rows() != N || a.y.cols() < 1 || a.y.cols() > M)
    fail("{}: GELU output 'y' {} must have {} rows of 1 to {} columns (the last columns of 'h' {})", op, a.y.str(), N,
         M, a.h.str());
  return {N, K, M, a.y.cols()};
}

LinearGeluDims check(std::string_view op, const op::LinearDgradGelu& a) {
  require_defined(op, {"dy", a.dy});
  require_rank(op, {"w", a.w}, 2);
  const int64_t N = a.dy.rows(), M = a.dy.cols(), K = a.w.shape[1];
  if (a.w.shape[0] != M)
    fail("{}: weight 'w' {} must be [{}, K] to match the output gradient 'dy' {}", op, a.w.str(), M, a.dy.str());
  require_defined(op, {"h", a.h});
  require_same_matrix(op, {"dh", a.dh}, {"h", a.h});
  const int64_t gelu = a.h.cols();
  if (a.h.rows() != N || gelu < 1 || gelu > K)
    fail("{}: GELU input 'h' {} must have {} rows of 1 to {} columns (the last columns of the Linear's input)", op,
         a.h.str(), N, K);
  if (gelu == K && a.dx.defined())
    fail("{}: input gradient 'dx' {} given, but the GELU input 'h' {} covers all {} columns of the Linear's input", op,
         a.dx.str(), a.h.str(), K);
  if (gelu < K && (!a.dx.defined() || a.dx.rows() != N || a.dx.cols() != K - gelu))
    fail(
        "{}: input gradient 'dx' {} must have {} rows of {} columns (the columns of the Linear's input before the "
        "GELU's)",
        op, a.dx.str(), N, K - gelu);
  return {N, K, M, gelu};
}

NormDims check(std::string_view op, const op::LayernormModulate& a) {
  require_rank(op, {"x", a.x}, 3);
  const NormDims d{a.x.shape[0], a.x.shape[1], a.x.shape[2]};
  if (a.y.defined()) require_shape(op, {"y", a.y}, a.x.shape);  // undefined: statistics only
  require_vector(op, {"mean", a.mean}, d.B * d.L);
  require_vector(op, {"rstd", a.rstd}, d.B * d.L);
  require_shape(op, {"shift", a.shift}, Shape{d.B, d.H});
  require_shape(op, {"scale", a.scale}, Shape{d.B, d.H});
  return d;
}

int64_t check(std::string_view op, const op::GatedResidualStats& a) {
  require_rank(op, {"x", a.x}, 3);
  const int64_t B = a.x.shape[0], L = a.x.shape[1], H = a.x.shape[2];
  require_shape(op, {"out", a.out}, a.x.shape);
  require_shape(op, {"y", a.y}, a.x.shape);
  require_shape(op, {"gate", a.gate}, Shape{B, H});
  require_shape(op, {"mean", a.mean}, Shape{B, L});
  require_shape(op, {"rstd", a.rstd}, Shape{B, L});
  if (a.out.data == a.x.data) fail("{}: out must not be x (the statistics read the stored out)", op);
  if (a.mean.dtype != a.rstd.dtype || (a.mean.dtype != DType::f32 && a.mean.dtype != DType::f64))
    fail("{}: mean {} and rstd {} must share one floating type", op, a.mean.str(), a.rstd.str());
  if (a.mean.data == a.rstd.data) fail("{}: mean and rstd must be separate tensors", op);
  return B;
}

NormDims check(std::string_view op, const op::LayernormModulateBackward& a) {
  require_rank(op, {"x", a.x}, 3);
  const NormDims d{a.x.shape[0], a.x.shape[1], a.x.shape[2]};
  require_shape(op, {"dy", a.dy}, a.x.shape);
  require_vector(op, {"mean", a.mean}, d.B * d.L);
  require_vector(op, {"rstd", a.rstd}, d.B * d.L);
  return d;
}

namespace {
// Fails naming the first two of `ranges` ((begin, end) pairs, `what` the noun) that overlap.
void require_disjoint(std::string_view op, std::vector<std::pair<int64_t, int64_t>> ranges, std::string_view what) {
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second)
      fail("{}: {} [{}, {}) and [{}, {}) overlap", op, what, ranges[i - 1].first, ranges[i - 1].second, ranges[i].first,
           ranges[i].second);
}
}  // namespace

std::vector<Backend::LowRankGrad> check(std::string_view op, const op::Adamw& a) {
  for (const Named& n : tensor_fields(a)) {
    require_contiguous(op, n);
    require_vector(op, n, a.param.numel());
  }
  if (a.h.step < 1) fail("{}: step must be >= 1 (1-based), got {}", op, a.h.step);
  // The moments in the parameters' type, or both bf16 with f32 parameters (adam_moment_precision).
  const bool bf16_moments = a.m.dtype == DType::bf16 && a.v.dtype == DType::bf16 && a.param.dtype == DType::f32;
  if (!bf16_moments && (a.m.dtype != a.param.dtype || a.v.dtype != a.param.dtype))
    fail(
        "{}: the moments 'm' ({}) and 'v' ({}) must both be in the parameters' type ({}), or both bf16 with f32 "
        "parameters",
        op, dtype_name(a.m.dtype), dtype_name(a.v.dtype), dtype_name(a.param.dtype));
  std::vector<std::pair<int64_t, int64_t>> ranges;  // (offset, end): no two outputs may overlap
  const auto inside = [&](const char* what, size_t i, int64_t offset, int64_t count) {
    if (offset < 0 || offset + count > a.param.numel())
      fail("{}: {} {} of {} elements at offset {} lies outside the {} parameters", op, what, i, count, offset,
           a.param.numel());
    ranges.emplace_back(offset, offset + count);
  };
  for (size_t i = 0; i < a.copies.size(); ++i) {
    const Backend::ParamCopy& c = a.copies[i];
    if (!c.copy.defined() || c.copy.dtype != DType::bf16 || !c.copy.contiguous())
      fail("{}: copy {} ({}) must be a contiguous bf16 tensor", op, i, c.copy.str());
    inside("copy", i, c.offset, c.copy.numel());
  }
  for (size_t i = 0; i < a.casts.size(); ++i) {
    const Backend::ParamCast& c = a.casts[i];
    if (!c.codes.defined() || c.codes.scaling != Fp8Scaling::per_tensor || !c.codes.scale_inv || !c.scale || !c.amax)
      fail("{}: cast {} needs per-tensor codes with their scale_inv, a scale and an amax target", op, i);
    inside("cast", i, c.offset, c.codes.numel());
  }
  require_disjoint(op, ranges, "the outputs for the parameters");
  return check_low_rank_grads(op, a.param.numel(), a.low_rank);
}

std::vector<Backend::LowRankGrad> check_low_rank_grads(std::string_view op, int64_t n,
                                                       std::span<const Backend::LowRankGrad> low_rank) {
  for (size_t i = 0; i < low_rank.size(); ++i) {
    const Backend::LowRankGrad& g = low_rank[i];
    for (const Tensor* t : {&g.a, &g.b})
      if (!t->defined() || t->dtype != DType::f32 || t->shape.rank != 2 || !t->contiguous())
        fail("{}: low-rank gradient {} needs contiguous f32 factors a [R, M] and b [R, K], got a {} and b {}", op, i,
             g.a.str(), g.b.str());
    if (g.rank() < 1 || g.rank() != g.b.shape[0])
      fail("{}: low-rank gradient {}: factors a {} and b {} need the same R >= 1 rows", op, i, g.a.str(), g.b.str());
    if (g.offset < 0 || g.end() > n)
      fail("{}: low-rank gradient {} of {} elements at offset {} lies outside the {} gradients", op, i, g.size(),
           g.offset, n);
  }
  std::vector<Backend::LowRankGrad> sorted(low_rank.begin(), low_rank.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& x, const auto& y) { return x.offset < y.offset; });
  for (size_t i = 1; i < sorted.size(); ++i)  // sorted by offset: only neighbours can overlap
    if (sorted[i].offset < sorted[i - 1].end())
      fail("{}: the low-rank gradients of [{}, {}) and [{}, {}) overlap", op, sorted[i - 1].offset, sorted[i - 1].end(),
           sorted[i].offset, sorted[i].end());
  return sorted;
}

std::vector<Backend::LowRankGrad> check(std::string_view op, const op::GradientSumSquares& a) {
  return check_low_rank_grads(op, a.grads.numel(), a.low_rank);
}

void check(std::string_view op, const op::RangesSumSquares& a) {
  require_defined(op, {"x", a.x});
  require_contiguous(op, {"x", a.x});
  for (const ElementRange& r : a.ranges)
    if (r.begin < 0 || r.count < 0 || r.end() > a.x.numel())
      fail("{}: range [{}, {}) is not inside x {} of {} elements", op, r.begin, r.end(), a.x.str(), a.x.numel());
}

void check(std::string_view op, const op::TransposeCodes& a) {
  if (!a.dst.defined() || !a.src.defined() || a.dst.scaling != Fp8Scaling::per_tensor ||
      a.src.scaling != Fp8Scaling::per_tensor || !a.dst.scale_inv || !a.src.scale_inv)
    fail("{}: 'dst' and 'src' must be per-tensor FP8 casts with their scale_inv", op);
  if (a.dst.rows != a.src.cols || a.dst.cols != a.src.rows || a.dst.format != a.src.format)
    fail("{}: 'dst' [{}, {}] {} must be 'src' [{}, {}] {} transposed", op, a.dst.rows, a.dst.cols,
         fp8_format_name(a.dst.format), a.src.rows, a.src.cols, fp8_format_name(a.src.format));
}

void check_cast_input(std::string_view op, const Backend::CastInput& in) {
  require_defined(op, {"x", in.x});
  if (in.x.ld < in.x.cols()) fail("{}: input {} has row stride {} smaller than its columns", op, in.x.str(), in.x.ld);
  if (!in.head.defined()) return;
  if (in.head.rows() != in.x.rows() || in.head.dtype != in.x.dtype || in.head.ld < in.head.cols())
    fail("{}: the cast's head {} must have the rows and dtype of x {} (its columns come first)", op, in.head.str(),
         in.x.str());
}

void check_column_sums(std::string_view op, const Tensor& sums, int64_t cols, bool bf16_ok) {
  if (!sums.defined()) return;
  const bool type_ok = sums.dtype == DType::f32 || (bf16_ok && sums.dtype == DType::bf16);
  if (!type_ok || !sums.contiguous() || sums.numel() != cols)
    fail("{}: 'column_sums' {} must be a contiguous {} vector of {} elements (one per column of the input)", op,
         sums.str(), bf16_ok ? "f32 or bf16" : "f32", cols);
}

namespace {
// QK-norm: rows of x are n·D with D = scale.numel() (contiguous scale); returns D.
template <typename Op>
int64_t rmsnorm_head_dim(std::string_view op, const Op& a) {
  require_defined(op, {"x", a.x});
  require_defined(op, {"scale", a.scale});
  const int64_t D = a.scale.numel();
  if (D == 0 || a.x.cols() % D != 0 || !a.scale.contiguous())
    fail("{}: x {} must have rows of n·D elements with D = {} from a contiguous 'scale' {}", op, a.x.str(), D,
         a.scale.str());
  return D;
}
}  // namespace

RmsnormDims check(std::string_view op, const op::RmsnormHeads& a) {
  const int64_t D = rmsnorm_head_dim(op, a), rows = a.x.rows(), n = a.x.cols() / D;
  require_same_matrix(op, {"y", a.y}, {"x", a.x});
  require_vector(op, {"rstd", a.rstd}, rows * n);
  return {D, n, rows};
}

RmsnormDims check(std::string_view op, const op::RmsnormHeadsBackward& a) {
  const int64_t D = rmsnorm_head_dim(op, a), rows = a.x.rows(), n = a.x.cols() / D;
  require_same_matrix(op, {"dy", a.dy}, {"x", a.x});
  require_vector(op, {"rstd", a.rstd}, rows * n);
  if (a.dx.defined()) require_same_matrix(op, {"dx", a.dx}, {"x", a.x});
  if (a.dscale.defined()) require_vector(op, {"dscale", a.dscale}, D);
  return {D, n, rows};
}

void check(std::string_view op, const op::GatedResidual& a) {
  require_rank(op, {"x", a.x}, 3);
  require_shape(op, {"out", a.out}, a.x.shape);
  require_shape(op, {"y", a.y}, a.x.shape);
  require_shape(op, {"gate", a.gate}, Shape{a.x.shape[0], a.x.shape[2]});
}

NormDims check(std::string_view op, const op::GatedResidualBackward& a) {
  require_rank(op, {"dx", a.dx}, 3);
  const NormDims d{a.dx.shape[0], a.dx.shape[1], a.dx.shape[2]};
  if (a.dy.defined()) {
    require_shape(op, {"dy", a.dy}, a.dx.shape);
    require_shape(op, {"gate", a.gate}, Shape{d.B, d.H});
  }
  if (a.dgate.defined()) {
    require_shape(op, {"y", a.y}, a.dx.shape);
    require_shape(op, {"dgate", a.dgate}, Shape{d.B, d.H});
  }
  return d;
}

void check_attention_heads(std::string_view op, std::span<const Named> heads) {
  const Named& q = *heads.begin();
  require_rank(op, q, 4);
  for (const Named& a : heads)
    if (a.t.defined()) require_shape(op, a, q.t.shape);
}

AttentionDims check(std::string_view op, const op::Attention& a) {
  check_attention_heads(op, tensor_fields(a, {"q", "k", "v", "o"}));
  for (const Named& t : tensor_fields(a, {"k", "v", "o"})) require_defined(op, t);
  const AttentionDims d{a.q.shape[0], a.q.shape[1], a.q.shape[2], a.q.shape[3]};
  require_vector(op, {"lse", a.lse}, d.B * d.n * d.L);  // [B, n, L] or flat, like mean/rstd
  return d;
}

AttentionDims check(std::string_view op, const op::AttentionBackward& a) {
  check_attention_heads(op, tensor_fields(a, {"q", "k", "v", "o", "dout", "dq", "dk", "dv"}));
  for (const Named& t : tensor_fields(a, {"k", "v", "o", "dout"})) require_defined(op, t);
  const AttentionDims d{a.q.shape[0], a.q.shape[1], a.q.shape[2], a.q.shape[3]};
  require_vector(op, {"lse", a.lse}, d.B * d.n * d.L);
  return d;
}

bool check_quantize(std::string_view op, const QTensor& rowwise, const QTensor& columnwise, const Tensor& x,
                    std::initializer_list<DType> x_types) {
  require_defined(op, {"x", x});
  if (std::find(x_types.begin(), x_types.end(), x.dtype) == x_types.end()) {
    std::string names;
    for (DType d : x_types) names += std::string(names.empty() ? "" : " or ") + std::string(dtype_name(d));
    fail("{}: FP8 casts take {} input, got {}", op, names, x.str());
  }
  if (x.ld < x.cols()) fail("{}: input {} has row stride {} smaller than its columns", op, x.str(), x.ld);
  if (!rowwise.defined() && !columnwise.defined()) return false;
  const int64_t R = x.rows(), C = x.cols();
  if (rowwise.defined() && (rowwise.rows != R || rowwise.cols != C))
    fail("{}: rowwise output [{}, {}] for input {}", op, rowwise.rows, rowwise.cols, x.str());
  if (columnwise.defined() && (columnwise.rows != C || columnwise.cols != R))
    fail("{}: columnwise output [{}, {}] must be the transpose of input {}", op, columnwise.rows, columnwise.cols,
         x.str());
  return true;
}

void check_quantize_spec(std::string_view op, const QuantizeSpec& q) {
  if (q.whole_amax && (q.delayed_scale || q.scaling != Fp8Scaling::per_tensor))
    fail("{}: whole_amax is for current per-tensor scaling; this cast has {}{}", op, fp8_scaling_name(q.scaling),
         q.delayed_scale ? " with a delayed scale" : " scaling");
}

void check(std::string_view op, const op::CastAmax& a, std::initializer_list<DType> x_types) {
  check_cast_input(op, a.in);
  check_quantize(op, QTensor{}, QTensor{}, a.in.x, x_types);
  if (!a.amax.defined() || a.amax.dtype != DType::f32 || a.amax.numel() != 1 || !a.amax.contiguous())
    fail("{}: amax {} must be one contiguous f32 element", op, a.amax.str());
}

namespace {

// A defined per-tensor cast with its scale_inv, or an error naming it (`what`: "FP8 tensor 'q'").
void require_per_tensor_cast(std::string_view op, std::string_view what, const QTensor& q) {
  if (!q.defined()) fail("{}: {} is not defined", op, what);
  if (q.scaling != Fp8Scaling::per_tensor || !q.scale_inv)
    fail("{}: {} must be a per-tensor cast with its scale_inv (got {} scaling)", op, what, fp8_scaling_name(q.scaling));
}

// The scales of `sc` named in `only` that a call reads: each must be given.
void require_scales(std::string_view op, const Fp8AttentionScales& sc, std::initializer_list<std::string_view> only) {
  for_each_field(sc, [&](std::string_view name, const auto& p) {
    if (std::find(only.begin(), only.end(), name) != only.end() && !p)
      fail("{}: scale '{}' is not given (Fp8AttentionScales)", op, name);
  });
}

// What both directions of FP8 attention check; `tensors` are every QTensor of the call.
AttentionDims check_attention_fp8(std::string_view op, const Shape& heads, std::span<const NamedQ> tensors,
                                  const QTensor& q, const Tensor& lse) {
  if (heads.rank != 4) fail("{}: heads {} must be [B, n, L, D]", op, heads.str());
  const AttentionDims d{heads[0], heads[1], heads[2], heads[3]};
  for (const NamedQ& t : tensors) {
    require_per_tensor_cast(op, fmt::format("FP8 tensor '{}'", t.name), t.q);
    if (t.q.rows != d.B * d.n * d.L || t.q.cols != d.D)
      fail("{}: FP8 tensor '{}' is [{}, {}] but heads {} need [B·n·L, D] = [{}, {}]", op, t.name, t.q.rows, t.q.cols,
           heads.str(), d.B * d.n * d.L, d.D);
    if ((t.name == "k" || t.name == "v") && t.q.format != q.format)
      fail("{}: q, k and v must share one FP8 format ('{}' is {}, '{}' {})", op, t.name, fp8_format_name(t.q.format),
           "q", fp8_format_name(q.format));
  }
  require_contiguous(op, {"lse", lse});
  require_vector(op, {"lse", lse}, d.B * d.n * d.L);
  if (lse.dtype != DType::f32) fail("{}: lse {} must be f32", op, lse.str());
  return d;
}

// The FP8 heads of an op: its Fp8Heads fields' codes and its QTensor fields, in declaration order.
template <typename Op>
std::vector<NamedQ> fp8_heads_of(const Op& a) {
  std::vector<NamedQ> heads;
  for_each_field(a, [&](std::string_view name, const auto& f) {
    using F = std::remove_cvref_t<decltype(f)>;
    if constexpr (std::is_same_v<F, Fp8Heads>) heads.push_back({name, f.codes});
    if constexpr (std::is_same_v<F, QTensor>) heads.push_back({name, f});
  });
  return heads;
}

// What every FP8-heads op checks: `tokens` one stream of the joint sequence the heads hold.
Shape check_fp8_heads(std::string_view op, const Tensor& tokens, int64_t token_offset, std::span<const NamedQ> heads) {
  require_defined(op, {"tokens", tokens});
  require_rank(op, {"tokens", tokens}, 3);
  const NamedQ& first = *heads.begin();
  for (const NamedQ& t : heads) {
    require_per_tensor_cast(op, fmt::format("FP8 heads tensor '{}'", t.name), t.q);
    if (t.q.rows != first.q.rows || t.q.cols != first.q.cols)
      fail("{}: FP8 heads '{}' are [{}, {}] but '{}' [{}, {}]: one shape for all", op, t.name, t.q.rows, t.q.cols,
           first.name, first.q.rows, first.q.cols);
  }
  const int64_t B = tokens.shape[0], Ls = tokens.shape[1], D = first.q.cols;
  if (D <= 0 || tokens.shape[2] % D != 0)
    fail("{}: tokens {} are not whole heads of the FP8 heads' width D = {}", op, tokens.str(), D);
  const int64_t n = tokens.shape[2] / D;
  if (B * n == 0 || first.q.rows % (B * n) != 0)
    fail("{}: FP8 heads '{}' have {} rows, not B·n·L for B = {}, n = {} (tokens {})", op, first.name, first.q.rows, B,
         n, tokens.str());
  const int64_t L = first.q.rows / (B * n);
  if (token_offset < 0 || token_offset + Ls > L)
    fail("{}: tokens {} at offset {} do not fit the joint length L = {} of the FP8 heads", op, tokens.str(),
         token_offset, L);
  return Shape{B, n, L, D};
}

}  // namespace

AttentionDims check(std::string_view op, const op::AttentionFp8& a) {
  const AttentionDims d = check_attention_fp8(op, a.heads, qtensor_fields(a, {"q", "k", "v", "o"}), a.q, a.lse);
  require_scales(op, a.sc, {"o"});
  return d;
}

AttentionDims check(std::string_view op, const op::AttentionFp8Backward& a) {
  const AttentionDims d =
      check_attention_fp8(op, a.heads, qtensor_fields(a, {"q", "k", "v", "o", "dout", "dq", "dk", "dv"}), a.q, a.lse);
  require_scales(op, a.sc, {"ds", "ds_inv", "dq", "dk", "dv"});
  return d;
}

Shape check(std::string_view op, const op::QkNormRopeToHeadsFp8& a) {
  return check_fp8_heads(op, a.q, a.token_offset, fp8_heads_of(a));
}

Shape check(std::string_view op, const op::QkNormRopeToHeadsBackwardFp8& a) {
  return check_fp8_heads(op, a.q, a.token_offset, fp8_heads_of(a));
}

Shape check(std::string_view op, const op::TokensToHeadsFp8& a) {
  return check_fp8_heads(op, a.tokens, a.token_offset, fp8_heads_of(a));
}

Shape check(std::string_view op, const op::HeadsToTokensFp8& a) {
  return check_fp8_heads(op, a.tokens, a.token_offset, fp8_heads_of(a));
}

void check(std::string_view op, const op::Dequantize& a) {
  require_defined(op, {"y", a.y});
  if (!a.x.defined()) fail("{}: FP8 tensor 'x' is not defined", op);
  if (a.x.scaling != Fp8Scaling::per_tensor || !a.x.scale_inv)
    fail("{}: x must be a per-tensor cast with its scale_inv (got {} scaling)", op, fp8_scaling_name(a.x.scaling));
  if (a.y.dtype != DType::f32 && a.y.dtype != DType::bf16) fail("{}: y {} must be f32 or bf16", op, a.y.str());
  if (a.y.rows() != a.x.rows || a.y.cols() != a.x.cols)
    fail("{}: y {} does not hold x's [{}, {}]", op, a.y.str(), a.x.rows, a.x.cols);
  if (a.y.ld < a.y.cols()) fail("{}: y {} has row stride {} smaller than its columns", op, a.y.str(), a.y.ld);
}

DelayedUpdateDims check(std::string_view op, const op::DelayedScalingUpdate& a) {
  require_rank(op, {"amax_history", a.amax_history}, 2);
  require_contiguous(op, {"amax_history", a.amax_history});
  const int64_t L = a.amax_history.shape[0], n = a.amax_history.shape[1];
  if (L < 1) fail("{}: amax_history {} has no staging row (history length must be >= 1)", op, a.amax_history.str());
  require_vector(op, {"scale", a.scale}, n);
  require_vector(op, {"scale_inv", a.scale_inv}, n);
  require_vector(op, {"fp8_max", a.fp8_max}, n);
  for (const Named& t : tensor_fields(a))
    if (t.t.dtype != DType::f32) fail("{}: tensor '{}' is {} but must be f32", op, t.name, t.t.str());
  return {L, n};
}

}  // namespace flux8::ops
