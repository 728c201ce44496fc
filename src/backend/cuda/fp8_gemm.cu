// The TN FP8 GEMM on the device: CudaBackend::gemm_fp8_tn, c[m,n] (= or +=) a[m,k]·b[n,k]ᵀ
// (+ bias[n]) with fp32 accumulation, the twin of CpuBackend::gemm_fp8_tn.
//
// Native path: cuBLASLt through the one wrapper (gemm.h). Row-major c = a·bᵀ is column-major
// cᵀ(n×m) = op_T(b)·op_N(a): cuBLASLt's A is b (TRANSA = T, lda = k), its B is a (TRANSB = N,
// ldb = k), D is c (ldd = c.ld), m_cublas = n, n_cublas = m. Split (precise) accumulation.
//   - per tensor: A/B scale pointers are the operands' device scale_inv; E4M3×E4M3, E4M3×E5M2,
//     E5M2×E4M3.
//   - block scaling (cuBLAS 12.9+, Hopper): CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F for 1x128
//     operands and BLK128x128_32F for 128x128 ones, in the combinations 1x128·1x128, 1x128·
//     128x128 and 128x128·1x128 (cuBLASLt has no 128x128·128x128 kernel). cuBLASLt reads the
//     scales in its own layout (https://docs.nvidia.com/cuda/cublas/#scaling-factors-layouts,
//     as Transformer Engine's "GEMM-ready" layouts and PyTorch's _scaled_mm use it), not in
//     QTensor's row-major one, so they are rearranged into scratch:
//       1x128 operand [rows, k]:   scale (r, kb) at kb·rows + r   (rows contiguous; rows % 8 == 0
//                                  is required, so no padding of rows to a multiple of 4 is left)
//       128x128 operand [rows, k]: scale (rb, kb) at rb·L4 + kb, L4 = ceil(k/128) rounded up to a
//                                  multiple of 4 (k blocks contiguous, padded).
//     Shape rules (TE's checks, from cuBLASLt's): k % 16 == 0 (16-byte rows), m_cublas (= n)
//     % 8 == 0, and n_cublas (= m) % 8 == 0 when cuBLASLt's B (our a) is 1x128.
//     cuBLASLt's heuristic refuses these modes unless the scale pointers are already set in the
//     matmul descriptor ("The scaling mode for A scale (BLK128x128_32F) requires a custom pointer
//     for A scale"), so Gemm::plan must set placeholders before it asks.
//   - every FP8 GEMM: 16-byte aligned operand and output pointers, 16-byte aligned output rows
//     (c.ld % 4 == 0), and no E5M2×E5M2 (no such kernel: an error, whatever the path).
// Precision: Hopper's FP8 MMA sums the products of a k-slice keeping about 14 significant bits
// (DeepSeek-V3 report §3.3.2); split accumulation adds the slices in fp32. Results differ from the
// CPU's fp32 sums by ~1e-4 relative, not ~1e-7 (see the tolerances in tests/gpu/test_cuda_fp8.cpp).
// Fp8Accumulation::fast (the forward GEMMs by default, fp8_fprop_fast_accumulation) sets
// cuBLASLt's FAST_ACCUM: the running sum stays in the MMA's accumulator, ~1e-3 relative.
// Output c: f32, or bf16 (an activation in bf16 storage: cuBLASLt rounds D once, from the fp32
// sum). Bias: gemm_with_bias (gemm.h) — cuBLASLt has no FP8 GEMM with an f32 bias epilogue for
// f32 D (on an H200 the heuristic finds no algorithm), so for f32 c a kernel adds the bias after
// the product, in the CPU's order; bf16 c takes cuBLASLt's bf16 bias epilogue.
//
// Emulated path, for what cuBLASLt cannot run on Hopper: MXFP8 (native on sm_100 only), odd
// shapes, mixed scalings, 128x128·128x128. A tiled kernel dequantizes both operands per element
// with the exact scale of its block (as the CPU does) and accumulates in fp32. Each reason is
// logged once to stderr, so a run that emulates says so.
#include <fmt/format.h>

