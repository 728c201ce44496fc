// FP8 recipe math, the meta registry and the CPU quantizers, against expectations computed
// independently here (double arithmetic, explicit rolls, per-block loops), following
// Transformer Engine's recipe tests (tests/pytorch/test_recipe.py: scale update with random
// histories, the 4-step constant-tensor run, the amax numeric scenarios) and its cast tests'
// awkward shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "fp8/format.h"
#include "fp8/meta.h"
#include "fp8/quantize.h"
#include "fp8/recipe.h"

namespace flux8 {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// (fp8_max / amax) / 2^margin, correctly rounded to float: the double quotient rounded once
// to float is the correctly rounded float quotient (53 >= 2*24+2), and /2^margin is exact.
float ref_delayed_scale(float fp8_max, float amax, int margin) {
  return static_cast<float>(std::ldexp(double(fp8_max) / double(amax), -margin));
}

// ---- scale math --------------------------------------------------------------------------

TEST(Fp8Recipe, DelayedScaleNumericScenarios) {
  for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2})
    for (int margin : {0, 2}) {
      const float fmax = fp8_max(f), old = 0.75f;
      SCOPED_TRACE(testing::Message() << fp8_format_name(f) << " margin " << margin);
      EXPECT_EQ(delayed_scale(0.0f, old, fmax, margin), old);  // tensor unused / all zeros
      EXPECT_EQ(delayed_scale(kInf, old, fmax, margin), old);  // overflowed: nothing to learn
      EXPECT_EQ(delayed_scale(kNaN, old, fmax, margin), old);
      EXPECT_EQ(delayed_scale(-1.0f, old, fmax, margin), old);  // never produced, but not a scale
      // Smallest amax whose scale is finite, halved (TE's "tiny" case), and a subnormal amax.
      const float tiny = static_cast<float>(std::ldexp(double(fmax), -margin) / double(FLT_MAX)) / 2;
      EXPECT_EQ(delayed_scale(tiny, old, fmax, margin), FLT_MAX);
      EXPECT_EQ(delayed_scale(1e-40f, old, fmax, margin), FLT_MAX);
      for (float amax : {1.0f, 0.3f, 1.7e-3f, 3.0e4f, 12345.678f, 1e-30f})
        EXPECT_EQ(delayed_scale(amax, old, fmax, margin), ref_delayed_scale(fmax, amax, margin)) << amax;
    }
  // A negative margin lets the amax land above fp8_max.
  EXPECT_EQ(delayed_scale(448.0f, 1.0f, 448.0f, -1), 2.0f);
}

TEST(Fp8Recipe, CurrentScaleCasesAndPow2RoundsDown) {
  const float fmax = 448.0f;
  for (bool pow2 : {false, true}) {
    EXPECT_EQ(current_scale(0.0f, fmax, pow2), 1.0f);
    EXPECT_EQ(current_scale(kInf, fmax, pow2), 1.0f);
    EXPECT_EQ(current_scale(kNaN, fmax, pow2), 1.0f);
  }
  EXPECT_EQ(current_scale(1e-40f, fmax, false), FLT_MAX);
  EXPECT_EQ(current_scale(1e-40f, fmax, true), std::ldexp(1.0f, 127));  // FLT_MAX rounded down
  EXPECT_EQ(current_scale(3.0f, fmax, false), ref_delayed_scale(fmax, 3.0f, 0));
  EXPECT_EQ(current_scale(3.0f, fmax, true), 128.0f);  // 149.33 -> 128
  EXPECT_EQ(current_scale(448.0f, fmax, true), 1.0f);
  EXPECT_EQ(current_scale(300.0f, fmax, true), 1.0f);  // 1.49 -> 1
  EXPECT_EQ(current_scale(500.0f, fmax, true), 0.5f);  // 0.896 -> 0.5
  // amax_epsilon floors the amax: a zero tensor still gets 1 only when epsilon is 0.
  EXPECT_EQ(current_scale(0.0f, fmax, false, 1.0f), 448.0f);
  EXPECT_EQ(current_scale(0.5f, fmax, false, 1.0f), 448.0f);

  // Power-of-2 scales never push the amax past fp8_max, and lose less than a factor 2.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-30.0f, 30.0f);
  for (int i = 0; i < 2000; ++i) {
    const float amax = std::exp2(u(rng));
    for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
      const float s = current_scale(amax, fp8_max(f), true);
      int e;
      EXPECT_EQ(std::frexp(s, &e), 0.5f) << amax;
      EXPECT_LE(double(amax) * s, fp8_max(f)) << amax;
      EXPECT_GT(double(amax) * s * 2, fp8_max(f) * (1 - 1e-6)) << amax;
    }
  }
}

