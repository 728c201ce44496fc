#include "bench/roofline.h"

#include <array>

namespace flux8 {

namespace {

constexpr std::array<std::string_view, 5> kParts = {"GEMMs", "attention", "AdamW", "FP8 casts", "everything else"};

}  // namespace

std::string_view roofline_part_of(std::string_view op) {
  if (op == "linear" || op == "linear_backward" || op == "linear_gelu" || op == "linear_dgrad_gelu" ||
      op.starts_with("gemm_fp8_tn"))
    return kParts[0];
  if (op.starts_with("attention")) return kParts[1];
  if (op == "adamw") return kParts[2];
  if (op.starts_with("quantize") || op == "dequantize" || op == "transpose_codes") return kParts[3];
  return kParts[4];
}

std::vector<RooflinePart> roofline_parts(const std::vector<OpTime>& ops, const ModelFlops& flops) {
  std::vector<RooflinePart> parts;
  for (const std::string_view name : kParts) parts.push_back(RooflinePart{std::string(name)});
  parts[0].model_tflop = 6 * flops.linear_macs / 1e12;   // forward 2, backward 4 per multiply-add
  parts[1].model_tflop = 3 * flops.attention_fwd / 1e12;  // forward 1, backward 2 forwards
  for (const OpTime& t : ops) {
    const std::string_view part = roofline_part_of(t.op);
    for (RooflinePart& p : parts)
      if (p.name == part) p.ms_per_step += t.ms_per_step;
  }
  return parts;
}

}  // namespace flux8
