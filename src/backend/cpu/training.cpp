// The rectified-flow objective's noise, the MSE loss, the gradient norm and AdamW.
// Reductions run over fixed chunks summed in order, so results do not depend on threads.
#include <algorithm>
#include <cmath>
#include <span>
#include <type_traits>
#include <vector>

#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"
#include "core/rng.h"
#include "core/stochastic_rounding.h"

namespace flux8 {
using namespace cpu;

namespace {

constexpr int64_t kChunk = 1 << 15;

// Σ f(i) over [0, n) in double: chunk partial sums (parallel), then summed in chunk order.
template <typename F>
double ordered_sum(int64_t n, const Ctx& c, F f) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
  parallel_for(chunks, c, [&](int64_t k) {
    double s = 0;
    for (int64_t i = k * kChunk; i < std::min(n, (k + 1) * kChunk); ++i) s += f(i);
    partial[static_cast<size_t>(k)] = s;
  });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

// The gradient's element i: from the flat buffer, or from a low-rank gradient's factors
// (Backend::LowRankGrad: f32, products and sums rounded one by one, r in order; this file is
// compiled with -ffp-contract=off, so the CUDA kernels' _rn operations give the same bits).
// `sorted`: by offset, as ops::check_low_rank_grads returns them.
template <typename T>
class GradientReader {
 public:
  GradientReader(const T* flat, const std::vector<Backend::LowRankGrad>& sorted) : flat_(flat), ranges_(sorted) {}
  // The low-rank gradient element i lies in, or null.
  const Backend::LowRankGrad* covering(int64_t i) const {
    auto it = std::upper_bound(ranges_.begin(), ranges_.end(), i,
                               [](int64_t e, const Backend::LowRankGrad& g) { return e < g.offset; });
    return it != ranges_.begin() && i < (it - 1)->end() ? &*(it - 1) : nullptr;
  }
  T operator()(int64_t i) const {
    const Backend::LowRankGrad* g = ranges_.empty() ? nullptr : covering(i);
    if (!g) return flat_[i];
    const int64_t R = g->rank(), M = g->a.shape[1], K = g->b.shape[1], e = i - g->offset;
    const float *a = g->a.ptr<float>() + e / K, *b = g->b.ptr<float>() + e % K;
    float s = a[0] * b[0];
    for (int64_t r = 1; r < R; ++r) s = s + a[r * M] * b[r * K];
    return static_cast<T>(s);
  }

