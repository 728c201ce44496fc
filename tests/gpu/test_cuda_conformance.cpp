// The conformance table (tests/conformance/) on the CUDA backend: f32 activations with exact f32
// GEMMs, and the training setup (bf16 activations, bf16 GEMM operands). Each case skips itself on
// a machine without a usable GPU.
#include "../conformance/conformance_test.h"

namespace flux8::conformance {
namespace {

FLUX8_CONFORMANCE_INSTANTIATE(Cuda, Variant::cuda_f32, Variant::cuda_bf16);

}  // namespace
}  // namespace flux8::conformance
