// Linear layer y = x·wᵀ + b and its backward, on OpenBLAS. Leading dimensions are the tensors'
// row strides, so column windows of fused projections are read and written in place.
#include <cblas.h>

#include <limits>
#include <vector>

#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"

namespace flux8 {
using namespace cpu;

namespace cpu {

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  constexpr int64_t kMax = std::numeric_limits<blasint>::max();
  FLUX8_CHECK(m <= kMax && n <= kMax && k <= kMax && lda <= kMax && ldb <= kMax && ldc <= kMax,
              "gemm dimensions {}x{}x{} exceed the BLAS integer range", m, n, k);
  const auto ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
  // BLAS requires ld >= 1 even for empty operands.
  const auto ld = [](int64_t v) { return static_cast<blasint>(std::max<int64_t>(v, 1)); };
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, ta, tb, static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha,
                a, ld(lda), b, ld(ldb), beta, c, ld(ldc));
  else
    cblas_dgemm(CblasRowMajor, ta, tb, static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha,
                a, ld(lda), b, ld(ldb), beta, c, ld(ldc));
}
template void gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                          float, float*, int64_t);
template void gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t, const double*,
                           int64_t, double, double*, int64_t);

}  // namespace cpu

void CpuBackend::execute(const op::Linear& args) {
  constexpr std::string_view op = "linear";
  const auto [t, c] = begin_call(options_, args);
  const auto [N, K, M] = ops::check(op, args);
  dispatch(t, [&]<typename T>(T) {
    parallel_gemm<T>(c, false, true, N, M, K, T(1), args.x.ptr<T>(), args.x.ld, args.w.ptr<T>(), args.w.ld, T(0),
                     args.y.ptr<T>(), args.y.ld);
    // Bias after the product, as a GEMM epilogue does.
    const T* bias = args.b.defined() ? args.b.ptr<T>() : nullptr;
    if (!bias && !c.round_bf16) return;
    parallel_for(N, c, [&](int64_t r) {
      T* yr = row<T>(args.y, r);
      for (int64_t j = 0; j < M; ++j) yr[j] = act<T>(bias ? yr[j] + bias[j] : yr[j], c);
    });
  });
}

// The epilogue's order: the sum plus bias unrounded, the GELU of that, each output rounded once.
void CpuBackend::execute(const op::LinearGelu& args) {
  constexpr std::string_view op = "linear_gelu";
  const auto [t, c] = begin_call(options_, args);
  [[maybe_unused]] const auto [N, K, M, G] = ops::check(op, args);
  dispatch(t, [&]<typename T>(T) {
    parallel_gemm<T>(c, false, true, N, M, K, T(1), args.x.ptr<T>(), args.x.ld, args.w.ptr<T>(), args.w.ld, T(0),
                     args.h.ptr<T>(), args.h.ld);
    gelu_epilogue<T>(args.h, args.y, args.b.defined() ? args.b.ptr<T>() : nullptr, c);
  });
}

void CpuBackend::execute(const op::LinearDgradGelu& args) {
  constexpr std::string_view op = "linear_dgrad_gelu";
  const auto [t, c] = begin_call(options_, args);
  [[maybe_unused]] const auto [N, K, M, G] = ops::check(op, args);
  dispatch(t, [&]<typename T>(T) {
    // The whole product P = dy·w first (one GEMM, as an unfused backward computes it), unrounded.
    std::vector<T> p(static_cast<size_t>(N * K));
    parallel_gemm<T>(c, false, false, N, K, M, T(1), args.dy.ptr<T>(), args.dy.ld, args.w.ptr<T>(), args.w.ld, T(0),
                     p.data(), K);
    dgelu_epilogue<T>(p.data(), args.dx, args.dh, args.h, c);
  });
}

void CpuBackend::execute(const op::LinearBackward& args) {
  constexpr std::string_view op = "linear_backward";
  const auto [t, c] = begin_call(options_, args);
  require_defined(op, {"dy", args.dy});
  require_rank(op, {"w", args.w}, 2);
  const int64_t N = args.dy.rows(), M = args.dy.cols(), K = args.w.shape[1];
  if (args.w.shape[0] != M)
    fail("{}: weight 'w' {} must be [{}, K] to match the output gradient 'dy' {}", op, args.w.str(), M, args.dy.str());
  dispatch(t, [&]<typename T>(T) {
    if (args.dx.defined()) {
      if (args.dx.rows() != N || args.dx.cols() != K)
        fail("{}: input gradient 'dx' {} must have {} rows of {} columns", op, args.dx.str(), N, K);
      parallel_gemm<T>(c, false, false, N, K, M, T(1), args.dy.ptr<T>(), args.dy.ld, args.w.ptr<T>(), args.w.ld,
                       args.accumulate_dx ? T(1) : T(0), args.dx.ptr<T>(), args.dx.ld);
      if (c.round_bf16)
        parallel_for(N, c, [&](int64_t r) {
          T* dxr = row<T>(args.dx, r);
          for (int64_t j = 0; j < K; ++j) dxr[j] = act<T>(dxr[j], c);
        });
    }
    if (args.dw.defined()) {
      require_shape(op, {"dw", args.dw}, args.w.shape);
      require_defined(op, {"x", args.x});
      if (args.x.rows() != N || args.x.cols() != K)
        fail("{}: input 'x' {} must have {} rows of {} columns", op, args.x.str(), N, K);
      // beta = 0 overwrites (BLAS never reads C then, so stale or NaN contents do not leak).
      if (!args.accumulate_params && N == 0) fill(args.dw, 0.0);  // no rows: no product to write
      parallel_gemm<T>(c, true, false, M, K, N, T(1), args.dy.ptr<T>(), args.dy.ld, args.x.ptr<T>(), args.x.ld,
                       args.accumulate_params ? T(1) : T(0), args.dw.ptr<T>(), args.dw.ld);
    }
    if (args.db.defined()) {
      if (args.db.numel() != M || !args.db.contiguous())
        fail("{}: bias gradient 'db' {} must be a contiguous vector of {} elements", op, args.db.str(), M);
      if (!args.accumulate_params) fill(args.db, 0.0);
      add_column_sums<T>(args.db, args.dy, c);
    }
  });
}

void CpuBackend::execute(const op::BiasAdd& args) {
  const auto [t, c] = begin_call(options_, args);
  require_vector(op::BiasAdd::name, {"b", args.b}, args.y.cols());
  dispatch(t, [&]<typename T>(T) {
    const T* bias = args.b.ptr<T>();
    parallel_for(args.y.rows(), c, [&](int64_t r) {
      T* yr = row<T>(args.y, r);
      for (int64_t j = 0; j < args.y.cols(); ++j) yr[j] = act<T>(yr[j] + bias[j], c);
    });
  });
}

}  // namespace flux8
