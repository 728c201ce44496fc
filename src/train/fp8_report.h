#pragma once
// FP8 telemetry: per quantized tensor the step's amax, scale, fraction saturated at ±max and
// fraction of non-zeros flushed to zero, written to metrics.jsonl, with a one-line "FP8
// health" summary naming the worst tensors.
#include <cstdint>

namespace flux8 {

class Fp8Runtime;
class Progress;

void report_fp8_stats(Fp8Runtime& fp8, int64_t step, Progress& progress);

}  // namespace flux8
