#pragma once
// Every Linear of the double and single blocks runs through a LinearSite: in BF16 it is a
// plain Linear; in FP8 it casts its input, weight and output gradient per the recipe and runs
// the fprop, dgrad and wgrad GEMMs on the casts (DESIGN.md §4). The model code is the same in
// both modes; only what the site saves for the backward differs (the input's FP8 copy, which is
// where FP8 saves activation memory, or the input itself).
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "fp8/fp8_config.h"
#include "fp8/meta.h"
#include "fp8/qtensor.h"
#include "model/arena.h"
#include "model/params.h"

namespace flux8 {

class Backend;

enum class Operand : uint8_t { input = 0, weight = 1, grad_output = 2 };

// A Linear's weight, bias and their gradients (views into the flat buffers), and its FP8 state.
struct LinearSite {
  std::string name;            // reference prefix, e.g. "double_blocks.0.img_attn.qkv"
  Tensor w, b, dw, db;
  const ParamStore* store = nullptr;  // whose step tracks the gradient writes (null: always add)
  bool fp8 = false;
  int index = -1;              // into Fp8Runtime's tables (FP8 sites only)
  QTensor w_row, w_col;        // this step's weight casts (fprop / dgrad operands)
  int64_t w_version = -1;
  bool w_recorded = false;     // the cast's amax went into the delayed-scaling history
  bool w_counted = false;      // the cast counted its telemetry (Fp8Runtime::collect_stats)

  static LinearSite bind(const ParamStore& store, const std::string& prefix);
  // For the backward about to write dw and db: false when it is their first write of the step
  // (ParamStore::first_write: overwrite, the buffer is not zero-filled), true after (add).
  bool accumulate_grads() const;
  // The weight as a BF16 GEMM takes it: the store's per-step rounded copy where it keeps one
  // (ParamStore::operand), else w.
  Tensor w_operand() const { return store ? store->operand(w) : w; }
  // The bias as the GEMM writing `out` takes it (ParamStore::bias_operand), else b.
  Tensor b_operand(const Tensor& out) const { return store ? store->bias_operand(b, out) : b; }
};

// What a Linear keeps for its backward: the input itself (BF16, or FP8 with fp8_wgrad: false)
// and/or the FP8 cast of its transpose (the wgrad operand).
struct SavedLinearInput {
  Tensor full;
  QTensor cast_t;
};

// The FP8 state of a model: config, delayed-scaling registry, weight casts, telemetry.
//
// The delayed-scaling state (scales, amax histories) lives in the backend's memory — on the GPU
// the casts read their scale and max their amax into the staging row on the device, and
// end_step() updates every slot in one launch, so the host never touches it during training.
// registry() is the host mirror (names, roles, checkpoints, reports): reading it downloads the
// state when the device has moved on; changing it (restoring a checkpoint) uploads it before
// the next cast.
class Fp8Runtime {
 public:
  Fp8Runtime(const Fp8Config& cfg, Backend& backend);
  // Synchronises the backend first: casts may still hold pointers to this runtime's registry
  // and statistics (a backend may deliver them late, Backend::Quantize).
  ~Fp8Runtime();
  Fp8Runtime(const Fp8Runtime&) = delete;
  Fp8Runtime& operator=(const Fp8Runtime&) = delete;
  const Fp8Config& config() const { return cfg_; }
  // The host mirror, current when returned. The mutable one may be changed (set_state,
  // resize_history, set_allreduce_hook): the device copy is refreshed from it before its next use.
  Fp8MetaRegistry& registry();
  const Fp8MetaRegistry& registry() const;

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
  // amax (a delayed scale, 448/amax > 448, saturated them: measured, a GPU model run 0.39 off its
  // CPU twin, whose casts of the normalised P did not saturate).
  Backend::Fp8AttentionScales attention_scales(int index);

  Fp8Format format(Operand o) const;
  Fp8Scaling scaling(Operand o) const;
  // How the forward GEMMs sum (fp8_fprop_fast_accumulation); the gradient GEMMs sum in fp32.
  Fp8Accumulation fprop_accumulation() const {
    return cfg_.fprop_fast_accumulation ? Fp8Accumulation::fast : Fp8Accumulation::fp32;
  }
  Backend::Quantize quantize_args(const LinearSite& site, Operand o);

