#pragma once
// A Backend that runs a training step's forward and backward as CUDA graphs (`cuda_graph: true`).
//
// Why: a forward and backward is a few hundred op calls (134 on W1, 290 on W2 FP8), many of them
// small (the per-sample Linears, the modulation chain, the norms of short sequences), and issuing
// one costs the host 3–15 µs — a cuBLASLt call alone ~10 — so on W2 the GPU waited ~0.6 ms a step
// for launches (`flux8 bench --profile`'s idle row). A graph launch issues tens of ops.
//
// How, without trusting the model code to repeat itself: between begin_region() and end_region()
// every op call is *recorded* — its arguments kept by value (span contents copied) and written
// into a signature: the op, every pointer, shape, stride, scalar and flag. Every `segment_ops`
// calls (and at the region's end, or where something must wait for the device) the segment is
// closed: a signature seen before with a graph is launched as that graph and the fresh record
// dropped; one seen once before is captured (run through the wrapped backend under stream
// capture), instantiated and launched; a new one runs eagerly. Nothing is assumed about the step
// but what its signature shows, so any divergence — a report step's statistics, another shape, a
// checkpoint restore — costs a capture, never a wrong result, and the host state the model code
// keeps (FP8 flags, gradient first-writes, low-rank rows) is what running that code left, as
// without graphs. Segments pipeline: the host records segment k + 1 while the device runs k.
//
// What a graph cannot hold, so the segment runs eagerly: an FP8 cast that counts telemetry
// (Quantize::stats: the counts reach the host through the backend's bookkeeping at issue time),
// a capture that fails (an op that synchronises or allocates: scratch that grows), and any call
// that needs the device's results or memory (download, synchronize, upload, release, the sums
// that return a value) — those close the segment first. A graph is dropped when the wrapped
// backend's capture_generation() moves (its scratch was reallocated).
//
// On a backend without graphs (the CPU) a segment's "graph" is its first record replayed: the
// recorded calls of an earlier step run instead of the fresh ones. That is the CPU twin the tests
// use — any argument missing from the signature would make a replayed step differ from an eager
// one.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/backend.h"

namespace flux8 {

class StepGraph : public Backend {
 public:
  struct Options {
    int segment_ops = 48;         // op calls a segment (a graph) holds at most
    size_t max_segments = 4096;   // distinct signatures kept; beyond, all are dropped and relearnt
    // The defaults, segment_ops from FLUX8_GRAPH_SEGMENT_OPS where set (an empty value counts as
    // unset; anything but a count from 1 to 100000 is an error naming it).
    static Options from_environment();
  };
  explicit StepGraph(Backend& inner) : StepGraph(inner, Options{}) {}
  StepGraph(Backend& inner, Options options);
  ~StepGraph() override;

  Backend& inner() { return be_; }
  const Options& graph_options() const { return options_; }
  // Record the op calls from here to end_region() (regions do not nest).
  void begin_region();
  // Closes the last segment (launching, capturing or running it); the work is queued, not done.
  void end_region();
  bool recording() const { return recording_; }
  // Leaves a region without issuing what it recorded and not yet issued (a step that threw).
  void abandon_region();

  // A region for a scope (null graph: nothing): end() closes it; a scope left by an exception
  // abandons it.
  class Region {
   public:
    explicit Region(StepGraph* g) : g_(g) {
      if (g_) g_->begin_region();
    }
    Region(const Region&) = delete;
    Region& operator=(const Region&) = delete;
    ~Region() {
      if (g_) g_->abandon_region();
    }
    void end() {
      StepGraph* g = std::exchange(g_, nullptr);
      if (g) g->end_region();
    }

   private:
    StepGraph* g_;
  };

  struct Stats {
    int64_t launched = 0;        // segments launched as a graph (or, on the CPU, replayed)
    int64_t captured = 0;        // graphs captured
    int64_t eager = 0;           // segments run op by op (first sightings, uncapturable ones)
    int64_t capture_failed = 0;  // captures that failed (their signatures then stay eager)
    int64_t ops_launched = 0;    // op calls inside launched segments
    int64_t ops_eager = 0;       // op calls run one by one inside regions
  };
  const Stats& stats() const { return stats_; }
  void reset_stats() { stats_ = Stats{}; }
  // The reason of the last failed capture ("" if none failed).
  const std::string& last_capture_failure() const { return last_failure_; }

