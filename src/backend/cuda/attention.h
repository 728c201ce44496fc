#pragma once
// Exact (non-causal, unmasked) softmax attention on the GPU: the CUDA backend's attention and
// attention_backward. Two implementations of the same math (backend.h):
//
// - cuDNN's fused flash attention (the default). cuDNN's kernels take bf16 Q/K/V/O/dO: bf16
//   heads (what models store where cuDNN runs, Backend::attention_heads_dtype) go in as they
//   are; f32 heads are converted into bf16 staging buffers and the results converted back (o,
//   dq, dk, dv carry bf16 rounding either way).
//   lse is cuDNN's own f32 "Stats" output (max + log Σ exp of the scaled scores: exactly our
//   lse). The plans are built once per (B, n, L, D) and direction and reused; the scale is a
//   by-value graph input, so one plan serves every scale. A training step builds nothing
//   after its first iteration.
// - A plain f32 kernel (attention_reference.cu): for head dims cuDNN does not take
//   (D % 8 != 0, D > 256), when cuDNN refuses the graph on this GPU (a one-time log line says
//   why), and as the tests' second opinion.
//
// Which one runs: set_attention_path below, or FLUX8_ATTENTION=cudnn|reference|auto in the
// environment (read once, at first use).
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "fp8/format.h"

namespace flux8::cuda {

struct CudnnPlan;

enum class AttentionPath {
  automatic,  // cuDNN where it supports the shape, else the reference kernel
  cudnn,      // cuDNN only: an unsupported shape is an error (tests, benchmarks)
  reference,  // the f32 reference kernel only
};

// Process-wide selection, for every CUDA backend in the process.
void set_attention_path(AttentionPath path);
AttentionPath attention_path();

// Counters since the process started (tests check that plans are cached and which path ran).
struct AttentionCounters {
  int64_t cudnn_plans_built = 0;       // cuDNN execution plans finalized (forward and backward)
  int64_t cudnn_calls = 0;             // forward/backward calls run by cuDNN
  int64_t reference_calls = 0;         // forward/backward calls run by the reference kernel
  int64_t cudnn_plans_prefetched = 0;  // of the plans built, those built on the helper thread
};
AttentionCounters attention_counters();

// q, k, v, o, dq, dk, dv: [batch, heads, seq, head_dim]; lse: [batch, heads, seq]; all
// contiguous device memory (the heads f32 or bf16, lse f32).
struct AttentionShape {
  int64_t batch = 0, heads = 0, seq = 0, head_dim = 0;
  int64_t rows() const { return batch * heads * seq; }  // query rows of all heads
  int64_t numel() const { return rows() * head_dim; }
  auto key() const { return std::make_tuple(batch, heads, seq, head_dim); }
};

// ---- the reference kernels (attention_reference.cu) --------------------------------------
// o = softmax(scale·q·kᵀ)·v and lse = log Σ_j exp(scale·q·k_j), in f32 with an online softmax.
void reference_attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                                 const AttentionShape& s, float scale, cudaStream_t stream);
// dq, dk, dv (each may be null: not needed) from the saved lse; `delta` is scratch for
// δ_i = dO_i·O_i, s.rows() floats. No atomics: the results are the same on every run.
void reference_attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                                  const float* v, const float* o, const float* lse, const AttentionShape& s,
                                  float scale, float* delta, cudaStream_t stream);
// Head dims the reference kernels take (each lane of a warp holds D/32 elements of a row).
constexpr int64_t kReferenceMaxHeadDim = 256;

// ---- the dispatcher, owned by the CUDA backend ---------------------------------------------
// Told of each device buffer the dispatcher allocates or frees for itself (cuDNN's staging and
// workspace region, the reference kernel's δ): the backend counts them with its own allocations,
// so a step's peak memory includes the attention's workspace. Either may be empty.
struct BufferHooks {
  std::function<void(void*, size_t)> allocated;
  std::function<void(void*)> released;
  void on_allocated(void* p, size_t bytes) const {
    if (allocated) allocated(p, bytes);
  }
  void on_released(void* p) const {
    if (released) released(p);
  }
};

class Attention {
 public:
  // `deterministic`: the BF16 backward. cuDNN's usual backward sums dq's contributions of
  // different key blocks with atomics, in an order that varies from run to run (dq differs in
  // the last bits); its deterministic backward keeps dP in its workspace instead (cudnn-frontend
  // budgets B·n·L² bf16 values for it) and is slower (docs/PERFORMANCE.md, GEMMs and attention at
  // Flux shapes). The reference kernel is always deterministic. The backend passes
  // BackendOptions::deterministic_attention (the config key of that name; true by default: runs
  // repeat bit for bit, resume is exact). `dp_limit_bytes` (0: none) bounds the deterministic
  // backward's dP: a larger call runs as several over consecutive (sample, head) pairs
  // (split_attention_backward), with the same results.
  Attention(cudaStream_t stream, bool deterministic, uint64_t dp_limit_bytes = 0, BufferHooks hooks = {});
  ~Attention();
  Attention(const Attention&) = delete;
  Attention& operator=(const Attention&) = delete;

  // The heads tensors (q, k, v, o and, backward, dout, dq, dk, dv) are all f32 or all bf16
  // (`bf16`); lse is f32. bf16 heads are what cuDNN reads and writes: no conversion passes (on
  // the reference kernel they are widened to f32 and the results rounded back).
  void forward(void* o, float* lse, const void* q, const void* k, const void* v, bool bf16, const AttentionShape& s,
               double scale);
  // dq, dk, dv may be null (not needed).
  void backward(void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k, const void* v,
                const void* o, const float* lse, bool bf16, const AttentionShape& s, double scale);
  // Whether cuDNN is the path for head dim D here (FLUX8_ATTENTION not reference, cuDNN loads,
  // D a multiple of 8 up to 256): where models keep their attention heads in bf16. A shape
  // cuDNN still refuses when its plan is built runs on the reference kernel with the bf16 values.
  bool cudnn_takes_head_dim(int64_t head_dim);

