// FP8 in the training loop on the CPU emulation: every recipe and format trains, resume is
// bit-exact with the FP8 state, BF16 <-> FP8 resumes work, block selection, config errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/op_profiler.h"
#include "config/config.h"
#include "core/error.h"
#include "fp8/fp8_config.h"
#include "fp8/state_io.h"
#include "model_test_util.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train_test_util.h"

namespace flux8 {
namespace {

using testing::RunDir;

TrainResult train(const RunDir& dir, const std::string& save, std::vector<std::string> extra, bool resume = false,
                  int64_t stop_after = 0) {
  TrainOptions o = dir.options(save);
  o.overrides.insert(o.overrides.end(), extra.begin(), extra.end());
  o.resume = resume;
  o.stop_after = stop_after;
  return run_training(o);
}

TEST(Fp8Training, EveryRecipeAndFormatTrains) {
  const RunDir dir("fp8_recipes");
  const TrainResult bf16 = train(dir, "bf16", {"train_iters=8"});
  for (const char* recipe : {"delayed", "tensorwise", "blockwise", "mxfp8"})
    for (const char* format : {"e4m3", "hybrid"}) {
      const std::string name = std::string(recipe) + "_" + format;
      const TrainResult r = train(
          dir, name,
          {"train_iters=8", std::string("fp8=") + format, std::string("fp8_recipe=") + recipe, "fp8_stats_interval=4"});
      EXPECT_TRUE(std::isfinite(r.last_loss)) << name;
      EXPECT_LT(r.last_val_loss, r.first_val_loss) << name << ": validation loss did not fall";
      // FP8 changes the numbers (it is really on) but stays close to BF16 at this size.
      EXPECT_NE(r.last_loss, bf16.last_loss) << name;
      EXPECT_NEAR(r.last_val_loss, bf16.last_val_loss, 0.05 * bf16.last_val_loss) << name;
      // The telemetry record is in metrics.jsonl.
      std::ifstream in(dir.root / name / "metrics.jsonl");
      std::string line;
      bool telemetry = false;
      while (std::getline(in, line)) {
        const auto j = nlohmann::json::parse(line);
        if (j.contains("fp8")) {
          telemetry = true;
          const auto& t = j["fp8"][0];
          EXPECT_TRUE(t.contains("amax") && t.contains("saturated") && t.contains("underflow")) << name;
        }
      }
      EXPECT_TRUE(telemetry) << name;
    }
}

// The interrupted run writes its checkpoints behind training (async_save: on): the step-3 copy
// must hold the FP8 state of step 3 (the host mirror brought up to date at the copy), not the
// mirror as it was when last read.
TEST(Fp8Training, ResumeIsBitExactWithFp8State) {
  const RunDir dir("fp8_resume");
  const std::vector<std::string> fp8 = {"fp8=hybrid", "fp8_recipe=delayed", "fp8_amax_history_len=4"};
  train(dir, "straight", fp8);
  std::vector<std::string> behind = fp8;
  behind.push_back("async_save=on");
  train(dir, "resumed", behind, false, 3);
  const TrainResult b = train(dir, "resumed", fp8, true);
  EXPECT_EQ(b.steps_done, 6);
  EXPECT_EQ(testing::step_losses(dir.root / "straight" / "metrics.jsonl"),
            testing::step_losses(dir.root / "resumed" / "metrics.jsonl"));
  const auto ckpt = [&](const char* run, const char* file) {
    return (dir.root / run / "step-0000006" / file).string();
  };
  testing::expect_same_tensors(ckpt("straight", "model.safetensors"), ckpt("resumed", "model.safetensors"));
  testing::expect_same_tensors(ckpt("straight", "fp8_state.safetensors"), ckpt("resumed", "fp8_state.safetensors"));
  // The history really moved: scales are not all 1 after 6 steps.
  const SafetensorsReader f(ckpt("straight", "fp8_state.safetensors"));
  std::vector<float> scale(static_cast<size_t>(f.tensor("scale").numel()));
  f.read_f32("scale", scale.data());
  EXPECT_TRUE(std::any_of(scale.begin(), scale.end(), [](float s) { return s != 1.0f; }));
}

// fp8_dot_product_attention: the attention of every FP8 block in FP8 (the CPU twin of cuDNN's
// FP8 attention): trains as close to BF16 as the FP8 Linears alone, resumes bit for bit, and
// its nine delayed-scaling slots per block move and are checkpointed.
TEST(Fp8Training, Fp8AttentionTrainsResumesAndKeepsItsScales) {
  const RunDir dir("fp8_attention");
  const std::vector<std::string> linears = {"train_iters=6", "fp8=hybrid", "fp8_recipe=delayed",
                                            "fp8_amax_history_len=4"};
  std::vector<std::string> attention = linears;
  attention.push_back("fp8_dot_product_attention=true");
  const TrainResult bf16 = train(dir, "bf16", {"train_iters=6"});
  const TrainResult fp8 = train(dir, "linears", linears);
  std::vector<std::string> reported = attention;
  reported.push_back("fp8_stats_interval=3");
  const TrainResult straight = train(dir, "straight", reported);
  EXPECT_TRUE(std::isfinite(straight.last_loss));
  EXPECT_LT(straight.last_val_loss, straight.first_val_loss);
  EXPECT_NE(straight.last_loss, fp8.last_loss);  // the attention really ran in FP8
  EXPECT_NEAR(straight.last_val_loss, bf16.last_val_loss, 0.05 * bf16.last_val_loss);
  train(dir, "resumed", reported, false, 3);
  const TrainResult b = train(dir, "resumed", reported, true);
  EXPECT_EQ(b.steps_done, 6);
  EXPECT_EQ(testing::step_losses(dir.root / "straight" / "metrics.jsonl"),
            testing::step_losses(dir.root / "resumed" / "metrics.jsonl"));
  // The telemetry records each attention tensor's amax and scale.
  std::ifstream in(dir.root / "straight" / "metrics.jsonl");
  std::string line;
  int attention_records = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("fp8")) continue;
    for (const auto& t : j["fp8"])
      if (t["role"] == "attention" && t["tensor"] == "double_blocks.0.attn.o") {
        ++attention_records;
        EXPECT_GT(t["amax"].get<double>(), 0.0);
        EXPECT_GT(t["scale"].get<double>(), 1.0);  // O's amax is below E4M3's 448
        EXPECT_FALSE(t.contains("saturated"));     // cast inside the attention kernel
      } else if (t["role"] == "attention" && t["tensor"] == "double_blocks.0.attn.q") {
        EXPECT_TRUE(t.contains("saturated") && t.contains("underflow"));  // flux8's own cast
      }
  }
  EXPECT_EQ(attention_records, 2);  // steps 3 and 6
  const std::string state = (dir.root / "straight" / "step-0000006" / "fp8_state.safetensors").string();
  const std::string resumed = (dir.root / "resumed" / "step-0000006" / "fp8_state.safetensors").string();
  testing::expect_same_tensors(state, resumed);
  Fp8MetaRegistry reg(4);
  for (const char* t : {"q", "k", "v", "o"}) reg.add(std::string("double_blocks.0.attn.") + t, Fp8Role::input);
  for (const char* t : {"do", "ds", "dq", "dk", "dv"})
    reg.add(std::string("double_blocks.0.attn.") + t, Fp8Role::grad_output);
  const std::string note = load_fp8_state(reg, state);
  EXPECT_NE(note.find("9 of 9 tensors restored"), std::string::npos) << note;
  for (int s = 0; s < reg.size(); ++s) EXPECT_NE(reg.scale(s), 1.0f) << reg.name(s) << ": its scale never moved";
}

