#include "model/attention_saved.h"

namespace flux8 {

void BlockAttentionSaved::place_recomputed(Arena& scratch, const BlockWidths& w, StepShape sh, DType heads) {
  if (att8.defined()) return;  // FP8 attention writes only its casts (kept)
  allocate_heads_qkv(scratch, w, sh, heads, SlotKind::workspace, q, k, v);
}

}  // namespace flux8
