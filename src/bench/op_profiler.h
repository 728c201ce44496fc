#pragma once
// A Backend that runs every op on another backend and times it: the per-op breakdown of a
// training step (`flux8 bench --profile`). Each op is bracketed by two timing marks of the
// wrapped backend (Backend::timing_mark: on the GPU, events in its stream), and nothing waits:
// the step runs as it would unprofiled. At each synchronize() the marks are read: an op's row
// is the device time from its first to its last work (with the launch gaps inside it where the
// GPU waited for the host), and the device time between one op's end and the next one's start
// — the GPU idle, waiting for the host (launches, host synchronisations, host work) — goes to
// the row kIdle, across synchronize() calls too, and by the op each wait ended with
// (idle_before(): where the device waited — after a host synchronisation, on short launches);
// not across a pause (the bench's data upload between steps), where the marks are released.
// On the CPU the marks are the host clock (its ops finish before they return), which gives the
// same rows. Until the bench stopped synchronising around every op (thirteenth session), each
// row also held a launch and a synchronisation, which inflated short ops by ~10–20 µs a call.
#include <chrono>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace flux8 {

class OpProfiler : public Backend {
 public:
  explicit OpProfiler(Backend& inner) : be_(inner) {}

  struct Row {
    std::string op;
    int64_t calls = 0;
    double ms = 0;
  };
  // The device time between ops (the GPU idle): a row of its own.
  static constexpr const char* kIdle = "(device idle between ops)";
  // Rows by total time, largest first, as of the last synchronize(); reset() clears them
  // (e.g. after warm-up).
  std::vector<Row> rows() const;
  // The idle row split by the op that ended each wait (what the device waited to start: after a
  // host synchronisation, the first op launched after it), largest first; `calls` counts the
  // waits. Where a CUDA graph or one synchronisation less would pay.
  std::vector<Row> idle_before() const;
  void reset() {
    totals_.clear();
    idle_before_.clear();
    pending_.clear();
    last_end_ = -1;
    be_.release_timing_marks();
  }
  // While paused, ops run untimed (the bench uploads each batch outside the step's clock), and
  // the time from the last op before to the first op after is nobody's.
  void pause(bool paused) {
    if (paused) last_end_ = -1;
    paused_ = paused;
  }

  std::string name() const override { return be_.name() + "+profiler"; }
  const BackendOptions& options() const override { return be_.options(); }
  void* allocate(size_t bytes) override { return be_.allocate(bytes); }
  void release(void* p) override { be_.release(p); }
  void upload(void* dst, const void* src, size_t bytes) override { timed("upload", [&] { be_.upload(dst, src, bytes); }); }
  std::unique_ptr<Event> make_event() override { return be_.make_event(); }
  std::unique_ptr<CopyQueue> make_copy_queue() override { return be_.make_copy_queue(); }
  void record_event(Event& e) override { be_.record_event(e); }
  void wait_event(const Event& e) override { be_.wait_event(e); }
  void download(void* dst, const void* src, size_t bytes) override {
    timed("download", [&] { be_.download(dst, src, bytes); });
  }
  // Waits for the wrapped backend, then reads the marks of the ops since the last call into rows.
  void synchronize() override;
  // The wrapped backend's marks; the profiler releases them at each synchronize().
  int64_t timing_mark() override { return be_.timing_mark(); }
  double timing_elapsed_ms(int64_t from, int64_t to) override { return be_.timing_elapsed_ms(from, to); }
  void release_timing_marks() override { be_.release_timing_marks(); }
  MemoryUse memory_use() const override { return be_.memory_use(); }
  PowerReading power_reading() override { return be_.power_reading(); }

