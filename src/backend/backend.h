#pragma once
// The op interface. The Flux model is written once against this class; a backend (CPU
// reference, CUDA) implements it. Model code never branches on the backend.
//
// Conventions every implementation follows (the conformance tests check them):
// - Shapes are given by the tensors; an op checks them and fails naming the op and tensors.
// - Within one call all tensors share one dtype: f32 (or f64 on the CPU backend, used by the
//   finite-difference gradient checks). Saved statistics (mean, rstd, lse) use that dtype.
//   One exception: a backend whose activation_dtype() is bf16 (the CUDA backend with
//   bf16_activations) takes the ACTIVATION arguments of the ops below — inputs, outputs and
//   input gradients, named per op — in bf16, all of one call in the same type, while
//   parameters (w, b, scale), parameter gradients and statistics stay in the compute dtype
//   (parameter gradients: in gradient_dtype(), which is bf16 with bf16_grads).
//   Kernels compute in f32 and round each stored value to nearest even: the values the CPU
//   backend gives with round_activations_to_bf16 (up to summation order).
// - Outputs are overwritten, except: parameter gradients (dw, db, dscale) are ACCUMULATED
//   (+=) so that micro-batches and repeated uses of a parameter sum — or overwritten where
//   the op has a flag for it (linear_backward's accumulate_params, Quantize's
//   column_sums_accumulate, gemm_fp8_tn's accumulate): a step's first write of a gradient
//   (ParamStore::first_write) needs no zero-filled buffer; input gradients are
//   accumulated when the op's `accumulate` flag is set (residual streams).
// - Any gradient output may be an undefined Tensor, meaning "not needed"; it is skipped.
// - Tensors may be column windows (ld > cols) where the comment says "any ld".
// - Batched activations are rank 3 [B, L, C]; "per sample" vectors (shift, scale, gate) are
//   [B, C] with any ld, so they can be column windows of one modulation output [B, 6H].
// - With bf16 activation rounding on (BackendOptions), every activation or input-gradient
//   output is rounded to the nearest bf16 value, as the GPU stores them; statistics and
//   parameter gradients stay at full precision, and the generic fill/copy/add/accumulate
//   never round (they also serve parameter and gradient buffers).
// - Statistics (mean, rstd, lse) may be passed flat: any contiguous tensor of the stated size.
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "fp8/meta.h"
#include "fp8/qtensor.h"

namespace flux8 {

class Config;

struct BackendOptions {
  bool round_activations_to_bf16 = false;  // CPU: emulate the GPU's bf16 activation storage
  int threads = 0;                         // CPU: 0 = OpenMP default
  // CUDA: the non-FP8 GEMMs (linear, linear_backward) round their operands to bf16 and
  // accumulate in fp32 on the tensor cores (gemm_precision: bf16); false = exact f32 GEMMs.
  bool bf16_gemm = false;
  // CUDA: activations stored in bf16 (activation_dtype()); their GEMMs then run on bf16
  // operands whatever bf16_gemm says (the operands are bf16 already).
  bool bf16_activations = false;
  // CUDA: parameter gradients stored in bf16 (gradient_dtype(), grad_precision: bf16).
  bool bf16_grads = false;
  // CUDA: cuDNN's deterministic attention backward (deterministic_attention: true, the default;
  // false: its faster backward, whose dq sums with atomics in a varying order). The CPU always
  // repeats bit for bit.
  bool deterministic_attention = true;

  // From the config keys threads, round_activations_to_bf16, gemm_precision,
  // activation_precision, grad_precision and deterministic_attention (which
  // FLUX8_ATTENTION_DETERMINISTIC=0 or 1 overrides).
  static BackendOptions from_config(const Config& cfg);
};

// Memory handed out by allocate() (parameters, gradients, moments, arenas, buffers).
struct MemoryUse {
  size_t allocated = 0, peak_allocated = 0;
  size_t device_used = 0;  // CUDA: all device memory in use (context and library workspaces too)
};

// The device's energy counter, power limit and clock, where the backend can read them (CUDA:
// NVML, the driver's management library). A step's energy is the difference of two readings;
// `available` false (with `why`) elsewhere.
struct PowerReading {
  bool available = false;
  std::string why;               // when not available
  double energy_j = 0;           // since the driver loaded (monotonic): use differences
  double power_limit_w = 0;      // the limit the driver enforces
  double sm_clock_mhz = 0;       // at the time of reading
  uint64_t clock_reasons = 0;    // what holds the clock back: NVML's clocks-event reason bits
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual const BackendOptions& options() const = 0;

