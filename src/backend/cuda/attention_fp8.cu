// FP8 attention on the GPU (Backend::attention_fp8, fp8_dot_product_attention): cuDNN's FP8
// flash attention, described through the backend API as the same operation pattern
// cudnn-frontend emits for its FP8 SDPA nodes, and the CUDA backend's ops around it.
//
// Forward (Q, K, V FP8 of one format; Kᵀ described transposed like the BF16 graph's):
//   S = Q·Kᵀ·scale·descale_q·descale_k;  M = rowmax S;  E = exp(S − M);  Z = rowsum E;
//   Stats = M + log Z;  P = E / Z;  amax_s = amax(P);  P8 = P·scale_s (FP8, Q's format);
//   O' = P8·V·descale_s·descale_v;  amax_o = amax(O');  O = O'·scale_o (FP8)
// Backward (Vᵀ described transposed too; dS is cudnn-frontend's "dP"):
//   δ = rowsum(dO ⊙ O)·descale_dO·descale_O;  P = exp(Q·Kᵀ·scale·descale_q·descale_k − Stats);
//   dV' = (P·scale_s)ᵀ·dO·descale_s·descale_dO;  dS = (dO·Vᵀ·descale_dO·descale_v − δ)·P·scale;
//   dS8 = dS·scale_ds (FP8, dO's format);  dQ' = dS8·K·descale_ds·descale_k;
//   dK' = dS8ᵀ·Q·descale_ds·descale_q;  dQ = dQ'·scale_dq (FP8), amax_dq = amax(dQ'), alike
// On Hopper cuDNN writes O, dQ, dK, dV only in FP8 and its FP8 backward takes head dim 128 only
// (cudnn-frontend's support checks); the frontend documents no deterministic FP8 backward.
//
// The scales are single floats in device memory that cuDNN reads through [1,1,1,1] tensors
// declared 16-byte aligned; the registry's are packed arrays, so a small kernel copies the
// ones a call reads into 16-byte slots of the staging buffer first, and another one, after the
// graph, writes the outputs' scale_inv and max-accumulates cuDNN's amaxes into their targets
// (cuDNN overwrites its amax outputs; a registry slot may be cast more than once per step).
#include <cuda_bf16.h>
#include <fmt/format.h>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_cudnn.h"
#include "backend/cuda/common.cuh"
#include "fp8/quantize.h"
#include "fp8/recipe.h"

