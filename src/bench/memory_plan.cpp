#include "bench/memory_plan.h"

#include <algorithm>
#include <limits>

#include "backend/attention_workspace.h"
#include "config/config.h"
#include "core/error.h"
#include "fp8/fp8_config.h"
#include "model/params.h"
#include "model/tensor_parallel.h"
#include "train/data_parallel.h"

namespace flux8 {

double MemoryPlan::step_total(Recompute r) const {
  return state() + activations[static_cast<size_t>(r)] + attention_workspace;
}

double MemoryPlan::peak(Recompute r) const { return step_total(r) + checkpoint_buffers; }

double fp8_weight_cast_bytes(const Config& config, int64_t block_linear, int64_t largest) {
  if (!weights_transposed_in_backward(config)) return 2.0 * static_cast<double>(block_linear);
  return static_cast<double>(block_linear + largest);
}

MemoryPlan MemoryPlan::of(const Config& config, ParallelShape parallel) {
  if (parallel.tp < 1 || parallel.dp < 1)
    fail("a memory plan needs at least one tensor-parallel and one data-parallel rank (got {} x {})", parallel.tp,
         parallel.dp);
  // The splits flux8 does not make (train/train_config.cpp refuses them the same way).
  for (const char* key : {"pipeline_model_parallel_size", "context_parallel_size"})
    if (config.get_int(key) != 1)
      fail("{} is {} ({}): flux8 splits a model over tensor- and data-parallel ranks only; set it to 1", key,
           config.get_int(key), config.source(key));
  MemoryPlan p;
  p.parallel = parallel;
  const FluxConfig cfg = FluxConfig::from_config(config);
  check_tensor_parallel(cfg, parallel.tp);
  p.shape =
      StepShape{config.get_int("micro_batch_size"), cfg.text_seq_len, cfg.image_tokens(config.get_int("image_size"))};
  const Fp8Config fp8 = Fp8Config::from_config(config);
  p.fp8 = fp8.enabled;
  p.fp8_attention = p.fp8 && config.get_bool("fp8_dot_product_attention");
  p.bf16_activations = config.get_string("activation_precision") == "bf16";
  p.bf16_grads = config.get_string("grad_precision") == "bf16";
  p.bf16_moments = config.get_string("adam_moment_precision") == "bf16";

  // Every rank of a tensor-parallel group holds as many parameters (whole heads and equal MLP
  // slices, the rest replicated): rank 0's layout stands for all.
  const ParamLayout layout = ParamLayout::build(cfg, 0, parallel.tp);
  int64_t block_linear = 0, linear_weight = 0, largest_block_linear = 0;
  for (const ParamInfo& info : layout.params()) {
    if (info.block_linear) block_linear += info.shape.numel();
    if (info.block_linear) largest_block_linear = std::max(largest_block_linear, info.shape.numel());
    if (info.linear_weight) linear_weight += info.shape.numel();
  }
  p.model_params = ParamLayout::build(cfg).total();
  p.rank_params = layout.total();
  const double P = static_cast<double>(p.rank_params);

  // The CUDA backend's buffers: FP8 block Linears keep their weight's E4M3 cast and its transpose
  // (or, fp8_weight_transpose: in_backward, one transpose buffer of the largest) instead of a bf16
  // copy; every other Linear weight keeps a bf16 copy.
  p.fp8_casts = p.fp8 ? fp8_weight_cast_bytes(config, block_linear, largest_block_linear) : 0.0;
  p.operand_copies = 2.0 * static_cast<double>(linear_weight - block_linear * (p.fp8 ? 1 : 0));
  p.masters = 4.0 * P;
  p.gradients = (p.bf16_grads ? 2.0 : 4.0) * P;
  const double moment_bytes = p.bf16_moments ? 4.0 : 8.0;  // two moments
  int64_t largest = 0, small = 0, largest_split = 0, largest_shard = 0;
  for (const ParamInfo& info : layout.params()) {
    largest = std::max(largest, info.shape.numel());
    if (!info.linear_weight) small += info.shape.numel();
    if (!info.shard.sharded()) continue;
    largest_split = std::max(largest_split, info.shard.full.numel());
    largest_shard = std::max(largest_shard, info.shape.numel());
  }
  const int64_t offload_chunk = config.get_int("optimizer_offload_chunk");
  // Tensor parallelism: a save stages the largest split tensor's shards from every rank (and, for
  // state gathered into host memory, this rank's shard of it).
  const double tp_staging = 4.0 * static_cast<double>(largest_split);
  p.checkpoint_buffers = tp_staging;
  if (parallel.moments_sharded()) {
    const FlatSharding sharding = FlatSharding::of(p.rank_params, parallel.dp);
    p.moment_elements = sharding.owned(parallel.dp - 1).count;
    // The masters of this rank's shard; the f32 residents of the small parameters, the staging
    // buffer of the largest (init, FP8 casts of gathered masters) and the forms' gather window
    // (ParamStore MasterShards).
    p.masters = 4.0 * static_cast<double>(p.moment_elements + small + largest +
                                          std::max(ParamStore::kFormsWindowElements, largest));
    // The save's gather buffer (AdamWOptimizer::gather_to_lead): a piece of every rank's shard.
    const int64_t piece =
        std::max<int64_t>(64, std::min(offload_chunk / parallel.dp, (p.moment_elements + 63) / 64 * 64) / 64 * 64);
    p.checkpoint_buffers =
        std::max(tp_staging + 4.0 * static_cast<double>(largest_shard), 4.0 * static_cast<double>(piece * parallel.dp));
    p.host_checkpoint = (4.0 + moment_bytes) * P;
  } else {
    p.moment_elements = p.rank_params;
  }
  p.moments = moment_bytes * static_cast<double>(p.moment_elements);
  p.offload = config.get_string("optimizer_offload") != "none";
  p.offload_masters = config.get_string("optimizer_offload") == "cpu";
  if (p.offload) {
    // AdamWOptimizer's device chunk: offload_chunk elements, passed by up to a parameter.
    const int64_t chunk = std::min(p.moment_elements, offload_chunk + largest);
    p.host_moments = p.moments;
    // optimizer_offload_update: host — the moments never come to the device.
    p.host_update = p.offload_masters && config.get_string("optimizer_offload_update") == "host";
    // optimizer_offload_overlap: two chunks' buffers, where there is more than one chunk.
    const double slots =
        !p.host_update && config.get_bool("optimizer_offload_overlap") && chunk < p.moment_elements ? 2 : 1;
    p.moments = p.host_update ? 0 : slots * moment_bytes * static_cast<double>(chunk);
    if (p.offload_masters) {
      // ParamStore's f32 residents of the small parameters, the staging buffer of the largest
      // (FP8 casts, operand copies) and the optimizer's chunk(s) of masters.
      p.host_masters = p.masters;
      p.masters = 4.0 * (static_cast<double>(small + largest) + slots * static_cast<double>(chunk));
    }
  }

  p.recompute_elementwise = config.get_bool("recompute_elementwise");
  for (const Recompute r : {Recompute::none, Recompute::selective, Recompute::full}) {
    const RecomputePolicy policy{r, std::numeric_limits<int64_t>::max(), p.recompute_elementwise};
    const ActivationEstimate act =
        FluxModel::estimate_activations(cfg, p.shape, policy, parallel.tp, p.fp8 ? &fp8 : nullptr);
    p.activations[static_cast<size_t>(r)] =
        p.bf16_activations ? act.gpu_bytes(p.fp8, p.fp8_attention) : act.f32_bytes(p.fp8);
  }
  // cuDNN's deterministic BF16 attention backward keeps dP (batch x the rank's heads x L^2 bf16,
  // or one call's share under deterministic_attention_workspace_mib) in one workspace; FP8
  // attention keeps none.
  if (config.get_bool("deterministic_attention") && !p.fp8_attention)
    p.attention_workspace =
        split_attention_backward(p.shape.batch, cfg.num_heads / parallel.tp, p.shape.txt_tokens + p.shape.img_tokens,
                                 attention_workspace_limit(config))
            .dp_bytes;
  return p;
}

}  // namespace flux8
