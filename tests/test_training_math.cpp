// The objective, loss, optimizer and schedule against hand-computed values.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>

#include "backend/backend.h"
#include "config/config.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/stochastic_rounding.h"
#include "model/params.h"
#include "model_test_util.h"
#include "test_util.h"
#include "train/objective.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace flux8 {
namespace {

Tensor view(std::vector<double>& v, Shape s) { return Tensor(v.data(), DType::f64, s); }

TEST(Objective, FlowMatchInputsInterpolateAndTargetVelocity) {
  auto be = make_backend("cpu");
  std::vector<double> x0 = {0.5, -1.0, 2.0, 0.0, 1.5, -0.25}, t = {0.25, 0.9};
  std::vector<double> xt(6), target(6);
  const std::vector<uint64_t> streams = {11, 12};
  be->flow_match_inputs(view(xt, Shape{2, 3}), view(target, Shape{2, 3}), view(x0, Shape{2, 3}), view(t, Shape{2}), 5,
                        streams);
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 3; ++i) {
      const double eps = rng_normal(5, streams[b], static_cast<uint64_t>(i));
      const size_t k = static_cast<size_t>(b * 3 + i);
      EXPECT_DOUBLE_EQ(target[k], eps - x0[k]);                    // v = ε − x0
      EXPECT_NEAR(xt[k], (1 - t[b]) * x0[k] + t[b] * eps, 1e-15);  // x_t = (1−t)x0 + tε
    }
  // At t = 0 the input is clean; at t = 1 it is pure noise.
  t = {0.0, 1.0};
  be->flow_match_inputs(view(xt, Shape{2, 3}), view(target, Shape{2, 3}), view(x0, Shape{2, 3}), view(t, Shape{2}), 5,
                        streams);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(xt[static_cast<size_t>(i)], x0[static_cast<size_t>(i)]);
  for (int i = 0; i < 3; ++i)
    EXPECT_DOUBLE_EQ(xt[static_cast<size_t>(3 + i)], rng_normal(5, 12, static_cast<uint64_t>(i)));
}

TEST(Objective, MseLossAndGradient) {
  auto be = make_backend("cpu");
  std::vector<double> pred = {1, 2, 3, 4}, target = {0, 2, 5, 3}, d(4);
  const double loss = be->mse_loss(view(d, Shape{4}), view(pred, Shape{4}), view(target, Shape{4}), 0.5);
  EXPECT_DOUBLE_EQ(loss, (1 + 0 + 4 + 1) / 4.0);
  // dpred = grad_scale · 2(pred − target)/N
  EXPECT_EQ(d, (std::vector<double>{0.25, 0.0, -0.5, 0.25}));
}

TEST(Optimizer, AdamWMatchesHandComputedSteps) {
  auto be = make_backend("cpu");
  std::vector<double> p = {1.0, -2.0}, g = {0.5, -0.1}, m = {0, 0}, v = {0, 0};
  const Backend::AdamW h{0.1, 0.9, 0.95, 1e-8, 0.1, 1.0, 1};
  be->adamw(view(p, Shape{2}), view(g, Shape{2}), view(m, Shape{2}), view(v, Shape{2}), h, {}, {}, {});
  // Step 1: m = 0.1g, v = 0.05g², m̂ = g, v̂ = g², update = g/(|g| + eps) ≈ sign(g).
  for (int i = 0; i < 2; ++i) {
    const double g0 = i ? -0.1 : 0.5, p0 = i ? -2.0 : 1.0;
    EXPECT_DOUBLE_EQ(m[static_cast<size_t>(i)], (1 - 0.9) * g0);
    EXPECT_DOUBLE_EQ(v[static_cast<size_t>(i)], (1 - 0.95) * g0 * g0);
    EXPECT_NEAR(p[static_cast<size_t>(i)], p0 * (1 - 0.1 * 0.1) - 0.1 * g0 / (std::abs(g0) + 1e-8), 1e-15);
  }
  // Step 2 with gradient scaling 0.5 (clipping): g' = 0.5·g2.
  std::vector<double> p1 = p, m1 = m, v1 = v, g2 = {1.0, 0.2};
  be->adamw(view(p, Shape{2}), view(g2, Shape{2}), view(m, Shape{2}), view(v, Shape{2}),
            Backend::AdamW{0.1, 0.9, 0.95, 1e-8, 0.1, 0.5, 2}, {}, {}, {});
  for (size_t i = 0; i < 2; ++i) {
    const double gs = 0.5 * g2[i];
    const double mi = 0.9 * m1[i] + 0.1 * gs, vi = 0.95 * v1[i] + 0.05 * gs * gs;
    const double expect = p1[i] * (1 - 0.01) - 0.1 * (mi / (1 - 0.81)) / (std::sqrt(vi / (1 - 0.9025)) + 1e-8);
    EXPECT_NEAR(p[i], expect, 1e-14);
  }
}

