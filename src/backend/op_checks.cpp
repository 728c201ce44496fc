#include "backend/op_checks.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace flux8::ops {

DType call_dtype(std::string_view op, std::initializer_list<Named> tensors, std::initializer_list<DType> allowed,
                 std::string_view backend) {
  const Named* first = nullptr;
  for (const Named& a : tensors) {
    if (!a.t.defined()) continue;
    if (std::find(allowed.begin(), allowed.end(), a.t.dtype) == allowed.end()) {
      std::string names;
      for (DType d : allowed) names += std::string(names.empty() ? "" : " or ") + std::string(dtype_name(d));
      fail("{}: tensor '{}' is {}; the {} backend computes this op in {} (convert storage types first)", op,
           a.name, a.t.str(), backend, names);
    }
    if (first && a.t.dtype != first->t.dtype)
      fail("{}: tensor '{}' is {} but '{}' is {}; all tensors of one call must share one dtype", op,
           a.name, a.t.str(), first->name, first->t.str());
    if (a.t.ld < a.t.cols())
      fail("{}: tensor '{}' ({}) has row stride {} smaller than its {} columns", op, a.name,
           a.t.str(), a.t.ld, a.t.cols());
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
  if (a.t.shape.rank != rank)
    fail("{}: tensor '{}' is {} but must have rank {}", op, a.name, a.t.str(), rank);
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
    fail("{}: tensors '{}' {} and '{}' {} must have the same [rows, cols]", op, a.name, a.t.str(),
         b.name, b.t.str());
}

void require_vector(std::string_view op, Named a, int64_t n) {
  require_defined(op, a);
  if (a.t.numel() != n || !a.t.contiguous())
    fail("{}: tensor '{}' is {} (ld {}) but must be a contiguous vector of {} elements", op, a.name,
         a.t.str(), a.t.ld, n);
}

void require_contiguous(std::string_view op, Named a) {
  if (a.t.defined() && !a.t.contiguous())
    fail("{}: tensor '{}' ({}) must be contiguous", op, a.name, a.t.str());
}

void check_heads_tokens(std::string_view op, const Tensor& heads, const Tensor& tokens,
                        int64_t offset) {
  require_rank(op, {"heads", heads}, 4);
  require_rank(op, {"tokens", tokens}, 3);
  const int64_t B = heads.shape[0], n = heads.shape[1], L = heads.shape[2], D = heads.shape[3];
  if (tokens.shape[0] != B || tokens.shape[2] != n * D)
    fail("{}: tokens {} do not match heads {}: expected [{}, Ls, {}]", op, tokens.str(),
         heads.str(), B, n * D);
  if (offset < 0 || offset + tokens.shape[1] > L)
    fail("{}: tokens {} at token_offset {} do not fit in the {} positions of heads {}", op,
         tokens.str(), offset, L, heads.str());
}

namespace {

// What both directions of qk_norm_rope_to_heads check. The first tensor of `heads` and of
// `tokens` gives the shapes (required); the other tensors of every list are checked when defined.
QkNormRopeDims check_qk_norm_rope(std::string_view op, std::initializer_list<Named> heads,
                                  std::initializer_list<Named> tokens, std::initializer_list<Named> stats,
                                  std::initializer_list<Named> scales, const Tensor& pe, int64_t offset) {
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

QkNormRopeDims check_qk_norm_rope_to_heads(std::string_view op, const Tensor& q_heads, const Tensor& k_heads,
                                           const Tensor& v_heads, const Tensor& q_rstd, const Tensor& k_rstd,
                                           const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_scale,
                                           const Tensor& k_scale, const Tensor& pe, int64_t offset) {
  // The statistics may be undefined (not saved: recomputation already has them).
  for (const Named& a : {Named{"q_heads", q_heads}, Named{"k_heads", k_heads}, Named{"v_heads", v_heads},
                         Named{"q", q}, Named{"k", k}, Named{"v", v}, Named{"q_scale", q_scale},
                         Named{"k_scale", k_scale}})
    require_defined(op, a);
  return check_qk_norm_rope(op, {{"q_heads", q_heads}, {"k_heads", k_heads}, {"v_heads", v_heads}},
                            {{"q", q}, {"k", k}, {"v", v}}, {{"q_rstd", q_rstd}, {"k_rstd", k_rstd}},
                            {{"q_scale", q_scale}, {"k_scale", k_scale}}, pe, offset);
}

QkNormRopeDims check_qk_norm_rope_to_heads_backward(std::string_view op, const Tensor& dq, const Tensor& dk,
                                                    const Tensor& dv, const Tensor& dq_scale, const Tensor& dk_scale,
                                                    const Tensor& dq_heads, const Tensor& dk_heads,
                                                    const Tensor& dv_heads, const Tensor& q, const Tensor& k,
                                                    const Tensor& q_rstd, const Tensor& k_rstd, const Tensor& q_scale,
                                                    const Tensor& k_scale, const Tensor& pe, int64_t offset) {
  // Every gradient output may be undefined (skipped); dv_heads is needed only for dv.
  for (const Named& a : {Named{"dq_heads", dq_heads}, Named{"dk_heads", dk_heads}, Named{"q", q}, Named{"k", k},
                         Named{"q_rstd", q_rstd}, Named{"k_rstd", k_rstd}, Named{"q_scale", q_scale},
                         Named{"k_scale", k_scale}})
    require_defined(op, a);
  if (dv.defined()) require_defined(op, {"dv_heads", dv_heads});
  return check_qk_norm_rope(op, {{"dq_heads", dq_heads}, {"dk_heads", dk_heads}, {"dv_heads", dv_heads}},
                            {{"q", q}, {"k", k}, {"dq", dq}, {"dk", dk}, {"dv", dv}},
                            {{"q_rstd", q_rstd}, {"k_rstd", k_rstd}},
                            {{"q_scale", q_scale}, {"k_scale", k_scale}, {"dq_scale", dq_scale},
                             {"dk_scale", dk_scale}},
                            pe, offset);
}

void check_joint(std::string_view op, Named joint_arg, const Tensor& a, const Tensor& b) {
  const Tensor& joint = joint_arg.t;
  require_rank(op, joint_arg, 3);
  const int64_t B = joint.shape[0], C = joint.shape[2];
  int64_t L = 0;
  for (const Named& p : {Named{"a", a}, Named{"b", b}}) {
    if (!p.t.defined()) continue;
    require_rank(op, p, 3);
    if (p.t.shape[0] != B || p.t.shape[2] != C)
      fail("{}: tensor '{}' {} must be [{}, L, {}] to match '{}' {}", op, p.name, p.t.str(), B, C,
           joint_arg.name, joint.str());
    L += p.t.shape[1];
  }
  // With both parts present they must tile the joint sequence exactly; a lone part must fit.
  if ((a.defined() && b.defined()) ? L != joint.shape[1] : L > joint.shape[1])
    fail("{}: parts a {} and b {} do not tile the sequence of '{}' {}", op,
         a.defined() ? a.str() : "undefined", b.defined() ? b.str() : "undefined", joint_arg.name,
         joint.str());
}

LinearDims check_linear(std::string_view op, const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& b) {
  require_defined(op, {"x", x});
  require_rank(op, {"w", w}, 2);
  const int64_t N = x.rows(), K = x.cols(), M = w.shape[0];
  if (w.shape[1] != K) fail("{}: weight 'w' {} must be [M, {}] to match input 'x' {}", op, w.str(), K, x.str());
  require_defined(op, {"y", y});
  if (y.rows() != N || y.cols() != M)
    fail("{}: output 'y' {} must have {} rows of {} columns for x {} and w {}", op, y.str(), N, M, x.str(),
         w.str());
  if (b.defined() && (b.numel() != M || !b.contiguous()))
    fail("{}: bias 'b' {} must be a contiguous vector of {} elements", op, b.str(), M);
  return {N, K, M};
}

LinearGeluDims check_linear_gelu(std::string_view op, const Tensor& y, const Tensor& h, const Tensor& x,
                                 const Tensor& w, const Tensor& b) {
  const auto [N, K, M] = check_linear(op, h, x, w, b);
  require_defined(op, {"y", y});
  if (y.rows() != N || y.cols() < 1 || y.cols() > M)
    fail("{}: GELU output 'y' {} must have {} rows of 1 to {} columns (the last columns of 'h' {})", op, y.str(), N,
         M, h.str());
  return {N, K, M, y.cols()};
}

LinearGeluDims check_linear_dgrad_gelu(std::string_view op, const Tensor& dx, const Tensor& dh, const Tensor& dy,
                                       const Tensor& w, const Tensor& h) {
  require_defined(op, {"dy", dy});
  require_rank(op, {"w", w}, 2);
  const int64_t N = dy.rows(), M = dy.cols(), K = w.shape[1];
  if (w.shape[0] != M)
    fail("{}: weight 'w' {} must be [{}, K] to match the output gradient 'dy' {}", op, w.str(), M, dy.str());
  require_defined(op, {"h", h});
  require_same_matrix(op, {"dh", dh}, {"h", h});
  const int64_t gelu = h.cols();
  if (h.rows() != N || gelu < 1 || gelu > K)
    fail("{}: GELU input 'h' {} must have {} rows of 1 to {} columns (the last columns of the Linear's input)", op,
         h.str(), N, K);
  if (gelu == K && dx.defined())
    fail("{}: input gradient 'dx' {} given, but the GELU input 'h' {} covers all {} columns of the Linear's input",
         op, dx.str(), h.str(), K);
  if (gelu < K && (!dx.defined() || dx.rows() != N || dx.cols() != K - gelu))
    fail("{}: input gradient 'dx' {} must have {} rows of {} columns (the columns of the Linear's input before the "
         "GELU's)",
         op, dx.str(), N, K - gelu);
  return {N, K, M, gelu};
}

NormDims check_layernorm_modulate(std::string_view op, const Tensor& y, const Tensor& mean, const Tensor& rstd,
                                  const Tensor& x, const Tensor& shift, const Tensor& scale) {
  require_rank(op, {"x", x}, 3);
  const NormDims d{x.shape[0], x.shape[1], x.shape[2]};
  if (y.defined()) require_shape(op, {"y", y}, x.shape);  // undefined: statistics only
  require_vector(op, {"mean", mean}, d.B * d.L);
  require_vector(op, {"rstd", rstd}, d.B * d.L);
  require_shape(op, {"shift", shift}, Shape{d.B, d.H});
  require_shape(op, {"scale", scale}, Shape{d.B, d.H});
  return d;
}

int64_t check_gated_residual_stats(std::string_view op, const Tensor& out, const Tensor& mean, const Tensor& rstd,
                                   const Tensor& x, const Tensor& y, const Tensor& gate) {
  require_rank(op, {"x", x}, 3);
  const int64_t B = x.shape[0], L = x.shape[1], H = x.shape[2];
  require_shape(op, {"out", out}, x.shape);
  require_shape(op, {"y", y}, x.shape);
  require_shape(op, {"gate", gate}, Shape{B, H});
  require_shape(op, {"mean", mean}, Shape{B, L});
  require_shape(op, {"rstd", rstd}, Shape{B, L});
  if (out.data == x.data) fail("{}: out must not be x (the statistics read the stored out)", op);
  if (mean.dtype != rstd.dtype || (mean.dtype != DType::f32 && mean.dtype != DType::f64))
    fail("{}: mean {} and rstd {} must share one floating type", op, mean.str(), rstd.str());
  if (mean.data == rstd.data) fail("{}: mean and rstd must be separate tensors", op);
  return B;
}

NormDims check_layernorm_modulate_backward(std::string_view op, const Tensor& dy, const Tensor& x,
                                           const Tensor& mean, const Tensor& rstd) {
  require_rank(op, {"x", x}, 3);
  const NormDims d{x.shape[0], x.shape[1], x.shape[2]};
  require_shape(op, {"dy", dy}, x.shape);
  require_vector(op, {"mean", mean}, d.B * d.L);
  require_vector(op, {"rstd", rstd}, d.B * d.L);
  return d;
}

namespace {
// Fails naming the first two of `ranges` ((begin, end) pairs, `what` the noun) that overlap.
void require_disjoint(std::string_view op, std::vector<std::pair<int64_t, int64_t>> ranges, std::string_view what) {
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second)
      fail("{}: {} [{}, {}) and [{}, {}) overlap", op, what, ranges[i - 1].first, ranges[i - 1].second,
           ranges[i].first, ranges[i].second);
}
}  // namespace

std::vector<Backend::LowRankGrad> check_adamw(std::string_view op, const Tensor& param, const Tensor& grad,
                                              const Tensor& m, const Tensor& v, const Backend::AdamW& h,
                                              std::span<const Backend::ParamCopy> copies,
                                              std::span<const Backend::ParamCast> casts,
                                              std::span<const Backend::LowRankGrad> low_rank) {
  for (Named n : {Named{"param", param}, Named{"grad", grad}, Named{"m", m}, Named{"v", v}}) {
    require_contiguous(op, n);
    require_vector(op, n, param.numel());
  }
  if (h.step < 1) fail("{}: step must be >= 1 (1-based), got {}", op, h.step);
  // The moments in the parameters' type, or both bf16 with f32 parameters (adam_moment_precision).
  const bool bf16_moments = m.dtype == DType::bf16 && v.dtype == DType::bf16 && param.dtype == DType::f32;
  if (!bf16_moments && (m.dtype != param.dtype || v.dtype != param.dtype))
    fail("{}: the moments 'm' ({}) and 'v' ({}) must both be in the parameters' type ({}), or both bf16 with f32 "
         "parameters",
         op, dtype_name(m.dtype), dtype_name(v.dtype), dtype_name(param.dtype));
  std::vector<std::pair<int64_t, int64_t>> ranges;  // (offset, end): no two outputs may overlap
  const auto inside = [&](const char* what, size_t i, int64_t offset, int64_t count) {
    if (offset < 0 || offset + count > param.numel())
      fail("{}: {} {} of {} elements at offset {} lies outside the {} parameters", op, what, i, count, offset,
           param.numel());
    ranges.emplace_back(offset, offset + count);
  };
  for (size_t i = 0; i < copies.size(); ++i) {
    const Backend::ParamCopy& c = copies[i];
    if (!c.copy.defined() || c.copy.dtype != DType::bf16 || !c.copy.contiguous())
      fail("{}: copy {} ({}) must be a contiguous bf16 tensor", op, i, c.copy.str());
    inside("copy", i, c.offset, c.copy.numel());
  }
  for (size_t i = 0; i < casts.size(); ++i) {
    const Backend::ParamCast& c = casts[i];
    if (!c.codes.defined() || c.codes.scaling != Fp8Scaling::per_tensor || !c.codes.scale_inv || !c.scale || !c.amax)
      fail("{}: cast {} needs per-tensor codes with their scale_inv, a scale and an amax target", op, i);
    inside("cast", i, c.offset, c.codes.numel());
  }
  require_disjoint(op, ranges, "the outputs for the parameters");
  return check_low_rank_grads(op, param.numel(), low_rank);
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
      fail("{}: the low-rank gradients of [{}, {}) and [{}, {}) overlap", op, sorted[i - 1].offset,
           sorted[i - 1].end(), sorted[i].offset, sorted[i].end());
  return sorted;
}

void check_transpose_codes(std::string_view op, const QTensor& dst, const QTensor& src) {
  if (!dst.defined() || !src.defined() || dst.scaling != Fp8Scaling::per_tensor ||
      src.scaling != Fp8Scaling::per_tensor || !dst.scale_inv || !src.scale_inv)
    fail("{}: 'dst' and 'src' must be per-tensor FP8 casts with their scale_inv", op);
  if (dst.rows != src.cols || dst.cols != src.rows || dst.format != src.format)
    fail("{}: 'dst' [{}, {}] {} must be 'src' [{}, {}] {} transposed", op, dst.rows, dst.cols,
         fp8_format_name(dst.format), src.rows, src.cols, fp8_format_name(src.format));
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

int64_t rmsnorm_head_dim(std::string_view op, const Tensor& x, const Tensor& scale) {
  require_defined(op, {"x", x});
  require_defined(op, {"scale", scale});
  const int64_t D = scale.numel();
  if (D == 0 || x.cols() % D != 0 || !scale.contiguous())
    fail("{}: x {} must have rows of n·D elements with D = {} from a contiguous 'scale' {}", op, x.str(), D,
         scale.str());
  return D;
}

void check_attention_heads(std::string_view op, std::initializer_list<Named> heads) {
  const Named& q = *heads.begin();
  require_rank(op, q, 4);
  for (const Named& a : heads)
    if (a.t.defined()) require_shape(op, a, q.t.shape);
}

AttentionDims check_attention(std::string_view op, const Tensor& o, const Tensor& lse, const Tensor& q,
                              const Tensor& k, const Tensor& v) {
  check_attention_heads(op, {{"q", q}, {"k", k}, {"v", v}, {"o", o}});
  for (const Named& a : {Named{"k", k}, Named{"v", v}, Named{"o", o}}) require_defined(op, a);
  const AttentionDims d{q.shape[0], q.shape[1], q.shape[2], q.shape[3]};
  require_vector(op, {"lse", lse}, d.B * d.n * d.L);  // [B, n, L] or flat, like mean/rstd
  return d;
}

AttentionDims check_attention_backward(std::string_view op, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                       const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& o, const Tensor& lse) {
  check_attention_heads(
      op, {{"q", q}, {"k", k}, {"v", v}, {"o", o}, {"dout", dout}, {"dq", dq}, {"dk", dk}, {"dv", dv}});
  for (const Named& a : {Named{"k", k}, Named{"v", v}, Named{"o", o}, Named{"dout", dout}}) require_defined(op, a);
  const AttentionDims d{q.shape[0], q.shape[1], q.shape[2], q.shape[3]};
  require_vector(op, {"lse", lse}, d.B * d.n * d.L);
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

namespace {

// A defined per-tensor cast with its scale_inv, or an error naming it (`what`: "FP8 tensor 'q'").
void require_per_tensor_cast(std::string_view op, std::string_view what, const QTensor& q) {
  if (!q.defined()) fail("{}: {} is not defined", op, what);
  if (q.scaling != Fp8Scaling::per_tensor || !q.scale_inv)
    fail("{}: {} must be a per-tensor cast with its scale_inv (got {} scaling)", op, what,
         fp8_scaling_name(q.scaling));
}

}  // namespace

AttentionDims check_attention_fp8(std::string_view op, const Shape& heads, std::initializer_list<NamedQ> tensors,
                                  const Tensor& lse, std::initializer_list<NamedScale> scales) {
  if (heads.rank != 4) fail("{}: heads {} must be [B, n, L, D]", op, heads.str());
  const AttentionDims d{heads[0], heads[1], heads[2], heads[3]};
  const NamedQ& q = *tensors.begin();
  for (const NamedQ& t : tensors) {
    require_per_tensor_cast(op, fmt::format("FP8 tensor '{}'", t.name), t.q);
    if (t.q.rows != d.B * d.n * d.L || t.q.cols != d.D)
      fail("{}: FP8 tensor '{}' is [{}, {}] but heads {} need [B·n·L, D] = [{}, {}]", op, t.name, t.q.rows, t.q.cols,
           heads.str(), d.B * d.n * d.L, d.D);
    if ((t.name == "k" || t.name == "v") && t.q.format != q.q.format)
      fail("{}: q, k and v must share one FP8 format ('{}' is {}, '{}' {})", op, t.name, fp8_format_name(t.q.format),
           q.name, fp8_format_name(q.q.format));
  }
  require_contiguous(op, {"lse", lse});
  require_vector(op, {"lse", lse}, d.B * d.n * d.L);
  if (lse.dtype != DType::f32) fail("{}: lse {} must be f32", op, lse.str());
  for (const NamedScale& s : scales)
    if (!s.p) fail("{}: scale '{}' is not given (Fp8AttentionScales)", op, s.name);
  return d;
}

Shape check_fp8_heads(std::string_view op, const Tensor& tokens, int64_t token_offset,
                      std::initializer_list<NamedQ> heads) {
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

void check_dequantize(std::string_view op, const Tensor& y, const QTensor& x) {
  require_defined(op, {"y", y});
  if (!x.defined()) fail("{}: FP8 tensor 'x' is not defined", op);
  if (x.scaling != Fp8Scaling::per_tensor || !x.scale_inv)
    fail("{}: x must be a per-tensor cast with its scale_inv (got {} scaling)", op, fp8_scaling_name(x.scaling));
  if (y.dtype != DType::f32 && y.dtype != DType::bf16) fail("{}: y {} must be f32 or bf16", op, y.str());
  if (y.rows() != x.rows || y.cols() != x.cols)
    fail("{}: y {} does not hold x's [{}, {}]", op, y.str(), x.rows, x.cols);
  if (y.ld < y.cols()) fail("{}: y {} has row stride {} smaller than its columns", op, y.str(), y.ld);
}

DelayedUpdateDims check_delayed_scaling_update(std::string_view op, const Tensor& amax_history, const Tensor& scale,
                                               const Tensor& scale_inv, const Tensor& fp8_max) {
  require_rank(op, {"amax_history", amax_history}, 2);
  require_contiguous(op, {"amax_history", amax_history});
  const int64_t L = amax_history.shape[0], n = amax_history.shape[1];
  if (L < 1) fail("{}: amax_history {} has no staging row (history length must be >= 1)", op, amax_history.str());
  require_vector(op, {"scale", scale}, n);
  require_vector(op, {"scale_inv", scale_inv}, n);
  require_vector(op, {"fp8_max", fp8_max}, n);
  for (Named t : {Named{"amax_history", amax_history}, Named{"scale", scale}, Named{"scale_inv", scale_inv},
                  Named{"fp8_max", fp8_max}})
    if (t.t.dtype != DType::f32) fail("{}: tensor '{}' is {} but must be f32", op, t.name, t.t.str());
  return {L, n};
}

}  // namespace flux8::ops