TEST(Fp8Recipe, AmaxIgnoresNanButSeesInf) {
  float a = 0;
  for (float x : {1.0f, -3.0f, kNaN, 2.0f}) a = amax_accumulate(a, x);
  EXPECT_EQ(a, 3.0f);
  EXPECT_EQ(amax_accumulate(a, -kInf), kInf);
  const std::vector<float> v = {kNaN, -0.5f, 0.25f, kNaN};
  EXPECT_EQ(tensor_amax(v.data(), 4), 0.5f);
}

// ---- registry: TE's scale update with random histories ------------------------------------

// (history length, algorithm, weight re-cast this step). TE's is_first_microbatch=False keeps
// the cached FP8 weight; here the cached weight is simply not cast, so its staging row stays 0.
class Fp8MetaScaleUpdate : public testing::TestWithParam<std::tuple<int, AmaxAlgo, bool>> {};

TEST_P(Fp8MetaScaleUpdate, MatchesRollAndMaxReference) {
  const auto [L, algo, weight_recast] = GetParam();
  const int margin = 2;
  const DelayedScalingParams p{algo, margin, Fp8Format::e4m3, Fp8Format::e5m2};  // hybrid
  Fp8MetaRegistry reg(L);
  const int x = reg.add("blocks.0.linear", Fp8Role::input);
  const int w = reg.add("blocks.0.linear", Fp8Role::weight);
  const int dy = reg.add("blocks.0.linear", Fp8Role::grad_output);
  const int n = reg.size();
  ASSERT_EQ(n, 3);

  // Cast the weight once with the initial scale: this is the cached FP8 copy.
  const std::vector<float> w_data = {0.5f, -1.25f, 2.0f, 0.03125f};
  const QuantizedTensor w_cached = quantize_delayed(w_data.data(), 2, 2, Fp8Format::e4m3, reg, w);
  reg.update(p);

  // Tweak histories and scales (rows 1..L-1 random in [0.5, 2.5), row 1 of x = 3), as TE does.
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> u(0.5f, 2.5f);
  std::vector<float> history(size_t(L) * n, 0.0f), scale(n);
  for (int r = 1; r < L; ++r)
    for (int s = 0; s < n; ++s) history[size_t(r) * n + s] = u(rng);
  if (L > 1) history[size_t(n) + x] = 3.0f;
  for (int s = 0; s < n; ++s) scale[s] = u(rng);
  reg.set_state(scale, history, L);
  const float w_scale_before = reg.scale(w);

  // This step's casts: staging amaxes (several casts per slot: the row keeps the max).
  std::vector<float> row0(n, 0.0f);
  for (int s : {x, dy}) row0[s] = u(rng);
  if (weight_recast) row0[w] = u(rng);
  for (int s = 0; s < n; ++s)
    if (row0[s] != 0) {
      reg.record_amax(s, row0[s] * 0.5f);
      reg.record_amax(s, row0[s]);
      reg.record_amax(s, kNaN);
      reg.record_amax(s, row0[s] * 0.25f);
    }
  for (int s = 0; s < n; ++s) history[s] = row0[s];

  // Reference: for slots cast this step, torch.roll(history, -1, 0) then zero row 0;
  // amax = max over the whole pre-roll history (max) or row 0 (most_recent).
  std::vector<float> ref_history = history, ref_scale = scale;
  for (int s = 0; s < n; ++s) {
    if (row0[s] == 0) continue;
    float window = 0;
    for (int r = 0; r < L; ++r) window = std::max(window, history[size_t(r) * n + s]);
    for (int r = 0; r < L; ++r) ref_history[size_t(r) * n + s] = history[size_t((r + 1) % L) * n + s];
    ref_history[s] = 0;
    const float amax = algo == AmaxAlgo::max ? window : row0[s];
    ref_scale[s] = ref_delayed_scale(fp8_max(p.format_for(reg.role(s))), amax, margin);
  }
  // Not trivially passing: every cast slot must change.
  for (int s = 0; s < n; ++s)
    if (row0[s] != 0) EXPECT_NE(ref_scale[s], scale[s]) << s;

  EXPECT_EQ(reg.update(p), weight_recast ? 3 : 2);
  EXPECT_EQ(reg.amax_history(), ref_history);
  EXPECT_EQ(reg.scales(), ref_scale);
  for (int s = 0; s < n; ++s) EXPECT_EQ(reg.scale_inv(s), static_cast<float>(1.0 / double(ref_scale[s]))) << s;
  if (!weight_recast) EXPECT_EQ(reg.scale(w), w_scale_before);

  // The cached weight keeps the scale_inv of its cast, so it still dequantizes to its values.
  ASSERT_EQ(w_cached.scale_inv.size(), 1u);
  EXPECT_EQ(w_cached.scale_inv[0], 1.0f);
  EXPECT_EQ(dequantize(w_cached), w_data);  // all four values are E4M3-exact at scale 1
}