// The bf16 copies adamw writes are the new parameters rounded to nearest even; the update itself
// is the same with or without them, and a bad copy is refused naming it.
TEST(Optimizer, AdamWWritesRoundedCopies) {
  auto be = make_backend("cpu");
  const int64_t n = 300;
  std::vector<float> p(n), g(n), m(n, 0.f), v(n, 0.f);
  for (int64_t i = 0; i < n; ++i) p[i] = rng_normal(1, 0, i), g[i] = 0.01f * rng_normal(2, 0, i);
  std::vector<float> p2 = p, m2 = m, v2 = v;
  std::vector<uint16_t> a(100, 0xFFFF), b(37, 0xFFFF);
  const auto f32 = [&](std::vector<float>& x) { return Tensor(x.data(), DType::f32, Shape{n}); };
  const Backend::ParamCopy copies[] = {{200, Tensor(a.data(), DType::bf16, Shape{10, 10})},
                                       {13, Tensor(b.data(), DType::bf16, Shape{37})}};
  const Backend::AdamW h{1e-2, 0.9, 0.95, 1e-8, 0.1, 1.0, 1};
  be->adamw(f32(p), f32(g), f32(m), f32(v), h, copies, {}, {});
  be->adamw(f32(p2), f32(g), f32(m2), f32(v2), h, {}, {}, {});
  EXPECT_EQ(p, p2);
  EXPECT_EQ(m, m2);
  EXPECT_EQ(v, v2);
  for (int64_t i = 0; i < 100; ++i) ASSERT_EQ(a[i], f32_to_bf16_bits(p[200 + i])) << i;
  for (int64_t i = 0; i < 37; ++i) ASSERT_EQ(b[i], f32_to_bf16_bits(p[13 + i])) << i;
  EXPECT_NE(bf16_bits_to_f32(a[0]), p[200]) << "a value bf16 cannot hold: the copy is rounded";

  const auto refused = [&](const Backend::ParamCopy& c, const char* what) {
    const Backend::ParamCopy one[] = {c};
    testing::expect_refused(what, [&] { be->adamw(f32(p), f32(g), f32(m), f32(v), h, one, {}, {}); });
  };
  refused({290, Tensor(a.data(), DType::bf16, Shape{20})}, "lies outside the 300 parameters");
  refused({0, Tensor(p2.data(), DType::f32, Shape{20})}, "copy 0");
  const Backend::ParamCopy overlapping[] = {{0, Tensor(a.data(), DType::bf16, Shape{20})},
                                            {19, Tensor(b.data(), DType::bf16, Shape{5})}};
  EXPECT_THROW(be->adamw(f32(p), f32(g), f32(m), f32(v), h, overlapping, {}, {}), Error);
}

// f32_to_bf16_bits_stochastic: a value bf16 holds stays for every r; between two neighbours the
// top 8 of the 16 dropped bits d decide — over the 256 values of r's low byte it rounds away from
// zero ⌊(d + 128)/256⌋ times, so the mean is the value within 1/512 of a bf16 ulp (positive,
// negative, subnormal); r's other bits are ignored; ±inf stay, every NaN becomes the quiet NaN.
TEST(StochasticRounding, RoundsUpWithTheDroppedFraction) {
  const auto f32_of = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  for (const uint32_t kept : {0x3f810000u, 0xc0490000u, 0x00000000u, 0x00070000u, 0x7f7f0000u})
    for (uint32_t r = 0; r < 256; ++r)
      ASSERT_EQ(f32_to_bf16_bits_stochastic(f32_of(kept), r), kept >> 16) << std::hex << kept << " r " << r;
  for (const uint32_t u : {0x3f812345u, 0xbf81fffeu, 0x00012345u, 0x42c80001u, 0x3f80ff7fu, 0x3f80ff80u}) {
    const float x = f32_of(u);
    const double ulp =
        bf16_bits_to_f32(static_cast<uint16_t>((u >> 16) + 1)) - bf16_bits_to_f32(static_cast<uint16_t>(u >> 16));
    double sum = 0;
    uint32_t up = 0;
    for (uint32_t r = 0; r < 256; ++r) {
      const uint16_t b = f32_to_bf16_bits_stochastic(x, r);
      ASSERT_EQ(b, f32_to_bf16_bits_stochastic(x, r | 0xabcd00u)) << "only the low byte counts";
      ASSERT_TRUE(b == (u >> 16) || b == (u >> 16) + 1) << std::hex << u << " r " << r;
      up += b != (u >> 16);
      sum += bf16_bits_to_f32(b);
    }
    EXPECT_EQ(up, ((u & 0xffffu) + 128) >> 8) << std::hex << u;
    EXPECT_LE(std::abs(sum / 256.0 - static_cast<double>(x)), std::abs(ulp) / 512 + 1e-300) << std::hex << u;
  }
  EXPECT_EQ(f32_to_bf16_bits_stochastic(INFINITY, 0xff), 0x7f80);
  EXPECT_EQ(f32_to_bf16_bits_stochastic(-INFINITY, 0xff), 0xff80);
  for (const uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7fffffffu, 0xffffffffu})
    EXPECT_EQ(f32_to_bf16_bits_stochastic(f32_of(nan), 0xff), 0x7fc0) << std::hex << nan;
}