namespace flux8::cuda {

namespace {

enum Fp8Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kAttnScale,
  kDescaleQ,
  kDescaleK,
  kDescaleV,
  kDescaleS,
  kScaleS,
  kScaleO,
  kAmaxS,
  kAmaxO,
  kDO,
  kDescaleO,
  kDescaleDO,
  kDescaleDS,
  kScaleDS,
  kScaleDQ,
  kScaleDK,
  kScaleDV,
  kDQ,
  kDK,
  kDV,
  kAmaxDQ,
  kAmaxDK,
  kAmaxDV,
  kAmaxDS,
};

cudnnDataType_t cudnn_type(Fp8Format f) { return f == Fp8Format::e4m3 ? CUDNN_DATA_FP8_E4M3 : CUDNN_DATA_FP8_E5M2; }

// Strides of the [B, H, S, D] operands in head-major ([B, n, L, D]) or token-major
// ([B, L, n, D]) memory, and of the transposed views [B, H, D, S] of the same memory.
struct Fp8Layout : Layout {
  Dims heads_stride, heads_t_stride;
  Fp8Layout(const AttentionShape& s, bool token_major) : Layout(s) {
    const int64_t H = s.heads, S = s.seq, D = s.head_dim;
    heads_stride = token_major ? Dims{S * H * D, D, H * D, 1} : bhsd_stride;
    heads_t_stride = token_major ? Dims{S * H * D, D, 1, H * D} : bhds_stride;
  }
};

constexpr Dims kScalar{1, 1, 1, 1};

// An FP8 output of a matmul as cudnn-frontend builds each one (O; dV, dQ, dK): a·b in f32, taken
// to its value by both operands' descales, cast into `out` with `scale`, and `amax` the amax of
// that value before the cast. Its three f32 [B, H, S, D] virtual tensors are made before its ops.
void fp8_matmul_output(GraphBuilder& g, const Layout& l, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                       cudnnBackendDescriptor_t descale_a, cudnnBackendDescriptor_t descale_b,
                       cudnnBackendDescriptor_t scale, cudnnBackendDescriptor_t out, cudnnBackendDescriptor_t amax) {
  auto od = [&] { return g.virtual_tensor(CUDNN_DATA_FLOAT, l.bhsd, l.bhsd_stride); };
  auto y1 = od(), y2 = od(), y3 = od();
  g.matmul(a, b, y1);
  g.pointwise(CUDNN_POINTWISE_MUL, y1, descale_a, y2);
  g.pointwise(CUDNN_POINTWISE_MUL, y2, descale_b, y3);
  g.pointwise(CUDNN_POINTWISE_MUL, y3, scale, out);
  g.reduction(CUDNN_REDUCE_TENSOR_AMAX, y3, amax);
}

void build_forward_fp8_graph(GraphBuilder& g, const Attention::Fp8Forward& a) {
  const Fp8Layout l(a.shape, a.token_major);
  const cudnnDataType_t in = cudnn_type(a.qkv), f32 = CUDNN_DATA_FLOAT;
  auto q = g.tensor(kQ, in, l.bhsd, l.heads_stride);
  auto kt = g.tensor(kK, in, l.bhds, l.heads_t_stride);
  auto v = g.tensor(kV, in, l.bhsd, l.heads_stride);
  auto o = g.tensor(kO, cudnn_type(a.o_format), l.bhsd, l.heads_stride);
  auto stats = g.tensor(kStats, f32, l.bhs1, l.bhs1_stride);
  auto attn_scale = g.scalar(kAttnScale);
  auto descale_q = g.tensor(kDescaleQ, f32, kScalar, kScalar), descale_k = g.tensor(kDescaleK, f32, kScalar, kScalar);
  auto descale_v = g.tensor(kDescaleV, f32, kScalar, kScalar), descale_s = g.tensor(kDescaleS, f32, kScalar, kScalar);
  auto scale_s = g.tensor(kScaleS, f32, kScalar, kScalar), scale_o = g.tensor(kScaleO, f32, kScalar, kScalar);
  auto amax_s = g.tensor(kAmaxS, f32, kScalar, kScalar), amax_o = g.tensor(kAmaxO, f32, kScalar, kScalar);

  auto ss = [&] { return g.virtual_tensor(f32, l.bhss, l.bhss_stride); };
  auto rows = [&] { return g.virtual_tensor(f32, l.bhs1, l.bhs1_stride); };
  auto s1 = ss();
  g.matmul(q, kt, s1);
  auto s2 = ss(), s3 = ss(), s4 = ss();
  g.pointwise(CUDNN_POINTWISE_MUL, s1, attn_scale, s2);
  g.pointwise(CUDNN_POINTWISE_MUL, s2, descale_q, s3);
  g.pointwise(CUDNN_POINTWISE_MUL, s3, descale_k, s4);
  auto m = rows();
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s4, m);
  auto shifted = ss(), e = ss();
  g.pointwise(CUDNN_POINTWISE_SUB, s4, m, shifted);
  g.pointwise(CUDNN_POINTWISE_EXP, shifted, nullptr, e);
  auto z = rows(), log_z = rows();
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, z);
  g.pointwise(CUDNN_POINTWISE_LOG, z, nullptr, log_z);
  g.pointwise(CUDNN_POINTWISE_ADD, m, log_z, stats);
  auto p = ss();
  g.pointwise(CUDNN_POINTWISE_DIV, e, z, p);
  g.reduction(CUDNN_REDUCE_TENSOR_AMAX, p, amax_s);
  auto p8 = g.virtual_tensor(in, l.bhss, l.bhss_stride);  // the second matmul's FP8 operand
  g.pointwise(CUDNN_POINTWISE_MUL, p, scale_s, p8);
  fp8_matmul_output(g, l, p8, v, descale_s, descale_v, scale_o, o, amax_o);
}

