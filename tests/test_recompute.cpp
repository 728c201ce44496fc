// recompute_granularity: full keeps only block inputs and re-runs each block's forward in the
// backward. The same ops on the same inputs give the same bits, so every gradient must be
// identical to the run that keeps all activations — in f64, f32 and FP8 (delayed scaling,
// several steps, where a recomputed cast must not change the recorded amaxes).
#include <gtest/gtest.h>

#include "backend/transfer.h"
#include "core/error.h"
#include "fp8/fp8_config.h"
#include "model_test_util.h"

namespace flux8::testing {
namespace {

ModelRun run(const FluxConfig& cfg, DType dtype, const Fp8Config* fp8, Recompute rc, int steps) {
  auto be = make_backend("cpu");
  return run_model(*be, cfg,
                   {.dtype = dtype, .fp8 = fp8, .recompute = rc, .steps = steps, .param_seed = 5, .input_seed = 21,
                    .probe_seed = 9});
}

void expect_identical(const ModelRun& a, const ModelRun& b) {
  EXPECT_EQ(a.pred, b.pred);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i].second, b.grads[i].second) << a.grads[i].first;
  // A recomputed forward casts again but must not count (or record) its casts a second time.
  EXPECT_EQ(a.cast_elements, b.cast_elements);
}

TEST(Recompute, FullGivesIdenticalGradientsF64AndF32) {
  const FluxConfig cfg = odd_config(2, 3, true);
  for (DType t : {DType::f64, DType::f32})
    expect_identical(run(cfg, t, nullptr, Recompute::full, 1), run(cfg, t, nullptr, Recompute::none, 1));
}

TEST(Recompute, FullGivesIdenticalGradientsInFp8DelayedOverSteps) {
  const FluxConfig cfg = odd_config(2, 2, false);
  Fp8Config fp8;
  fp8.enabled = true;
  fp8.hybrid = true;
  fp8.recipe = Fp8Recipe::delayed;
  fp8.amax_history_len = 3;
  fp8.first_last_bf16 = true;  // blocks of different layouts share the recompute region
  expect_identical(run(cfg, DType::f32, &fp8, Recompute::full, 3), run(cfg, DType::f32, &fp8, Recompute::none, 3));
  fp8.recipe = Fp8Recipe::blockwise;
  fp8.amax_history_len = 1024;
  fp8.first_last_bf16 = false;
  expect_identical(run(cfg, DType::f32, &fp8, Recompute::full, 2), run(cfg, DType::f32, &fp8, Recompute::none, 2));
}

TEST(Recompute, FullKeepsOneBlockOfActivations) {
  FluxConfig cfg = odd_config(4, 8, true);
  const StepShape sh{2, 16, 64};
  const ActivationEstimate none = FluxModel::estimate_activations(cfg, sh, Recompute::none);
  const ActivationEstimate full = FluxModel::estimate_activations(cfg, sh, Recompute::full);
  EXPECT_LT(full.gpu_bytes(false), 0.4 * none.gpu_bytes(false))
      << "full " << full.gpu_bytes(false) << " vs none " << none.gpu_bytes(false);
  EXPECT_GT(full.gpu_bytes(false), 0.0);
  EXPECT_EQ(recompute_from_name("full"), Recompute::full);
  EXPECT_THROW(recompute_from_name("selective"), Error);
}

}  // namespace
}  // namespace flux8::testing
