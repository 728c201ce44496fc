// The CUDA backend's attention ops: argument checks, the choice between cuDNN and the
// reference kernel, and cuDNN's fused flash attention through the backend (graph) API.
//
// cuDNN recognises flash attention as a pattern of matmul / pointwise / reduction operations
// over [B, H, S, D] tensors (the same pattern NVIDIA's cudnn-frontend emits for its SDPA
// nodes). Graph inputs and outputs have unique ids (Uid below); the score matrices are
// "virtual" tensors that never reach memory. Intermediates are f32, Q/K/V/O/dO and the
// matrices fed to the second matmuls are bf16.
//
// Forward, S = Q·Kᵀ (K is described transposed: dims [B, H, D, S], strides swapped):
//   Z = S·scale;  M = rowmax Z;  E = exp(Z − M);  Σ = rowsum E;
//   Stats = M + log Σ  (= log Σ_j exp(scale·q·k_j): our lse, f32 [B, H, S, 1]);
//   P = E / Σ (bf16);  O = P·V
// Backward (Stats from the forward; Vᵀ described transposed like Kᵀ):
//   δ = rowsum(dO ⊙ O)·1 (f32 [B, H, S, 1], cuDNN writes it to a buffer we provide);
//   P = exp(Q·Kᵀ·scale − Stats);  dV = Pᵀ·dO;  dS = P ⊙ (dO·Vᵀ − δ)·scale;  dK = dSᵀ·Q;
//   dQ_accum = dS·K (f32);  dQ = identity(dQ_accum) (bf16)
//   or, deterministic: dQ = dS·K directly (cuDNN then keeps dP in its workspace instead of
//   accumulating dQ with atomics; cudnn-frontend's is_deterministic_algorithm does the same).
// The transposes are "reshape" operations that only restride. dQ_accum is cuDNN's scratch,
// not a finished f32 dQ (cudnn-frontend declares it in a reordered F16x16 layout; read as row
// major it differed from dQ by O(1) on the H200), so dq is taken from the bf16 dQ like dk and
// dv; the atomics add into it, so it is zeroed before every call.
//
// A plan is built once per shape, with runtime compilation (rates and build times:
// docs/PERFORMANCE.md).
#include <cuda_bf16.h>
#include <fmt/format.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "backend/attention_workspace.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/attention_cudnn.h"
#include "backend/cuda/common.cuh"

