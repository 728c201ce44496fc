// fill, copy, add, accumulate and the gated residual: elementwise over [rows, cols], any ld.
#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"
#include "core/rng.h"

namespace flux8 {
using namespace cpu;

void CpuBackend::fill(Tensor y, double value) {
  const DType t = call_dtype("fill", {{"y", y}});
  const Ctx c = make_ctx(options_, t);
  dispatch(t, [&]<typename T>(T) {
    parallel_for(y.rows(), c, [&](int64_t r) {
      std::fill(row<T>(y, r), row<T>(y, r) + y.cols(), static_cast<T>(value));
    });
  });
}

void CpuBackend::fill_random(Tensor y, Random dist, uint64_t seed, uint64_t stream, double scale) {
  const DType t = call_dtype("fill_random", {{"y", y}});
  require_contiguous("fill_random", {"y", y});
  const Ctx c = make_ctx(options_, t);
  dispatch(t, [&]<typename T>(T) {
    T* out = y.ptr<T>();
    parallel_for(y.numel(), c, [&](int64_t i) {
      const uint64_t k = static_cast<uint64_t>(i);
      const double v = dist == Random::normal ? static_cast<double>(rng_normal(seed, stream, k))
                                              : 2.0 * static_cast<double>(rng_uniform(seed, stream, k)) - 1.0;
      out[i] = static_cast<T>(scale * v);
    });
  });
}

void CpuBackend::copy(Tensor y, Tensor x) {
  const DType t = call_dtype("copy", {{"y", y}, {"x", x}});
  require_same_matrix("copy", {"y", y}, {"x", x});
  const Ctx c = make_ctx(options_, t);
  dispatch(t, [&]<typename T>(T) {
    parallel_for(y.rows(), c, [&](int64_t r) {
      std::copy(row<T>(x, r), row<T>(x, r) + x.cols(), row<T>(y, r));
    });
  });
}

void CpuBackend::add(Tensor y, Tensor a, Tensor b) {
  const DType t = call_dtype("add", {{"y", y}, {"a", a}, {"b", b}});
  require_same_matrix("add", {"y", y}, {"a", a});
  require_same_matrix("add", {"y", y}, {"b", b});
  const Ctx c = make_ctx(options_, t);
  dispatch(t, [&]<typename T>(T) {
    parallel_for(y.rows(), c, [&](int64_t r) {
      T* yr = row<T>(y, r);
      const T *ar = row<T>(a, r), *br = row<T>(b, r);
      for (int64_t j = 0; j < y.cols(); ++j) yr[j] = ar[j] + br[j];
    });
  });
}

void CpuBackend::accumulate(Tensor y, Tensor x) {
  const DType t = call_dtype("accumulate", {{"y", y}, {"x", x}});
  require_same_matrix("accumulate", {"y", y}, {"x", x});
  const Ctx c = make_ctx(options_, t);
  dispatch(t, [&]<typename T>(T) {
    parallel_for(y.rows(), c, [&](int64_t r) {
      T* yr = row<T>(y, r);
      const T* xr = row<T>(x, r);
      for (int64_t j = 0; j < y.cols(); ++j) yr[j] += xr[j];
    });
  });
}

// out[B, L, H] = x + gate[b] ⊙ y (out may be x). The residual stream is an activation, so it
// is rounded.
void CpuBackend::gated_residual(Tensor out, Tensor x, Tensor y, Tensor gate) {
  constexpr std::string_view op = "gated_residual";
  const DType t = call_dtype(op, {{"out", out}, {"x", x}, {"y", y}, {"gate", gate}});
  require_rank(op, {"x", x}, 3);
  require_shape(op, {"out", out}, x.shape);
  require_shape(op, {"y", y}, x.shape);
  require_shape(op, {"gate", gate}, Shape{x.shape[0], x.shape[2]});
  const Ctx c = make_ctx(options_, t);
  const int64_t L = x.shape[1], H = x.shape[2];
  dispatch(t, [&]<typename T>(T) {
    parallel_for(x.rows(), c, [&](int64_t r) {
      T* outr = row<T>(out, r);
      const T *xr = row<T>(x, r), *yr = row<T>(y, r), *g = row<T>(gate, r / L);
      for (int64_t j = 0; j < H; ++j) outr[j] = act<T>(xr[j] + g[j] * yr[j], c);
    });
  });
}

// dy = gate[b] ⊙ dx;  dgate[b] = Σ_l dx ⊙ y (both input gradients: rounded like activations).
void CpuBackend::gated_residual_backward(Tensor dy, Tensor dgate, Tensor dx, Tensor y,
                                         Tensor gate) {
  constexpr std::string_view op = "gated_residual_backward";
  const DType t =
      call_dtype(op, {{"dy", dy}, {"dgate", dgate}, {"dx", dx}, {"y", y}, {"gate", gate}});
  require_rank(op, {"dx", dx}, 3);
  const int64_t B = dx.shape[0], L = dx.shape[1], H = dx.shape[2];
  const Ctx c = make_ctx(options_, t);
  dispatch(t, [&]<typename T>(T) {
    if (dy.defined()) {
      require_shape(op, {"dy", dy}, dx.shape);
      require_shape(op, {"gate", gate}, Shape{B, H});
      parallel_for(dx.rows(), c, [&](int64_t r) {
        T* dyr = row<T>(dy, r);
        const T *dxr = row<T>(dx, r), *g = row<T>(gate, r / L);
        for (int64_t j = 0; j < H; ++j) dyr[j] = act<T>(g[j] * dxr[j], c);
      });
    }
    if (dgate.defined()) {
      require_shape(op, {"y", y}, dx.shape);
      require_shape(op, {"dgate", dgate}, Shape{B, H});
      const auto s = grouped_column_sums(B, L, H, c, [&](int64_t b, int64_t l, double* acc) {
        const T *dxr = row<T>(dx, b * L + l), *yr = row<T>(y, b * L + l);
        for (int64_t j = 0; j < H; ++j) acc[j] += static_cast<double>(dxr[j]) * yr[j];
      });
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < H; ++j) row<T>(dgate, b)[j] = act<T>(T(s[b * H + j]), c);
    }
  });
}

}  // namespace flux8