  // ---- memory -----------------------------------------------------------------------
  virtual void* allocate(size_t bytes) = 0;  // 256-byte aligned, zero-filled
  virtual void release(void* p) = 0;  // after the work queued so far (which may still use p)
  virtual void upload(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void download(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void synchronize() {}
  virtual MemoryUse memory_use() const { return memory_; }
  // The device's energy counter and clock now (see PowerReading): not available on the CPU.
  virtual PowerReading power_reading() { return PowerReading{.why = name() + " backend: no energy counter"}; }

  // ---- a second queue: uploads from another host thread beside the ops -------------------
  // The trainer builds and uploads micro-batch k + 1 on a thread of its own while the device
  // computes k (train/batch_pipeline.h). The copies go to a CopyQueue; Events order the two
  // queues without the host waiting: record_event(e) marks the point the ops queued so far
  // reach, CopyQueue::wait_event(e) holds the queue's later copies until then (the slot being
  // refilled is no longer read), and the reverse pair holds the ops until the copies are in.
  // A backend whose ops are done when they return (the CPU) has trivial events and a queue
  // that copies before upload() returns (asynchronous() false).
  class Event {
   public:
    virtual ~Event() = default;
  };
  class CopyQueue {
   public:
    virtual ~CopyQueue() = default;
    // Host -> backend memory, after what the queue waits for; host_src may be reused once
    // upload() returns. Called from one host thread at a time (any thread).
    virtual void upload(void* dst, const void* host_src, size_t bytes) = 0;
    virtual void record_event(Event& e) = 0;      // after the copies queued so far
    virtual void wait_event(const Event& e) = 0;  // later copies start after e's point
    // True when the copies run beside the backend's ops (a CUDA copy stream).
    virtual bool asynchronous() const = 0;
  };
  virtual std::unique_ptr<Event> make_event() = 0;
  virtual std::unique_ptr<CopyQueue> make_copy_queue() = 0;
  virtual void record_event(Event& e) = 0;      // after the ops queued so far
  virtual void wait_event(const Event& e) = 0;  // ops queued later start after e's point

  // True when the ops run on a device of their own and the host's cores are free while they
  // run (CUDA): the trainer then writes checkpoints behind training (async_save: auto). False
  // where the host's cores are the ones that compute (the CPU backend).
  virtual bool computes_beside_host() const { return false; }
  virtual bool attention_backward_repeats() const { return true; }  // bit for bit, run after run

  // ---- device timing (flux8 bench --profile) ---------------------------------------------
  // timing_mark() records the point the backend's queued work has reached (on the GPU an event
  // in its stream: nothing waits) and returns its handle; after synchronize(),
  // timing_elapsed_ms(a, b) is the device time from mark a to mark b. Marks stay valid until
  // release_timing_marks(). The default, for a backend whose ops are done when they return
  // (the CPU), reads the host clock.
  virtual int64_t timing_mark();
  virtual double timing_elapsed_ms(int64_t from, int64_t to);
  virtual void release_timing_marks();

  // The element type a model stores activations and their gradients in when it computes in
  // `compute`: `compute` itself, or bf16 (CUDA backend, bf16_activations, compute f32).
  virtual DType activation_dtype(DType compute) const { return compute; }
  // The type linear/linear_backward run their GEMM operands in when the model computes in
  // `compute`: `compute` itself, or bf16 (CUDA backend with bf16 activations or bf16_gemm). A
  // weight `w` may be passed in this type as well as in `compute` — the rounded copy a model
  // keeps per optimizer step (ParamStore::operand), which the op would otherwise make per call.
  virtual DType weight_operand_dtype(DType compute) const { return compute; }
  // The element type of the parameter gradients (ParamStore's gradient buffer) of a model that
  // computes in `compute`: `compute` itself, or bf16 (CUDA backend, bf16_grads, compute f32).
  // The ops that write parameter gradients (linear_backward's dw and db, gemm_fp8_tn's c,
  // Quantize::column_sums, the QK-norm backward's dscale) then take them in that type — each
  // stored value the f32 (or double) sum rounded to nearest even, with += read back from bf16 —
  // and gradient_sum_squares and adamw read them in it.
  virtual DType gradient_dtype(DType compute) const { return compute; }

  // ---- elementwise / copies (same shape [rows, cols]; any ld) --------------------------
  // Activations: every tensor (all of one type); copy() also converts, y's type from x's.
  virtual void fill(Tensor y, double value) = 0;
  // y[i] = scale·N(0, 1) or scale·U(−1, 1) for every element i of the contiguous y, drawn from
  // (seed, stream, i) by core/rng.h's counter-based generator, in double, rounded to y's type:
  // the value depends on nothing else (thread count, backend). Parameter initialisation on the
  // device. Uniform values are the same bits everywhere; normal ones go through logf/cosf,
  // whose last bit may differ between the host's libm and the GPU (then 1 ulp of f32).
  enum class Random : uint8_t { normal, uniform };
  virtual void fill_random(Tensor y, Random dist, uint64_t seed, uint64_t stream, double scale) = 0;
  virtual void copy(Tensor y, Tensor x) = 0;
  // copy() of every pair, in one pass where the backend can (the CUDA backend: one launch a
  // batch). For many small copies — the low-rank gradient factors' rows, a few a Linear — whose
  // launches cost more than their bytes. No pair's y may overlap another pair's x or y.
  struct CopyPair {
    Tensor y, x;
  };
  virtual void copy_batch(std::span<const CopyPair> pairs);
  virtual void add(Tensor y, Tensor a, Tensor b) = 0;  // y = a + b
  virtual void accumulate(Tensor y, Tensor x) = 0;     // y += x

  // ---- linear: y[N,M] = x[N,K] · w[M,K]ᵀ + b[M] (b may be undefined). x, y any ld. -----
  // b is f32, or — for a bf16 y, on a backend whose weight_operand_dtype is bf16 — the model's
  // bf16 copy of it (ParamStore::bias_operand), which the GEMM's epilogue adds as it is (so does
  // linear_gelu's, and gemm_fp8_tn's for a bf16 c).
  virtual void linear(Tensor y, Tensor x, Tensor w, Tensor b) = 0;
  // dx[N,K] = dy·w (+= if accumulate_dx); dw[M,K] += dyᵀ·x; db[M] += Σ_rows dy (dw and db
  // overwritten instead when accumulate_params is false: their old contents are never read).
  virtual void linear_backward(Tensor dx, Tensor dw, Tensor db, Tensor dy, Tensor x, Tensor w,
                               bool accumulate_dx, bool accumulate_params) = 0;
  // A Linear whose last output columns go through GELU (an MLP's first layer; the single
  // block's linear1, whose MLP part follows q, k, v), the GELU in the GEMM's epilogue where the
  // backend has one: h[N,M] = x·wᵀ + b (kept for the backward) and y[N,My] = gelu_tanh of h's
  // last My columns (My = M: all of them). Fused, both round once from the same sum — y is the
  // GELU of the unrounded value, so with bf16 activations it may differ by an ulp from
  // gelu_tanh() of the stored h (the CPU reference computes it so); where a backend cannot fuse
  // a call it takes the GELU of the stored h. Activations: y, h, x. Any ld.
  virtual void linear_gelu(Tensor y, Tensor h, Tensor x, Tensor w, Tensor b) = 0;
  // The input gradient of a Linear whose input was [x₀ | gelu_tanh(h)] (h the last Kh of its K
  // columns), the GELU's derivative in the GEMM's epilogue where the backend has one: with
  // P = dy·w [N,K], dx = P's first K−Kh columns (undefined when Kh = K) and dh = gelu_tanh'(h) ⊙
  // P's last Kh columns, both overwritten; fused (and on the CPU) each rounds once, P is not
  // rounded before the derivative multiplies it (unfused: the stored P). The weight and bias
  // gradients are linear_backward's (with dx undefined). Activations: dx, dh, dy, h. Any ld.
  virtual void linear_dgrad_gelu(Tensor dx, Tensor dh, Tensor dy, Tensor w, Tensor h) = 0;

  // ---- activations (any ld) -----------------------------------------------------------
  virtual void silu(Tensor y, Tensor x) = 0;  // x·σ(x)
  virtual void silu_backward(Tensor dx, Tensor dy, Tensor x, bool accumulate_dx) = 0;
  // GELU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
  virtual void gelu_tanh(Tensor y, Tensor x) = 0;
  virtual void gelu_tanh_backward(Tensor dx, Tensor dy, Tensor x) = 0;

  // ---- modulated LayerNorm (no affine) over the last dim of x [B, L, H] ----------------
  //   y = (1 + scale[b])·(x − μ)·rstd + shift[b],  rstd = 1/√(var + eps)  (biased var)
  // mean, rstd: [B·L] saved for the backward. shift, scale: [B, H] any ld. y may be undefined:
  // then only mean and rstd are computed (a fused cast, quantize_fused, makes y on the fly).
  virtual void layernorm_modulate(Tensor y, Tensor mean, Tensor rstd, Tensor x, Tensor shift,
                                  Tensor scale, double eps) = 0;
  // dx (+= if accumulate_dx), dshift = Σ_l dy, dscale = Σ_l dy·x̂ (both [B, H], overwritten).
  virtual void layernorm_modulate_backward(Tensor dx, Tensor dshift, Tensor dscale, Tensor dy,
                                           Tensor x, Tensor mean, Tensor rstd, Tensor scale,
                                           bool accumulate_dx) = 0;

  // ---- QK-norm: RMSNorm of every D-wide head segment of x [rows, n·D] (any ld) ---------
  //   y = x / √(mean(x²) + eps) · scale[D];  rstd [rows·n] saved. D = scale.numel().
  virtual void rmsnorm_heads(Tensor y, Tensor rstd, Tensor x, Tensor scale, double eps) = 0;
  // dx overwritten; dscale[D] accumulated.
  virtual void rmsnorm_heads_backward(Tensor dx, Tensor dscale, Tensor dy, Tensor x, Tensor rstd,
                                      Tensor scale) = 0;

  // ---- layout: token-major [B, Ls, n·D] (any ld) <-> head-major [B, n, L, D] ----------
  // heads[b, h, offset + l, :] = tokens[b, l, h·D : (h+1)·D], for l < Ls.
  virtual void tokens_to_heads(Tensor heads, Tensor tokens, int64_t token_offset) = 0;
  virtual void heads_to_tokens(Tensor tokens, Tensor heads, int64_t token_offset) = 0;

  // ---- rotary position embedding --------------------------------------------------------
  // ids [B, L, 3] positions; pe [B, L, D/2, 2] = (cos, sin) of pos_i·θ^(−2k/d_i) for axis i
  // of width d_i (axes concatenated in order), computed in double precision.
  virtual void rope_table(Tensor pe, Tensor ids, std::span<const int> axes_dim, double theta) = 0;
  // x [B, n, L, D] in place: each adjacent pair (2p, 2p+1) rotated by [[c, −s], [s, c]];
  // inverse = true rotates by the opposite angle, which is exactly the backward.
  virtual void rope(Tensor x, Tensor pe, bool inverse) = 0;

  // ---- attention inputs: QK-norm + RoPE + head-major layout of one stream, fused -------
  // q, k, v [B, Ls, n·D] (any ld: column windows of the qkv Linear's output) are one stream
  // of the joint sequence, at positions token_offset .. token_offset + Ls of the head-major
  // q_heads, k_heads, v_heads [B, n, L, D]; pe is the joint table of rope(). Equal to
  //   rmsnorm_heads(q) → tokens_to_heads → rope, the same for k, and tokens_to_heads(v)
  // (bit for bit on the CPU backend): q_heads[b, h, token_offset + l] = rope at that joint
  // position of (RMSNorm of q[b, l, h·D : (h+1)·D]) · q_scale. q_rstd, k_rstd [B·Ls·n] as
  // rmsnorm_heads saves them; either may be undefined (not saved: a recomputation). D even
  // (RoPE pairs); the CUDA backend takes D ≤ 512.
  virtual void qk_norm_rope_to_heads(Tensor q_heads, Tensor k_heads, Tensor v_heads, Tensor q_rstd, Tensor k_rstd,
                                     Tensor q, Tensor k, Tensor v, Tensor q_scale, Tensor k_scale, Tensor pe,
                                     int64_t token_offset, double eps) = 0;
  // Backward, from dq_heads, dk_heads, dv_heads (gradients of the joint q_heads, k_heads,
  // v_heads), the forward's pre-norm q, k and statistics: dq, dk, dv [B, Ls, n·D] (any ld)
  // overwritten; dq_scale, dk_scale [D] accumulated. Equal to rope(inverse) → heads_to_tokens →
  // rmsnorm_heads_backward, and heads_to_tokens(dv_heads).
  virtual void qk_norm_rope_to_heads_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dq_scale, Tensor dk_scale,
                                              Tensor dq_heads, Tensor dk_heads, Tensor dv_heads, Tensor q, Tensor k,
                                              Tensor q_rstd, Tensor k_rstd, Tensor q_scale, Tensor k_scale, Tensor pe,
                                              int64_t token_offset) = 0;

  // ---- attention: q, k, v, o [B, n, L, D]; non-causal, no mask -------------------------
  //   o = softmax(q·kᵀ·scale)·v;  lse [B, n, L] = log Σ_j exp(q·k_j·scale) saved.
  // The element type a model stores its attention heads in (q, k, v, o, their gradients and
  // dO; written by qk_norm_rope_to_heads and tokens_to_heads, read by heads_to_tokens): the
  // activation type, or bf16 where this backend's attention computes on bf16 heads anyway (the
  // CUDA backend's cuDNN path), so no conversion passes run and the results are the same bits
  // (should cuDNN refuse a shape when it builds the plan, the reference kernel then computes on
  // the bf16 values).
  virtual DType attention_heads_dtype(DType activations, int64_t head_dim) const { return activations; }
  virtual void attention(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, double scale) = 0;
  // dq, dk, dv overwritten.
  virtual void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                                  Tensor v, Tensor o, Tensor lse, double scale) = 0;

