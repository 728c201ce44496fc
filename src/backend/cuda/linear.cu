// Linear layer y = x·wᵀ + b and its backward through cuBLASLt (gemm.h) in f32 with fp32
// compute (no TF32: the f32 path is the accurate one; speed comes from the bf16/FP8 paths).
// Row-major tensors are column-major transposes, so each product is issued with the operands
// swapped: y[N,M] = x·wᵀ  <=>  yᵀ[M,N] = wᵀ·xᵀ, with the row strides as leading dimensions.
#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.h"

namespace flux8 {
using namespace cuda;

void CudaBackend::linear(Tensor y, Tensor x, Tensor w, Tensor b) {
  constexpr std::string_view op = "linear";
  require_f32(op, {{"y", y}, {"x", x}, {"w", w}, {"b", b}});
  require_defined(op, {"x", x});
  require_rank(op, {"w", w}, 2);
  const int64_t N = x.rows(), K = x.cols(), M = w.shape[0];
  if (w.shape[1] != K) fail("{}: weight 'w' {} must be [M, {}] to match input 'x' {}", op, w.str(), K, x.str());
  require_defined(op, {"y", y});
  if (y.rows() != N || y.cols() != M)
    fail("{}: output 'y' {} must have {} rows of {} columns for x {} and w {}", op, y.str(), N, M, x.str(),
         w.str());
  if (b.defined() && (b.numel() != M || !b.contiguous()))
    fail("{}: bias 'b' {} must be a contiguous vector of {} elements", op, b.str(), M);
  if (K == 0) {  // empty product: y = b (or 0)
    if (b.defined()) {
      const Mat Y = mat(y);
      const float* bias = b.ptr<float>();
      for_each(*this, N * M, [=] __device__(int64_t i) { Y.at(i / M, i % M) = bias[i % M]; });
    } else {
      fill(y, 0.0);
    }
    return;
  }
  GemmDesc d;
  d.trans_a = CUBLAS_OP_T;
  d.trans_b = CUBLAS_OP_N;
  d.m = M, d.n = N, d.k = K;
  d.lda = w.ld, d.ldb = x.ld, d.ldd = y.ld;
  d.bias = b.defined();
  gemm_->run(d, GemmArgs{.a = w.data, .b = x.data, .d = y.data, .bias = b.data});
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
  if (dx.defined()) {
    if (dx.rows() != N || dx.cols() != K)
      fail("{}: input gradient 'dx' {} must have {} rows of {} columns", op, dx.str(), N, K);
    if (M == 0) {
      if (!accumulate_dx) fill(dx, 0.0);
    } else {
      // dxᵀ[K,N] = w-as-colmajor[K,M] · dyᵀ[M,N]
      GemmDesc d;
      d.m = K, d.n = N, d.k = M;
      d.lda = w.ld, d.ldb = dy.ld, d.ldd = dx.ld;
      d.accumulate = accumulate_dx;
      gemm_->run(d, GemmArgs{.a = w.data, .b = dy.data, .d = dx.data});
    }
  }
  if (dw.defined()) {
    require_shape(op, {"dw", dw}, w.shape);
    require_defined(op, {"x", x});
    if (x.rows() != N || x.cols() != K) fail("{}: input 'x' {} must have {} rows of {} columns", op, x.str(), N, K);
    if (N > 0) {
      // dwᵀ[K,M] += xᵀ[K,N] · dy[N,M]
      GemmDesc d;
      d.trans_b = CUBLAS_OP_T;
      d.m = K, d.n = M, d.k = N;
      d.lda = x.ld, d.ldb = dy.ld, d.ldd = dw.ld;
      d.accumulate = true;
      gemm_->run(d, GemmArgs{.a = x.data, .b = dy.data, .d = dw.data});
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
