#include "backend/cuda/gemm.h"

#include <fmt/format.h>

#include "backend/cuda/check.h"
#include "core/error.h"

namespace flux8::cuda {

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLASLt's recommendation for Hopper

const char* type_name(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F: return "f32";
    case CUDA_R_16BF: return "bf16";
    case CUDA_R_16F: return "f16";
    case CUDA_R_8F_E4M3: return "e4m3";
    case CUDA_R_8F_E5M2: return "e5m2";
    default: return "?";
  }
}

bool is_fp8(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

template <typename T>
void set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  FLUX8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

}  // namespace

std::string describe(const GemmDesc& d) {
  return fmt::format("{}{} m={} n={} k={} lda={} ldb={} ldd={} {} x {} -> {}{}{}{}", d.trans_a == CUBLAS_OP_T ? 'T' : 'N',
                     d.trans_b == CUBLAS_OP_T ? 'T' : 'N', d.m, d.n, d.k, d.lda, d.ldb, d.ldd, type_name(d.type_a),
                     type_name(d.type_b), type_name(d.type_d), d.bias ? (d.bias_type == CUDA_R_32F ? " +bias" : " +bf16 bias") : "",
                     d.accumulate ? " +=" : "",
                     d.scale_mode_a == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F     ? " scales 1x128"
                     : d.scale_mode_a == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F ? " scales 128x128"
                                                                                      : "");
}

struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
  std::string why_not;  // heuristic's failure, when !found
  ~Plan() {
    if (desc) cublasLtMatmulDescDestroy(desc);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
  }
};

Gemm::Gemm(cudaStream_t stream) : stream_(stream) {
  FLUX8_CUBLAS_CHECK(cublasLtCreate(&handle_));
  FLUX8_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
  workspace_bytes_ = kWorkspaceBytes;
}

Gemm::~Gemm() {
  plans_.clear();
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

Gemm::Plan& Gemm::plan(const GemmDesc& g) {
  auto it = plans_.find(g.key());
  if (it != plans_.end()) return *it->second;
  auto p = std::make_unique<Plan>();
  const bool fp8 = is_fp8(g.type_a) || is_fp8(g.type_b);
  FLUX8_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, g.compute, CUDA_R_32F));
  set(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, g.trans_a);
  set(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, g.trans_b);
  if (g.bias) {
    set(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, g.bias_type);
  }
  if (fp8) {
    const int8_t fast = g.fast_accum ? 1 : 0;
    set(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast);
    set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, g.scale_mode_a);
    set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, g.scale_mode_b);
  }
  const uint64_t a_rows = g.trans_a == CUBLAS_OP_N ? g.m : g.k, a_cols = g.trans_a == CUBLAS_OP_N ? g.k : g.m;
  const uint64_t b_rows = g.trans_b == CUBLAS_OP_N ? g.k : g.n, b_cols = g.trans_b == CUBLAS_OP_N ? g.n : g.k;
  FLUX8_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, g.type_a, a_rows, a_cols, g.lda));
  FLUX8_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, g.type_b, b_rows, b_cols, g.ldb));
  FLUX8_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->d, g.type_d, g.m, g.n, g.ldd));

  // Block-scale modes: the heuristic refuses them unless scale pointers are set ("requires a
  // custom pointer for A scale"). Any device address serves for planning; run() sets the real
  // ones on every call.
  if (fp8 && (g.scale_mode_a != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F ||
              g.scale_mode_b != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F)) {
    set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(workspace_));
    set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(workspace_));
  }
  cublasLtMatmulPreference_t pref = nullptr;
  FLUX8_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  FLUX8_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &workspace_bytes_, sizeof(workspace_bytes_)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t s =
      cublasLtMatmulAlgoGetHeuristic(handle_, p->desc, p->a, p->b, p->d, p->d, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s == CUBLAS_STATUS_SUCCESS && found > 0) {
    p->algo = result.algo;
    p->found = true;
  } else {
    p->why_not = s == CUBLAS_STATUS_SUCCESS ? "no algorithm" : cublasLtGetStatusString(s);
  }
  return *plans_.emplace(g.key(), std::move(p)).first->second;
}

std::string Gemm::supported(const GemmDesc& d) {
  Plan& p = plan(d);
  return p.found ? "" : fmt::format("cuBLASLt has no algorithm for {} ({})", describe(d), p.why_not);
}

void Gemm::run(const GemmDesc& g, const GemmArgs& args) {
  if (g.m == 0 || g.n == 0) return;
  Plan& p = plan(g);
  if (!p.found) fail("GEMM {}: cuBLASLt found no algorithm on this GPU ({})", describe(g), p.why_not);
  if (g.bias) set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, args.bias);
  if (is_fp8(g.type_a) || is_fp8(g.type_b)) {
    set(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(args.scale_a));
    set(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(args.scale_b));
    // Set on every call (null = not wanted): the descriptor is shared by all calls of this shape.
    set(p.desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void*>(args.amax_d));
  } else if (args.amax_d) {
    fail("GEMM {}: amax of D is only computed by FP8 GEMMs", describe(g));
  }
  const float alpha = args.alpha, beta = g.accumulate ? 1.0f : 0.0f;
  // k == 0: the product is empty; cuBLASLt may reject it, and D = beta·D is all it means.
  if (g.k == 0) {
    if (!g.accumulate) fail("GEMM {}: empty reduction (k = 0) is only meaningful when accumulating", describe(g));
    return;
  }
  FLUX8_CUBLAS_CHECK(cublasLtMatmul(handle_, p.desc, &alpha, args.a, p.a, args.b, p.b, &beta, args.d, p.d, args.d,
                                    p.d, &p.algo, workspace_, workspace_bytes_, stream_));
}

}  // namespace flux8::cuda