void build_backward_fp8_graph(GraphBuilder& g, const Attention::Fp8Backward& a) {
  const Fp8Layout l(a.shape, a.token_major);
  const int64_t H = a.shape.heads, S = a.shape.seq, D = a.shape.head_dim;
  const cudnnDataType_t in = cudnn_type(a.qkv), grad = cudnn_type(a.dout_format), f32 = CUDNN_DATA_FLOAT;
  auto q = g.tensor(kQ, in, l.bhsd, l.heads_stride);
  auto kt = g.tensor(kK, in, l.bhds, l.heads_t_stride);
  auto vt = g.tensor(kV, in, l.bhds, l.heads_t_stride);
  auto o = g.tensor(kO, cudnn_type(a.o_format), l.bhsd, l.heads_stride);
  auto d_o = g.tensor(kDO, grad, l.bhsd, l.heads_stride);
  auto stats = g.tensor(kStats, f32, l.bhs1, l.bhs1_stride);
  const cudnnDataType_t out = cudnn_type(a.grads);
  auto dq = g.tensor(kDQ, out, l.bhsd, l.heads_stride);
  auto dk = g.tensor(kDK, out, l.bhsd, l.heads_stride);
  auto dv = g.tensor(kDV, out, l.bhsd, l.heads_stride);
  auto attn_scale = g.scalar(kAttnScale);
  auto scalar = [&](int64_t uid) { return g.tensor(uid, f32, kScalar, kScalar); };
  auto descale_q = scalar(kDescaleQ), descale_k = scalar(kDescaleK), descale_v = scalar(kDescaleV);
  auto descale_o = scalar(kDescaleO), descale_do = scalar(kDescaleDO), descale_s = scalar(kDescaleS);
  auto descale_ds = scalar(kDescaleDS), scale_s = scalar(kScaleS), scale_ds = scalar(kScaleDS);
  auto scale_dq = scalar(kScaleDQ), scale_dk = scalar(kScaleDK), scale_dv = scalar(kScaleDV);
  auto amax_dq = scalar(kAmaxDQ), amax_dk = scalar(kAmaxDK), amax_dv = scalar(kAmaxDV), amax_ds = scalar(kAmaxDS);

  auto ss = [&] { return g.virtual_tensor(f32, l.bhss, l.bhss_stride); };
  auto rows = [&] { return g.virtual_tensor(f32, l.bhs1, l.bhs1_stride); };
  // δ (the product's strides are cudnn-frontend's; a virtual tensor's strides describe no memory)
  auto do_o = g.virtual_tensor(f32, l.bhsd, {H * S * D, S * D, H * D, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, d_o, o, do_o);
  auto r1 = rows(), r2 = rows(), delta = rows();
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, r1);
  g.pointwise(CUDNN_POINTWISE_MUL, r1, descale_do, r2);
  g.pointwise(CUDNN_POINTWISE_MUL, r2, descale_o, delta);
  // P recomputed from Stats
  auto b1 = ss(), b2 = ss(), b3 = ss(), b4 = ss(), b5 = ss(), p = ss();
  g.matmul(q, kt, b1);
  g.pointwise(CUDNN_POINTWISE_MUL, b1, attn_scale, b2);
  g.pointwise(CUDNN_POINTWISE_MUL, b2, descale_q, b3);
  g.pointwise(CUDNN_POINTWISE_MUL, b3, descale_k, b4);
  g.pointwise(CUDNN_POINTWISE_SUB, b4, stats, b5);
  g.pointwise(CUDNN_POINTWISE_EXP, b5, nullptr, p);
  auto p8 = g.virtual_tensor(in, l.bhss, l.bhss_stride);
  g.pointwise(CUDNN_POINTWISE_MUL, p, scale_s, p8);
  auto p8_t = g.virtual_tensor(in, l.bhss, l.bhss_t_stride);
  g.reshape(p8, p8_t);
  // dV
  fp8_matmul_output(g, l, p8_t, d_o, descale_s, descale_do, scale_dv, dv, amax_dv);
  // dS
  auto d1 = ss(), d2 = ss(), d3 = ss(), d4 = ss(), d5 = ss(), ds = ss();
  g.matmul(d_o, vt, d1);
  g.pointwise(CUDNN_POINTWISE_MUL, d1, descale_do, d2);
  g.pointwise(CUDNN_POINTWISE_MUL, d2, descale_v, d3);
  g.pointwise(CUDNN_POINTWISE_SUB, d3, delta, d4);
  g.pointwise(CUDNN_POINTWISE_MUL, d4, p, d5);
  g.pointwise(CUDNN_POINTWISE_MUL, d5, attn_scale, ds);
  g.reduction(CUDNN_REDUCE_TENSOR_AMAX, ds, amax_ds);
  auto ds8 = g.virtual_tensor(grad, l.bhss, l.bhss_stride);
  g.pointwise(CUDNN_POINTWISE_MUL, ds, scale_ds, ds8);
  // dQ (K seen untransposed; cudnn-frontend leaves this reshape's type at its f32 default)
  auto k = g.virtual_tensor(f32, l.bhsd, l.heads_stride);
  g.reshape(kt, k);
  fp8_matmul_output(g, l, ds8, k, descale_ds, descale_k, scale_dq, dq, amax_dq);
  // dK
  auto ds8_t = g.virtual_tensor(grad, l.bhss, l.bhss_t_stride);
  g.reshape(ds8, ds8_t);
  fp8_matmul_output(g, l, ds8_t, q, descale_ds, descale_q, scale_dk, dk, amax_dk);
}