 private:
  const T* flat_;
  const std::vector<Backend::LowRankGrad>& ranges_;
};

}  // namespace

void CpuBackend::execute(const op::FlowMatchInputs& args) {
  constexpr std::string_view op = "flow_match_inputs";
  const auto [dt, c] = begin_call(options_, args);
  const int64_t B = check(op, args), per = args.x0.numel() / B;
  dispatch(dt, [&]<typename T>(T) {
    parallel_for(B, c, [&](int64_t b) {
      const double tb = static_cast<double>(args.t.ptr<T>()[b]);
      const T* x = args.x0.ptr<T>() + b * per;
      T* xo = args.xt.ptr<T>() + b * per;
      T* tg = args.target.ptr<T>() + b * per;
      for (int64_t i = 0; i < per; ++i) {
        const double eps = rng_normal(args.seed, args.streams[static_cast<size_t>(b)], static_cast<uint64_t>(i));
        xo[i] = act<T>(static_cast<T>((1.0 - tb) * static_cast<double>(x[i]) + tb * eps), c);
        tg[i] = static_cast<T>(eps - static_cast<double>(x[i]));
      }
    });
  });
}

double CpuBackend::execute(const op::MseLoss& args) {
  constexpr std::string_view op = "mse_loss";
  const auto [dt, c] = begin_call(options_, args);
  for (Named n : {Named{"dpred", args.dpred}, Named{"pred", args.pred}, Named{"target", args.target}})
    require_contiguous(op, n);
  require_shape(op, {"target", args.target}, args.pred.shape);
  if (args.dpred.defined()) require_shape(op, {"dpred", args.dpred}, args.pred.shape);
  const int64_t n = args.pred.numel();
  double loss = 0;
  dispatch(dt, [&]<typename T>(T) {
    const T *p = args.pred.ptr<T>(), *y = args.target.ptr<T>();
    loss = ordered_sum(n, c,
                       [&](int64_t i) {
                         const double d = static_cast<double>(p[i]) - static_cast<double>(y[i]);
                         return d * d;
                       }) /
           static_cast<double>(n);
    if (args.dpred.defined()) {
      T* g = args.dpred.ptr<T>();
      const double k = 2.0 * args.grad_scale / static_cast<double>(n);
      parallel_for((n + kChunk - 1) / kChunk, c, [&](int64_t ch) {
        for (int64_t i = ch * kChunk; i < std::min(n, (ch + 1) * kChunk); ++i)
          g[i] = act<T>(static_cast<T>(k * (static_cast<double>(p[i]) - static_cast<double>(y[i]))), c);
      });
    }
  });
  return loss;
}

double CpuBackend::execute(const op::SumSquares& args) {
  const auto [dt, c] = begin_call(options_, args);
  require_contiguous("sum_squares", {"x", args.x});
  double s = 0;
  dispatch(dt, [&]<typename T>(T) {
    const T* p = args.x.ptr<T>();
    s = ordered_sum(args.x.numel(), c,
                    [&](int64_t i) { return static_cast<double>(p[i]) * static_cast<double>(p[i]); });
  });
  return s;
}

// Each range as sum_squares sums its slice, the ranges' sums added in order.
double CpuBackend::execute(const op::RangesSumSquares& args) {
  const auto [dt, c] = begin_call(options_, args);
  ops::check("ranges_sum_squares", args);
  double s = 0;
  dispatch(dt, [&]<typename T>(T) {
    for (const ElementRange& r : args.ranges) {
      const T* p = args.x.ptr<T>() + r.begin;
      s += ordered_sum(r.count, c, [&](int64_t i) { return static_cast<double>(p[i]) * static_cast<double>(p[i]); });
    }
  });
  return s;
}

double CpuBackend::execute(const op::GradientSumSquares& args) {
  constexpr std::string_view op = "gradient_sum_squares";
  const auto [dt, c] = begin_call(options_, args);
  require_contiguous(op, {"grads", args.grads});
  const std::vector<LowRankGrad> sorted = ops::check(op, args);
  if (sorted.empty()) return sum_squares(args.grads);
  if (dt != DType::f32) fail("{}: low-rank gradients need f32 gradients", op);
  const float* g = args.grads.ptr<float>();
  const GradientReader<float> reader(g, sorted);
  double s = ordered_sum(args.grads.numel(), c, [&](int64_t i) {
    if (reader.covering(i)) return 0.0;
    const double x = static_cast<double>(g[i]);
    return x * x;
  });
  // Each low-rank gradient's Σ_{r,s} (a_r·a_s)(b_r·b_s), r ≤ s (the pairs r < s twice), in
  // offset order after the flat elements.
  for (const LowRankGrad& lr : sorted) {
    const int64_t R = lr.rank(), M = lr.a.shape[1], K = lr.b.shape[1];
    const float *a = lr.a.ptr<float>(), *b = lr.b.ptr<float>();
    const auto dot = [](const float* x, const float* y, int64_t n) {
      double d = 0;
      for (int64_t i = 0; i < n; ++i) d += static_cast<double>(x[i]) * static_cast<double>(y[i]);
      return d;
    };
    double norm2 = 0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t q = r; q < R; ++q)
        norm2 += (r == q ? 1.0 : 2.0) * dot(a + r * M, a + q * M, M) * dot(b + r * K, b + q * K, K);
    s += norm2;
  }
  return s;
}

