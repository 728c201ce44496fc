#pragma once
// Numbers as `flux8 info` prints them.
#include <fmt/core.h>

#include <cstdint>
#include <string>

namespace flux8::cli {

inline std::string gib(double bytes) { return fmt::format("{:.2f} GiB", bytes / (1024.0 * 1024.0 * 1024.0)); }

// 11901408320 -> "11,901,408,320".
inline std::string with_commas(int64_t v) {
  std::string s = std::to_string(v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

}  // namespace flux8::cli