// AdamW's moment noise: each of the four bytes of a pair's bits near uniform (the share below
// 77/256 within 5 standard deviations), other bits at another step and at the pair 2^32 further on.
TEST(StochasticRounding, MomentNoiseIsUniformPerStepAndPair) {
  const uint32_t k1 = adamw_step_key(1), k2 = adamw_step_key(2);
  const int64_t n = 1 << 18, far = int64_t(1) << 32;
  int64_t below[4] = {}, same_step = 0, same_block = 0;
  for (int64_t p = 0; p < n; ++p) {
    const uint32_t r = adamw_pair_noise(k1, p);
    for (int b = 0; b < 4; ++b) below[b] += ((r >> (8 * b)) & 0xffu) < 77u;
    same_step += r == adamw_pair_noise(k2, p);
    same_block += r == adamw_pair_noise(k1, p + far);
  }
  for (int b = 0; b < 4; ++b) EXPECT_NEAR(static_cast<double>(below[b]) / n, 77.0 / 256, 0.0045) << "byte " << b;
  EXPECT_LE(same_step, 2);
  EXPECT_LE(same_block, 2);
  // Element i takes byte i % 2 of its pair for m and byte 2 + i % 2 for v.
  EXPECT_EQ(adamw_moment_bits(0x44332211u, 6), 0x44332211u);
  EXPECT_EQ(adamw_moment_bits(0x44332211u, 7) & 0xffu, 0x22u);
  EXPECT_EQ((adamw_moment_bits(0x44332211u, 7) >> 16) & 0xffu, 0x44u);
}

