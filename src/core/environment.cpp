#include "core/environment.h"

#include <cstdlib>

namespace flux8 {

EnvironmentSetting environment_setting(const char* name, const char* alias) {
  for (const char* n : {name, alias}) {
    if (!n) continue;
    const char* v = std::getenv(n);
    if (v && *v) return {v, n};
  }
  return {};
}

}  // namespace flux8