  // ---- gated residual: out[B, L, H] = x + gate[b] ⊙ y[B, L, H]; gate [B, H] any ld -----
  // out may be x (in place) or a separate tensor of x's shape: the blocks write their residual
  // stream out of place, so the block input stays saved for the backward without a copy.
  virtual void gated_residual(Tensor out, Tensor x, Tensor y, Tensor gate) = 0;
  // gated_residual's out (not in place), then the row statistics layernorm_modulate computes of
  // the stored out into mean, rstd [B, L] (any ld; the statistics' type): those of the LayerNorm
  // that reads out next, which then need not read it again (in FP8 that LayerNorm runs inside
  // its Linear's input cast and computes nothing but them). A window of a wider [B, L'] takes
  // one stream's rows of the joint sequence. The default runs the two ops; a backend may fuse.
  virtual void gated_residual_stats(Tensor out, Tensor mean, Tensor rstd, Tensor x, Tensor y, Tensor gate,
                                    double eps);
  // dy = gate[b] ⊙ dx; dgate[b] = Σ_l dx ⊙ y (overwritten).
  virtual void gated_residual_backward(Tensor dy, Tensor dgate, Tensor dx, Tensor y,
                                       Tensor gate) = 0;

  // ---- sinusoidal embedding: out [B, dim], t [B] ---------------------------------------
  //   t' = time_factor·t;  f_k = exp(−ln(max_period)·k/(dim/2));  out = [cos(t'f), sin(t'f)]
  // Evaluated in double precision, then stored (the reference's f32 evaluation loses ~1e-4 at
  // arguments near 10³).
  virtual void timestep_embedding(Tensor out, Tensor t, double time_factor, double max_period) = 0;

