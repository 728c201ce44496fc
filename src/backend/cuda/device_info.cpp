// `flux8 check`: what GPU this is, which driver and library versions are loaded, and which FP8
// recipes can run here. The FP8 answers come from asking cuBLASLt for an algorithm at a Flux
// shape (3072 x 3072 x 3072), the same question a training step asks.
#include <cudnn.h>
#include <fmt/format.h>
#include <nccl.h>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "backend/cuda/factory.h"
#include "backend/cuda/gemm.h"

namespace flux8 {

namespace {

// cuBLASLt, cuDNN (9+) and NCCL (2.9+) encode versions as major·10000 + minor·100 + patch.
std::string version3(size_t v) { return fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100); }

std::string fp8_gemm_support(cuda::Gemm& gemm, cudaDataType_t a, cudaDataType_t b, cublasLtMatmulMatrixScale_t mode_a,
                             cublasLtMatmulMatrixScale_t mode_b) {
  cuda::GemmDesc d;
  d.trans_a = CUBLAS_OP_T;
  d.m = d.n = d.k = 3072;
  d.lda = d.ldb = d.ldd = 3072;
  d.type_a = a, d.type_b = b;
  d.scale_mode_a = mode_a, d.scale_mode_b = mode_b;
  // Both outputs training writes: bf16 (fprop and dgrad onto bf16 activations) and f32 (wgrad).
  for (const cudaDataType_t out : {CUDA_R_16BF, CUDA_R_32F}) {
    d.type_d = out;
    if (std::string why = gemm.supported(d); !why.empty()) return why;
  }
  return "";
}

}  // namespace

CudaReport cuda_report() {
  CudaReport r;
  auto add = [&](std::string k, std::string v) { r.lines.push_back({std::move(k), std::move(v)}); };
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  add("CUDA runtime", fmt::format("{}.{}", runtime / 1000, (runtime % 1000) / 10));
  add("CUDA driver API", driver ? fmt::format("{}.{}", driver / 1000, (driver % 1000) / 10) : "none (no driver)");
  add("cuBLASLt", version3(cublasLtGetVersion()));
  add("cuDNN", version3(cudnnGetVersion()));
  int nccl = 0;
  add("NCCL", ncclGetVersion(&nccl) == ncclSuccess ? version3(static_cast<size_t>(nccl)) : "unknown");
  add("built for", "sm_90a (Hopper)");

  const std::string why = cuda_unavailable_reason();
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  add("GPUs", std::to_string(count));
  if (count > 0) {
    cudaDeviceProp p{};
    FLUX8_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    add("GPU 0", fmt::format("{}, {:.1f} GiB, {} SMs", p.name, p.totalGlobalMem / 1073741824.0, p.multiProcessorCount));
    add("compute capability", fmt::format("{}.{}", p.major, p.minor));
  }
  r.usable = why.empty();
  add("CUDA backend", r.usable ? "usable" : "not usable: " + why);
  if (!r.usable) {
    for (const char* recipe : {"delayed", "tensorwise", "blockwise", "mxfp8", "FP8 attention"})
      r.fp8_recipes.push_back({recipe, "no: " + why});
    return r;
  }
  cudaStream_t s = nullptr;
  FLUX8_CUDA_CHECK(cudaStreamCreate(&s));
  struct StreamGuard {  // destroyed on every path (Gemm refuses a bad FLUX8_GEMM_AUTOTUNE)
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } guard{s};
  {
    cuda::Gemm gemm(s);
    constexpr auto scalar = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    const std::string e4m3 = fp8_gemm_support(gemm, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, scalar, scalar);
    const std::string hybrid = fp8_gemm_support(gemm, CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, scalar, scalar);
    const std::string per_tensor = e4m3.empty() && hybrid.empty() ? "native (cuBLASLt per-tensor FP8, e4m3 and hybrid)"
                                                                  : "no: " + (e4m3.empty() ? hybrid : e4m3);
    r.fp8_recipes.push_back({"delayed", per_tensor});
    r.fp8_recipes.push_back({"tensorwise", per_tensor});
    const std::string blk =
        fp8_gemm_support(gemm, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                         CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
    r.fp8_recipes.push_back({"blockwise", blk.empty() ? "native (cuBLASLt 1x128 / 128x128 block scales)"
                                                      : "emulated (dequantize + fp32 GEMM): " + blk});
    r.fp8_recipes.push_back({"mxfp8",
                             "emulated (dequantize + fp32 GEMM): MXFP8 GEMMs are native on sm_100 "
                             "(Blackwell), not on Hopper"});
  }
  {
    // fp8_dot_product_attention: cuDNN's FP8 forward and backward plans built for a small shape
    // of the kind the model runs (hybrid formats, head-major heads); no BF16 backward runs here.
    const std::unique_ptr<cuda::Attention> attention = cuda::make_attention(s, true);
    cuda::Attention::Fp8Forward f;
    cuda::Attention::Fp8Backward b;
    f.shape = b.shape = cuda::AttentionShape{1, 1, 128, 128};
    const std::string no = attention->fp8_unsupported_reason(f, b);
    r.fp8_recipes.push_back({"FP8 attention", no.empty() ? "native (cuDNN FP8 flash attention; fp8: hybrid, head dim "
                                                           "128, sequence lengths that are multiples of 64)"
                                                         : "no: " + no});
  }
  return r;
}

}  // namespace flux8
