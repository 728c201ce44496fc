#pragma once
// The whole Flux transformer (docs/FLUX.md): embedders, double blocks on separate text/image
// streams, single blocks on the joint sequence, final layer; forward and hand-written
// backward. Activations are carved from planned arenas; nothing is allocated inside a step.
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/arena.h"
#include "model/block_common.h"
#include "model/double_block.h"
#include "model/final_gradients.h"
#include "model/single_block.h"
#include "model/tensor_parallel.h"

namespace flux8 {

// Inputs as backend tensors in the model dtype. They must stay valid until backward().
struct FluxInputs {
  Tensor img;        // [B, Li, in_channels] packed latent patches
  Tensor img_ids;    // [B, Li, 3] positions (0, row, col)
  Tensor txt;        // [B, Lt, context_dim] text encoder features
  Tensor txt_ids;    // [B, Lt, 3] (zeros for Flux)
  Tensor timesteps;  // [B] in [0, 1]
  Tensor y;          // [B, vec_dim] pooled text embedding
  Tensor guidance;   // [B], guidance_embed models only
};

// Sizes of one training step's activation memory, from the same code that allocates it.
struct ActivationEstimate {
  ArenaUsage saved;                // kept from forward to backward
  ArenaUsage saved_fp8_attention;  // ... with fp8_dot_product_attention in every block
  // The block scratch FluxModel::plan reserves (bytes: the backward's temporaries, one block at a
  // time, and the model's backward buffers), with bf16 and with f32 activations: BF16 Linears;
  // FP8 Linears, their casts included (the recipe estimate_activations was given); the same with
  // FP8 attention.
  struct Scratch {
    double bf16 = 0, f32 = 0;
  };
  Scratch workspace, workspace_fp8, workspace_fp8_attention;
  const Scratch& scratch(bool fp8, bool fp8_attention = false) const {
    return !fp8 ? workspace : fp8_attention ? workspace_fp8_attention : workspace_fp8;
  }
  double gpu_bytes(bool fp8, bool fp8_attention = false) const {
    return (fp8 && fp8_attention ? saved_fp8_attention : saved).gpu_bytes(fp8) + scratch(fp8, fp8_attention).bf16;
  }
  // With f32 activation storage (activation_precision: f32): f32 activations and workspace (an
  // upper bound: on the cuDNN path the attention heads q, k, v, o are bf16 all the same).
  double f32_bytes(bool fp8) const { return saved.bytes(4.0, fp8) + scratch(fp8).f32; }
};

struct EmbedderSaved;
struct ModelSaved;

// recompute_granularity. none: every block keeps its activations from forward to backward — with
// recompute_elementwise (RecomputePolicy::elementwise, the default) all but the element-wise and
// layout results its backward can redo without a GEMM (BlockRecompute: q, k, v, the attention and
// GELU outputs and the LayerNorm outputs that feed a Linear, the double block's x_mid).
// selective: every block keeps them except q, k, v and the attention/GELU outputs that feed a
// Linear (see DoubleBlockSaved, SingleBlockSaved), and with recompute_elementwise the rest of
// none's list too; the block's backward recomputes those in scratch with no GEMM and no
// attention forward. full: only each block's input is kept; the backward runs the block's
// forward again (into one reused region, where the block keeps everything) right before its
// backward — activation memory of one block instead of all, for one more forward pass. Results
// are bit-identical (the same ops on the same inputs; FP8 casts reuse the step's scales and are
// not recorded twice) — but for a recomputed GELU where the forward's ran in a GEMM epilogue
// (docs/MEMORY.md).
enum class Recompute : uint8_t { none, selective, full };
// From the recompute_granularity key's value.
Recompute recompute_from_name(const std::string& name);

// Which blocks recompute (Megatron's recompute_method block with recompute_num_layers N): the
// first `blocks` blocks, double blocks counted first, then single, take `granularity`; the rest
// keep every activation (but, with `elementwise`, the element-wise results). A Recompute alone
// applies to every block.
struct RecomputePolicy {
  Recompute granularity = Recompute::none;
  int64_t blocks = std::numeric_limits<int64_t>::max();
  bool elementwise = true;  // recompute_elementwise
  RecomputePolicy() = default;
  RecomputePolicy(Recompute g) : granularity(g) {}  // NOLINT: every block, where a Recompute was given
  RecomputePolicy(Recompute g, int64_t first_blocks) : granularity(g), blocks(first_blocks) {}
  RecomputePolicy(Recompute g, int64_t first_blocks, bool elementwise_results)
      : granularity(g), blocks(first_blocks), elementwise(elementwise_results) {}
  Recompute of_block(int64_t index) const { return index < blocks ? granularity : Recompute::none; }
  // What a block that keeps its activations (none, selective) rebuilds in its backward; a block
  // under full keeps everything in its one recomputed region.
  BlockRecompute saved_by_block(int64_t index) const;
  bool operator==(const RecomputePolicy&) const = default;
};

class FluxModel {
 public:
  // With an enabled Fp8Config the block Linears (and optionally the modulation Linears) run in
  // FP8 as the recipe says; FP8 needs dtype f32.
  // tp: the tensor-parallel group this model is one rank of (model/tensor_parallel.h): its
  // parameters are this rank's shards (ParamLayout::build) and its blocks run the group's
  // collectives. Every rank of the group calls forward() and backward() with the same inputs
  // and the same output gradient, and gets the same prediction; the gradients it leaves are
  // its shards' and the replicated tensors' whole ones (the same on every rank).
  // masters: a host backend to keep the f32 master weights on (optimizer_offload: cpu; null: the
  // backend keeps them) — the model then reads their device forms (ParamStore). shards: the
  // masters sharded over a data-parallel group (use_distributed_optimizer), read through their
  // device forms too.
  FluxModel(const FluxConfig& cfg, Backend& backend, DType dtype = DType::f32, const Fp8Config* fp8 = nullptr,
            RecomputePolicy recompute = Recompute::none, TensorParallel tp = {}, Backend* masters = nullptr,
            MasterShards shards = {});
  ~FluxModel();

