#include "bench/targets.h"

#include <fmt/format.h>

#include <algorithm>

namespace flux8 {

const WorkloadTargets* workload_targets(const std::string& workload) {
  static const WorkloadTargets w1{42.0, 28.0, 0.8, 3.0}, w2{85.0, 60.0, 0.8, 3.0};
  return workload == "W1" ? &w1 : workload == "W2" ? &w2 : nullptr;
}

std::string BenchRunSummary::label() const { return precision == "bf16" ? "BF16" : precision + " " + fp8_format; }

std::vector<TargetVerdict> judge_targets(const std::string& workload, const std::vector<BenchRunSummary>& runs) {
  std::vector<TargetVerdict> out;
  const WorkloadTargets* t = workload_targets(workload);
  if (!t) return out;
  const auto at_most = [&](std::string target, std::string run, double value, double limit, std::string unit) {
    out.push_back({std::move(target), std::move(run), value, limit, std::move(unit), value <= limit});
  };
  // A step target's energy: the run's joules a step against the limit's time at the power limit.
  const auto with_energy = [&](const BenchRunSummary& r) {
    if (r.joules_per_step < 0 || r.power_limit_w <= 0) return;
    out.back().joules = r.joules_per_step;
    out.back().joules_allowed = out.back().limit / 1e3 * r.power_limit_w;
  };
  const auto first_bf16 =
      std::find_if(runs.begin(), runs.end(), [](const BenchRunSummary& r) { return r.precision == "bf16"; });
  const BenchRunSummary* bf16 = first_bf16 == runs.end() ? nullptr : &*first_bf16;
  for (const BenchRunSummary& r : runs) {
    if (r.precision == "bf16") {
      at_most("BF16 step", r.label(), r.median_ms, t->bf16_step_ms, "ms");
      with_energy(r);
    }
    if (r.precision == "delayed" && r.fp8_format == "hybrid") {
      at_most("FP8 step", r.label(), r.median_ms, t->fp8_step_ms, "ms");
      with_energy(r);
      if (bf16 && bf16->peak_allocated_gib > 0)
        at_most("FP8 peak memory", r.label() + " / BF16", r.peak_allocated_gib / bf16->peak_allocated_gib,
                t->fp8_memory_vs_bf16, "x");
    }
  }
  for (const BenchRunSummary& r : runs)
    if (r.launch_to_first_step_s >= 0)
      at_most("launch to first step", r.label(), r.launch_to_first_step_s, t->launch_to_first_step_s, "s");
  return out;
}

std::string describe(const TargetVerdict& v) {
  // Ratios read as "0.96x"; times in the units the targets are written in.
  const auto amount = [&](double x) {
    return v.unit == "x" ? fmt::format("{:.2f}x", x) : fmt::format("{:.2f} {}", x, v.unit);
  };
  const std::string verdict = v.met ? "met" : "missed by " + amount(v.value - v.limit);
  const std::string energy = v.joules >= 0 && v.joules_allowed > 0
                                 ? fmt::format("; {:.1f} J a step, {:.1f} J allowed at the {:.0f} W limit", v.joules,
                                               v.joules_allowed, v.joules_allowed / (v.limit / 1e3))
                                 : "";
  return fmt::format("{} ({}): {} <= {}, {}{}", v.target, v.run, amount(v.value), amount(v.limit), verdict, energy);
}

}  // namespace flux8
