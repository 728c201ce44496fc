// recompute_elementwise (on by default) makes every block that keeps its activations keep only
// GEMM and attention outputs, its input and statistics, and recompute the element-wise and
// layout results in its backward (LayerNorm + modulation outputs, x_mid, GELU outputs, q, k, v,
// o in token layout); recompute_granularity: selective drops q, k, v and the attention and GELU
// outputs even without it; full keeps only block inputs and re-runs each block's forward in the
// backward. The same ops on the same inputs give the same bits, so every gradient must be
// identical to the run that keeps all activations — in f64, f32 and FP8 (delayed scaling over
// several steps, where a recomputed cast must not change the recorded amaxes; blockwise;
// tensorwise with fp8_wgrad off, where FP8 Linears keep their inputs unquantized).
#include <gtest/gtest.h>

#include <limits>

#include "backend/transfer.h"
#include "core/error.h"
#include "fp8/fp8_config.h"
#include "model_test_util.h"

namespace flux8::testing {
namespace {

ModelRun run(const FluxConfig& cfg, DType dtype, const Fp8Config* fp8, RecomputePolicy rc, int steps) {
  auto be = make_backend("cpu");
  return run_model(*be, cfg,
                   {.dtype = dtype,
                    .fp8 = fp8,
                    .recompute = rc,
                    .steps = steps,
                    .param_seed = 5,
                    .input_seed = 21,
                    .probe_seed = 9});
}

void expect_identical(const ModelRun& a, const ModelRun& b) {
  EXPECT_EQ(a.pred, b.pred);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i].second, b.grads[i].second) << a.grads[i].first;
  // A recomputed forward casts again but must not count (or record) its casts a second time.
  EXPECT_EQ(a.cast_elements, b.cast_elements);
}

constexpr Recompute kRecomputing[] = {Recompute::selective, Recompute::full};

const char* name_of(Recompute rc) {
  return rc == Recompute::none ? "none" : rc == Recompute::selective ? "selective" : "full";
}

// A policy with recompute_elementwise set as given.
RecomputePolicy with_elementwise(Recompute rc, bool elementwise, int64_t blocks = std::numeric_limits<int64_t>::max()) {
  return RecomputePolicy{rc, blocks, elementwise};
}

// Every policy, with recompute_elementwise on and off, against the run that keeps every
// activation (none, recompute_elementwise off) on the same model, precision and steps.
void expect_identical_to_none(const FluxConfig& cfg, DType dtype, const Fp8Config* fp8, int steps) {
  const ModelRun keep_all = run(cfg, dtype, fp8, with_elementwise(Recompute::none, false), steps);
  for (Recompute rc : {Recompute::none, Recompute::selective, Recompute::full})
    for (bool elementwise : {true, false}) {
      if (rc == Recompute::none && !elementwise) continue;
      SCOPED_TRACE(::testing::Message() << name_of(rc) << ", recompute_elementwise " << elementwise);
      expect_identical(run(cfg, dtype, fp8, with_elementwise(rc, elementwise), steps), keep_all);
    }
}

TEST(Recompute, GivesIdenticalGradientsF64AndF32) {
  const FluxConfig cfg = odd_config(2, 3, true);
  for (DType t : {DType::f64, DType::f32}) {
    SCOPED_TRACE(dtype_name(t));
    expect_identical_to_none(cfg, t, nullptr, 1);
  }
}

TEST(Recompute, GivesIdenticalGradientsInFp8OverSteps) {
  const FluxConfig cfg = odd_config(2, 2, false);
  Fp8Config fp8;
  fp8.enabled = true;
  fp8.hybrid = true;
  fp8.recipe = Fp8Recipe::delayed;
  fp8.amax_history_len = 3;
  fp8.first_last_bf16 = true;  // blocks of different layouts share the recompute region
  {
    SCOPED_TRACE("delayed");
    expect_identical_to_none(cfg, DType::f32, &fp8, 3);
  }
  fp8.dot_product_attention = true;  // the FP8 q, k, v, o kept, o dequantized for recomputation
  {
    SCOPED_TRACE("delayed, FP8 attention");
    expect_identical_to_none(cfg, DType::f32, &fp8, 3);
  }
  fp8.dot_product_attention = false;
  fp8.recipe = Fp8Recipe::blockwise;
  fp8.amax_history_len = 1024;
  fp8.first_last_bf16 = false;
  {
    SCOPED_TRACE("blockwise");
    expect_identical_to_none(cfg, DType::f32, &fp8, 2);
  }
  fp8.recipe = Fp8Recipe::tensorwise;
  fp8.wgrad = false;  // recomputed Linear inputs are used as they are, not cast again
  {
    SCOPED_TRACE("tensorwise, fp8_wgrad off");
    expect_identical_to_none(cfg, DType::f32, &fp8, 2);
  }
}

