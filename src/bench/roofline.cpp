#include "bench/roofline.h"

#include <array>

namespace flux8 {

namespace {

constexpr std::array<std::string_view, 5> kParts = {"GEMMs", "attention", "AdamW", "FP8 casts", "everything else"};

// The index in kParts of an op's part.
size_t part_index(std::string_view op) {
  if (op == "linear" || op == "linear_backward" || op == "linear_gelu" || op == "linear_dgrad_gelu" ||
      op.starts_with("gemm_fp8_tn"))
    return 0;
  if (op.starts_with("attention")) return 1;
  if (op == "adamw") return 2;
  if (op.starts_with("quantize") || op == "dequantize" || op == "transpose_codes") return 3;
  return 4;
}

}  // namespace

std::string_view roofline_part_of(std::string_view op) { return kParts[part_index(op)]; }

std::vector<RooflinePart> roofline_parts(const std::vector<OpTime>& ops, const ModelFlops& flops) {
  std::vector<RooflinePart> parts;
  for (const std::string_view name : kParts) parts.push_back(RooflinePart{std::string(name)});
  parts[0].model_tflop = flops.linear_training() / 1e12;
  parts[1].model_tflop = flops.attention_training() / 1e12;
  for (const OpTime& t : ops) parts[part_index(t.op)].ms_per_step += t.ms_per_step;
  return parts;
}

}  // namespace flux8
