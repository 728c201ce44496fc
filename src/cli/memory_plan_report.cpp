#include "cli/memory_plan_report.h"

#include <fmt/core.h>

#include <string>

#include "cli/text_format.h"

namespace flux8::cli {

namespace {

constexpr Recompute kSettings[] = {Recompute::none, Recompute::selective, Recompute::full};
constexpr const char* kSettingNames[] = {"none", "selective", "full"};

struct StateRow {
  std::string name;
  double bytes;
};

std::vector<StateRow> state_rows(const MemoryPlan& p) {
  return {
      {"bf16 weight copies", p.operand_copies},
      {"FP8 weight casts", p.fp8_casts},
      {p.offload_masters              ? "f32 weights (small, chunk, staging)"
       : p.parallel.moments_sharded() ? "f32 masters (shard; small, staging)"
                                      : "f32 master weights",
       p.masters},
      {p.bf16_grads ? "gradients (bf16)" : "gradients (f32)", p.gradients},
      {std::string(p.bf16_moments ? "AdamW moments (bf16)" : "AdamW moments (f32)") + (p.host_update ? ", none"
                                                                                       : p.offload   ? ", a chunk"
                                                                                                     : ""),
       p.moments},
  };
}

std::string moments_line(const MemoryPlan& p) {
  const ParallelShape& s = p.parallel;
  if (p.offload_masters)
    return fmt::format(
        "{} elements, in host memory ({}; optimizer_offload: cpu) with the f32 master\n"
        "    weights ({}), {}",
        with_commas(p.moment_elements), gib(p.host_moments), gib(p.host_masters),
        p.host_update ? "updated there by the host's cores (optimizer_offload_update: host)"
                      : "streamed through the GPU a chunk at a time");
  if (p.offload)
    return fmt::format(
        "{} elements{}, in host memory ({}; optimizer_offload: moments),\n"
        "    streamed through the GPU a chunk at a time",
        with_commas(p.moment_elements), s.moments_sharded() ? " (this rank's shard)" : "", gib(p.host_moments));
  if (s.moments_sharded())
    return fmt::format(
        "{} elements on this GPU, its shard over the {} data-parallel ranks\n"
        "    (use_distributed_optimizer), with the f32 master weights of the same shard",
        with_commas(p.moment_elements), s.dp);
  if (s.distributed_optimizer) return "whole on the GPU (use_distributed_optimizer with one data-parallel rank)";
  return s.dp > 1 ? "whole on every GPU (use_distributed_optimizer: false)" : "whole on the GPU";
}

void print_recompute_rows(const MemoryPlan& p, double gpu_bytes) {
  fmt::print("\n  {:<36} {:>12} {:>12} {:>12}\n", "recompute_granularity", "none", "selective", "full");
  auto row = [&](const char* name, auto value) {
    fmt::print("  {:<36}", name);
    for (Recompute r : kSettings) fmt::print(" {:>12}", value(r));
    fmt::print("\n");
  };
  row("activations", [&](Recompute r) { return gib(p.activations[static_cast<size_t>(r)]); });
  row("total, a training step", [&](Recompute r) { return gib(p.step_total(r)); });
  if (p.checkpoint_buffers > 0) row("peak, a checkpoint save", [&](Recompute r) { return gib(p.peak(r)); });
  const std::string fits = fmt::format("fits {}", gib(gpu_bytes));
  row(fits.c_str(), [&](Recompute r) { return p.peak(r) <= gpu_bytes ? "yes" : "no"; });
}

}  // namespace

void print_memory_plan(const MemoryPlan& p, double gpu_bytes) {
  const ParallelShape& s = p.parallel;
  fmt::print("\nmemory plan of one GPU: tensor-parallel {} x data-parallel {} = {} GPUs, {}, batch {} a GPU\n", s.tp,
             s.dp, s.world(), p.fp8 ? "FP8" : "BF16", p.shape.batch);
  fmt::print("  parameters on each GPU: {} of {}", with_commas(p.rank_params), with_commas(p.model_params));
  if (s.tp > 1)
    fmt::print(
        "\n    (the blocks' heads and MLP split over {} ranks; modulation, embedders and final layer\n"
        "    whole on every rank)",
        s.tp);
  fmt::print("\n  AdamW moments: {}\n\n", moments_line(p));
  for (const StateRow& r : state_rows(p)) fmt::print("  {:<36} {:>12}\n", r.name, gib(r.bytes));
  fmt::print("  {:<36} {:>12}\n", "model state", gib(p.state()));
  fmt::print("  {:<36} {:>12}\n", "attention backward workspace", gib(p.attention_workspace));
  print_recompute_rows(p, gpu_bytes);
  if (p.host_checkpoint > 0)
    fmt::print(
        "  (a checkpoint save gathers the shards of the f32 master weights and the AdamW moments\n"
        "   to data-parallel rank 0's host memory, {}, through a GPU buffer of {};\n"
        "   a resume reads each rank's part of the files into its shard)\n",
        gib(p.host_checkpoint), gib(p.checkpoint_buffers));
  else if (p.checkpoint_buffers > 0)
    fmt::print("  (a checkpoint save stages the largest split tensor's shards on the GPU: {})\n",
               gib(p.checkpoint_buffers));
  fmt::print(
      "  (activations in {} (activation_precision); the attention workspace is cuDNN's deterministic\n"
      "   backward's dP (deterministic_attention: true; none in FP8 attention); not counted: the CUDA\n"
      "   context (~0.5 GiB), cuBLASLt and NCCL buffers, allocator fragmentation; see docs/MEMORY.md)\n",
      p.bf16_activations ? "bf16" : "f32");
}

nlohmann::json memory_plan_json(const MemoryPlan& p, double gpu_bytes) {
  nlohmann::json j;
  j["tensor_parallel"] = p.parallel.tp;
  j["data_parallel"] = p.parallel.dp;
  j["gpus"] = p.parallel.world();
  j["distributed_optimizer"] = p.parallel.distributed_optimizer;
  j["fp8"] = p.fp8;
  j["parameters_per_gpu"] = p.rank_params;
  j["moment_elements_per_gpu"] = p.moment_elements;
  j["bytes"] = {{"bf16_weight_copies", p.operand_copies},
                {"fp8_weight_casts", p.fp8_casts},
                {"master_weights", p.masters},
                {"gradients", p.gradients},
                {"adam_moments", p.moments},
                {"model_state", p.state()},
                {"attention_workspace", p.attention_workspace},
                {"checkpoint_buffers", p.checkpoint_buffers},
                {"host_checkpoint", p.host_checkpoint},
                {"optimizer_offload", p.offload},
                {"offload_masters", p.offload_masters},
                {"host_moments", p.host_moments},
                {"host_masters", p.host_masters}};
  j["gpu_memory_bytes"] = gpu_bytes;
  for (size_t i = 0; i < std::size(kSettings); ++i) {
    const Recompute r = kSettings[i];
    j["recompute"][kSettingNames[i]] = {{"activations_bytes", p.activations[i]},
                                        {"step_total_bytes", p.step_total(r)},
                                        {"peak_bytes", p.peak(r)},
                                        {"fits", p.peak(r) <= gpu_bytes}};
  }
  return j;
}

}  // namespace flux8::cli
