// The training loop end to end on a tiny demo model: gradient accumulation equivalence (FP8
// amax staging over micro-batches too) and bit-exact resume after an interruption.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/step_graph.h"
#include "backend/transfer.h"
#include "bench/op_profiler.h"
#include "config/config.h"
#include "data/demo.h"
#include "fp8/fp8_config.h"
#include "io/safetensors.h"
#include "model/flops.h"
#include "model_test_util.h"
#include "test_util.h"
#include "train/optimizer.h"
#include "train/train_step.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace flux8 {
namespace {

namespace fs = std::filesystem;

using testing::tiny_demo_model;

using testing::demo_batch;
using testing::zero_prompt;

TEST(TrainStep, GradientAccumulationMatchesOneBigBatch) {
  // 4 micro-batches of 8 give the gradient of one batch of 32: same samples, same noise
  // (keyed by the sample's position in the global batch), each micro-batch's loss gradient
  // scaled by 8/32. In f64 the two differ only by summation order (~1e-15); in f32 by f32
  // rounding of the accumulation (~1e-6).
  const FluxConfig cfg = tiny_demo_model();
  const std::vector<Sample> samples = demo_batch(cfg, 32);
  const ObjectiveConfig obj;
  const EmptyPrompt empty = zero_prompt(cfg);
  for (const auto [dtype, tol] : {std::pair{DType::f64, 1e-12}, std::pair{DType::f32, 1e-5}}) {
    auto be = make_backend("cpu");
    FluxModel model(cfg, *be, dtype);
    testing::randomize_params(model.params(), 3);
    StepBuffers buf(*be, dtype);
    const StepContext ctx{model, cfg, obj, empty, buf, 77};
    const StepLoss one = accumulate_step_gradients(ctx, samples, 32, 5);
    const std::vector<double> g1 = to_host(*be, model.params().flat_grads());
    const StepLoss four = accumulate_step_gradients(ctx, samples, 8, 5);
    const std::vector<double> g4 = to_host(*be, model.params().flat_grads());
    EXPECT_NEAR(one.loss, four.loss, tol * one.loss);
    EXPECT_EQ(one.tokens, four.tokens);
    EXPECT_LT(testing::max_rel_error(g4, g1), tol) << dtype_name(dtype);
  }
}

// FP8 (delayed, hybrid, FP8 attention) over micro-batches: every cast of the step maxes its
// amax into the staging row, the attention's too (its amaxes come out of the kernels and are
// max-accumulated, not overwritten), so 4 micro-batches of 8 stage the amaxes of one batch of
// 32 — each sample's activations and gradients are the same values either way (the step's
// scales, per-sample attention, gradients scaled by 8/32 per micro-batch) up to the f32
// rounding of GEMMs over 8 instead of 32 rows (measured 6.8e-7). Overwriting instead of
// maxing the attention's amaxes put o's, dS's and the gradients' off by 10-60%.
TEST(TrainStep, Fp8AmaxesOverMicroBatchesEqualOneBigBatch) {
  const FluxConfig cfg = tiny_demo_model();
  const std::vector<Sample> samples = demo_batch(cfg, 32);
  const ObjectiveConfig obj;
  const EmptyPrompt empty = zero_prompt(cfg);
  const Fp8Config fp8 = testing::delayed_hybrid_fp8(true);
  auto staged = [&](int64_t micro_batch) {
    auto be = make_backend("cpu");
    FluxModel model(cfg, *be, DType::f32, &fp8);
    testing::randomize_params(model.params(), 3);
    StepBuffers buf(*be, DType::f32);
    const StepContext ctx{model, cfg, obj, empty, buf, 77};
    accumulate_step_gradients(ctx, samples, micro_batch, 5);
    const Fp8MetaRegistry& reg = model.fp8()->registry();
    std::vector<std::pair<std::string, float>> row0;
    for (int s = 0; s < reg.size(); ++s) row0.push_back({reg.name(s), reg.history_at(0, s)});
    return row0;
  };
  const auto one = staged(32), four = staged(8);
  ASSERT_EQ(one.size(), four.size());
  int attention_slots = 0;
  double worst = 0;
  for (size_t i = 0; i < one.size(); ++i) {
    const double e = std::fabs(four[i].second - one[i].second) / std::max(one[i].second, 1e-30f);
    EXPECT_LE(e, 1e-5) << one[i].first << ": " << four[i].second << " vs " << one[i].second;
    worst = std::max(worst, e);
    attention_slots += one[i].first.find(".attn.") != std::string::npos;
  }
  std::printf("worst relative difference of a staged amax: %.3g\n", worst);
  EXPECT_EQ(attention_slots, 2 * 9);  // one double and one single block
}

// The per-sample Linears' gradients kept as factors (ParamStore::keep_low_rank_grads) over 3
// micro-batches of 2: the norm, the update and the written-out gradients equal the dense run's
// up to the order of the wgrad GEMM's f32 sums; the flat buffer's own contents at those
// gradients (NaN here) are never read. With fewer rows kept than the step brings, the step
// falls back to dense gradients half-way — or at its first write, where one micro-batch
// brings more rows than kept.
// A backend that stores gradients in bf16 (Backend::gradient_dtype, the CUDA backend with
// grad_precision: bf16), here the CPU backend with that precision policy: the store's gradient
// buffer, its views and its per-step write tracking in 2-byte units, parameters in f32.
TEST(TrainStep, Bf16GradientBufferViewsAndWriteTracking) {
  struct Bf16Grads final : CpuBackend {
    Bf16Grads() : CpuBackend(BackendOptions{}) {}
    DType gradient_dtype(DType) const override { return DType::bf16; }
  };
  Bf16Grads be;
  const FluxConfig cfg = testing::odd_config(1, 1, false);
  ParamStore store(cfg, be, DType::f32);
  EXPECT_EQ(store.grad_dtype(), DType::bf16);
  EXPECT_EQ(store.flat_params().dtype, DType::f32);
  const Tensor flat = store.flat_grads();
  EXPECT_EQ(flat.dtype, DType::bf16);
  EXPECT_EQ(flat.numel(), store.layout().total());
  store.zero_grads();
  for (const ParamInfo& p : store.layout().params()) {
    const Tensor g = store.grad(p.name);
    EXPECT_EQ(g.dtype, DType::bf16);
    EXPECT_EQ(g.shape, p.shape);
    EXPECT_EQ(static_cast<const char*>(g.data) - static_cast<const char*>(flat.data), 2 * p.offset) << p.name;
    EXPECT_TRUE(store.first_write(g)) << p.name;
    EXPECT_FALSE(store.first_write(g)) << p.name;
  }
  store.finish_grads();  // every gradient claimed
  store.zero_grads();
  testing::expect_refused(store.layout().params().front().name, [&] { store.finish_grads(); });
  // A view that is not a whole parameter's gradient (one element in) is refused, named.
  Tensor inside = store.grad("img_in.weight");
  inside.data = static_cast<char*>(inside.data) + 2;
  testing::expect_refused("not a whole parameter gradient", [&] { store.first_write(inside); });
}

// The trainer's step with cuda_graph's recorder (StepGraph; on the CPU its twin replays each
// segment's first record): every micro-batch's forward, loss and backward a region, low-rank
// factors and FP8 delayed scaling on, four optimizer steps of 2 micro-batches — the losses, the
// gradient norms and the parameters equal the plain step's bit for bit, with segments replayed.
TEST(TrainStep, RecordedAndReplayedStepsEqualPlainOnes) {
  const FluxConfig cfg = tiny_demo_model();
  const std::vector<Sample> samples = demo_batch(cfg, 4);
  const ObjectiveConfig obj;
  const EmptyPrompt empty = zero_prompt(cfg);
  const Fp8Config fp8 = testing::delayed_hybrid_fp8();
  struct Run {
    std::vector<double> losses, norms, params;
    StepGraph::Stats graph;
  };
  const auto run = [&](bool graphed) {
    auto be = make_backend("cpu");
    // A segment per op: a signature that missed an argument would replay the wrong call.
    std::unique_ptr<StepGraph> graph =
        graphed ? std::make_unique<StepGraph>(*be, StepGraph::Options{.segment_ops = 1}) : nullptr;
    FluxModel model(cfg, *be, DType::f32, &fp8);
    testing::randomize_params(model.params(), 3);
    model.params().keep_low_rank_grads(4);
    AdamWOptimizer opt(model.params(), AdamWConfig{});
    StepBuffers buf(*be, DType::f32);
    const StepContext ctx{model, cfg, obj, empty, buf, 77, graph.get()};
    Run r;
    for (int step = 0; step < 4; ++step) {
      // As the trainer: FP8 telemetry on report steps only (here the third), whose counting casts
      // stay out of the replays.
      model.fp8()->set_collect_stats(step == 2);
      r.losses.push_back(accumulate_step_gradients(ctx, samples, 2, static_cast<uint64_t>(step)).loss);
      r.norms.push_back(apply_optimizer_step(model, opt, step + 1, 1e-3).grad_norm);
    }
    r.params = to_host(*be, model.params().flat_params());
    if (graph) r.graph = graph->stats();
    return r;
  };
  const Run plain = run(false), recorded = run(true);
  EXPECT_EQ(recorded.losses, plain.losses);
  EXPECT_EQ(recorded.norms, plain.norms);
  EXPECT_EQ(recorded.params, plain.params);
  // The first step records (and its weight casts at first use differ from later steps'), the
  // report step runs its casts eagerly: still over a third of all op calls were replays.
  const int64_t all = recorded.graph.ops_launched + recorded.graph.ops_eager;
  EXPECT_GT(3 * recorded.graph.ops_launched, all)
      << recorded.graph.ops_launched << " replayed, " << recorded.graph.ops_eager << " eager";
}

TEST(TrainStep, LowRankGradientsEqualDenseOnes) {
  const FluxConfig cfg = tiny_demo_model();
  const std::vector<Sample> samples = demo_batch(cfg, 6);
  const ObjectiveConfig obj;
  const EmptyPrompt empty = zero_prompt(cfg);
  struct Run {
    std::vector<double> grads, params;
    double norm = 0;
    size_t low_rank = 0;
  };
  int64_t per_sample = 0;
  // A named layout: a range-for over params() of a temporary reads it after it is destroyed.
  const ParamLayout layout = ParamLayout::build(cfg);
  for (const ParamInfo& p : layout.params()) per_sample += p.per_sample;
  const auto run = [&](int64_t keep, bool materialize) {
    auto be = make_backend("cpu");
    FluxModel model(cfg, *be, DType::f32);
    ParamStore& store = model.params();
    testing::randomize_params(store, 3);
    EXPECT_EQ(store.keep_low_rank_grads(keep), keep > 0);
    be->fill(store.flat_grads(), NAN);
    StepBuffers buf(*be, DType::f32);
    const StepContext ctx{model, cfg, obj, empty, buf, 77};
    accumulate_step_gradients(ctx, samples, 2, 5);
    Run r;
    const std::vector<Backend::LowRankGrad> lr = store.low_rank_grads();
    r.low_rank = lr.size();
    for (const Backend::LowRankGrad& g : lr) EXPECT_EQ(g.a.shape[0], 6);
    r.norm = be->gradient_sum_squares(store.flat_grads(), lr);
    if (materialize) {
      store.materialize_low_rank_grads();
      EXPECT_TRUE(store.low_rank_grads().empty());
      r.grads = to_host(*be, store.flat_grads());
    }
    AdamWOptimizer opt(store, AdamWConfig{});
    const StepStats st = opt.step(1, 1e-3, {});
    EXPECT_TRUE(st.applied);
    // The optimizer's norm: from the factors, or after materialize from the GEMM's sums.
    EXPECT_NEAR(st.grad_norm, std::sqrt(r.norm), (materialize ? 1e-6 : 1e-12) * st.grad_norm);
    r.params = to_host(*be, store.flat_params());
    return r;
  };
  const Run dense = run(0, true), low = run(6, false), low_out = run(6, true), fallback = run(4, true),
            first_fallback = run(1, true);
  EXPECT_EQ(dense.low_rank, 0u);
  EXPECT_EQ(low.low_rank, static_cast<size_t>(per_sample));
  EXPECT_EQ(per_sample, cfg.guidance_embed ? 10 : 8);  // 3 embedder MLPs (2 without guidance), 3 mod, final
  EXPECT_EQ(fallback.low_rank, 0u);
  EXPECT_EQ(first_fallback.low_rank, 0u);
  EXPECT_TRUE(std::isfinite(low.norm));
  EXPECT_NEAR(low.norm, dense.norm, 1e-6 * dense.norm);
  EXPECT_LT(testing::max_rel_error(low_out.grads, dense.grads), 1e-6);
  EXPECT_LT(testing::max_rel_error(fallback.grads, dense.grads), 1e-6);
  EXPECT_LT(testing::max_rel_error(first_fallback.grads, dense.grads), 1e-6);
  // AdamW's first step moves each weight by lr·g/(|g| + eps): where a gradient's sum cancels to
  // near eps, an f32 rounding of g moves the update by up to lr·(that rounding)/eps (measured
  // 2.3e-6 and 3.0e-6 of the largest weight).
  EXPECT_LT(testing::max_rel_error(low.params, dense.params), 1e-5);
  EXPECT_LT(testing::max_rel_error(fallback.params, dense.params), 1e-5);
  EXPECT_LT(testing::max_rel_error(first_fallback.params, dense.params), 1e-5);

  auto be = make_backend("cpu");
  FluxModel model(cfg, *be, DType::f32);
  EXPECT_FALSE(model.params().keep_low_rank_grads(ParamStore::kLowRankMaxRows + 1));
  EXPECT_TRUE(model.params().low_rank_grads().empty());
}

TEST(Trainer, ResumeAfterInterruptionIsBitExact) {
  const testing::RunDir dir;
  const TrainResult straight = run_training(dir.options("straight"));
  EXPECT_EQ(straight.steps_done, 6);

  TrainOptions first = dir.options("resumed");
  first.stop_after = 3;
  const TrainResult a = run_training(first);
  EXPECT_TRUE(a.stopped_early);
  EXPECT_EQ(a.steps_done, 3);
  TrainOptions second = dir.options("resumed");
  second.resume = true;
  const TrainResult b = run_training(second);
  EXPECT_EQ(b.steps_done, 6);

  const std::vector<double> l1 = testing::step_losses(dir.root / "straight" / "metrics.jsonl");
  const std::vector<double> l2 = testing::step_losses(dir.root / "resumed" / "metrics.jsonl");
  ASSERT_EQ(l1.size(), 6u);
  EXPECT_EQ(l1, l2);  // exact: same data order, noise and arithmetic
  // Each launch logs its first step's time since the process started (launch to first step, docs/PERFORMANCE.md).
  const auto first_steps = [&](const char* run) {
    std::vector<int64_t> steps;
    std::ifstream in(dir.root / run / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.value("event", "") != "first_step") continue;
      steps.push_back(j["step"].get<int64_t>());
      EXPECT_GT(j["seconds_since_launch"].get<double>(), 0.0) << line;
    }
    return steps;
  };
  EXPECT_EQ(first_steps("straight"), (std::vector<int64_t>{1}));
  EXPECT_EQ(first_steps("resumed"), (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(testing::resume_records(dir.root / "resumed" / "metrics.jsonl").at(0)["changed_settings"],
            nlohmann::json::array())
      << "the same settings as the checkpoint's run";
  testing::expect_same_tensors((dir.root / "straight" / "step-0000006" / "model.safetensors").string(),
                               (dir.root / "resumed" / "step-0000006" / "model.safetensors").string());
  testing::expect_same_tensors((dir.root / "straight" / "step-0000006" / "optimizer.safetensors").string(),
                               (dir.root / "resumed" / "step-0000006" / "optimizer.safetensors").string());
  EXPECT_EQ(straight.last_val_loss, b.last_val_loss);
}

// A resume under other settings than the checkpoint's run — here the moments' precision, whose
// default a newer flux8 may have changed — names each in the log and in the resume record.
TEST(Trainer, ResumeNamesTheSettingsThatDifferFromTheCheckpoint) {
  const testing::RunDir dir("trainer_changed_settings");
  TrainOptions first = dir.options("run");
  first.overrides.push_back("adam_moment_precision=f32");
  first.stop_after = 3;
  EXPECT_TRUE(run_training(first).stopped_early);
  TrainOptions second = dir.options("run");
  second.overrides.push_back("train_iters=7");
  second.resume = true;
  ::testing::internal::CaptureStdout();
  EXPECT_EQ(run_training(second).steps_done, 7);
  const std::string out = ::testing::internal::GetCapturedStdout();
  testing::expect_mentions(out, {"resumed with settings other than the checkpoint's run: ", "train_iters: 7 (was 6)",
                                 "adam_moment_precision: bf16 (was f32)"});
  const nlohmann::json changed = testing::resume_records(dir.root / "run" / "metrics.jsonl").at(0)["changed_settings"];
  EXPECT_EQ(changed, (nlohmann::json{"train_iters: 7 (was 6)", "adam_moment_precision: bf16 (was f32)"}));
}

// Each step's record says its model FLOPs rate: the step's FLOPs (model/flops.h, docs/WORKLOADS.md's
// convention, over its two micro-batches of 2 samples) over its step time; and its energy where
// the device counts it (null here).
TEST(Trainer, StepRecordsGiveTheModelFlopsRate) {
  const testing::RunDir dir("trainer_tflops");
  const TrainOptions o = dir.options("run");
  EXPECT_EQ(run_training(o).steps_done, 6);
  const FluxConfig cfg = FluxConfig::from_config(Config::load(o.config_path, o.overrides));
  const double step_flops = 2 * model_flops(cfg, StepShape{2, cfg.text_seq_len, cfg.image_tokens(8)}).training();
  ASSERT_GT(step_flops, 0.0);
  int rows = 0;
  std::ifstream in(dir.root / "run" / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("step_time_s")) continue;
    ++rows;
    EXPECT_NEAR(j["model_tflops_per_s"].get<double>() * 1e12 * j["step_time_s"].get<double>(), step_flops,
                1e-9 * step_flops)
        << line;
    // The CPU has no energy counter: the fields are there, null.
    EXPECT_TRUE(j.contains("energy_j_per_step") && j["energy_j_per_step"].is_null()) << line;
    EXPECT_TRUE(j.contains("gpu_power_w") && j["gpu_power_w"].is_null()) << line;
  }
  EXPECT_EQ(rows, 6);
}

// async_save: on writes each checkpoint from a host copy behind the next steps: the same
// parameters and moments as a save in line (off), every save reported twice in metrics.jsonl
// (the copy, then the written checkpoint), the last one written before run_training returns.
// auto, the default, writes in line on the CPU backend, whose cores compute the step.
TEST(Trainer, CheckpointsWrittenBehindTrainingEqualOnesWrittenInLine) {
  const testing::RunDir dir("trainer_async_save");
  auto options = [&](const char* save, const char* async) {
    TrainOptions o = dir.options(save);
    o.overrides.push_back("save_interval=2");
    if (*async) o.overrides.push_back(std::string("async_save=") + async);
    return o;
  };
  EXPECT_EQ(run_training(options("behind", "on")).steps_done, 6);
  EXPECT_EQ(run_training(options("in_line", "off")).steps_done, 6);
  EXPECT_EQ(run_training(options("auto", "")).steps_done, 6);
  for (const char* step : {"step-0000004", "step-0000006"})  // keep_last_checkpoints: 2 (demo.yaml)
    for (const char* file : {"model.safetensors", "optimizer.safetensors"})
      testing::expect_same_tensors((dir.root / "behind" / step / file).string(),
                                   (dir.root / "in_line" / step / file).string());
  EXPECT_FALSE(fs::exists(dir.root / "behind" / "step-0000002"));
  auto events = [&](const char* run, const char* kind) {
    std::vector<int64_t> steps;
    std::ifstream in(dir.root / run / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.value("event", "") != kind) continue;
      steps.push_back(j["step"].get<int64_t>());
      if (std::string(kind) == "checkpoint") EXPECT_EQ(j.value("async", false), std::string(run) == "behind") << line;
      if (std::string(kind) == "checkpoint_snapshot") EXPECT_GT(j["snapshot_bytes"].get<uint64_t>(), 0u) << line;
    }
    return steps;
  };
  const std::vector<int64_t> saves{2, 4, 6};
  EXPECT_EQ(events("behind", "checkpoint_snapshot"), saves);
  EXPECT_EQ(events("behind", "checkpoint"), saves);
  for (const char* run : {"in_line", "auto"}) {
    EXPECT_EQ(events(run, "checkpoint_snapshot"), std::vector<int64_t>{}) << run;
    EXPECT_EQ(events(run, "checkpoint"), saves) << run;
  }
}