  const FluxConfig& config() const { return cfg_; }
  ParamStore& params() { return *params_; }
  Backend& backend() { return be_; }
  DType dtype() const { return dtype_; }
  DType activation_dtype() const { return act_dtype_; }
  const TensorParallel& tensor_parallel() const { return tp_; }
  const BlockWidths& block_widths() const { return widths_; }

  // Reserves activation memory for steps up to this shape. forward() re-plans if a larger
  // shape arrives; training plans once so the step never allocates.
  void plan(StepShape max_shape);
  // Bytes of the block scratch arena: what plan() reserved, and the most in use at once since.
  size_t scratch_reserved() const { return scratch_arena_.capacity(); }
  size_t scratch_peak() const { return scratch_arena_.peak(); }

  // Returns pred [B, Li, out_channels], valid until the next forward.
  Tensor forward(const FluxInputs& in);
  // Accumulates the parameter gradients of a loss whose gradient w.r.t. pred is dpred.
  // `final`: this backward is the step's last (its last micro-batch); `final` hears of each part
  // of the model whose gradients are then complete — after each block, the final layer, the input
  // Linears and each embedder. Under tensor parallelism the blocks' partial QK-norm gradients are
  // then summed over the group block by block (the same sums as the one all-reduce otherwise), so
  // that a block's gradients are final when its backward ends.
  void backward(const Tensor& dpred, FinalGradients* final = nullptr);

  // Per rank of a tensor-parallel group of tp_size ranks (1: the whole model). fp8: the recipe
  // whose casts the FP8 scratch plans (null: delayed scaling, E4M3, fp8_wgrad on).
  static ActivationEstimate estimate_activations(const FluxConfig& cfg, StepShape shape,
                                                 RecomputePolicy recompute = Recompute::none, int tp_size = 1,
                                                 const Fp8Config* fp8 = nullptr);
  const RecomputePolicy& recompute() const { return recompute_; }

