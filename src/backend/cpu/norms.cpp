// Modulated LayerNorm (adaLN) and the per-head RMSNorm of QK-norm. Row statistics are
// accumulated in double; mean/rstd are stored unrounded in the tensor dtype, and both the
// forward and the backward normalise with those stored values so the two agree exactly.
#include <cmath>

#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"

namespace flux8 {
using namespace cpu;

void CpuBackend::execute(const op::LayernormModulate& args) {
  constexpr std::string_view op = "layernorm_modulate";
  const auto [t, c] = begin_call(options_, args);
  const auto [B, L, H] = ops::check(op, args);
  dispatch(t, [&]<typename T>(T) {
    parallel_for(B * L, c, [&](int64_t r) {
      const T* xr = row<T>(args.x, r);
      double sum = 0;
      for (int64_t j = 0; j < H; ++j) sum += xr[j];
      const double mu = sum / static_cast<double>(H);
      double sq = 0;  // two-pass variance: no cancellation for rows with a large mean
      for (int64_t j = 0; j < H; ++j) sq += (xr[j] - mu) * (xr[j] - mu);
      const T mu_t = static_cast<T>(mu);
      const T rs_t = static_cast<T>(1.0 / std::sqrt(sq / static_cast<double>(H) + args.eps));
      args.mean.ptr<T>()[r] = mu_t;
      args.rstd.ptr<T>()[r] = rs_t;
      if (!args.y.defined()) return;  // statistics only
      const T *sh = row<T>(args.shift, r / L), *sc = row<T>(args.scale, r / L);
      T* yr = row<T>(args.y, r);
      for (int64_t j = 0; j < H; ++j) {
        const double xhat = (static_cast<double>(xr[j]) - mu_t) * rs_t;
        yr[j] = act<T>(static_cast<T>((1.0 + sc[j]) * xhat + sh[j]), c);
      }
    });
  });
}

// With g = dy·(1 + scale) = ∂loss/∂x̂:  dx = rstd·(g − mean(g) − x̂·mean(g·x̂)).
void CpuBackend::execute(const op::LayernormModulateBackward& args) {
  constexpr std::string_view op = "layernorm_modulate_backward";
  const auto [t, c] = begin_call(options_, args);
  const auto [B, L, H] = ops::check(op, args);
  dispatch(t, [&]<typename T>(T) {
    const auto xhat = [&](int64_t r, int64_t j) {
      return (static_cast<double>(row<T>(args.x, r)[j]) - args.mean.ptr<T>()[r]) * args.rstd.ptr<T>()[r];
    };
    if (args.dx.defined()) {
      require_shape(op, {"dx", args.dx}, args.x.shape);
      require_shape(op, {"scale", args.scale}, Shape{B, H});
      parallel_for(B * L, c, [&](int64_t r) {
        const T *dyr = row<T>(args.dy, r), *sc = row<T>(args.scale, r / L);
        double sum_g = 0, sum_gx = 0;
        for (int64_t j = 0; j < H; ++j) {
          const double g = dyr[j] * (1.0 + sc[j]);
          sum_g += g;
          sum_gx += g * xhat(r, j);
        }
        const double mean_g = sum_g / static_cast<double>(H);
        const double mean_gx = sum_gx / static_cast<double>(H);
        const double rs = args.rstd.ptr<T>()[r];
        T* dxr = row<T>(args.dx, r);
        for (int64_t j = 0; j < H; ++j) {
          const double g = dyr[j] * (1.0 + sc[j]);
          const T v = static_cast<T>(rs * (g - mean_g - xhat(r, j) * mean_gx));
          dxr[j] = act<T>(args.accumulate_dx ? dxr[j] + v : v, c);
        }
      });
    }
    // dshift, dscale are gradients of the modulation activations: overwritten and rounded.
    const auto store = [&](const Tensor& out, const std::vector<double>& s) {
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < H; ++j) row<T>(out, b)[j] = act<T>(static_cast<T>(s[b * H + j]), c);
    };
    if (args.dshift.defined()) {
      require_shape(op, {"dshift", args.dshift}, Shape{B, H});
      store(args.dshift, grouped_column_sums(B, L, H, c, [&](int64_t b, int64_t l, double* acc) {
              const T* dyr = row<T>(args.dy, b * L + l);
              for (int64_t j = 0; j < H; ++j) acc[j] += dyr[j];
            }));
    }
    if (args.dscale.defined()) {
      require_shape(op, {"dscale", args.dscale}, Shape{B, H});
      store(args.dscale, grouped_column_sums(B, L, H, c, [&](int64_t b, int64_t l, double* acc) {
              const T* dyr = row<T>(args.dy, b * L + l);
              for (int64_t j = 0; j < H; ++j) acc[j] += dyr[j] * xhat(b * L + l, j);
            }));
    }
  });
}

