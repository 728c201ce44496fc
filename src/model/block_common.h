#pragma once
// Pieces shared by the Flux blocks: parameter bindings and the context a block runs in.
#include <cmath>
#include <string>

#include "backend/backend.h"
#include "model/arena.h"
#include "model/flux_config.h"
#include "model/fp8_runtime.h"
#include "model/linear_site.h"
#include "model/params.h"
#include "model/tensor_parallel.h"

namespace flux8 {

// Tokens of one step: every sample has txt_tokens text tokens then img_tokens image tokens.
struct StepShape {
  int64_t batch = 1;
  int64_t txt_tokens = 0;
  int64_t img_tokens = 0;
  int64_t tokens() const { return txt_tokens + img_tokens; }
};

// A norm scale and its gradient.
struct ScaleParam {
  Tensor s, ds;
  ParamStore* store = nullptr;
  static ScaleParam bind(ParamStore& store, const std::string& name);
  // Before an op that adds to ds: zero-fills it if this is its first write of the step.
  void prepare_grad() const {
    if (store) store->zero_if_unwritten(ds);
  }
};
// The QK-norm scales of an attention whose parameters are named under `attn` (both blocks
// name them attn + "norm.query_norm.scale" and attn + "norm.key_norm.scale").
void bind_qk_norm(ParamStore& store, const std::string& attn, ScaleParam& q_norm, ScaleParam& k_norm);

// Everything a block's forward/backward needs besides its own parameters and activations.
struct BlockContext {
  Backend& be;
  const FluxConfig& cfg;
  StepShape shape;
  DType dtype;                     // activations and their gradients (Backend::activation_dtype)
  Arena& scratch;                  // temporaries; every block releases what it takes
  Tensor pe;                       // RoPE table of the joint sequence [B, L, D/2, 2]
  Tensor silu_vec;                 // SiLU(vec) [B, H], the input of every modulation Linear
  Tensor d_silu_vec;               // its gradient, accumulated by every block's backward
  Fp8Runtime* fp8 = nullptr;       // FP8 state; null in BF16 runs
  DType heads_dtype = DType::f32;  // q, k, v, o and their gradients (Backend::attention_heads_dtype)
  // Gated residuals write the row statistics of the LayerNorm that reads them next where that
  // LayerNorm runs inside an FP8 cast (Backend::gated_residual_stats; FLUX8_FUSED_NORM_STATS=0
  // turns it off, for A/B measurements).
  bool norm_stats_in_residual = true;
  // This rank's widths (the whole model's without tensor parallelism) and its tensor-parallel
  // group: the blocks sum each row-parallel Linear's output over it in the forward and each
  // column-parallel Linear's input gradient in the backward.
  BlockWidths widths;
  TensorParallel tp;
};

// Where a block writes the row statistics of an output for the LayerNorm that reads it next
// (Backend::gated_residual_stats): mean and rstd [B, L] views of that LayerNorm's saved ones
// (a column window of them for one stream's rows of the joint sequence). Undefined: the block
// writes its output alone and the LayerNorm computes its statistics itself.
struct NormStatsOut {
  Tensor mean, rstd;
  bool defined() const { return mean.defined(); }
};
// out = x + gate ⊙ y (Backend::gated_residual), and where `next` is defined the row statistics
// of out into it (Backend::gated_residual_stats) with the LayerNorm's eps.
inline void gated_residual_to(Backend& be, Tensor out, Tensor x, Tensor y, Tensor gate, const NormStatsOut& next,
                              double eps) {
  if (next.defined())
    be.gated_residual_stats(out, next.mean, next.rstd, x, y, gate, eps);
  else
    be.gated_residual(out, x, y, gate);
}
// The softmax scale of every block's attention, 1/sqrt(head dim).
inline double attention_scale(const FluxConfig& c) { return 1.0 / std::sqrt(static_cast<double>(c.head_dim())); }
// The [B, L] view of saved statistics allocated as a vector of B·L.
inline Tensor stats_rows(const Tensor& stats, int64_t B, int64_t L) {
  return Tensor(stats.data, stats.dtype, Shape{B, L});
}

// The type of saved statistics (LayerNorm mean/rstd, QK-norm rstd, attention lse, RoPE table,
// positions) next to activations of type `activations`: the compute type — f32 when the
// activations are stored in bf16 (Backend::activation_dtype), else the activations' own.
inline DType statistics_dtype(DType activations) { return activations == DType::bf16 ? DType::f32 : activations; }

// q, k and v of a block's attention in the head-major layout [B, heads, L, D], from `a`
// (selective recompute puts them in scratch for one forward or backward).
void allocate_heads_qkv(Arena& a, const BlockWidths& w, StepShape sh, DType heads, SlotKind kind, Tensor& q, Tensor& k,
                        Tensor& v);
// The head-major shape of this rank's heads: [B, heads, L, D].
inline Shape heads_shape(const BlockWidths& w, StepShape sh) { return {sh.batch, w.heads, sh.tokens(), w.head_dim}; }

// Turns FP8 amax/statistics recording off while it lives. A recomputed cast uses the step's
// scales and gives the same codes, but the forward already recorded it once.
class NoFp8Recording {
 public:
  explicit NoFp8Recording(Fp8Runtime* rt) : rt_(rt), was_(rt && rt->recording()) {
    if (rt_) rt_->set_recording(false);
  }
  ~NoFp8Recording() {
    if (rt_) rt_->set_recording(was_);
  }
  NoFp8Recording(const NoFp8Recording&) = delete;
  NoFp8Recording& operator=(const NoFp8Recording&) = delete;