#include <cstdlib>
#include <mutex>
#include <set>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.h"
#include "backend/gemm_environment.h"
#include "backend/op_checks.h"
#include "fp8/quantize.h"

namespace flux8 {
namespace cuda {
namespace {

// An FP8 operand as the emulated kernel reads it.
struct Operand {
  const uint8_t* codes;
  int64_t rows, cols;
  Fp8Format format;
  bool mx;
  const float* scale_inv;
  const uint8_t* e8m0;
  int64_t block_rows, block_cols, scale_cols;
};

Operand operand(const QTensor& q) {
  Operand o{q.codes, q.rows, q.cols, q.format, q.scaling == Fp8Scaling::mx_1x32, q.scale_inv, q.scale_e8m0, 1, 1, 1};
  switch (q.scaling) {
    case Fp8Scaling::per_tensor:
      o.block_rows = q.rows > 0 ? q.rows : 1;
      o.block_cols = q.cols > 0 ? q.cols : 1;
      break;
    case Fp8Scaling::block_1x128: o.block_cols = 128; break;
    case Fp8Scaling::block_128x128: o.block_rows = o.block_cols = 128; break;
    case Fp8Scaling::mx_1x32: o.block_cols = 32; break;
  }
  o.scale_cols = (q.cols + o.block_cols - 1) / o.block_cols;
  return o;
}

// decode(code) · scale_inv of the element's block: dequantize_view() of the CPU backend.
__device__ inline float dequantized(const Operand& q, int64_t r, int64_t c) {
  const int64_t k = (r / q.block_rows) * q.scale_cols + c / q.block_cols;
  const float s = q.mx ? e8m0_decode(q.e8m0[k]) : q.scale_inv[k];
  return dequantize_value(q.codes[r * q.cols + c], s, q.format);
}

// c[m, n] = Σ_k a'[r, k]·b'[j, k] (+ c) (+ bias[j]): 64x64 tiles of c, 16-wide slices of k
// staged dequantized in shared memory, 4x4 outputs per thread.
constexpr int kBM = 64, kBN = 64, kBK = 16, kGemmThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kGemmThreads)
    emulated_gemm_kernel(Operand a, Operand b, T* c, int64_t ldc, BiasVector bias, bool accumulate) {
  __shared__ float as[kBK][kBM + 1];
  __shared__ float bs[kBK][kBN + 1];
  const int64_t m = a.rows, n = b.rows, k = a.cols;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kBM, n0 = static_cast<int64_t>(blockIdx.x) * kBN;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < k; k0 += kBK) {
    for (int e = threadIdx.x; e < kBM * kBK; e += kGemmThreads) {
      const int row = e / kBK, kk = e % kBK;
      as[kk][row] = m0 + row < m && k0 + kk < k ? dequantized(a, m0 + row, k0 + kk) : 0.0f;
      bs[kk][row] = n0 + row < n && k0 + kk < k ? dequantized(b, n0 + row, k0 + kk) : 0.0f;
    }
    __syncthreads();
    for (int kk = 0; kk < kBK; ++kk) {
      float av[4], bv[4];
      for (int i = 0; i < 4; ++i) av[i] = as[kk][ty + 16 * i];
      for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx + 16 * j];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      const int64_t r = m0 + ty + 16 * i, col = n0 + tx + 16 * j;
      if (r >= m || col >= n) continue;
      T* out = c + r * ldc + col;
      float v = acc[i][j];
      if (accumulate) v = v + load(*out);  // BLAS order: product, + beta·c, then the bias
      if (bias) v = v + bias[col];
      store(*out, v);  // bf16 c: rounded once
    }
}

void emulated_gemm(CudaBackend& be, const Tensor& c, const QTensor& a, const QTensor& b, BiasVector bias,
                   bool accumulate) {
  const int64_t m = a.rows, n = b.rows;
  const int64_t gy = (m + kBM - 1) / kBM, gx = (n + kBN - 1) / kBN;
  FLUX8_CHECK(gy <= 65535 && gx < (int64_t(1) << 31), "gemm_fp8_tn: m = {}, n = {} exceed one launch", m, n);
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  if (c.dtype == DType::bf16)
    emulated_gemm_kernel<<<grid, kGemmThreads, 0, be.stream()>>>(operand(a), operand(b), c.ptr<__nv_bfloat16>(), c.ld,
                                                                 bias, accumulate);
  else
    emulated_gemm_kernel<<<grid, kGemmThreads, 0, be.stream()>>>(operand(a), operand(b), c.ptr<float>(), c.ld, bias,
                                                                 accumulate);
  FLUX8_LAUNCH_CHECK(emulated_gemm_kernel);
}

// One stderr line per distinct reason (not per call): the run says that it emulates, and why.
void note_emulated(const std::string& key, const std::string& what, const std::string& why) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  const std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(key).second) fmt::print(stderr, "gemm_fp8_tn: {} emulated (dequantize + fp32 GEMM): {}\n", what, why);
}