TEST(Fp8Training, Bf16AndFp8CheckpointsResumeEachOther) {
  const RunDir dir("fp8_cross");
  train(dir, "run", {"train_iters=6"}, false, 3);                                  // BF16 for 3 steps
  const TrainResult fp8 = train(dir, "run", {"train_iters=6", "fp8=e4m3"}, true);  // then FP8
  EXPECT_EQ(fp8.steps_done, 6);
  EXPECT_TRUE(std::filesystem::exists(dir.root / "run" / "step-0000006" / "fp8_state.safetensors"));
  const TrainResult back = train(dir, "run", {"train_iters=8"}, true);  // and BF16 again
  EXPECT_EQ(back.steps_done, 8);
  EXPECT_FALSE(std::filesystem::exists(dir.root / "run" / "step-0000008" / "fp8_state.safetensors"));
}

TEST(Fp8Training, HistoryLengthChangeOnRestore) {
  Fp8MetaRegistry a(4);
  const int s = a.add("x", Fp8Role::input);
  for (int step = 1; step <= 3; ++step) {
    a.record_amax(s, static_cast<float>(step));
    a.update(DelayedScalingParams{});
  }
  const std::string path = (std::filesystem::temp_directory_path() / "flux8_fp8_state_len.safetensors").string();
  save_fp8_state(a, path);
  Fp8MetaRegistry shorter(2), longer(8);
  shorter.add("x", Fp8Role::input);
  longer.add("x", Fp8Role::input);
  shorter.add("new", Fp8Role::weight);
  const std::string note = load_fp8_state(shorter, path);
  EXPECT_NE(note.find("1 of 2 tensors restored"), std::string::npos) << note;
  EXPECT_NE(note.find("amax history 4 -> 2"), std::string::npos) << note;
  load_fp8_state(longer, path);
  EXPECT_EQ(shorter.scale(0), a.scale(0));
  EXPECT_EQ(longer.scale(0), a.scale(0));
  EXPECT_EQ(shorter.history_at(1, 0), 3.0f);  // newest past step kept
  EXPECT_EQ(longer.history_at(7, 0), 3.0f);
  EXPECT_EQ(longer.history_at(5, 0), 1.0f);
  std::filesystem::remove(path);
}

