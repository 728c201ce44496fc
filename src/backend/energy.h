#pragma once
// A run's energy from two readings of the device's energy counter (Backend::power_reading): what
// a step costs in joules, the mean power, and what that means under the power limit. Under
// sustained load the H200 holds its 700 W limit by lowering its clock (PERFORMANCE.md, Roofline),
// so a long run's step takes its energy over the limit: `ms_at_power_limit` — the figure a change
// must lower to make a power-capped step faster. (Over a window of a second or less the GPU may
// average above its limit: the power controller acts over a longer span.)
#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace flux8 {

struct EnergySummary {
  bool available = false;
  std::string why;             // when not available
  double joules_per_step = 0;  // the timed window's energy over its steps
  double mean_power_w = 0;     // the window's energy over its length
  double window_s = 0;         // the timed steps' span: the counter is updated every 20-100 ms on
                               // recent GPUs, so windows under a few seconds read approximately
  double power_limit_w = 0;
  double ms_at_power_limit = 0;             // joules_per_step at power_limit_w
  double sm_clock_mhz = 0;                  // the reading taken while the last step ran
  std::vector<std::string> clock_limiters;  // what held that clock back (clock_limiter_names)
};

// `start` and `end` bracket `steps` steps over `seconds`; `busy` was read while a step ran.
EnergySummary summarize_energy(const PowerReading& start, const PowerReading& end, const PowerReading& busy, int steps,
                               double seconds);

// NVML's clocks-event reason bits, named ("power cap (software)", "thermal slowdown (hardware)",
// ...); unknown bits as "0x...".
std::vector<std::string> clock_limiter_names(uint64_t reasons);

}  // namespace flux8