  // ---- joint sequence: out [B, La+Lb, C] = per-sample cat(a [B, La, C], b [B, Lb, C]) ---
  virtual void concat_tokens(Tensor out, Tensor a, Tensor b) = 0;
  // Inverse; a or b may be undefined (skipped).
  virtual void split_tokens(Tensor a, Tensor b, Tensor in) = 0;

  // ---- training objective and optimizer (contiguous tensors) ---------------------------
  // Rectified flow: for sample b of x0 [B, ...], ε[b, i] = rng_normal(seed, streams[b], i),
  //   xt = (1 − t[b])·x0 + t[b]·ε,  target = ε − x0.
  // The noise depends only on (seed, stream, element): the same on every backend.
  virtual void flow_match_inputs(Tensor xt, Tensor target, Tensor x0, Tensor t, uint64_t seed,
                                 std::span<const uint64_t> streams) = 0;
  // Returns mean((pred − target)²) over all elements, accumulated in double; writes
  // dpred = grad_scale · 2(pred − target)/numel.
  virtual double mse_loss(Tensor dpred, Tensor pred, Tensor target, double grad_scale) = 0;
  // mse_loss with the mean written to `loss` — a contiguous one-element f64 tensor in backend
  // memory, whatever the other tensors' type — instead of returned: nothing waits for the device,
  // so a training step reads its micro-batches' losses once, after the backward, and the loss can
  // be part of a captured graph (backend/step_graph.h). The same value mse_loss returns. The
  // default runs mse_loss and uploads its result.
  virtual void mse_loss_into(Tensor loss, Tensor dpred, Tensor pred, Tensor target, double grad_scale);
  // Σ x² in double, summed in a fixed order (independent of thread count). NaN/inf propagate.
  virtual double sum_squares(Tensor x) = 0;
  // A weight gradient kept as factors instead of in the flat gradient buffer (ParamStore's
  // low-rank gradients: a Linear that sees one row per sample, such as the modulation Linears,
  // has the gradient Σ_r dy_r ⊗ x_r of a step's few rows). For the parameters
  // [offset, offset + M·K), read as the row-major [M, K] weight:
  //   g[m, k] = Σ_{r < R} a[r, m]·b[r, k]     a [R, M], b [R, K]: contiguous f32, R ≥ 1
  // each product and sum rounded on its own in f32, r = 0, 1, ... in order: the same bits on
  // every backend. Writing g costs 4 bytes a parameter, and the norm and AdamW each read them
  // again; from the factors nobody does (the norm takes them from the factors' Gram matrices).
  struct LowRankGrad {
    int64_t offset = 0;
    Tensor a, b;
    int64_t rank() const { return a.shape[0]; }
    int64_t size() const { return a.shape[1] * b.shape[1]; }  // M·K
    int64_t end() const { return offset + size(); }
  };
  // Σ g² over the flat gradients `grads` in double, where each `low_rank` range adds the squared
  // norm of its gradient from the factors' Gram matrices instead of its elements,
  //   ‖Σ_r a_r ⊗ b_r‖² = Σ_{r,s} (a_r·a_s)(b_r·b_s)      (dot products in double)
  // — the norm of the gradient before its elements are rounded to f32 (within ~1e-7 of theirs),
  // in R²(M + K) operations instead of M·K. The contents of `grads` at those ranges are never
  // read. Without low-rank ranges it is sum_squares(grads).
  virtual double gradient_sum_squares(Tensor grads, std::span<const LowRankGrad> low_rank) = 0;
  // AdamW (decoupled weight decay), elementwise over flat param/grad/m/v, computed in the
  // parameters' precision (fp32 in training; fp64 in gradient checks):
  //   g = grad_scale·grad;  m = β1·m + (1−β1)·g;  v = β2·v + (1−β2)·g²
  //   p = p·decay − (step_size·m) / (√v + eps_hat)
  // with the per-step constants of adamw_constants (in double, then rounded to the precision).
  // This is the bias-corrected update lr·m̂ / (√v̂ + eps) of PyTorch's AdamW with both bias
  // corrections folded into the constants (Kingma & Ba's "more efficient" order): multiplying
  // numerator and denominator by √(1 − β2^step) leaves the value exact and saves a division an
  // element, which the memory-bound GPU kernel is partly issue-bound on.
  // The moments m and v are in the parameters' type, or both bf16 with f32 parameters
  // (adam_moment_precision: bf16): read widened, updated in f32 as above (p from the unrounded
  // m, v), stored rounded stochastically — f32_to_bf16_bits_stochastic with the bits of
  // adamw_pair_noise for (step, flat index / 2), a byte for each of the pair's m and v
  // (core/stochastic_rounding.h) — the same bits on every backend.
  struct AdamW {
    double lr, beta1, beta2, eps, weight_decay, grad_scale;
    int64_t step;  // 1-based
  };
  struct AdamWConstants {
    double decay;      // 1 − lr·wd
    double step_size;  // lr·√(1 − β2^step) / (1 − β1^step)
    double eps_hat;    // eps·√(1 − β2^step)
  };
  static AdamWConstants adamw_constants(const AdamW& h) {
    const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
    const double bc2_sqrt = std::sqrt(1.0 - std::pow(h.beta2, static_cast<double>(h.step)));
    return {1.0 - h.lr * h.weight_decay, h.lr * bc2_sqrt / bc1, h.eps * bc2_sqrt};
  }
  // A bf16 copy of the parameters [offset, offset + copy.numel()) of the flat f32 buffer (a
  // Linear's weight operand, ParamStore::operand), written by adamw with the new values rounded
  // to nearest even: the update already holds them, where a later conversion pass would read
  // the 4-byte parameters again.
  struct ParamCopy {
    int64_t offset = 0;
    Tensor copy;  // contiguous bf16
  };
  // A per-tensor FP8 cast of the parameters [offset, offset + codes.numel()) (a Linear's weight,
  // row-major [codes.rows, codes.cols]) written by adamw from the new values exactly as
  // quantize() casts them with a delayed scale (Quantize::delayed_scale = scale, amax): the codes
  // of x·*scale, codes.scale_inv[0] = 1/*scale, the amax max-accumulated into *amax; no
  // telemetry counts. `scale` and `amax` point into this backend's memory. With the delayed
  // recipe the next step's scale is known when the optimizer runs, so the weights' casts need
  // not read the 4-byte parameters again (transpose_codes makes their columnwise copy).
  struct ParamCast {
    int64_t offset = 0;
    QTensor codes;  // per_tensor
    const float* scale = nullptr;
    float* amax = nullptr;
  };
  // `low_rank`: ranges whose gradient comes from their factors, as gradient_sum_squares reads
  // it (`grad` is not read there).
  virtual void adamw(Tensor param, Tensor grad, Tensor m, Tensor v, const AdamW& h,
                     std::span<const ParamCopy> copies, std::span<const ParamCast> casts,
                     std::span<const LowRankGrad> low_rank) = 0;