namespace flux8::cuda {

// ---- path selection and counters -------------------------------------------------------

namespace {

std::atomic<int> g_path{-1};  // -1: not chosen yet (read FLUX8_ATTENTION at first use)
std::atomic<int64_t> g_plans_built{0}, g_cudnn_calls{0}, g_reference_calls{0}, g_plans_prefetched{0};

AttentionPath path_from_environment() {
  const char* e = std::getenv("FLUX8_ATTENTION");
  const std::string_view v = e ? e : "";
  if (v.empty() || v == "auto" || v == "automatic") return AttentionPath::automatic;
  if (v == "cudnn") return AttentionPath::cudnn;
  if (v == "reference") return AttentionPath::reference;
  fail("FLUX8_ATTENTION={}: expected cudnn, reference or auto", v);
}

}  // namespace

void set_attention_path(AttentionPath path) { g_path = static_cast<int>(path); }

AttentionPath attention_path() {
  int p = g_path.load();
  if (p < 0) {
    int expected = -1;
    g_path.compare_exchange_strong(expected, static_cast<int>(path_from_environment()));
    p = g_path.load();
  }
  return static_cast<AttentionPath>(p);
}

void count_plan_built() { ++g_plans_built; }
void count_plan_prefetched() { ++g_plans_prefetched; }
void count_cudnn_call() { ++g_cudnn_calls; }

AttentionCounters attention_counters() {
  return AttentionCounters{g_plans_built.load(), g_cudnn_calls.load(), g_reference_calls.load(),
                           g_plans_prefetched.load()};
}

namespace {

// ---- cuDNN graph construction ---------------------------------------------------------------

// Graph tensor ids of the BF16 graphs (below kFirstVirtual).
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kDO,
  kDQ,
  kDK,
  kDV,
  kOne,
  kSoftmaxSum,
  kDQAccum,
};

// y = mode(x, b) (b null for a unary mode) into a new f32 virtual tensor of the scores' shape
// [B, H, S, S]; returns y.
cudnnBackendDescriptor_t scores_pointwise(GraphBuilder& g, const Layout& l, cudnnPointwiseMode_t mode,
                                          cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b) {
  cudnnBackendDescriptor_t y = g.virtual_tensor(CUDNN_DATA_FLOAT, l.bhss, l.bhss_stride);
  g.pointwise(mode, x, b, y);
  return y;
}

void build_forward_graph(GraphBuilder& g, const AttentionShape& s) {
  const Layout l(s);
  const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
  auto q = g.tensor(kQ, bf16, l.bhsd, l.bhsd_stride);
  auto kt = g.tensor(kK, bf16, l.bhds, l.bhds_stride);
  auto v = g.tensor(kV, bf16, l.bhsd, l.bhsd_stride);
  auto o = g.tensor(kO, bf16, l.bhsd, l.bhsd_stride);
  auto stats = g.tensor(kStats, f32, l.bhs1, l.bhs1_stride);
  auto scale = g.scalar(kScale);

  auto scores = g.virtual_tensor(f32, l.bhss, l.bhss_stride);
  g.matmul(q, kt, scores);
  auto z = scores_pointwise(g, l, CUDNN_POINTWISE_MUL, scores, scale);
  auto row_max = g.virtual_tensor(f32, l.bhs1, l.bhs1_stride);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, z, row_max);
  auto shifted = scores_pointwise(g, l, CUDNN_POINTWISE_SUB, z, row_max);
  auto e = scores_pointwise(g, l, CUDNN_POINTWISE_EXP, shifted, nullptr);
  auto row_sum = g.virtual_tensor(f32, l.bhs1, l.bhs1_stride);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, row_sum);
  auto log_sum = g.virtual_tensor(f32, l.bhs1, l.bhs1_stride);
  g.pointwise(CUDNN_POINTWISE_LOG, row_sum, nullptr, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, row_max, log_sum, stats);
  auto p = g.virtual_tensor(bf16, l.bhss, l.bhss_stride);  // bf16: the second matmul's A operand
  g.pointwise(CUDNN_POINTWISE_DIV, e, row_sum, p);
  g.matmul(p, v, o);
}

void build_backward_graph(GraphBuilder& g, const AttentionShape& s, bool deterministic) {
  const Layout l(s);
  const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
  const int64_t H = s.heads, S = s.seq, D = s.head_dim;
  auto q = g.tensor(kQ, bf16, l.bhsd, l.bhsd_stride);
  auto kt = g.tensor(kK, bf16, l.bhds, l.bhds_stride);
  auto vt = g.tensor(kV, bf16, l.bhds, l.bhds_stride);
  auto o = g.tensor(kO, bf16, l.bhsd, l.bhsd_stride);
  auto d_o = g.tensor(kDO, bf16, l.bhsd, l.bhsd_stride);
  auto stats = g.tensor(kStats, f32, l.bhs1, l.bhs1_stride);
  auto dq = g.tensor(kDQ, bf16, l.bhsd, l.bhsd_stride);
  auto dk = g.tensor(kDK, bf16, l.bhsd, l.bhsd_stride);
  auto dv = g.tensor(kDV, bf16, l.bhsd, l.bhsd_stride);
  auto scale = g.scalar(kScale);
  auto one = g.scalar(kOne);
  auto softmax_sum = g.tensor(kSoftmaxSum, f32, l.bhs1, l.bhs1_stride);

  // δ = rowsum(dO ⊙ O). (The product's strides are cudnn-frontend's; a virtual tensor's
  // strides do not describe memory.)
  auto do_o = g.virtual_tensor(f32, l.bhsd, {H * S * D, S * D, H * D, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, d_o, o, do_o);
  auto delta = g.virtual_tensor(f32, l.bhs1, l.bhs1_stride);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, delta);
  g.pointwise(CUDNN_POINTWISE_MUL, delta, one, softmax_sum);

  // P = exp(Q·Kᵀ·scale − Stats); dV = Pᵀ·dO
  auto scores = g.virtual_tensor(f32, l.bhss, l.bhss_stride);
  g.matmul(q, kt, scores);
  auto z = scores_pointwise(g, l, CUDNN_POINTWISE_MUL, scores, scale);
  auto shifted = scores_pointwise(g, l, CUDNN_POINTWISE_SUB, z, stats);
  auto p = scores_pointwise(g, l, CUDNN_POINTWISE_EXP, shifted, nullptr);
  auto p_t = g.virtual_tensor(bf16, l.bhss, l.bhss_t_stride);
  g.reshape(p, p_t);
  g.matmul(p_t, d_o, dv);

  // dS = P ⊙ (dO·Vᵀ − δ)·scale; dK = dSᵀ·Q
  auto dp = g.virtual_tensor(f32, l.bhss, l.bhss_stride);
  g.matmul(d_o, vt, dp);
  auto dp_centered = scores_pointwise(g, l, CUDNN_POINTWISE_SUB, dp, softmax_sum);
  auto dp_p = scores_pointwise(g, l, CUDNN_POINTWISE_MUL, dp_centered, p);
  auto ds = scores_pointwise(g, l, CUDNN_POINTWISE_MUL, dp_p, scale);
  auto ds_t = g.virtual_tensor(bf16, l.bhss, l.bhss_t_stride);
  g.reshape(ds, ds_t);
  g.matmul(ds_t, q, dk);

  // dQ = dS·K, accumulated in f32
  auto k = g.virtual_tensor(bf16, l.bhsd, l.bhsd_stride);
  g.reshape(kt, k);
  if (deterministic) {
    g.matmul(ds, k, dq);
  } else {
    auto dq_accum = g.tensor(kDQAccum, f32, l.bhsd, l.bhsd_stride);
    g.matmul(ds, k, dq_accum);
    g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, dq);
  }
}

