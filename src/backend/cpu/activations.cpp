// SiLU and tanh-GELU, elementwise over [rows, cols] with any ld; math in the tensor dtype.
#include <cmath>

#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"

namespace flux8 {
using namespace cpu;

namespace {

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// d/dx x·σ(x) = σ(x)·(1 + x·(1 − σ(x))).
template <typename T>
T silu_grad(T x) {
  const T s = sigmoid(x);
  return s * (T(1) + x * (T(1) - s));
}

// out = f(x) elementwise, or out (+)= dy ⊙ f'(x) for a backward.
template <typename T, typename F>
void map_rows(const Tensor& out, const Tensor& x, const Tensor& dy, bool accumulate, const Ctx& c, F f) {
  parallel_for(x.rows(), c, [&](int64_t r) {
    T* o = row<T>(out, r);
    const T* xr = row<T>(x, r);
    const T* dyr = dy.defined() ? row<T>(dy, r) : nullptr;
    for (int64_t j = 0; j < x.cols(); ++j) {
      const T v = dyr ? dyr[j] * f(xr[j]) : f(xr[j]);
      o[j] = act<T>(accumulate ? o[j] + v : v, c);
    }
  });
}

}  // namespace

void CpuBackend::execute(const op::Silu& args) {
  const auto [t, c] = begin_call(options_, args);
  require_same_matrix("silu", {"y", args.y}, {"x", args.x});
  dispatch(t, [&]<typename T>(T) { map_rows<T>(args.y, args.x, {}, false, c, [](T v) { return v * sigmoid(v); }); });
}

void CpuBackend::execute(const op::SiluBackward& args) {
  const auto [t, c] = begin_call(options_, args);
  if (!args.dx.defined()) return;
  require_same_matrix("silu_backward", {"dx", args.dx}, {"x", args.x});
  require_same_matrix("silu_backward", {"dy", args.dy}, {"x", args.x});
  dispatch(t, [&]<typename T>(T) { map_rows<T>(args.dx, args.x, args.dy, args.accumulate_dx, c, silu_grad<T>); });
}

void CpuBackend::execute(const op::GeluTanh& args) {
  const auto [t, c] = begin_call(options_, args);
  require_same_matrix("gelu_tanh", {"y", args.y}, {"x", args.x});
  dispatch(t, [&]<typename T>(T) { map_rows<T>(args.y, args.x, {}, false, c, gelu_tanh_value<T>); });
}

void CpuBackend::execute(const op::GeluTanhBackward& args) {
  const auto [t, c] = begin_call(options_, args);
  if (!args.dx.defined()) return;
  require_same_matrix("gelu_tanh_backward", {"dx", args.dx}, {"x", args.x});
  require_same_matrix("gelu_tanh_backward", {"dy", args.dy}, {"x", args.x});
  dispatch(t, [&]<typename T>(T) { map_rows<T>(args.dx, args.x, args.dy, false, c, gelu_tanh_grad<T>); });
}

}  // namespace flux8
