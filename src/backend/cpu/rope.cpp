// Rotary position embedding with Flux's multi-axis table and ADJACENT-pair rotation.
#include <cmath>

#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"

namespace flux8 {
using namespace cpu;

// pe[b, l, p] = (cos, sin) of ids[b, l, i]·ω_k with ω_k = 1/θ^(2k/d_i), where pair p is pair k
// of axis i. Evaluated in double like the reference (which then casts to f32).
void CpuBackend::execute(const op::RopeTable& args) {
  constexpr std::string_view op = "rope_table";
  const auto [t, c] = begin_call(options_, args);
  require_rank(op, {"ids", args.ids}, 3);
  const int64_t B = args.ids.shape[0], L = args.ids.shape[1];
  int64_t pairs = 0;
  for (int d : args.axes_dim) {
    if (d <= 0 || d % 2 != 0) fail("{}: every axis width must be positive and even, got {}", op, d);
    pairs += d / 2;
  }
  if (args.ids.shape[2] != static_cast<int64_t>(args.axes_dim.size()))
    fail("{}: ids {} must have one position per axis ({} axes)", op, args.ids.str(), args.axes_dim.size());
  require_shape(op, {"pe", args.pe}, Shape{B, L, pairs, 2});
  if (!args.pe.contiguous()) fail("{}: table 'pe' {} must be contiguous", op, args.pe.str());
  dispatch(t, [&]<typename T>(T) {
    parallel_for(B * L, c, [&](int64_t r) {
      const T* pos = row<T>(args.ids, r);
      T* out = args.pe.ptr<T>() + r * pairs * 2;
      for (size_t i = 0; i < args.axes_dim.size(); ++i) {
        const int d = args.axes_dim[i];
        for (int k = 0; k < d / 2; ++k) {
          const double omega = 1.0 / std::pow(args.theta, 2.0 * k / d);
          const double angle = static_cast<double>(pos[i]) * omega;
          *out++ = static_cast<T>(std::cos(angle));
          *out++ = static_cast<T>(std::sin(angle));
        }
      }
    });
  });
}

// (x0, x1) → (c·x0 − s·x1, s·x0 + c·x1); the inverse uses −s. Rotations are orthogonal, so
// the inverse is also the backward.
void CpuBackend::execute(const op::Rope& args) {
  constexpr std::string_view op = "rope";
  const auto [t, c] = begin_call(options_, args);
  require_rank(op, {"x", args.x}, 4);
  const int64_t B = args.x.shape[0], n = args.x.shape[1], L = args.x.shape[2], D = args.x.shape[3];
  if (D % 2 != 0) fail("{}: head dim of x {} must be even", op, args.x.str());
  require_shape(op, {"pe", args.pe}, Shape{B, L, D / 2, 2});
  if (!args.pe.contiguous()) fail("{}: table 'pe' {} must be contiguous", op, args.pe.str());
  dispatch(t, [&]<typename T>(T) {
    parallel_for(B * n * L, c, [&](int64_t r) {
      const int64_t b = r / (n * L), l = r % L;
      rotate_pairs<T>(row<T>(args.x, r), row<T>(args.x, r), args.pe.ptr<T>() + (b * L + l) * D, D, args.inverse, c);
    });
  });
}

}  // namespace flux8
