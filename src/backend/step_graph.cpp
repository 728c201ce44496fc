#include "backend/step_graph.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <tuple>
#include <type_traits>
#include <utility>

#include "core/error.h"

namespace flux8 {

namespace {
using Sig = StepGraph::Signature;

// ---- what goes into a signature: every field a wrapped op could read, one by one (never a
// struct's raw bytes, whose padding is not ours to compare) --------------------------------------
template <typename T>
  requires std::is_arithmetic_v<T> || std::is_enum_v<T> || std::is_pointer_v<T>
void put(Sig& s, T v) {
  s.raw(v);
}
void put(Sig& s, const Shape& sh) {
  s.raw(sh.rank);
  for (int i = 0; i < sh.rank; ++i) s.raw(sh.d[static_cast<size_t>(i)]);
}
void put(Sig& s, const Tensor& t) {
  s.raw(t.data);
  s.raw(t.dtype);
  put(s, t.shape);
  s.raw(t.ld);
}
void put(Sig& s, const QTensor& q) {
  s.raw(q.codes);
  s.raw(q.rows);
  s.raw(q.cols);
  s.raw(q.format);
  s.raw(q.scaling);
  s.raw(q.scale_inv);
  s.raw(q.scale_e8m0);
}
void put(Sig& s, const Backend::Quantize& q) {
  s.raw(q.format);
  s.raw(q.scaling);
  s.raw(q.pow2);
  s.raw(q.delayed_scale);
  s.raw(q.amax);
  s.raw(q.stats);
  put(s, q.column_sums);
  s.raw(q.column_sums_accumulate);
  // The counts reach the host through the backend's bookkeeping when the cast is issued, which a
  // graph launch would skip.
  if (q.stats) s.capturable = false;
}
void put(Sig& s, const Backend::CastInput& in) {
  s.raw(in.op);
  for (const Tensor* t : {&in.x, &in.mean, &in.rstd, &in.shift, &in.scale, &in.gelu_x, &in.gate, &in.head})
    put(s, *t);
  s.raw(in.eps);
  s.raw(in.statistics_ready);
}
void put(Sig& s, const Backend::Fp8Heads& h) {
  put(s, h.codes);
  put(s, h.q);
}
void put(Sig& s, const Backend::Fp8AttentionScales& sc) {
  for (const float* p : {sc.o, sc.ds, sc.ds_inv, sc.dq, sc.dk, sc.dv}) s.raw(p);
  for (const float* p : {sc.amax_s, sc.amax_o, sc.amax_ds, sc.amax_dq, sc.amax_dk, sc.amax_dv}) s.raw(p);
}
void put(Sig& s, const Backend::CopyPair& p) {
  put(s, p.y);
  put(s, p.x);
}
void put(Sig& s, const Backend::LowRankGrad& g) {
  s.raw(g.offset);
  put(s, g.a);
  put(s, g.b);
}
void put(Sig& s, const Backend::ParamCopy& c) {
  s.raw(c.offset);
  put(s, c.copy);
}
void put(Sig& s, const Backend::ParamCast& c) {
  s.raw(c.offset);
  put(s, c.codes);
  s.raw(c.scale);
  s.raw(c.amax);
}
void put(Sig& s, const Backend::AdamW& h) {
  for (double v : {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.grad_scale}) s.raw(v);
  s.raw(h.step);
}
template <typename T>
void put(Sig& s, std::span<const T> items) {
  s.raw(items.size());
  for (const T& t : items) put(s, t);
}

// How a parameter is kept in a recorded call: by value, a span's elements copied (the caller's
// array may be gone, or hold something else, when the call runs).
template <typename P>
struct Stored {
  using type = std::remove_cvref_t<P>;
  static type from(const type& v) { return v; }
};
template <typename T>
struct Stored<std::span<const T>> {
  using type = std::vector<T>;
  static type from(std::span<const T> s) { return type(s.begin(), s.end()); }
};
}  // namespace

StepGraph::Options StepGraph::Options::from_environment() {
  Options o;
  if (const char* e = std::getenv("FLUX8_GRAPH_SEGMENT_OPS"); e && *e) {
    char* end = nullptr;
    const long v = std::strtol(e, &end, 10);
    if (*end || v < 1 || v > 100000)
      fail("FLUX8_GRAPH_SEGMENT_OPS={}: expected the op calls a graph holds, 1 to 100000 (unset: {})", e,
           o.segment_ops);
    o.segment_ops = static_cast<int>(v);
  }
  return o;
}

StepGraph::StepGraph(Backend& inner, Options options) : be_(inner), options_(options) {
  if (options_.segment_ops < 1) fail("StepGraph: segment_ops must be at least 1, got {}", options_.segment_ops);
}

StepGraph::~StepGraph() {
  try {
    be_.synchronize();  // no launched graph may still run when its executable is destroyed
  } catch (const std::exception&) {
    // A failing device is reported by whatever runs next; a destructor must not throw.
  }
  entries_.clear();
}

void StepGraph::begin_region() {
  if (recording_) fail("StepGraph: begin_region inside a region (regions do not nest)");
  recording_ = true;
}

void StepGraph::end_region() {
  if (!recording_) fail("StepGraph: end_region without begin_region");
  recording_ = false;  // first: should the segment throw, the wrapper is out of the region
  close_segment();
}

void StepGraph::abandon_region() {
  recording_ = false;
  calls_.clear();
  sig_.take();
  sig_.capturable = true;
}

template <typename... P, typename... A>
void StepGraph::op(const char* name, void (Backend::*fn)(P...), A&&... args) {
  if (!recording_) {
    (be_.*fn)(std::forward<A>(args)...);
    return;
  }
  sig_.raw(name);  // the op: one literal per wrapper method, so its address names it
  (put(sig_, args), ...);
  calls_.push_back({name, [fn, stored = std::tuple<typename Stored<P>::type...>(Stored<P>::from(args)...)](Backend& b) {
                       std::apply([&](const auto&... a) { (b.*fn)(a...); }, stored);
                     }});
  if (static_cast<int>(calls_.size()) >= options_.segment_ops) close_segment();
}

void StepGraph::run_eagerly(std::vector<Call>& calls) {
  for (Call& c : calls) c.run(be_);
  ++stats_.eager;
  stats_.ops_eager += static_cast<int64_t>(calls.size());
}

void StepGraph::close_segment() {
  std::vector<Call> calls = std::exchange(calls_, {});
  std::string key = sig_.take();
  const bool capturable = std::exchange(sig_.capturable, true);
  if (calls.empty()) return;
  if (!capturable) {
    run_eagerly(calls);
    return;
  }
  if (entries_.size() >= options_.max_segments && !entries_.contains(key)) {
    be_.synchronize();  // the graphs dropped may still be running
    entries_.clear();
  }
  Entry& e = entries_[std::move(key)];
  if (!e.capturable) {
    run_eagerly(calls);
    return;
  }
  const int64_t n = static_cast<int64_t>(calls.size());
  if (!be_.can_capture()) {  // the CPU twin: the first record stands for the graph
    if (e.replay.empty()) {
      run_eagerly(calls);
      e.replay = std::move(calls);
      return;
    }
    for (Call& c : e.replay) c.run(be_);
    ++stats_.launched;
    stats_.ops_launched += n;
    return;
  }
  if (e.graph && e.generation != be_.capture_generation()) {  // its scratch has moved
    be_.synchronize();  // an earlier launch of it may still run
    e.graph.reset();
  }
  if (!e.graph) {
    if (e.seen++ == 0) {  // first sighting: run it, which also grows any scratch it needs
      run_eagerly(calls);
      return;
    }
    be_.begin_capture();
    std::unique_ptr<Graph> g;
    size_t i = 0;
    try {
      for (; i < calls.size(); ++i) calls[i].run(be_);
      g = be_.end_capture();
      if (!g) last_failure_ = "the capture was invalidated (an op synchronised or allocated)";
    } catch (const std::exception& ex) {
      be_.end_capture();  // ends the capture the op broke off
      last_failure_ = fmt::format("{}: {}", calls[i].op, ex.what());
    }
    if (!g) {
      if (stats_.capture_failed++ == 0)
        fmt::print(stderr, "flux8: cuda_graph: a segment of {} ops could not be captured ({}); it runs op by op\n", n,
                   last_failure_);
      e.capturable = false;
      run_eagerly(calls);  // nothing of the failed capture ran
      return;
    }
    e.graph = std::move(g);
    e.generation = be_.capture_generation();
    ++stats_.captured;
  }
  be_.launch_graph(*e.graph);
  ++stats_.launched;
  stats_.ops_launched += n;
}

// ---- calls that need the device's results or memory: the open segment is issued first ----------
void StepGraph::release(void* p) {
  if (recording_) close_segment();
  be_.release(p);
}
void StepGraph::upload(void* dst, const void* src, size_t bytes) {
  if (recording_) close_segment();
  be_.upload(dst, src, bytes);
}
void StepGraph::download(void* dst, const void* src, size_t bytes) {
  if (recording_) close_segment();
  be_.download(dst, src, bytes);
}
void StepGraph::record_event(Event& e) {
  if (recording_) close_segment();
  be_.record_event(e);
}
void StepGraph::wait_event(const Event& e) {
  if (recording_) close_segment();
  be_.wait_event(e);
}
void StepGraph::synchronize() {
  if (recording_) close_segment();
  be_.synchronize();
}
int64_t StepGraph::timing_mark() {
  if (recording_) close_segment();
  return be_.timing_mark();
}
double StepGraph::mse_loss(Tensor dpred, Tensor pred, Tensor target, double grad_scale) {
  if (recording_) close_segment();
  return be_.mse_loss(dpred, pred, target, grad_scale);
}
double StepGraph::sum_squares(Tensor x) {
  if (recording_) close_segment();
  return be_.sum_squares(x);
}
double StepGraph::gradient_sum_squares(Tensor grads, std::span<const LowRankGrad> low_rank) {
  if (recording_) close_segment();
  return be_.gradient_sum_squares(grads, low_rank);
}

// ---- ops ---------------------------------------------------------------------------------------
void StepGraph::fill(Tensor y, double value) { op("fill", &Backend::fill, y, value); }
void StepGraph::fill_random(Tensor y, Random dist, uint64_t seed, uint64_t stream, double scale) {
  op("fill_random", &Backend::fill_random, y, dist, seed, stream, scale);
}
void StepGraph::copy(Tensor y, Tensor x) { op("copy", &Backend::copy, y, x); }
void StepGraph::copy_batch(std::span<const CopyPair> pairs) { op("copy_batch", &Backend::copy_batch, pairs); }
void StepGraph::add(Tensor y, Tensor a, Tensor b) { op("add", &Backend::add, y, a, b); }
void StepGraph::accumulate(Tensor y, Tensor x) { op("accumulate", &Backend::accumulate, y, x); }
void StepGraph::linear(Tensor y, Tensor x, Tensor w, Tensor b) { op("linear", &Backend::linear, y, x, w, b); }
void StepGraph::linear_backward(Tensor dx, Tensor dw, Tensor db, Tensor dy, Tensor x, Tensor w, bool accumulate_dx,
                                bool accumulate_params) {
  op("linear_backward", &Backend::linear_backward, dx, dw, db, dy, x, w, accumulate_dx, accumulate_params);
}
void StepGraph::linear_gelu(Tensor y, Tensor h, Tensor x, Tensor w, Tensor b) {
  op("linear_gelu", &Backend::linear_gelu, y, h, x, w, b);
}
void StepGraph::linear_dgrad_gelu(Tensor dx, Tensor dh, Tensor dy, Tensor w, Tensor h) {
  op("linear_dgrad_gelu", &Backend::linear_dgrad_gelu, dx, dh, dy, w, h);
}
void StepGraph::silu(Tensor y, Tensor x) { op("silu", &Backend::silu, y, x); }
void StepGraph::silu_backward(Tensor dx, Tensor dy, Tensor x, bool accumulate_dx) {
  op("silu_backward", &Backend::silu_backward, dx, dy, x, accumulate_dx);
}
void StepGraph::gelu_tanh(Tensor y, Tensor x) { op("gelu_tanh", &Backend::gelu_tanh, y, x); }
void StepGraph::gelu_tanh_backward(Tensor dx, Tensor dy, Tensor x) {
  op("gelu_tanh_backward", &Backend::gelu_tanh_backward, dx, dy, x);
}
void StepGraph::layernorm_modulate(Tensor y, Tensor mean, Tensor rstd, Tensor x, Tensor shift, Tensor scale,
                                   double eps) {
  op("layernorm_modulate", &Backend::layernorm_modulate, y, mean, rstd, x, shift, scale, eps);
}
void StepGraph::layernorm_modulate_backward(Tensor dx, Tensor dshift, Tensor dscale, Tensor dy, Tensor x, Tensor mean,
                                            Tensor rstd, Tensor scale, bool accumulate_dx) {
  op("layernorm_modulate_backward", &Backend::layernorm_modulate_backward, dx, dshift, dscale, dy, x, mean, rstd,
     scale, accumulate_dx);
}
void StepGraph::rmsnorm_heads(Tensor y, Tensor rstd, Tensor x, Tensor scale, double eps) {
  op("rmsnorm_heads", &Backend::rmsnorm_heads, y, rstd, x, scale, eps);
}
void StepGraph::rmsnorm_heads_backward(Tensor dx, Tensor dscale, Tensor dy, Tensor x, Tensor rstd, Tensor scale) {
  op("rmsnorm_heads_backward", &Backend::rmsnorm_heads_backward, dx, dscale, dy, x, rstd, scale);
}
void StepGraph::tokens_to_heads(Tensor heads, Tensor tokens, int64_t token_offset) {
  op("tokens_to_heads", &Backend::tokens_to_heads, heads, tokens, token_offset);
}
void StepGraph::heads_to_tokens(Tensor tokens, Tensor heads, int64_t token_offset) {
  op("heads_to_tokens", &Backend::heads_to_tokens, tokens, heads, token_offset);
}
void StepGraph::rope_table(Tensor pe, Tensor ids, std::span<const int> axes_dim, double theta) {
  op("rope_table", &Backend::rope_table, pe, ids, axes_dim, theta);
}
void StepGraph::rope(Tensor x, Tensor pe, bool inverse) { op("rope", &Backend::rope, x, pe, inverse); }
void StepGraph::qk_norm_rope_to_heads(Tensor q_heads, Tensor k_heads, Tensor v_heads, Tensor q_rstd, Tensor k_rstd,
                                      Tensor q, Tensor k, Tensor v, Tensor q_scale, Tensor k_scale, Tensor pe,
                                      int64_t token_offset, double eps) {
  op("qk_norm_rope_to_heads", &Backend::qk_norm_rope_to_heads, q_heads, k_heads, v_heads, q_rstd, k_rstd, q, k, v,
     q_scale, k_scale, pe, token_offset, eps);
}
void StepGraph::qk_norm_rope_to_heads_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dq_scale, Tensor dk_scale,
                                               Tensor dq_heads, Tensor dk_heads, Tensor dv_heads, Tensor q, Tensor k,
                                               Tensor q_rstd, Tensor k_rstd, Tensor q_scale, Tensor k_scale,
                                               Tensor pe, int64_t token_offset) {
  op("qk_norm_rope_to_heads_backward", &Backend::qk_norm_rope_to_heads_backward, dq, dk, dv, dq_scale, dk_scale,
     dq_heads, dk_heads, dv_heads, q, k, q_rstd, k_rstd, q_scale, k_scale, pe, token_offset);
}
void StepGraph::attention(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, double scale) {
  op("attention", &Backend::attention, o, lse, q, k, v, scale);
}
void StepGraph::attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v,
                                   Tensor o, Tensor lse, double scale) {
  op("attention_backward", &Backend::attention_backward, dq, dk, dv, dout, q, k, v, o, lse, scale);
}
void StepGraph::gated_residual(Tensor out, Tensor x, Tensor y, Tensor gate) {
  op("gated_residual", &Backend::gated_residual, out, x, y, gate);
}
void StepGraph::gated_residual_stats(Tensor out, Tensor mean, Tensor rstd, Tensor x, Tensor y, Tensor gate,
                                     double eps) {
  op("gated_residual_stats", &Backend::gated_residual_stats, out, mean, rstd, x, y, gate, eps);
}
void StepGraph::gated_residual_backward(Tensor dy, Tensor dgate, Tensor dx, Tensor y, Tensor gate) {
  op("gated_residual_backward", &Backend::gated_residual_backward, dy, dgate, dx, y, gate);
}
void StepGraph::timestep_embedding(Tensor out, Tensor t, double time_factor, double max_period) {
  op("timestep_embedding", &Backend::timestep_embedding, out, t, time_factor, max_period);
}
void StepGraph::concat_tokens(Tensor out, Tensor a, Tensor b) { op("concat_tokens", &Backend::concat_tokens, out, a, b); }
void StepGraph::split_tokens(Tensor a, Tensor b, Tensor in) { op("split_tokens", &Backend::split_tokens, a, b, in); }
void StepGraph::flow_match_inputs(Tensor xt, Tensor target, Tensor x0, Tensor t, uint64_t seed,
                                  std::span<const uint64_t> streams) {
  // It synchronises (the stream ids travel through a host span): never part of a graph.
  if (recording_) close_segment();
  be_.flow_match_inputs(xt, target, x0, t, seed, streams);
}
void StepGraph::mse_loss_into(Tensor loss, Tensor dpred, Tensor pred, Tensor target, double grad_scale) {
  op("mse_loss_into", &Backend::mse_loss_into, loss, dpred, pred, target, grad_scale);
}
void StepGraph::adamw(Tensor param, Tensor grad, Tensor m, Tensor v, const AdamW& h, std::span<const ParamCopy> copies,
                      std::span<const ParamCast> casts, std::span<const LowRankGrad> low_rank) {
  op("adamw", &Backend::adamw, param, grad, m, v, h, copies, casts, low_rank);
}
void StepGraph::quantize(QTensor rowwise, QTensor columnwise, Tensor x, const Quantize& q) {
  op("quantize", &Backend::quantize, rowwise, columnwise, x, q);
}
void StepGraph::transpose_codes(QTensor dst, const QTensor& src) {
  op("transpose_codes", &Backend::transpose_codes, dst, src);
}
void StepGraph::quantize_fused(QTensor rowwise, QTensor columnwise, const CastInput& in, const Quantize& q) {
  op("quantize_fused", &Backend::quantize_fused, rowwise, columnwise, in, q);
}
void StepGraph::delayed_scaling_update(Tensor amax_history, Tensor scale, Tensor scale_inv, Tensor fp8_max,
                                       AmaxAlgo algo, int margin) {
  op("delayed_scaling_update", &Backend::delayed_scaling_update, amax_history, scale, scale_inv, fp8_max, algo, margin);
}
void StepGraph::dequantize(Tensor y, const QTensor& x) { op("dequantize", &Backend::dequantize, y, x); }
void StepGraph::attention_fp8(QTensor o, Tensor lse, const QTensor& q, const QTensor& k, const QTensor& v, Shape heads,
                              double scale, const Fp8AttentionScales& sc) {
  op("attention_fp8", &Backend::attention_fp8, o, lse, q, k, v, heads, scale, sc);
}
void StepGraph::attention_fp8_backward(QTensor dq, QTensor dk, QTensor dv, const QTensor& dout, const QTensor& q,
                                       const QTensor& k, const QTensor& v, const QTensor& o, Tensor lse, Shape heads,
                                       double scale, const Fp8AttentionScales& sc) {
  op("attention_fp8_backward", &Backend::attention_fp8_backward, dq, dk, dv, dout, q, k, v, o, lse, heads, scale, sc);
}
void StepGraph::qk_norm_rope_to_heads_fp8(const Fp8Heads& q_heads, const Fp8Heads& k_heads, const Fp8Heads& v_heads,
                                          Tensor q_rstd, Tensor k_rstd, Tensor q, Tensor k, Tensor v, Tensor q_scale,
                                          Tensor k_scale, Tensor pe, int64_t token_offset, double eps) {
  op("qk_norm_rope_to_heads_fp8", &Backend::qk_norm_rope_to_heads_fp8, q_heads, k_heads, v_heads, q_rstd, k_rstd, q, k,
     v, q_scale, k_scale, pe, token_offset, eps);
}
void StepGraph::qk_norm_rope_to_heads_backward_fp8(Tensor dq, Tensor dk, Tensor dv, Tensor dq_scale, Tensor dk_scale,
                                                   const QTensor& dq_heads, const QTensor& dk_heads,
                                                   const QTensor& dv_heads, Tensor q, Tensor k, Tensor q_rstd,
                                                   Tensor k_rstd, Tensor q_scale, Tensor k_scale, Tensor pe,
                                                   int64_t token_offset) {
  op("qk_norm_rope_to_heads_backward_fp8", &Backend::qk_norm_rope_to_heads_backward_fp8, dq, dk, dv, dq_scale,
     dk_scale, dq_heads, dk_heads, dv_heads, q, k, q_rstd, k_rstd, q_scale, k_scale, pe, token_offset);
}
void StepGraph::tokens_to_heads_fp8(const Fp8Heads& heads, Tensor tokens, int64_t token_offset) {
  op("tokens_to_heads_fp8", &Backend::tokens_to_heads_fp8, heads, tokens, token_offset);
}
void StepGraph::heads_to_tokens_fp8(Tensor tokens, const QTensor& heads, int64_t token_offset) {
  op("heads_to_tokens_fp8", &Backend::heads_to_tokens_fp8, tokens, heads, token_offset);
}
void StepGraph::gemm_fp8_tn(Tensor c, const QTensor& a, const QTensor& b, Tensor bias, bool accumulate,
                            Fp8Accumulation sum) {
  op("gemm_fp8_tn", &Backend::gemm_fp8_tn, c, a, b, bias, accumulate, sum);
}

}  // namespace flux8
