#include "backend/gemm_environment.h"

#include <algorithm>
#include <cctype>
#include <string>

#include "core/environment.h"
#include "core/error.h"

namespace flux8 {

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

}  // namespace

Fp8GemmBackend fp8_gemm_backend_from_environment() {
  const EnvironmentSetting e = environment_setting("FLUX8_GEMM_BACKEND", "PRIMUS_TURBO_GEMM_BACKEND");
  const std::string v = lower(e.value);  // Primus-Turbo writes its backends in capitals
  if (v.empty() || v == "auto") return Fp8GemmBackend::automatic;
  if (v == "cublaslt" || v == "hipblaslt") return Fp8GemmBackend::cublaslt;
  if (v == "emulated") return Fp8GemmBackend::emulated;
  fail(ErrorKind::config, "{}={}: expected auto, cublaslt (or hipblaslt) or emulated", e.name, e.value);
}

bool gemm_autotune_from_environment() {
  const EnvironmentSetting e = environment_setting("FLUX8_GEMM_AUTOTUNE", "PRIMUS_TURBO_AUTO_TUNE");
  const std::string v = lower(e.value);
  if (v.empty() || v == "0" || v == "false" || v == "off") return false;
  if (v == "1" || v == "true" || v == "on") return true;
  fail(ErrorKind::config, "{}={}: expected 1 (time cuBLASLt's candidate algorithms per GEMM shape) or 0", e.name,
       e.value);
}

}  // namespace flux8