  // "" when cuDNN runs this shape here (forward and backward plans built and cached), else
  // the reason it does not.
  std::string cudnn_unsupported_reason(const AttentionShape& s);

  // ---- FP8 (attention_fp8.cu): cuDNN's FP8 flash attention, Backend::attention_fp8 ---------
  // All pointers are device memory; the scales and amaxes are single floats (cuDNN reads the
  // scales from, and writes the amaxes into, 16-byte aligned copies this class makes). The
  // amaxes are max-accumulated into their targets (null: not recorded) and the outputs'
  // scale_inv written after cuDNN's graph ran.
  struct Fp8Forward {
    AttentionShape shape;
    Fp8Format qkv = Fp8Format::e4m3, o_format = Fp8Format::e4m3;
    bool token_major = false;  // [B, L, n, D] memory (BSHD) instead of [B, n, L, D]
    double scale = 1.0;
    const uint8_t *q = nullptr, *k = nullptr, *v = nullptr;
    uint8_t* o = nullptr;
    float* lse = nullptr;
    const float *descale_q = nullptr, *descale_k = nullptr, *descale_v = nullptr;
    const float* scale_o = nullptr;  // (P's scale is fixed: Backend::attention_fp8)
    float* o_scale_inv = nullptr;    // written 1/scale_o
    float *amax_s = nullptr, *amax_o = nullptr;
  };
  struct Fp8Backward {
    AttentionShape shape;
    Fp8Format qkv = Fp8Format::e4m3, o_format = Fp8Format::e4m3, dout_format = Fp8Format::e5m2, grads = Fp8Format::e5m2;
    bool token_major = false;
    double scale = 1.0;
    const uint8_t *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *dout = nullptr;
    const float* lse = nullptr;
    uint8_t *dq = nullptr, *dk = nullptr, *dv = nullptr;
    const float *descale_q = nullptr, *descale_k = nullptr, *descale_v = nullptr, *descale_o = nullptr,
                *descale_dout = nullptr;
    const float *scale_ds = nullptr, *descale_ds = nullptr;
    const float *scale_dq = nullptr, *scale_dk = nullptr, *scale_dv = nullptr;
    float *dq_scale_inv = nullptr, *dk_scale_inv = nullptr, *dv_scale_inv = nullptr;  // written
    float *amax_ds = nullptr, *amax_dq = nullptr, *amax_dk = nullptr, *amax_dv = nullptr;
  };
  void forward_fp8(const Fp8Forward& a);
  void backward_fp8(const Fp8Backward& a);
  // "" when cuDNN runs FP8 attention of this shape and these types here (both plans built and
  // cached), else why not.
  std::string fp8_unsupported_reason(const Fp8Forward& f, const Fp8Backward& b);

  // How often the buffers this class hands cuDNN and its kernels (the staging and delta buffers)
  // were reallocated: a captured graph holding the old addresses must not run again.
  uint64_t reallocations() const;

 private:
  struct Cudnn;  // the handle, the plan cache, the staging buffers (attention_cudnn.h)
  enum class Direction { forward, backward, backward_deterministic, forward_fp8, backward_fp8 };
  CudnnPlan& bf16_plan(const AttentionShape& s, Direction d);
  // At a forward's call: the matching backward's plan started on the helper thread. The forward
  // holds the returned PrefetchWait, which waits for that build when the call returns (or
  // throws): both compilations overlap inside the forward, and no helper thread outlives the
  // call — one still compiling when a process exits races cuDNN's teardown of its own state
  // (a segfault at exit, e.g. after a refused FP8 call).
  struct PrefetchWait {
    std::shared_future<void> done;  // invalid: nothing was started
    ~PrefetchWait() {
      if (done.valid()) done.wait();  // errors stay in the future: plan() rethrows them
    }
  };
  PrefetchWait prefetch_backward(const AttentionShape& s);
  PrefetchWait prefetch_fp8_backward(const Fp8Forward& a);
  CudnnPlan& fp8_forward_plan(const Fp8Forward& a);
  CudnnPlan& fp8_backward_plan(const Fp8Backward& a);
  // True when cuDNN should run this call; false means the reference kernel.
  bool use_cudnn(const AttentionShape& s, Direction d);
  // The shape of each call a backward of `s` runs as: `s`, or with a dP bound that it exceeds,
  // [1, pairs a call, L, D] (deterministic backward only).
  AttentionShape backward_call_shape(const AttentionShape& s) const;
  void backward_call(void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k, const void* v,
                     const void* o, const float* lse, bool bf16, const AttentionShape& s, double scale);
  void* delta_scratch(size_t bytes);

  cudaStream_t stream_;
  bool deterministic_;  // the BF16 backward: cuDNN's deterministic one (the FP8 backward has one kind)
  uint64_t dp_limit_bytes_;
  BufferHooks hooks_;
  std::unique_ptr<Cudnn> cudnn_;
  void* delta_ = nullptr;
  size_t delta_bytes_ = 0;
  uint64_t delta_moves_ = 0;
};

std::unique_ptr<Attention> make_attention(cudaStream_t stream, bool deterministic, uint64_t dp_limit_bytes = 0,
                                          BufferHooks hooks = {});

}  // namespace flux8::cuda