// A plan variant: the element types and the layout, one bit each.
int fp8_variant(Fp8Format a, Fp8Format b, Fp8Format c, Fp8Format d, bool token_major) {
  auto bit = [](Fp8Format f) { return f == Fp8Format::e5m2 ? 1 : 0; };
  return bit(a) | bit(b) << 1 | bit(c) << 2 | bit(d) << 3 | (token_major ? 1 << 4 : 0);
}

// ---- the scalars around the graph ------------------------------------------------------------

constexpr int kMaxScalars = 16;
constexpr int kSlotFloats = 4;  // one scalar per 16 bytes

// Slot i gets *src[i], or value[i] where src[i] is null (P's fixed scale and its inverse).
struct ScalarCopies {
  const float* src[kMaxScalars];
  int count;
  float value[kMaxScalars];
};

__global__ void gather_scalars_kernel(float* slots, ScalarCopies c) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < c.count) slots[i * kSlotFloats] = c.src[i] ? *c.src[i] : c.value[i];
}

// One FP8 call's staging buffer: its scalar slots (gathered from `copies`), the softmax
// statistics where lse is not 16-byte aligned (cuDNN needs them aligned; the caller copies them
// in or out), and cuDNN's workspace; `buffer(bytes)` is the cuDNN state's staging_buffer.
struct Fp8Staging {
  float* slot;
  float* stats;  // lse itself, or its staged copy
  size_t stats_bytes;
  void* workspace;
  bool staged() const { return stats_bytes > 0; }
  void* slot_at(int i) const { return slot + i * kSlotFloats; }
};

template <typename Buffer>
Fp8Staging stage_fp8_call(Buffer&& buffer, cudaStream_t stream, const CudnnPlan& p, const AttentionShape& s,
                          const float* lse, const ScalarCopies& copies) {
  const bool stage_stats = !aligned16(lse);
  const size_t stats_bytes = stage_stats ? static_cast<size_t>(s.rows()) * sizeof(float) : 0;
  Regions r;
  const size_t scalars = r.take(kMaxScalars * kSlotFloats * sizeof(float));
  const size_t stats = stage_stats ? r.take(stats_bytes) : 0;
  const size_t ws = r.take(static_cast<size_t>(p.workspace_bytes));
  void* base = buffer(r.total);
  const Fp8Staging st{at<float>(base, scalars), stage_stats ? at<float>(base, stats) : const_cast<float*>(lse),
                      stats_bytes, at<void>(base, ws)};
  gather_scalars_kernel<<<1, 32, 0, stream>>>(st.slot, copies);
  FLUX8_LAUNCH_CHECK(gather_scalars_kernel);
  return st;
}

// After the graph: out_scale_inv[i] = 1/scale[i]; amax_target[i] = max(target, cuDNN's amax).
struct Fp8Finish {
  float* scale_inv[3];
  const float* scale[3];
  int outputs;
  float* amax_target[4];
  const float* amax[4];
  int amaxes;
};

