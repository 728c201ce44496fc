#pragma once
// cuDNN's deterministic attention backward keeps dP — one bf16 value per (sample, head, query,
// key) — in its workspace, so that workspace grows with batch × heads × L². Each (sample, head)
// pair's gradients depend on that pair's q, k, v, o, dO and lse alone, so the backward can run
// as several calls over consecutive pairs of the [batch, heads, L, D] tensors and give the same
// values; the workspace then holds one call's dP. deterministic_attention_workspace_mib (the
// config key) bounds it; the memory plan counts what the bound leaves.
#include <cstdint>

namespace flux8 {

class Config;

// deterministic_attention_workspace_mib in bytes (0: no bound).
uint64_t attention_workspace_limit(const Config& cfg);

struct AttentionBackwardSplit {
  int64_t pairs_per_call = 0;  // (sample, head) pairs of one call: a divisor of batch × heads
  int64_t calls = 0;           // batch × heads / pairs_per_call
  double dp_bytes = 0;         // one call's dP: pairs_per_call × L² bf16 values
};

// The calls a deterministic backward of `batch` × `heads` heads of `seq` tokens runs as:
// one call where its dP fits `limit_bytes` or the limit is 0 (none); otherwise the largest
// divisor of batch × heads whose dP fits, at least one pair a call (whose dP may exceed the
// limit: one pair cannot be split).
AttentionBackwardSplit split_attention_backward(int64_t batch, int64_t heads, int64_t seq, uint64_t limit_bytes);

}  // namespace flux8