// adamw with bf16 moments (adam_moment_precision: bf16): the parameters are those the f32 update
// gives from the same (widened) moments — the update uses the unrounded new moments — and the
// stored moments are that update's m and v rounded stochastically with the noise of (step,
// element pair), a byte each (written out here by hand). The same bits
// with 1 and 3 threads (chunks of 2^15 elements). Mixed moment types and bf16 moments of f64
// parameters are refused naming the moments.
TEST(Optimizer, Bf16MomentsAreTheF32MomentsRoundedStochastically) {
  const int64_t n = 100003;
  std::vector<float> p(n), g(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = rng_normal(1, 0, i);
    g[i] = 0.01f * rng_normal(2, 0, i);
    m[i] = round_to_bf16(1e-3f * rng_normal(3, 0, i));
    v[i] = round_to_bf16(1e-4f * std::exp(rng_normal(4, 0, i)));
  }
  std::vector<uint16_t> mb(n), vb(n);
  for (int64_t i = 0; i < n; ++i) mb[i] = f32_to_bf16_bits(m[i]), vb[i] = f32_to_bf16_bits(v[i]);
  const auto f32 = [&](std::vector<float>& x) { return Tensor(x.data(), DType::f32, Shape{n}); };
  const auto bf16 = [&](std::vector<uint16_t>& x) { return Tensor(x.data(), DType::bf16, Shape{n}); };
  const Backend::AdamW h{1e-3, 0.9, 0.999, 1e-8, 0.1, 0.7, 5};
  std::vector<float> p_f32 = p, m_f32 = m, v_f32 = v;
  make_backend("cpu")->adamw(f32(p_f32), f32(g), f32(m_f32), f32(v_f32), h, {}, {}, {});

  std::vector<uint16_t> first_m, first_v;
  std::vector<float> first_p;
  for (const int threads : {1, 3}) {
    BackendOptions o;
    o.threads = threads;
    std::vector<float> pp = p;
    std::vector<uint16_t> mm = mb, vv = vb;
    make_backend("cpu", o)->adamw(f32(pp), f32(g), bf16(mm), bf16(vv), h, {}, {}, {});
    EXPECT_EQ(pp, p_f32) << "the update reads the unrounded moments";
    const uint32_t key = adamw_step_key(5);
    int64_t m_up = 0, m_inexact = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t r = adamw_moment_bits(adamw_pair_noise(key, i >> 1), i);
      ASSERT_EQ(mm[i], f32_to_bf16_bits_stochastic(m_f32[i], r)) << i;
      ASSERT_EQ(vv[i], f32_to_bf16_bits_stochastic(v_f32[i], r >> 16)) << i;
      m_inexact += round_to_bf16(m_f32[i]) != m_f32[i];
      m_up += f32_to_bf16_bits(m_f32[i]) != mm[i];
    }
    EXPECT_GT(m_inexact, n / 2);
    EXPECT_GT(m_up, n / 10) << "not rounded to nearest";
    if (threads == 1) {
      first_m = mm, first_v = vv, first_p = pp;
    } else {
      EXPECT_EQ(mm, first_m);
      EXPECT_EQ(vv, first_v);
    }
  }

  auto be = make_backend("cpu");
  testing::expect_refused("the moments 'm' (bf16) and 'v' (f32)",
                          [&] { be->adamw(f32(p), f32(g), bf16(mb), f32(v), h, {}, {}, {}); });
  std::vector<double> pd(n), gd(n);
  testing::expect_refused("parameters' type (f64)", [&] {
    be->adamw(Tensor(pd.data(), DType::f64, Shape{n}), Tensor(gd.data(), DType::f64, Shape{n}), bf16(mb), bf16(vb), h,
              {}, {}, {});
  });
}

// Why the rounding is stochastic: with β2 = 0.999 and no gradient, v = 0.999·v shrinks by 0.1% a
// step, less than half a bf16 ulp (2^-9), so rounding to nearest would keep v = 1 forever; the
// stochastically rounded v follows 0.999^step on average (here over 4096 elements, 2000 steps:
// 0.135, within 2%; each element within 25%).
TEST(Optimizer, Bf16MomentsFollowADecayThatRoundingToNearestLoses) {
  const int64_t n = 4096, steps = 2000;
  std::vector<float> p(n, 0.5f), g(n, 0.0f);
  std::vector<uint16_t> m(n, 0), v(n, f32_to_bf16_bits(1.0f));
  auto be = make_backend("cpu");
  for (int64_t s = 1; s <= steps; ++s)
    be->adamw(Tensor(p.data(), DType::f32, Shape{n}), Tensor(g.data(), DType::f32, Shape{n}),
              Tensor(m.data(), DType::bf16, Shape{n}), Tensor(v.data(), DType::bf16, Shape{n}),
              Backend::AdamW{1e-4, 0.9, 0.999, 1e-8, 0.0, 1.0, s}, {}, {}, {});
  const double want = std::pow(0.999, static_cast<double>(steps));
  double sum = 0, sq = 0;
  for (uint16_t b : v) {
    const double rel = bf16_bits_to_f32(b) / want - 1.0;
    sum += rel, sq += rel * rel;
  }
  std::printf("v after %lld steps: mean %.4f, rms %.4f relative to 0.999^steps\n", static_cast<long long>(steps),
              sum / n, std::sqrt(sq / n));
  EXPECT_NEAR(sum / n, 0.0, 0.02);
  EXPECT_LT(std::sqrt(sq / n), 0.15);
  EXPECT_EQ(round_to_bf16(0.999f * 1.0f), 1.0f) << "the premise: rounding to nearest loses the step";
  for (uint16_t b : m) ASSERT_EQ(b, 0);
}

