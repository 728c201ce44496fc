// AdamW's moments stored in bf16 (adam_moment_precision: bf16) on the CUDA backend: read widened,
// updated in fp32, stored rounded stochastically with the random bits of (step, flat element)
// (core/stochastic_rounding.h) — the CPU backend's bits exactly, on the vector path (four
// elements an access: f32 and bf16 gradients, low-rank ranges, a bf16 operand copy, FP8 weight
// casts) and element by element (views from element 1). The CPU's own arithmetic is checked
// against a hand-written reference in Optimizer.Bf16MomentsAreTheF32MomentsRoundedStochastically;
// the model-level check is CudaModel.Bf16MomentsTrainLikeF32Moments.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "fp8_test_util.h"
#include "gpu_test_util.h"

namespace flux8::testing {
namespace {

TEST(CudaBf16Moments, AdamWMatchesTheCpuBitForBit) {
  FLUX8_REQUIRE_GPU();
  const int64_t n = 200003;
  const LowRankFactors factors({{1000, 2, 37, 64}, {5001, 3, 13, 7}, {20000, 5, 300, 512}}, 42);
  {
    SCOPED_TRACE("f32 gradients");
    Pair gr({n});
    gr.randn(41, 0.01);
    factors.plant_nan(gr);
    expect_norm_and_adamw_match_cpu<Pair, Bf16Flat>(gr, factors);
  }
  {
    SCOPED_TRACE("bf16 gradients");
    Bf16Pair gr({n});
    gr.randn(42, 0.01);
    factors.plant_nan(gr);
    expect_norm_and_adamw_match_cpu<Bf16Pair, Bf16Flat>(gr, factors);
  }
}

// Element by element (every view starts at element 1: no aligned quads) and with FP8 weight casts
// of odd shapes written beside the update; three steps, so the moments read back are the
// stochastically rounded ones of the step before.
TEST(CudaBf16Moments, ElementPathAndWeightCastsMatchTheCpu) {
  FLUX8_REQUIRE_GPU();
  const int64_t n = 70001;
  Pair p({n}), gr({n});
  Bf16Flat m({n}), v({n});
  p.randn(61), gr.randn(43, 0.01), m.randn(62, 0.001), v.fill(1e-6f);
  const auto from1 = [&](const auto& x, bool g) {
    Tensor t = x.t(g);
    t.data = static_cast<char*>(t.data) + dtype_size(t.dtype);
    t.shape = Shape{n - 1};
    t.ld = n - 1;
    return t;
  };
  for (int64_t step = 1; step <= 3; ++step) {
    const Backend::AdamW h{1e-3, 0.9, 0.95, 1e-8, 0.1, 0.6, step};
    run_both(
        [&](Backend& be, bool g) { be.adamw(from1(p, g), from1(gr, g), from1(m, g), from1(v, g), h, {}, {}, {}); });
    ASSERT_EQ(p.down(), p.host.mem) << "step " << step;
    ASSERT_EQ(m.down(), m.host.mem) << "step " << step;
    ASSERT_EQ(v.down(), v.host.mem) << "step " << step;
  }

  // FP8 casts of two weights (one at an odd offset, per element) written with the update.
  QPair w0(137, 301, Fp8Format::e4m3, Fp8Scaling::per_tensor), w1(7, 13, Fp8Format::e5m2, Fp8Scaling::per_tensor);
  Pair scales({2}), amax({2});
  scales.host.mem = {300.0f, 2.0f};
  amax.host.mem = {0.0f, 0.25f};
  scales.up(), amax.up();
  for (int64_t step = 4; step <= 5; ++step) {
    const Backend::AdamW h{1e-2, 0.9, 0.999, 1e-8, 0.1, 1.0, step};
    run_both([&](Backend& be, bool g) {
      const Backend::ParamCast casts[] = {
          {0, w0.on(g), static_cast<const float*>(scales.t(g).data), static_cast<float*>(amax.t(g).data)},
          {50001, w1.on(g), static_cast<const float*>(scales.t(g).data) + 1, static_cast<float*>(amax.t(g).data) + 1}};
      be.adamw(p.t(g), gr.t(g), m.t(g), v.t(g), h, {}, casts, {});
    });
    EXPECT_EQ(p.down(), p.host.mem) << "step " << step;
    EXPECT_EQ(m.down(), m.host.mem) << "step " << step;
    EXPECT_EQ(v.down(), v.host.mem) << "step " << step;
    expect_equals_cpu(w0, "weight 0");
    expect_equals_cpu(w1, "weight 1");
  }
}

}  // namespace
}  // namespace flux8::testing
