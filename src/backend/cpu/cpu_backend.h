#pragma once
// The CPU reference backend: plain C++ with OpenMP over independent rows/heads/samples and
// OpenBLAS for matrix products. Every op runs on f32 and on f64 tensors (f64 is what the
// finite-difference gradient checks use). Results never depend on the thread count: no
// reduction is split in a way that depends on how many threads run it.
//
// Implementation is split by concern: memory.cpp, layout.cpp, linear.cpp, activations.cpp,
// norms.cpp, rope.cpp, attention.cpp, embedding.cpp; shared helpers in common.h.
#include "backend/backend.h"

namespace flux8 {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& options);

  std::string name() const override { return "cpu"; }
  const BackendOptions& options() const override { return options_; }

  void* allocate(size_t bytes) override;
  void release(void* p) override;
  void upload(void* dst, const void* host_src, size_t bytes) override;
  void download(void* host_dst, const void* src, size_t bytes) override;
  // Ops are done when they return: events are points already passed, the copy queue copies.
  std::unique_ptr<Event> make_event() override { return std::make_unique<Event>(); }
  std::unique_ptr<CopyQueue> make_copy_queue() override;
  void record_event(Event&) override {}
  void wait_event(const Event&) override {}

  // fill/copy/add/accumulate serve parameter and gradient buffers as well as activations,
  // so they never apply the bf16 activation rounding (their callers know what they hold).
  void fill(Tensor y, double value) override;
  void fill_random(Tensor y, Random dist, uint64_t seed, uint64_t stream, double scale) override;
  void copy(Tensor y, Tensor x) override;
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
  void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                          Tensor v, Tensor o, Tensor lse, double scale) override;

  void gated_residual(Tensor out, Tensor x, Tensor y, Tensor gate) override;
  void gated_residual_backward(Tensor dy, Tensor dgate, Tensor dx, Tensor y, Tensor gate) override;

  void timestep_embedding(Tensor out, Tensor t, double time_factor, double max_period) override;

  void concat_tokens(Tensor out, Tensor a, Tensor b) override;
  void split_tokens(Tensor a, Tensor b, Tensor in) override;

  void flow_match_inputs(Tensor xt, Tensor target, Tensor x0, Tensor t, uint64_t seed,
                         std::span<const uint64_t> streams) override;
  double mse_loss(Tensor dpred, Tensor pred, Tensor target, double grad_scale) override;
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
  void delayed_scaling_update(Tensor amax_history, Tensor scale, Tensor scale_inv, Tensor fp8_max, AmaxAlgo algo,
                              int margin) override;
  void gemm_fp8_tn(Tensor c, const QTensor& a, const QTensor& b, Tensor bias, bool accumulate,
                   Fp8Accumulation sum) override;

 private:
  BackendOptions options_;
};

}  // namespace flux8