// recompute_method block (RecomputePolicy with a block count): the first N blocks recompute,
// double blocks counted first; the rest keep their activations. Still the same bits, whether
// the boundary falls among the double blocks, at the switch to the single blocks or among them
// (FP8: the LayerNorm statistics a kept block hands to the next are not handed to a recomputed
// one).
// fp8_weight_transpose: in_backward transposes each weight's rowwise cast for its dgrad instead of
// keeping the transposed cast: the same codes and scale, so the same bits — over steps whose
// weights AdamW casts (delayed) and whose casts take each step's amax (tensorwise), with every
// recompute setting (a recomputed forward leaves the shared buffer to the backward after it).
TEST(Recompute, WeightsTransposedInTheBackwardGiveIdenticalGradients) {
  const FluxConfig cfg = odd_config(2, 2, false);
  for (Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise}) {
    Fp8Config keep;
    keep.enabled = true;
    keep.hybrid = true;
    keep.recipe = recipe;
    keep.amax_history_len = 3;
    Fp8Config in_backward = keep;
    in_backward.weight_transpose_in_backward = true;
    for (Recompute rc : {Recompute::none, Recompute::full}) {
      SCOPED_TRACE(::testing::Message() << fp8_recipe_name(recipe) << ", " << name_of(rc));
      const ModelRun a = run(cfg, DType::f32, &keep, with_elementwise(rc, true), 3);
      const ModelRun b = run(cfg, DType::f32, &in_backward, with_elementwise(rc, true), 3);
      expect_identical(b, a);
    }
  }
}

TEST(Recompute, TheFirstBlocksOnlyGiveIdenticalGradients) {
  const FluxConfig cfg = odd_config(2, 3, true);
  const ModelRun none = run(cfg, DType::f32, nullptr, with_elementwise(Recompute::none, false), 1);
  Fp8Config fp8;
  fp8.enabled = true;
  fp8.hybrid = true;
  fp8.amax_history_len = 3;
  const ModelRun none8 = run(cfg, DType::f32, &fp8, with_elementwise(Recompute::none, false), 2);
  for (Recompute rc : kRecomputing)
    for (int64_t blocks : {1, 2, 4})
      for (bool elementwise : {true, false}) {
        SCOPED_TRACE(::testing::Message()
                     << name_of(rc) << ", first " << blocks << " blocks, recompute_elementwise " << elementwise);
        expect_identical(run(cfg, DType::f32, nullptr, with_elementwise(rc, elementwise, blocks), 1), none);
        expect_identical(run(cfg, DType::f32, &fp8, with_elementwise(rc, elementwise, blocks), 2), none8);
      }
}

// Recomputing the first blocks keeps less than recomputing none and more than recomputing all,
// more so the fewer blocks recompute (down to where the saving of a few blocks is outweighed by
// the region one recomputed block needs, not tested here). recompute_elementwise off: the other
// blocks keep everything.
TEST(Recompute, TheFirstBlocksOnlyKeepTheRestsActivations) {
  const FluxConfig cfg = odd_config(4, 8, true);
  const StepShape sh{2, 16, 64};
  auto bytes_of = [&](RecomputePolicy rc) { return FluxModel::estimate_activations(cfg, sh, rc).gpu_bytes(false); };
  for (Recompute rc : kRecomputing) {
    SCOPED_TRACE(name_of(rc));
    double previous = bytes_of(with_elementwise(rc, false));
    for (int64_t blocks : {8, 4}) {
      const double bytes = bytes_of(with_elementwise(rc, false, blocks));
      EXPECT_GT(bytes, previous) << blocks;
      previous = bytes;
    }
    EXPECT_LT(previous, bytes_of(with_elementwise(Recompute::none, false)));
    EXPECT_EQ(bytes_of(with_elementwise(rc, false, 12)), bytes_of(with_elementwise(rc, false)));
  }
  // With it, selective on the first blocks is what none does in every block.
  EXPECT_EQ(bytes_of(RecomputePolicy{Recompute::selective, 4}), bytes_of(Recompute::none));
}