// FLUX8_GEMM_BACKEND (or PRIMUS_TURBO_GEMM_BACKEND) pins where FP8 GEMMs run: auto (unset or
// empty: cuBLASLt where it has a kernel, the emulated kernel elsewhere), cublaslt (a product
// cuBLASLt cannot run is an error naming the reason: a run that must not fall back silently) or
// emulated (every FP8 GEMM on the dequantize + fp32 kernel: the reference, to tell a cuBLASLt
// problem from a cast problem). Parsed in backend/gemm_environment.h.
using GemmBackend = Fp8GemmBackend;

// Read at every call (a getenv is nothing next to a GEMM), so a test or tool may change it.
GemmBackend gemm_backend() { return fp8_gemm_backend_from_environment(); }

cudaDataType_t cuda_type(Fp8Format f) { return f == Fp8Format::e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool is_block(Fp8Scaling s) { return s == Fp8Scaling::block_1x128 || s == Fp8Scaling::block_128x128; }

// Why cuBLASLt cannot run this product ("" when it can, as far as the rules above go);
// `key` names the kind of reason for the once-only log.
std::string native_blocker(const Tensor& c, const QTensor& a, const QTensor& b, std::string& key) {
  const int64_t m = a.rows, n = b.rows, k = a.cols;
  if (a.scaling == Fp8Scaling::mx_1x32 || b.scaling == Fp8Scaling::mx_1x32) {
    key = "mx";
    return "native MXFP8 (1x32 blocks, E8M0 scales) needs sm_100 (Blackwell); Hopper has no such GEMM";
  }
  if (a.scaling != b.scaling && !(is_block(a.scaling) && is_block(b.scaling))) {
    key = "mixed";
    return fmt::format("operands scaled {} and {}: cuBLASLt has no GEMM mixing per-tensor and block scales",
                       fp8_scaling_name(a.scaling), fp8_scaling_name(b.scaling));
  }
  if (a.scaling == Fp8Scaling::block_128x128 && b.scaling == Fp8Scaling::block_128x128) {
    key = "2dx2d";
    return "both operands have 128x128 blocks: cuBLASLt's block-scaled GEMMs need one 1x128 operand";
  }
  if (k % 16 != 0) {
    key = "k16";
    return fmt::format("k = {} is not a multiple of 16 (cuBLASLt FP8 needs 16-byte aligned rows)", k);
  }
  if (is_block(a.scaling) && (n % 8 != 0 || (a.scaling == Fp8Scaling::block_1x128 && m % 8 != 0))) {
    key = "block8";
    return fmt::format(
        "m = {}, n = {}: cuBLASLt's block-scaled GEMMs need n % 8 == 0, and m % 8 == 0 when a has "
        "1x128 blocks",
        m, n);
  }
  if (!aligned16(a.codes) || !aligned16(b.codes) || !aligned16(c.data) || (c.ld * dtype_size(c.dtype)) % 16 != 0) {
    key = "align";
    return fmt::format("operands or output not 16-byte aligned (c ld = {}): cuBLASLt FP8 needs 16-byte alignment",
                       c.ld);
  }
  return "";
}

cublasLtMatmulMatrixScale_t scale_mode(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::block_1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case Fp8Scaling::block_128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    default: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  }
}

