#pragma once
// Every Linear of the double and single blocks runs through a LinearSite: in BF16 it is a
// plain Linear; in FP8 it casts its input, weight and output gradient per the recipe and runs
// the fprop, dgrad and wgrad GEMMs on the casts (docs/FP8.md). The model code is the same in
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

class Fp8Runtime;

enum class Operand : uint8_t { input = 0, weight = 1, grad_output = 2 };

// The FP8 format and scaling of an operand's casts under a recipe (Fp8Runtime::format, scaling):
// E5M2 gradients with hybrid; per-tensor scales (delayed, tensorwise), 1x128 blocks (128x128 for
// weights) under blockwise, 1x32 E8M0 blocks under mxfp8.
Fp8Format operand_format(const Fp8Config& fp8, Operand o);
Fp8Scaling operand_scaling(const Fp8Config& fp8, Operand o);

// A Linear's weight, bias and their gradients (views into the flat buffers), and its FP8 state.
struct LinearSite {
  std::string name;  // reference prefix, e.g. "double_blocks.0.img_attn.qkv"
  Tensor w, b, dw, db;
  ParamStore* store = nullptr;  // whose step tracks the gradient writes (null: always add)
  bool fp8 = false;
  int index = -1;        // into Fp8Runtime's tables (FP8 sites only)
  QTensor w_row, w_col;  // this step's weight casts (fprop / dgrad operands)
  int64_t w_version = -1;
  bool w_recorded = false;  // the cast's amax went into the delayed-scaling history
  bool w_counted = false;   // the cast counted its telemetry (Fp8Runtime::collect_stats)
  // A row-parallel Linear's bias is added by rank 0 of its tensor-parallel group alone (before
  // the all-reduce that sums the ranks' partial outputs); false on the other ranks.
  bool bias_in_forward = true;
  // How the weight is split over the tensor-parallel group (replicated: not split, or one rank).
  // rows: a column-parallel Linear, whose output (and its gradient) is split by columns too;
  // cols: a row-parallel one, whose input is split by columns too.
  ShardSplit split = ShardSplit::replicated;

  static LinearSite bind(ParamStore& store, const std::string& prefix);
  // For the backward about to write dw and db: false when it is their first write of the step
  // (ParamStore::first_write: overwrite, the buffer is not zero-filled), true after (add).
  bool accumulate_grads() const;
  // The weight as a BF16 GEMM takes it: the store's per-step rounded copy where it keeps one
  // (ParamStore::operand), else w.
  Tensor w_operand() const { return store ? store->operand(w) : w; }
  // The f32 weight on the backend, for its FP8 cast (ParamStore::master_on_device).
  Tensor w_master() const { return store ? store->master_on_device(w) : w; }
  // The bias as the forward GEMM writing `out` takes it (ParamStore::bias_operand), else b;
  // undefined where this rank adds no bias (bias_in_forward).
  Tensor b_operand(const Tensor& out) const {
    if (!bias_in_forward) return Tensor{};
    return store ? store->bias_operand(b, out) : b;
  }
};

// What a Linear keeps for its backward: the input itself (BF16, or FP8 with fp8_wgrad: false)
// and/or the FP8 cast of its transpose (the wgrad operand).
struct SavedLinearInput {
  Tensor full;
  QTensor cast_t;
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
void site_backward_gelu(Backend& be, Fp8Runtime* fp8, LinearSite& site, Tensor dx, Tensor dh, Tensor gelu_h, Tensor dy,
                        const SavedLinearInput& saved);
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
bool wgrad_in_fp8(const LinearSite& site, const Fp8Runtime* fp8);
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

// The scratch an FP8 site takes for rows x cols and gives back (planning; nothing with fp8 null,
// a BF16 site): the forward's rowwise cast of its `in_cols` input (cast_site_input), the
// backward's casts of its `out_cols` output gradient (site_backward_fp8: rowwise for the dgrad,
// columnwise with FP8 wgrad).
void plan_site_forward(Arena& scratch, const Fp8Config* fp8, int64_t rows, int64_t in_cols);
void plan_site_backward(Arena& scratch, const Fp8Config* fp8, int64_t rows, int64_t out_cols);

}  // namespace flux8
