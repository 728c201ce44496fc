// FP8 Linears against the full-precision Linear on Gaussian data, per recipe and format.
//
// Expected accuracy (signal-to-quantization-noise ratio, 10·log10(‖ref‖² / ‖out − ref‖²)):
// rounding a Gaussian to a p-bit significand leaves a relative error uniform within
// ±2^-(p+1) of the value's binade, about 6.02·(p+1) + 5 dB for one operand: E4M3 (p = 3) ~29 dB,
// E5M2 (p = 2) ~23 dB. A GEMM of two independently rounded operands adds the two noises, so
// E4M3·E4M3 ≈ 26 dB (threshold 24), and hybrid gradients E5M2·E4M3 ≈ 22 dB (threshold 20).
// Per-block scales (blockwise, MX) waste less of the range than one scale per tensor, so they
// do at least as well.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "core/error.h"
#include "core/rng.h"
#include "fp8/fp8_config.h"
#include "model/fp8_runtime.h"
#include "model/linear_site.h"

namespace flux8 {
namespace {

double sqnr_db(const std::vector<double>& out, const std::vector<double>& ref) {
  double s = 0, n = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    s += ref[i] * ref[i];
    n += (out[i] - ref[i]) * (out[i] - ref[i]);
  }
  return 10.0 * std::log10(s / n);
}

struct Buffers {
  Backend& be;
  std::vector<void*> owned;
  explicit Buffers(Backend& b) : be(b) {}
  ~Buffers() {
    for (void* p : owned) be.release(p);
  }
  Tensor randn(Shape s, uint64_t stream, double stddev) {
    Tensor t(be.allocate(static_cast<size_t>(s.numel()) * 4), DType::f32, s);
    owned.push_back(t.data);
    std::vector<double> v(static_cast<size_t>(s.numel()));
    for (size_t i = 0; i < v.size(); ++i) v[i] = stddev * rng_normal(42, stream, i);
    from_host(be, t, v);
    return t;
  }
  Tensor zeros(Shape s) { return randn(s, 0, 0.0); }
};

struct Case {
  Fp8Recipe recipe;
  bool hybrid;
};

void check_recipe(Case c) {
  auto be = make_backend("cpu");
  Buffers buf(*be);
  const int64_t N = 150, K = 200, M = 130;  // not multiples of 32 or 128
  Fp8Config cfg;
  cfg.enabled = true;
  cfg.recipe = c.recipe;
  cfg.hybrid = c.hybrid;
  cfg.power_of_2_scales = c.recipe == Fp8Recipe::blockwise;
  Fp8Runtime rt(cfg, *be);
  LinearSite site;
  site.name = "test.linear";
  site.w = buf.randn(Shape{M, K}, 1, 1.0 / std::sqrt(static_cast<double>(K)));
  site.b = buf.randn(Shape{M}, 2, 0.1);
  site.dw = buf.zeros(Shape{M, K});
  site.db = buf.zeros(Shape{M});
  rt.add_site(site);
  std::vector<LinearSite*> sites = {&site};
  rt.allocate_weight_casts(sites);
  const Tensor x = buf.randn(Shape{N, K}, 3, 1.0), dy = buf.randn(Shape{N, M}, 4, 0.01);

  Arena saved_arena, scratch;
  {
    Arena m1, m2;
    allocate_linear_input(m1, site, &rt, x.shape, DType::f32);
    plan_site_forward(m2, &rt.config(), N, K);
    plan_site_backward(m2, &rt.config(), N, M);
    saved_arena.reserve(*be, m1.peak());
    scratch.reserve(*be, m2.peak());
  }
  // Reference: the full-precision Linear.
  Tensor y_ref = buf.zeros(Shape{N, M}), dx_ref = buf.zeros(Shape{N, K}), dw_ref = buf.zeros(Shape{M, K}),
         db_ref = buf.zeros(Shape{M});
  be->linear(y_ref, x, site.w, site.b);
  be->linear_backward(dx_ref, dw_ref, db_ref, dy, x, site.w, false, true);

  Tensor y = buf.zeros(Shape{N, M}), dx = buf.zeros(Shape{N, K});
  // Two steps: delayed scaling casts step 2 with the scales learned from step 1's amax.
  for (int step = 0; step < 2; ++step) {
    saved_arena.reset();
    SavedLinearInput saved = allocate_linear_input(saved_arena, site, &rt, x.shape, DType::f32);
    if (saved.full.defined()) be->copy(saved.full, x);
    be->fill(site.dw, 0.0);
    be->fill(site.db, 0.0);
    site_forward(*be, &rt, scratch, site, y, saved.full.defined() ? saved.full : x, saved);
    site_backward(*be, &rt, scratch, site, dx, dy, saved, false);
    rt.end_step();
    rt.weights_updated();
  }
  const double fwd = sqnr_db(to_host(*be, y), to_host(*be, y_ref));
  const double dgrad = sqnr_db(to_host(*be, dx), to_host(*be, dx_ref));
  const double wgrad = sqnr_db(to_host(*be, site.dw), to_host(*be, dw_ref));
  const double grad_threshold = c.hybrid ? 20.0 : 24.0;
  const std::string what = std::string(fp8_recipe_name(c.recipe)) + (c.hybrid ? " hybrid" : " e4m3");
  std::printf("  %-18s SQNR fprop %.1f dB, dgrad %.1f dB, wgrad %.1f dB\n", what.c_str(), fwd, dgrad, wgrad);
  EXPECT_GE(fwd, 24.0) << what;
  EXPECT_GE(dgrad, grad_threshold) << what;
  EXPECT_GE(wgrad, grad_threshold) << what;
  // FP8 is not a no-op: the error is there, at the size the format predicts (< 40 dB).
  EXPECT_LT(fwd, 40.0) << what;
  // The bias gradient comes from the unquantized output gradient.
  EXPECT_EQ(to_host(*be, site.db), to_host(*be, db_ref)) << what;
}

TEST(Fp8Linear, DelayedE4m3) { check_recipe({Fp8Recipe::delayed, false}); }
TEST(Fp8Linear, DelayedHybrid) { check_recipe({Fp8Recipe::delayed, true}); }
TEST(Fp8Linear, TensorwiseE4m3) { check_recipe({Fp8Recipe::tensorwise, false}); }
TEST(Fp8Linear, TensorwiseHybrid) { check_recipe({Fp8Recipe::tensorwise, true}); }
TEST(Fp8Linear, BlockwiseE4m3) { check_recipe({Fp8Recipe::blockwise, false}); }
TEST(Fp8Linear, BlockwiseHybrid) { check_recipe({Fp8Recipe::blockwise, true}); }
TEST(Fp8Linear, Mxfp8E4m3) { check_recipe({Fp8Recipe::mxfp8, false}); }
TEST(Fp8Linear, Mxfp8Hybrid) { check_recipe({Fp8Recipe::mxfp8, true}); }

// site_forward_gelu / site_backward_gelu run the GELU in BF16 GEMM epilogues only; an FP8 site
// given to them is a caller's mistake (its GELU belongs in the casts: gelu_in_epilogues), so it
// fails naming the site before anything runs.
TEST(Fp8Linear, GeluSitesRefuseFp8Sites) {
  auto be = make_backend("cpu");
  Fp8Config cfg;
  cfg.enabled = true;
  Fp8Runtime rt(cfg, *be);
  LinearSite site;
  site.name = "test.mlp.0";
  rt.add_site(site);
  Arena scratch;
  SavedLinearInput saved;
  const auto expect_refused = [&](const auto& call) {
    try {
      call();
      ADD_FAILURE() << "an FP8 site ran";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("site 'test.mlp.0' runs in FP8"), std::string::npos) << m;
    }
  };
  expect_refused(
      [&] { site_forward_gelu(*be, &rt, scratch, site, Tensor{}, Tensor{}, Backend::CastInput{}, saved, DType::f32); });
  expect_refused([&] { site_backward_gelu(*be, &rt, site, Tensor{}, Tensor{}, Tensor{}, Tensor{}, saved); });
}

