#pragma once
// Argument checks shared by every backend: each failure names the op, the tensor (by its name
// in the op's signature) and what was expected, so a shape bug in model code is found at once.
#include <initializer_list>
#include <span>
#include <string_view>
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

// Checks that all defined tensors share one dtype, that it is one of `allowed` (a backend's
// compute types; `backend` names it in the message) and that ld >= cols; returns the dtype.
DType call_dtype(std::string_view op, std::initializer_list<Named> tensors, std::initializer_list<DType> allowed,
                 std::string_view backend);

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

// tokens [B, Ls, n·D] against heads [B, n, L, D] with Ls + offset <= L (tokens_to_heads).
void check_heads_tokens(std::string_view op, const Tensor& heads, const Tensor& tokens, int64_t offset);
// The whole argument check of qk_norm_rope_to_heads / its backward: one stream's token slices
// [B, Ls, n·D] (any ld) at token_offset in joint head-major tensors [B, n, L, D] with D even
// (RoPE turns adjacent pairs), statistics vectors of B·Ls·n, scales contiguous [D], pe
// contiguous [B, L, D/2, 2]. Returns {B, n, L, D, Ls}.
struct QkNormRopeDims {
  int64_t B, n, L, D, Ls;
};
QkNormRopeDims check_qk_norm_rope_to_heads(std::string_view op, const Tensor& q_heads, const Tensor& k_heads,
                                           const Tensor& v_heads, const Tensor& q_rstd, const Tensor& k_rstd,
                                           const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_scale,
                                           const Tensor& k_scale, const Tensor& pe, int64_t offset);
QkNormRopeDims check_qk_norm_rope_to_heads_backward(std::string_view op, const Tensor& dq, const Tensor& dk,
                                                    const Tensor& dv, const Tensor& dq_scale, const Tensor& dk_scale,
                                                    const Tensor& dq_heads, const Tensor& dk_heads,
                                                    const Tensor& dv_heads, const Tensor& q, const Tensor& k,
                                                    const Tensor& q_rstd, const Tensor& k_rstd, const Tensor& q_scale,
                                                    const Tensor& k_scale, const Tensor& pe, int64_t offset);
// Parts a [B, La, C], b [B, Lb, C] of a joint sequence [B, L, C]: with both present they must
// tile it exactly; a lone part must fit (concat_tokens / split_tokens).
void check_joint(std::string_view op, Named joint, const Tensor& a, const Tensor& b);
// linear(): x [N, K] (any ld), w [M, K], y [N, M], b undefined or a contiguous [M].
struct LinearDims {
  int64_t N, K, M;
};
LinearDims check_linear(std::string_view op, const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& b);
// linear_gelu / linear_dgrad_gelu: the Linear's dims and the width of the GELU part (the last
// `gelu` columns of the output, or of the input).
struct LinearGeluDims {
  int64_t N, K, M, gelu;
};
// h [N, M] as linear's y for x, w, b; y [N, My] with 0 < My ≤ M.
LinearGeluDims check_linear_gelu(std::string_view op, const Tensor& y, const Tensor& h, const Tensor& x,
                                 const Tensor& w, const Tensor& b);
// dy [N, M], w [M, K], h and dh [N, Kh] with 0 < Kh ≤ K, dx [N, K − Kh] (undefined iff Kh = K).
LinearGeluDims check_linear_dgrad_gelu(std::string_view op, const Tensor& dx, const Tensor& dh, const Tensor& dy,
                                       const Tensor& w, const Tensor& h);

// Modulated LayerNorm over x [B, L, H]: y like x, mean/rstd vectors of B·L, shift/scale [B, H].
struct NormDims {
  int64_t B, L, H;
};
NormDims check_layernorm_modulate(std::string_view op, const Tensor& y, const Tensor& mean, const Tensor& rstd,
                                  const Tensor& x, const Tensor& shift, const Tensor& scale);
// gated_residual_stats: x [B, L, H], out and y like x (out not x itself), gate [B, H], mean and
// rstd [B, L] of one floating type, any ld, two tensors. Returns B.
int64_t check_gated_residual_stats(std::string_view op, const Tensor& out, const Tensor& mean, const Tensor& rstd,
                                   const Tensor& x, const Tensor& y, const Tensor& gate);
// The backward's common part: dy like x [B, L, H], mean/rstd vectors of B·L.
NormDims check_layernorm_modulate_backward(std::string_view op, const Tensor& dy, const Tensor& x,
                                           const Tensor& mean, const Tensor& rstd);
