#pragma once
// The CUDA backend for Hopper (sm_90a). Every op of src/backend/backend.h runs on the device
// stream of this backend; the conformance tests (tests/gpu/) check each against the CPU
// backend. Parameters, gradients and statistics are f32; activations are f32 or bf16
// (BackendOptions::bf16_activations, activation_dtype(): every kernel that touches them is
// templated on the storage type, load() widens and store() rounds, common.cuh).
//
// Files by concern: memory.cu (allocation, copies, fill/add), gemm.{h,cpp} (the one cuBLASLt
// wrapper), linear.cu, activations.cu, norms.cu, layout.cu (token/head layout, concat/split,
// RoPE), qk_norm_rope.cu (QK-norm + RoPE + head layout of the attention inputs, fused),
// attention.cu (cuDNN SDPA; attention_reference.cu the plain kernel), embedding.cu,
// training.cu (objective noise, loss, norm, AdamW), fp8.cu (casts) and fp8_gemm.cu.
//
// Reductions (column sums, loss, norms, amax) use a fixed split of the work and sum partials
// in a fixed order: results are the same on every run.
#include <cuda_runtime.h>

#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/pinned_staging.h"

namespace flux8::cuda {
class Gemm;
class Attention;
class NvmlDevice;
}  // namespace flux8::cuda

