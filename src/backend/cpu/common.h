#pragma once
// Helpers shared by the CPU op files: dtype dispatch, shape checks that name the op and the
// tensors, row access that honours `ld`, bf16 activation rounding, deterministic column sums
// and a row-major GEMM wrapper.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "backend/backend.h"
#include "backend/op_checks.h"
#include "core/error.h"

namespace flux8::cpu {

// The shared argument checks (backend/op_checks.h), unqualified in the op files.
using namespace ops;

// Checks that all defined tensors share one dtype (f32 or f64) and have ld >= cols; returns it.
inline DType call_dtype(std::string_view op, std::span<const Named> tensors) {
  return ops::call_dtype(op, tensors, {DType::f32, DType::f64}, "CPU");
}
// The same over every Tensor field of the op.
template <typename Op>
DType call_dtype(const Op& a) {
  return ops::call_dtype(a, {DType::f32, DType::f64}, "CPU");
}

// What every op needs besides its tensors.
struct Ctx {
  bool round_bf16 = false;  // only ever true for f32 calls
  int threads = 1;
};
inline Ctx make_ctx(const BackendOptions& o, DType t) {
  // Read per call so that omp_set_num_threads() between calls takes effect.
  return Ctx{o.round_activations_to_bf16 && t == DType::f32, o.threads > 0 ? o.threads : omp_get_max_threads()};
}

// The element type of an op call (call_dtype over its tensors) and the context it runs in.
struct Call {
  DType t;
  Ctx c;
};
template <typename Op>
Call begin_call(const BackendOptions& o, const Op& a) {
  const DType t = call_dtype(a);
  return {t, make_ctx(o, t)};
}

// Calls f(T{}) with T = float or double according to t.
template <typename F>
void dispatch(DType t, F&& f) {
  if (t == DType::f64)
    f(double{});
  else
    f(float{});
}

// Runs f(r) for r in [0, rows) on the op's threads; each r must write only its own outputs.
template <typename F>
void parallel_for(int64_t n, const Ctx& c, F f) {
#pragma omp parallel for num_threads(c.threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) f(i);
}

template <typename T>
inline T* row(const Tensor& t, int64_t r) {
  return t.ptr<T>() + r * t.ld;
}

// f(head_row, token_row, b, l) for every head h, sample b and token l < Ls of one stream:
// head_row = heads[b, h, offset + l, :] ([B, n, L, D]), token_row = tokens[b, l, h·D : (h+1)·D]
// ([B, Ls, n·D], any ld). Parallel over (b, h, l); each call owns one head row and one token
// segment. The layout copies and the fused QK-norm + RoPE ops walk the two layouts this way.
template <typename T, typename F>
void for_each_head_row(const Tensor& heads, const Tensor& tokens, int64_t offset, const Ctx& c, F f) {
  const int64_t n = heads.shape[1], L = heads.shape[2], D = heads.shape[3];
  const int64_t B = heads.shape[0], Ls = tokens.shape[1];
  parallel_for(B * n * Ls, c, [&](int64_t i) {
    const int64_t b = i / (n * Ls), h = (i / Ls) % n, l = i % Ls;
    f(row<T>(heads, (b * n + h) * L + offset + l), row<T>(tokens, b * Ls + l) + h * D, b, l);
  });
}

// Value stored into an activation or input-gradient output: the bf16 value the GPU would keep.
template <typename T>
inline T act(T v, const Ctx& c) {
  if constexpr (std::is_same_v<T, float>) return c.round_bf16 ? round_to_bf16(v) : v;
  return v;
}

// RoPE of one head row: every adjacent pair (x0, x1) of x → (c·x0 − s·x1, s·x0 + c·x1) into y,
// with (c, s) the pair's entry of the table row cs; inverse rotates by −s. y may be x. rope() and
// the fused qk_norm_rope_to_heads ops all rotate here, so their results agree bit for bit.
template <typename T>
inline void rotate_pairs(T* y, const T* x, const T* cs, int64_t D, bool inverse, const Ctx& c) {
  for (int64_t p = 0; p < D / 2; ++p) {
    const T co = cs[2 * p], si = inverse ? -cs[2 * p + 1] : cs[2 * p + 1];
    const T x0 = x[2 * p], x1 = x[2 * p + 1];
    y[2 * p] = act<T>(co * x0 - si * x1, c);
    y[2 * p + 1] = act<T>(si * x0 + co * x1, c);
  }
}

// sums[g·cols + c] = Σ_{r < rows} (row r of group g)[c], accumulated in double. add_row(g, r,
// acc) adds one row's contribution into acc[0, cols). Rows are cut into chunks whose size
// depends only on `rows`; chunk partials are combined in chunk order, so the result is the
// same for every thread count.
template <typename AddRow>
std::vector<double> grouped_column_sums(int64_t groups, int64_t rows, int64_t cols, const Ctx& c, AddRow add_row) {
  const int64_t chunks = std::clamp<int64_t>(rows / 64, 1, 32);
  const int64_t chunk_rows = (rows + chunks - 1) / chunks;
  std::vector<double> partial(static_cast<size_t>(groups * chunks * cols), 0.0);
#pragma omp parallel for num_threads(c.threads) schedule(static)
  for (int64_t gc = 0; gc < groups * chunks; ++gc) {
    const int64_t g = gc / chunks, r0 = (gc % chunks) * chunk_rows;
    double* acc = partial.data() + gc * cols;
    for (int64_t r = r0; r < std::min(rows, r0 + chunk_rows); ++r) add_row(g, r, acc);
  }
  std::vector<double> sums(static_cast<size_t>(groups * cols), 0.0);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t k = 0; k < chunks; ++k) {
      const double* p = partial.data() + (g * chunks + k) * cols;
      double* s = sums.data() + g * cols;
      for (int64_t j = 0; j < cols; ++j) s[j] += p[j];
    }
  return sums;
}