INSTANTIATE_TEST_SUITE_P(Fp8Meta, Fp8MetaScaleUpdate,
                         testing::Combine(testing::Values(1, 31, 1024),
                                          testing::Values(AmaxAlgo::max, AmaxAlgo::most_recent), testing::Bool()));

// ---- registry: 4 steps of constant tensors, against the closed form -----------------------

// (history length, algorithm, margin, values increasing with the step or decreasing)
class Fp8MetaConstantTensors : public testing::TestWithParam<std::tuple<int, AmaxAlgo, int, bool>> {};

TEST_P(Fp8MetaConstantTensors, HistoryAndScalesFollowClosedForm) {
  const auto [L, algo, margin, increasing] = GetParam();
  const int steps = 4, rows = 16, cols = 16;
  const DelayedScalingParams p{algo, margin, Fp8Format::e4m3, Fp8Format::e5m2};
  Fp8MetaRegistry reg(L);
  const int slots[3] = {reg.add("linear", Fp8Role::input), reg.add("linear", Fp8Role::weight),
                        reg.add("linear", Fp8Role::grad_output)};
  const float offsets[3] = {0.25f, 0.5f, 0.75f};  // x, w, dy
  auto value = [&](int step, int k) { return float(increasing ? step : steps - step) + offsets[k]; };

  bool any_clipped = false;
  for (int step = 0; step < steps; ++step) {
    bool clipped[3];
    for (int k = 0; k < 3; ++k) {
      const int s = slots[k];
      const Fp8Format f = p.format_for(reg.role(s));
      const float v = value(step, k), scale_used = reg.scale(s);
      const std::vector<float> data(rows * cols, v);
      const QuantizedTensor q = quantize_delayed(data.data(), rows, cols, f, reg, s);
      // The cast uses the scale of steps <= step-1 and records its inverse.
      ASSERT_EQ(q.scale_inv.size(), 1u);
      EXPECT_EQ(q.scale_inv[0], reg.scale_inv(s));
      clipped[k] = double(v) * scale_used > fp8_saturation_bound(f);
      any_clipped |= clipped[k];
      const float deq = dequantize(q)[0];
      if (clipped[k])
        EXPECT_EQ(deq, fp8_max(f) * q.scale_inv[0]);
      else
        EXPECT_LE(std::fabs(deq - v), v * (f == Fp8Format::e4m3 ? 0x1p-4 : 0x1p-3) * (1 + 0x1p-20));
    }
    EXPECT_EQ(reg.update(p), 3);

    for (int k = 0; k < 3; ++k) {
      const int s = slots[k];
      SCOPED_TRACE(testing::Message() << "step " << step << " " << fp8_role_name(reg.role(s)));
      // Closed form: row 0 zero; row L-1-j holds step-j for j < min(step+1, L-1); older rows 0.
      EXPECT_EQ(reg.history_at(0, s), 0.0f);
      for (int r = 1; r < L; ++r) {
        const int j = L - 1 - r, from = step - j;
        EXPECT_EQ(reg.history_at(r, s), from >= 0 ? value(from, k) : 0.0f) << "row " << r;
      }
      // The window is the last L steps (TE: max over old rows 1..L-1 plus the current amax).
      float amax = value(step, k);
      if (algo == AmaxAlgo::max)
        for (int t = std::max(0, step - L + 1); t <= step; ++t) amax = std::max(amax, value(t, k));
      const float ref = ref_delayed_scale(fp8_max(p.format_for(reg.role(s))), amax, margin);
      EXPECT_EQ(reg.scale(s), ref);
      EXPECT_EQ(reg.scale_inv(s), static_cast<float>(1.0 / double(ref)));
      // The step's telemetry: one cast of rows*cols equal non-zero values.
      const CastStats& st = reg.step_stats(s);
      EXPECT_EQ(st.amax, value(step, k));
      EXPECT_EQ(st.elements, rows * cols);
      EXPECT_EQ(st.nonzero, rows * cols);
      EXPECT_EQ(st.saturated, clipped[k] ? rows * cols : 0);
      EXPECT_EQ(st.flushed, 0);
    }
  }
  // Growing amaxes clip under delayed scaling (step n uses step n-1's amax; x grows 5x from
  // step 0 to 1, past margin 2's 4x headroom), so the saturated branch above runs; shrinking
  // ones never clip.
  EXPECT_EQ(any_clipped, increasing);
}

