#pragma once
// `flux8 info --tp T --dp D`: the per-GPU memory plan (bench/memory_plan.h) as text and JSON,
// with which recompute settings fit a GPU of a given size.
#include <nlohmann/json.hpp>

#include "bench/memory_plan.h"

namespace flux8::cli {

void print_memory_plan(const MemoryPlan& plan, double gpu_bytes);
nlohmann::json memory_plan_json(const MemoryPlan& plan, double gpu_bytes);

}  // namespace flux8::cli