__global__ void finish_fp8_kernel(Fp8Finish f) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < f.outputs) *f.scale_inv[i] = scale_inverse(*f.scale[i]);
  if (i < f.amaxes && f.amax_target[i]) *f.amax_target[i] = amax_accumulate(*f.amax_target[i], *f.amax[i]);
}

// Why cuDNN's FP8 attention cannot take this call on the H200 ("" when it may): what its
// graphs refuse (head dims other than 128 in the backward) and what they ran but computed wrong
// in this code's tests (test_cuda_attention_fp8.cpp; cuDNN 9.19): at sequence lengths that are
// not a multiple of 64 the last query rows' dQ came out zero or NaN, and with E4M3 gradients
// (dO and dS in E4M3) dQ had NaN rows where dO was zero — rows every Flux step has (the text
// tokens of the last single block). E5M2 gradients at multiples of 64 matched the CPU twin.
std::string static_refusal_fp8(const AttentionShape& s, Fp8Format grads) {
  if (s.head_dim != 128)
    return fmt::format("head dim {}: cuDNN's FP8 attention backward on Hopper takes head dim 128 only", s.head_dim);
  if (s.seq % 64 != 0)
    return fmt::format(
        "sequence length {} is not a multiple of 64: cuDNN's FP8 backward gets the last rows' dQ "
        "wrong there",
        s.seq);
  if (grads != Fp8Format::e5m2)
    return "E4M3 gradients: cuDNN's FP8 backward gives NaN dQ rows where dO is zero; the gradients (dO, dS, dq, dk, "
           "dv) must be E5M2 (fp8: hybrid)";
  return "";
}

}  // namespace

CudnnPlan& Attention::fp8_forward_plan(const Fp8Forward& a) {
  return cudnn_->plan(int(Direction::forward_fp8), fp8_variant(a.qkv, a.o_format, a.qkv, a.qkv, a.token_major), a.shape,
                      [&](GraphBuilder& g) { build_forward_fp8_graph(g, a); });
}

CudnnPlan& Attention::fp8_backward_plan(const Fp8Backward& a) {
  return cudnn_->plan(int(Direction::backward_fp8),
                      fp8_variant(a.qkv, a.o_format, a.dout_format, a.grads, a.token_major), a.shape,
                      [&](GraphBuilder& g) { build_backward_fp8_graph(g, a); });
}

// The backward a training step runs after this forward: E5M2 dO and gradients (what
// attention_fp8_backward takes), the forward's q, k, v, o formats and layout.
Attention::PrefetchWait Attention::prefetch_fp8_backward(const Fp8Forward& f) {
  Fp8Backward b;
  b.shape = f.shape;
  b.qkv = f.qkv;
  b.o_format = f.o_format;
  b.token_major = f.token_major;
  if (!static_refusal_fp8(b.shape, b.dout_format).empty()) return {};
  return {cudnn_->prefetch(int(Direction::backward_fp8),
                           fp8_variant(b.qkv, b.o_format, b.dout_format, b.grads, b.token_major), b.shape,
                           [b](GraphBuilder& g) { build_backward_fp8_graph(g, b); })};
}

std::string Attention::fp8_unsupported_reason(const Fp8Forward& f, const Fp8Backward& b) {
  if (std::string why = static_refusal_fp8(f.shape, b.dout_format); !why.empty()) return why;
  if (const CudnnPlan& p = fp8_forward_plan(f); !p.refused.empty()) return "forward: " + p.refused;
  if (const CudnnPlan& p = fp8_backward_plan(b); !p.refused.empty()) return "backward: " + p.refused;
  return "";
}

namespace {

// The plan of a call, or an error saying why cuDNN does not run it (no fallback: the reference
// kernel has no FP8 twin, and a run that asked for FP8 attention must not silently lose it).
const CudnnPlan& runnable(CudnnPlan& p, const AttentionShape& s, std::string_view op) {
  if (!p.refused.empty())
    fail(
        "{}: cuDNN does not run FP8 attention of [B, n, L, D] = [{}, {}, {}, {}] here: {} (set "
        "fp8_dot_product_attention: false)",
        op, s.batch, s.heads, s.seq, s.head_dim, p.refused);
  return p;
}

void check_static(const AttentionShape& s, Fp8Format grads, std::string_view op) {
  if (std::string why = static_refusal_fp8(s, grads); !why.empty())
    fail("{}: [B, n, L, D] = [{}, {}, {}, {}]: {} (set fp8_dot_product_attention: false)", op, s.batch, s.heads, s.seq,
         s.head_dim, why);
}

}  // namespace

