// The rectified-flow objective's noise, the MSE loss, the gradient norm and AdamW on the device.
// The noise comes from the same counter-based Philox generator as the CPU backend
// (core/rng.h), keyed by (seed, stream, element). The device's logf/cosf/sqrtf may differ
// from the host's libm in the last bit, so the noise agrees with the CPU's to f32 rounding
// (~1e-7 relative), not bit for bit. Loss and norm sums are in double with a fixed order.
#include <cmath>

#include <cstdint>

#include "backend/cuda/common.cuh"
#include "core/rng.h"

namespace flux8 {
using namespace cuda;

void CudaBackend::flow_match_inputs(Tensor xt, Tensor target, Tensor x0, Tensor t, uint64_t seed,
                                    std::span<const uint64_t> streams) {
  constexpr std::string_view op = "flow_match_inputs";
  require_f32(op, {{"xt", xt}, {"target", target}, {"x0", x0}, {"t", t}});
  for (Named n : {Named{"xt", xt}, Named{"target", target}, Named{"x0", x0}}) require_contiguous(op, n);
  require_shape(op, {"xt", xt}, x0.shape);
  require_shape(op, {"target", target}, x0.shape);
  const int64_t B = x0.shape[0], per = x0.numel() / B;
  require_vector(op, {"t", t}, B);
  if (static_cast<int64_t>(streams.size()) != B) fail("{}: {} noise streams for a batch of {}", op, streams.size(), B);
  // The per-sample stream ids travel to the device through the scratch buffer.
  uint64_t* dev_streams = static_cast<uint64_t*>(scratch(static_cast<size_t>(B) * sizeof(uint64_t)));
  FLUX8_CUDA_CHECK(cudaMemcpyAsync(dev_streams, streams.data(), B * sizeof(uint64_t), cudaMemcpyHostToDevice, stream_));
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));  // streams is a host span the caller may reuse
  const float *x = x0.ptr<float>(), *tv = t.ptr<float>();
  float *xo = xt.ptr<float>(), *tg = target.ptr<float>();
  for_each(*this, B * per, [=] __device__(int64_t i) {
    const int64_t b = i / per, e = i % per;
    const double tb = tv[b];
    const double eps = rng_normal(seed, dev_streams[b], static_cast<uint64_t>(e));
    xo[i] = static_cast<float>((1.0 - tb) * static_cast<double>(x[i]) + tb * eps);
    tg[i] = static_cast<float>(eps - static_cast<double>(x[i]));
  });
}

double CudaBackend::mse_loss(Tensor dpred, Tensor pred, Tensor target, double grad_scale) {
  constexpr std::string_view op = "mse_loss";
  require_f32(op, {{"dpred", dpred}, {"pred", pred}, {"target", target}});
  for (Named n : {Named{"dpred", dpred}, Named{"pred", pred}, Named{"target", target}}) require_contiguous(op, n);
  require_shape(op, {"target", target}, pred.shape);
  if (dpred.defined()) require_shape(op, {"dpred", dpred}, pred.shape);
  const int64_t n = pred.numel();
  const float *p = pred.ptr<float>(), *y = target.ptr<float>();
  if (dpred.defined()) {
    float* g = dpred.ptr<float>();
    const double k = 2.0 * grad_scale / static_cast<double>(n);
    for_each(*this, n, [=] __device__(int64_t i) {
      g[i] = static_cast<float>(k * (static_cast<double>(p[i]) - static_cast<double>(y[i])));
    });
  }
  const double sum = ordered_sum(*this, n, [=] __device__(int64_t i) {
    const double d = static_cast<double>(p[i]) - static_cast<double>(y[i]);
    return d * d;
  });
  return sum / static_cast<double>(n);
}

double CudaBackend::sum_squares(Tensor x) {
  require_f32("sum_squares", {{"x", x}});
  require_contiguous("sum_squares", {"x", x});
  const float* p = x.ptr<float>();
  return ordered_sum(*this, x.numel(), [=] __device__(int64_t i) {
    const double v = p[i];
    return v * v;
  });
}

void CudaBackend::adamw(Tensor param, Tensor grad, Tensor m, Tensor v, const AdamW& h) {
  constexpr std::string_view op = "adamw";
  require_f32(op, {{"param", param}, {"grad", grad}, {"m", m}, {"v", v}});
  for (Named n : {Named{"param", param}, Named{"grad", grad}, Named{"m", m}, Named{"v", v}}) {
    require_contiguous(op, n);
    require_vector(op, n, param.numel());
  }
  if (h.step < 1) fail("adamw: step must be >= 1 (1-based), got {}", h.step);
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  const double decay = 1.0 - h.lr * h.weight_decay;
  float *p = param.ptr<float>(), *mm = m.ptr<float>(), *vv = v.ptr<float>();
  const float* g = grad.ptr<float>();
  const float gs = static_cast<float>(h.grad_scale), b1 = static_cast<float>(h.beta1), b2 = static_cast<float>(h.beta2);
  const float ob1 = static_cast<float>(1.0 - h.beta1), ob2 = static_cast<float>(1.0 - h.beta2);
  const float lr = static_cast<float>(h.lr), eps = static_cast<float>(h.eps), dec = static_cast<float>(decay);
  const float c1 = static_cast<float>(bc1), c2 = static_cast<float>(bc2);
  // The CPU backend's fp32 operations in its order, each rounded on its own (the _rn intrinsics
  // are never contracted into FMAs), so the two backends agree bit for bit. fp32, not fp64: the
  // double-precision version was partly bound by the FP64 units (divisions, square root,
  // conversions), 4.3–6.1 ms for 535M parameters against 3.5 ms of memory traffic.
  auto update = [=] __device__(float& pi, float gf, float& mf, float& vf) {
    const float gi = __fmul_rn(gs, gf);
    const float mi = __fadd_rn(__fmul_rn(b1, mf), __fmul_rn(ob1, gi));
    const float vi = __fadd_rn(__fmul_rn(b2, vf), __fmul_rn(__fmul_rn(ob2, gi), gi));
    mf = mi;
    vf = vi;
    const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(vi, c2)), eps);
    pi = __fsub_rn(__fmul_rn(pi, dec), __fdiv_rn(__fmul_rn(lr, __fdiv_rn(mi, c1)), denom));
  };
  // Four elements per thread in 16-byte loads and stores where the buffers allow (the flat
  // parameter buffers do): AdamW is pure HBM traffic, 28 bytes per parameter.
  const int64_t n = param.numel();
  const bool vec = aligned16(p) && aligned16(mm) && aligned16(vv) && aligned16(g);
  const int64_t n4 = vec ? n / 4 : 0;
  if (n4 > 0) {
    auto *p4 = reinterpret_cast<float4*>(p), *m4 = reinterpret_cast<float4*>(mm), *v4 = reinterpret_cast<float4*>(vv);
    const auto* g4 = reinterpret_cast<const float4*>(g);
    for_each(*this, n4, [=] __device__(int64_t q) {
      float4 pq = p4[q], mq = m4[q], vq = v4[q];
      const float4 gq = g4[q];
      update(pq.x, gq.x, mq.x, vq.x);
      update(pq.y, gq.y, mq.y, vq.y);
      update(pq.z, gq.z, mq.z, vq.z);
      update(pq.w, gq.w, mq.w, vq.w);
      p4[q] = pq, m4[q] = mq, v4[q] = vq;
    });
  }
  const int64_t done = 4 * n4;
  for_each(*this, n - done, [=] __device__(int64_t i) { update(p[done + i], g[done + i], mm[done + i], vv[done + i]); });
}

}  // namespace flux8