TEST(Recompute, FullKeepsOneBlockOfActivations) {
  FluxConfig cfg = odd_config(4, 8, true);
  const StepShape sh{2, 16, 64};
  const ActivationEstimate none = FluxModel::estimate_activations(cfg, sh, Recompute::none);
  const ActivationEstimate full = FluxModel::estimate_activations(cfg, sh, Recompute::full);
  EXPECT_LT(full.gpu_bytes(false), 0.4 * none.gpu_bytes(false))
      << "full " << full.gpu_bytes(false) << " vs none " << none.gpu_bytes(false);
  EXPECT_GT(full.gpu_bytes(false), 0.0);
}

// fp8_dot_product_attention keeps each block's q, k, v and o as FP8 codes (1 byte) in place of
// bf16 heads: without recomputation 4 heads fewer bf16 elements, with q, k, v recomputed (which
// kept only o) q, k, v kept as well; Linear inputs unchanged.
TEST(Recompute, Fp8AttentionKeepsFp8Heads) {
  FluxConfig cfg = odd_config(2, 3, true);
  const StepShape sh{2, 16, 64};
  const int64_t heads = sh.batch * sh.tokens() * cfg.hidden_size;  // B·n·L·D of one head tensor
  const int64_t blocks = cfg.num_double_blocks + cfg.num_single_blocks;
  for (const RecomputePolicy& rc : {with_elementwise(Recompute::none, false), RecomputePolicy{Recompute::none},
                                    with_elementwise(Recompute::selective, false)}) {
    SCOPED_TRACE(::testing::Message() << name_of(rc.granularity) << ", recompute_elementwise " << rc.elementwise);
    const ActivationEstimate e = FluxModel::estimate_activations(cfg, sh, rc);
    auto kept = [](const ArenaUsage& u, SlotKind k) { return u.elements[static_cast<int>(k)]; };
    const int64_t bf16_heads = rc.saved_by_block(0).heads ? 1 : 4;
    EXPECT_EQ(kept(e.saved, SlotKind::activation) - kept(e.saved_fp8_attention, SlotKind::activation),
              blocks * bf16_heads * heads);
    EXPECT_EQ(kept(e.saved_fp8_attention, SlotKind::fp8_heads), blocks * 4 * heads);
    EXPECT_EQ(kept(e.saved, SlotKind::fp8_heads), 0);
    EXPECT_EQ(kept(e.saved, SlotKind::linear_input), kept(e.saved_fp8_attention, SlotKind::linear_input));
    // bytes kept: bf16 heads out, FP8 heads and their four f32 scale_inv in
    EXPECT_EQ(e.saved.gpu_bytes(true) - e.saved_fp8_attention.gpu_bytes(true),
              static_cast<double>(blocks * ((2 * bf16_heads - 4) * heads - 4 * 4)));
    EXPECT_EQ(e.gpu_bytes(false, true), e.gpu_bytes(false));  // BF16 runs have no FP8 attention
    // Its backward's head gradients are FP8 casts too and no q, k, v are recomputed in scratch: never
    // more scratch (the peak may lie where no head gradient is held: a single block's linear1).
    EXPECT_LE(e.scratch(true, true).bf16, e.scratch(true).bf16);
  }
}