INSTANTIATE_TEST_SUITE_P(Fp8Meta, Fp8MetaConstantTensors,
                         testing::Combine(testing::Values(1, 3, 31, 1024),
                                          testing::Values(AmaxAlgo::max, AmaxAlgo::most_recent), testing::Values(0, 2),
                                          testing::Bool()));

// A slot not cast this step keeps history and scale; the all-reduce hook sees row 0 and its
// result is what the update uses.
TEST(Fp8Meta, AllreduceHookAndUnusedSlots) {
  Fp8MetaRegistry reg(4);
  const int a = reg.add("a", Fp8Role::input), b = reg.add("b", Fp8Role::input), c = reg.add("c", Fp8Role::weight);
  reg.record_amax(a, 2.0f);
  reg.record_amax(b, kNaN);  // NaN is never staged
  EXPECT_EQ(reg.history_at(0, b), 0.0f);
  int calls = 0;
  reg.set_allreduce_hook([&](float* row0, int n) {
    ++calls;
    ASSERT_EQ(n, 3);
    EXPECT_EQ(row0, reg.amax_history_data());
    const float other_rank[3] = {4.0f, 0.0f, 1.0f};  // rank 1 cast c, rank 0 did not
    for (int s = 0; s < n; ++s) row0[s] = std::max(row0[s], other_rank[s]);
  });
  EXPECT_EQ(reg.update(DelayedScalingParams{AmaxAlgo::max, 0, Fp8Format::e4m3, Fp8Format::e5m2}), 2);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(reg.scale(a), 112.0f);  // 448 / 4: the reduced amax
  EXPECT_EQ(reg.history_at(3, a), 4.0f);
  EXPECT_EQ(reg.scale(b), 1.0f);  // unused everywhere: unchanged
  for (int r = 0; r < 4; ++r) EXPECT_EQ(reg.history_at(r, b), 0.0f);
  EXPECT_EQ(reg.scale(c), 448.0f);
}

