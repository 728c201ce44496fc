#pragma once
// The device memory one GPU of a tensor × data-parallel training job holds (`flux8 info --tp T
// --dp D`), from the code that allocates it: the rank's parameters from ParamLayout at the
// tensor-parallel size, the AdamW moments and (sharded with them) the f32 master weights from the
// distributed optimizer's FlatSharding, the activations from FluxModel::estimate_activations at
// the tensor-parallel size. Buffers are
// counted as the CUDA backend allocates them (the "today" columns of `flux8 info`): bf16
// operand copies of the Linear weights its BF16 GEMMs read, FP8 casts of the block Linears'
// weights, f32 master weights, gradients in grad_precision, moments in adam_moment_precision.
#include <array>
#include <cstdint>

#include "model/flux_model.h"

namespace flux8 {

class Config;

// The FP8 weight casts' bytes of block Linears of `block_linear` parameters, the largest of
// `largest`: the E4M3 cast and its transpose, or with fp8_weight_transpose: in_backward the cast
// and one transpose buffer of the largest.
double fp8_weight_cast_bytes(const Config& config, int64_t block_linear, int64_t largest);

// How a job splits over its GPUs.
struct ParallelShape {
  int tp = 1;                          // tensor_model_parallel_size
  int dp = 1;                          // data-parallel ranks (the job's ranks / tp)
  bool distributed_optimizer = false;  // use_distributed_optimizer
  int world() const { return tp * dp; }
  // The AdamW moments — and with them the f32 master weights (AdamWOptimizer::master_shards) —
  // are sharded only over a data-parallel group of more than one rank.
  bool moments_sharded() const { return distributed_optimizer && dp > 1; }
};

struct MemoryPlan {
  static constexpr int kRecomputeSettings = 3;  // Recompute::none, selective, full

  ParallelShape parallel;
  StepShape shape;
  bool fp8 = false;            // the block Linears in FP8 (fp8: e4m3 or hybrid)
  bool fp8_attention = false;  // fp8_dot_product_attention with fp8
  bool bf16_activations = true;
  bool bf16_grads = false, bf16_moments = false;
  bool recompute_elementwise = true;  // the blocks that keep activations recompute element-wise results
  bool offload = false;          // optimizer_offload: moments or cpu — the moments in host memory, a chunk on the GPU
  bool offload_masters = false;  // optimizer_offload: cpu — the f32 master weights too
  bool host_update = false;      // optimizer_offload_update: host — AdamW on the host, no moments on the GPU
  int64_t model_params = 0;      // the whole model
  int64_t rank_params = 0;       // one tensor-parallel rank's (every rank of the group holds as many)
  int64_t moment_elements = 0;   // the moments of the rank that keeps most (the last rank owns the tail)

  // Bytes on one GPU.
  double operand_copies = 0;  // bf16 copies of the Linear weights not run in FP8
  double fp8_casts = 0;       // E4M3 weight and its transpose, per FP8 block-Linear weight (fp8_weight_transpose)
  // f32 parameters: all of them; offload_masters: the small ones, a chunk and a staging buffer;
  // sharded (the distributed optimizer): this rank's shard, the small ones' residents, the
  // staging buffer of the largest and the window the device forms are gathered through.
  double masters = 0;
  double gradients = 0;     // the whole local gradient buffer (reduce-scattered in place)
  double moments = 0;       // exp_avg and exp_avg_sq of moment_elements (offload: the device's chunk of each)
  double host_moments = 0;  // offload: the rank's moments in host memory
  double host_masters = 0;  // offload_masters: the rank's f32 master weights in host memory
  // A checkpoint of the distributed optimizer: the whole-buffer masters and moments its
  // data-parallel rank 0 gathers into host memory.
  double host_checkpoint = 0;
  std::array<double, kRecomputeSettings> activations{};  // saved tensors + one block's backward scratch
  double attention_workspace = 0;  // cuDNN's deterministic attention backward: dP of this rank's heads
  // A checkpoint save's buffers on the GPU beside everything else: a sharded optimizer's gather
  // buffer (AdamWOptimizer::gather_moments: optimizer_offload_chunk elements of f32), and under
  // tensor parallelism the staging of the largest split tensor (train/checkpoint_shards.h).
  double checkpoint_buffers = 0;

  double state() const { return operand_copies + fp8_casts + masters + gradients + moments; }
  double step_total(Recompute r) const;  // a training step
  double peak(Recompute r) const;        // the step or a checkpoint save, whichever is more

  // Fails naming the model and the number when the heads or the MLP width do not split over
  // parallel.tp, for sizes below 1, and for pipeline or context parallelism (not done).
  static MemoryPlan of(const Config& config, ParallelShape parallel);
};

}  // namespace flux8
