// FluxModel::plan reserves the block scratch arena once from a model of the blocks' allocations
// (double_block_plan_scratch, single_block_plan_scratch): the step must fit it (an overflow fails
// in Arena::alloc), and whatever the plan reserves beyond the step's peak is device memory no
// tensor ever uses. So the plan is checked against the arena's measured peak over whole training
// steps, in every precision, recompute setting and FP8 layout: it may exceed the peak only by the
// one buffer it holds for a gradient of the prediction in another dtype than the activations'.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "fp8/fp8_config.h"
#include "model_test_util.h"

namespace flux8::testing {
namespace {

struct Precision {
  std::string name;
  DType dtype = DType::f32;
  Fp8Config fp8;  // disabled: BF16 blocks
};

std::vector<Precision> precisions() {
  std::vector<Precision> p;
  p.push_back({"f64", DType::f64, {}});
  p.push_back({"f32", DType::f32, {}});
  p.push_back({"delayed hybrid", DType::f32, delayed_hybrid_fp8()});
  p.push_back({"delayed hybrid, FP8 attention", DType::f32, delayed_hybrid_fp8(true)});
  Fp8Config blockwise = delayed_hybrid_fp8();
  blockwise.recipe = Fp8Recipe::blockwise;
  p.push_back({"blockwise", DType::f32, blockwise});
  Fp8Config mx = delayed_hybrid_fp8();
  mx.recipe = Fp8Recipe::mxfp8;
  p.push_back({"mxfp8", DType::f32, mx});
  Fp8Config bf16_wgrad = delayed_hybrid_fp8();
  bf16_wgrad.recipe = Fp8Recipe::tensorwise;
  bf16_wgrad.wgrad = false;  // FP8 Linears keep their inputs unquantized
  p.push_back({"tensorwise, fp8_wgrad off", DType::f32, bf16_wgrad});
  Fp8Config edges = delayed_hybrid_fp8(true);
  edges.first_last_bf16 = true;  // BF16 and FP8 blocks in one model
  edges.modulation = true;
  p.push_back({"first and last blocks BF16, FP8 modulation", DType::f32, edges});
  return p;
}

std::vector<RecomputePolicy> policies() {
  std::vector<RecomputePolicy> r;
  for (Recompute g : {Recompute::none, Recompute::selective, Recompute::full})
    for (bool elementwise : {true, false}) r.push_back({g, std::numeric_limits<int64_t>::max(), elementwise});
  r.push_back({Recompute::full, 2, true});  // the first two blocks only
  return r;
}

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }  // Arena's slot alignment

TEST(ScratchPlan, ReservesWhatTheStepUses) {
  const FluxConfig cfg = odd_config(2, 2, true);
  for (const Precision& p : precisions())
    for (const RecomputePolicy& rc : policies()) {
      SCOPED_TRACE(::testing::Message() << p.name << ", recompute " << static_cast<int>(rc.granularity) << " (first "
                                        << rc.blocks << " blocks), elementwise " << rc.elementwise);
      auto be = make_backend("cpu");
      // Streams of one length: the double block's plan sizes both streams' parts at the longer one.
      const ModelRun run = run_model(*be, cfg,
                                     {.dtype = p.dtype,
                                      .fp8 = p.fp8.enabled ? &p.fp8 : nullptr,
                                      .recompute = rc,
                                      .batch = 2,
                                      .txt_tokens = 7,
                                      .img_tokens = 7,
                                      .steps = 2,
                                      .optimizer = true});
      const size_t dpred = aligned(static_cast<size_t>(2 * 7 * cfg.out_channels) * dtype_size(p.dtype));
      EXPECT_LE(run.scratch_peak, run.scratch_reserved);
      EXPECT_LE(run.scratch_reserved, run.scratch_peak + dpred)
          << "planned " << run.scratch_reserved << " B, used " << run.scratch_peak << " B";
    }
}

// Streams of different lengths: the plan covers the step (the difference is the shorter stream's).
TEST(ScratchPlan, CoversStreamsOfDifferentLengths) {
  const FluxConfig cfg = odd_config(1, 2, false);
  for (const Precision& p : precisions()) {
    SCOPED_TRACE(p.name);
    auto be = make_backend("cpu");
    const ModelRun run = run_model(*be, cfg,
                                   {.dtype = p.dtype,
                                    .fp8 = p.fp8.enabled ? &p.fp8 : nullptr,
                                    .recompute = Recompute::selective,
                                    .txt_tokens = 4,
                                    .img_tokens = 11});
    EXPECT_LE(run.scratch_peak, run.scratch_reserved);
    EXPECT_GT(run.scratch_peak, 0u);
  }
}

}  // namespace
}  // namespace flux8::testing