  // ---- FP8 (src/fp8: recipe math and the CPU reference quantizers) ---------------------
  // How to cast one GEMM operand. Per-tensor scaling takes its scale from `delayed_scale`
  // (delayed recipe: the registry's scale, computed from past steps) or, when that is null,
  // from this tensor's amax (tensorwise/current scaling). Blockwise and MX scales always come
  // from the block. `delayed_scale` and `amax` point into this backend's memory (device memory
  // on the GPU: the scale is read and the amax written in stream order, never by the host).
  // The cast's amax is max-accumulated into *amax (the registry's staging row) and its counts
  // are merged into *stats (host memory) when given. A backend may deliver the counts late (the
  // CUDA backend keeps them on the device until the next synchronize() or download()): the
  // target must outlive the cast and is current after synchronize().
  struct Quantize {
    Fp8Format format = Fp8Format::e4m3;
    Fp8Scaling scaling = Fp8Scaling::per_tensor;
    bool pow2 = false;                     // current/blockwise scales rounded down to 2^k
    const float* delayed_scale = nullptr;  // backend memory
    float* amax = nullptr;                 // backend memory
    CastStats* stats = nullptr;            // host memory
    // Defined: column_sums[c] += Σ_r x[r, c] — the bias gradient of the Linear whose output
    // gradient x is, summed in the pass that casts it (contiguous vector of cols(x) in
    // gradient_dtype(f32): f32, or bf16);
    // = instead of += when column_sums_accumulate is false (old contents never read).
    Tensor column_sums;
    bool column_sums_accumulate = true;
  };
  // x [rows, cols] (any ld) -> `rowwise` [rows, cols] and/or `columnwise` [cols, rows] (the
  // quantized transpose: xᵀ's blocks run along x's columns); either may be undefined. With
  // per-tensor scaling both copies share one scale; 128x128 tiles transpose with their scales.
  virtual void quantize(QTensor rowwise, QTensor columnwise, Tensor x, const Quantize& q) = 0;
  // dst [cols, rows] = src [rows, cols] transposed, codes and (per-tensor) scale_inv: the
  // columnwise copy of a weight whose rowwise cast adamw wrote (ParamCast).
  virtual void transpose_codes(QTensor dst, const QTensor& src) = 0;
  // The input of a fused cast: the element-wise op that produces the tensor to cast, so the
  // tensor between the op and the cast is never stored. identity: x itself; gelu_tanh:
  // gelu_tanh(x); layernorm_modulate: layernorm_modulate's y from x [B, L, H], the mean and
  // rstd it computed (with y undefined) and shift, scale [B, H]; gelu_tanh_backward:
  // gelu_tanh_backward's dx from x = dy and gelu_x, the GELU's input (same shape); gated: the
  // gated residual's branch gradient gated_residual_backward's dy = gate[b] ⊙ x from x = the
  // residual's gradient [B, L, H] and gate [B, H].
  // With a head the tensor cast is [head | op(x)]: head's columns as they are, then the op's
  // (the single block's two-source tensors — linear2's input [attention output | GELU(h)] and
  // linear1's output gradient [dq dk dv | GELU's backward] — cast without being assembled).
  struct CastInput {
    enum class Op : uint8_t { identity, gelu_tanh, layernorm_modulate, gelu_tanh_backward, gated };
    Op op = Op::identity;
    Tensor x;
    Tensor mean, rstd, shift, scale;  // layernorm_modulate only
    double eps = 0.0;                 // layernorm_modulate: the eps mean/rstd were made with
    // layernorm_modulate: mean and rstd already hold x's statistics (gated_residual_stats wrote
    // them with x): the model need not compute them before the cast. Backends ignore it.
    bool statistics_ready = false;
    Tensor gelu_x;                    // gelu_tanh_backward only
    Tensor gate;                      // gated only
    Tensor head;                      // optional: the first columns, x's rows and dtype, any ld

