#pragma once
// The GEMM switches of the CUDA backend read from the environment, under flux8's names and
// Primus-Turbo's (core/environment.h: an empty value is unset, flux8's name wins). Parsed here,
// outside the CUDA sources, so that every build checks them.
#include <cstdint>

namespace flux8 {

// FLUX8_GEMM_BACKEND, or PRIMUS_TURBO_GEMM_BACKEND: where FP8 GEMMs run. auto (unset): cuBLASLt
// where it has a kernel, the emulated kernel elsewhere; cublaslt (Primus-Turbo's hipblaslt, the
// vendor's BLAS-Lt, means the same): a product cuBLASLt cannot run is an error; emulated: every
// FP8 GEMM on the dequantize + fp32 kernel. Any other value is an error naming the variable.
enum class Fp8GemmBackend : uint8_t { automatic, cublaslt, emulated };
Fp8GemmBackend fp8_gemm_backend_from_environment();

// FLUX8_GEMM_AUTOTUNE, or PRIMUS_TURBO_AUTO_TUNE: 1/true/on times cuBLASLt's candidate
// algorithms per GEMM shape; 0/false/off (or unset) does not.
bool gemm_autotune_from_environment();

}  // namespace flux8