TEST(Fp8Meta, AddKeepsStateAndRejectsDuplicates) {
  Fp8MetaRegistry reg(3);
  const int a = reg.add("double_blocks.0.img_attn.qkv", Fp8Role::weight);
  reg.record_amax(a, 7.0f);
  reg.update({});
  const int b = reg.add("double_blocks.0.img_attn.qkv", Fp8Role::input);  // same name, other role
  EXPECT_EQ(reg.find("double_blocks.0.img_attn.qkv", Fp8Role::input), b);
  EXPECT_EQ(reg.find("nope", Fp8Role::input), -1);
  EXPECT_EQ(reg.history_at(2, a), 7.0f);
  EXPECT_EQ(reg.history_at(2, b), 0.0f);
  EXPECT_EQ(reg.scale(a), 64.0f);
  EXPECT_EQ(reg.scale(b), 1.0f);
  EXPECT_THROW(reg.add("double_blocks.0.img_attn.qkv", Fp8Role::weight), Error);
  EXPECT_THROW(Fp8MetaRegistry(0), Error);
}

// History length change on restore: newest past rows kept, zeros on the oldest side.
TEST(Fp8Meta, ResizeHistoryKeepsNewestRows) {
  Fp8MetaRegistry reg(5);
  const int s = reg.add("t", Fp8Role::input);
  for (float v : {1.0f, 2.0f, 3.0f, 4.0f}) {
    reg.record_amax(s, v);
    reg.update({});
  }
  reg.record_amax(s, 9.0f);  // staged, not yet rolled
  EXPECT_EQ(reg.amax_history(), (std::vector<float>{9, 1, 2, 3, 4}));
  reg.resize_history(3);
  EXPECT_EQ(reg.amax_history(), (std::vector<float>{9, 3, 4}));
  reg.resize_history(6);
  EXPECT_EQ(reg.amax_history(), (std::vector<float>{9, 0, 0, 0, 3, 4}));
  reg.resize_history(1);
  EXPECT_EQ(reg.amax_history(), (std::vector<float>{9}));
  EXPECT_THROW(reg.resize_history(0), Error);
}

TEST(Fp8Meta, SetStateRestoresAndChecks) {
  Fp8MetaRegistry src(4), dst(2);
  for (Fp8MetaRegistry* r : {&src, &dst}) {
    r->add("a", Fp8Role::input);
    r->add("a", Fp8Role::grad_output);
  }
  for (float v : {1.0f, 3.0f, 2.0f}) {
    src.record_amax(0, v);
    src.record_amax(1, 10 * v);
    src.update({});
  }
  dst.set_state(src.scales(), src.amax_history(), src.history_len());
  EXPECT_EQ(dst.scales(), src.scales());
  EXPECT_EQ(dst.scale_invs(), src.scale_invs());
  EXPECT_EQ(dst.amax_history(), (std::vector<float>{0, 0, 2, 20}));  // length 2: the newest row
  EXPECT_THROW(dst.set_state({1.0f}, std::vector<float>(4), 2), Error);
  EXPECT_THROW(dst.set_state({1.0f, 1.0f}, std::vector<float>(5), 2), Error);
  EXPECT_THROW(dst.set_state({1.0f, 0.0f}, std::vector<float>(4), 2), Error);
  EXPECT_THROW(dst.set_state({1.0f, kInf}, std::vector<float>(4), 2), Error);
}

// ---- quantizers --------------------------------------------------------------------------

struct Shape2 {
  int64_t rows, cols;
};
const Shape2 kShapes[] = {{1, 16}, {5, 160}, {217, 256}, {130, 129}, {256, 384}};

// Values spread over 20 binades, with (for tensors of more than one tile) a zero bottom-right
// 128x128 tile — whole 1x128 and 1x32 blocks are zero too —, a huge outlier in the first
// block and a NaN in the middle.
std::vector<float> make_data(Shape2 sh, float outlier, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(-16.0f, 4.0f);
  std::vector<float> x(size_t(sh.rows * sh.cols));
  for (float& v : x) v = nd(rng) * std::exp2(ud(rng));
  if (sh.rows * sh.cols > 128) {
    const int64_t r0 = (sh.rows - 1) / 128 * 128, c0 = (sh.cols - 1) / 128 * 128;
    for (int64_t r = r0; r < sh.rows; ++r)
      for (int64_t c = c0; c < sh.cols; ++c) x[size_t(r * sh.cols + c)] = 0.0f;
    x[1] = outlier;
    x[size_t(sh.rows / 2 * sh.cols + sh.cols / 2 - 1)] = kNaN;
  }
  return x;
}