// adamw's whole argument check: param, grad, m, v contiguous vectors of one length, m and v
// in the parameters' type or both bf16 with f32 parameters (the types of param and grad are
// each backend's to check), a 1-based step, each copy a contiguous bf16 tensor and each cast
// a per-tensor QTensor (with its scale and amax) inside the parameters, no two of them over
// the same parameters.
// The low-rank gradients as check_low_rank_grads checks them; returns them by offset.
std::vector<Backend::LowRankGrad> check_adamw(std::string_view op, const Tensor& param, const Tensor& grad,
                                              const Tensor& m, const Tensor& v, const Backend::AdamW& h,
                                              std::span<const Backend::ParamCopy> copies,
                                              std::span<const Backend::ParamCast> casts,
                                              std::span<const Backend::LowRankGrad> low_rank);
// Backend::LowRankGrad ranges of a flat gradient of n elements: a [R, M], b [R, K] contiguous
// f32 with R ≥ 1, [offset, offset + M·K) inside [0, n), no two overlapping. Returns them sorted
// by offset (what the backends walk).
std::vector<Backend::LowRankGrad> check_low_rank_grads(std::string_view op, int64_t n,
                                                       std::span<const Backend::LowRankGrad> low_rank);
// transpose_codes: per-tensor codes, dst [cols, rows] of src [rows, cols], one format.
void check_transpose_codes(std::string_view op, const QTensor& dst, const QTensor& src);
// Quantize::column_sums: a contiguous f32 vector of `cols` elements (when defined); or bf16 where
// the backend stores parameter gradients so (`bf16_ok`: Backend::gradient_dtype).
void check_column_sums(std::string_view op, const Tensor& sums, int64_t cols, bool bf16_ok = false);
// QK-norm: rows of x are n·D with D = scale.numel() (contiguous scale); returns D.
int64_t rmsnorm_head_dim(std::string_view op, const Tensor& x, const Tensor& scale);

// Attention: the first tensor (q) is rank 4 [B, n, L, D]; every other defined one has its shape.
void check_attention_heads(std::string_view op, std::initializer_list<Named> heads);
// The whole argument check of attention / attention_backward: q, k, v, o (and dout; dq, dk,
// dv when defined) [B, n, L, D] alike, lse a vector of B·n·L. Returns {B, n, L, D}.
struct AttentionDims {
  int64_t B, n, L, D;
};
AttentionDims check_attention(std::string_view op, const Tensor& o, const Tensor& lse, const Tensor& q,
                              const Tensor& k, const Tensor& v);
AttentionDims check_attention_backward(std::string_view op, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                       const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& o, const Tensor& lse);

// FP8 attention (attention_fp8, attention_fp8_backward): `heads` rank 4 [B, n, L, D]; every
// QTensor named defined, per-tensor, B·n·L x D; q, k, v in one format; lse a contiguous f32
// vector of B·n·L; the scales each call reads (`scales`) given. Returns {B, n, L, D}.
struct NamedQ {
  std::string_view name;
  const QTensor& q;
};
struct NamedScale {
  std::string_view name;
  const float* p;
};
AttentionDims check_attention_fp8(std::string_view op, const Shape& heads, std::initializer_list<NamedQ> tensors,
                                  const Tensor& lse, std::initializer_list<NamedScale> scales);
// The FP8-heads ops (qk_norm_rope_to_heads_fp8, tokens_to_heads_fp8, ...): every QTensor named
// defined, per-tensor with its scale_inv, all of one shape [B·n·L, D]; `tokens` [B, Ls, n·D] (any
// ld) one stream with Ls + offset <= L. Returns the heads' shape {B, n, L, D}.
Shape check_fp8_heads(std::string_view op, const Tensor& tokens, int64_t token_offset,
                      std::initializer_list<NamedQ> heads);
// dequantize(): per-tensor x, y f32 or bf16 of x.rows rows and x.cols columns (any ld).
void check_dequantize(std::string_view op, const Tensor& y, const QTensor& x);

// quantize(): x (any ld) of one of `x_types` (the backend's: f32 on the CPU; the CUDA backend
// also casts bf16 activations), rowwise [rows, cols] and columnwise [cols, rows] when defined.
// Returns false when there is nothing to cast (both outputs undefined).
bool check_quantize(std::string_view op, const QTensor& rowwise, const QTensor& columnwise, const Tensor& x,
                    std::initializer_list<DType> x_types = {DType::f32});

// delayed_scaling_update(): contiguous f32 amax_history [L, n] (rank 2, L >= 1) and scale,
// scale_inv, fp8_max vectors of n. Returns {L, n}.
struct DelayedUpdateDims {
  int64_t L, n;
};
DelayedUpdateDims check_delayed_scaling_update(std::string_view op, const Tensor& amax_history, const Tensor& scale,
                                               const Tensor& scale_inv, const Tensor& fp8_max);

}  // namespace flux8::ops
