#include "train/fp8_report.h"

#include <fmt/core.h>

#include <algorithm>
#include <nlohmann/json.hpp>

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
};

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
      entries.push_back(
          {stats[site].name + "." + operand_name(o), c.saturated_fraction(), c.flushed_fraction(), c.amax});
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
          entries.push_back({reg.name(slot), c->saturated_fraction(), c->flushed_fraction(), c->amax});
        }
        tensors.push_back(j);
      }
    }
  }
  if (entries.empty()) return;
  progress.event(
      fmt::format("FP8 health at step {} ({} tensors): most saturated: {}; most underflow: {}", step, entries.size(),
                  worst(entries, &Entry::saturated, 3), worst(entries, &Entry::underflow, 3)),
      RecordKind::fp8, {{"step", step}, {"fp8", tensors}});
}

}  // namespace flux8