// adam_moment_precision reaches the optimizer: bf16 (the default) moments take 2 bytes each; f64
// parameters (gradient checks) refuse them.
TEST(Optimizer, MomentPrecisionKey) {
  const AdamWConfig bf16 = AdamWConfig::from_config(Config{});
  Config f32;
  f32.apply_override("adam_moment_precision=f32");
  EXPECT_EQ(AdamWConfig::from_config(f32).moment_dtype, DType::f32);
  EXPECT_EQ(bf16.moment_dtype, DType::bf16);
  testing::expect_refused("adam_moment_precision", [&] { Config{}.apply_override("adam_moment_precision=fp8"); });
  auto be = make_backend("cpu");
  ParamStore store(testing::odd_config(1, 1, false), *be, DType::f32);
  AdamWOptimizer opt(store, bf16);
  EXPECT_EQ(opt.moment_dtype(), DType::bf16);
  EXPECT_EQ(opt.exp_avg().dtype, DType::bf16);
  EXPECT_EQ(opt.exp_avg_sq().numel(), store.layout().total());
  ParamStore f64(testing::odd_config(1, 1, false), *be, DType::f64);
  testing::expect_refused("adam_moment_precision bf16 needs f32 parameters", [&] { AdamWOptimizer bad(f64, bf16); });
}

// Low-rank gradients (Backend::LowRankGrad): AdamW reads g[m, k] = Σ_r a[r, m]·b[r, k] from the
// factors — exactly the values of a flat buffer that holds them, in f32 with each product and
// sum rounded on its own — and the norm takes ‖g‖² from the factors' Gram matrices; neither
// reads the buffer's own contents there (NaN here).
TEST(Optimizer, LowRankGradientsReadFromTheirFactors) {
  auto be = make_backend("cpu");
  const int64_t n = 1000;
  std::vector<float> g(n), dense(n);
  for (int64_t i = 0; i < n; ++i) g[i] = 0.01f * rng_normal(4, 0, i);
  struct Factors {
    int64_t offset, R, M, K;
    std::vector<float> a, b;
  };
  std::vector<Factors> fs{{100, 3, 7, 9, {}, {}}, {401, 1, 5, 4, {}, {}}, {600, 2, 16, 20, {}, {}}};
  dense = g;
  for (size_t f = 0; f < fs.size(); ++f) {
    Factors& x = fs[f];
    for (int64_t i = 0; i < x.R * x.M; ++i) x.a.push_back(0.1f * rng_normal(5, f, i));
    for (int64_t i = 0; i < x.R * x.K; ++i) x.b.push_back(rng_normal(6, f, i));
    for (int64_t m = 0; m < x.M; ++m)
      for (int64_t k = 0; k < x.K; ++k) {
        volatile float s = x.a[m] * x.b[k];  // volatile: every product and sum rounded on its own
        for (int64_t r = 1; r < x.R; ++r) {
          volatile float prod = x.a[r * x.M + m] * x.b[r * x.K + k];
          s = s + prod;
        }
        dense[x.offset + m * x.K + k] = s;
        g[x.offset + m * x.K + k] = NAN;  // never read
      }
  }
  std::vector<Backend::LowRankGrad> lr;
  for (Factors& x : fs)
    lr.push_back(
        {x.offset, Tensor(x.a.data(), DType::f32, Shape{x.R, x.M}), Tensor(x.b.data(), DType::f32, Shape{x.R, x.K})});
  const auto f32 = [&](std::vector<float>& x) { return Tensor(x.data(), DType::f32, Shape{n}); };
  // The flat elements (zero at the low-rank ranges), then each gradient's Σ_{r,s} (a_r·a_s)(b_r·b_s).
  std::vector<float> flat_only = g;
  double gram_total = 0;
  for (const Factors& x : fs) {
    std::fill(flat_only.begin() + x.offset, flat_only.begin() + x.offset + x.M * x.K, 0.0f);
    double norm2 = 0;
    for (int64_t r = 0; r < x.R; ++r)
      for (int64_t q = r; q < x.R; ++q) {
        double da = 0, db = 0;
        for (int64_t i = 0; i < x.M; ++i) da += double(x.a[r * x.M + i]) * double(x.a[q * x.M + i]);
        for (int64_t i = 0; i < x.K; ++i) db += double(x.b[r * x.K + i]) * double(x.b[q * x.K + i]);
        norm2 += (r == q ? 1.0 : 2.0) * da * db;
      }
    gram_total += norm2;
  }
  const double want = be->sum_squares(f32(flat_only)) + gram_total;
  const double got = be->gradient_sum_squares(f32(g), lr);
  EXPECT_NEAR(got, want, 1e-14 * want);
  // The norm of the gradient before rounding: within f32 rounding of the elements' own.
  EXPECT_NEAR(got, be->sum_squares(f32(dense)), 1e-6 * got);
  EXPECT_EQ(be->gradient_sum_squares(f32(dense), {}), be->sum_squares(f32(dense)));

  std::vector<float> p(n), m(n, 0.f), v(n, 0.f);
  for (int64_t i = 0; i < n; ++i) p[i] = rng_normal(7, 0, i);
  std::vector<float> p2 = p, m2 = m, v2 = v;
  std::vector<uint16_t> copy(16 * 20, 0xFFFF);
  const Backend::ParamCopy copies[] = {{600, Tensor(copy.data(), DType::bf16, Shape{16, 20})}};  // over a factor range
  for (int64_t step = 1; step <= 2; ++step) {
    const Backend::AdamW h{1e-2, 0.9, 0.95, 1e-8, 0.1, 0.8, step};
    be->adamw(f32(p), f32(g), f32(m), f32(v), h, copies, {}, lr);
    be->adamw(f32(p2), f32(dense), f32(m2), f32(v2), h, {}, {}, {});
  }
  EXPECT_EQ(p, p2);
  EXPECT_EQ(m, m2);
  EXPECT_EQ(v, v2);
  for (int64_t i = 0; i < 16 * 20; ++i) ASSERT_EQ(copy[i], f32_to_bf16_bits(p[600 + i])) << i;

  const auto refused = [&](std::vector<Backend::LowRankGrad> bad, const char* what) {
    testing::expect_refused(what, [&] { be->gradient_sum_squares(f32(g), bad); });
  };
  refused({{990, lr[0].a, lr[0].b}}, "lies outside the 1000 gradients");
  refused({lr[0], {150, lr[1].a, lr[1].b}}, "overlap");
  refused({{0, lr[0].a, lr[1].b}}, "the same R >= 1 rows");
  refused({{0, Tensor(copy.data(), DType::bf16, Shape{1, 4}), lr[1].b}}, "contiguous f32 factors");
  std::vector<double> g64(n, 0.0);
  EXPECT_THROW(be->gradient_sum_squares(Tensor(g64.data(), DType::f64, Shape{n}), lr), Error);
}

