#include "bench/op_profiler.h"

#include <algorithm>

namespace flux8 {

void OpProfiler::synchronize() {
  be_.synchronize();
  for (const Pending& p : pending_) {
    Row& r = totals_[p.op];
    ++r.calls;
    r.ms += be_.timing_elapsed_ms(p.begin, p.end);
    if (p.previous_end >= 0) totals_[kIdle].ms += be_.timing_elapsed_ms(p.previous_end, p.begin);
  }
  pending_.clear();
  // The marks are released while paused (between the bench's steps); within a stretch of work
  // the last op's end mark is kept for the next op's idle time.
  if (last_end_ < 0) be_.release_timing_marks();
}

std::vector<OpProfiler::Row> OpProfiler::rows() const {
  std::vector<Row> out;
  for (const auto& [op, r] : totals_) {
    Row row = r;
    row.op = op;
    out.push_back(row);
  }
  std::sort(out.begin(), out.end(), [](const Row& a, const Row& b) { return a.ms > b.ms; });
  return out;
}

}  // namespace flux8
