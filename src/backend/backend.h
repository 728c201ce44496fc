#pragma once
// A backend (CPU reference, CUDA) is a device (backend/device.h), a precision policy
// (backend/precision.h) and an implementation of every op (backend/ops.h). The Flux model is
// written once against the ops; the conformance tests check every backend against the CPU.
#include <memory>
#include <string_view>

#include "backend/device.h"
#include "backend/ops.h"
#include "backend/precision.h"

namespace flux8 {

class Config;

struct BackendOptions {
  bool round_activations_to_bf16 = false;  // CPU: emulate the GPU's bf16 activation storage
  int threads = 0;                         // CPU: 0 = OpenMP default
  // CUDA: the non-FP8 GEMMs (linear, linear_backward) round their operands to bf16 and
  // accumulate in fp32 on the tensor cores (gemm_precision: bf16); false = exact f32 GEMMs.
  bool bf16_gemm = false;
  // CUDA: activations stored in bf16 (activation_dtype()); their GEMMs then run on bf16
  // operands whatever bf16_gemm says (the operands are bf16 already).
  bool bf16_activations = false;
  // CUDA: parameter gradients stored in bf16 (gradient_dtype(), grad_precision: bf16).
  bool bf16_grads = false;
  // CUDA: cuDNN's deterministic attention backward (deterministic_attention: true, the default;
  // false: its faster backward, whose dq sums with atomics in a varying order). The CPU always
  // repeats bit for bit.
  bool deterministic_attention = true;
  // CUDA: the most bytes the deterministic backward keeps dP in (0: no bound); a larger backward
  // runs as several calls over (sample, head) pairs (backend/attention_workspace.h).
  uint64_t attention_workspace_limit = 0;
  // CUDA: the GPU, by index among the visible ones (-1: the current device, 0 unless set). A rank
  // of a job passes its index among the job's ranks on its node; more ranks than GPUs is an error
  // unless `share_device` (the host-staged communicator's tests: several ranks on one GPU), when
  // ranks wrap around the GPUs.
  int device = -1;
  bool share_device = false;

  // From the config keys threads, round_activations_to_bf16, gemm_precision,
  // activation_precision, grad_precision, deterministic_attention (which
  // FLUX8_ATTENTION_DETERMINISTIC=0 or 1 overrides) and deterministic_attention_workspace_mib.
  static BackendOptions from_config(const Config& cfg);
};

// A backend: a device, its precision policy and its ops, with the generic implementations of the
// ops a backend may leave to them (FLUX8_DEFAULTED_OPS). Model code never branches on the backend.
class Backend : public Device, public PrecisionPolicy, public Ops {
 public:
  virtual const BackendOptions& options() const = 0;

  // The defaults: copy_batch copies pair by pair, gated_residual_stats runs the two ops,
  // mse_loss_into uploads mse_loss's value, quantize_fused produces its input through a temporary
  // and casts it, the FP8-heads ops run the plain op through temporaries and cast or dequantize.
  FLUX8_DEFAULTED_OPS(FLUX8_DECLARE_EXECUTE)

  // Writes the op a fused cast takes its input from (the unfused path of quantize_fused, and its
  // reference) to y: y has in.shape(); a head that already is y's first columns (same memory) is
  // left in place, and so is an identity input that already is y.
  void produce(Tensor y, const CastInput& in);

  using Ops::execute;

 protected:
  // Hands the access to the op interceptor, if one is installed, to issue what it holds first.
  void host_access(HostAccess what, const std::function<void()>& access) override;
};

// "cpu" (always available), "cuda" (when built with CUDA and a GPU is present; else an error
// saying why) or "auto" (cuda when it can run here, else cpu).
std::unique_ptr<Backend> make_backend(std::string_view name, const BackendOptions& options = {});

}  // namespace flux8