// The tensor-parallel gradient norm's split runs in one op: on the CPU the sum of sum_squares of
// each range's slice in list order, bit for bit, whatever the threads; ranges outside are refused.
TEST(Optimizer, RangesSumSquaresIsTheSumOfEachRangesSumSquares) {
  std::vector<double> x(200003);
  for (size_t i = 0; i < x.size(); ++i) x[i] = rng_normal(5, 0, i) * (1.0 + static_cast<double>(i % 7));
  const Tensor t(x.data(), DType::f64, Shape{static_cast<int64_t>(x.size())});
  const std::vector<Backend::ElementRange> ranges{{7, 70001}, {90000, 0}, {100001, 99999}, {1, 5}, {3, 3}};
  BackendOptions one, four;
  one.threads = 1;
  four.threads = 4;
  for (const BackendOptions& o : {one, four}) {
    auto be = make_backend("cpu", o);
    double want = 0;
    for (const Backend::ElementRange& r : ranges)
      want += be->sum_squares(Tensor(x.data() + r.begin, DType::f64, Shape{r.count}));
    EXPECT_EQ(be->ranges_sum_squares(t, ranges), want) << o.threads << " threads";
    EXPECT_EQ(be->ranges_sum_squares(t, {}), 0.0);
    testing::expect_refused("is not inside x", [&] { be->ranges_sum_squares(t, {{200000, 4}}); });
    testing::expect_refused("is not inside x", [&] { be->ranges_sum_squares(t, {{5, -1}}); });
  }
}

TEST(Optimizer, SumSquaresIsThreadIndependent) {
  std::vector<float> x(100003);
  for (size_t i = 0; i < x.size(); ++i) x[i] = rng_normal(3, 0, i);
  BackendOptions one, four;
  one.threads = 1;
  four.threads = 4;
  auto a = make_backend("cpu", one), b = make_backend("cpu", four);
  const Tensor t(x.data(), DType::f32, Shape{static_cast<int64_t>(x.size())});
  EXPECT_EQ(a->sum_squares(t), b->sum_squares(t));
  x[500] = NAN;
  EXPECT_TRUE(std::isnan(a->sum_squares(t)));
}

