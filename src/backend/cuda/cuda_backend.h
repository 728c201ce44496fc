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
#include <mutex>
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
  double timing_elapsed_ms(int64_t from, int64_t to) override;
  void release_timing_marks() override;
  const BackendOptions& options() const override { return options_; }
  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }  // the CUDA device index the stream belongs to
  // The CUDA event behind an event of this backend (make_event), for a queue of another library
  // (NCCL's) to order its stream with this backend's ops; fails for another backend's event.
  static cudaEvent_t native_event(const Event& e);
  cuda::Gemm& gemm() { return *gemm_; }

  void* allocate(size_t bytes) override;
  // Events are cudaEvents on this backend's stream; the copy queue is a stream of its own with
  // two pinned chunks (memory.cu). Not while capturing: a graph would hold the wait.
  std::unique_ptr<Event> make_event() override;
  std::unique_ptr<CopyQueue> make_copy_queue() override;
  MemoryUse memory_use() const override;
  PowerReading power_reading() override;  // NVML (nvml.h), opened at the first call

  // CUDA graphs (StepGraph): stream capture of this backend's stream, thread-local mode (an op
  // that synchronises or allocates while capturing fails the capture, not the process).
  bool can_capture() const override { return true; }
  bool register_host_memory(void* p, size_t bytes) override;
  void unregister_host_memory(void* p) override;
  bool computes_beside_host() const override { return true; }
  void begin_capture() override;
  std::unique_ptr<Graph> end_capture() override;
  void launch_graph(const Graph& g) override;
  // Bumped whenever a scratch buffer, the attention's staging buffer or its delta buffer moves.
  uint64_t capture_generation() const override;

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
  bool repeats_bit_for_bit() const override { return options_.deterministic_attention; }

  // Every op, the defaulted ones too (fused kernels).
  FLUX8_OPS(FLUX8_DECLARE_EXECUTE)

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
  bool qk_norm_rope_backward(std::string_view op, const op::QkNormRopeToHeadsBackward& args, const QTensor* fp8);

 protected:
  void do_release(void* p) override;
  void do_upload(void* dst, const void* host_src, size_t bytes) override;
  void do_download(void* host_dst, const void* src, size_t bytes) override;
  void do_synchronize() override;
  void do_record_event(Event& e) override;
  void do_wait_event(const Event& e) override;
  int64_t do_timing_mark() override;

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
  // A scratch buffer of at least `want` bytes (grown by a quarter more; counted as allocated).
  void* grow(void*& buf, size_t& have, size_t want);

  // A table of per-block chunks of the flat parameter buffers on the device (adamw,
  // gradient_sum_squares, ranges_sum_squares: training.cu) and the layout it was made for (n, the outputs, the
  // low-rank gradients): made again only when that changes (a trainer passes the same every step).
  struct ChunkTable {
    std::vector<int64_t> layout;
    void* data = nullptr;
    size_t bytes = 0;
    int64_t count = 0;
    int64_t first_low_rank = 0;  // the flat-gradient chunks come first, then the low-rank ones
  };
  ChunkTable adamw_table_, squares_table_, ranges_table_;
  // Uploads `flat_count` then `low_rank_count` chunks of `chunk_bytes` each as t's table.
  void upload_chunk_table(ChunkTable& t, size_t chunk_bytes, const void* flat, int64_t flat_count, const void* low_rank,
                          int64_t low_rank_count, std::vector<int64_t> layout);
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
  // register_host_memory's page-locked ranges (start, bytes), which copies use directly.
  std::mutex registered_mutex_;
  std::vector<std::pair<const char*, size_t>> registered_;
  bool registered_range(const void* p, size_t bytes);
  void* stats_dev_ = nullptr;   // kPendingCastStats totals (fp8.cu's StatsTotal)
  void* stats_host_ = nullptr;  // pinned mirror
};

}  // namespace flux8