namespace flux8 {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const BackendOptions& options);
  ~CudaBackend() override;

  std::string name() const override { return "cuda"; }
  // Events recorded in the stream (created on first use, reused after release_timing_marks()).
  int64_t timing_mark() override;
  double timing_elapsed_ms(int64_t from, int64_t to) override;
  void release_timing_marks() override;
  const BackendOptions& options() const override { return options_; }
  cudaStream_t stream() const { return stream_; }
  cuda::Gemm& gemm() { return *gemm_; }

  void* allocate(size_t bytes) override;
  void release(void* p) override;
  void upload(void* dst, const void* host_src, size_t bytes) override;
  void download(void* host_dst, const void* src, size_t bytes) override;
  void synchronize() override;
  // Events are cudaEvents on this backend's stream; the copy queue is a stream of its own with
  // two pinned chunks (memory.cu). Not while capturing: a graph would hold the wait.
  std::unique_ptr<Event> make_event() override;
  std::unique_ptr<CopyQueue> make_copy_queue() override;
  void record_event(Event& e) override;
  void wait_event(const Event& e) override;
  MemoryUse memory_use() const override;
  PowerReading power_reading() override;  // NVML (nvml.h), opened at the first call

  // CUDA graphs (StepGraph): stream capture of this backend's stream, thread-local mode (an op
  // that synchronises or allocates while capturing fails the capture, not the process).
  bool can_capture() const override { return true; }
  bool computes_beside_host() const override { return true; }
  bool attention_backward_repeats() const override { return options().deterministic_attention; }
  void begin_capture() override;
  std::unique_ptr<Graph> end_capture() override;
  void launch_graph(const Graph& g) override;
  // Bumped whenever a scratch buffer, the attention's staging buffer or its delta buffer moves.
  uint64_t capture_generation() const override;

  void fill(Tensor y, double value) override;
  void fill_random(Tensor y, Random dist, uint64_t seed, uint64_t stream, double scale) override;
  void copy(Tensor y, Tensor x) override;
  DType attention_heads_dtype(DType activations, int64_t head_dim) const override;
  DType activation_dtype(DType compute) const override {
    return options_.bf16_activations && compute == DType::f32 ? DType::bf16 : compute;
  }
  DType weight_operand_dtype(DType compute) const override {
    return (options_.bf16_activations || options_.bf16_gemm) && compute == DType::f32 ? DType::bf16 : compute;
  }
  DType gradient_dtype(DType compute) const override {
    return options_.bf16_grads && compute == DType::f32 ? DType::bf16 : compute;
  }
  void add(Tensor y, Tensor a, Tensor b) override;
  void accumulate(Tensor y, Tensor x) override;

  void linear(Tensor y, Tensor x, Tensor w, Tensor b) override;
  void linear_gelu(Tensor y, Tensor h, Tensor x, Tensor w, Tensor b) override;
  void linear_dgrad_gelu(Tensor dx, Tensor dh, Tensor dy, Tensor w, Tensor h) override;
  void linear_backward(Tensor dx, Tensor dw, Tensor db, Tensor dy, Tensor x, Tensor w,
                       bool accumulate_dx, bool accumulate_params) override;

  void silu(Tensor y, Tensor x) override;
  void silu_backward(Tensor dx, Tensor dy, Tensor x, bool accumulate_dx) override;
  void gelu_tanh(Tensor y, Tensor x) override;
  void gelu_tanh_backward(Tensor dx, Tensor dy, Tensor x) override;

  void layernorm_modulate(Tensor y, Tensor mean, Tensor rstd, Tensor x, Tensor shift, Tensor scale,
                          double eps) override;
  void layernorm_modulate_backward(Tensor dx, Tensor dshift, Tensor dscale, Tensor dy, Tensor x,
                                   Tensor mean, Tensor rstd, Tensor scale,
                                   bool accumulate_dx) override;
  void rmsnorm_heads(Tensor y, Tensor rstd, Tensor x, Tensor scale, double eps) override;
  void rmsnorm_heads_backward(Tensor dx, Tensor dscale, Tensor dy, Tensor x, Tensor rstd,
                              Tensor scale) override;

  void tokens_to_heads(Tensor heads, Tensor tokens, int64_t token_offset) override;
  void heads_to_tokens(Tensor tokens, Tensor heads, int64_t token_offset) override;
  void tokens_to_heads_fp8(const Fp8Heads& heads, Tensor tokens, int64_t token_offset) override;
  void heads_to_tokens_fp8(Tensor tokens, const QTensor& heads, int64_t token_offset) override;

  void rope_table(Tensor pe, Tensor ids, std::span<const int> axes_dim, double theta) override;
  void rope(Tensor x, Tensor pe, bool inverse) override;
  void qk_norm_rope_to_heads(Tensor q_heads, Tensor k_heads, Tensor v_heads, Tensor q_rstd, Tensor k_rstd, Tensor q,
                             Tensor k, Tensor v, Tensor q_scale, Tensor k_scale, Tensor pe, int64_t token_offset,
                             double eps) override;
  void qk_norm_rope_to_heads_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dq_scale, Tensor dk_scale,
                                      Tensor dq_heads, Tensor dk_heads, Tensor dv_heads, Tensor q, Tensor k,
                                      Tensor q_rstd, Tensor k_rstd, Tensor q_scale, Tensor k_scale, Tensor pe,
                                      int64_t token_offset) override;
  void qk_norm_rope_to_heads_fp8(const Fp8Heads& q_heads, const Fp8Heads& k_heads, const Fp8Heads& v_heads,
                                 Tensor q_rstd, Tensor k_rstd, Tensor q, Tensor k, Tensor v, Tensor q_scale,
                                 Tensor k_scale, Tensor pe, int64_t token_offset, double eps) override;
  void qk_norm_rope_to_heads_backward_fp8(Tensor dq, Tensor dk, Tensor dv, Tensor dq_scale, Tensor dk_scale,
                                          const QTensor& dq_heads, const QTensor& dk_heads, const QTensor& dv_heads,
                                          Tensor q, Tensor k, Tensor q_rstd, Tensor k_rstd, Tensor q_scale,
                                          Tensor k_scale, Tensor pe, int64_t token_offset) override;

  void attention(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, double scale) override;
  void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                          Tensor v, Tensor o, Tensor lse, double scale) override;

  void copy_batch(std::span<const CopyPair> pairs) override;
  void gated_residual(Tensor out, Tensor x, Tensor y, Tensor gate) override;
  void gated_residual_stats(Tensor out, Tensor mean, Tensor rstd, Tensor x, Tensor y, Tensor gate,
                            double eps) override;
  void gated_residual_backward(Tensor dy, Tensor dgate, Tensor dx, Tensor y, Tensor gate) override;

  void timestep_embedding(Tensor out, Tensor t, double time_factor, double max_period) override;

  void concat_tokens(Tensor out, Tensor a, Tensor b) override;
  void split_tokens(Tensor a, Tensor b, Tensor in) override;

  void flow_match_inputs(Tensor xt, Tensor target, Tensor x0, Tensor t, uint64_t seed,
                         std::span<const uint64_t> streams) override;
  double mse_loss(Tensor dpred, Tensor pred, Tensor target, double grad_scale) override;
  void mse_loss_into(Tensor loss, Tensor dpred, Tensor pred, Tensor target, double grad_scale) override;
  double sum_squares(Tensor x) override;
  double gradient_sum_squares(Tensor grads, std::span<const LowRankGrad> low_rank) override;
  void adamw(Tensor param, Tensor grad, Tensor m, Tensor v, const AdamW& h,
             std::span<const ParamCopy> copies, std::span<const ParamCast> casts,
             std::span<const LowRankGrad> low_rank) override;
  void quantize(QTensor rowwise, QTensor columnwise, Tensor x, const Quantize& q) override;
  void transpose_codes(QTensor dst, const QTensor& src) override;
  void dequantize(Tensor y, const QTensor& x) override;
  void attention_fp8(QTensor o, Tensor lse, const QTensor& q, const QTensor& k, const QTensor& v, Shape heads,
                     double scale, const Fp8AttentionScales& sc) override;
  void attention_fp8_backward(QTensor dq, QTensor dk, QTensor dv, const QTensor& dout, const QTensor& q,
                              const QTensor& k, const QTensor& v, const QTensor& o, Tensor lse, Shape heads,
                              double scale, const Fp8AttentionScales& sc) override;
  void quantize_fused(QTensor rowwise, QTensor columnwise, const CastInput& in, const Quantize& q) override;
  void delayed_scaling_update(Tensor amax_history, Tensor scale, Tensor scale_inv, Tensor fp8_max, AmaxAlgo algo,
                              int margin) override;
  void gemm_fp8_tn(Tensor c, const QTensor& a, const QTensor& b, Tensor bias, bool accumulate,
                   Fp8Accumulation sum) override;

  // Device scratch of at least `bytes`, valid until the next call. It grows (with a
  // synchronisation) only when a larger size is first asked for: after the first step of a
  // fixed shape nothing is allocated.
  void* scratch(size_t bytes);
  // A second, independent scratch (ops that need two at once).
  void* scratch2(size_t bytes);
  // Device scratch for the bias of a GEMM epilogue (gemm_with_bias), apart from the others,
  // which may hold the GEMM's operands or scales.
  void* epilogue_scratch(size_t bytes);
  // Device scratch for the partial sums of the fixed-order reductions (common.cuh), apart from
  // the two above so that a reduction may run while their contents are in use.
  void* reduction_scratch(size_t bytes);
  // Delivers the amax and statistics of the FP8 casts since the last call to their host targets
  // (Quantize::amax/stats), with one synchronisation. synchronize() and download() call it, so
  // the targets are current whenever the host can see the step's results.
  void flush_cast_stats();
  // The total of a cast's per-block statistics (cast_stats.cuh's StatsPartial [n], device
  // memory) over `elements`: its amax max-accumulated into *q.amax, its counts delivered to
  // *q.stats at the next flush_cast_stats(). Either target may be absent (nothing to do).
  void total_cast_stats(const void* partials, int64_t n, int64_t elements, const Quantize& q);
  // Host-visible pinned buffer for small results (loss, norms, amax): `bytes` ≤ 4096.
  void* pinned_result();
  // Calls of qk_norm_rope_to_heads and its backward that took the vector path (16-byte
  // accesses: head dim 8·2^k up to 256, rows aligned to 8 elements; qk_norm_rope.cu) since this
  // backend was made. Tests check which path their shapes take.
  int64_t qk_norm_rope_vector_calls() const { return qk_norm_rope_vector_calls_; }

  // qk_norm_rope_to_heads_backward on the heads tensors, or (fp8: the codes of dq, dk, dv
  // heads, whose tensors then only give the shape and alignment) on FP8 heads: false, launching
  // nothing, where FP8 heads would need the pair path (the caller takes the default). Public only
  // because nvcc's extended device lambdas may not sit in a private member.
  bool qk_norm_rope_backward(std::string_view op, Tensor dq, Tensor dk, Tensor dv, Tensor dq_scale, Tensor dk_scale,
                             Tensor dq_heads, Tensor dk_heads, Tensor dv_heads, Tensor q, Tensor k, Tensor q_rstd,
                             Tensor k_rstd, Tensor q_scale, Tensor k_scale, Tensor pe, int64_t token_offset,
                             const QTensor* fp8);

 private:
  BackendOptions options_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> timing_events_;  // timing_mark(): the first timing_marks_used_ are in use
  size_t timing_marks_used_ = 0;
  std::unique_ptr<cuda::Gemm> gemm_;
  std::unique_ptr<cuda::Attention> attention_;
  std::unique_ptr<cuda::NvmlDevice> nvml_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  void* scratch2_ = nullptr;
  size_t scratch2_bytes_ = 0;
  void* reduction_scratch_ = nullptr;
  size_t reduction_scratch_bytes_ = 0;
  void* epilogue_scratch_ = nullptr;
  size_t epilogue_scratch_bytes_ = 0;
  void* pinned_ = nullptr;
  int64_t qk_norm_rope_vector_calls_ = 0;
  bool capturing_ = false;
  uint64_t scratch_generation_ = 0;  // reallocations of the four scratch buffers

  // A table of per-block chunks of the flat parameter buffers on the device (adamw,
  // gradient_sum_squares: training.cu) and the layout it was made for (n, the outputs, the
  // low-rank gradients): made again only when that changes (a trainer passes the same every step).
  struct ChunkTable {
    std::vector<int64_t> layout;
    void* data = nullptr;
    size_t bytes = 0;
    int64_t count = 0;
    int64_t first_low_rank = 0;  // the flat-gradient chunks come first, then the low-rank ones
  };
  ChunkTable adamw_table_, squares_table_;
  // Uploads `flat_count` then `low_rank_count` chunks of `chunk_bytes` each as t's table.
  void upload_chunk_table(ChunkTable& t, size_t chunk_bytes, const void* flat, int64_t flat_count,
                          const void* low_rank, int64_t low_rank_count, std::vector<int64_t> layout);
  // Casts whose statistics are still on the device (flush_cast_stats), in cast order.
  struct PendingCastStats {
    CastStats* stats;
    int64_t elements;
  };
  static constexpr size_t kPendingCastStats = 4096;
  std::vector<PendingCastStats> pending_stats_;
  // upload() and download(): at least kStagedUploadBytes go through pinned chunks, each
  // direction its own (the batch pipeline's thread uploads while the trainer downloads).
  static constexpr size_t kStagedUploadBytes = size_t(4) << 20;
  cuda::PinnedStaging upload_staging_;
  cuda::PinnedStaging download_staging_;
  void* stats_dev_ = nullptr;   // kPendingCastStats totals (fp8.cu's StatsTotal)
  void* stats_host_ = nullptr;  // pinned mirror
};

}  // namespace flux8