// QK-norm: every D-wide head segment of a row is normalised on its own.
void CpuBackend::execute(const op::RmsnormHeads& args) {
  constexpr std::string_view op = "rmsnorm_heads";
  const auto [t, c] = begin_call(options_, args);
  const auto [D, n, rows] = ops::check(op, args);
  dispatch(t, [&]<typename T>(T) {
    const T* sc = args.scale.ptr<T>();
    parallel_for(rows * n, c, [&](int64_t i) {
      const int64_t r = i / n, h = i % n;
      const T* xs = row<T>(args.x, r) + h * D;
      double sq = 0;
      for (int64_t d = 0; d < D; ++d) sq += static_cast<double>(xs[d]) * xs[d];
      const T rs = static_cast<T>(1.0 / std::sqrt(sq / static_cast<double>(D) + args.eps));
      args.rstd.ptr<T>()[i] = rs;
      T* ys = row<T>(args.y, r) + h * D;
      for (int64_t d = 0; d < D; ++d) ys[d] = act<T>(static_cast<T>(xs[d] * rs * sc[d]), c);
    });
  });
}

// With x̂ = x·rstd and g = dy·scale:  dx = rstd·(g − x̂·mean(g·x̂));  dscale += Σ dy·x̂.
void CpuBackend::execute(const op::RmsnormHeadsBackward& args) {
  constexpr std::string_view op = "rmsnorm_heads_backward";
  const auto [t, c] = begin_call(options_, args);
  const auto [D, n, rows] = ops::check(op, args);
  dispatch(t, [&]<typename T>(T) {
    const T *sc = args.scale.ptr<T>(), *rs = args.rstd.ptr<T>();
    if (args.dx.defined()) {
      parallel_for(rows * n, c, [&](int64_t i) {
        const int64_t r = i / n, h = i % n;
        const T *xs = row<T>(args.x, r) + h * D, *dys = row<T>(args.dy, r) + h * D;
        double sum_gx = 0;
        for (int64_t d = 0; d < D; ++d) sum_gx += static_cast<double>(dys[d]) * sc[d] * xs[d] * rs[i];
        const double mean_gx = sum_gx / static_cast<double>(D);
        T* dxs = row<T>(args.dx, r) + h * D;
        for (int64_t d = 0; d < D; ++d) {
          const double g = static_cast<double>(dys[d]) * sc[d];
          dxs[d] = act<T>(static_cast<T>(rs[i] * (g - xs[d] * rs[i] * mean_gx)), c);
        }
      });
    }
    if (args.dscale.defined()) {
      const auto s = grouped_column_sums(1, rows * n, D, c, [&](int64_t, int64_t i, double* acc) {
        const int64_t r = i / n, h = i % n;
        const T *xs = row<T>(args.x, r) + h * D, *dys = row<T>(args.dy, r) + h * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += static_cast<double>(dys[d]) * xs[d] * rs[i];
      });
      for (int64_t d = 0; d < D; ++d) args.dscale.ptr<T>()[d] = static_cast<T>(args.dscale.ptr<T>()[d] + s[d]);
    }
  });
}

}  // namespace flux8