  // The rowwise casts of every FP8 site's new weight for AdamW to write (Backend::ParamCast),
  // with the next step's scales: the delayed recipe only (end_step() has run; other recipes
  // derive the scale from the new weight itself), else empty.
  std::vector<Backend::ParamCast> weight_casts(const ParamStore& store);
  // Weights changed (optimizer step): casts are redone on first use — or, cast_by_update, AdamW
  // wrote the weight_casts() and they are completed here (columnwise copies) and kept.
  void weights_updated(bool cast_by_update = false);
  // Casts a site's weight unless this step's cast is in place (and recorded, and counted when
  // the step counts telemetry).
  void ensure_weight_cast(LinearSite& site);

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
  // backward instead of after a drained device (measured 0.17 / 0.29 ms of idle a W1 / W2 step).
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
  // The scale the next cast of (site, operand) uses; for current scaling the last one used.
  float scale_of(int site, Operand o) const;

 private:
  Fp8Config cfg_;
  Backend& be_;
  Fp8MetaRegistry registry_;
  std::vector<SiteStats> stats_, last_stats_;
  std::vector<int> first_slot_;  // registry slot of the site's input (weight +1, grad +2)
  std::vector<LinearSite*> sites_;  // those with weight casts (allocate_weight_casts)
  std::vector<int> attention_slot_;  // registry slot of each attention's q (k +1, ..., dv +8)
  std::vector<AttentionCastStats> attention_stats_, last_attention_stats_;
  Arena weight_arena_;
  int64_t weight_version_ = 0;
  bool recording_ = true;
  bool collect_stats_ = true;
  bool stats_pending_ = false;  // a cast of this step was given a stats_/attention_stats_ target
  CastStats scratch_stats_;