    // The cast tensor's columns and shape (x's, widened by the head's columns).
    int64_t head_cols() const { return head.defined() ? head.cols() : 0; }
    int64_t cols() const { return head_cols() + x.cols(); }
    Shape shape() const {
      Shape s = x.shape;
      if (s.rank > 0) s.d[static_cast<size_t>(s.rank - 1)] = cols();
      return s;
    }
    CastInput with_head(Tensor h) const {
      CastInput in = *this;
      in.head = h;
      return in;
    }

    static CastInput gelu_tanh_of(Tensor x) {
      CastInput in;
      in.op = Op::gelu_tanh;
      in.x = x;
      return in;
    }
    static CastInput gelu_tanh_backward_of(Tensor dy, Tensor gelu_x) {
      CastInput in;
      in.op = Op::gelu_tanh_backward;
      in.x = dy, in.gelu_x = gelu_x;
      return in;
    }
    static CastInput gated_of(Tensor dx, Tensor gate) {
      CastInput in;
      in.op = Op::gated;
      in.x = dx, in.gate = gate;
      return in;
    }
    static CastInput layernorm_modulate_of(Tensor x, Tensor mean, Tensor rstd, Tensor shift, Tensor scale,
                                           double eps) {
      CastInput in;
      in.op = Op::layernorm_modulate;
      in.x = x, in.mean = mean, in.rstd = rstd, in.shift = shift, in.scale = scale, in.eps = eps;
      return in;
    }
  };
  // quantize() of the op's output, which must give the same codes, scales and statistics as
  // running the op (produce()) and then quantize() on this backend — with bf16 activations too:
  // the op's output is rounded to bf16 as storing it would, then cast. The default does just that,
  // through a temporary; the CUDA backend computes the op inside the cast kernel.
  virtual void quantize_fused(QTensor rowwise, QTensor columnwise, const CastInput& in, const Quantize& q);
  // Writes the op's output to y (the unfused path, and the reference of quantize_fused): y has
  // in.shape(); a head that already is y's first columns (same memory) is left in place, and so
  // is an identity input that already is y.
  void produce(Tensor y, const CastInput& in);

