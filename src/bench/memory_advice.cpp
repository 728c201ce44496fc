#include "bench/memory_advice.h"

#include <fmt/core.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "config/config.h"
#include "core/error.h"
#include "fp8/fp8_config.h"

namespace flux8 {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

Recompute current_recompute(const Config& cfg) { return recompute_from_name(cfg.get_string("recompute_granularity")); }

// The planned peak with `key` set to `value` (and the job split as `parallel`); nothing when the
// setting does not apply to this model (heads that do not split over the ranks, ...).
std::optional<double> peak_with(const Config& cfg, ParallelShape parallel,
                                const std::vector<std::pair<std::string, std::string>>& settings) {
  Config changed = cfg;
  try {
    for (const auto& [key, value] : settings) changed.set(key, value, "memory advice");
    return MemoryPlan::of(changed, parallel).peak(current_recompute(changed));
  } catch (const Error&) {
    return std::nullopt;
  }
}

}  // namespace

MemoryAdvice memory_advice(const Config& cfg, ParallelShape parallel) {
  const MemoryPlan plan = MemoryPlan::of(cfg, parallel);
  const Recompute now = current_recompute(cfg);
  MemoryAdvice a;
  a.peak = plan.peak(now);
  auto add = [&](std::string setting, std::string note, std::optional<double> peak) {
    if (peak && *peak < a.peak) a.knobs.push_back({std::move(setting), std::move(note), a.peak - *peak, *peak});
  };
  if (!cfg.get_bool("recompute_elementwise"))
    add("recompute_elementwise: true", "", peak_with(cfg, parallel, {{"recompute_elementwise", "true"}}));
  if (now == Recompute::none) add("recompute_granularity: selective", "", plan.peak(Recompute::selective));
  if (now != Recompute::full) add("recompute_granularity: full", "", plan.peak(Recompute::full));
  if (cfg.get_string("grad_precision") == "f32")
    add("grad_precision: bf16", "", peak_with(cfg, parallel, {{"grad_precision", "bf16"}}));
  if (cfg.get_string("adam_moment_precision") == "f32")
    add("adam_moment_precision: bf16", "", peak_with(cfg, parallel, {{"adam_moment_precision", "bf16"}}));
  const std::string recipe = cfg.get_string("fp8_recipe");
  if (cfg.get_string("fp8") != "none" && !weights_transposed_in_backward(cfg) &&
      (recipe == "delayed" || recipe == "tensorwise"))
    add("fp8_weight_transpose: in_backward", "the dgrad's transposed weight casts made in the backward",
        peak_with(cfg, parallel, {{"fp8_weight_transpose", "in_backward"}}));
  // The deterministic attention backward's dP, in calls of at most 256 MiB each.
  const int64_t dp_mib = cfg.get_int("deterministic_attention_workspace_mib");
  if (plan.attention_workspace > 256.0 * (1 << 20) && (dp_mib == 0 || dp_mib > 256))
    add("deterministic_attention_workspace_mib: 256", "the attention backward in calls over fewer heads",
        peak_with(cfg, parallel, {{"deterministic_attention_workspace_mib", "256"}}));
  if (cfg.get_string("activation_precision") == "f32")
    add("activation_precision: bf16", "", peak_with(cfg, parallel, {{"activation_precision", "bf16"}}));
  if (cfg.get_string("optimizer_offload") == "none")
    add("optimizer_offload: moments", "the AdamW moments in host memory",
        peak_with(cfg, parallel, {{"optimizer_offload", "moments"}}));
  // (cpu keeps every rank's whole master weights on its host: not with the distributed optimizer;
  // a tensor-parallel rank's masters stay on its device: TrainConfig.)
  if (cfg.get_string("optimizer_offload") != "cpu" && parallel.tp == 1 && !parallel.distributed_optimizer)
    add("optimizer_offload: cpu", "the f32 master weights and the AdamW moments in host memory",
        peak_with(cfg, parallel, {{"optimizer_offload", "cpu"}}));
  // The overlapped offload's second chunk of device buffers (the device update only).
  if (cfg.get_string("optimizer_offload") != "none" && cfg.get_bool("optimizer_offload_overlap") &&
      cfg.get_string("optimizer_offload_update") == "device")
    add("optimizer_offload_overlap: false", "one chunk's buffers; the transfers and updates one after another",
        peak_with(cfg, parallel, {{"optimizer_offload_overlap", "false"}}));
  if (parallel.dp > 1 && !parallel.distributed_optimizer) {
    ParallelShape zero = parallel;
    zero.distributed_optimizer = true;
    add("use_distributed_optimizer: true", "", peak_with(cfg, zero, {{"use_distributed_optimizer", "true"}}));
  }
  // Twice the tensor-parallel ranks: on the same GPUs where the data-parallel size halves, else
  // on twice as many.
  ParallelShape wider = parallel;
  wider.tp = parallel.tp * 2;
  wider.dp = parallel.dp % 2 == 0 ? parallel.dp / 2 : parallel.dp;
  add(fmt::format("tensor_model_parallel_size: {}", wider.tp),
      wider.world() == parallel.world() ? "" : fmt::format("on {} GPUs", wider.world()),
      peak_with(cfg, wider, {{"tensor_model_parallel_size", std::to_string(wider.tp)}}));
  const int64_t micro = cfg.get_int("micro_batch_size");
  if (micro > 1) {
    const int64_t global = cfg.get_int("global_batch_size") ? cfg.get_int("global_batch_size") : micro;
    const int64_t half = micro / 2;
    if (global % half == 0)
      add(fmt::format("micro_batch_size: {}", half),
          fmt::format("global_batch_size: {} kept: {} micro-batches a step", global, global / half),
          peak_with(cfg, parallel, {{"micro_batch_size", std::to_string(half)}}));
  }
  std::stable_sort(a.knobs.begin(), a.knobs.end(),
                   [](const MemoryKnob& x, const MemoryKnob& y) { return x.saving > y.saving; });
  return a;
}

