#include "backend/backend.h"

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "backend/attention_workspace.h"
#include "backend/op_checks.h"
#include "config/config.h"
#include "core/error.h"

namespace flux8 {

void Device::track_allocation(void* p, size_t bytes) {
  sizes_[p] = bytes;
  memory_.allocated += bytes;
  memory_.peak_allocated = std::max(memory_.peak_allocated, memory_.allocated);
}

void Device::track_release(void* p) {
  const auto it = sizes_.find(p);
  if (it == sizes_.end()) return;
  memory_.allocated -= it->second;
  sizes_.erase(it);
}

int64_t Device::do_timing_mark() {
  host_marks_.push_back(std::chrono::steady_clock::now());
  return static_cast<int64_t>(host_marks_.size()) - 1;
}

double Device::timing_elapsed_ms(int64_t from, int64_t to) {
  const auto n = static_cast<int64_t>(host_marks_.size());
  if (from < 0 || to < 0 || from >= n || to >= n)
    fail("timing_elapsed_ms: marks {} and {} are not both among the {} recorded", from, to, n);
  return std::chrono::duration<double, std::milli>(host_marks_[static_cast<size_t>(to)] -
                                                   host_marks_[static_cast<size_t>(from)])
      .count();
}

void Device::release_timing_marks() { host_marks_.clear(); }

void Device::release(void* p) {
  host_access(HostAccess::release, [&] { do_release(p); });
}
void Device::upload(void* dst, const void* host_src, size_t bytes) {
  host_access(HostAccess::upload, [&] { do_upload(dst, host_src, bytes); });
}
void Device::download(void* host_dst, const void* src, size_t bytes) {
  host_access(HostAccess::download, [&] { do_download(host_dst, src, bytes); });
}
void Device::synchronize() {
  host_access(HostAccess::synchronize, [&] { do_synchronize(); });
}
void Device::record_event(Event& e) {
  host_access(HostAccess::record_event, [&] { do_record_event(e); });
}
void Device::wait_event(const Event& e) {
  host_access(HostAccess::wait_event, [&] { do_wait_event(e); });
}
int64_t Device::timing_mark() {
  int64_t mark = 0;
  host_access(HostAccess::timing_mark, [&] { mark = do_timing_mark(); });
  return mark;
}

void Backend::host_access(HostAccess what, const std::function<void()>& access) {
  if (interceptor() && !executing_for_interceptor())
    interceptor()->host_access(what, access);
  else
    access();
}

void Backend::produce(Tensor y, const CastInput& in) {
  ops::check_cast_input("produce", in);
  ops::require_defined("produce", {"y", y});
  if (y.rows() != in.x.rows() || y.cols() != in.cols())
    fail("produce: output {} must be [{}, {}] (the head's columns, then the op's)", y.str(), in.x.rows(), in.cols());
  if (in.head.defined()) {
    const int64_t h = in.head_cols();
    if (in.head.data != y.data || in.head.ld != y.ld) copy(y.cols_slice(0, h), in.head);
    y = y.cols_slice(h, in.x.cols());
  }
  switch (in.op) {
    case CastInput::Op::identity:  // x already y (same memory): nothing to write, as for the head
      if (in.x.data != y.data || in.x.ld != y.ld) copy(y, in.x);
      return;
    case CastInput::Op::gelu_tanh: gelu_tanh(y, in.x); return;
    case CastInput::Op::gelu_tanh_backward: gelu_tanh_backward(y, in.x, in.gelu_x); return;
    case CastInput::Op::gated: gated_residual_backward(y, Tensor{}, in.x, Tensor{}, in.gate); return;
    case CastInput::Op::layernorm_modulate:
      // Recomputes mean and rstd: the same values, from the same x and eps.
      layernorm_modulate(y, in.mean, in.rstd, in.x, in.shift, in.scale, in.eps);
      return;
  }
}

void Backend::execute(const op::MseLossInto& args) {
  if (args.loss.dtype != DType::f64 || args.loss.numel() != 1 || !args.loss.contiguous())
    fail("mse_loss_into: loss must be one contiguous f64 element, got {} {}", dtype_name(args.loss.dtype),
         args.loss.shape.str());
  const double value = mse_loss(args.dpred, args.pred, args.target, args.grad_scale);
  upload(args.loss.data, &value, sizeof value);
}

void Device::begin_capture() { fail("backend '{}' has no graphs (set cuda_graph: false)", name()); }
std::unique_ptr<Device::Graph> Device::end_capture() { fail("backend '{}' has no graphs", name()); }
void Device::launch_graph(const Graph&) { fail("backend '{}' has no graphs", name()); }

void Backend::execute(const op::CopyBatch& args) {
  for (const CopyPair& p : args.pairs) copy(p.y, p.x);
}

void Backend::execute(const op::GatedResidualStats& args) {
  constexpr std::string_view op = "gated_residual_stats";
  const int64_t B = ops::check(op, args);
  gated_residual(args.out, args.x, args.y, args.gate);
  const int64_t L = args.out.shape[1], H = args.out.shape[2];
  for (int64_t b = 0; b < B; ++b) {  // sample by sample: mean and rstd may be a window of wider rows
    Tensor rows = args.out.rows_slice(b * L, L), m = args.mean.rows_slice(b, 1), r = args.rstd.rows_slice(b, 1);
    rows.shape = Shape{1, L, H};
    m.shape = r.shape = Shape{L};
    m.ld = r.ld = L;                              // one row of [B, L]: a contiguous vector of L
    const Tensor g = args.gate.rows_slice(b, 1);  // layernorm_modulate's shift and scale, unread (no y)
    layernorm_modulate(Tensor{}, m, r, rows, g, g, args.eps);
  }
}

namespace {

// A temporary of the backend's memory, released however the scope ends.
class Temporary {
 public:
  Temporary(Backend& be, DType t, Shape s)
      : be_(be), tensor_(be.allocate(static_cast<size_t>(s.numel()) * dtype_size(t)), t, s) {}
  ~Temporary() { be_.release(tensor_.data); }
  Temporary(const Temporary&) = delete;
  Temporary& operator=(const Temporary&) = delete;
  const Tensor& get() const { return tensor_; }