// Delayed scaling, hybrid formats, an amax history of `history` steps.
Fp8Config delayed_hybrid(int history) {
  Fp8Config cfg;
  cfg.enabled = true;
  cfg.recipe = Fp8Recipe::delayed;
  cfg.hybrid = true;
  cfg.amax_history_len = history;
  return cfg;
}

// The delayed-scaling state lives in backend memory and end_step() updates it there
// (Backend::delayed_scaling_update). The host mirror must show exactly what the registry's own
// update() gives on the same staged amaxes, with the all-reduce hook applied to the staging
// row first; a state restored into the mirror (set_state, as a checkpoint load does) must be
// what the next casts use.
TEST(Fp8Runtime, DelayedUpdateOnBackendMatchesRegistryUpdate) {
  auto be = make_backend("cpu");
  Buffers buf(*be);
  const int64_t N = 40, K = 48, M = 24;
  const Fp8Config cfg = delayed_hybrid(4);
  Fp8Runtime rt(cfg, *be);
  LinearSite site;
  site.name = "test.linear";
  site.w = buf.randn(Shape{M, K}, 1, 0.2);
  site.dw = buf.zeros(Shape{M, K});
  rt.add_site(site);
  std::vector<LinearSite*> sites = {&site};
  rt.allocate_weight_casts(sites);
  const Tensor x = buf.randn(Shape{N, K}, 3, 1.0), dy = buf.randn(Shape{N, M}, 4, 0.01);
  Tensor y = buf.zeros(Shape{N, M}), dx = buf.zeros(Shape{N, K});
  Arena saved_arena, scratch;
  saved_arena.reserve(*be, 1 << 20);
  scratch.reserve(*be, 1 << 20);

  // A restored state: past rows and scales that are not the defaults.
  const int n = rt.registry().size(), L = 4;
  std::vector<float> scale(static_cast<size_t>(n)), history(static_cast<size_t>(L * n), 0.0f);
  for (int s = 0; s < n; ++s) {
    scale[static_cast<size_t>(s)] = 2.0f + static_cast<float>(s);
    for (int r = 1; r < L; ++r) history[static_cast<size_t>(r * n + s)] = 0.5f * static_cast<float>(r + s);
  }
  rt.registry().set_state(scale, history, L);
  auto doubling = [](float* row0, int count) {
    for (int s = 0; s < count; ++s) row0[s] *= 2.0f;
  };
  rt.registry().set_allreduce_hook(doubling);

  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(step);
    saved_arena.reset();
    SavedLinearInput saved = allocate_linear_input(saved_arena, site, &rt, x.shape, DType::f32);
    site_forward(*be, &rt, scratch, site, y, x, saved);
    site_backward(*be, &rt, scratch, site, dx, dy, saved, false);
    // The weight cast used the scale in force this step (the restored one at step 0).
    EXPECT_EQ(site.w_row.scale_inv[0], 1.0f / rt.registry().scale(1));
    if (step == 0) EXPECT_EQ(rt.registry().scale(1), 3.0f);

    Fp8MetaRegistry ref(L);  // the host reference, from the mirror's staged state
    for (int s = 0; s < n; ++s) ref.add(rt.registry().name(s), rt.registry().role(s));
    ref.set_state(rt.registry().scales(), rt.registry().amax_history(), L);
    ref.set_allreduce_hook(doubling);
    for (int s = 0; s < n; ++s) EXPECT_GT(ref.history_at(0, s), 0.0f) << "slot " << s << " was cast";
    EXPECT_EQ(ref.update(DelayedScalingParams{AmaxAlgo::max, 0, Fp8Format::e4m3, Fp8Format::e5m2}), n);

    rt.end_step();
    rt.weights_updated();
    EXPECT_EQ(rt.registry().amax_history(), ref.amax_history());
    EXPECT_EQ(rt.registry().scales(), ref.scales());
    EXPECT_EQ(rt.registry().scale_invs(), ref.scale_invs());
  }
}

