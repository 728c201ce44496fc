// SiLU and tanh-GELU on the device, elementwise over [rows, cols] with any ld; f32 math with
// the CPU backend's formulas (src/backend/cpu/activations.cpp; GELU through the logistic form
// of tanh, pointwise.cuh), on f32 or bf16 activations (bf16: widened on load, rounded to
// nearest even on store).
#include "backend/cuda/common.cuh"
#include "backend/cuda/pointwise.cuh"

namespace flux8 {
using namespace cuda;

namespace {

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ inline float silu_grad(float x) {
  const float s = sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}

// out = f(x), or out (+)= dy ⊙ f'(x) when dy is given; every tensor of element type T (f32 or
// bf16 activations), the math in f32 either way.
template <typename T, typename F>
void map(CudaBackend& be, const Tensor& out, const Tensor& x, const Tensor& dy, bool accumulate, F f) {
  const MatOf<T> O = mat_of<T>(out), X = mat_of<T>(x), DY = mat_of_or_null<T>(dy);
  const int64_t cols = X.cols;
  const bool has_dy = dy.defined();
  if (vec4_rows(O) && vec4_rows(X) && (!has_dy || vec4_rows(DY))) {  // four elements per thread
    for_each_row(be, X.rows, cols / 4, [=] __device__(int64_t r, int cq) {
      const int64_t c = 4 * static_cast<int64_t>(cq);
      const float4 xv = load4(&X.at(r, c));
      float4 v{f(xv.x), f(xv.y), f(xv.z), f(xv.w)};
      if (has_dy) {
        const float4 g = load4(&DY.at(r, c));
        v = float4{g.x * v.x, g.y * v.y, g.z * v.z, g.w * v.w};
      }
      if (accumulate) {
        const float4 old = load4(&O.at(r, c));
        v = float4{old.x + v.x, old.y + v.y, old.z + v.z, old.w + v.w};
      }
      store4(&O.at(r, c), v);
    });
    return;
  }
  for_each_row(be, X.rows, cols, [=] __device__(int64_t r, int c) {
    const float v = has_dy ? DY.get(r, c) * f(X.get(r, c)) : f(X.get(r, c));
    O.set(r, c, accumulate ? O.get(r, c) + v : v);
  });
}

// map() over the storage type of the call's activations.
template <typename F>
void map_as(CudaBackend& be, bool bf16, const Tensor& out, const Tensor& x, const Tensor& dy, bool accumulate, F f) {
  if (bf16)
    map<__nv_bfloat16>(be, out, x, dy, accumulate, f);
  else
    map<float>(be, out, x, dy, accumulate, f);
}

}  // namespace

void CudaBackend::execute(const op::Silu& args) {
  const bool bf = activations_in_bf16(args);
  require_same_matrix("silu", {"y", args.y}, {"x", args.x});
  map_as(*this, bf, args.y, args.x, {}, false, [] __device__(float v) { return v * sigmoid(v); });
}

void CudaBackend::execute(const op::SiluBackward& args) {
  const bool bf = activations_in_bf16(args);
  if (!args.dx.defined()) return;
  require_same_matrix("silu_backward", {"dx", args.dx}, {"x", args.x});
  require_same_matrix("silu_backward", {"dy", args.dy}, {"x", args.x});
  map_as(*this, bf, args.dx, args.x, args.dy, args.accumulate_dx, [] __device__(float v) { return silu_grad(v); });
}

void CudaBackend::execute(const op::GeluTanh& args) {
  const bool bf = activations_in_bf16(args);
  require_same_matrix("gelu_tanh", {"y", args.y}, {"x", args.x});
  map_as(*this, bf, args.y, args.x, {}, false, [] __device__(float v) { return gelu_value(v); });
}

void CudaBackend::execute(const op::GeluTanhBackward& args) {
  const bool bf = activations_in_bf16(args);
  if (!args.dx.defined()) return;
  require_same_matrix("gelu_tanh_backward", {"dx", args.dx}, {"x", args.x});
  require_same_matrix("gelu_tanh_backward", {"dy", args.dy}, {"x", args.x});
  map_as(*this, bf, args.dx, args.x, args.dy, false, [] __device__(float v) { return gelu_grad(v); });
}

}  // namespace flux8