// Why cuDNN's flash attention cannot take this shape at all ("" when it may).
std::string static_refusal(const AttentionShape& s) {
  if (s.head_dim % 8 != 0 || s.head_dim > 256)
    return fmt::format("head dim {} is not a multiple of 8 up to 256", s.head_dim);
  if (s.seq < 2) return "sequence length 1";
  return "";
}

}  // namespace

// ---- Attention -------------------------------------------------------------------------

Attention::Attention(cudaStream_t stream, bool deterministic, uint64_t dp_limit_bytes, BufferHooks hooks)
    : stream_(stream),
      deterministic_(deterministic),
      dp_limit_bytes_(dp_limit_bytes),
      hooks_(std::move(hooks)),
      cudnn_(std::make_unique<Cudnn>(stream, hooks_)) {}

Attention::~Attention() {
  cudnn_.reset();
  if (delta_) cudaFree(delta_);
}

std::unique_ptr<Attention> make_attention(cudaStream_t stream, bool deterministic, uint64_t dp_limit_bytes,
                                          BufferHooks hooks) {
  return std::make_unique<Attention>(stream, deterministic, dp_limit_bytes, std::move(hooks));
}

AttentionShape Attention::backward_call_shape(const AttentionShape& s) const {
  if (!deterministic_ || dp_limit_bytes_ == 0) return s;
  const AttentionBackwardSplit split = split_attention_backward(s.batch, s.heads, s.seq, dp_limit_bytes_);
  if (split.calls <= 1) return s;
  return AttentionShape{1, split.pairs_per_call, s.seq, s.head_dim};
}

CudnnPlan& Attention::bf16_plan(const AttentionShape& s, Direction d) {
  return cudnn_->plan(int(d), 0, s, [&](GraphBuilder& g) {
    if (d == Direction::forward)
      build_forward_graph(g, s);
    else
      build_backward_graph(g, s, d == Direction::backward_deterministic);
  });
}

Attention::PrefetchWait Attention::prefetch_backward(const AttentionShape& shape) {
  const AttentionShape s = backward_call_shape(shape);
  if (attention_path() == AttentionPath::reference || !static_refusal(s).empty()) return {};
  const bool deterministic = deterministic_;
  const Direction d = deterministic ? Direction::backward_deterministic : Direction::backward;
  return {cudnn_->prefetch(int(d), 0, s,
                           [s, deterministic](GraphBuilder& g) { build_backward_graph(g, s, deterministic); })};
}

std::string Attention::cudnn_unsupported_reason(const AttentionShape& s) {
  if (std::string why = static_refusal(s); !why.empty()) return why;
  const Direction backward = deterministic_ ? Direction::backward_deterministic : Direction::backward;
  for (Direction d : {Direction::forward, backward})
    if (const CudnnPlan& p = bf16_plan(d == Direction::forward ? s : backward_call_shape(s), d); !p.refused.empty())
      return fmt::format("{}: {}", d == Direction::forward ? "forward" : "backward", p.refused);
  return "";
}

