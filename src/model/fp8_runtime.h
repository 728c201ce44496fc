#pragma once
// The FP8 state machine of a model: its config, the delayed-scaling registry (per site and
// attention: scales and amax histories), the weight casts and the cast telemetry. The Linear
// sites (linear_site.h) and the FP8 attention ask it for their casts' arguments; the trainer
// drives it once a step (end_step, weights_updated).
#include <string>
#include <vector>

#include "backend/backend.h"
#include "fp8/fp8_config.h"
#include "fp8/meta.h"
#include "fp8/qtensor.h"
#include "model/arena.h"
#include "model/linear_site.h"
#include "model/params.h"
#include "model/tensor_parallel.h"

namespace flux8 {

// The delayed-scaling state (scales, amax histories) lives in the backend's memory — on the GPU
// the casts read their scale and max their amax into the staging row on the device, and
// end_step() updates every slot in one launch, so the host never touches it during training.
// registry() and current_registry() are the host mirror (names, roles, checkpoints, reports):
// reading it downloads the state when the device has moved on; changing it (restoring a
// checkpoint) uploads it before the next cast.
class Fp8Runtime {
 public:
  // `tp`: the tensor-parallel group whose ranks split the sites' tensors (LinearSite::split).
  Fp8Runtime(const Fp8Config& cfg, Backend& backend, TensorParallel tp = {});
  // Synchronises the backend first: casts may still hold pointers to this runtime's registry
  // and statistics (a backend may deliver them late, Backend::Quantize).
  ~Fp8Runtime();
  Fp8Runtime(const Fp8Runtime&) = delete;
  Fp8Runtime& operator=(const Fp8Runtime&) = delete;
  const Fp8Config& config() const { return cfg_; }
  // The host mirror, current when returned (downloaded when the device has moved on). registry()
  // may be changed (set_state, resize_history, set_allreduce_hook): the device copy is refreshed
  // from it before its next use. current_registry() is for reading (reports, checkpoints) and
  // leaves the device copy current.
  Fp8MetaRegistry& registry();
  const Fp8MetaRegistry& current_registry();

  // Registers an FP8 site (three registry slots: input, weight, grad_output).
  void add_site(LinearSite& site);
  // Allocates the weight-cast cache for all registered sites (once).
  void allocate_weight_casts(std::vector<LinearSite*>& sites);
  // The FP8 sites, as allocate_weight_casts found them.
  const std::vector<LinearSite*>& sites() const { return sites_; }

  // FP8 attention (fp8_dot_product_attention): one attention's nine delayed-scaling slots —
  // `name`.q, .k, .v, .o as forward tensors (E4M3), .do, .ds (the scores' gradient), .dq, .dk,
  // .dv as gradients (E5M2 in hybrid) — registered; returns its index. The softmax P has no
  // slot: its scale is fixed at the format's largest value (attention_scales).
  enum class AttentionTensor : uint8_t { q, k, v, o, dout, ds, dq, dk, dv };
  int add_attention(const std::string& name);
  int attentions() const { return static_cast<int>(attention_slot_.size()); }
  // Registry slot of attention `index`'s q; its other tensors follow in AttentionTensor order.
  int attention_first_slot(int index) const { return attention_slot_[static_cast<size_t>(index)]; }
  static constexpr int kAttentionSlots = 9;
  Fp8Format attention_format(AttentionTensor t) const;
  // The delayed cast of attention `index`'s q, k, v (forward) or dout (backward); its amax is
  // recorded while recording() (else it goes to a scratch float).
  Backend::Quantize attention_cast(int index, AttentionTensor t);
  // The scales of o, dS, dq, dk, dv and where their amaxes go, for Backend::attention_fp8.
  // P has no delayed scale: the op fixes it at the format's largest value, since cuDNN's online
  // softmax casts exp(S − running max), which reaches 1 in every row whatever the normalised P's
  // amax (a delayed scale, 448/amax > 448, saturates them, where the CPU twin's casts of the
  // normalised P do not).
  Backend::Fp8AttentionScales attention_scales(int index);

  Fp8Format format(Operand o) const;
  Fp8Scaling scaling(Operand o) const;
  // How the forward GEMMs sum (fp8_fprop_fast_accumulation); the gradient GEMMs sum in fp32.
  Fp8Accumulation fprop_accumulation() const {
    return cfg_.fprop_fast_accumulation ? Fp8Accumulation::fast : Fp8Accumulation::fp32;
  }
  Backend::Quantize quantize_args(const LinearSite& site, Operand o);
  // quantize_args for the cast of `in` (the tensor as the cast reads it) as operand `o` of `site`.
  // Where that tensor is this rank's part of one split over the tensor-parallel group
  // (split_over_group) and its scale is current per-tensor (tensorwise), the whole tensor's amax
  // comes first: in's amax (Backend::cast_amax) max-reduced over the group in stream order, which
  // the cast scales by (QuantizeSpec::whole_amax) — every rank casts with one process's scale, as
  // Transformer Engine reduces amaxes over its tensor-parallel group. Every rank of the group
  // must make the same casts in the same order (the model's code does).
  Backend::Quantize cast_args(const LinearSite& site, Operand o, const Backend::CastInput& in);
  // Whether operand `o` of `site` is split over the tensor-parallel group: the weight of a split
  // Linear, the input of a row-parallel one (split along K), the output gradient of a
  // column-parallel one (split along its columns).
  bool split_over_group(const LinearSite& site, Operand o) const;