  // The delayed-scaling update of every tensor of a model in one pass (one launch on the GPU),
  // over the registry's flat buffers in backend memory (fp8/meta.h): amax_history [L, n]
  // (history-major; row 0 is the step's staged, already all-reduced amax), scale, scale_inv
  // and fp8_max [n] (the largest finite value of each slot's format). delayed_update_slot() in
  // fp8/recipe.h per slot: bit-equal on every backend.
  virtual void delayed_scaling_update(Tensor amax_history, Tensor scale, Tensor scale_inv, Tensor fp8_max,
                                      AmaxAlgo algo, int margin) = 0;

  // y = x dequantized (per-tensor scaling): y[r, c] = decode(x.codes[r, c])·x.scale_inv[0], in
  // y's type (f32, or bf16 rounded to nearest even); y [x.rows, x.cols] any ld, or any shape
  // with those rows and cols.
  virtual void dequantize(Tensor y, const QTensor& x) = 0;

  // ---- FP8 attention (fp8_dot_product_attention: cuDNN's FP8 flash attention) -----------
  // q, k, v, o and (backward) dout, dq, dk, dv are per-tensor FP8 casts of [B, n, L, D]
  // head-major tensors: QTensors of B·n·L rows and D columns, `heads` = [B, n, L, D]; q, k, v
  // share one format. The softmax P and the scores' gradient dS are cast inside the op, P in
  // q's format, dS in dout's, with the delayed scales given. With every FP8 operand taken at
  // its value (code · scale_inv) and f32 sums:
  //   S = q·kᵀ·scale;  lse = log Σ_j exp S_j (f32 [B, n, L]);  P = softmax(S);  P8 = cast(P·s)
  //   O = P8·v;  o = cast(O·scale_o)
  //   δ = rowsum(dO ⊙ O);  dV = P8ᵀ·dO;  dS = P ⊙ (dO·vᵀ − δ)·scale;  dS8 = cast(dS·ds)
  //   dQ = dS8·k;  dK = dS8ᵀ·q;  dq, dk, dv = casts of dQ, dK, dV with scale_dq, _dk, _dv
  // where P in the backward is recomputed from lse, and P's scale s is fixed at the largest value
  // of q's format (448 for E4M3), not a delayed scale: cuDNN's kernels cast exp(S − running max),
  // which is 1 somewhere in every row, not the normalised P, so any larger scale saturates and
  // the format's maximum uses its whole range. The outputs' scale_inv become 1/scale; the
  // amax of P, O, dS, dQ, dK, dV before its cast is max-accumulated into its amax pointer (null:
  // not recorded). Scales and amaxes point into this backend's memory. The CUDA backend runs
  // cuDNN's FP8 graphs (Hopper: head dim 128; an unsupported call is an error saying why).
  struct Fp8AttentionScales {
    const float* o = nullptr;       // forward output
    const float* ds = nullptr;      // dS's scale and its inverse
    const float* ds_inv = nullptr;
    const float* dq = nullptr;      // backward outputs
    const float* dk = nullptr;
    const float* dv = nullptr;
    float* amax_s = nullptr;
    float* amax_o = nullptr;
    float* amax_ds = nullptr;
    float* amax_dq = nullptr;
    float* amax_dk = nullptr;
    float* amax_dv = nullptr;
    // P's fixed scale (above): the largest value of q's format.
    static float p_scale(Fp8Format qkv) { return fp8_max(qkv); }
  };
  virtual void attention_fp8(QTensor o, Tensor lse, const QTensor& q, const QTensor& k, const QTensor& v,
                             Shape heads, double scale, const Fp8AttentionScales& sc) = 0;
  virtual void attention_fp8_backward(QTensor dq, QTensor dk, QTensor dv, const QTensor& dout, const QTensor& q,
                                      const QTensor& k, const QTensor& v, const QTensor& o, Tensor lse, Shape heads,
                                      double scale, const Fp8AttentionScales& sc) = 0;

