#include "bench/op_profiler.h"

#include <algorithm>

namespace flux8 {

void OpProfiler::synchronize() {
  be_.synchronize();
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