  // The rowwise casts of every FP8 site's new weight for AdamW to write (Backend::ParamCast),
  // with the next step's scales: the delayed recipe only (end_step() has run; other recipes
  // derive the scale from the new weight itself), else empty.
  std::vector<Backend::ParamCast> weight_casts(ParamStore& store);
  // Around an optimizer update: weights_changing() before it (the casts made so far are of the
  // old weights; those made from here on, by cast_forms' writer, are of the new ones) and
  // weights_updated() after it. Without weights_changing(), weights_updated() alone marks every
  // cast stale. Casts not made by then are redone at first use — or, cast_by_update, AdamW wrote
  // the weight_casts() and they are completed here (columnwise copies) and kept.
  void weights_changing();
  void weights_updated(bool cast_by_update = false);
  // Sharded masters: the writer of the sites' weight casts that ParamStore::refresh_device_forms
  // calls with each weight's gathered masters (ParamStore::CastForms), so the update makes the
  // next step's casts and no forward gathers a master — a forward one rank runs alone (a sample
  // preview) makes no collective.
  ParamStore::CastForms cast_forms(const ParamStore& store);
  // Casts a site's weight unless this step's cast is in place (and recorded, and counted when
  // the step counts telemetry; a cast that records nothing, in validation or a preview, needs
  // neither).
  void ensure_weight_cast(LinearSite& site);
  // Whether every site's weight cast is of the current weights (ensure_weight_cast casts none
  // in a forward that records nothing).
  bool weight_casts_current() const;
  // The dgrad operand of a site whose forward cast its weight this step: its kept columnwise
  // cast, or (fp8_weight_transpose: in_backward) the rowwise cast transposed into the buffer
  // every site shares — valid until the next call.
  QTensor dgrad_weight(const LinearSite& site);

  // Casts of validation passes must not move the delayed-scaling history.
  void set_recording(bool on) { recording_ = on; }
  // Whether the casts count their telemetry (non-zero, saturated, flushed elements) for
  // last_step_stats(). The amaxes (scaling) are kept either way; the counts cost the cast kernel
  // a third of its instructions, so the trainer asks for them only on the steps it reports
  // (fp8_stats_interval). On by default.
  void set_collect_stats(bool on) { collect_stats_ = on; }
  bool collect_stats() const { return collect_stats_; }
  bool recording() const { return recording_; }
  // Once per optimizer step after the backward: the delayed-scaling update of every slot on the
  // backend (after the registry's amax all-reduce hook, which gets the staging row in host
  // memory), and the step's cast statistics become `last_step_stats`. It waits for the device
  // only when this step's casts counted statistics (a backend delivers them at a
  // synchronisation): on the other steps the optimizer's gradient norm is launched behind the
  // backward instead of after a drained device (docs/PERFORMANCE.md, "Measurements behind the kernels").
  void end_step();

  struct SiteStats {
    std::string name;
    CastStats op[3];
  };
  const std::vector<SiteStats>& last_step_stats() const { return last_stats_; }
  // FP8 attention: what the casts flux8 makes itself (q, k, v; dO) saw last step, per attention
  // (the casts inside cuDNN's kernels report only their amax, in the registry).
  struct AttentionCastStats {
    CastStats q, k, v, dout;
    CastStats* of(AttentionTensor t);  // null for the casts inside cuDNN's kernels
    const CastStats* of(AttentionTensor t) const { return const_cast<AttentionCastStats*>(this)->of(t); }
  };
  const std::vector<AttentionCastStats>& last_attention_stats() const { return last_attention_stats_; }
  // The scale the next cast of (site, operand) uses; for current scaling the last one used. 0
  // where no single value is known here: block scales, and a tensorwise cast of a tensor split
  // over the tensor-parallel group (its scale came from the group's amax, its statistics are this
  // rank's part's).
  float scale_of(int site, Operand o);

 private:
  Fp8Config cfg_;
  Backend& be_;
  TensorParallel tp_;
  Tensor whole_amax_dev_;  // one f32 in backend memory: the amax cast_args reduces over the group
  Fp8MetaRegistry registry_;
  std::vector<SiteStats> stats_, last_stats_;
  std::vector<int> first_slot_;      // registry slot of the site's input (weight +1, grad +2)
  std::vector<LinearSite*> sites_;   // those with weight casts (allocate_weight_casts)
  std::vector<int> attention_slot_;  // registry slot of each attention's q (k +1, ..., dv +8)
  std::vector<AttentionCastStats> attention_stats_, last_attention_stats_;
  Arena weight_arena_;
  QTensor shared_col_;  // in_backward: the largest site's columnwise cast, reused by every site
  int64_t weight_version_ = 0;
  bool weights_changing_ = false;  // between weights_changing() and weights_updated()
  bool recording_ = true;
  bool collect_stats_ = true;
  bool stats_pending_ = false;  // a cast of this step was given a stats_/attention_stats_ target
  CastStats scratch_stats_;
  // Casts site's weight from `master` (its f32 values on the backend) as this step's cast.
  void cast_weight(LinearSite& site, const Tensor& master);

  // The registry's state in backend memory: amax_history [L, n], scale, scale_inv, fp8_max
  // [n] (of each slot's format), and a scratch amax for casts that must not record.
  void push_state();  // host mirror -> backend, when the backend copy is not current
  void pull_state();  // backend -> host mirror, when the host copy is not current
  void release_state();
  // Where a cast of `slot` max-accumulates its amax: the history's staging row while recording
  // (the host mirror is then stale), else the scratch amax.
  float* amax_target(int slot);
  Tensor history_dev_, scale_dev_, scale_inv_dev_, fp8_max_dev_, scratch_amax_dev_;
  bool device_current_ = false;  // the backend copy equals the host mirror
  bool host_current_ = true;     // the host mirror equals the backend copy
};

}  // namespace flux8