// adam_moment_precision: bf16 on the trainer: the run says so, its moments are bf16 values (saved
// as F32) that differ from the f32 moments' run, and an interrupted run resumes bit for bit — the
// moments reload exactly and the rounding's random bits depend only on (step, element).
TEST(Trainer, ResumeWithBf16MomentsIsBitExact) {
  const testing::RunDir dir("trainer_bf16_moments");
  const auto with_bf16 = [&](const char* save) {
    TrainOptions o = dir.options(save);
    o.overrides.push_back("adam_moment_precision=bf16");
    return o;
  };
  ::testing::internal::CaptureStdout();
  const TrainResult straight = run_training(with_bf16("straight"));
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("AdamW moments: stored in bf16"), std::string::npos) << out;
  EXPECT_EQ(straight.steps_done, 6);
  TrainOptions with_f32 = dir.options("f32");
  with_f32.overrides.push_back("adam_moment_precision=f32");
  run_training(with_f32);
  TrainOptions first = with_bf16("resumed");
  first.stop_after = 3;
  EXPECT_TRUE(run_training(first).stopped_early);
  TrainOptions second = with_bf16("resumed");
  second.resume = true;
  EXPECT_EQ(run_training(second).steps_done, 6);

  EXPECT_EQ(testing::step_losses(dir.root / "straight" / "metrics.jsonl"),
            testing::step_losses(dir.root / "resumed" / "metrics.jsonl"));
  const std::string opt = "step-0000006/optimizer.safetensors";
  testing::expect_same_tensors((dir.root / "straight" / opt).string(), (dir.root / "resumed" / opt).string());
  const SafetensorsReader bf16((dir.root / "straight" / opt).string()), f32((dir.root / "f32" / opt).string());
  const std::string name = "exp_avg_sq.double_blocks.0.img_attn.qkv.weight";
  std::vector<double> v(static_cast<size_t>(bf16.tensor(name).numel())), w(v.size());
  bf16.read_f64(name, v.data(), bf16.tensor(name).shape);
  f32.read_f64(name, w.data(), f32.tensor(name).shape);
  for (double x : v) ASSERT_EQ(x, round_to_bf16(static_cast<float>(x))) << "a moment that bf16 cannot hold";
  EXPECT_NE(v, w);
  EXPECT_LT(testing::max_rel_error(v, w), 0.05);
}

}  // namespace
}  // namespace flux8