 private:
  Backend& be_;
  Tensor tensor_;
};

}  // namespace

void Backend::execute(const op::QuantizeFused& args) {
  if (args.in.op == CastInput::Op::identity && !args.in.head.defined()) {
    quantize(args.rowwise, args.columnwise, args.in.x, args.q);
    return;
  }
  ops::check_cast_input("quantize_fused", args.in);
  const Temporary y(*this, args.in.x.dtype, args.in.shape());
  produce(y.get(), args.in);
  quantize(args.rowwise, args.columnwise, y.get(), args.q);
}

namespace {

// quantize() of the rows of `heads` [B, n, L, D] one stream wrote (Ls at `offset` in every
// (sample, head)) into the same rows of `out`: a cast per (sample, head), merged into q's amax
// and counts one after another.
void quantize_stream_rows(Backend& be, const Backend::Fp8Heads& out, const Tensor& heads, int64_t Ls, int64_t offset) {
  const int64_t rows = heads.shape[0] * heads.shape[1], L = heads.shape[2];
  const Tensor flat = heads.reshaped(Shape{rows * L, heads.shape[3]});
  for (int64_t r = 0; r < rows; ++r)
    be.quantize(rows_of(out.codes, r * L + offset, Ls), QTensor{}, flat.rows_slice(r * L + offset, Ls), out.q);
}

}  // namespace

void Backend::execute(const op::QkNormRopeToHeadsFp8& args) {
  const Shape h = ops::check("qk_norm_rope_to_heads_fp8", args);
  const DType t = attention_heads_dtype(args.q.dtype, h[3]);
  const Temporary qh(*this, t, h), kh(*this, t, h), vh(*this, t, h);
  qk_norm_rope_to_heads(qh.get(), kh.get(), vh.get(), args.q_rstd, args.k_rstd, args.q, args.k, args.v, args.q_scale,
                        args.k_scale, args.pe, args.token_offset, args.eps);
  const int64_t Ls = args.q.shape[1];
  quantize_stream_rows(*this, args.q_heads, qh.get(), Ls, args.token_offset);
  quantize_stream_rows(*this, args.k_heads, kh.get(), Ls, args.token_offset);
  quantize_stream_rows(*this, args.v_heads, vh.get(), Ls, args.token_offset);
}

void Backend::execute(const op::QkNormRopeToHeadsBackwardFp8& args) {
  const Shape h = ops::check("qk_norm_rope_to_heads_backward_fp8", args);
  const DType t = attention_heads_dtype(args.q.dtype, h[3]);
  const Temporary dqh(*this, t, h), dkh(*this, t, h), dvh(*this, t, h);
  dequantize(dqh.get(), args.dq_heads);
  dequantize(dkh.get(), args.dk_heads);
  dequantize(dvh.get(), args.dv_heads);
  qk_norm_rope_to_heads_backward(args.dq, args.dk, args.dv, args.dq_scale, args.dk_scale, dqh.get(), dkh.get(),
                                 dvh.get(), args.q, args.k, args.q_rstd, args.k_rstd, args.q_scale, args.k_scale,
                                 args.pe, args.token_offset);
}

void Backend::execute(const op::TokensToHeadsFp8& args) {
  const Shape h = ops::check("tokens_to_heads_fp8", args);
  const Temporary th(*this, attention_heads_dtype(args.tokens.dtype, h[3]), h);
  tokens_to_heads(th.get(), args.tokens, args.token_offset);
  quantize_stream_rows(*this, args.heads, th.get(), args.tokens.shape[1], args.token_offset);
}

void Backend::execute(const op::HeadsToTokensFp8& args) {
  const Shape h = ops::check("heads_to_tokens_fp8", args);
  const Temporary th(*this, attention_heads_dtype(args.tokens.dtype, h[3]), h);
  dequantize(th.get(), args.heads);
  heads_to_tokens(args.tokens, th.get(), args.token_offset);
}

namespace {

// FLUX8_ATTENTION_DETERMINISTIC=0 or 1 overrides the key (A/B runs without editing a config); an
// empty value counts as unset.
bool deterministic_attention_choice(bool configured) {
  const char* e = std::getenv("FLUX8_ATTENTION_DETERMINISTIC");
  const std::string_view v = e ? e : "";
  if (v.empty()) return configured;
  if (v == "0") return false;
  if (v == "1") return true;
  fail(
      "FLUX8_ATTENTION_DETERMINISTIC={}: expected 0 (cuDNN's faster attention backward, with atomics) or 1 (its "
      "deterministic one); or unset it and choose with the config key deterministic_attention",
      v);
}

}  // namespace

BackendOptions BackendOptions::from_config(const Config& cfg) {
  BackendOptions o;
  o.threads = static_cast<int>(cfg.get_int("threads"));
  o.round_activations_to_bf16 = cfg.get_bool("round_activations_to_bf16");
  o.bf16_gemm = cfg.get_string("gemm_precision") == "bf16";
  o.bf16_activations = cfg.get_string("activation_precision") == "bf16";
  o.bf16_grads = cfg.get_string("grad_precision") == "bf16";
  o.deterministic_attention = deterministic_attention_choice(cfg.get_bool("deterministic_attention"));
  o.attention_workspace_limit = flux8::attention_workspace_limit(cfg);
  return o;
}

}  // namespace flux8