bool Attention::use_cudnn(const AttentionShape& s, Direction d) {
  const AttentionPath path = attention_path();
  if (path == AttentionPath::reference) return false;
  std::string why = static_refusal(s);
  CudnnPlan* plan = nullptr;
  if (why.empty()) {
    plan = &bf16_plan(s, d);
    why = plan->refused;
  }
  if (why.empty()) return true;
  const char* op = d == Direction::forward ? "attention" : "attention_backward";
  if (path == AttentionPath::cudnn)
    fail(
        "{}: cuDNN does not run [B, n, L, D] = [{}, {}, {}, {}]: {} (FLUX8_ATTENTION=auto or reference uses the "
        "reference kernel)",
        op, s.batch, s.heads, s.seq, s.head_dim, why);
  if (plan && !plan->logged) {  // shape-independent refusals (odd head dims) are expected, not logged
    plan->logged = true;
    fmt::print(stderr,
               "flux8: {}: cuDNN does not run [B, n, L, D] = [{}, {}, {}, {}] ({}); using the f32 "
               "reference kernel\n",
               op, s.batch, s.heads, s.seq, s.head_dim, why);
  }
  return false;
}

void* Attention::delta_scratch(size_t bytes) {
  if (bytes > delta_bytes_) {
    if (delta_) {
      FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));
      hooks_.on_released(delta_);
      FLUX8_CUDA_CHECK(cudaFree(delta_));
      delta_ = nullptr;
    }
    FLUX8_CUDA_CHECK(cudaMalloc(&delta_, bytes));
    hooks_.on_allocated(delta_, bytes);
    delta_bytes_ = bytes;
    ++delta_moves_;
  }
  return delta_;
}

uint64_t Attention::reallocations() const { return delta_moves_ + (cudnn_ ? cudnn_->staging_moves : 0); }

bool Attention::cudnn_takes_head_dim(int64_t head_dim) {
  return attention_path() != AttentionPath::reference && static_refusal(AttentionShape{1, 1, 2, head_dim}).empty() &&
         cudnn_->ensure_handle();
}

namespace {
// The heads of a call as cuDNN takes them: bf16 tensors as they are, f32 ones converted into a
// staging region (`in`), or, for outputs, a staging region converted back afterwards.
const __nv_bfloat16* bf16_input(const void* t, bool bf16, void* staging, int64_t n, cudaStream_t stream) {
  if (bf16) return static_cast<const __nv_bfloat16*>(t);
  to_bf16(static_cast<__nv_bfloat16*>(staging), static_cast<const float*>(t), n, stream);
  return static_cast<const __nv_bfloat16*>(staging);
}
}  // namespace