// out[j] += Σ_r x[r, j] (a Linear's bias gradient from its output gradient x): the one place
// both linear_backward's db and quantize's column_sums take it from, so they agree bit for bit.
template <typename T>
void add_column_sums(Tensor out, const Tensor& x, const Ctx& c) {
  const int64_t R = x.rows(), C = x.cols();
  const auto s = grouped_column_sums(1, R, C, c, [&](int64_t, int64_t r, double* acc) {
    const T* xr = row<T>(x, r);
    for (int64_t j = 0; j < C; ++j) acc[j] += xr[j];
  });
  T* o = out.ptr<T>();
  for (int64_t j = 0; j < C; ++j) o[j] = static_cast<T>(o[j] + s[j]);
}

// GELU, tanh approximation, and its derivative (activations.cpp; linear.cpp's GELU epilogues).
constexpr double kGeluC = 0.7978845608028654;  // √(2/π)
constexpr double kGeluA = 0.044715;

template <typename T>
T gelu_tanh_value(T x) {
  const T u = T(kGeluC) * (x + T(kGeluA) * x * x * x);
  return T(0.5) * x * (T(1) + std::tanh(u));
}

// d/dx ½x(1 + tanh u) = ½(1 + tanh u) + ½x(1 − tanh²u)·√(2/π)(1 + 3a·x²).
template <typename T>
T gelu_tanh_grad(T x) {
  const T th = std::tanh(T(kGeluC) * (x + T(kGeluA) * x * x * x));
  return T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * T(kGeluC) * (T(1) + T(3 * kGeluA) * x * x);
}

// The GELU epilogue of linear_gelu on the product already in h [rows, n] (unrounded):
// v = h + bias (bias may be null), y = gelu_tanh(v) of h's last y.cols() columns, h = v, each
// rounded once — GELU of the unrounded sum, as a fused GEMM epilogue computes it.
template <typename T>
void gelu_epilogue(const Tensor& h, const Tensor& y, const T* bias, const Ctx& c) {
  const int64_t n = h.cols(), first = n - y.cols();
  parallel_for(h.rows(), c, [&](int64_t r) {
    T* hr = row<T>(h, r);
    T* yr = row<T>(y, r);
    for (int64_t j = 0; j < n; ++j) {
      const T v = bias ? hr[j] + bias[j] : hr[j];
      if (j >= first) yr[j - first] = act<T>(gelu_tanh_value(v), c);
      hr[j] = act<T>(v, c);
    }
  });
}

// The derivative's epilogue of linear_dgrad_gelu on the whole product p [rows, n] (row stride
// n, unrounded): dx = p's first n − dh.cols() columns (when there are any), dh = p's last
// columns ⊙ gelu_tanh'(h), each rounded once.
template <typename T>
void dgelu_epilogue(const T* p, const Tensor& dx, const Tensor& dh, const Tensor& h, const Ctx& c) {
  const int64_t G = dh.cols(), first = dx.defined() ? dx.cols() : 0, n = first + G;
  parallel_for(dh.rows(), c, [&](int64_t r) {
    const T* pr = p + r * n;
    if (first > 0) {
      T* dxr = row<T>(dx, r);
      for (int64_t j = 0; j < first; ++j) dxr[j] = act<T>(pr[j], c);
    }
    T* d = row<T>(dh, r);
    const T* hr = row<T>(h, r);
    for (int64_t j = 0; j < G; ++j) d[j] = act<T>(pr[first + j] * gelu_tanh_grad(hr[j]), c);
  });
}

// Row-major C[m,n] = alpha·op(A)·op(B) + beta·C through OpenBLAS; op(X) = Xᵀ when trans_x.
// Single-threaded: OpenBLAS runs with one thread (see CpuBackend's constructor), so it can be
// called from inside parallel regions (attention heads) without oversubscribing the cores.
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc);

// The same on the op's threads: C's rows are cut into blocks of a fixed size (a function of
// the shape only) and the blocks are shared among the threads. OpenBLAS may round an element
// differently depending on where it falls in the block it is given (edge kernels), so the
// blocks must not depend on the thread count: then the bits do not either.
template <typename T>
void parallel_gemm(const Ctx& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                   int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  constexpr int64_t kRowBlock = 64;
  const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  if (blocks <= 1 || m * n * k < (1 << 16)) {
    gemm<T>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
#pragma omp parallel for num_threads(ctx.threads) schedule(static)
  for (int64_t p = 0; p < blocks; ++p) {
    const int64_t r0 = p * kRowBlock, rows = std::min(kRowBlock, m - r0);
    // Rows r0.. of op(A): rows of A, or columns of A when transposed.
    const T* a_part = trans_a ? a + r0 : a + r0 * lda;
    gemm<T>(trans_a, trans_b, rows, n, k, alpha, a_part, lda, b, ldb, beta, c + r0 * ldc, ldc);
  }
}

}  // namespace flux8::cpu