struct FormatLimits {
  int mant_bits;
  double min_normal, min_subnormal;
};
FormatLimits limits(Fp8Format f) {
  return f == Fp8Format::e4m3 ? FormatLimits{3, 0x1p-6, 0x1p-9} : FormatLimits{2, 0x1p-14, 0x1p-16};
}

// Checks q against x given the scale each element should have been multiplied by: codes NaN
// exactly for NaN inputs; saturated elements at +-fp8_max; elements below half the smallest
// subnormal flushed to zero; otherwise the half-ULP bound of the format — relative 2^-(M+1)
// in the normal range, absolute half a subnormal step below it — widened by 2^-21 relative for
// the fp32 roundings of x*scale, scale*scale_inv != 1 and decode*scale_inv (3 x 2^-24).
// The CastStats counts must match the classification.
void check_quantized(const std::vector<float>& x, const QuantizedTensor& q, const CastStats& st,
                     const std::function<double(int64_t, int64_t)>& scale_of) {
  const std::vector<float> y = dequantize(q);
  const FormatLimits lim = limits(q.format);
  const double fmax = fp8_max(q.format), rel = std::ldexp(1.0, -(lim.mant_bits + 1));
  int64_t saturated = 0, flushed = 0, nonzero = 0;
  float amax = 0;
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t c = 0; c < q.cols; ++c) {
      const size_t k = size_t(r * q.cols + c);
      const double v = x[k], s = scale_of(r, c), s_inv = q.scale_inv_at(r, c);
#define AT "element (" << r << ", " << c << ") x=" << v << " scale=" << s
      if (std::isnan(v)) {
        EXPECT_TRUE(std::isnan(y[k])) << AT;
        ++nonzero;
        continue;
      }
      amax = std::max(amax, float(std::fabs(v)));
      if (v != 0) ++nonzero;
      const double xs = std::fabs(v * s);
      if (xs > fp8_saturation_bound(q.format)) {
        ++saturated;
        EXPECT_EQ(std::fabs(y[k]), float(fmax * s_inv)) << AT;
      } else if (xs <= lim.min_subnormal / 2) {
        flushed += v != 0;
        EXPECT_EQ(y[k], 0.0f) << AT;
      } else if (xs < lim.min_normal) {
        EXPECT_LE(std::fabs(y[k] - v), (lim.min_subnormal / 2 * s_inv) * (1 + 0x1p-21)) << AT;
      } else {
        EXPECT_LE(std::fabs(y[k] - v), std::fabs(v) * (rel + 0x1p-21)) << AT;
      }
#undef AT
    }
  EXPECT_EQ(st.amax, amax);
  EXPECT_EQ(st.elements, q.rows * q.cols);
  EXPECT_EQ(st.nonzero, nonzero);
  EXPECT_EQ(st.saturated, saturated);
  EXPECT_EQ(st.flushed, flushed);
}

float ref_amax(const std::vector<float>& x, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  float a = 0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      const float v = x[size_t(r * cols + c)];
      if (!std::isnan(v)) a = std::max(a, std::fabs(v));
    }
  return a;
}

// fp8_max / amax correctly rounded, optionally rounded down to 2^k; 1 for a zero amax.
float ref_current_scale(float fmax, float amax, bool pow2) {
  if (amax == 0) return 1.0f;
  const float s = ref_delayed_scale(fmax, amax, 0);
  if (!pow2) return s;
  int e;
  std::frexp(s, &e);
  return std::ldexp(1.0f, e - 1);
}

class Fp8RecipeQuantize : public testing::TestWithParam<std::tuple<Fp8Format, bool>> {};