void Attention::forward(void* o, float* lse, const void* q, const void* k, const void* v, bool bf16,
                        const AttentionShape& s, double scale) {
  if (s.numel() == 0) return;
  const int64_t n = s.numel();
  const PrefetchWait backward_plan = prefetch_backward(s);  // compiles while the forward's does
  if (!use_cudnn(s, Direction::forward)) {
    if (!bf16) {
      reference_attention_forward(static_cast<float*>(o), lse, static_cast<const float*>(q),
                                  static_cast<const float*>(k), static_cast<const float*>(v), s,
                                  static_cast<float>(scale), stream_);
    } else {  // bf16 heads on the f32 kernel: widen, run, round o back
      Regions r;
      const size_t f32_bytes = static_cast<size_t>(n) * sizeof(float);
      const size_t q32 = r.take(f32_bytes), k32 = r.take(f32_bytes), v32 = r.take(f32_bytes), o32 = r.take(f32_bytes);
      void* base = cudnn_->staging_buffer(r.total);
      to_f32(at<float>(base, q32), static_cast<const __nv_bfloat16*>(q), n, stream_);
      to_f32(at<float>(base, k32), static_cast<const __nv_bfloat16*>(k), n, stream_);
      to_f32(at<float>(base, v32), static_cast<const __nv_bfloat16*>(v), n, stream_);
      reference_attention_forward(at<float>(base, o32), lse, at<float>(base, q32), at<float>(base, k32),
                                  at<float>(base, v32), s, static_cast<float>(scale), stream_);
      to_bf16(static_cast<__nv_bfloat16*>(o), at<float>(base, o32), n, stream_);
    }
    ++g_reference_calls;
    return;
  }
  const CudnnPlan& p = bf16_plan(s, Direction::forward);
  const size_t bf16_bytes = static_cast<size_t>(n) * sizeof(__nv_bfloat16);
  const size_t stats_bytes = static_cast<size_t>(s.rows()) * sizeof(float);
  const bool stage_stats = !aligned16(lse);     // cuDNN writes Stats with 16-byte alignment
  const size_t staged = bf16 ? 0 : bf16_bytes;  // f32 heads: bf16 copies of q, k, v and o
  Regions r;
  const size_t q16 = r.take(staged), k16 = r.take(staged), v16 = r.take(staged), o16 = r.take(staged);
  const size_t stats = stage_stats ? r.take(stats_bytes) : 0;
  const size_t ws = r.take(static_cast<size_t>(p.workspace_bytes));
  void* base = cudnn_->staging_buffer(r.total);

  const __nv_bfloat16* qb = bf16_input(q, bf16, at<void>(base, q16), n, stream_);
  const __nv_bfloat16* kb = bf16_input(k, bf16, at<void>(base, k16), n, stream_);
  const __nv_bfloat16* vb = bf16_input(v, bf16, at<void>(base, v16), n, stream_);
  void* ob = bf16 ? o : at<void>(base, o16);
  float scale_f = static_cast<float>(scale);
  float* stats_ptr = stage_stats ? at<float>(base, stats) : lse;
  cudnn_->execute(p, {kQ, kK, kV, kO, kStats, kScale},
                  {const_cast<__nv_bfloat16*>(qb), const_cast<__nv_bfloat16*>(kb), const_cast<__nv_bfloat16*>(vb), ob,
                   stats_ptr, &scale_f},
                  at<void>(base, ws));
  if (!bf16) to_f32(static_cast<float*>(o), static_cast<const __nv_bfloat16*>(ob), n, stream_);
  if (stage_stats) FLUX8_CUDA_CHECK(cudaMemcpyAsync(lse, stats_ptr, stats_bytes, cudaMemcpyDeviceToDevice, stream_));
  ++g_cudnn_calls;
}

void Attention::backward(void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k, const void* v,
                         const void* o, const float* lse, bool bf16, const AttentionShape& s, double scale) {
  if (s.numel() == 0 || (!dq && !dk && !dv)) return;
  const AttentionShape part = backward_call_shape(s);
  if (part.key() == s.key()) {
    backward_call(dq, dk, dv, dout, q, k, v, o, lse, bf16, s, scale);
    return;
  }
  // Consecutive (sample, head) pairs of the dense [B, n, L, D] heads: each call's tensors start
  // `c` parts further in, its lse `c` parts' rows further.
  const int64_t head_bytes = part.numel() * static_cast<int64_t>(bf16 ? sizeof(__nv_bfloat16) : sizeof(float));
  const int64_t calls = s.batch * s.heads / part.heads;
  for (int64_t c = 0; c < calls; ++c) {
    auto in = [&](const void* p) { return p ? static_cast<const char*>(p) + c * head_bytes : nullptr; };
    auto out = [&](void* p) { return p ? static_cast<char*>(p) + c * head_bytes : nullptr; };
    backward_call(out(dq), out(dk), out(dv), in(dout), in(q), in(k), in(v), in(o), lse + c * part.rows(), bf16, part,
                  scale);
  }
}

