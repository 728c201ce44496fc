#pragma once
// Activation memory. Every tensor a step needs is carved out of one allocation, in an order
// fixed by the model code, so nothing is allocated inside the step. The same allocation code
// runs in a *measuring* arena (no memory, just sizes) to plan capacity up front and to tell
// `flux8 info` what a step will need. Each slot is tagged with what it holds, because the
// precision the GPU would store it in (and so its size) depends on that.
#include <cstddef>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace flux8 {

class Backend;

enum class SlotKind : uint8_t {
  linear_input,  // saved input of a block Linear, needed for wgrad (FP8-eligible)
  activation,    // other saved activations (bf16 on the GPU)
  statistic,     // per-row statistics: LayerNorm mean/rstd, RMS rstd, softmax lse (fp32)
  workspace,     // temporaries of one block's backward
  fp8_heads,     // attention heads kept as FP8 codes (fp8_dot_product_attention): 1 byte
};

struct ArenaUsage {
  int64_t elements[5] = {0, 0, 0, 0, 0};  // per SlotKind
  // Bytes if activations were stored as on the GPU: bf16 everywhere, or FP8 (1 byte) for
  // linear inputs; statistics fp32 (activation_precision: bf16; with f32: bytes(4, ...)).
  double gpu_bytes(bool fp8_linear_inputs) const { return bytes(2.0, fp8_linear_inputs); }
  // With `element_bytes` per stored element (statistics always fp32; FP8 linear inputs 1 byte).
  double bytes(double element_bytes, bool fp8_linear_inputs) const;
};

class Arena {
 public:
  // A measuring arena: allocations return views with null data and only count sizes.
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena();

  // Gives the arena `bytes` of backend memory (replacing any previous memory).
  void reserve(Backend& backend, size_t bytes);
  bool measuring() const { return base_ == nullptr; }

  Tensor alloc(DType dtype, Shape shape, SlotKind kind);
  size_t mark() const { return used_; }
  void release_to(size_t mark);  // frees everything allocated after mark
  void reset() { release_to(0); }

  size_t used() const { return used_; }
  size_t peak() const { return peak_; }
  size_t capacity() const { return capacity_; }
  // What the live slots hold now, and what they held when the arena was at its peak (the
  // footprint to report when regions are released and reused, as with recomputation).
  const ArenaUsage& usage() const { return usage_; }
  const ArenaUsage& peak_usage() const { return peak_usage_; }

 private:
  struct Slot {
    size_t offset;
    SlotKind kind;
    int64_t elements;
  };
  Backend* backend_ = nullptr;
  char* base_ = nullptr;
  size_t capacity_ = 0, used_ = 0, peak_ = 0;
  ArenaUsage usage_, peak_usage_;
  std::vector<Slot> slots_;  // live slots, in allocation order (release_to pops them)
};

}  // namespace flux8