TEST_P(Fp8RecipeQuantize, TensorwiseExactScaleAndHalfUlp) {
  const auto [fmt, pow2] = GetParam();
  for (const Shape2 sh : kShapes) {
    SCOPED_TRACE(testing::Message() << sh.rows << "x" << sh.cols);
    const std::vector<float> x = make_data(sh, 3.0e4f, uint32_t(sh.rows * 1000 + sh.cols));
    CastStats st;
    const QuantizedTensor q = quantize_tensorwise(x.data(), sh.rows, sh.cols, fmt, {.pow2 = pow2}, &st);
    const float scale = ref_current_scale(fp8_max(fmt), ref_amax(x, sh.cols, 0, sh.rows, 0, sh.cols), pow2);
    ASSERT_EQ(q.scale_inv.size(), 1u);
    EXPECT_EQ(q.scale_inv[0], float(1.0 / double(scale)));
    EXPECT_EQ(q.scaling, Fp8Scaling::per_tensor);
    check_quantized(x, q, st, [&](int64_t, int64_t) { return double(scale); });
    if (sh.rows * sh.cols > 128) EXPECT_GT(st.flushed, 0);  // the outlier squeezes small values out
  }
  // All zeros: scale 1, zero codes.
  const std::vector<float> z(16, 0.0f);
  const QuantizedTensor qz = quantize_tensorwise(z.data(), 1, 16, fmt, {.pow2 = pow2});
  EXPECT_EQ(qz.scale_inv[0], 1.0f);
  for (uint8_t code : qz.codes) EXPECT_EQ(code, 0);
}

TEST_P(Fp8RecipeQuantize, BlockwiseExactScalesOnPartialBlocks) {
  const auto [fmt, pow2] = GetParam();
  const float fmax = fp8_max(fmt);
  for (Fp8Scaling blocks : {Fp8Scaling::block_1x128, Fp8Scaling::block_128x128})
    for (const Shape2 sh : kShapes) {
      SCOPED_TRACE(testing::Message() << fp8_scaling_name(blocks) << " " << sh.rows << "x" << sh.cols);
      const std::vector<float> x = make_data(sh, 3.0e4f, uint32_t(sh.rows * 7 + sh.cols));
      CastStats st;
      const QuantizedTensor q = quantize_blockwise(x.data(), sh.rows, sh.cols, fmt, blocks, {.pow2 = pow2}, &st);
      const int64_t br = blocks == Fp8Scaling::block_1x128 ? 1 : 128;
      const int64_t nbr = (sh.rows + br - 1) / br, nbc = (sh.cols + 127) / 128;
      ASSERT_EQ(q.scale_inv.size(), size_t(nbr * nbc));
      std::vector<float> scales(size_t(nbr * nbc));
      int zero_blocks = 0;
      for (int64_t i = 0; i < nbr; ++i)
        for (int64_t j = 0; j < nbc; ++j) {
          const float amax =
              ref_amax(x, sh.cols, i * br, std::min(sh.rows, (i + 1) * br), j * 128, std::min(sh.cols, (j + 1) * 128));
          const float s = ref_current_scale(fmax, amax, pow2);
          scales[size_t(i * nbc + j)] = s;
          EXPECT_EQ(q.scale_inv[size_t(i * nbc + j)], float(1.0 / double(s))) << "block " << i << "," << j;
          if (amax == 0) {
            ++zero_blocks;
            EXPECT_EQ(q.scale_inv[size_t(i * nbc + j)], 1.0f);
          }
        }
      if (sh.rows * sh.cols > 128) EXPECT_GT(zero_blocks, 0);
      check_quantized(x, q, st, [&](int64_t r, int64_t c) { return double(scales[size_t(r / br * nbc + c / 128)]); });
      EXPECT_EQ(st.saturated, 0);  // every block fits by construction
    }
}

INSTANTIATE_TEST_SUITE_P(Fp8Recipe, Fp8RecipeQuantize,
                         testing::Combine(testing::Values(Fp8Format::e4m3, Fp8Format::e5m2), testing::Bool()));