// set_collect_stats(false) (the trainer's steps between fp8_stats_interval reports) drops only
// the telemetry counts: the casts, their amaxes, hence the delayed-scaling state and every
// result, are those of a runtime that counts; its last_step_stats() are empty (nothing is
// reported for those steps).
TEST(Fp8Runtime, TelemetryCountsOnlyWhenCollected) {
  auto be = make_backend("cpu");
  Buffers buf(*be);
  const int64_t N = 40, K = 48, M = 24;
  const Fp8Config cfg = delayed_hybrid(4);
  const Tensor x = buf.randn(Shape{N, K}, 3, 1.0), dy = buf.randn(Shape{N, M}, 4, 0.01);
  const Tensor w = buf.randn(Shape{M, K}, 1, 0.2);
  struct Run {
    Run(const Fp8Config& c, Backend& b) : rt(c, b) {}
    Fp8Runtime rt;
    LinearSite site;
    Tensor y, dx;
    Arena saved, scratch;
  };
  auto make = [&](bool collect) {
    auto r = std::make_unique<Run>(cfg, *be);
    r->y = buf.zeros(Shape{N, M});
    r->dx = buf.zeros(Shape{N, K});
    r->site.name = "test.linear";
    r->site.w = w;
    r->site.dw = buf.zeros(Shape{M, K});
    r->rt.add_site(r->site);
    std::vector<LinearSite*> sites = {&r->site};
    r->rt.allocate_weight_casts(sites);
    r->rt.set_collect_stats(collect);
    r->saved.reserve(*be, 1 << 20);
    r->scratch.reserve(*be, 1 << 20);
    return r;
  };
  const auto on = make(true), off = make(false);
  EXPECT_FALSE(off->rt.collect_stats());
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(step);
    for (Run* r : {on.get(), off.get()}) {
      r->saved.reset();
      SavedLinearInput saved = allocate_linear_input(r->saved, r->site, &r->rt, x.shape, DType::f32);
      site_forward(*be, &r->rt, r->scratch, r->site, r->y, x, saved);
      site_backward(*be, &r->rt, r->scratch, r->site, r->dx, dy, saved, false);
      r->rt.end_step();
      r->rt.weights_updated();
    }
    EXPECT_EQ(to_host(*be, off->y), to_host(*be, on->y));
    EXPECT_EQ(to_host(*be, off->dx), to_host(*be, on->dx));
    EXPECT_EQ(to_host(*be, off->site.dw), to_host(*be, on->site.dw));
    EXPECT_EQ(off->rt.registry().amax_history(), on->rt.registry().amax_history());
    EXPECT_EQ(off->rt.registry().scales(), on->rt.registry().scales());
    for (int o = 0; o < 3; ++o) {
      EXPECT_GT(on->rt.last_step_stats()[0].op[o].elements, 0) << o;
      EXPECT_GT(on->rt.last_step_stats()[0].op[o].nonzero, 0) << o;
      EXPECT_EQ(off->rt.last_step_stats()[0].op[o].elements, 0) << o;
    }
  }
}

}  // namespace
}  // namespace flux8
