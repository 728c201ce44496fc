#include "core/process_clock.h"

#include <time.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>

namespace flux8 {

namespace {

// The process's start in seconds since boot, or a negative value when it cannot be read.
double start_since_boot() {
#ifdef __linux__
  std::ifstream f("/proc/self/stat");
  std::string stat;
  if (!std::getline(f, stat)) return -1;
  // Field 2 (the command name) is in parentheses and may hold spaces: fields are counted from
  // the last ')', after which comes field 3; the start time is field 22.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(stat.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i)
    if (!(rest >> field)) return -1;
  const long ticks = sysconf(_SC_CLK_TCK);
  try {
    return ticks > 0 ? static_cast<double>(std::stoull(field)) / static_cast<double>(ticks) : -1;
  } catch (const std::exception&) {
    return -1;
  }
#else
  return -1;
#endif
}

}  // namespace

double seconds_since_process_start() {
  static const double start = start_since_boot();
  static const auto first_call = std::chrono::steady_clock::now();
#ifdef __linux__
  timespec now{};
  if (start >= 0 && clock_gettime(CLOCK_BOOTTIME, &now) == 0) {
    const double since = static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec) - start;
    if (since >= 0) return since;
  }
#endif
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - first_call).count();
}

}  // namespace flux8
