#pragma once
// Environment variables that also go by another framework's name (Primus-Turbo's
// PRIMUS_TURBO_AUTO_TUNE for FLUX8_GEMM_AUTOTUNE, ...). An empty value counts as unset; where
// both names are set, flux8's own wins (the more specific: a job script that sets it means it).
#include <string>

namespace flux8 {

struct EnvironmentSetting {
  std::string value;  // "" when neither name is set (or both are empty)
  std::string name;   // the variable the value came from, for error messages; "" when unset
};

EnvironmentSetting environment_setting(const char* name, const char* alias);

}  // namespace flux8