  // ---- not ops: forwarded (those that must see the queued work close the segment first) ----
  std::string name() const override { return be_.name() + "+graphs"; }
  const BackendOptions& options() const override { return be_.options(); }
  void* allocate(size_t bytes) override { return be_.allocate(bytes); }
  void release(void* p) override;
  void upload(void* dst, const void* src, size_t bytes) override;
  void download(void* dst, const void* src, size_t bytes) override;
  void synchronize() override;
  MemoryUse memory_use() const override { return be_.memory_use(); }
  PowerReading power_reading() override { return be_.power_reading(); }
  std::unique_ptr<Event> make_event() override { return be_.make_event(); }
  std::unique_ptr<CopyQueue> make_copy_queue() override { return be_.make_copy_queue(); }
  void record_event(Event& e) override;
  void wait_event(const Event& e) override;
  int64_t timing_mark() override;
  double timing_elapsed_ms(int64_t from, int64_t to) override { return be_.timing_elapsed_ms(from, to); }
  void release_timing_marks() override { be_.release_timing_marks(); }
  DType activation_dtype(DType compute) const override { return be_.activation_dtype(compute); }
  DType weight_operand_dtype(DType compute) const override { return be_.weight_operand_dtype(compute); }
  DType gradient_dtype(DType compute) const override { return be_.gradient_dtype(compute); }
  DType attention_heads_dtype(DType activations, int64_t head_dim) const override {
    return be_.attention_heads_dtype(activations, head_dim);
  }
  double mse_loss(Tensor dpred, Tensor pred, Tensor target, double grad_scale) override;
  double sum_squares(Tensor x) override;
  double gradient_sum_squares(Tensor grads, std::span<const LowRankGrad> low_rank) override;
  // Graphs of graphs are not offered: the regions are this class's.
  bool can_capture() const override { return false; }

