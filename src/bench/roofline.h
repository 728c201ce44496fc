#pragma once
// The per-op profile of a step (`flux8 bench --profile`) grouped into the parts of its roofline
// (docs/PERFORMANCE.md, Roofline): the GEMMs and attention, with the model FLOPs they do and the
// rate they reached, then AdamW, the FP8 casts and everything else (norms, RoPE, residuals,
// layouts, the gradient norm, the device's idle time). What the table says at a glance: how
// close the compute-bound parts run to the GPU's rates, and how much of the step is left to the
// memory-bound rest.
#include <string>
#include <string_view>
#include <vector>

#include "bench/step_bench.h"
#include "model/flops.h"

namespace flux8 {

struct RooflinePart {
  std::string name;  // "GEMMs", "attention", "AdamW", "FP8 casts", "everything else"
  double ms_per_step = 0;
  double model_tflop = 0;  // GEMMs and attention: their model FLOPs a step (model/flops.h's
                           // convention: recomputation's extra work is not counted); else 0
  double tflops() const { return ms_per_step > 0 && model_tflop > 0 ? model_tflop / (ms_per_step / 1e3) : 0; }
};

// The part a profile row belongs to, by the op's name: "GEMMs" (linear, linear_backward and their
// GELU-epilogue forms, every gemm_fp8_tn row), "attention" (forward and backward, BF16 or FP8),
// "AdamW", "FP8 casts" (quantize, quantize_fused rows, dequantize, transpose_codes), else
// "everything else".
std::string_view roofline_part_of(std::string_view op);

// The five parts in that order, each the sum of its rows (a part without rows has 0 ms).
std::vector<RooflinePart> roofline_parts(const std::vector<OpTime>& ops, const ModelFlops& flops);

}  // namespace flux8
