#pragma once
// What to change when a training run does not fit its GPU: every setting that lowers the
// planned peak of one GPU (MemoryPlan, the numbers of `flux8 info --tp --dp`), each with its
// planned saving and whether the planned peak with it alone fits the device. The CUDA backend
// reports the failed allocation (OutOfMemoryError); `flux8 train` turns it into this advice.
#include <cstdint>
#include <string>
#include <vector>

#include "bench/memory_plan.h"

namespace flux8 {

class Config;

struct MemoryKnob {
  std::string setting;  // as written in a config: "recompute_granularity: selective"
  std::string note;     // what else it changes ("on 2 GPUs", "4 micro-batches a step"), or ""
  double saving = 0;    // planned bytes a GPU
  double peak = 0;      // the planned peak with this setting alone
};

struct MemoryAdvice {
  double peak = 0;                // the planned peak of one GPU with the run's settings
  std::vector<MemoryKnob> knobs;  // largest saving first; only settings that save memory
};

// The settings of `cfg` (at its micro_batch_size and image_size) a GPU of a `parallel` job
// could change, planned.
MemoryAdvice memory_advice(const Config& cfg, ParallelShape parallel);

// What the device said when an allocation failed (OutOfMemoryError); 0 = not known.
struct AllocationFailure {
  double requested = 0, free = 0, total = 0;
  // The bytes the failed allocation lacked.
  double shortfall() const { return requested > free ? requested - free : 0; }
};

// Whether `knob` alone would fit: the plan's peak with it within the device's memory, and its
// saving at least what the failed allocation lacked (the plan leaves out the CUDA context and
// fragmentation; the shortfall is what the device really missed). Each test only where known.
bool knob_fits(const MemoryKnob& knob, const AllocationFailure& failure);

// The advice as lines to append to an out-of-memory error (`config_path` for the `flux8 info`
// line); where nothing about the device is known, nothing is said about what fits.
std::string describe_memory_advice(const MemoryAdvice& advice, const AllocationFailure& failure,
                                   const std::string& config_path, ParallelShape parallel);

}  // namespace flux8