void Attention::forward_fp8(const Fp8Forward& a) {
  constexpr std::string_view op = "attention_fp8";
  const AttentionShape& s = a.shape;
  if (s.numel() == 0) return;
  check_static(s, Fp8Format::e5m2, op);                         // the forward alone has no gradients
  const PrefetchWait backward_plan = prefetch_fp8_backward(a);  // compiles while the forward's does
  const CudnnPlan& p = runnable(fp8_forward_plan(a), s, op);
  // Slots 0-5: the scales read; 6, 7: cuDNN's amaxes.
  ScalarCopies copies{{a.descale_q, a.descale_k, a.descale_v, nullptr, nullptr, a.scale_o}, 6, {}};
  const float p_scale = Backend::Fp8AttentionScales::p_scale(a.qkv);
  copies.value[3] = scale_inverse(p_scale), copies.value[4] = p_scale;
  const auto staging = [this](size_t bytes) { return cudnn_->staging_buffer(bytes); };
  const Fp8Staging st = stage_fp8_call(staging, stream_, p, s, a.lse, copies);
  float attn_scale = static_cast<float>(a.scale);
  auto in = [](const uint8_t* p) { return static_cast<void*>(const_cast<uint8_t*>(p)); };
  cudnn_->execute(p,
                  {kQ, kK, kV, kO, kStats, kAttnScale, kDescaleQ, kDescaleK, kDescaleV, kDescaleS, kScaleS, kScaleO,
                   kAmaxS, kAmaxO},
                  {in(a.q), in(a.k), in(a.v), a.o, st.stats, &attn_scale, st.slot_at(0), st.slot_at(1), st.slot_at(2),
                   st.slot_at(3), st.slot_at(4), st.slot_at(5), st.slot_at(6), st.slot_at(7)},
                  st.workspace);
  if (st.staged())
    FLUX8_CUDA_CHECK(cudaMemcpyAsync(a.lse, st.stats, st.stats_bytes, cudaMemcpyDeviceToDevice, stream_));
  Fp8Finish f{};
  f.scale_inv[0] = a.o_scale_inv;
  f.scale[0] = a.scale_o;
  f.outputs = a.o_scale_inv ? 1 : 0;
  f.amax_target[0] = a.amax_s, f.amax[0] = st.slot + 6 * kSlotFloats;
  f.amax_target[1] = a.amax_o, f.amax[1] = st.slot + 7 * kSlotFloats;
  f.amaxes = 2;
  finish_fp8_kernel<<<1, 32, 0, stream_>>>(f);
  FLUX8_LAUNCH_CHECK(finish_fp8_kernel);
  count_cudnn_call();
}

