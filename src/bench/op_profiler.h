#pragma once
// Times every op of a backend: the per-op breakdown of a training step (`flux8 bench --profile`),
// as an op interceptor (backend/ops.h). Each op is bracketed by two timing marks of the
// wrapped backend (Backend::timing_mark: on the GPU, events in its stream), and nothing waits:
// the step runs as it would unprofiled. At each synchronize() the marks are read: an op's row
// is the device time from its first to its last work (with the launch gaps inside it where the
// GPU waited for the host), and the device time between one op's end and the next one's start
// — the GPU idle, waiting for the host (launches, host synchronisations, host work) — goes to
// the row kIdle, across synchronize() calls too, and by the op each wait ended with
// (idle_before(): where the device waited — after a host synchronisation, on short launches);
// not across a pause (the bench's data upload between steps), where the marks are released.
// On the CPU the marks are the host clock (its ops finish before they return), which gives the
// same rows.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace flux8 {

class OpProfiler final : public OpInterceptor {
 public:
  // Installs itself as `be`'s op interceptor until destroyed.
  explicit OpProfiler(Backend& be);
  ~OpProfiler() override;
  OpProfiler(const OpProfiler&) = delete;
  OpProfiler& operator=(const OpProfiler&) = delete;

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
  void reset();
  // While paused, ops run untimed (the bench uploads each batch outside the step's clock), and
  // the time from the last op before to the first op after is nobody's.
  void pause(bool paused) {
    if (paused) last_end_ = -1;
    paused_ = paused;
  }
  // The row an op call is counted in: its name, with the fused casts by what they fuse and the
  // forward FP8 GEMMs (fast accumulation) apart.
  static std::string row_name(const AnyOp& op);

  // Times `f` — a collective, which the backend does not see as an op — as one call of row
  // `row`: the device time between a mark before it and one after it, the ops it issues itself
  // (a host-staged collective's copies) counted in it, not apart.
  void time_call(std::string row, const std::function<void()>& f);

  // OpInterceptor: each op runs at once between two timing marks; upload and download are timed
  // as rows of their own; synchronize reads the marks into the rows.
  double intercept(Ops& ops, AnyOp&& op) override;
  void host_access(HostAccess what, const std::function<void()>& access) override;

 private:
  template <typename F>
  void timed(std::string op, F&& f);
  void read_marks();  // after a synchronisation: the marks of the ops since the last one

  struct Pending {
    std::string op;
    int64_t previous_end, begin, end;  // timing marks; previous_end −1: no op before it to measure from
  };
  Backend& be_;
  bool paused_ = false;
  int inside_call_ = 0;    // time_call's depth: the ops issued inside a timed call are its own
  int64_t last_end_ = -1;  // the last timed op's end mark (−1 after a pause or reset)
  std::map<std::string, Row> totals_;
  std::map<std::string, Row> idle_before_;  // kIdle by the op after the wait
  std::vector<Pending> pending_;            // ops timed since the last synchronize(), in call order
};

}  // namespace flux8
