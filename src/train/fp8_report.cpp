#include "train/fp8_report.h"

#include <fmt/core.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/fp8_runtime.h"
#include "train/progress.h"

namespace flux8 {

namespace {

const char* operand_name(int o) {
  static const char* names[] = {"input", "weight", "grad_output"};
  return names[o];
}

struct Entry {
  std::string tensor;
  double saturated, underflow, amax;
  bool gradient = false;  // a backward tensor (grad_output; attention's dO)
};

// What a user can change when a tensor's casts flush or clamp too much, given the run's recipe.
std::string underflow_remedy(const Fp8Config& c, bool gradient) {
  if (!gradient)
    return c.recipe == Fp8Recipe::blockwise || c.recipe == Fp8Recipe::mxfp8
               ? "its values span more than a block's scale covers; keep these blocks in BF16 "
                 "(first_last_layers_bf16) if the loss suffers"
               : "its values span more than E4M3's range under one scale: fp8_recipe blockwise or mxfp8 scale "
                 "each block of values on its own";
  std::string r;
  if (!c.hybrid) r = "fp8: hybrid (E5M2 gradients reach 2^-16, E4M3 only 2^-9 of the scale)";
  if (c.recipe == Fp8Recipe::delayed) {
    if (!r.empty()) r += "; ";
    r += c.amax_max && c.amax_history_len > 1
             ? "shrinking gradients keep the scale of an older, larger amax: fp8_amax_compute_algo: most_recent, "
               "a shorter fp8_amax_history_len, or fp8_recipe tensorwise (the scale of the tensor itself)"
             : "fp8_recipe tensorwise takes the scale from the tensor itself instead of earlier steps";
  }
  return r.empty() ? "fp8_recipe blockwise or mxfp8 scale each block of values on its own" : r;
}

std::string saturation_remedy(const Fp8Config& c) {
  if (c.recipe == Fp8Recipe::delayed)
    return fmt::format(
        "the amax grew past the delayed scale: {}{}, or fp8_recipe tensorwise scales each cast by its "
        "own amax",
        c.margin == 0 ? "fp8_margin 1 or 2 leaves headroom" : "a larger fp8_margin leaves more headroom",
        c.amax_max ? "" : ", fp8_amax_compute_algo: max keeps the largest amax of the history");
  return "values beyond the format's largest after scaling: check the scale rounding (fp8_scale_rounding) and, for "
         "gradients, fp8: hybrid (E5M2 reaches 57344)";
}

// The tensors past the run's thresholds: the warning line (empty when none) and its records.
std::string warnings(const Fp8Config& c, const std::vector<Entry>& entries, nlohmann::json& records) {
  std::vector<std::string> parts;
  auto flag = [&](const char* kind, double threshold, double Entry::*key, auto remedy) {
    if (threshold <= 0) return;
    std::vector<Entry> over;
    for (const Entry& e : entries)
      if (e.*key > threshold) over.push_back(e);
    for (const Entry& e : over)
      records.push_back({{"tensor", e.tensor}, {"kind", kind}, {"fraction", e.*key}, {"threshold", threshold}});
    // One remedy per kind and tensor class, for the worst tensor of the class.
    for (const bool gradient : {true, false}) {
      const Entry* worst_one = nullptr;
      int count = 0;
      for (const Entry& e : over)
        if (e.gradient == gradient) {
          ++count;
          if (!worst_one || e.*key > worst_one->*key) worst_one = &e;
        }
      if (!worst_one) continue;
      parts.push_back(fmt::format("{} {} above {:.3g}% ({}{}{:.3f}%): {}", count, kind, 100.0 * threshold,
                                  worst_one->tensor, count > 1 ? " the worst, " : " ", 100.0 * worst_one->*key,
                                  remedy(gradient)));
    }
  };
  flag("underflow", c.underflow_warning, &Entry::underflow, [&](bool g) { return underflow_remedy(c, g); });
  flag("saturated", c.saturation_warning, &Entry::saturated, [&](bool) { return saturation_remedy(c); });
  std::string line;
  for (const std::string& p : parts) line += (line.empty() ? "" : "\n  ") + p;
  return line;
}

std::string worst(std::vector<Entry> v, double Entry::*key, int count) {
  std::sort(v.begin(), v.end(), [&](const Entry& a, const Entry& b) { return a.*key > b.*key; });
  std::string out;
  for (int i = 0; i < count && i < static_cast<int>(v.size()) && v[static_cast<size_t>(i)].*key > 0; ++i)
    out += fmt::format("{}{} {:.3f}%", out.empty() ? "" : ", ", v[static_cast<size_t>(i)].tensor,
                       100.0 * v[static_cast<size_t>(i)].*key);
  return out.empty() ? "none" : out;
}

}  // namespace

void report_fp8_stats(Fp8Runtime& fp8, int64_t step, Progress& progress) {
  nlohmann::json tensors = nlohmann::json::array();
  std::vector<Entry> entries;
  const auto& stats = fp8.last_step_stats();
  for (size_t site = 0; site < stats.size(); ++site) {
    for (int o = 0; o < 3; ++o) {
      const CastStats& c = stats[site].op[o];
      if (c.elements == 0) continue;  // not cast this step (a cached weight, or no backward)
      const float scale = fp8.scale_of(static_cast<int>(site), static_cast<Operand>(o));
      nlohmann::json t{{"tensor", stats[site].name},
                       {"role", operand_name(o)},
                       {"amax", c.amax},
                       {"saturated", c.saturated_fraction()},
                       {"underflow", c.flushed_fraction()}};
      if (scale > 0) t["scale"] = scale;
      tensors.push_back(t);
      entries.push_back({stats[site].name + "." + operand_name(o), c.saturated_fraction(), c.flushed_fraction(), c.amax,
                         o == static_cast<int>(Operand::grad_output)});
    }
  }
  // FP8 attention: the amax each tensor had last step (cuDNN reports dS's and the outputs' from
  // inside its kernels) and the scale the next step casts it with; saturation and underflow for
  // the casts flux8 makes itself (q, k, v, dO), not for those inside cuDNN's kernels.
  if (fp8.attentions() > 0) {
    const Fp8MetaRegistry& reg = fp8.current_registry();  // downloads the device state: only for attentions
    for (int a = 0; a < fp8.attentions(); ++a) {
      const Fp8Runtime::AttentionCastStats& counts = fp8.last_attention_stats()[static_cast<size_t>(a)];
      for (int t = 0; t < Fp8Runtime::kAttentionSlots; ++t) {
        const int slot = fp8.attention_first_slot(a) + t;
        nlohmann::json j{{"tensor", reg.name(slot)}, {"role", "attention"}, {"scale", reg.scale(slot)}};
        if (reg.history_len() > 1) j["amax"] = reg.history_at(reg.history_len() - 1, slot);
        if (const CastStats* c = counts.of(static_cast<Fp8Runtime::AttentionTensor>(t)); c && c->elements > 0) {
          j["saturated"] = c->saturated_fraction();
          j["underflow"] = c->flushed_fraction();
          entries.push_back({reg.name(slot), c->saturated_fraction(), c->flushed_fraction(), c->amax,
                             t == static_cast<int>(Fp8Runtime::AttentionTensor::dout)});
        }
        tensors.push_back(j);
      }
    }
  }
  if (entries.empty()) return;
  nlohmann::json flagged = nlohmann::json::array();
  const std::string warning = warnings(fp8.config(), entries, flagged);
  if (!warning.empty())
    progress.note(
        fmt::format("warning: FP8 health at step {}: {}\n  (thresholds: fp8_underflow_warning, "
                    "fp8_saturation_warning)",
                    step, warning));
  progress.event(
      fmt::format("FP8 health at step {} ({} tensors): most saturated: {}; most underflow: {}", step, entries.size(),
                  worst(entries, &Entry::saturated, 3), worst(entries, &Entry::underflow, 3)),
      RecordKind::fp8, {{"step", step}, {"fp8", tensors}, {"warnings", flagged}});
}

}  // namespace flux8