void Attention::backward_call(void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k,
                              const void* v, const void* o, const float* lse, bool bf16, const AttentionShape& s,
                              double scale) {
  const int64_t n = s.numel();
  const Direction dir = deterministic_ ? Direction::backward_deterministic : Direction::backward;
  if (!use_cudnn(s, dir)) {
    float* delta = static_cast<float*>(delta_scratch(static_cast<size_t>(s.rows()) * sizeof(float)));
    if (!bf16) {
      reference_attention_backward(static_cast<float*>(dq), static_cast<float*>(dk), static_cast<float*>(dv),
                                   static_cast<const float*>(dout), static_cast<const float*>(q),
                                   static_cast<const float*>(k), static_cast<const float*>(v),
                                   static_cast<const float*>(o), lse, s, static_cast<float>(scale), delta, stream_);
    } else {  // bf16 heads on the f32 kernel: widen the inputs, round the gradients back
      Regions r;
      const size_t f32_bytes = static_cast<size_t>(n) * sizeof(float);
      size_t in[5], out[3];
      for (size_t& i : in) i = r.take(f32_bytes);
      for (size_t& i : out) i = r.take(f32_bytes);
      void* base = cudnn_->staging_buffer(r.total);
      const void* src[5] = {q, k, v, o, dout};
      for (int i = 0; i < 5; ++i) to_f32(at<float>(base, in[i]), static_cast<const __nv_bfloat16*>(src[i]), n, stream_);
      void* dst[3] = {dq, dk, dv};
      reference_attention_backward(dq ? at<float>(base, out[0]) : nullptr, dk ? at<float>(base, out[1]) : nullptr,
                                   dv ? at<float>(base, out[2]) : nullptr, at<float>(base, in[4]),
                                   at<float>(base, in[0]), at<float>(base, in[1]), at<float>(base, in[2]),
                                   at<float>(base, in[3]), lse, s, static_cast<float>(scale), delta, stream_);
      for (int i = 0; i < 3; ++i)
        if (dst[i]) to_bf16(static_cast<__nv_bfloat16*>(dst[i]), at<float>(base, out[i]), n, stream_);
    }
    ++g_reference_calls;
    return;
  }
  const CudnnPlan& p = bf16_plan(s, dir);
  const size_t bf16_bytes = static_cast<size_t>(n) * sizeof(__nv_bfloat16);
  const size_t stats_bytes = static_cast<size_t>(s.rows()) * sizeof(float);
  const bool stage_stats = !aligned16(lse);
  const size_t staged = bf16 ? 0 : bf16_bytes;  // f32 heads: bf16 copies of the inputs
  Regions r;
  const size_t q16 = r.take(staged), k16 = r.take(staged), v16 = r.take(staged), o16 = r.take(staged);
  const size_t do16 = r.take(staged);
  // Gradient outputs: staged unless they are bf16 tensors given by the caller (cuDNN writes
  // all three; one not wanted goes to staging).
  const size_t dq16 = r.take(bf16 && dq ? 0 : bf16_bytes), dk16 = r.take(bf16 && dk ? 0 : bf16_bytes),
               dv16 = r.take(bf16 && dv ? 0 : bf16_bytes);
  const size_t softmax_sum = r.take(stats_bytes);
  const size_t stats = stage_stats ? r.take(stats_bytes) : 0;
  const bool accumulate_dq = dir == Direction::backward;  // the graph has an f32 dQ_accum
  const size_t dq_accum = accumulate_dq ? r.take(static_cast<size_t>(n) * sizeof(float)) : 0;
  const size_t ws = r.take(static_cast<size_t>(p.workspace_bytes));
  void* base = cudnn_->staging_buffer(r.total);

  const __nv_bfloat16* qb = bf16_input(q, bf16, at<void>(base, q16), n, stream_);
  const __nv_bfloat16* kb = bf16_input(k, bf16, at<void>(base, k16), n, stream_);
  const __nv_bfloat16* vb = bf16_input(v, bf16, at<void>(base, v16), n, stream_);
  const __nv_bfloat16* ob = bf16_input(o, bf16, at<void>(base, o16), n, stream_);
  const __nv_bfloat16* dob = bf16_input(dout, bf16, at<void>(base, do16), n, stream_);
  void* dqb = bf16 && dq ? dq : at<void>(base, dq16);
  void* dkb = bf16 && dk ? dk : at<void>(base, dk16);
  void* dvb = bf16 && dv ? dv : at<void>(base, dv16);
  float* stats_ptr = stage_stats ? at<float>(base, stats) : const_cast<float*>(lse);
  if (stage_stats) FLUX8_CUDA_CHECK(cudaMemcpyAsync(stats_ptr, lse, stats_bytes, cudaMemcpyDeviceToDevice, stream_));
  float scale_f = static_cast<float>(scale), one = 1.0f;
  auto in = [](const __nv_bfloat16* p) { return static_cast<void*>(const_cast<__nv_bfloat16*>(p)); };
  std::vector<int64_t> uids{kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kScale, kOne, kSoftmaxSum};
  std::vector<void*> pointers{in(qb), in(kb), in(vb), in(ob),   in(dob), stats_ptr,
                              dqb,    dkb,    dvb,    &scale_f, &one,    at<void>(base, softmax_sum)};
  if (accumulate_dq) {
    // cuDNN adds dQ's contributions into dQ_accum with atomics: it must start at zero
    // (cudnn-frontend memsets it as a workspace modification). The staging buffer holds the
    // previous call's data.
    FLUX8_CUDA_CHECK(cudaMemsetAsync(at<void>(base, dq_accum), 0, static_cast<size_t>(n) * sizeof(float), stream_));
    uids.push_back(kDQAccum);
    pointers.push_back(at<void>(base, dq_accum));
  }
  cudnn_->execute(p, uids, pointers, at<void>(base, ws));
  if (!bf16) {
    if (dq) to_f32(static_cast<float*>(dq), static_cast<const __nv_bfloat16*>(dqb), n, stream_);
    if (dk) to_f32(static_cast<float*>(dk), static_cast<const __nv_bfloat16*>(dkb), n, stream_);
    if (dv) to_f32(static_cast<float*>(dv), static_cast<const __nv_bfloat16*>(dvb), n, stream_);
  }
  ++g_cudnn_calls;
}

}  // namespace flux8::cuda