  void fill(Tensor y, double v) override { timed("fill", [&] { be_.fill(y, v); }); }
  void fill_random(Tensor y, Random d, uint64_t seed, uint64_t stream, double scale) override {
    timed("fill_random", [&] { be_.fill_random(y, d, seed, stream, scale); });
  }
  void copy(Tensor y, Tensor x) override { timed("copy", [&] { be_.copy(y, x); }); }
  void copy_batch(std::span<const CopyPair> pairs) override {
    timed("copy_batch", [&] { be_.copy_batch(pairs); });
  }
  DType activation_dtype(DType compute) const override { return be_.activation_dtype(compute); }
  DType weight_operand_dtype(DType compute) const override { return be_.weight_operand_dtype(compute); }
  DType gradient_dtype(DType compute) const override { return be_.gradient_dtype(compute); }
  DType attention_heads_dtype(DType activations, int64_t head_dim) const override {
    return be_.attention_heads_dtype(activations, head_dim);
  }
  void add(Tensor y, Tensor a, Tensor b) override { timed("add", [&] { be_.add(y, a, b); }); }
  void accumulate(Tensor y, Tensor x) override { timed("accumulate", [&] { be_.accumulate(y, x); }); }
  void linear(Tensor y, Tensor x, Tensor w, Tensor b) override { timed("linear", [&] { be_.linear(y, x, w, b); }); }
  void linear_backward(Tensor dx, Tensor dw, Tensor db, Tensor dy, Tensor x, Tensor w, bool acc,
                       bool acc_params) override {
    timed("linear_backward", [&] { be_.linear_backward(dx, dw, db, dy, x, w, acc, acc_params); });
  }
  void silu(Tensor y, Tensor x) override { timed("silu", [&] { be_.silu(y, x); }); }
  void silu_backward(Tensor dx, Tensor dy, Tensor x, bool acc) override {
    timed("silu_backward", [&] { be_.silu_backward(dx, dy, x, acc); });
  }
  void linear_gelu(Tensor y, Tensor h, Tensor x, Tensor w, Tensor b) override {
    timed("linear_gelu", [&] { be_.linear_gelu(y, h, x, w, b); });
  }
  void linear_dgrad_gelu(Tensor dx, Tensor dh, Tensor dy, Tensor w, Tensor h) override {
    timed("linear_dgrad_gelu", [&] { be_.linear_dgrad_gelu(dx, dh, dy, w, h); });
  }
  void gelu_tanh(Tensor y, Tensor x) override { timed("gelu_tanh", [&] { be_.gelu_tanh(y, x); }); }
  void gelu_tanh_backward(Tensor dx, Tensor dy, Tensor x) override {
    timed("gelu_tanh_backward", [&] { be_.gelu_tanh_backward(dx, dy, x); });
  }
  void layernorm_modulate(Tensor y, Tensor mean, Tensor rstd, Tensor x, Tensor shift, Tensor scale,
                          double eps) override {
    timed("layernorm_modulate", [&] { be_.layernorm_modulate(y, mean, rstd, x, shift, scale, eps); });
  }
  void layernorm_modulate_backward(Tensor dx, Tensor dshift, Tensor dscale, Tensor dy, Tensor x, Tensor mean,
                                   Tensor rstd, Tensor scale, bool acc) override {
    timed("layernorm_modulate_backward",
          [&] { be_.layernorm_modulate_backward(dx, dshift, dscale, dy, x, mean, rstd, scale, acc); });
  }
  void rmsnorm_heads(Tensor y, Tensor rstd, Tensor x, Tensor scale, double eps) override {
    timed("rmsnorm_heads", [&] { be_.rmsnorm_heads(y, rstd, x, scale, eps); });
  }
  void rmsnorm_heads_backward(Tensor dx, Tensor dscale, Tensor dy, Tensor x, Tensor rstd, Tensor scale) override {
    timed("rmsnorm_heads_backward", [&] { be_.rmsnorm_heads_backward(dx, dscale, dy, x, rstd, scale); });
  }
  void tokens_to_heads(Tensor heads, Tensor tokens, int64_t off) override {
    timed("tokens_to_heads", [&] { be_.tokens_to_heads(heads, tokens, off); });
  }
  void heads_to_tokens(Tensor tokens, Tensor heads, int64_t off) override {
    timed("heads_to_tokens", [&] { be_.heads_to_tokens(tokens, heads, off); });
  }
  void rope_table(Tensor pe, Tensor ids, std::span<const int> axes, double theta) override {
    timed("rope_table", [&] { be_.rope_table(pe, ids, axes, theta); });
  }
  void rope(Tensor x, Tensor pe, bool inverse) override { timed("rope", [&] { be_.rope(x, pe, inverse); }); }
  void qk_norm_rope_to_heads(Tensor qh, Tensor kh, Tensor vh, Tensor q_rstd, Tensor k_rstd, Tensor q, Tensor k,
                             Tensor v, Tensor q_scale, Tensor k_scale, Tensor pe, int64_t off, double eps) override {
    timed("qk_norm_rope_to_heads",
          [&] { be_.qk_norm_rope_to_heads(qh, kh, vh, q_rstd, k_rstd, q, k, v, q_scale, k_scale, pe, off, eps); });
  }
  void qk_norm_rope_to_heads_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dq_scale, Tensor dk_scale, Tensor dqh,
                                      Tensor dkh, Tensor dvh, Tensor q, Tensor k, Tensor q_rstd, Tensor k_rstd,
                                      Tensor q_scale, Tensor k_scale, Tensor pe, int64_t off) override {
    timed("qk_norm_rope_to_heads_backward", [&] {
      be_.qk_norm_rope_to_heads_backward(dq, dk, dv, dq_scale, dk_scale, dqh, dkh, dvh, q, k, q_rstd, k_rstd, q_scale,
                                         k_scale, pe, off);
    });
  }
  void attention(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, double scale) override {
    timed("attention", [&] { be_.attention(o, lse, q, k, v, scale); });
  }
  void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o,
                          Tensor lse, double scale) override {
    timed("attention_backward", [&] { be_.attention_backward(dq, dk, dv, dout, q, k, v, o, lse, scale); });
  }
  void gated_residual(Tensor out, Tensor x, Tensor y, Tensor gate) override {
    timed("gated_residual", [&] { be_.gated_residual(out, x, y, gate); });
  }
  void gated_residual_stats(Tensor out, Tensor mean, Tensor rstd, Tensor x, Tensor y, Tensor gate,
                            double eps) override {
    timed("gated_residual_stats", [&] { be_.gated_residual_stats(out, mean, rstd, x, y, gate, eps); });
  }
  void gated_residual_backward(Tensor dy, Tensor dgate, Tensor dx, Tensor y, Tensor gate) override {
    timed("gated_residual_backward", [&] { be_.gated_residual_backward(dy, dgate, dx, y, gate); });
  }
  void timestep_embedding(Tensor out, Tensor t, double tf, double mp) override {
    timed("timestep_embedding", [&] { be_.timestep_embedding(out, t, tf, mp); });
  }
  void concat_tokens(Tensor out, Tensor a, Tensor b) override { timed("concat_tokens", [&] { be_.concat_tokens(out, a, b); }); }
  void split_tokens(Tensor a, Tensor b, Tensor in) override { timed("split_tokens", [&] { be_.split_tokens(a, b, in); }); }
  void flow_match_inputs(Tensor xt, Tensor target, Tensor x0, Tensor t, uint64_t seed,
                         std::span<const uint64_t> streams) override {
    timed("flow_match_inputs", [&] { be_.flow_match_inputs(xt, target, x0, t, seed, streams); });
  }
  double mse_loss(Tensor dpred, Tensor pred, Tensor target, double grad_scale) override {
    double r = 0;
    timed("mse_loss", [&] { r = be_.mse_loss(dpred, pred, target, grad_scale); });
    return r;
  }
  void mse_loss_into(Tensor loss, Tensor dpred, Tensor pred, Tensor target, double grad_scale) override {
    timed("mse_loss", [&] { be_.mse_loss_into(loss, dpred, pred, target, grad_scale); });
  }
  double sum_squares(Tensor x) override {
    double r = 0;
    timed("sum_squares", [&] { r = be_.sum_squares(x); });
    return r;
  }
  double gradient_sum_squares(Tensor grads, std::span<const LowRankGrad> low_rank) override {
    double r = 0;
    timed("sum_squares", [&] { r = be_.gradient_sum_squares(grads, low_rank); });
    return r;
  }
  void adamw(Tensor p, Tensor g, Tensor m, Tensor v, const AdamW& h, std::span<const ParamCopy> copies,
             std::span<const ParamCast> casts, std::span<const LowRankGrad> low_rank) override {
    timed("adamw", [&] { be_.adamw(p, g, m, v, h, copies, casts, low_rank); });
  }
  void transpose_codes(QTensor dst, const QTensor& src) override {
    timed("transpose_codes", [&] { be_.transpose_codes(dst, src); });
  }
  void quantize(QTensor rowwise, QTensor columnwise, Tensor x, const Quantize& q) override {
    timed("quantize (fp8 cast)", [&] { be_.quantize(rowwise, columnwise, x, q); });
  }
  void delayed_scaling_update(Tensor amax_history, Tensor scale, Tensor scale_inv, Tensor fp8_max, AmaxAlgo algo,
                              int margin) override {
    timed("delayed_scaling_update",
          [&] { be_.delayed_scaling_update(amax_history, scale, scale_inv, fp8_max, algo, margin); });
  }
  // A row per fused op (and whether the cast has a head: the single block's two-source casts).
  void quantize_fused(QTensor rowwise, QTensor columnwise, const CastInput& in, const Quantize& q) override {
    timed(fused_cast_row(in), [&] { be_.quantize_fused(rowwise, columnwise, in, q); });
  }
  static const char* fused_cast_row(const CastInput& in) {
    using Op = CastInput::Op;
    static constexpr const char* kPlain[] = {
        "quantize_fused (identity + fp8 cast)", "quantize_fused (gelu_tanh + fp8 cast)",
        "quantize_fused (layernorm_modulate + fp8 cast)", "quantize_fused (gelu_tanh_backward + fp8 cast)",
        "quantize_fused (gated + fp8 cast)"};
    static constexpr const char* kHead[] = {
        "quantize_fused ([head | identity] + fp8 cast)", "quantize_fused ([head | gelu_tanh] + fp8 cast)",
        "quantize_fused ([head | layernorm_modulate] + fp8 cast)",
        "quantize_fused ([head | gelu_tanh_backward] + fp8 cast)", "quantize_fused ([head | gated] + fp8 cast)"};
    static_assert(static_cast<int>(Op::gated) == 4 && std::size(kPlain) == 5 && std::size(kHead) == 5);
    return (in.head.defined() ? kHead : kPlain)[static_cast<int>(in.op)];
  }

  void dequantize(Tensor y, const QTensor& x) override {
    timed("dequantize", [&] { be_.dequantize(y, x); });
  }
  void attention_fp8(QTensor o, Tensor lse, const QTensor& q, const QTensor& k, const QTensor& v, Shape heads,
                     double scale, const Fp8AttentionScales& sc) override {
    timed("attention_fp8", [&] { be_.attention_fp8(o, lse, q, k, v, heads, scale, sc); });
  }
  void attention_fp8_backward(QTensor dq, QTensor dk, QTensor dv, const QTensor& dout, const QTensor& q,
                              const QTensor& k, const QTensor& v, const QTensor& o, Tensor lse, Shape heads,
                              double scale, const Fp8AttentionScales& sc) override {
    timed("attention_fp8_backward", [&] { be_.attention_fp8_backward(dq, dk, dv, dout, q, k, v, o, lse, heads, scale, sc); });
  }
  void qk_norm_rope_to_heads_fp8(const Fp8Heads& qh, const Fp8Heads& kh, const Fp8Heads& vh, Tensor q_rstd,
                                 Tensor k_rstd, Tensor q, Tensor k, Tensor v, Tensor q_scale, Tensor k_scale, Tensor pe,
                                 int64_t off, double eps) override {
    timed("qk_norm_rope_to_heads_fp8 (+ fp8 casts)", [&] {
      be_.qk_norm_rope_to_heads_fp8(qh, kh, vh, q_rstd, k_rstd, q, k, v, q_scale, k_scale, pe, off, eps);
    });
  }
  void qk_norm_rope_to_heads_backward_fp8(Tensor dq, Tensor dk, Tensor dv, Tensor dq_scale, Tensor dk_scale,
                                          const QTensor& dqh, const QTensor& dkh, const QTensor& dvh, Tensor q,
                                          Tensor k, Tensor q_rstd, Tensor k_rstd, Tensor q_scale, Tensor k_scale,
                                          Tensor pe, int64_t off) override {
    timed("qk_norm_rope_to_heads_backward_fp8", [&] {
      be_.qk_norm_rope_to_heads_backward_fp8(dq, dk, dv, dq_scale, dk_scale, dqh, dkh, dvh, q, k, q_rstd, k_rstd,
                                             q_scale, k_scale, pe, off);
    });
  }
  void tokens_to_heads_fp8(const Fp8Heads& heads, Tensor tokens, int64_t off) override {
    timed("tokens_to_heads_fp8 (+ fp8 cast)", [&] { be_.tokens_to_heads_fp8(heads, tokens, off); });
  }
  void heads_to_tokens_fp8(Tensor tokens, const QTensor& heads, int64_t off) override {
    timed("heads_to_tokens_fp8", [&] { be_.heads_to_tokens_fp8(tokens, heads, off); });
  }
  void gemm_fp8_tn(Tensor c, const QTensor& a, const QTensor& b, Tensor bias, bool acc, Fp8Accumulation sum) override {
    // The forward GEMMs (fast accumulation, fp8_fprop_fast_accumulation) apart from the rest.
    timed(sum == Fp8Accumulation::fast ? "gemm_fp8_tn (fast accumulation)" : "gemm_fp8_tn",
          [&] { be_.gemm_fp8_tn(c, a, b, bias, acc, sum); });
  }

 private:
  template <typename F>
  void timed(const char* op, F&& f) {
    if (paused_) {
      f();
      return;
    }
    const int64_t begin = be_.timing_mark();
    f();
    const int64_t end = be_.timing_mark();
    pending_.push_back(Pending{op, last_end_, begin, end});
    last_end_ = end;
  }
  struct Pending {
    const char* op;
    int64_t previous_end, begin, end;  // timing marks; previous_end −1: no op before it to measure from
  };
  Backend& be_;
  bool paused_ = false;
  int64_t last_end_ = -1;  // the last timed op's end mark (−1 after a pause or reset)
  std::map<std::string, Row> totals_;
  std::map<std::string, Row> idle_before_;  // kIdle by the op after the wait
  std::vector<Pending> pending_;  // ops timed since the last synchronize(), in call order
};

}  // namespace flux8