// The operand's scales in cuBLASLt's layout (see the top of the file), in scratch (`buffer`).
const float* cublas_scales(CudaBackend& be, const QTensor& q, void* (CudaBackend::*buffer)(size_t)) {
  const int64_t rows = q.rows, kb = (q.cols + 127) / 128;
  const float* in = q.scale_inv;
  if (q.scaling == Fp8Scaling::block_1x128) {
    float* out = static_cast<float*>((be.*buffer)(static_cast<size_t>(rows * kb) * sizeof(float)));
    for_each(be, rows * kb, [=] __device__(int64_t i) {
      const int64_t r = i / kb, j = i % kb;
      out[j * rows + r] = in[i];
    });
    return out;
  }
  const int64_t rb = (rows + 127) / 128, kb4 = (kb + 3) / 4 * 4;
  float* out = static_cast<float*>((be.*buffer)(static_cast<size_t>(rb * kb4) * sizeof(float)));
  for_each(be, rb * kb4, [=] __device__(int64_t i) {
    const int64_t r = i / kb4, j = i % kb4;
    out[i] = j < kb ? in[r * kb + j] : 1.0f;  // padding: never applied to data, kept finite
  });
  return out;
}

// The cuBLASLt description of row-major c = a·bᵀ (see the top of the file), with fast
// accumulation where `sum` allows it and the scales are per-tensor (block-scaled kernels promote
// every 128-wide block to fp32 by construction).
GemmDesc fp8_desc(const Tensor& c, const QTensor& a, const QTensor& b, Fp8Accumulation sum) {
  GemmDesc d;
  d.trans_a = CUBLAS_OP_T;
  d.trans_b = CUBLAS_OP_N;
  d.m = b.rows, d.n = a.rows, d.k = a.cols;
  d.lda = a.cols, d.ldb = a.cols, d.ldd = c.ld;
  d.type_a = cuda_type(b.format), d.type_b = cuda_type(a.format);
  d.type_d = c.dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
  d.compute = CUBLAS_COMPUTE_32F;
  d.scale_mode_a = scale_mode(b.scaling), d.scale_mode_b = scale_mode(a.scaling);
  d.fast_accum =
      sum == Fp8Accumulation::fast && a.scaling == Fp8Scaling::per_tensor && b.scaling == Fp8Scaling::per_tensor;
  return d;
}

}  // namespace
}  // namespace cuda

