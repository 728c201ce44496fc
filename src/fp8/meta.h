#pragma once
// Fp8MetaRegistry: all delayed-scaling state of a model in flat buffers (docs/FP8.md, Recipes), so one
// all-reduce covers every amax and one pass (one kernel on the GPU) updates every scale.
//
// Layout, n = number of slots, L = history length:
//   scale[n], scale_inv[n]                 init 1
//   amax_history[L * n], history-major     init 0; element (row r, slot s) at r * n + s.
// Row 0 is the staging row: the casts of the current step max their amax into it, so row 0 is
// one contiguous buffer of n floats — exactly what the MAX all-reduce over data/tensor-parallel
// ranks needs. Rows 1..L-1 are past steps, newest last. The update rule is
// delayed_update_slot() in recipe.h.
//
// A slot is one quantized GEMM operand: a Linear's input, its weight, or its grad_output,
// named by the parameter's reference name plus the role (e.g. "double_blocks.0.img_attn.qkv"
// with role weight). Per-slot cast statistics (amax, saturated and flushed counts) ride along
// for telemetry; they are not part of the recipe state and are not checkpointed.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "fp8/recipe.h"

namespace flux8 {

// What one cast saw; filled by the quantizers (quantize.h), summed over a step per slot.
struct CastStats {
  float amax = 0.0f;      // max |x| over the cast, NaN ignored
  int64_t elements = 0;   // elements cast
  int64_t nonzero = 0;    // elements with x != 0 (NaN included)
  int64_t saturated = 0;  // elements clipped: |x * scale| > fp8_saturation_bound (inf included)
  int64_t flushed = 0;    // non-zero, non-NaN elements whose code decodes to 0
  void merge(const CastStats& o);
  double saturated_fraction() const { return elements ? double(saturated) / double(elements) : 0.0; }
  double flushed_fraction() const { return nonzero ? double(flushed) / double(nonzero) : 0.0; }
};

// The recipe knobs of one update (the fp8_* config keys). Roles input and weight use
// fwd_format, grad_output uses bwd_format (fp8: e4m3 -> both E4M3; hybrid -> bwd E5M2).
struct DelayedScalingParams {
  AmaxAlgo algo = AmaxAlgo::max;
  int margin = 0;
  Fp8Format fwd_format = Fp8Format::e4m3;
  Fp8Format bwd_format = Fp8Format::e5m2;
  Fp8Format format_for(Fp8Role r) const { return r == Fp8Role::grad_output ? bwd_format : fwd_format; }
};

class Fp8MetaRegistry {
 public:
  explicit Fp8MetaRegistry(int history_len = 1024);

  // Registers a tensor; returns its slot. Names must be unique per role (error otherwise).
  // Adding a slot keeps every existing slot's state.
  int add(std::string name, Fp8Role role);
  int find(const std::string& name, Fp8Role role) const;  // -1 if absent

  int size() const { return static_cast<int>(scale_.size()); }
  int history_len() const { return history_len_; }
  const std::string& name(int slot) const { return names_[slot]; }
  Fp8Role role(int slot) const { return roles_[slot]; }

  // The scale a cast this step uses, and its inverse (what the FP8 tensor records).
  float scale(int slot) const { return scale_[slot]; }
  float scale_inv(int slot) const { return scale_inv_[slot]; }

  // Max-accumulates an amax into the staging row (NaN ignored).
  void record_amax(int slot, float amax);
  // record_amax(stats.amax) plus the telemetry counts of this step.
  void record_cast(int slot, const CastStats& stats);

  // Called by update() with the staging row (n contiguous floats) before any slot is updated;
  // it must MAX-reduce the row across ranks in place. Unset: a no-op (one process).
  void set_allreduce_hook(std::function<void(float* row0, int n)> hook) { allreduce_ = std::move(hook); }
  // Fp8Runtime runs the update on its backend (Backend::delayed_scaling_update) and calls the
  // hook itself, with the staging row copied to host memory and back.
  const std::function<void(float*, int)>& allreduce_hook() const { return allreduce_; }

  // Once per optimizer step, after all casts: all-reduce row 0, then delayed_update_slot() for
  // every slot, each with fp8_max of its role's format — the host reference of what Fp8Runtime
  // runs as Backend::delayed_scaling_update over its backend copy of these buffers (training
  // does not call this; its telemetry is Fp8Runtime::last_step_stats). Also closes the step's telemetry:
  // step_stats() then returns this step's counts and the counters restart at zero.
  // Returns the number of slots whose history rolled (slots cast this step).
  int update(const DelayedScalingParams& params);

  const CastStats& step_stats(int slot) const { return step_stats_[slot]; }

  // Changes the history length (restoring a checkpoint made with another fp8_amax_history_len).
  // The staging row stays row 0. Shorter: the newest L-1 past rows are kept (the oldest drop,
  // as if they had rolled out). Longer: zero rows are added on the oldest side (zeros are
  // ignored by the max, like steps that never happened). TE differs: it keeps the FIRST rows
  // (dropping the newest) and pads zeros at the newest end.
  void resize_history(int history_len);

  // Flat buffers, for checkpoints and for copying to the device.
  const std::vector<float>& scales() const { return scale_; }
  const std::vector<float>& scale_invs() const { return scale_inv_; }
  const std::vector<float>& amax_history() const { return amax_history_; }
  float history_at(int row, int slot) const { return amax_history_[size_t(row) * size_t(size()) + size_t(slot)]; }
  float* amax_history_data() { return amax_history_.data(); }
  float* scale_data() { return scale_.data(); }
  float* scale_inv_data() { return scale_inv_.data(); }

  // Restores the state of all slots (in slot order, as the accessors return it). history must
  // hold history_len * size() floats, history-major; history_len may differ from the current
  // length (then resize_history semantics apply). scale_inv is recomputed as 1/scale. A
  // non-finite or non-positive scale is an error naming the slot.
  void set_state(const std::vector<float>& scale, const std::vector<float>& amax_history, int history_len);

 private:
  int history_len_;
  std::vector<std::string> names_;
  std::vector<Fp8Role> roles_;
  std::vector<float> scale_, scale_inv_, amax_history_;
  std::vector<CastStats> cur_stats_, step_stats_;
  std::function<void(float*, int)> allreduce_;
};

}  // namespace flux8
