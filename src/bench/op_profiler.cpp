#include "bench/op_profiler.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <type_traits>

namespace flux8 {

OpProfiler::OpProfiler(Backend& be) : be_(be) { be_.set_interceptor(this); }

OpProfiler::~OpProfiler() { be_.set_interceptor(nullptr); }

void OpProfiler::reset() {
  totals_.clear();
  idle_before_.clear();
  pending_.clear();
  last_end_ = -1;
  be_.release_timing_marks();
}

namespace {

// A row is named by its op, except where the op's name alone would hide what the row times: the
// FP8 casts and their inputs, the fast-accumulation GEMM, and the two reductions whose rows keep
// their short names.
template <typename Op>
std::string op_row_name(const Op&) {
  return std::string(Op::name);
}
std::string op_row_name(const std::monostate&) { return ""; }
std::string op_row_name(const op::Quantize&) { return "quantize (fp8 cast)"; }
std::string op_row_name(const op::QkNormRopeToHeadsFp8&) { return "qk_norm_rope_to_heads_fp8 (+ fp8 casts)"; }
std::string op_row_name(const op::TokensToHeadsFp8&) { return "tokens_to_heads_fp8 (+ fp8 cast)"; }
std::string op_row_name(const op::MseLossInto&) { return "mse_loss"; }
std::string op_row_name(const op::GradientSumSquares&) { return "sum_squares"; }

std::string op_row_name(const op::GemmFp8Tn& o) {
  return o.sum == Fp8Accumulation::fast ? "gemm_fp8_tn (fast accumulation)" : "gemm_fp8_tn";
}

std::string op_row_name(const op::QuantizeFused& o) {
  constexpr std::string_view kInputs[] = {"identity", "gelu_tanh", "layernorm_modulate", "gelu_tanh_backward", "gated"};
  static_assert(static_cast<int>(CastInput::Op::gated) == std::size(kInputs) - 1);
  const std::string_view input = kInputs[static_cast<int>(o.in.op)];
  return o.in.head.defined() ? fmt::format("quantize_fused ([head | {}] + fp8 cast)", input)
                             : fmt::format("quantize_fused ({} + fp8 cast)", input);
}

}  // namespace

std::string OpProfiler::row_name(const AnyOp& op) {
  return std::visit([](const auto& o) { return op_row_name(o); }, op);
}

template <typename F>
void OpProfiler::timed(std::string op, F&& f) {
  if (paused_ || inside_call_ > 0) {
    f();
    return;
  }
  const int64_t begin = be_.timing_mark();
  f();
  const int64_t end = be_.timing_mark();
  pending_.push_back(Pending{std::move(op), last_end_, begin, end});
  last_end_ = end;
}

void OpProfiler::time_call(std::string row, const std::function<void()>& f) {
  timed(std::move(row), [&] {
    ++inside_call_;
    try {
      f();
    } catch (...) {
      --inside_call_;
      throw;
    }
    --inside_call_;
  });
}

double OpProfiler::intercept(Ops& ops, AnyOp&& op) {
  double result = 0;
  timed(row_name(op), [&] { result = ops.execute_any(op); });
  return result;
}

void OpProfiler::host_access(HostAccess what, const std::function<void()>& access) {
  switch (what) {
    case HostAccess::upload:
    case HostAccess::download: timed(std::string(host_access_name(what)), access); return;
    case HostAccess::synchronize:
      access();
      read_marks();
      return;
    default: access(); return;
  }
}

void OpProfiler::read_marks() {
  for (const Pending& p : pending_) {
    Row& r = totals_[p.op];
    ++r.calls;
    r.ms += be_.timing_elapsed_ms(p.begin, p.end);
    if (p.previous_end < 0) continue;
    const double idle = be_.timing_elapsed_ms(p.previous_end, p.begin);
    totals_[kIdle].ms += idle;
    Row& before = idle_before_[p.op];
    ++before.calls;
    before.ms += idle;
  }
  pending_.clear();
  // The marks are released while paused (between the bench's steps); within a stretch of work
  // the last op's end mark is kept for the next op's idle time.
  if (last_end_ < 0) be_.release_timing_marks();
}

namespace {

std::vector<OpProfiler::Row> by_time(const std::map<std::string, OpProfiler::Row>& rows) {
  std::vector<OpProfiler::Row> out;
  for (const auto& [op, r] : rows) {
    OpProfiler::Row row = r;
    row.op = op;
    out.push_back(row);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.ms > b.ms; });
  return out;
}

}  // namespace

std::vector<OpProfiler::Row> OpProfiler::rows() const { return by_time(totals_); }

std::vector<OpProfiler::Row> OpProfiler::idle_before() const { return by_time(idle_before_); }

}  // namespace flux8