// The delayed recipe's weight casts written by AdamW with the new weights (Backend::ParamCast,
// with the next step's scales; columnwise copies by transpose_codes) give the steps the casts
// at the weights' first use gave: the same predictions, gradients and delayed-scaling state;
// and on a step that counts telemetry the weights are cast again for their counts.
TEST(Fp8Training, WeightCastsWrittenByAdamWEqualCastsAtFirstUse) {
  auto cpu = make_backend("cpu");
  FluxConfig cfg = testing::odd_config(1, 1, false);
  Fp8Config fp8;
  fp8.enabled = true;
  fp8.hybrid = true;
  fp8.recipe = Fp8Recipe::delayed;
  fp8.amax_history_len = 3;
  testing::ModelRunOptions o{.fp8 = &fp8, .steps = 4, .optimizer = true, .collect_stats = false};
  const testing::ModelRun fused = testing::run_model(*cpu, cfg, o);
  o.fused_weight_casts = false;
  const testing::ModelRun first_use = testing::run_model(*cpu, cfg, o);
  EXPECT_EQ(fused.pred, first_use.pred);
  ASSERT_EQ(fused.grads.size(), first_use.grads.size());
  for (size_t i = 0; i < fused.grads.size(); ++i) EXPECT_EQ(fused.grads[i].second, first_use.grads[i].second) << i;
  EXPECT_EQ(fused.scales, first_use.scales);
  // The amax history: the same rows, but for the staging row's weight slots (each site's
  // second), which already hold the amax of the next step's weights when AdamW cast them.
  const size_t n = fused.scales.size();
  ASSERT_EQ(fused.history.size(), first_use.history.size());
  ASSERT_EQ(n % 3, 0u);
  for (size_t i = 0; i < fused.history.size(); ++i) {
    if (i < n && i % 3 == 1) {
      EXPECT_GT(fused.history[i], 0.0f) << "staging slot " << i << ": the new weight's amax";
      EXPECT_EQ(first_use.history[i], 0.0f) << i;
    } else {
      EXPECT_EQ(fused.history[i], first_use.history[i]) << i;
    }
  }

  o.collect_stats = true;
  const testing::ModelRun counted = testing::run_model(*cpu, cfg, o);
  o.fused_weight_casts = true;
  const testing::ModelRun fused_counted = testing::run_model(*cpu, cfg, o);
  EXPECT_EQ(fused_counted.pred, counted.pred);
  EXPECT_EQ(fused_counted.cast_elements, counted.cast_elements) << "the weights' casts counted on every step";
  EXPECT_EQ(fused_counted.scales, counted.scales);
}