TEST(Schedule, WarmupThenDecay) {
  LrSchedule s{1.0, 0.1, 10, 110, "cosine"};
  EXPECT_DOUBLE_EQ(s.at(1), 0.1);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(60), 0.1 + 0.9 * 0.5, 1e-15);  // halfway through the cosine
  EXPECT_DOUBLE_EQ(s.at(110), 0.1);
  EXPECT_DOUBLE_EQ(s.at(500), 0.1);
  s.style = "linear";
  EXPECT_NEAR(s.at(35), 0.1 + 0.9 * 0.75, 1e-15);
  s.style = "constant";
  EXPECT_DOUBLE_EQ(s.at(5), 0.5);
  EXPECT_DOUBLE_EQ(s.at(1000), 1.0);
}

TEST(Objective, PackPatchesFeatureOrder) {
  // feature = c·4 + ph·2 + pw; tokens row-major over the 2×2 patch grid.
  HostTensor x{{2, 4, 4}, std::vector<float>(32)};
  for (size_t i = 0; i < 32; ++i) x.data[i] = static_cast<float>(i);
  int64_t rows = 0, cols = 0;
  const std::vector<double> p = pack_patches(x, 2, &rows, &cols);
  EXPECT_EQ(rows, 4);
  EXPECT_EQ(cols, 8);
  // token 1 = patch (0, 1); channel 1, ph 1, pw 0 -> pixel (c=1, y=1, x=2) = 16 + 4 + 2
  EXPECT_EQ(p[1 * 8 + 1 * 4 + 1 * 2 + 0], 22.0);
  EXPECT_EQ(unpack_patches(p.data(), 2, 4, 4, 2), std::vector<double>(x.data.begin(), x.data.end()));
  EXPECT_EQ(image_position_ids(4, 6, 2), (std::vector<double>{0, 0, 0, 0, 0, 1, 0, 0, 2, 0, 1, 0, 0, 1, 1, 0, 1, 2}));
}

TEST(Objective, TimestepShift) {
  EXPECT_NEAR(shift_timestep(0.5, 256), std::exp(0.5) / (std::exp(0.5) + 1.0), 1e-15);
  EXPECT_NEAR(shift_timestep(0.5, 4096), std::exp(1.15) / (std::exp(1.15) + 1.0), 1e-15);
  EXPECT_EQ(shift_timestep(0.0, 1024), 0.0);
  EXPECT_DOUBLE_EQ(shift_timestep(1.0, 1024), 1.0);
}

Sample demo_like(int i) {
  Sample s;
  s.key = std::to_string(i);
  s.shard = "test";
  s.fields["image"] = HostTensor{{3, 4, 4}, std::vector<float>(48, 0.1f * static_cast<float>(i))};
  s.fields["t5"] = HostTensor{{2, 5}, std::vector<float>(10, 1.0f)};
  s.fields["clip"] = HostTensor{{3}, std::vector<float>(3, 2.0f)};
  return s;
}

FluxConfig tiny_pixels() {
  FluxConfig c;
  c.in_channels = 12;
  c.out_channels = 12;
  c.context_dim = 5;
  c.vec_dim = 3;
  c.latent_channels = 3;
  c.vae_downsample = 1;
  return c;
}

TEST(Objective, TrainBatchDoesNotDependOnMicroBatching) {
  const FluxConfig m = tiny_pixels();
  ObjectiveConfig obj;
  obj.text_dropout = 0.5;
  EmptyPrompt empty{HostTensor{{2, 5}, std::vector<float>(10, 0)}, HostTensor{{3}, std::vector<float>(3, 0)}};
  std::vector<Sample> all;
  for (int i = 0; i < 8; ++i) all.push_back(demo_like(i));
  const HostBatch whole = make_train_batch(all, m, obj, empty, 9, 3, 0, 0);
  const HostBatch a = make_train_batch({all.begin(), all.begin() + 4}, m, obj, empty, 9, 3, 0, 0);
  const HostBatch b = make_train_batch({all.begin() + 4, all.end()}, m, obj, empty, 9, 3, 0, 4);
  auto cat = [](auto x, const auto& y) {
    x.insert(x.end(), y.begin(), y.end());
    return x;
  };
  EXPECT_EQ(whole.t, cat(a.t, b.t));
  EXPECT_EQ(whole.y, cat(a.y, b.y));
  EXPECT_EQ(whole.x0, cat(a.x0, b.x0));
  std::vector<uint64_t> streams = a.noise_streams;
  streams.insert(streams.end(), b.noise_streams.begin(), b.noise_streams.end());
  EXPECT_EQ(whole.noise_streams, streams);
  // Text dropout at p = 0.5 dropped some samples (their pooled vector is the empty one) and kept others.
  int dropped = 0;
  for (int i = 0; i < 8; ++i) dropped += whole.y[static_cast<size_t>(3 * i)] == 0.0;
  EXPECT_GT(dropped, 0);
  EXPECT_LT(dropped, 8);
  // Another step draws other timesteps.
  EXPECT_NE(make_train_batch(all, m, obj, empty, 9, 4, 0, 0).t, whole.t);
}

