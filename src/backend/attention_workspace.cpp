#include "backend/attention_workspace.h"

#include "config/config.h"
#include "core/error.h"

namespace flux8 {

uint64_t attention_workspace_limit(const Config& cfg) {
  return static_cast<uint64_t>(cfg.get_int("deterministic_attention_workspace_mib")) << 20;
}

AttentionBackwardSplit split_attention_backward(int64_t batch, int64_t heads, int64_t seq, uint64_t limit_bytes) {
  FLUX8_CHECK(batch >= 0 && heads >= 0 && seq >= 0, "split_attention_backward: negative size [{}, {}, {}]", batch,
              heads, seq);
  const int64_t pairs = batch * heads;
  const double pair_bytes = 2.0 * static_cast<double>(seq) * static_cast<double>(seq);
  AttentionBackwardSplit s{pairs, pairs > 0 ? 1 : 0, pair_bytes * static_cast<double>(pairs)};
  if (limit_bytes == 0 || pairs <= 1 || s.dp_bytes <= static_cast<double>(limit_bytes)) return s;
  int64_t best = 1;
  for (int64_t g = 1; g <= pairs; ++g)
    if (pairs % g == 0 && pair_bytes * static_cast<double>(g) <= static_cast<double>(limit_bytes)) best = g;
  return AttentionBackwardSplit{best, pairs / best, pair_bytes * static_cast<double>(best)};
}

}  // namespace flux8