// The FP8 model's gradients follow the exact (f32) model's: every parameter gradient within a
// relative L2 error the casts explain, through the paths FP8 changes — the GELUs and their
// backward inside the casts (the single block's two-source casts with a head), FP8 or BF16
// wgrad, FP8 attention. E4M3 throughout, delayed scaling, second step (the first step's amaxes
// set the scales). Measured: at most 0.28 for any gradient (printed), while a wrong op in these
// paths (GELU instead of its backward in the single block's cast, tried) puts the gradients it
// feeds at 0.6–0.65.
TEST(Fp8Training, GradientsFollowTheExactModel) {
  auto cpu = make_backend("cpu");
  FluxConfig cfg = testing::odd_config(1, 1, false);
  cfg.hidden_size = 64, cfg.num_heads = 4, cfg.mlp_ratio = 4.0, cfg.axes_dim = {4, 6, 6};
  const testing::ModelRunOptions exact_options{.steps = 2, .weight_std = 0.125};
  const testing::ModelRun exact = testing::run_model(*cpu, cfg, exact_options);
  const auto rel_l2 = [](const std::vector<double>& a, const std::vector<double>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
    return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  };
  for (const bool wgrad : {true, false})
    for (const bool attention : {false, true}) {
      SCOPED_TRACE(fmt::format("fp8_wgrad {} fp8_dot_product_attention {}", wgrad, attention));
      Fp8Config fp8;
      fp8.enabled = true;
      fp8.recipe = Fp8Recipe::delayed;
      fp8.wgrad = wgrad;
      fp8.dot_product_attention = attention;
      testing::ModelRunOptions o = exact_options;
      o.fp8 = &fp8;
      const testing::ModelRun run = testing::run_model(*cpu, cfg, o);
      EXPECT_LT(rel_l2(run.pred, exact.pred), 0.1);
      ASSERT_EQ(run.grads.size(), exact.grads.size());
      double worst = 0;
      std::string worst_name;
      for (size_t i = 0; i < run.grads.size(); ++i) {
        const double e = rel_l2(run.grads[i].second, exact.grads[i].second);
        EXPECT_LT(e, 0.4) << run.grads[i].first;
        if (e > worst) worst = e, worst_name = run.grads[i].first;
      }
      std::printf("worst gradient error %.3g (%s)\n", worst, worst_name.c_str());
    }
}

// The optimizer step's FP8 bookkeeping (Fp8Runtime::end_step) waits for the device only on the
// steps whose casts counted telemetry — their counts arrive at a synchronisation — so that on
// the other steps the gradient norm is queued behind the backward instead of after a drained
// device. The syncs are counted by an op interceptor on the CPU backend.
TEST(Fp8Training, EndStepWaitsForTheDeviceOnlyForCountedStatistics) {
  struct SyncCounter : OpInterceptor {
    double intercept(Ops& ops, AnyOp&& op) override { return ops.execute_any(op); }
    void host_access(HostAccess what, const std::function<void()>& access) override {
      if (what == HostAccess::synchronize) ++syncs;
      access();
    }
    int syncs = 0;
  };
  auto cpu = make_backend("cpu");
  const FluxConfig cfg = testing::odd_config(1, 1, false);
  Fp8Config fp8;
  fp8.enabled = fp8.hybrid = true;
  fp8.recipe = Fp8Recipe::delayed;
  int syncs[2] = {0, 0};
  for (const bool counted : {false, true}) {
    SCOPED_TRACE(counted ? "counted" : "not counted");
    SyncCounter counter;
    cpu->set_interceptor(&counter);
    const testing::ModelRun r = testing::run_model(*cpu, cfg, {.fp8 = &fp8, .steps = 3, .collect_stats = counted});
    cpu->set_interceptor(nullptr);
    syncs[counted] = counter.syncs;
    int64_t elements = 0;
    for (const int64_t e : r.cast_elements) elements += e;
    if (counted)
      EXPECT_GT(elements, 0);
    else
      EXPECT_EQ(elements, 0) << "nothing counted, nothing reported";
  }
  EXPECT_EQ(syncs[1] - syncs[0], 3) << "one wait per counted step";
}

