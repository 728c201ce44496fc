#include "bench/op_profiler.h"

#include <algorithm>

namespace flux8 {

void OpProfiler::synchronize() {
  be_.synchronize();
  if (pending_.empty()) return;
  Row& idle = totals_[kIdle];
  for (size_t i = 0; i < pending_.size(); ++i) {
    const Pending& p = pending_[i];
    Row& r = totals_[p.op];
    ++r.calls;
    r.ms += be_.timing_elapsed_ms(p.begin, p.end);
    // Only between ops of one stretch of work: a paused stretch (the bench's data upload) may
    // lie between two synchronize() calls but never between two pending ops.
    if (i > 0) idle.ms += be_.timing_elapsed_ms(pending_[i - 1].end, p.begin);
  }
  pending_.clear();
  be_.release_timing_marks();
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