TEST(Recompute, SelectiveDropsExactlyTheRecomputedTensors) {
  FluxConfig cfg = odd_config(4, 8, true);
  const StepShape sh{2, 16, 64};
  const ActivationEstimate none = FluxModel::estimate_activations(cfg, sh, with_elementwise(Recompute::none, false));
  const ActivationEstimate selective =
      FluxModel::estimate_activations(cfg, sh, with_elementwise(Recompute::selective, false));
  const ActivationEstimate full = FluxModel::estimate_activations(cfg, sh, Recompute::full);
  // Per block and token: q, k, v (3H of activations) and the input of the Linear after
  // attention and GELU — proj and mlp_out per double-block stream, linear2 in a single block
  // (H + M of Linear inputs). Everything else, statistics included, is kept.
  const int64_t per_block = sh.batch * sh.tokens(), H = cfg.hidden_size, M = cfg.mlp_hidden();
  const int64_t blocks = cfg.num_double_blocks + cfg.num_single_blocks;
  auto kept = [](const ActivationEstimate& e, SlotKind k) { return e.saved.elements[static_cast<int>(k)]; };
  EXPECT_EQ(kept(none, SlotKind::activation) - kept(selective, SlotKind::activation), blocks * per_block * 3 * H);
  EXPECT_EQ(kept(none, SlotKind::linear_input) - kept(selective, SlotKind::linear_input), blocks * per_block * (H + M));
  EXPECT_EQ(kept(none, SlotKind::statistic), kept(selective, SlotKind::statistic));
  EXPECT_EQ(kept(selective, SlotKind::workspace), 0) << "recomputed tensors belong in scratch";
  // FP8 Linears add their casts' scratch to the blocks': a single block's linear1 backward holds
  // the two casts of its output gradient (2 x (3H + M) bytes a token), more than the head
  // gradients that set the peak of BF16's.
  FluxConfig wide = odd_config(1, 1, false);
  wide.mlp_ratio = 4.0;
  const ActivationEstimate w =
      FluxModel::estimate_activations(wide, StepShape{2, 2, 64}, with_elementwise(Recompute::none, false));
  EXPECT_GT(w.scratch(true).bf16, w.scratch(false).bf16);
  // Between the two other policies, in BF16 and in FP8; the recomputed tensors need scratch.
  for (bool fp8 : {false, true}) {
    EXPECT_LT(selective.saved.gpu_bytes(fp8), none.saved.gpu_bytes(fp8)) << "fp8 " << fp8;
    EXPECT_GT(selective.saved.gpu_bytes(fp8), full.saved.gpu_bytes(fp8)) << "fp8 " << fp8;
    EXPECT_LT(selective.gpu_bytes(fp8), none.gpu_bytes(fp8)) << "fp8 " << fp8;
  }
  EXPECT_GT(selective.workspace.bf16, none.workspace.bf16);
}

// recompute_elementwise: per block and token, besides selective's q, k, v (3H of activations)
// and the inputs of proj and mlp_out (double-block stream) or linear2 (single block), the
// LayerNorm outputs that feed qkv and mlp_in (double) or linear1 (single) — H each, Linear
// inputs — and the double block's x_mid (H of activations). Statistics stay; selective then
// drops nothing more. The saved bytes are those elements at 2 bytes (bf16), and in FP8 the Linear
// inputs at 1 (their casts; their scales are kept too).
TEST(Recompute, ElementwiseDropsExactlyTheRecomputedTensors) {
  FluxConfig cfg = odd_config(4, 8, true);
  const StepShape sh{2, 16, 64};
  const ActivationEstimate keep_all =
      FluxModel::estimate_activations(cfg, sh, with_elementwise(Recompute::none, false));
  const ActivationEstimate none = FluxModel::estimate_activations(cfg, sh, Recompute::none);
  const ActivationEstimate selective = FluxModel::estimate_activations(cfg, sh, Recompute::selective);
  const int64_t per_block = sh.batch * sh.tokens(), H = cfg.hidden_size, M = cfg.mlp_hidden();
  const int64_t nd = cfg.num_double_blocks, ns = cfg.num_single_blocks;
  auto kept = [](const ActivationEstimate& e, SlotKind k) { return e.saved.elements[static_cast<int>(k)]; };
  const int64_t activations = (nd + ns) * per_block * 3 * H + nd * per_block * H;
  const int64_t linear_inputs = nd * per_block * (3 * H + M) + ns * per_block * (2 * H + M);
  EXPECT_EQ(kept(keep_all, SlotKind::activation) - kept(none, SlotKind::activation), activations);
  EXPECT_EQ(kept(keep_all, SlotKind::linear_input) - kept(none, SlotKind::linear_input), linear_inputs);
  EXPECT_EQ(kept(keep_all, SlotKind::statistic), kept(none, SlotKind::statistic));
  EXPECT_EQ(kept(none, SlotKind::workspace), 0) << "recomputed tensors belong in scratch";
  EXPECT_EQ(none.saved.gpu_bytes(false), selective.saved.gpu_bytes(false));
  EXPECT_EQ(keep_all.saved.gpu_bytes(false) - none.saved.gpu_bytes(false),
            2.0 * static_cast<double>(activations + linear_inputs));
  EXPECT_LT(none.saved.gpu_bytes(true), keep_all.saved.gpu_bytes(true));
  EXPECT_GT(none.workspace.bf16, keep_all.workspace.bf16);
}

TEST(Recompute, PolicyNames) {
  EXPECT_EQ(recompute_from_name("none"), Recompute::none);
  EXPECT_EQ(recompute_from_name("selective"), Recompute::selective);
  EXPECT_EQ(recompute_from_name("full"), Recompute::full);
  EXPECT_THROW(recompute_from_name("partial"), Error);
}

}  // namespace
}  // namespace flux8::testing