TEST(Fp8RecipeQuantizeMx, E8m0ScalesAreCeilExponentsOfAmaxOver448) {
  for (const Shape2 sh : kShapes) {
    SCOPED_TRACE(testing::Message() << sh.rows << "x" << sh.cols);
    const std::vector<float> x = make_data(sh, 3.0e4f, uint32_t(sh.rows * 31 + sh.cols));
    CastStats st;
    const QuantizedTensor q = quantize_mxfp8(x.data(), sh.rows, sh.cols, Fp8Format::e4m3, &st);
    const int64_t nbc = (sh.cols + 31) / 32;
    ASSERT_EQ(q.scale_e8m0.size(), size_t(sh.rows * nbc));
    EXPECT_TRUE(q.scale_inv.empty());
    std::vector<double> scales(q.scale_e8m0.size());
    for (int64_t r = 0; r < sh.rows; ++r)
      for (int64_t j = 0; j < nbc; ++j) {
        const float amax = ref_amax(x, sh.cols, r, r + 1, j * 32, std::min(sh.cols, (j + 1) * 32));
        // Smallest e with amax <= 448 * 2^e (exact in double); a zero block gets 2^0.
        int e = 0;
        if (amax > 0) {
          e = std::ilogb(amax) - 10;
          while (double(amax) > std::ldexp(448.0, e)) ++e;
        }
        const size_t k = size_t(r * nbc + j);
        EXPECT_EQ(int(q.scale_e8m0[k]) - 127, e) << "block " << r << "," << j << " amax " << amax;
        scales[k] = std::ldexp(1.0, -e);
      }
    check_quantized(x, q, st, [&](int64_t r, int64_t c) { return scales[size_t(r * nbc + c / 32)]; });
    EXPECT_EQ(st.saturated, 0);
  }
}

// An MX block whose amax is an exact power-of-two multiple of 448 keeps it at 448, no higher.
TEST(Fp8RecipeQuantizeMx, AmaxOnTheBoundaryAndDequantizeIsExactScaling) {
  std::vector<float> x(32, 0.0f);
  x[0] = 448.0f * 8;
  x[1] = -3.0f;
  x[2] = 448.0f * 8 + 1;  // needs the next exponent in a second block
  x[3] = 1e-30f;          // flushed
  const QuantizedTensor q1 = quantize_mxfp8(x.data(), 1, 2, Fp8Format::e4m3);
  EXPECT_EQ(q1.scale_e8m0[0], 127 + 3);
  const QuantizedTensor q2 = quantize_mxfp8(x.data(), 1, 32, Fp8Format::e4m3);
  EXPECT_EQ(q2.scale_e8m0[0], 127 + 4);
  const std::vector<float> y = dequantize(q1);
  EXPECT_EQ(y[0], 448.0f * 8);
  EXPECT_EQ(y[1], -3.0f);  // -3/8 = -0.375 is E4M3-exact
}

TEST(Fp8RecipeDelayedCast, UsesRegistryScaleAndRecordsCast) {
  Fp8MetaRegistry reg(2);
  const int s = reg.add("x", Fp8Role::input);
  std::vector<float> x = {1.0f, -2.0f, 0.0f, kNaN, 1e-9f, 500.0f};
  QuantizedTensor q = quantize_delayed(x.data(), 2, 3, Fp8Format::e4m3, reg, s);
  EXPECT_EQ(reg.history_at(0, s), 500.0f);
  reg.update({});
  EXPECT_EQ(reg.step_stats(s).saturated, 1);  // 500 > 464 at scale 1
  EXPECT_EQ(reg.step_stats(s).flushed, 1);    // 1e-9
  EXPECT_EQ(reg.step_stats(s).nonzero, 5);
  EXPECT_DOUBLE_EQ(reg.step_stats(s).saturated_fraction(), 1.0 / 6);
  EXPECT_DOUBLE_EQ(reg.step_stats(s).flushed_fraction(), 1.0 / 5);
  EXPECT_EQ(reg.scale(s), float(448.0 / 500.0));
  q = quantize_delayed(x.data(), 2, 3, Fp8Format::e4m3, reg, s);
  EXPECT_EQ(q.scale_inv[0], reg.scale_inv(s));
  const std::vector<float> y = dequantize(q);
  EXPECT_EQ(y[5], 448.0f * reg.scale_inv(s));
  EXPECT_TRUE(std::isnan(y[3]));
  EXPECT_EQ(y[2], 0.0f);
}

}  // namespace
}  // namespace flux8