  // FP8 state (null in BF16 runs).
  Fp8Runtime* fp8() { return fp8_.get(); }
  // Around each optimizer update (FP8; no-ops in BF16):
  //   before_optimizer_step(): the delayed-scaling update of every FP8 tensor (the step's
  //     amaxes are all in), so the next step's scales are known when the weights change;
  //   weight_casts(): the FP8 casts of the new weights for AdamW to write with them (delayed
  //     recipe; empty otherwise), with the next step's scales;
  //   after_optimizer_step(casts_written, applied): those casts made the weights' current ones
  //     (their columnwise copies transposed from them), or, when AdamW did not write them (no
  //     update, another recipe), the weights cast afresh at their first use. With sharded
  //     masters the update's refresh of the device forms casts them (Fp8Runtime::cast_forms),
  //     and a step without an update (applied false) casts them again with the new scales.
  void before_optimizer_step();
  std::vector<Backend::ParamCast> weight_casts();
  void after_optimizer_step(bool casts_written, bool applied = true);

 private:
  // Parts of forward(), on shape_ and saved_.
  void embed_conditioning(const FluxInputs& in, const Tensor& x_y);
  void run_blocks();
  BlockContext block_context(const Tensor& d_silu_vec);
  // Tensor parallelism: the QK-norm scales' gradients (ParamShard::reduce_grad) are accumulated
  // by the blocks into partial_grads_, this backward's part alone, which the end of the
  // backward sums over the group (one all-reduce for all of them) and adds to the gradients.
  void bind_partial_grads();
  // partial_[first, first + count): the scales of one block when the backward reports final
  // gradients (block by block), all of them otherwise.
  void reduce_partial_grads(size_t first, size_t count);
  // Tells `final` (when set) that the parameters of `part` are final, after summing the part's
  // partial gradients over the tensor-parallel group.
  struct FinalPart {
    std::vector<size_t> params;                   // layout indices
    size_t partial_first = 0, partial_count = 0;  // its QK-norm scales in partial_
  };
  void report_final(FinalGradients* final, const FinalPart& part);
  void plan_final_parts();
  // Tensor parallelism runs collectives between the blocks' ops, which a step graph
  // (backend/step_graph.h, cuda_graph) would neither capture nor replay: refused with it.
  void check_no_step_graph() const;

  FluxConfig cfg_;
  Backend& be_;
  TensorParallel tp_;
  BlockWidths widths_;
  DType dtype_;        // parameters, inputs, pred and dpred
  DType act_dtype_;    // activations and their gradients: Backend::activation_dtype(dtype_)
  DType heads_dtype_;  // attention q, k, v, o and their gradients: Backend::attention_heads_dtype
  RecomputePolicy recompute_;
  bool norm_stats_in_residual_ = true;  // BlockContext::norm_stats_in_residual (FLUX8_FUSED_NORM_STATS)
  std::unique_ptr<ParamStore> params_;
  std::vector<DoubleBlockParams> double_params_;
  std::vector<SingleBlockParams> single_params_;
  std::unique_ptr<Fp8Runtime> fp8_;
  struct PartialGrad {
    Tensor grad, part;  // the parameter's gradient; this backward's part of it (in partial_grads_)
  };
  void* partial_grads_ = nullptr;
  Tensor partial_flat_;
  std::vector<PartialGrad> partial_;
  // The parts of the model whose gradients become final together: each block's, and by name the
  // final layer's ("final_layer"), the input Linears' ("inputs": img_in, txt_in) and each
  // embedder's ("time_in", ...).
  std::vector<FinalPart> double_parts_, single_parts_;
  std::unordered_map<std::string, FinalPart> final_parts_;
  Arena saved_arena_, scratch_arena_;
  StepShape planned_{0, 0, 0};
  StepShape shape_{0, 0, 0};
  FluxInputs inputs_;
  std::unique_ptr<ModelSaved> saved_;
};

}  // namespace flux8