  // ---- FP8 attention's neighbours: the head-layout ops with FP8 heads ---------------------
  // With FP8 attention the heads exist only as per-tensor casts, QTensor [B·n·L, D] (n·D the
  // token side's width, L the joint length: codes.rows / (B·n)). These ops take or give them in
  // place of heads tensors, so no heads of the activation type are stored and no cast or
  // dequantize pass of their own runs. An FP8 output is exactly quantize(codes, {}, heads, q) of
  // the heads the plain op would write (values of attention_heads_dtype(activations, D)) over the
  // rows this call writes (one stream's): the same codes and scale_inv, the amax max-accumulated
  // into *q.amax and the counts merged into *q.stats as one or more casts of those rows. An FP8
  // input is read as dequantize() into that type gives it. The defaults run just that, through
  // temporaries (the CPU backend; the reference of the CUDA backend's fused kernels).
  struct Fp8Heads {
    QTensor codes;  // per-tensor, [B·n·L, D]
    Quantize q;     // per-tensor, with delayed_scale
  };
  virtual void qk_norm_rope_to_heads_fp8(const Fp8Heads& q_heads, const Fp8Heads& k_heads, const Fp8Heads& v_heads,
                                         Tensor q_rstd, Tensor k_rstd, Tensor q, Tensor k, Tensor v, Tensor q_scale,
                                         Tensor k_scale, Tensor pe, int64_t token_offset, double eps);
  virtual void qk_norm_rope_to_heads_backward_fp8(Tensor dq, Tensor dk, Tensor dv, Tensor dq_scale, Tensor dk_scale,
                                                  const QTensor& dq_heads, const QTensor& dk_heads,
                                                  const QTensor& dv_heads, Tensor q, Tensor k, Tensor q_rstd,
                                                  Tensor k_rstd, Tensor q_scale, Tensor k_scale, Tensor pe,
                                                  int64_t token_offset);
  virtual void tokens_to_heads_fp8(const Fp8Heads& heads, Tensor tokens, int64_t token_offset);
  virtual void heads_to_tokens_fp8(Tensor tokens, const QTensor& heads, int64_t token_offset);

  // c[m, n] (= or += when accumulate) a[m, k] · b[n, k]ᵀ (+ bias[n]): the TN FP8 GEMM. Exact
  // products; the summation order is backend-specific and its precision `sum` (fp32, or the
  // tensor cores' fast accumulation where the backend has it: Fp8Accumulation).
  virtual void gemm_fp8_tn(Tensor c, const QTensor& a, const QTensor& b, Tensor bias, bool accumulate,
                           Fp8Accumulation sum) = 0;

  // ---- graphs: queued work recorded once, launched many times (backend/step_graph.h) -------
  // Between begin_capture() and end_capture() the ops called are recorded into a graph instead of
  // run; launch_graph() then runs that work, with the same pointers and arguments, as often as
  // asked — in one launch, where issuing the ops one by one costs the host more than the device
  // needs for the small ones. A backend without graphs (the CPU) says so in can_capture(), and the
  // others fail. end_capture() ends the capture in every case and returns null when it failed (an
  // op that synchronises or allocates cannot be captured; nothing of the captured work ran); an op
  // that threw during a capture has ended it too.
  class Graph {
   public:
    virtual ~Graph() = default;
  };
  virtual bool can_capture() const { return false; }
  virtual void begin_capture();
  virtual std::unique_ptr<Graph> end_capture();
  virtual void launch_graph(const Graph& g);
  // Changes whenever memory the backend owns and its ops use (scratch buffers, workspaces) is
  // freed or moved: a graph captured before holds the old addresses and must not run again.
  virtual uint64_t capture_generation() const { return 0; }

 protected:
  // Implementations call these from allocate()/release() so memory_use() is known everywhere.
  void track_allocation(void* p, size_t bytes);
  void track_release(void* p);
  MemoryUse memory_;

 private:
  std::unordered_map<void*, size_t> sizes_;
  std::vector<std::chrono::steady_clock::time_point> host_marks_;  // the default timing marks
};

// "cpu" (always available), "cuda" (when built with CUDA and a GPU is present; else an error
// saying why) or "auto" (cuda when it can run here, else cpu).
std::unique_ptr<Backend> make_backend(std::string_view name, const BackendOptions& options = {});

}  // namespace flux8
