#include "bench/op_profiler.h"

#include <algorithm>

namespace flux8 {

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