// FP8 LayerNorms run inside their Linears' input casts, and the gated residual before each
// writes its statistics (Backend::gated_residual_stats): within a double block for LayerNorm 2,
// and across blocks for the next block's LayerNorm — the last double block's two streams into
// their rows of the first single block's. The same predictions, gradients and FP8 state as with
// every LayerNorm computing its own (FLUX8_FUSED_NORM_STATS=0): a statistic written to the wrong
// place, or one missing, would change them. Counted through the profiler: per forward of 2
// double and 2 single blocks, 9 of the 11 LayerNorms that compute only statistics get them from
// a residual (double block 0's LayerNorm 1 has the embedders before it), and the final layer's
// (a BF16 Linear) keeps its own pass; with full recomputation only the in-block LayerNorm 2.
// Each backward of a block that keeps its activations adds one plain gated residual a double
// block stream (x_mid recomputed, recompute_elementwise).
TEST(Fp8Training, GatedResidualsWriteTheNextLayerNormsStatistics) {
  struct EnvFlag {  // sets FLUX8_FUSED_NORM_STATS for the scope
    explicit EnvFlag(const char* v) { ::setenv("FLUX8_FUSED_NORM_STATS", v, 1); }
    ~EnvFlag() { ::unsetenv("FLUX8_FUSED_NORM_STATS"); }
  };
  auto cpu = make_backend("cpu");
  const FluxConfig cfg = testing::odd_config(2, 2, false);
  Fp8Config fp8;
  fp8.enabled = fp8.hybrid = true;
  fp8.recipe = Fp8Recipe::delayed;
  for (const Recompute rc : {Recompute::none, Recompute::selective, Recompute::full}) {
    SCOPED_TRACE(::testing::Message() << "recompute " << static_cast<int>(rc));
    const testing::ModelRunOptions o{.fp8 = &fp8, .recompute = rc, .steps = 2, .optimizer = true};
    std::map<std::string, int64_t> calls[2];
    testing::ModelRun runs[2];
    for (const int fused : {0, 1}) {
      const EnvFlag flag(fused ? "1" : "0");
      OpProfiler prof(*cpu);
      runs[fused] = testing::run_model(*cpu, cfg, o);
      cpu->synchronize();
      for (const OpProfiler::Row& r : prof.rows()) calls[fused][r.op] = r.calls;
    }
    EXPECT_EQ(runs[1].pred, runs[0].pred);
    ASSERT_EQ(runs[1].grads.size(), runs[0].grads.size());
    for (size_t i = 0; i < runs[0].grads.size(); ++i)
      EXPECT_EQ(runs[1].grads[i].second, runs[0].grads[i].second) << runs[0].grads[i].first;
    EXPECT_EQ(runs[1].scales, runs[0].scales);
    EXPECT_EQ(runs[1].history, runs[0].history);

    const int64_t recomputed_x_mid = rc == Recompute::full ? 0 : 2 * 2 * o.steps;
    const int64_t ln_off = calls[0]["layernorm_modulate"], residuals = calls[0]["gated_residual"] - recomputed_x_mid;
    ASSERT_GT(ln_off, 0);
    EXPECT_EQ(calls[0]["gated_residual_stats"], 0) << "FLUX8_FUSED_NORM_STATS=0: none";
    EXPECT_EQ(residuals % 10, 0) << "10 gated residuals a forward";
    const int64_t forwards = residuals / 10, handed = rc == Recompute::full ? 4 : 9;
    EXPECT_EQ(calls[1]["gated_residual_stats"], handed * forwards);
    EXPECT_EQ(calls[1]["gated_residual"], (10 - handed) * forwards + recomputed_x_mid);
    // Each LayerNorm handed statistics skips its pass; the last double block's two streams
    // hand one LayerNorm its statistics together.
    const int64_t skipped = rc == Recompute::full ? 4 : 8;
    EXPECT_EQ(calls[1]["layernorm_modulate"], ln_off - skipped * forwards);
  }
}

TEST(Fp8Config, FirstLastLayersSelectBlocks) {
  Fp8Config c;
  c.enabled = true;
  c.first_last_bf16 = true;
  c.bf16_start = 1;
  c.bf16_end = 2;
  std::vector<bool> in;
  for (int i = 0; i < 5; ++i) in.push_back(c.block_in_fp8(i, 5));
  EXPECT_EQ(in, (std::vector<bool>{false, true, true, false, false}));
  c.first_last_bf16 = false;
  EXPECT_TRUE(c.block_in_fp8(0, 5));
}