void Attention::backward_fp8(const Fp8Backward& a) {
  constexpr std::string_view op = "attention_fp8_backward";
  const AttentionShape& s = a.shape;
  if (s.numel() == 0) return;
  check_static(s, a.dout_format, op);
  if (a.grads != a.dout_format) fail("{}: dq, dk, dv must be in dout's format (E5M2)", op);
  const CudnnPlan& p = runnable(fp8_backward_plan(a), s, op);
  // Slots 0-11: the scales read; 12-15: cuDNN's amaxes of dQ, dK, dV, dS.
  ScalarCopies copies{{a.descale_q, a.descale_k, a.descale_v, a.descale_o, a.descale_dout, nullptr, a.descale_ds,
                       nullptr, a.scale_ds, a.scale_dq, a.scale_dk, a.scale_dv},
                      12,
                      {}};
  const float p_scale = Backend::Fp8AttentionScales::p_scale(a.qkv);
  copies.value[5] = scale_inverse(p_scale), copies.value[7] = p_scale;
  const auto staging = [this](size_t bytes) { return cudnn_->staging_buffer(bytes); };
  const Fp8Staging st = stage_fp8_call(staging, stream_, p, s, a.lse, copies);
  if (st.staged())
    FLUX8_CUDA_CHECK(cudaMemcpyAsync(st.stats, a.lse, st.stats_bytes, cudaMemcpyDeviceToDevice, stream_));
  float attn_scale = static_cast<float>(a.scale);
  auto in = [](const uint8_t* p) { return static_cast<void*>(const_cast<uint8_t*>(p)); };
  cudnn_->execute(
      p, {kQ,         kK,        kV,        kO,        kDO,       kStats,     kDQ,       kDK,        kDV,
          kAttnScale, kDescaleQ, kDescaleK, kDescaleV, kDescaleO, kDescaleDO, kDescaleS, kDescaleDS, kScaleS,
          kScaleDS,   kScaleDQ,  kScaleDK,  kScaleDV,  kAmaxDQ,   kAmaxDK,    kAmaxDV,   kAmaxDS},
      {in(a.q),        in(a.k),        in(a.v),        in(a.o),        in(a.dout),    st.stats,      a.dq,
       a.dk,           a.dv,           &attn_scale,    st.slot_at(0),  st.slot_at(1), st.slot_at(2), st.slot_at(3),
       st.slot_at(4),  st.slot_at(5),  st.slot_at(6),  st.slot_at(7),  st.slot_at(8), st.slot_at(9), st.slot_at(10),
       st.slot_at(11), st.slot_at(12), st.slot_at(13), st.slot_at(14), st.slot_at(15)},
      st.workspace);
  Fp8Finish f{};
  f.scale_inv[0] = a.dq_scale_inv, f.scale[0] = a.scale_dq;
  f.scale_inv[1] = a.dk_scale_inv, f.scale[1] = a.scale_dk;
  f.scale_inv[2] = a.dv_scale_inv, f.scale[2] = a.scale_dv;
  f.outputs = 3;
  float* targets[4] = {a.amax_dq, a.amax_dk, a.amax_dv, a.amax_ds};
  for (int i = 0; i < 4; ++i) f.amax_target[i] = targets[i], f.amax[i] = st.slot + (12 + i) * kSlotFloats;
  f.amaxes = 4;
  finish_fp8_kernel<<<1, 32, 0, stream_>>>(f);
  FLUX8_LAUNCH_CHECK(finish_fp8_kernel);
  count_cudnn_call();
}

}  // namespace flux8::cuda

// ---- the backend's ops ---------------------------------------------------------------------

