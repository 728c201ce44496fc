// The configs of the user guide load as written (tests/fixtures/guide): its three FP8 tuning
// profiles, its out-of-memory advice, the Megatron key names it uses with Megatron's meaning, a
// Primus experiment file; the Primus-Turbo environment names; and the out-of-memory advice.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>
#include <vector>

#include "backend/gemm_environment.h"
#include "bench/memory_advice.h"
#include "config/config.h"
#include "core/environment.h"
#include "core/error.h"
#include "test_util.h"
#include "train/train_config.h"

namespace flux8::testing {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string fixture(const std::string& name) { return std::string(FLUX8_SOURCE_DIR) + "/tests/fixtures/guide/" + name; }

TrainConfig load_fixture(const std::string& name, const std::vector<std::string>& sets = {}) {
  return TrainConfig::from_config(Config::load(fixture(name), sets));
}

bool warns_about(const TrainConfig& t, const std::string& text) {
  for (const std::string& w : t.warnings)
    if (w.find(text) != std::string::npos) return true;
  return false;
}

TEST(GuideConfigs, TheThreeFp8ProfilesLoad) {
  const TrainConfig conservative = load_fixture("profile_conservative.yaml");
  EXPECT_EQ(conservative.fp8.recipe, Fp8Recipe::delayed);
  EXPECT_EQ(conservative.fp8.amax_history_len, 2048);
  EXPECT_TRUE(conservative.fp8.amax_max);
  EXPECT_FALSE(conservative.fp8.wgrad);
  EXPECT_TRUE(conservative.warnings.empty());

  const TrainConfig balanced = load_fixture("profile_balanced.yaml");
  EXPECT_EQ(balanced.fp8.recipe, Fp8Recipe::delayed);
  EXPECT_EQ(balanced.fp8.amax_history_len, 1024);
  EXPECT_FALSE(balanced.fp8.amax_max);
  EXPECT_TRUE(balanced.fp8.wgrad);
  EXPECT_TRUE(balanced.warnings.empty());

  // Tensorwise: the amax settings have no effect; each is a warning naming the key and why, and
  // the run is the one without them.
  const TrainConfig aggressive = load_fixture("profile_aggressive.yaml");
  EXPECT_EQ(aggressive.fp8.recipe, Fp8Recipe::tensorwise);
  EXPECT_TRUE(aggressive.fp8.wgrad);
  EXPECT_EQ(aggressive.fp8.amax_history_len, Fp8Config{}.amax_history_len);
  EXPECT_EQ(aggressive.fp8.amax_max, Fp8Config{}.amax_max);
  ASSERT_EQ(aggressive.warnings.size(), 2u);
  expect_mentions(aggressive.warnings[0], {"fp8_amax_history_len", "profile_aggressive.yaml:6", "has no effect",
                                           "delayed only", "tensorwise", "current step"});
  expect_mentions(aggressive.warnings[1], {"fp8_amax_compute_algo", "has no effect"});
}

// Settings of another recipe are warnings, not errors; FP8 keys without fp8 stay errors (the
// run would silently train in BF16).
TEST(GuideConfigs, KeysWithoutEffectUnderTheRecipeWarn) {
  for (const char* recipe : {"blockwise", "mxfp8"}) {
    const TrainConfig t = load_fixture("profile_balanced.yaml", {std::string("fp8_recipe=") + recipe, "fp8_margin=1"});
    EXPECT_TRUE(warns_about(t, "fp8_margin (--set) has no effect")) << recipe;
    EXPECT_EQ(t.fp8.margin, 0);
  }
  const TrainConfig rounding = load_fixture("profile_balanced.yaml", {"fp8_scale_rounding=power_of_2"});
  EXPECT_TRUE(warns_about(rounding, "fp8_scale_rounding (--set) has no effect"));
  EXPECT_FALSE(rounding.fp8.power_of_2_scales);
  const TrainConfig fast =
      load_fixture("profile_balanced.yaml", {"fp8_recipe=blockwise", "fp8_fprop_fast_accumulation=true"});
  EXPECT_TRUE(warns_about(fast, "fp8_fprop_fast_accumulation (--set) has no effect"));
  EXPECT_FALSE(fast.fp8.fprop_fast_accumulation);
  expect_mentions(error_of([] { load_fixture("profile_balanced.yaml", {"fp8=none"}); }), {"but fp8 is none"});
}

TEST(GuideConfigs, OutOfMemoryAdviceConfigsLoad) {
  const TrainConfig block = load_fixture("oom_recompute.yaml");
  EXPECT_EQ(block.recompute, (RecomputePolicy{Recompute::selective, 2}));
  EXPECT_TRUE(block.recompute.elementwise) << "recompute_elementwise is on by default";
  EXPECT_TRUE(block.warnings.empty());
  const TrainConfig keep = load_fixture("oom_recompute.yaml", {"recompute_elementwise=false"});
  EXPECT_EQ(keep.recompute, (RecomputePolicy{Recompute::selective, 2, false}));
  const TrainConfig tp = load_fixture("oom_tensor_parallel.yaml");
  EXPECT_EQ(tp.tensor_parallel, 4);
}

TEST(GuideConfigs, MegatronKeysTakeMegatronsMeaning) {
  const Config cfg = Config::load(fixture("megatron_keys.yaml"));
  const TrainConfig t = TrainConfig::from_config(cfg);
  EXPECT_EQ(t.adam.moment_dtype, DType::bf16);               // exp_avg_dtype / exp_avg_sq_dtype
  EXPECT_EQ(t.recompute, RecomputePolicy{Recompute::full});  // uniform groups of 1: every block
  EXPECT_TRUE(t.log_timers_to_tensorboard);
  EXPECT_EQ(t.tensorboard_dir, "runs/guide/tensorboard");
  EXPECT_TRUE(t.warnings.empty());
  // The resolved config holds the value under flux8's key, the alias in its provenance, and
  // loads back to the same values.
  const std::string dump = cfg.dump();
  expect_mentions(dump, {"adam_moment_precision: bf16  # " + fixture("megatron_keys.yaml") + ":5 (exp_avg_sq_dtype)"});
  EXPECT_EQ(dump.find("exp_avg_dtype"), std::string::npos) << dump;
  const Config again = Config::load_text(dump, "dump.yaml");
  for (const KeySpec& k : config_keys())
    if (!find_key_alias(k.name)) EXPECT_EQ(again.get(k.name), cfg.get(k.name)) << k.name;
}

TEST(GuideConfigs, MegatronKeysRefuseWhatFlux8CannotDo) {
  expect_mentions(error_of([] { Config::load(fixture("megatron_keys.yaml"), {"optimizer=sgd"}); }),
                  {"optimizer in --set must be one of: adamw, adam", "'sgd'"});
  EXPECT_EQ(load_fixture("megatron_keys.yaml", {"optimizer=adam"}).adam.moment_dtype, DType::bf16);
  expect_mentions(error_of([] { Config::load(fixture("megatron_keys.yaml"), {"exp_avg_sq_dtype=fp32"}); }),
                  {"exp_avg_dtype is bf16", "megatron_keys.yaml:4", "exp_avg_sq_dtype is fp32 (--set)",
                   "adam_moment_precision", "same value"});
  expect_mentions(error_of([] { Config::load(fixture("megatron_keys.yaml"), {"exp_avg_dtype=fp16"}); }),
                  {"exp_avg_dtype in --set must be one of: fp32, bf16"});
  // seq_length: the sum it states or an error naming the keys to set instead.
  expect_mentions(error_of([] { load_fixture("megatron_keys.yaml", {"seq_length=4096"}); }),
                  {"seq_length is 4096 (--set)", "text_seq_len 8", "256 image tokens", "image_size 32", "= 264",
                   "set text_seq_len and image_size"});
  // recompute_method needs recompute_num_layers, and does nothing without a granularity.
  expect_mentions(error_of([] { load_fixture("megatron_keys.yaml", {"recompute_num_layers=0"}); }),
                  {"recompute_method", "uniform", "recompute_num_layers is not set"});
  EXPECT_TRUE(warns_about(load_fixture("megatron_keys.yaml", {"recompute_granularity=none"}),
                          "megatron_keys.yaml:7) has no effect: recompute_granularity is none (--set)"));
  const TrainConfig groups = load_fixture("megatron_keys.yaml", {"recompute_num_layers=3"});
  EXPECT_EQ(groups.recompute, RecomputePolicy{Recompute::full});
  EXPECT_TRUE(warns_about(groups, "not one per group of 3"));
  EXPECT_TRUE(warns_about(load_fixture("profile_balanced.yaml", {"recompute_num_layers=2"}),
                          "recompute_num_layers (--set) has no effect"));
}

TEST(GuideConfigs, PrimusExperimentLoadsWithOneWarning) {
  ::unsetenv("FLUX8_TEST_PRIMUS_ITERS");
  const Config cfg = Config::load(fixture("primus_experiment.yaml"));
  EXPECT_EQ(cfg.get_int("hidden_size"), 96);              // modules.pre_trainer.model
  EXPECT_EQ(cfg.get_string("lr_decay_style"), "linear");  // extends:
  EXPECT_EQ(cfg.get_int("train_iters"), 40);              // ${FLUX8_TEST_PRIMUS_ITERS:40}
  EXPECT_EQ(cfg.get_int("micro_batch_size"), 8);
  EXPECT_EQ(cfg.get_string("adam_moment_precision"), "bf16");
  ASSERT_EQ(cfg.warnings().size(), 1u);
  expect_mentions(
      cfg.warnings()[0],
      {"primus_experiment.yaml: Primus experiment: 11 keys with no flux8 meaning, not used:", "work_group", "user_name",
       "exp_name", "workspace", "modules.pre_trainer.framework", "modules.pre_trainer.config",
       "modules.pre_trainer.overrides.stderr_sink_level", "modules.pre_trainer.overrides.log_avg_skip_iterations",
       "modules.pre_trainer.overrides.mock_data", "modules.pre_trainer.overrides.ckpt_format",
       "overrides.lr_decay_iters: null (flux8's default kept)"});
  const TrainConfig t = TrainConfig::from_config(cfg);
  EXPECT_EQ(t.recompute, (RecomputePolicy{Recompute::full, 1}));
  EXPECT_EQ(t.warnings.size(), 1u);
  ::setenv("FLUX8_TEST_PRIMUS_ITERS", "7", 1);
  EXPECT_EQ(Config::load(fixture("primus_experiment.yaml")).get_int("train_iters"), 7);
  ::setenv("FLUX8_TEST_PRIMUS_ITERS", "", 1);  // empty: the default
  EXPECT_EQ(Config::load(fixture("primus_experiment.yaml")).get_int("train_iters"), 40);
  ::unsetenv("FLUX8_TEST_PRIMUS_ITERS");
}

// --from-primus: a flux8 config that, written next to the experiment, loads to the same values.
TEST(GuideConfigs, PrimusExperimentConvertsToAFlux8Config) {
  const std::string yaml = convert_primus_experiment(fixture("primus_experiment.yaml"));
  expect_mentions(yaml, {"# left out, no flux8 meaning: work_group", "include:", "  - primus_base.yaml",
                         "  - ../../../configs/models/flux_tiny_demo.yaml", "train_iters: 40", "optimizer: adam",
                         "exp_avg_dtype: bf16"});
  const Config converted = Config::load_text(yaml, fixture("converted.yaml"));
  const Config direct = Config::load(fixture("primus_experiment.yaml"));
  for (const KeySpec& k : config_keys()) EXPECT_EQ(converted.get(k.name), direct.get(k.name)) << k.name;
  EXPECT_TRUE(converted.warnings().empty());
  expect_mentions(error_of([] { convert_primus_experiment(fixture("profile_balanced.yaml")); }),
                  {"is not a Primus experiment"});
}

TEST(GuideConfigs, PrimusTurboEnvironmentNamesAreAliases) {
  ::unsetenv("FLUX8_GEMM_BACKEND");
  ::setenv("PRIMUS_TURBO_GEMM_BACKEND", "HIPBLASLT", 1);
  EXPECT_EQ(fp8_gemm_backend_from_environment(), Fp8GemmBackend::cublaslt);
  ::setenv("FLUX8_GEMM_BACKEND", "emulated", 1);  // flux8's name wins
  EXPECT_EQ(fp8_gemm_backend_from_environment(), Fp8GemmBackend::emulated);
  ::setenv("FLUX8_GEMM_BACKEND", "", 1);  // empty: unset, so the alias counts
  EXPECT_EQ(fp8_gemm_backend_from_environment(), Fp8GemmBackend::cublaslt);
  ::setenv("PRIMUS_TURBO_GEMM_BACKEND", "CK", 1);
  const std::string bad = error_of([] { fp8_gemm_backend_from_environment(); });
  expect_mentions(bad, {"PRIMUS_TURBO_GEMM_BACKEND=CK", "auto, cublaslt"});
  ::unsetenv("PRIMUS_TURBO_GEMM_BACKEND");
  ::unsetenv("FLUX8_GEMM_BACKEND");
  EXPECT_EQ(fp8_gemm_backend_from_environment(), Fp8GemmBackend::automatic);

  ::unsetenv("FLUX8_GEMM_AUTOTUNE");
  ::setenv("PRIMUS_TURBO_AUTO_TUNE", "1", 1);
  EXPECT_TRUE(gemm_autotune_from_environment());
  ::setenv("FLUX8_GEMM_AUTOTUNE", "0", 1);
  EXPECT_FALSE(gemm_autotune_from_environment());
  EXPECT_EQ(environment_setting("FLUX8_GEMM_AUTOTUNE", "PRIMUS_TURBO_AUTO_TUNE").name, "FLUX8_GEMM_AUTOTUNE");
  ::unsetenv("FLUX8_GEMM_AUTOTUNE");
  ::setenv("PRIMUS_TURBO_AUTO_TUNE", "", 1);
  EXPECT_FALSE(gemm_autotune_from_environment());
  EXPECT_EQ(environment_setting("FLUX8_GEMM_AUTOTUNE", "PRIMUS_TURBO_AUTO_TUNE").name, "");
  ::unsetenv("PRIMUS_TURBO_AUTO_TUNE");
}

// The advice of an out-of-memory error: each setting with the saving `flux8 info`'s plan gives
// it, largest first, and which ones alone fit the device. (f32 gradients and moments, so that
// their bf16 defaults are advised too.)
TEST(MemoryAdvice, ListsTheSettingsThatFitWithTheirPlannedSaving) {
  const std::string schnell = std::string(FLUX8_SOURCE_DIR) + "/configs/models/flux_12b_schnell.yaml";
  for (const MemoryKnob& k : memory_advice(Config::load(schnell, {"image_size=1024"}), ParallelShape{}).knobs)
    EXPECT_EQ(k.setting.find("_precision: bf16"), std::string::npos) << "advised a default: " << k.setting;
  Config cfg = Config::load(
      schnell, {"image_size=1024", "micro_batch_size=2", "grad_precision=f32", "adam_moment_precision=f32"});
  const ParallelShape one;
  const MemoryPlan plan = MemoryPlan::of(cfg, one);
  const MemoryAdvice a = memory_advice(cfg, one);
  EXPECT_DOUBLE_EQ(a.peak, plan.peak(Recompute::none));
  auto knob = [&](const std::string& setting) -> const MemoryKnob* {
    for (const MemoryKnob& k : a.knobs)
      if (k.setting == setting) return &k;
    ADD_FAILURE() << "no advice '" << setting << "'";
    return nullptr;
  };
  // recompute_elementwise (the default) keeps no more than selective does: no advice to use it.
  for (const MemoryKnob& k : a.knobs) EXPECT_NE(k.setting, "recompute_granularity: selective");
  {
    Config keep_all = cfg;
    keep_all.set("recompute_elementwise", "false");
    const MemoryPlan p = MemoryPlan::of(keep_all, one);
    const MemoryAdvice b = memory_advice(keep_all, one);
    auto saving = [&](const std::string& setting) {
      for (const MemoryKnob& k : b.knobs)
        if (k.setting == setting) return k.saving;
      ADD_FAILURE() << "no advice '" << setting << "' with recompute_elementwise: false";
      return 0.0;
    };
    EXPECT_DOUBLE_EQ(saving("recompute_granularity: selective"),
                     p.peak(Recompute::none) - p.peak(Recompute::selective));
    EXPECT_DOUBLE_EQ(saving("recompute_elementwise: true"), p.peak(Recompute::none) - plan.peak(Recompute::none));
  }
  if (const MemoryKnob* k = knob("recompute_granularity: full"))
    EXPECT_DOUBLE_EQ(k->saving, plan.peak(Recompute::none) - plan.peak(Recompute::full));
  Config bf16 = cfg;
  bf16.set("grad_precision", "bf16");
  if (const MemoryKnob* k = knob("grad_precision: bf16"))
    EXPECT_DOUBLE_EQ(k->saving, plan.peak(Recompute::none) - MemoryPlan::of(bf16, one).peak(Recompute::none));
  knob("adam_moment_precision: bf16");
  Config offloaded = cfg;
  offloaded.set("optimizer_offload", "cpu");
  if (const MemoryKnob* k = knob("optimizer_offload: cpu"))
    EXPECT_DOUBLE_EQ(k->saving, plan.peak(Recompute::none) - MemoryPlan::of(offloaded, one).peak(Recompute::none));
  knob("micro_batch_size: 1");
  if (const MemoryKnob* k = knob("tensor_model_parallel_size: 2")) EXPECT_EQ(k->note, "on 2 GPUs");
  // The deterministic attention backward's dP (2 x 24 heads x 4,352^2 bf16: 1.69 GiB; by default
  // in 2 calls of 24 heads, 0.85 GiB) in calls of 6 heads (217 MiB each).
  Config bounded = cfg;
  bounded.set("deterministic_attention_workspace_mib", "256");
  if (const MemoryKnob* k = knob("deterministic_attention_workspace_mib: 256")) {
    EXPECT_DOUBLE_EQ(k->saving, plan.peak(Recompute::none) - MemoryPlan::of(bounded, one).peak(Recompute::none));
    EXPECT_DOUBLE_EQ(k->saving, 2.0 * 4352 * 4352 * (24 - 6));
  }
  for (const MemoryKnob& k : memory_advice(bounded, one).knobs)
    EXPECT_EQ(k.setting.find("deterministic_attention_workspace_mib"), std::string::npos) << "advised again";
  for (const MemoryKnob& k : a.knobs) EXPECT_NE(k.setting, "optimizer_offload_overlap: false");  // nothing offloaded
  {
    // Offloaded and overlapped: one chunk's buffers instead of two are advised, with their bytes.
    Config overlapped = offloaded;
    overlapped.set("optimizer_offload_overlap", "true");
    const MemoryAdvice o = memory_advice(overlapped, one);
    Config single = offloaded;
    single.set("optimizer_offload_overlap", "false");
    bool advised = false;
    for (const MemoryKnob& k : o.knobs)
      if (k.setting == "optimizer_offload_overlap: false") {
        advised = true;
        EXPECT_DOUBLE_EQ(k.saving, o.peak - MemoryPlan::of(single, one).peak(Recompute::none));
        EXPECT_GT(k.saving, 0.0);
      }
    EXPECT_TRUE(advised);
  }
  for (size_t i = 1; i < a.knobs.size(); ++i) EXPECT_GE(a.knobs[i - 1].saving, a.knobs[i].saving);

  // A device just above the peak with full recomputation; the failed allocation lacked 1 GiB.
  const AllocationFailure failure{3.0 * kGiB, 2.0 * kGiB, plan.peak(Recompute::full) + 1.0};
  const std::string text = describe_memory_advice(a, failure, "run.yaml", one);
  expect_mentions(text, {"planned peak of one GPU with these settings", "the failed allocation lacked 1.00 GiB",
                         "recompute_granularity: full", "flux8 info -c run.yaml --tp 1 --dp 1"});
  size_t fits = 0;
  for (size_t p = text.find("  fits"); p != std::string::npos; p = text.find("  fits", p + 1)) ++fits;
  size_t expected = 0;
  for (const MemoryKnob& k : a.knobs) expected += k.peak <= failure.total && k.saving >= kGiB ? 1 : 0;
  EXPECT_EQ(fits, expected);
  EXPECT_GE(expected, 1u);
  // Each test only where the device told: a saving below the shortfall never fits; with nothing
  // known, nothing is said to fit.
  const MemoryKnob small{"x", "", 0.5 * kGiB, 0};
  EXPECT_FALSE(knob_fits(small, failure));
  EXPECT_TRUE(knob_fits(small, AllocationFailure{1.0 * kGiB, 0.75 * kGiB, 0}));
  EXPECT_FALSE(knob_fits(small, AllocationFailure{}));
  EXPECT_EQ(describe_memory_advice(a, AllocationFailure{}, "run.yaml", one).find("fits"), std::string::npos);

  // Settings already taken are not advised again; with several data-parallel ranks twice the
  // tensor parallelism stays on the same GPUs, and the distributed optimizer is advised only
  // where it lowers the peak (a checkpoint save gathers the whole moments on every rank).
  cfg.set("recompute_granularity", "full");
  cfg.set("grad_precision", "bf16");
  const ParallelShape eight{1, 8, false};
  const MemoryAdvice b = memory_advice(cfg, eight);
  for (const MemoryKnob& k : b.knobs) {
    EXPECT_EQ(k.setting.find("recompute_granularity"), std::string::npos) << k.setting;
    EXPECT_NE(k.setting, "grad_precision: bf16");
    if (k.setting == "tensor_model_parallel_size: 2") EXPECT_EQ(k.note, "");
  }
  Config zero_cfg = cfg;
  zero_cfg.set("use_distributed_optimizer", "true");
  const double zero_peak = MemoryPlan::of(zero_cfg, ParallelShape{1, 8, true}).peak(Recompute::full);
  bool zero = false;
  for (const MemoryKnob& k : b.knobs) zero = zero || k.setting == "use_distributed_optimizer: true";
  EXPECT_EQ(zero, zero_peak < b.peak);

  // Under tensor parallelism the moments may go to host memory, the master weights may not.
  const ParallelShape tp2{2, 1, false};
  const MemoryAdvice c = memory_advice(cfg, tp2);
  bool moments = false, cpu = false;
  for (const MemoryKnob& k : c.knobs) {
    moments = moments || k.setting == "optimizer_offload: moments";
    cpu = cpu || k.setting == "optimizer_offload: cpu";
  }
  EXPECT_TRUE(moments);
  EXPECT_FALSE(cpu);
}

}  // namespace
}  // namespace flux8::testing