TEST(Objective, ValidationUsesMlperfTimestepsAndFixedNoise) {
  const FluxConfig m = tiny_pixels();
  std::vector<Sample> s;
  for (int i = 0; i < 10; ++i) s.push_back(demo_like(i));
  const HostBatch v = make_validation_batch(s, m, ObjectiveConfig{}, 1, 0);
  for (size_t j = 0; j < 10; ++j) EXPECT_DOUBLE_EQ(v.t[j], static_cast<double>(j % 8) / 8.0);
  const HostBatch again = make_validation_batch({s.begin() + 2, s.end()}, m, ObjectiveConfig{}, 1, 2);
  EXPECT_EQ(std::vector<uint64_t>(v.noise_streams.begin() + 2, v.noise_streams.end()), again.noise_streams);
}

TEST(Objective, VaeResampleAndNormalisation) {
  FluxConfig m = tiny_pixels();
  m.in_channels = 4;
  m.out_channels = 4;
  Sample s = demo_like(0);
  s.fields.erase("image");
  s.fields["mean"] = HostTensor{{1, 2, 2}, {1.0f, 2.0f, 3.0f, 4.0f}};
  s.fields["logvar"] = HostTensor{{1, 2, 2}, {0.0f, -2.0f, 2.0f, -100.0f}};
  ObjectiveConfig obj;
  const HostBatch b = make_validation_batch({s}, m, obj, 1, 0);
  const uint64_t stream = validation_stream(0, Draw::vae_noise);
  for (size_t i = 0; i < 4; ++i) {
    const double z = s.fields["mean"].data[i] + std::exp(0.5 * s.fields["logvar"].data[i]) * rng_normal(1, stream, i);
    EXPECT_NEAR(b.x0[i], static_cast<float>(0.3611 * (z - 0.1159)), 1e-6);
  }
}

// The batch is assembled by the CPU's threads — sample by sample, or (few samples) each VAE draw
// spread over them — and comes out the same whatever their number, in place of a reused batch too.
TEST(Objective, TrainBatchIsTheSameFromAnyNumberOfThreads) {
  FluxConfig m = tiny_pixels();
  m.in_channels = 4 * 3;
  m.out_channels = m.in_channels;
  std::vector<Sample> samples;
  for (int i = 0; i < 3; ++i) {
    Sample s = demo_like(i);
    s.fields.erase("image");
    std::vector<float> mean(3 * 128 * 256), logvar(mean.size());  // 98k elements: the threaded VAE draw
    for (size_t k = 0; k < mean.size(); ++k) mean[k] = static_cast<float>(std::sin(0.01 * k + i)), logvar[k] = -1.0f;
    s.fields["mean"] = HostTensor{{3, 128, 256}, mean};
    s.fields["logvar"] = HostTensor{{3, 128, 256}, logvar};
    samples.push_back(s);
  }
  const ObjectiveConfig obj;
  const EmptyPrompt empty{HostTensor{{2, 5}, std::vector<float>(10, 0)}, HostTensor{{3}, std::vector<float>(3, 0)}};
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const HostBatch one = make_train_batch(samples, m, obj, empty, 5, 2, 0, 0);
  omp_set_num_threads(std::max(threads, 4));
  HostBatch many;
  make_train_batch(many, samples, m, obj, empty, 5, 7, 0, 0);  // another step first: then reused
  make_train_batch(many, {samples[0]}, m, obj, empty, 5, 2, 0, 0);
  make_train_batch(many, samples, m, obj, empty, 5, 2, 0, 0);
  omp_set_num_threads(threads);
  EXPECT_EQ(many.x0, one.x0);
  EXPECT_EQ(many.txt, one.txt);
  EXPECT_EQ(many.y, one.y);
  EXPECT_EQ(many.t, one.t);
  EXPECT_EQ(many.img_ids, one.img_ids);
  EXPECT_EQ(many.noise_streams, one.noise_streams);
  EXPECT_EQ(one.x0.size(), static_cast<size_t>(3 * 64 * 128 * 12));
}

}  // namespace
}  // namespace flux8
