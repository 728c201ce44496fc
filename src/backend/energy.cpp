#include "backend/energy.h"

#include <fmt/format.h>

#include <utility>

namespace flux8 {

std::vector<std::string> clock_limiter_names(uint64_t reasons) {
  // nvml.h's nvmlClocksEventReason* values.
  static const std::pair<uint64_t, const char*> kNames[] = {
      {0x1, "idle"},
      {0x2, "application clocks setting"},
      {0x4, "power cap (software)"},
      {0x8, "slowdown (hardware)"},
      {0x10, "sync boost"},
      {0x20, "thermal slowdown (software)"},
      {0x40, "thermal slowdown (hardware)"},
      {0x80, "power brake (hardware)"},
      {0x100, "display clock setting"},
  };
  std::vector<std::string> names;
  uint64_t known = 0;
  for (const auto& [bit, name] : kNames) {
    known |= bit;
    if (reasons & bit) names.emplace_back(name);
  }
  if (const uint64_t other = reasons & ~known) names.push_back(fmt::format("{:#x}", other));
  return names;
}

EnergySummary summarize_energy(const PowerReading& start, const PowerReading& end, const PowerReading& busy, int steps,
                               double seconds) {
  EnergySummary e;
  for (const PowerReading* r : {&start, &end, &busy})
    if (!r->available) {
      e.why = r->why.empty() ? "no energy reading" : r->why;
      return e;
    }
  if (steps <= 0 || !(seconds > 0)) {
    e.why = "no timed steps";
    return e;
  }
  const double joules = end.energy_j - start.energy_j;
  if (!(joules > 0)) {
    // The counter did not move (or went back): a device that does not count, or a window
    // shorter than its update period.
    e.why = fmt::format("the energy counter did not move forward ({:+.3f} J over {:.3f} s)", joules, seconds);
    return e;
  }
  e.available = true;
  e.joules_per_step = joules / steps;
  e.mean_power_w = joules / seconds;
  e.window_s = seconds;
  e.power_limit_w = end.power_limit_w;
  e.ms_at_power_limit = e.power_limit_w > 0 ? 1e3 * e.joules_per_step / e.power_limit_w : 0;
  e.sm_clock_mhz = busy.sm_clock_mhz;
  e.clock_limiters = clock_limiter_names(busy.clock_reasons);
  return e;
}

}  // namespace flux8
