// fill, copy, add, accumulate and the gated residual: elementwise over [rows, cols], any ld.
#include <cstring>

#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"
#include "core/rng.h"

namespace flux8 {
using namespace cpu;

void CpuBackend::execute(const op::Fill& args) {
  const auto [t, c] = begin_call(options_, args);
  dispatch(t, [&]<typename T>(T) {
    parallel_for(args.y.rows(), c, [&](int64_t r) {
      std::fill(row<T>(args.y, r), row<T>(args.y, r) + args.y.cols(), static_cast<T>(args.value));
    });
  });
}

void CpuBackend::execute(const op::FillRandom& args) {
  const auto [t, c] = begin_call(options_, args);
  require_contiguous("fill_random", {"y", args.y});
  dispatch(t, [&]<typename T>(T) {
    T* out = args.y.ptr<T>();
    parallel_for(args.y.numel(), c, [&](int64_t i) {
      const uint64_t k = static_cast<uint64_t>(i);
      const double v = args.dist == Random::normal
                           ? static_cast<double>(rng_normal(args.seed, args.stream, k))
                           : 2.0 * static_cast<double>(rng_uniform(args.seed, args.stream, k)) - 1.0;
      out[i] = static_cast<T>(args.scale * v);
    });
  });
}

void CpuBackend::execute(const op::Copy& args) {
  // bf16 to bf16 (moments of adam_moment_precision: bf16, gathered or scattered by a sharded
  // optimizer): the bits as they are, as the CUDA backend copies them.
  if (args.x.defined() && args.y.defined() && args.x.dtype == DType::bf16 && args.y.dtype == DType::bf16) {
    require_same_matrix("copy", {"y", args.y}, {"x", args.x});
    for (int64_t r = 0; r < args.y.rows(); ++r)
      std::memcpy(static_cast<uint16_t*>(args.y.data) + r * args.y.ld,
                  static_cast<const uint16_t*>(args.x.data) + r * args.x.ld, static_cast<size_t>(args.x.cols()) * 2);
    return;
  }
  const auto [t, c] = begin_call(options_, args);
  require_same_matrix("copy", {"y", args.y}, {"x", args.x});
  dispatch(t, [&]<typename T>(T) {
    parallel_for(args.y.rows(), c, [&](int64_t r) {
      std::copy(row<T>(args.x, r), row<T>(args.x, r) + args.x.cols(), row<T>(args.y, r));
    });
  });
}

void CpuBackend::execute(const op::Add& args) {
  const auto [t, c] = begin_call(options_, args);
  require_same_matrix("add", {"y", args.y}, {"a", args.a});
  require_same_matrix("add", {"y", args.y}, {"b", args.b});
  dispatch(t, [&]<typename T>(T) {
    parallel_for(args.y.rows(), c, [&](int64_t r) {
      T* yr = row<T>(args.y, r);
      const T *ar = row<T>(args.a, r), *br = row<T>(args.b, r);
      for (int64_t j = 0; j < args.y.cols(); ++j) yr[j] = ar[j] + br[j];
    });
  });
}

void CpuBackend::execute(const op::Accumulate& args) {
  const auto [t, c] = begin_call(options_, args);
  require_same_matrix("accumulate", {"y", args.y}, {"x", args.x});
  dispatch(t, [&]<typename T>(T) {
    parallel_for(args.y.rows(), c, [&](int64_t r) {
      T* yr = row<T>(args.y, r);
      const T* xr = row<T>(args.x, r);
      for (int64_t j = 0; j < args.y.cols(); ++j) yr[j] += xr[j];
    });
  });
}

// out[B, L, H] = x + gate[b] ⊙ y (out may be x). The residual stream is an activation, so it
// is rounded.
void CpuBackend::execute(const op::GatedResidual& args) {
  constexpr std::string_view op = "gated_residual";
  const auto [t, c] = begin_call(options_, args);
  ops::check(op, args);
  const int64_t L = args.x.shape[1], H = args.x.shape[2];
  dispatch(t, [&]<typename T>(T) {
    parallel_for(args.x.rows(), c, [&](int64_t r) {
      T* outr = row<T>(args.out, r);
      const T *xr = row<T>(args.x, r), *yr = row<T>(args.y, r), *g = row<T>(args.gate, r / L);
      for (int64_t j = 0; j < H; ++j) outr[j] = act<T>(xr[j] + g[j] * yr[j], c);
    });
  });
}

// dy = gate[b] ⊙ dx;  dgate[b] = Σ_l dx ⊙ y (both input gradients: rounded like activations).
void CpuBackend::execute(const op::GatedResidualBackward& args) {
  constexpr std::string_view op = "gated_residual_backward";
  const auto [t, c] = begin_call(options_, args);
  const auto [B, L, H] = ops::check(op, args);
  dispatch(t, [&]<typename T>(T) {
    if (args.dy.defined()) {
      parallel_for(args.dx.rows(), c, [&](int64_t r) {
        T* dyr = row<T>(args.dy, r);
        const T *dxr = row<T>(args.dx, r), *g = row<T>(args.gate, r / L);
        for (int64_t j = 0; j < H; ++j) dyr[j] = act<T>(g[j] * dxr[j], c);
      });
    }
    if (args.dgate.defined()) {
      const auto s = grouped_column_sums(B, L, H, c, [&](int64_t b, int64_t l, double* acc) {
        const T *dxr = row<T>(args.dx, b * L + l), *yr = row<T>(args.y, b * L + l);
        for (int64_t j = 0; j < H; ++j) acc[j] += static_cast<double>(dxr[j]) * yr[j];
      });
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < H; ++j) row<T>(args.dgate, b)[j] = act<T>(T(s[b * H + j]), c);
    }
  });
}

}  // namespace flux8
