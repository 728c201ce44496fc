#pragma once
// flux8's own targets per workload and the verdicts `flux8 bench` prints after a workload's
// runs — so a benchmark says itself which target it met and by how much it missed the others,
// instead of leaving the comparison to whoever reads its table. (Comparisons with PyTorch are
// bench/peer.h's: measured in the same run, never written down here.)
#include <string>
#include <vector>

namespace flux8 {

// flux8's targets, set for one H200. The FP8 ones are for delayed scaling in the hybrid format
// (E4M3 forward, E5M2 gradients); memory is FP8's peak over BF16's, both flux8's.
struct WorkloadTargets {
  double bf16_step_ms, fp8_step_ms, fp8_memory_vs_bf16, launch_to_first_step_s;
};

// nullptr for anything but "W1" and "W2" (a config's own model has no targets).
const WorkloadTargets* workload_targets(const std::string& workload);

// One `flux8 bench` run of a workload, as the verdicts need it.
struct BenchRunSummary {
  std::string precision;   // bf16, delayed, tensorwise, blockwise, mxfp8
  std::string fp8_format;  // hybrid or e4m3; empty for bf16
  double median_ms = 0;
  double peak_allocated_gib = 0;
  double launch_to_first_step_s = -1;  // < 0: not measured (only a process's first run is)
  // The run's energy a step and the GPU's power limit (backend/energy.h); < 0: not measured.
  double joules_per_step = -1, power_limit_w = -1;
  std::string label() const;  // "BF16", "delayed hybrid" (as the bench's table names it)
};

struct TargetVerdict {
  std::string target;  // "BF16 step", "FP8 step", "FP8 peak memory", "launch to first step"
  std::string run;     // the run judged: "BF16", "delayed hybrid", "delayed hybrid / BF16"
  double value = 0, limit = 0;
  std::string unit;  // "ms", "x", "s"
  bool met = false;
  // Step targets of a run whose energy was measured: its joules a step, and the joules a step
  // the target leaves at the power limit (limit ms x limit W) — what a power-capped step must
  // come down to (PERFORMANCE.md, Energy per step). < 0 otherwise.
  double joules = -1, joules_allowed = -1;
};

// Every target the runs can be judged on: BF16 step for each BF16 run, FP8 step for each
// delayed-hybrid run, FP8 peak memory for each delayed-hybrid run when a BF16 run of the same
// workload is there, launch to first step for the run that measured it. Empty for a workload
// without targets. Other recipes and formats are not judged: the targets do not name them.
std::vector<TargetVerdict> judge_targets(const std::string& workload, const std::vector<BenchRunSummary>& runs);

// "FP8 step (delayed hybrid): 28.13 ms <= 28.00 ms, missed by 0.13 ms", and with the energy
// "...; 20.9 J a step, 19.6 J allowed at the 700 W limit"
std::string describe(const TargetVerdict& v);

}  // namespace flux8
