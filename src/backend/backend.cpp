#include "backend/backend.h"

#include <algorithm>

#include "backend/cpu/cpu_backend.h"
#include "backend/op_checks.h"
#if FLUX8_HAVE_CUDA
#include "backend/cuda/factory.h"
#endif
#include "config/config.h"
#include "core/error.h"

namespace flux8 {

void Backend::track_allocation(void* p, size_t bytes) {
  sizes_[p] = bytes;
  memory_.allocated += bytes;
  memory_.peak_allocated = std::max(memory_.peak_allocated, memory_.allocated);
}

void Backend::track_release(void* p) {
  const auto it = sizes_.find(p);
  if (it == sizes_.end()) return;
  memory_.allocated -= it->second;
  sizes_.erase(it);
}

void Backend::produce(Tensor y, const CastInput& in) {
  switch (in.op) {
    case CastInput::Op::identity: copy(y, in.x); return;
    case CastInput::Op::gelu_tanh: gelu_tanh(y, in.x); return;
    case CastInput::Op::gelu_tanh_backward: gelu_tanh_backward(y, in.x, in.gelu_x); return;
    case CastInput::Op::layernorm_modulate:
      // Recomputes mean and rstd: the same values, from the same x and eps.
      layernorm_modulate(y, in.mean, in.rstd, in.x, in.shift, in.scale, in.eps);
      return;
  }
}

void Backend::quantize_fused(QTensor rowwise, QTensor columnwise, const CastInput& in, const Quantize& q) {
  if (in.op == CastInput::Op::identity) {
    quantize(rowwise, columnwise, in.x, q);
    return;
  }
  ops::require_defined("quantize_fused", {"x", in.x});
  const size_t bytes = static_cast<size_t>(in.x.numel()) * dtype_size(in.x.dtype);
  const Tensor y(allocate(bytes), in.x.dtype, in.x.shape);
  try {
    produce(y, in);
    quantize(rowwise, columnwise, y, q);
  } catch (...) {
    release(y.data);
    throw;
  }
  release(y.data);
}

BackendOptions BackendOptions::from_config(const Config& cfg) {
  BackendOptions o;
  o.threads = static_cast<int>(cfg.get_int("threads"));
  o.round_activations_to_bf16 = cfg.get_bool("round_activations_to_bf16");
  o.bf16_gemm = cfg.get_string("gemm_precision") == "bf16";
  o.bf16_activations = cfg.get_string("activation_precision") == "bf16";
  return o;
}

std::unique_ptr<Backend> make_backend(std::string_view name, const BackendOptions& options) {
  if (name == "cpu") return std::make_unique<CpuBackend>(options);
  if (name == "auto") {
#if FLUX8_HAVE_CUDA
    if (cuda_unavailable_reason().empty()) return make_cuda_backend(options);
#endif
    return std::make_unique<CpuBackend>(options);
  }
  if (name == "cuda") {
#if FLUX8_HAVE_CUDA
    return make_cuda_backend(options);
#else
    fail("backend 'cuda': this build of flux8 has no CUDA backend (configured without nvcc); use backend: cpu, or "
         "rebuild with CUDA (README: GPU builds)");
#endif
  }
  fail("unknown backend '{}': choose 'cpu', 'cuda' or 'auto'", name);
}

}  // namespace flux8
