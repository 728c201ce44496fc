#pragma once
// The one cuBLASLt wrapper. Every matrix product of the CUDA backend — f32 linears, FP8
// per-tensor and blockwise GEMMs — is described by a GemmDesc and run by Gemm::run, which
// caches the matmul descriptor, the layouts and the heuristic's algorithm per distinct
// description (shape, types, layout, scale modes, epilogue), so a training step does no
// descriptor or heuristic work after its first iteration.
//
// Autotuning (FLUX8_GEMM_AUTOTUNE=1): the heuristic ranks algorithms by a model, and its first
// choice is not always the fastest at a given shape. With autotuning on, the first run of each
// distinct description times up to 8 of the heuristic's algorithms on the call's own operands
// (into a scratch output: D is not touched) and keeps the fastest. Choices are cached on disk
// (FLUX8_GEMM_AUTOTUNE_CACHE, default $XDG_CACHE_HOME/flux8/gemm_autotune.tsv, else
// ~/.cache/flux8/...), keyed by GPU, cuBLASLt version and description, so a later run starts
// without timing. An empty variable counts as unset.
//
// Profiling (FLUX8_GEMM_PROFILE=1): what `flux8 bench --profile` cannot show, which GEMM shapes
// of a step run below the GPU's rate. Every cublasLtMatmul waits for the stream to drain and is
// then bracketed by two CUDA events, read in batches; the device time is summed per description,
// profile() returns the totals and the destructor prints them on stderr (largest first, with
// TFLOP/s). A row is the GEMM's device time plus its launch, as in `--profile`, and the step
// runs slower. The first call of each description is left out: it may load its kernel (lazy
// module loading), which took milliseconds. (Events without the wait misattribute: the start
// event of a GEMM can be stamped before the work queued ahead of it has finished, and the
// per-GEMM times then sum to more than the whole step.)
//
// Column-major, like cuBLASLt: D[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · C, with
// C == D (in place). Row-major callers swap operands (see linear.cu).
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "core/dtype.h"  // FLUX8_HD
#include "core/error.h"

namespace flux8 {
class CudaBackend;
struct Tensor;
}  // namespace flux8

namespace flux8::cuda {

// What the epilogue does besides the optional bias (column-major D[m, n]; aux has D's shape and
// type, leading dimension aux_ld):
// - gelu_aux: aux = product (+ bias), D = gelu_tanh(aux) from the unrounded value (cuBLASLt's
//   GELU is the tanh approximation);
// - dgelu: D = product ⊙ gelu_tanh'(aux), aux read (the GELU's input); no bias.
// (cuBLASLt's bias-gradient epilogue BGRADB is not used on the wgrad GEMMs: it slows them by more
// than the column-sum kernel costs; docs/PERFORMANCE.md, Measurements behind the kernels.)
enum class Epilogue : uint8_t { none, gelu_aux, dgelu };
inline bool has_aux(Epilogue e) { return e == Epilogue::gelu_aux || e == Epilogue::dgelu; }

struct GemmDesc {
  cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;
  cudaDataType_t type_a = CUDA_R_32F, type_b = CUDA_R_32F, type_d = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  // FP8 operands: how the scales apply (per tensor: one f32 scale_inv on the device; blockwise:
  // cuBLASLt's VEC128 / BLK128x128 f32 scale tensors).
  cublasLtMatmulMatrixScale_t scale_mode_a = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  cublasLtMatmulMatrixScale_t scale_mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  bool bias = false;                      // epilogue: D += bias[m] broadcast along n
  cudaDataType_t bias_type = CUDA_R_32F;  // f32, or bf16 (what cuBLASLt's FP8 GEMMs take for bf16 D)
  bool fast_accum = false;                // FP8: Hopper's fast (less precise) accumulation (fprop)
  bool accumulate = false;                // beta = 1 (D += ...), else beta = 0
  Epilogue epilogue = Epilogue::none;
  int64_t aux_ld = 0;  // gelu_aux, dgelu: a multiple of 8, ≥ m

  auto key() const {
    return std::make_tuple(trans_a, trans_b, m, n, k, lda, ldb, ldd, type_a, type_b, type_d, compute, scale_mode_a,
                           scale_mode_b, bias, bias_type, fast_accum, accumulate, epilogue, aux_ld);
  }
};

// cuBLASLt refused to run a description its heuristic had offered an algorithm for (nothing
// ran); Gemm::supported() answers no for it from then on.
class GemmRefused : public Error {
 public:
  using Error::Error;
};

// Device time of one GEMM description, summed over its calls (FLUX8_GEMM_PROFILE=1).
struct GemmTiming {
  std::string desc;  // describe()
  int64_t calls = 0;
  double ms = 0;     // total
  double flops = 0;  // 2·m·n·k per call, summed
};

// Device pointers of one call.
struct GemmArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  const void* bias = nullptr;
  const float* scale_a = nullptr;  // FP8: scale_inv of A (a scalar or a scale tensor)
  const float* scale_b = nullptr;
  float* amax_d = nullptr;  // when set: amax of D (FP8 output cast of the next op)
  void* aux = nullptr;      // Epilogue::gelu_aux (written), dgelu (read)
  float alpha = 1.0f;
};