// ---- the backend's ops ---------------------------------------------------------------------

namespace flux8 {
using namespace cuda;

namespace {

// cuDNN and the kernels take dense [B, n, L, D] tensors (the shapes are checked by ops::).
AttentionShape dense_heads(std::string_view op, const ops::AttentionDims& d, std::span<const Named> heads) {
  for (const Named& a : heads) require_contiguous(op, a);
  return AttentionShape{d.B, d.n, d.L, d.D};
}

}  // namespace

namespace {
// The heads share one dtype (heads_in_bf16); lse is f32; bf16 heads go to cuDNN as they are,
// so they must be 16-byte aligned like its tensors.
bool attention_heads_in_bf16(std::string_view op, std::span<const Named> heads, const Tensor& lse) {
  require_f32(op, {{"lse", lse}});
  const bool bf16 = heads_in_bf16(op, heads);
  if (bf16)
    for (const Named& h : heads)
      if (h.t.defined() && !aligned16(h.t.data))
        fail("{}: bf16 tensor '{}' is not 16-byte aligned (cuDNN reads bf16 heads in place)", op, h.name);
  return bf16;
}
}  // namespace

void CudaBackend::execute(const op::Attention& args) {
  constexpr std::string_view op = "attention";
  const bool bf16 = attention_heads_in_bf16(op, tensor_fields(args, {"o", "q", "k", "v"}), args.lse);
  const AttentionShape s = dense_heads(op, ops::check(op, args), tensor_fields(args, {"q", "k", "v", "o"}));
  FLUX8_CHECK(attention_ != nullptr, "CudaBackend has no Attention (make_attention not called)");
  attention_->forward(args.o.data, args.lse.ptr<float>(), args.q.data, args.k.data, args.v.data, bf16, s, args.scale);
}

void CudaBackend::execute(const op::AttentionBackward& args) {
  constexpr std::string_view op = "attention_backward";
  const bool bf16 =
      attention_heads_in_bf16(op, tensor_fields(args, {"dq", "dk", "dv", "dout", "q", "k", "v", "o"}), args.lse);
  const AttentionShape s =
      dense_heads(op, ops::check(op, args), tensor_fields(args, {"q", "k", "v", "o", "dout", "dq", "dk", "dv"}));
  FLUX8_CHECK(attention_ != nullptr, "CudaBackend has no Attention (make_attention not called)");
  attention_->backward(args.dq.data, args.dk.data, args.dv.data, args.dout.data, args.q.data, args.k.data, args.v.data,
                       args.o.data, args.lse.ptr<float>(), bf16, s, args.scale);
}

DType CudaBackend::attention_heads_dtype(DType activations, int64_t head_dim) const {
  FLUX8_CHECK(attention_ != nullptr, "CudaBackend has no Attention (make_attention not called)");
  return activations == DType::f32 && attention_->cudnn_takes_head_dim(head_dim) ? DType::bf16 : activations;
}

}  // namespace flux8