 private:
  Fp8Runtime* rt_;
  bool was_;
};

// The saved input the forward hands a Linear whose input the block does not keep (`kept`
// undefined; BlockRecompute): where the site keeps its input itself (BF16, or FP8 with fp8_wgrad
// off) a scratch buffer of `shape`, written and read as the kept one would be, so the forward
// runs the same ops either way; with FP8 wgrad nothing (the cast writes only the fprop operand).
// `kept` itself where it is defined. Lives until the caller releases the scratch.
SavedLinearInput forward_linear_input(Arena& scratch, const LinearSite& site, const Fp8Runtime* fp8,
                                      const SavedLinearInput& kept, Shape shape, DType dtype);
// A Linear input the forward did not keep, rebuilt in scratch for the backward from `x`, the
// input recomputed exactly as the forward made it: `x` itself where the site keeps its input
// (BF16, or FP8 with fp8_wgrad off), else the transposed FP8 cast that site_forward would have
// kept, cast again from `x` (same scale, so same codes; not recorded). Mirrors
// allocate_linear_input.
SavedLinearInput recompute_linear_input(Backend& be, Fp8Runtime* fp8, Arena& scratch, const LinearSite& site, Tensor x);
// The same from the element-wise op that made the input (`in`: LayerNorm + modulation of a kept
// x with its kept statistics, GELU of a kept pre-activation), as site_forward_fused ran it: the
// op written to scratch, or with FP8 wgrad run inside the transposed cast alone (the input is
// never stored). A LayerNorm's statistics are written again with the values they hold.
SavedLinearInput recompute_linear_input_of(Backend& be, Fp8Runtime* fp8, Arena& scratch, const LinearSite& site,
                                           const Backend::CastInput& in, DType dtype);
// Scratch recompute_linear_input takes for a rows x cols input, besides `x` (planning).
void plan_recompute_linear_input(Arena& scratch, const Fp8Config* fp8, int64_t rows, int64_t cols);

// What a block's scratch plan allocates, `rows` tokens at a time, for a block whose Linears run
// in FP8 under `fp8` (their casts planned too), or in BF16 (fp8 null).
struct BlockScratchPlan {
  BlockScratchPlan(Arena& arena, const BlockWidths& widths, StepShape shape, DType dtype, const Fp8Config* fp8,
                   int64_t rows);
  Arena& a;
  const Fp8Config* fp8;
  const Fp8Config* modulation;         // the modulation Linear's casts (fp8_modulation), else null
  bool fp8_sites, wgrad8, attention8;  // FP8 Linears; their wgrad in FP8 (wgrad_in_fp8); FP8 attention
  int64_t rows;
  DType dtype;
  Shape heads;
  void tokens(int64_t cols) const { a.alloc(dtype, Shape{rows, cols}, SlotKind::workspace); }
  void head_tensors(int n) const;
  // A Linear input the block did not keep, rebuilt for the backward: with FP8 wgrad its cast alone
  // (recompute_linear_input_of), else the input itself.
  void recomputed_input(int64_t cols) const;
};

}  // namespace flux8