class Gemm {
 public:
  Gemm(cudaStream_t stream);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;
  // cuBLASLt's workspace, held for the Gemm's life (the backend counts it as allocated).
  size_t workspace_size() const { return workspace_bytes_; }

  void run(const GemmDesc& d, const GemmArgs& args);
  // "" when cuBLASLt has an algorithm for this description on this GPU, else the reason
  // (used to report which FP8 recipes can run here).
  std::string supported(const GemmDesc& d);
  // supported(d) == "" without formatting the reason: for the per-call choice between variants.
  bool has_algorithm(const GemmDesc& d);
  size_t cached_plans() const { return plans_.size(); }
  bool autotuning() const { return autotune_; }
  // Descriptions timed by this process, and those whose choice came from the disk cache.
  int tuned_here() const { return tuned_here_; }
  int tuned_from_cache() const { return tuned_from_cache_; }
  // GEMMs run with each epilogue kind so far (Epilogue::none counts the rest): which fused paths
  // cuBLASLt really took on this GPU (the ops fall back to separate kernels where it refuses).
  int64_t runs_with(Epilogue e) const { return runs_[static_cast<size_t>(e)]; }
  int64_t runs_with_bias() const { return bias_runs_; }  // a bias added in the epilogue
  bool profiling() const { return profile_; }
  // FLUX8_GEMM_PROFILE=1: the totals so far per description, largest first (waits for the
  // stream's timed calls to finish).
  std::vector<GemmTiming> profile();

 private:
  struct Plan;
  Plan& plan(const GemmDesc& d);
  void tune(Plan& p, const GemmDesc& d, const GemmArgs& args);  // after run() set the descriptor's pointers
  void load_tuning_cache();
  void store_tuning(const std::string& key, int index, double ms);
  void drain_profile();  // reads the recorded event pairs into the plans' totals
  void print_profile();
  cudaStream_t stream_;
  bool profile_ = false;
  struct TimedCall {
    Plan* plan;
    cudaEvent_t start, stop;
  };
  std::vector<TimedCall> timed_;           // recorded, not yet read
  std::vector<cudaEvent_t> spare_events_;  // read, reusable
  bool autotune_ = false;
  std::string cache_path_, device_key_;
  std::map<std::string, int> cache_;  // description key -> index in the heuristic's list
  int tuned_here_ = 0, tuned_from_cache_ = 0;
  std::array<int64_t, 3> runs_{};
  int64_t bias_runs_ = 0;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<decltype(GemmDesc{}.key()), std::unique_ptr<Plan>> plans_;
};

// A bias vector on the device for gemm_with_bias: f32, or bf16 — the rounded copy a model keeps
// of its bias next to its weights' (ParamStore::operand), for a bf16 output only.
struct BiasVector {
  const void* p = nullptr;  // null: no bias
  bool bf16 = false;
  FLUX8_HD explicit operator bool() const { return p != nullptr; }
#ifdef __CUDACC__
  __device__ float operator[](int64_t j) const {
    return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[j]) : static_cast<const float*>(p)[j];
  }
#endif
};
// `b` of op `op` (undefined: none) as a bias for the output `out`: a contiguous f32 vector, or a
// bf16 one where `out` is bf16 (fails naming the op otherwise).
BiasVector bias_vector(std::string_view op, const Tensor& b, const Tensor& out);

// Runs `d` (its D is the row-major c [rows, cols] = column-major [cols, rows]; args.d = c) and
// adds bias[cols] (device; none: no bias), in the epilogue where cuBLASLt has one for c:
// - an f32 bias: exact, the product (+ c when accumulating) + bias rounded once to c's type;
// - bf16 c: else a bf16 copy of the bias (cuBLASLt's FP8 and BF16 GEMMs take only that for bf16
//   D: an f32 bias is rounded to bf16 before it is added, ≤ 2⁻⁹ of it), or the bf16 bias itself;
// - else the plain GEMM, then a kernel adds the bias to c in the CPU's order (product, + c,
//   + bias); a bf16 c is then rounded twice (≤ 1 bf16 ulp more).
// A non-FP8 description cuBLASLt refuses when run (GemmRefused) is computed by a plain kernel
// (noted once on stderr); an FP8 one is rethrown for the caller's emulated path. (linear.cu)
void gemm_with_bias(CudaBackend& be, GemmDesc d, GemmArgs args, const Tensor& c, BiasVector bias);

std::string describe(const GemmDesc& d);  // for error messages: "TN m=.. n=.. k=.. e4m3 x e5m2 -> f32"

}  // namespace flux8::cuda
