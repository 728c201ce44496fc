#include "fp8/fp8_config.h"

#include <fmt/core.h>

#include "config/config.h"
#include "core/error.h"

namespace flux8 {

const char* fp8_recipe_name(Fp8Recipe r) {
  switch (r) {
    case Fp8Recipe::delayed: return "delayed";
    case Fp8Recipe::tensorwise: return "tensorwise";
    case Fp8Recipe::blockwise: return "blockwise";
    case Fp8Recipe::mxfp8: return "mxfp8";
  }
  return "?";
}

namespace {

// Recipes whose GEMMs take one scale per tensor (the only ones with fast accumulation).
bool per_tensor_recipe(Fp8Recipe r) { return r == Fp8Recipe::delayed || r == Fp8Recipe::tensorwise; }

}  // namespace

bool weights_transposed_in_backward(const Config& c) {
  const std::string how = c.get_string("fp8_weight_transpose"), recipe = c.get_string("fp8_recipe");
  return how == "in_backward" || (how == "auto" && (recipe == "delayed" || recipe == "tensorwise"));
}

Fp8Config Fp8Config::from_config(const Config& c) {
  Fp8Config f;
  const std::string fmt = c.get_string("fp8");
  f.enabled = fmt != "none";
  f.hybrid = fmt == "hybrid";
  const std::string recipe = c.get_string("fp8_recipe");
  f.recipe = recipe == "tensorwise"  ? Fp8Recipe::tensorwise
             : recipe == "blockwise" ? Fp8Recipe::blockwise
             : recipe == "mxfp8"     ? Fp8Recipe::mxfp8
                                     : Fp8Recipe::delayed;
  f.margin = static_cast<int>(c.get_int("fp8_margin"));
  f.amax_history_len = c.get_int("fp8_amax_history_len");
  f.amax_max = c.get_string("fp8_amax_compute_algo") == "max";
  f.wgrad = c.get_bool("fp8_wgrad");
  f.modulation = c.get_bool("fp8_modulation");
  f.first_last_bf16 = c.get_bool("first_last_layers_bf16");
  f.bf16_start = c.get_int("num_layers_at_start_in_bf16");
  f.bf16_end = c.get_int("num_layers_at_end_in_bf16");
  f.stats_interval = c.get_int("fp8_stats_interval");
  f.underflow_warning = c.get_float("fp8_underflow_warning");
  f.saturation_warning = c.get_float("fp8_saturation_warning");
  const std::string rounding = c.get_string("fp8_scale_rounding");

  auto set = [&](const char* key) { return c.source(key) != "default"; };
  auto where = [&](const char* key) { return fmt::format("{} ({})", key, c.source(key)); };

  if (!f.enabled) {
    // A run that asks for FP8 details but not FP8 itself would silently train in BF16.
    for (const char* key : {"fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad",
                            "fp8_scale_rounding", "fp8_modulation", "fp8_dot_product_attention", "fp8_weight_transpose",
                            "fp8_fprop_fast_accumulation", "fp8_multi_head_attention", "first_last_layers_bf16",
                            "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"})
      if (set(key))
        fail("{} is set but fp8 is {} ({}), so the run would train in BF16; set fp8: e4m3 or hybrid, or remove {}",
             where(key), fmt, c.source("fp8"), key);
    return f;
  }
  f.dot_product_attention = c.get_bool("fp8_dot_product_attention");
  // Block-scaled GEMMs promote every 128-wide block to fp32 (cuBLASLt has no fast mode for them).
  const bool per_tensor = per_tensor_recipe(f.recipe);
  f.fprop_fast_accumulation = c.get_bool("fp8_fprop_fast_accumulation") && per_tensor;
  if (!per_tensor && set("fp8_fprop_fast_accumulation") && c.get_bool("fp8_fprop_fast_accumulation"))
    f.warnings.push_back(fmt::format(
        "{} has no effect: it applies to the per-tensor recipes (delayed, tensorwise); {} GEMMs accumulate each "
        "128-wide block in fp32 (fp8_recipe {}, {})",
        where("fp8_fprop_fast_accumulation"), recipe, recipe, c.source("fp8_recipe")));
  f.weight_transpose_in_backward = weights_transposed_in_backward(c);
  // A block-scaled cast's transpose has scales of its own (1x32 blocks along the other axis) or
  // tiles to move with their scales; only the per-tensor codes transpose as they are.
  if (c.get_string("fp8_weight_transpose") == "in_backward" && !per_tensor)
    fail(
        "{} needs a per-tensor recipe (delayed, tensorwise), but the recipe is {} ({}); use fp8_weight_transpose: "
        "keep, or a per-tensor recipe",
        where("fp8_weight_transpose"), recipe, c.source("fp8_recipe"));
  if (c.get_bool("fp8_multi_head_attention"))
    fail(
        "{}: FP8 attention with FP8 q, k, v, o passed to and from the Linears around it is not implemented; "
        "fp8_dot_product_attention: true runs the attention itself in FP8 (bf16 in and out)",
        where("fp8_multi_head_attention"));
  if (f.dot_product_attention && f.recipe != Fp8Recipe::delayed)
    fail(
        "{} needs fp8_recipe: delayed (the softmax, output and gradient casts inside cuDNN's FP8 attention take "
        "scales from past steps), but the recipe is {} ({})",
        where("fp8_dot_product_attention"), recipe, c.source("fp8_recipe"));
  if (f.dot_product_attention && !f.hybrid)
    fail(
        "{} needs fp8: hybrid: with E4M3 gradients cuDNN's FP8 attention backward gives NaN dQ rows where the "
        "output gradient is zero (every Flux step has such rows: the text tokens of the last single block)",
        where("fp8_dot_product_attention"));
  // Settings of another recipe: the guide's tuning profiles carry the delayed recipe's amax
  // settings into tensorwise runs, where scales come from each tensor's current amax.
  if (f.recipe != Fp8Recipe::delayed) {
    // At their defaults, as if they were not given: a run (and its checkpoints' FP8 state) is
    // the same with or without them.
    const Fp8Config defaults;
    f.margin = defaults.margin;
    f.amax_history_len = defaults.amax_history_len;
    f.amax_max = defaults.amax_max;
  }
  if (f.recipe != Fp8Recipe::delayed)
    for (const char* key : {"fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo"})
      if (set(key))
        f.warnings.push_back(fmt::format(
            "{} has no effect: it applies to fp8_recipe: delayed only, and the recipe is {} ({}), whose scales "
            "come from {}",
            where(key), recipe, c.source("fp8_recipe"),
            f.recipe == Fp8Recipe::tensorwise ? "each tensor's amax of the current step"
                                              : "the amax of each block of the current step"));
  if (rounding != "auto" && (f.recipe == Fp8Recipe::delayed || f.recipe == Fp8Recipe::mxfp8))
    f.warnings.push_back(
        fmt::format("{} has no effect: it applies to the tensorwise and blockwise recipes; {} scales "
                    "are {}",
                    where("fp8_scale_rounding"), recipe,
                    f.recipe == Fp8Recipe::mxfp8 ? "E8M0 powers of two by definition" : "fp8_max * 2^-margin / amax"));
  f.power_of_2_scales = (f.recipe == Fp8Recipe::tensorwise || f.recipe == Fp8Recipe::blockwise) &&
                        (rounding == "power_of_2" || (rounding == "auto" && f.recipe == Fp8Recipe::blockwise));
  if (!f.first_last_bf16 && (set("num_layers_at_start_in_bf16") || set("num_layers_at_end_in_bf16")))
    fail("{} / {} take effect only with first_last_layers_bf16: true", where("num_layers_at_start_in_bf16"),
         where("num_layers_at_end_in_bf16"));
  return f;
}

bool Fp8Config::block_in_fp8(int64_t index, int64_t num_blocks) const {
  if (!enabled) return false;
  if (first_last_bf16 && (index < bf16_start || index >= num_blocks - bf16_end)) return false;
  return true;
}

std::string Fp8Config::describe() const {
  if (!enabled) return "BF16 (fp8: none)";
  std::string s = fmt::format("FP8 {} recipe, {}", fp8_recipe_name(recipe),
                              hybrid ? "hybrid (E4M3 forward, E5M2 gradients)" : "E4M3");
  if (recipe == Fp8Recipe::delayed)
    s += fmt::format(", amax history {} ({}), margin {}", amax_history_len, amax_max ? "max" : "most_recent", margin);
  if (power_of_2_scales) s += ", power-of-2 scales";
  if (!wgrad) s += ", BF16 wgrad";
  if (per_tensor_recipe(recipe))
    s += fprop_fast_accumulation ? ", forward GEMMs with fast accumulation" : ", forward GEMMs in fp32 accumulation";
  if (dot_product_attention) s += ", FP8 attention";
  if (weight_transpose_in_backward) s += ", weights transposed in the backward";
  if (first_last_bf16) s += fmt::format(", first {} / last {} blocks in BF16", bf16_start, bf16_end);
  return s;
}

}  // namespace flux8