namespace flux8 {
using namespace cuda;

namespace {

// y = x's codes · scale_inv. Contiguous y with 16-byte aligned rows of whole 16-code groups
// (the heads' case): 16 codes per thread, one 16-byte load and two store8s; else one element
// per thread.
template <typename T>
__global__ void dequantize_kernel(MatOf<T> y, const uint8_t* codes, const float* scale_inv, Fp8Format f,
                                  bool vector16) {
  const float s = *scale_inv;
  const int64_t n = y.rows * y.cols, stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (vector16) {
    for (int64_t g = first; g < n / 16; g += stride) {
      const uint4 packed = reinterpret_cast<const uint4*>(codes)[g];
      const uint8_t* c = reinterpret_cast<const uint8_t*>(&packed);
      float lo[8], hi[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) lo[i] = dequantize_value(c[i], s, f), hi[i] = dequantize_value(c[8 + i], s, f);
      store8(y.p + g * 16, lo);
      store8(y.p + g * 16 + 8, hi);
    }
    return;
  }
  for (int64_t i = first; i < n; i += stride) {
    const int64_t r = i / y.cols;
    y.set(r, i - r * y.cols, dequantize_value(codes[i], s, f));
  }
}

template <typename T>
void launch_dequantize(const Tensor& y, const QTensor& x, cudaStream_t stream) {
  const MatOf<T> m = mat_of<T>(y);
  const bool vector16 = y.ld == y.cols() && x.numel() % 16 == 0 && aligned16(x.codes) &&
                        reinterpret_cast<uintptr_t>(y.data) % (16 * sizeof(T)) == 0;
  const unsigned blocks = blocks_for(vector16 ? x.numel() / 16 : x.numel());
  dequantize_kernel<<<blocks, kThreads, 0, stream>>>(m, x.codes, x.scale_inv, x.format, vector16);
  FLUX8_LAUNCH_CHECK(dequantize_kernel);
}

// FP8 operands go to cuDNN in place: 16-byte aligned, like its tensors.
void require_aligned(std::string_view op, std::initializer_list<ops::NamedQ> tensors) {
  for (const ops::NamedQ& t : tensors)
    if (!aligned16(t.q.codes)) fail("{}: FP8 tensor '{}' is not 16-byte aligned (cuDNN reads it in place)", op, t.name);
}

AttentionShape shape_of(const ops::AttentionDims& d) { return AttentionShape{d.B, d.n, d.L, d.D}; }

}  // namespace

void CudaBackend::execute(const op::Dequantize& args) {
  ops::check("dequantize", args);
  if (args.x.numel() == 0) return;
  if (args.y.dtype == DType::bf16)
    launch_dequantize<__nv_bfloat16>(args.y, args.x, stream_);
  else
    launch_dequantize<float>(args.y, args.x, stream_);
}

void CudaBackend::execute(const op::AttentionFp8& args) {
  constexpr std::string_view op = "attention_fp8";
  const auto d = ops::check(op, args);
  require_aligned(op, {{"q", args.q}, {"k", args.k}, {"v", args.v}, {"o", args.o}});
  FLUX8_CHECK(attention_ != nullptr, "CudaBackend has no Attention (make_attention not called)");
  Attention::Fp8Forward a;
  a.shape = shape_of(d);
  a.qkv = args.q.format, a.o_format = args.o.format, a.scale = args.scale;
  a.q = args.q.codes, a.k = args.k.codes, a.v = args.v.codes, a.o = args.o.codes, a.lse = args.lse.ptr<float>();
  a.descale_q = args.q.scale_inv, a.descale_k = args.k.scale_inv, a.descale_v = args.v.scale_inv;
  a.scale_o = args.sc.o;
  a.o_scale_inv = args.o.scale_inv, a.amax_s = args.sc.amax_s, a.amax_o = args.sc.amax_o;
  attention_->forward_fp8(a);
}

void CudaBackend::execute(const op::AttentionFp8Backward& args) {
  constexpr std::string_view op = "attention_fp8_backward";
  const auto d = ops::check(op, args);
  require_aligned(op, {{"q", args.q},
                       {"k", args.k},
                       {"v", args.v},
                       {"o", args.o},
                       {"dout", args.dout},
                       {"dq", args.dq},
                       {"dk", args.dk},
                       {"dv", args.dv}});
  if (args.dq.format != args.dk.format || args.dq.format != args.dv.format)
    fail("{}: dq, dk and dv must share one FP8 format (cuDNN writes them alike)", op);
  FLUX8_CHECK(attention_ != nullptr, "CudaBackend has no Attention (make_attention not called)");
  Attention::Fp8Backward a;
  a.shape = shape_of(d);
  a.qkv = args.q.format, a.o_format = args.o.format, a.dout_format = args.dout.format, a.grads = args.dq.format,
  a.scale = args.scale;
  a.q = args.q.codes, a.k = args.k.codes, a.v = args.v.codes, a.o = args.o.codes, a.dout = args.dout.codes,
  a.lse = args.lse.ptr<float>();
  a.dq = args.dq.codes, a.dk = args.dk.codes, a.dv = args.dv.codes;
  a.descale_q = args.q.scale_inv, a.descale_k = args.k.scale_inv, a.descale_v = args.v.scale_inv,
  a.descale_o = args.o.scale_inv, a.descale_dout = args.dout.scale_inv;
  a.scale_ds = args.sc.ds, a.descale_ds = args.sc.ds_inv;
  a.scale_dq = args.sc.dq, a.scale_dk = args.sc.dk, a.scale_dv = args.sc.dv;
  a.dq_scale_inv = args.dq.scale_inv, a.dk_scale_inv = args.dk.scale_inv, a.dv_scale_inv = args.dv.scale_inv;
  a.amax_ds = args.sc.amax_ds, a.amax_dq = args.sc.amax_dq, a.amax_dk = args.sc.amax_dk, a.amax_dv = args.sc.amax_dv;
  attention_->backward_fp8(a);
}

}  // namespace flux8