std::string config_error(const std::vector<std::string>& sets) {
  try {
    Fp8Config::from_config(Config::load(std::string(FLUX8_SOURCE_DIR) + "/configs/demo.yaml", sets));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// fp8_fprop_fast_accumulation: on by default where the GEMMs have per-tensor scales (delayed,
// tensorwise), off for the block-scaled recipes, where asking for it has no effect (a warning);
// the log line says which summation the forward GEMMs use.
TEST(Fp8Config, FpropFastAccumulationFollowsTheRecipe) {
  auto resolve = [](std::vector<std::string> sets) {
    return Fp8Config::from_config(Config::load(std::string(FLUX8_SOURCE_DIR) + "/configs/demo.yaml", sets));
  };
  for (const char* recipe : {"delayed", "tensorwise"}) {
    const std::string r = std::string("fp8_recipe=") + recipe;
    const Fp8Config on = resolve({"fp8=hybrid", r});
    EXPECT_TRUE(on.fprop_fast_accumulation) << recipe;
    EXPECT_NE(on.describe().find("forward GEMMs with fast accumulation"), std::string::npos) << on.describe();
    const Fp8Config off = resolve({"fp8=hybrid", r, "fp8_fprop_fast_accumulation=false"});
    EXPECT_FALSE(off.fprop_fast_accumulation) << recipe;
    EXPECT_NE(off.describe().find("forward GEMMs in fp32 accumulation"), std::string::npos) << off.describe();
  }
  for (const char* recipe : {"blockwise", "mxfp8"}) {
    const std::string r = std::string("fp8_recipe=") + recipe;
    const Fp8Config f = resolve({"fp8=e4m3", r});
    EXPECT_FALSE(f.fprop_fast_accumulation) << recipe;
    EXPECT_EQ(f.describe().find("accumulation"), std::string::npos) << f.describe();
    EXPECT_FALSE(resolve({"fp8=e4m3", r, "fp8_fprop_fast_accumulation=false"}).fprop_fast_accumulation);
    const Fp8Config asked = resolve({"fp8=e4m3", r, "fp8_fprop_fast_accumulation=true"});
    EXPECT_FALSE(asked.fprop_fast_accumulation);
    ASSERT_EQ(asked.warnings.size(), 1u) << recipe;
    EXPECT_NE(asked.warnings[0].find("fp8_fprop_fast_accumulation (--set) has no effect: it applies to the per-tensor "
                                     "recipes"),
              std::string::npos)
        << asked.warnings[0];
  }
  EXPECT_NE(config_error({"fp8_fprop_fast_accumulation=false"}).find("but fp8 is none"), std::string::npos);
}

TEST(Fp8Config, ImpossibleCombinationsNameTheKeys) {
  EXPECT_NE(config_error({"fp8_recipe=blockwise"}).find("fp8_recipe (--set) is set but fp8 is none"),
            std::string::npos);
  EXPECT_EQ(config_error({"fp8=hybrid", "fp8_dot_product_attention=true"}), "");
  EXPECT_NE(config_error({"fp8=e4m3", "fp8_dot_product_attention=true"}).find("needs fp8: hybrid"), std::string::npos);
  EXPECT_NE(config_error({"fp8=hybrid", "fp8_recipe=tensorwise", "fp8_dot_product_attention=true"})
                .find("needs fp8_recipe: delayed"),
            std::string::npos);
  EXPECT_NE(config_error({"fp8=hybrid", "fp8_multi_head_attention=true"}).find("fp8_multi_head_attention (--set)"),
            std::string::npos);
  EXPECT_NE(config_error({"fp8_dot_product_attention=true"}).find("but fp8 is none"), std::string::npos);
  for (const char* recipe : {"delayed", "tensorwise"})
    EXPECT_EQ(config_error({"fp8=hybrid", std::string("fp8_recipe=") + recipe, "fp8_weight_transpose=in_backward"}),
              "");
  for (const char* recipe : {"blockwise", "mxfp8"})
    EXPECT_NE(
        config_error({"fp8=hybrid", std::string("fp8_recipe=") + recipe, "fp8_weight_transpose=in_backward"})
            .find("fp8_weight_transpose (--set) needs a per-tensor recipe (delayed, tensorwise), but the recipe is"),
        std::string::npos)
        << recipe;
  EXPECT_NE(config_error({"fp8_weight_transpose=in_backward"}).find("but fp8 is none"), std::string::npos);
  // Keys of another recipe have no effect: warnings, not errors (docs/CONFIG.md).
  EXPECT_EQ(config_error({"fp8=e4m3", "fp8_recipe=mxfp8", "fp8_margin=2"}), "");
  EXPECT_EQ(config_error({"fp8=e4m3", "fp8_scale_rounding=power_of_2"}), "");
  EXPECT_NE(config_error({"fp8=e4m3", "num_layers_at_end_in_bf16=2"}).find("first_last_layers_bf16: true"),
            std::string::npos);
  EXPECT_EQ(config_error({"fp8=hybrid", "fp8_recipe=blockwise", "first_last_layers_bf16=true"}), "");
  // Megatron's `fp8: null` means off.
  EXPECT_FALSE(
      Fp8Config::from_config(Config::load(std::string(FLUX8_SOURCE_DIR) + "/configs/demo.yaml", {"fp8=null"})).enabled);
}

}  // namespace
}  // namespace flux8