void CudaBackend::execute(const op::GemmFp8Tn& call) {
  using namespace cuda;
  constexpr std::string_view op = "gemm_fp8_tn";
  require_defined(op, {"c", call.c});
  if (call.c.dtype != DType::f32 && call.c.dtype != DType::bf16)
    fail("{}: output {} must be f32 or bf16 (an activation or a gradient stored in bf16)", op, call.c.str());
  if (call.c.ld < call.c.cols())
    fail("{}: output {} has row stride {} smaller than its columns", op, call.c.str(), call.c.ld);
  if (!call.a.defined() || !call.b.defined() || call.a.cols != call.b.cols || call.c.rows() != call.a.rows ||
      call.c.cols() != call.b.rows)
    fail("{}: c {} = a [{}, {}] · b [{}, {}]ᵀ does not fit", op, call.c.str(), call.a.rows, call.a.cols, call.b.rows,
         call.b.cols);
  if (call.bias.defined() && call.bias.numel() != call.b.rows)
    fail("{}: bias {} must be a vector of {} elements (f32, or bf16 for a bf16 output)", op, call.bias.str(),
         call.b.rows);
  const BiasVector bias_ptr = bias_vector(op, call.bias, call.c);
  for (const QTensor* q : {&call.a, &call.b})
    if (q->scaling == Fp8Scaling::mx_1x32 ? !q->scale_e8m0 : !q->scale_inv)
      fail("{}: operand {} [{}, {}] ({}) has no scales", op, q == &call.a ? "a" : "b", q->rows, q->cols,
           fp8_scaling_name(q->scaling));
  if (call.a.format == Fp8Format::e5m2 && call.b.format == Fp8Format::e5m2)
    fail(
        "{}: a and b are both E5M2; FP8 GEMMs take at most one E5M2 operand (cuBLASLt has no E5M2 x E5M2 "
        "kernel). Cast one of them to E4M3 (fp8: hybrid uses E5M2 for grad_output only)",
        op);
  const int64_t m = call.a.rows, n = call.b.rows, k = call.a.cols;
  if (m == 0 || n == 0) return;
  if (k == 0) {  // empty reduction: c = (c) + bias, which the tiled kernel does without a product
    emulated_gemm(*this, call.c, call.a, call.b, bias_ptr, call.accumulate);
    return;
  }

  GemmDesc d = fp8_desc(call.c, call.a, call.b, call.sum);
  d.accumulate = call.accumulate;
  std::string key;
  const GemmBackend pinned = gemm_backend();
  std::string why =
      pinned == GemmBackend::emulated ? "FLUX8_GEMM_BACKEND=emulated" : native_blocker(call.c, call.a, call.b, key);
  if (pinned == GemmBackend::emulated) key = "pinned";
  if (why.empty() && !gemm_->has_algorithm(d)) {  // (the strings only when it has none: this runs every call)
    why = gemm_->supported(d);
    key = "heuristic " + describe(d);
  }
  if (!why.empty() && pinned == GemmBackend::cublaslt)
    fail("{}: FLUX8_GEMM_BACKEND=cublaslt, but cuBLASLt cannot run this GEMM (m={} n={} k={}, {} x {}): {}", op, m, n,
         k, fp8_scaling_name(call.a.scaling), fp8_scaling_name(call.b.scaling), why);
  if (!why.empty()) {
    note_emulated(key,
                  fmt::format("{} GEMM m={} n={} k={} ({} x {})", fp8_scaling_name(call.a.scaling), m, n, k,
                              fp8_format_name(call.a.format), fp8_format_name(call.b.format)),
                  why);
    emulated_gemm(*this, call.c, call.a, call.b, bias_ptr, call.accumulate);
    return;
  }

  GemmArgs args;
  args.a = call.b.codes;
  args.b = call.a.codes;
  args.d = call.c.data;
  if (is_block(call.a.scaling)) {
    args.scale_a = cublas_scales(*this, call.b, &CudaBackend::scratch);
    args.scale_b = cublas_scales(*this, call.a, &CudaBackend::scratch2);
  } else {
    args.scale_a = call.b.scale_inv;
    args.scale_b = call.a.scale_inv;
  }
  try {
    gemm_with_bias(*this, d, args, call.c, bias_ptr);
  } catch (const GemmRefused& refused) {
    if (pinned == GemmBackend::cublaslt) throw;
    note_emulated("refused " + describe(d),
                  fmt::format("{} GEMM m={} n={} k={} ({} x {})", fp8_scaling_name(call.a.scaling), m, n, k,
                              fp8_format_name(call.a.format), fp8_format_name(call.b.format)),
                  refused.what());
    emulated_gemm(*this, call.c, call.a, call.b, bias_ptr, call.accumulate);
  }
}

}  // namespace flux8
