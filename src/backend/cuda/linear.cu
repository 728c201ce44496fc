// Linear layer y = x·wᵀ + b and its backward through cuBLASLt (gemm.h). Two precisions:
// - bf16 (BackendOptions::bf16_gemm, the training default): operands rounded to bf16 (RNE) into
//   scratch, tensor-core GEMM with fp32 accumulation and f32 output — what "BF16 training"
//   means for the GEMMs; the result differs from the exact product by the operand rounding
//   (~2⁻⁹ relative per operand).
// - f32: exact f32 GEMMs with fp32 compute (no TF32), the reference the tests compare with.
// Row-major tensors are column-major transposes, so each product is issued with the operands
// swapped: y[N,M] = x·wᵀ  <=>  yᵀ[M,N] = wᵀ·xᵀ, with the row strides as leading dimensions.
#include <cuda_bf16.h>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.h"

namespace flux8 {
using namespace cuda;

namespace {

// A GEMM operand as handed to cuBLASLt: pointer, leading dimension and element type.
struct Operand {
  const void* p;
  int64_t ld;
  cudaDataType_t type;
};

// x (any ld) rounded to bf16 into dst as a contiguous [rows, cols] matrix: a contiguous x
// through the shared vectorised conversion (convert.cu), a strided one row by row.
Operand bf16_operand(CudaBackend& be, const Tensor& x, __nv_bfloat16* dst) {
  const Mat X = mat(x);
  const int64_t cols = X.cols;
  if (x.contiguous())
    to_bf16(dst, X.p, X.rows * cols, be.stream());
  else
    for_each_row(be, X.rows, cols,
                 [=] __device__(int64_t r, int c) { dst[r * cols + c] = __float2bfloat16_rn(X.at(r, c)); });
  return Operand{dst, cols, CUDA_R_16BF};
}

// The operands of one call in the precision the backend runs its GEMMs in. In bf16 mode the
// copies share one scratch allocation (carved in 256-byte aligned pieces).
class Operands {
 public:
  Operands(CudaBackend& be, std::initializer_list<const Tensor*> tensors) : be_(be) {
    if (!be.options().bf16_gemm) return;
    size_t total = 0;
    for (const Tensor* t : tensors) total += t->defined() ? align(t->numel() * 2) : 0;
    base_ = static_cast<char*>(be.scratch(total));
  }
  Operand get(const Tensor& t) {
    if (!base_) return Operand{t.data, t.ld, CUDA_R_32F};
    auto* dst = reinterpret_cast<__nv_bfloat16*>(base_ + used_);
    used_ += align(t.numel() * 2);
    return bf16_operand(be_, t, dst);
  }
  cudaDataType_t type() const { return base_ ? CUDA_R_16BF : CUDA_R_32F; }

 private:
  static size_t align(int64_t bytes) { return (static_cast<size_t>(bytes) + 255) / 256 * 256; }
  CudaBackend& be_;
  char* base_ = nullptr;
  size_t used_ = 0;
};

}  // namespace

void CudaBackend::linear(Tensor y, Tensor x, Tensor w, Tensor b) {
  constexpr std::string_view op = "linear";
  require_f32(op, {{"y", y}, {"x", x}, {"w", w}, {"b", b}});
  const auto [N, K, M] = ops::check_linear(op, y, x, w, b);
  if (K == 0) {  // empty product: y = b (or 0)
    if (b.defined()) {
      const Mat Y = mat(y);
      const float* bias = b.ptr<float>();
      for_each_row(*this, N, M, [=] __device__(int64_t r, int c) { Y.at(r, c) = bias[c]; });
    } else {
      fill(y, 0.0);
    }
    return;
  }
  Operands ops(*this, {&w, &x});
  const Operand W = ops.get(w), X = ops.get(x);
  GemmDesc d;
  d.trans_a = CUBLAS_OP_T;
  d.trans_b = CUBLAS_OP_N;
  d.m = M, d.n = N, d.k = K;
  d.lda = W.ld, d.ldb = X.ld, d.ldd = y.ld;
  d.type_a = d.type_b = ops.type();
  d.bias = b.defined();
  gemm_->run(d, GemmArgs{.a = W.p, .b = X.p, .d = y.data, .bias = b.data});
}

void CudaBackend::linear_backward(Tensor dx, Tensor dw, Tensor db, Tensor dy, Tensor x, Tensor w,
                                  bool accumulate_dx) {
  constexpr std::string_view op = "linear_backward";
  require_f32(op, {{"dx", dx}, {"dw", dw}, {"db", db}, {"dy", dy}, {"x", x}, {"w", w}});
  require_defined(op, {"dy", dy});
  require_rank(op, {"w", w}, 2);
  const int64_t N = dy.rows(), M = dy.cols(), K = w.shape[1];
  if (w.shape[0] != M)
    fail("{}: weight 'w' {} must be [{}, K] to match the output gradient 'dy' {}", op, w.str(), M, dy.str());
  const bool gemm_dx = dx.defined() && M > 0, gemm_dw = dw.defined() && N > 0;
  static const Tensor none;
  Operands ops(*this, {&dy, gemm_dx ? &w : &none, gemm_dw ? &x : &none});
  const Operand DY = gemm_dx || gemm_dw ? ops.get(dy) : Operand{};
  if (dx.defined()) {
    if (dx.rows() != N || dx.cols() != K)
      fail("{}: input gradient 'dx' {} must have {} rows of {} columns", op, dx.str(), N, K);
    if (M == 0) {
      if (!accumulate_dx) fill(dx, 0.0);
    } else {
      // dxᵀ[K,N] = w-as-colmajor[K,M] · dyᵀ[M,N]
      const Operand W = ops.get(w);
      GemmDesc d;
      d.m = K, d.n = N, d.k = M;
      d.lda = W.ld, d.ldb = DY.ld, d.ldd = dx.ld;
      d.type_a = d.type_b = ops.type();
      d.accumulate = accumulate_dx;
      gemm_->run(d, GemmArgs{.a = W.p, .b = DY.p, .d = dx.data});
    }
  }
  if (dw.defined()) {
    require_shape(op, {"dw", dw}, w.shape);
    require_defined(op, {"x", x});
    if (x.rows() != N || x.cols() != K) fail("{}: input 'x' {} must have {} rows of {} columns", op, x.str(), N, K);
    if (N > 0) {
      // dwᵀ[K,M] += xᵀ[K,N] · dy[N,M]
      const Operand X = ops.get(x);
      GemmDesc d;
      d.trans_b = CUBLAS_OP_T;
      d.m = K, d.n = M, d.k = N;
      d.lda = X.ld, d.ldb = DY.ld, d.ldd = dw.ld;
      d.type_a = d.type_b = ops.type();
      d.accumulate = true;
      gemm_->run(d, GemmArgs{.a = X.p, .b = DY.p, .d = dw.data});
    }
  }
  if (db.defined()) {
    if (db.numel() != M || !db.contiguous())
      fail("{}: bias gradient 'db' {} must be a contiguous vector of {} elements", op, db.str(), M);
    const Mat DY = mat(dy);
    column_sums(*this, 1, N, M, [=] __device__(int64_t, int64_t r, int64_t c) { return double(DY.at(r, c)); },
                db.ptr<float>(), M, true);
  }
}

}  // namespace flux8