bool knob_fits(const MemoryKnob& knob, const AllocationFailure& failure) {
  if (failure.total <= 0 && failure.shortfall() <= 0) return false;  // nothing known to fit against
  if (failure.total > 0 && knob.peak > failure.total) return false;
  return knob.saving >= failure.shortfall();
}

std::string describe_memory_advice(const MemoryAdvice& advice, const AllocationFailure& failure,
                                   const std::string& config_path, ParallelShape parallel) {
  std::string out = fmt::format("\nplanned peak of one GPU with these settings: {:.2f} GiB", advice.peak / kGiB);
  if (failure.total > 0) out += fmt::format(" (the device has {:.2f} GiB)", failure.total / kGiB);
  if (failure.shortfall() > 0)
    out += fmt::format("; the failed allocation lacked {:.2f} GiB", failure.shortfall() / kGiB);
  if (advice.knobs.empty()) return out + "; no setting flux8 plans lowers it: use more GPUs or a smaller image_size";
  const bool known = failure.total > 0 || failure.shortfall() > 0;
  out += "; settings that lower it (planned saving a GPU";
  out += known ? "; fits: that setting alone saves what the allocation lacked and brings the planned peak within the "
                 "device):"
               : "):";
  for (const MemoryKnob& k : advice.knobs) {
    out += fmt::format("\n  {:<38} -{:.2f} GiB", k.setting, k.saving / kGiB);
    if (knob_fits(k, failure)) out += "  fits";
    if (!k.note.empty()) out += "  (" + k.note + ")";
  }
  out += fmt::format(
      "\n(`flux8 info -c {} --tp {} --dp {}` prints the whole plan; it does not count the CUDA "
      "context, library workspaces or fragmentation)",
      config_path, parallel.tp, parallel.dp);
  return out;
}

}  // namespace flux8