namespace flux8 {
namespace {

// The FP8 health report warns when a tensor's casts flush more than fp8_underflow_warning of its
// non-zero values, in the log (naming the tensor and the remedy for the run's recipe) and in the
// fp8 record's "warnings"; a threshold of 0 never warns.
TEST(Fp8Training, UnderflowPastTheThresholdWarnsWithTheRemedy) {
  const testing::RunDir dir("fp8_warn");
  auto fp8_records = [&](const char* run) {
    std::vector<nlohmann::json> out;
    std::ifstream in(dir.root / run / "metrics.jsonl");
    for (std::string line; std::getline(in, line);)
      if (auto j = nlohmann::json::parse(line); j.value("kind", "") == "fp8") out.push_back(j);
    return out;
  };
  // E4M3 gradients under delayed scaling with the max of a long history: gradients flush first.
  const std::string fp8 = " --set fp8=e4m3 --set fp8_recipe=delayed --set fp8_stats_interval=1";
  auto train = [&](const char* run, const std::string& extra, std::string* log) {
    return testing::run_flux8(
        "train -c " + (dir.root / "exp.yaml").string() + " --set save_dir=" + (dir.root / run).string() + fp8 + extra,
        (dir.root / (std::string(run) + ".log")).string(), log);
  };
  std::string log;
  ASSERT_EQ(0, train("warn", " --set fp8_underflow_warning=1e-9 --set fp8_saturation_warning=0", &log)) << log;
  EXPECT_NE(log.find("warning: FP8 health at step "), std::string::npos) << log;
  EXPECT_NE(log.find("underflow above 1e-07%"), std::string::npos) << log;
  EXPECT_NE(log.find("grad_output"), std::string::npos) << log;
  EXPECT_NE(log.find("fp8: hybrid"), std::string::npos) << log;
  EXPECT_NE(log.find("fp8_amax_compute_algo: most_recent"), std::string::npos) << log;
  const std::vector<nlohmann::json> warned = fp8_records("warn");
  ASSERT_EQ(warned.size(), 6u);
  int with_warnings = 0;
  for (const nlohmann::json& r : warned) {
    with_warnings += !r["warnings"].empty();
    for (const nlohmann::json& w : r["warnings"]) {
      EXPECT_EQ(w["kind"], "underflow");
      EXPECT_GT(w["fraction"].get<double>(), 1e-9);
      EXPECT_EQ(w["threshold"].get<double>(), 1e-9);
    }
  }
  EXPECT_GT(with_warnings, 0);
  ASSERT_EQ(0, train("quiet", " --set fp8_underflow_warning=0 --set fp8_saturation_warning=0", &log)) << log;
  EXPECT_EQ(log.find("warning: FP8 health"), std::string::npos) << log;
  for (const nlohmann::json& r : fp8_records("quiet")) EXPECT_TRUE(r["warnings"].empty()) << r.dump();
}

}  // namespace
}  // namespace flux8