  // The registry's state in backend memory: amax_history [L, n], scale, scale_inv, fp8_max
  // [n] (of each slot's format), and a scratch amax for casts that must not record.
  void push_state();        // host mirror -> backend, when the backend copy is not current
  void pull_state() const;  // backend -> host mirror, when the host copy is not current
  void release_state();
  // Where a cast of `slot` max-accumulates its amax: the history's staging row while recording
  // (the host mirror is then stale), else the scratch amax.
  float* amax_target(int slot);
  Tensor history_dev_, scale_dev_, scale_inv_dev_, fp8_max_dev_, scratch_amax_dev_;
  bool device_current_ = false;       // the backend copy equals the host mirror
  mutable bool host_current_ = true;  // the host mirror equals the backend copy
};

// Allocation of a Linear's saved input for a `rows x cols` input (measuring arenas too).
// `shape` is the input's shape ([B, L, K] or [B, K]).
SavedLinearInput allocate_linear_input(Arena& arena, const LinearSite& site, const Fp8Runtime* fp8, Shape shape,
                                       DType dtype);
// The buffer the producer of a Linear's input writes: the saved input itself, or (FP8 runs
// that keep only the cast) a scratch buffer that lives until the caller releases the scratch.
Tensor linear_input_buffer(Arena& scratch, const SavedLinearInput& saved, Shape shape, DType dtype);
QTensor allocate_qtensor(Arena& arena, int64_t rows, int64_t cols, Fp8Format f, Fp8Scaling s, SlotKind kind);

// y = x·wᵀ + b. `x` is the input (any ld); in FP8 the site casts it, keeps the transposed cast
// in `saved`, and the input buffer may be a temporary.
void site_forward(Backend& be, Fp8Runtime* fp8, Arena& scratch, LinearSite& site, Tensor y, Tensor x,
                  SavedLinearInput& saved);
// site_forward of the output of an element-wise op (`in`: LayerNorm + modulation, GELU). In FP8
// runs that keep only the cast of the input, the op runs inside the cast
// (Backend::quantize_fused) and its f32 output is never stored; otherwise the op writes the
// saved input (or a scratch buffer) first. LayerNorm's mean and rstd are written either way.
void site_forward_fused(Backend& be, Fp8Runtime* fp8, Arena& scratch, LinearSite& site, Tensor y,
                        const Backend::CastInput& in, SavedLinearInput& saved, DType dtype);
// Whether site_forward_fused of `site` with a LayerNorm input (CastInput::layernorm_modulate)
// runs the LayerNorm inside its FP8 input cast, computing nothing but its statistics first —
// which the gated residual before it can then write instead (Backend::gated_residual_stats,
// CastInput::statistics_ready). `saved`: the site's saved input.
bool layernorm_in_cast(const LinearSite& site, const Fp8Runtime* fp8, const SavedLinearInput& saved);
// site_forward_fused of a BF16 Linear whose last output columns go through GELU (an MLP's first
// Linear, the single block's linear1): h = x·wᵀ + b, y_gelu = gelu_tanh of h's last columns, the
// GELU in the GEMM's epilogue (Backend::linear_gelu). BF16 sites only (an FP8 site is an error):
// FP8 sites run the GELU in the cast of the second Linear's input instead (gelu_in_epilogues).
void site_forward_gelu(Backend& be, Fp8Runtime* fp8, Arena& scratch, LinearSite& site, Tensor y_gelu, Tensor h,
                       const Backend::CastInput& in, SavedLinearInput& saved, DType dtype);
// A BF16 Linear's backward (Backend::linear_backward: dx = or += dy·w, dw and db per the step's
// writes) through its store: a weight gradient the store keeps low-rank
// (ParamStore::add_low_rank_grad) takes dy's and x's rows instead of the wgrad GEMM. `w` is the
// weight as the dgrad GEMM takes it (w_operand(), or w).
void linear_backward_params(Backend& be, const LinearSite& site, Tensor dx, Tensor dy, Tensor x, Tensor w,
                            bool accumulate_dx);
// dx (= or += when accumulate_dx; may be undefined), dw and db accumulated.
void site_backward(Backend& be, Fp8Runtime* fp8, Arena& scratch, LinearSite& site, Tensor dx, Tensor dy,
                   const SavedLinearInput& saved, bool accumulate_dx);
// site_backward of a BF16 Linear whose input was [x₀ | gelu_tanh(gelu_h)] (the single block's
// linear2, an MLP's second Linear): dx = x₀'s gradient (undefined when gelu_h covers the whole
// input), dh = gelu_h's through the GELU, both overwritten (Backend::linear_dgrad_gelu), dw and
// db as site_backward's. BF16 sites only (an FP8 site is an error): FP8 sites run the GELU's
// backward in the casts of the MLP's first Linear's output gradient (gelu_in_epilogues).
void site_backward_gelu(Backend& be, Fp8Runtime* fp8, LinearSite& site, Tensor dx, Tensor dh,
                        Tensor gelu_h, Tensor dy, const SavedLinearInput& saved);
// site_backward of an output gradient made by an element-wise op (`dy`: GELU's backward, a
// gate's product). With FP8 dgrad and wgrad (wgrad_in_fp8) the op runs inside the casts of dy
// (Backend::quantize_fused) and dy is never stored; otherwise the op writes dy_buffer (dy's
// shape) first (Backend::produce: nothing to write for an identity input that is dy_buffer).
void site_backward_fused(Backend& be, Fp8Runtime* fp8, Arena& scratch, LinearSite& site, Tensor dx,
                         const Backend::CastInput& dy, Tensor dy_buffer, const SavedLinearInput& saved,
                         bool accumulate_dx);
// Whether the site runs its weight gradient in FP8 (an FP8 site with fp8_wgrad: true): it saves its
// input's transposed cast instead of the input, and site_backward_fused runs its op inside the
// casts of dy, where the op's output is never stored.
inline bool wgrad_in_fp8(const LinearSite& site, const Fp8Runtime* fp8) {
  return site.fp8 && fp8 && fp8->config().wgrad;
}
// The output gradient of a Linear whose output joins the residual stream through a gate (the
// blocks' proj, mlp_out and linear2: out = x + gate[b] ⊙ y): dgate from the residual's gradient
// `dres` and the saved y, and dy = gate[b] ⊙ dres as site_backward_fused takes it — inside the
// site's FP8 casts (CastInput::gated; `buffer` not written), or written to `buffer` in the
// same pass as dgate.
Backend::CastInput gated_branch_backward(Backend& be, const LinearSite& site, const Fp8Runtime* fp8, Tensor buffer,
                                         Tensor dgate, Tensor dres, Tensor y, Tensor gate);
// Whether an MLP (Linear, GELU, Linear) runs its GELU in the GEMMs' epilogues —
// Backend::linear_gelu in the forward, linear_dgrad_gelu in the backward: when both Linears run
// in BF16. FP8 sites run the GELU and its backward inside their casts instead (quantize_fused).
inline bool gelu_in_epilogues(const LinearSite& first, const LinearSite& second, const Fp8Runtime* fp8) {
  return !fp8 || (!first.fp8 && !second.fp8);
}

// Scratch bytes site_forward/backward need at most for a `rows x max_cols` Linear.
void plan_site_scratch(Arena& scratch, const Fp8Runtime* fp8, int64_t rows, int64_t max_cols);

}  // namespace flux8