  // ---- ops: recorded inside a region, else forwarded ---------------------------------------
  void fill(Tensor y, double value) override;
  void fill_random(Tensor y, Random dist, uint64_t seed, uint64_t stream, double scale) override;
  void copy(Tensor y, Tensor x) override;
  void copy_batch(std::span<const CopyPair> pairs) override;
  void add(Tensor y, Tensor a, Tensor b) override;
  void accumulate(Tensor y, Tensor x) override;
  void linear(Tensor y, Tensor x, Tensor w, Tensor b) override;
  void linear_backward(Tensor dx, Tensor dw, Tensor db, Tensor dy, Tensor x, Tensor w, bool accumulate_dx,
                       bool accumulate_params) override;
  void linear_gelu(Tensor y, Tensor h, Tensor x, Tensor w, Tensor b) override;
  void linear_dgrad_gelu(Tensor dx, Tensor dh, Tensor dy, Tensor w, Tensor h) override;
  void silu(Tensor y, Tensor x) override;
  void silu_backward(Tensor dx, Tensor dy, Tensor x, bool accumulate_dx) override;
  void gelu_tanh(Tensor y, Tensor x) override;
  void gelu_tanh_backward(Tensor dx, Tensor dy, Tensor x) override;
  void layernorm_modulate(Tensor y, Tensor mean, Tensor rstd, Tensor x, Tensor shift, Tensor scale,
                          double eps) override;
  void layernorm_modulate_backward(Tensor dx, Tensor dshift, Tensor dscale, Tensor dy, Tensor x, Tensor mean,
                                   Tensor rstd, Tensor scale, bool accumulate_dx) override;
  void rmsnorm_heads(Tensor y, Tensor rstd, Tensor x, Tensor scale, double eps) override;
  void rmsnorm_heads_backward(Tensor dx, Tensor dscale, Tensor dy, Tensor x, Tensor rstd, Tensor scale) override;
  void tokens_to_heads(Tensor heads, Tensor tokens, int64_t token_offset) override;
  void heads_to_tokens(Tensor tokens, Tensor heads, int64_t token_offset) override;
  void rope_table(Tensor pe, Tensor ids, std::span<const int> axes_dim, double theta) override;
  void rope(Tensor x, Tensor pe, bool inverse) override;
  void qk_norm_rope_to_heads(Tensor q_heads, Tensor k_heads, Tensor v_heads, Tensor q_rstd, Tensor k_rstd, Tensor q,
                             Tensor k, Tensor v, Tensor q_scale, Tensor k_scale, Tensor pe, int64_t token_offset,
                             double eps) override;
  void qk_norm_rope_to_heads_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dq_scale, Tensor dk_scale,
                                      Tensor dq_heads, Tensor dk_heads, Tensor dv_heads, Tensor q, Tensor k,
                                      Tensor q_rstd, Tensor k_rstd, Tensor q_scale, Tensor k_scale, Tensor pe,
                                      int64_t token_offset) override;
  void attention(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, double scale) override;
  void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o,
                          Tensor lse, double scale) override;
  void gated_residual(Tensor out, Tensor x, Tensor y, Tensor gate) override;
  void gated_residual_stats(Tensor out, Tensor mean, Tensor rstd, Tensor x, Tensor y, Tensor gate,
                            double eps) override;
  void gated_residual_backward(Tensor dy, Tensor dgate, Tensor dx, Tensor y, Tensor gate) override;
  void timestep_embedding(Tensor out, Tensor t, double time_factor, double max_period) override;
  void concat_tokens(Tensor out, Tensor a, Tensor b) override;
  void split_tokens(Tensor a, Tensor b, Tensor in) override;
  void flow_match_inputs(Tensor xt, Tensor target, Tensor x0, Tensor t, uint64_t seed,
                         std::span<const uint64_t> streams) override;
  void mse_loss_into(Tensor loss, Tensor dpred, Tensor pred, Tensor target, double grad_scale) override;
  void adamw(Tensor param, Tensor grad, Tensor m, Tensor v, const AdamW& h, std::span<const ParamCopy> copies,
             std::span<const ParamCast> casts, std::span<const LowRankGrad> low_rank) override;
  void quantize(QTensor rowwise, QTensor columnwise, Tensor x, const Quantize& q) override;
  void transpose_codes(QTensor dst, const QTensor& src) override;
  void quantize_fused(QTensor rowwise, QTensor columnwise, const CastInput& in, const Quantize& q) override;
  void delayed_scaling_update(Tensor amax_history, Tensor scale, Tensor scale_inv, Tensor fp8_max, AmaxAlgo algo,
                              int margin) override;
  void dequantize(Tensor y, const QTensor& x) override;
  void attention_fp8(QTensor o, Tensor lse, const QTensor& q, const QTensor& k, const QTensor& v, Shape heads,
                     double scale, const Fp8AttentionScales& sc) override;
  void attention_fp8_backward(QTensor dq, QTensor dk, QTensor dv, const QTensor& dout, const QTensor& q,
                              const QTensor& k, const QTensor& v, const QTensor& o, Tensor lse, Shape heads,
                              double scale, const Fp8AttentionScales& sc) override;
  void qk_norm_rope_to_heads_fp8(const Fp8Heads& q_heads, const Fp8Heads& k_heads, const Fp8Heads& v_heads,
                                 Tensor q_rstd, Tensor k_rstd, Tensor q, Tensor k, Tensor v, Tensor q_scale,
                                 Tensor k_scale, Tensor pe, int64_t token_offset, double eps) override;
  void qk_norm_rope_to_heads_backward_fp8(Tensor dq, Tensor dk, Tensor dv, Tensor dq_scale, Tensor dk_scale,
                                          const QTensor& dq_heads, const QTensor& dk_heads, const QTensor& dv_heads,
                                          Tensor q, Tensor k, Tensor q_rstd, Tensor k_rstd, Tensor q_scale,
                                          Tensor k_scale, Tensor pe, int64_t token_offset) override;
  void tokens_to_heads_fp8(const Fp8Heads& heads, Tensor tokens, int64_t token_offset) override;
  void heads_to_tokens_fp8(Tensor tokens, const QTensor& heads, int64_t token_offset) override;
  void gemm_fp8_tn(Tensor c, const QTensor& a, const QTensor& b, Tensor bias, bool accumulate,
                   Fp8Accumulation sum) override;

  // The signature's byte writer (public for the op templates in step_graph.cpp).
  class Signature {
   public:
    // The bytes written so far, handed over (the signature is empty again).
    std::string take() { return std::exchange(bytes_, {}); }
    // False once an argument asked for host-side bookkeeping a graph would skip.
    bool capturable = true;
    template <typename T>
    void raw(const T& v) {
      bytes_.append(reinterpret_cast<const char*>(&v), sizeof v);
    }

   private:
    std::string bytes_;
  };

 private:
  // A recorded op call: the op (for a failed capture's message) and the call with its arguments.
  struct Call {
    const char* op;
    std::function<void(Backend&)> run;
  };
  template <typename... P, typename... A>
  void op(const char* name, void (Backend::*fn)(P...), A&&... args);
  void close_segment();  // issues the segment recorded so far, as a graph or op by op
  void run_eagerly(std::vector<Call>& calls);

  struct Entry {
    int seen = 0;                          // sightings (eager runs before the capture)
    bool capturable = true;                // false: stays eager (telemetry, a failed capture)
    std::unique_ptr<Graph> graph;          // the captured graph (backends with graphs)
    uint64_t generation = 0;               // be_.capture_generation() at the capture
    std::vector<Call> replay;              // backends without graphs: the first record, replayed
  };

  Backend& be_;
  Options options_;
  bool recording_ = false;
  Signature sig_;
  std::vector<Call> calls_;  // the open segment's calls
  std::unordered_map<std::string, Entry> entries_;
  Stats stats_;
  std::string last_failure_;
};

}  // namespace flux8