void CpuBackend::execute(const op::Adamw& args) {
  constexpr std::string_view op = "adamw";
  const DType dt = call_dtype(op, tensor_fields(args, {"param", "grad"}));
  const std::vector<LowRankGrad> sorted = ops::check(op, args);
  if (!args.casts.empty() && dt != DType::f32) fail("{}: FP8 casts of the new parameters need f32 parameters", op);
  if (!sorted.empty() && dt != DType::f32) fail("{}: low-rank gradients need f32 parameters", op);
  const int64_t n = args.param.numel();
  const AdamWConstants k = AdamWConstants::of(args.h);
  const Ctx c = make_ctx(options_, dt);
  // In the parameters' own precision (fp32 in training, fp64 in gradient checks), as PyTorch's
  // fused AdamW computes for fp32 parameters (with the bias corrections in the constants:
  // Backend::AdamW). The CUDA kernel performs the same fp32 operations
  // in the same order without fusing them (training.cu), and this file is compiled with
  // -ffp-contract=off, so both agree bit for bit. bf16 moments (f32 parameters only, checked)
  // are widened, updated in f32 and stored stochastically rounded with the noise of
  // (step, element) (core/stochastic_rounding.h), the update itself using the unrounded values.
  const bool bf16_moments = args.m.dtype == DType::bf16;
  const uint32_t step_key = adamw_step_key(args.h.step);
  if (args.h.index_base % 2 != 0)
    fail("{}: index_base {} is odd (the moments' noise comes in pairs)", op, args.h.index_base);
  dispatch(dt, [&]<typename T>(T) {
    T* p = args.param.ptr<T>();
    const GradientReader<T> g(args.grad.ptr<T>(), sorted);
    const T gs = static_cast<T>(args.h.grad_scale), b1 = static_cast<T>(args.h.beta1),
            b2 = static_cast<T>(args.h.beta2);
    const T ob1 = static_cast<T>(1.0 - args.h.beta1), ob2 = static_cast<T>(1.0 - args.h.beta2);
    const T eps_hat = static_cast<T>(k.eps_hat), dec = static_cast<T>(k.decay);
    const T step_size = static_cast<T>(k.step_size);
    // One element's update from its moments m0, v0; returns the new ones.
    const auto update = [&](int64_t i, T m0, T v0, T& mi, T& vi) {
      const T gi = gs * g(i);
      mi = b1 * m0 + ob1 * gi;
      vi = b2 * v0 + (ob2 * gi) * gi;
      p[i] = p[i] * dec - (step_size * mi) / (std::sqrt(vi) + eps_hat);
    };
    parallel_for((n + kChunk - 1) / kChunk, c, [&](int64_t ch) {
      const int64_t end = std::min(n, (ch + 1) * kChunk);
      if constexpr (std::is_same_v<T, float>) {
        if (bf16_moments) {
          uint16_t *mb = static_cast<uint16_t*>(args.m.data), *vb = static_cast<uint16_t*>(args.v.data);
          for (int64_t i = ch * kChunk; i < end; ++i) {
            float mi, vi;
            update(i, bf16_bits_to_f32(mb[i]), bf16_bits_to_f32(vb[i]), mi, vi);
            const int64_t e = args.h.index_base + i;
            const uint32_t r = adamw_moment_bits(adamw_pair_noise(step_key, e >> 1), e);
            mb[i] = f32_to_bf16_bits_stochastic(mi, r);
            vb[i] = f32_to_bf16_bits_stochastic(vi, r >> 16);
          }
          return;
        }
      }
      T *mm = args.m.ptr<T>(), *vv = args.v.ptr<T>();
      for (int64_t i = ch * kChunk; i < end; ++i) update(i, mm[i], vv[i], mm[i], vv[i]);
    });
    // The copies: the new values rounded to bf16 (through f32, the only type they are made of
    // in training), as the CUDA kernel writes them with the update.
    for (const ParamCopy& cp : args.copies) {
      uint16_t* bits = static_cast<uint16_t*>(cp.copy.data);
      const T* src = p + cp.offset;
      parallel_for((cp.copy.numel() + kChunk - 1) / kChunk, c, [&](int64_t ch) {
        for (int64_t i = ch * kChunk; i < std::min(cp.copy.numel(), (ch + 1) * kChunk); ++i)
          bits[i] = f32_to_bf16_bits(static_cast<float>(src[i]));
      });
    }
  });
  // The casts: quantize() of each weight's new values with its delayed scale (no counts).
  for (const ParamCast& cast : args.casts) {
    Quantize q;
    q.format = cast.codes.format;
    q.delayed_scale = cast.scale;
    q.amax = cast.amax;
    quantize(cast.codes, QTensor{},
             Tensor(args.param.ptr<float>() + cast.offset, DType::f32, Shape{cast.codes.rows, cast.codes.cols}), q);
  }
}

}  // namespace flux8
