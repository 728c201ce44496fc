// The per-GPU memory plan of a tensor × data-parallel job (bench/memory_plan.h, `flux8 info --tp
// T --dp D`): one GPU's plan is the single-GPU breakdown of `flux8 info`, a tensor-parallel rank
// holds its ParamLayout, the distributed optimizer divides the moments (and only them) over the
// data-parallel ranks, and sizes that do not split are refused by name.
#include <fmt/core.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/attention_workspace.h"
#include "bench/memory_plan.h"
#include "config/config.h"
#include "fp8/fp8_config.h"
#include "model/params.h"
#include "test_util.h"
#include "train/data_parallel.h"

namespace flux8 {
namespace {

using testing::error_of;

const std::string kTiny = std::string(FLUX8_SOURCE_DIR) + "/configs/models/flux_tiny_demo.yaml";
const std::string kDev = std::string(FLUX8_SOURCE_DIR) + "/configs/models/flux_12b_dev.yaml";

struct InfoCli {
  testing::TempDir dir;
  std::string log;
  int run(const std::string& args) {
    return testing::run_flux8("info -c " + kTiny + " " + args, dir.file("log.txt"), &log);
  }
  nlohmann::json json(const std::string& args) {
    EXPECT_EQ(run(args + " --json"), 0) << log;
    return nlohmann::json::parse(log, nullptr, false);
  }
};

constexpr const char* kSettings[] = {"none", "selective", "full"};

TEST(MemoryPlan, OneGpuIsTheSingleGpuBreakdown) {
  InfoCli cli;
  for (const auto& [fp8, column] : {std::pair{"none", "bf16"}, std::pair{"hybrid", "fp8"}})
    for (const char* recompute : kSettings) {
      const nlohmann::json j =
          cli.json(fmt::format("--set fp8={} --set recompute_granularity={} --tp 1 --dp 1", fp8, recompute));
      ASSERT_TRUE(j.contains("memory_plan")) << cli.log;
      const nlohmann::json& today = j["memory_bytes_cuda_today"];
      const nlohmann::json& plan = j["memory_plan"];
      const nlohmann::json& bytes = plan["bytes"];
      SCOPED_TRACE(fmt::format("fp8 {}, recompute {}", fp8, recompute));
      EXPECT_EQ(plan["parameters_per_gpu"], j["parameters"]);
      EXPECT_EQ(bytes["bf16_weight_copies"], today["weights (bf16)"][column]);
      EXPECT_EQ(bytes["fp8_weight_casts"], today["fp8 weight copies"][column]);
      EXPECT_EQ(bytes["master_weights"], today["fp32 master weights"][column]);
      EXPECT_EQ(bytes["gradients"], today["gradients (bf16)"][column]);  // the defaults
      EXPECT_EQ(bytes["adam_moments"], today["AdamW moments (bf16)"][column]);
      EXPECT_EQ(bytes["checkpoint_buffers"], 0.0);
      EXPECT_EQ(bytes["host_checkpoint"], 0.0);
      EXPECT_EQ(bytes["attention_workspace"], j["deterministic_attention_workspace_bytes"]);
      const nlohmann::json& r = plan["recompute"][recompute];
      EXPECT_EQ(r["activations_bytes"], today["activations"][column]);
      // The block scratch is part of the activations (the rest is kept from forward to backward).
      const double scratch = j["block_scratch_bytes"][std::string("today_") + column].get<double>();
      EXPECT_GT(scratch, 0.0);
      EXPECT_LT(scratch, today["activations"][column].get<double>());
      EXPECT_DOUBLE_EQ(
          r["step_total_bytes"].get<double>(),
          today["total"][column].get<double>() + j["deterministic_attention_workspace_bytes"].get<double>());
    }
  // Without --tp/--dp `flux8 info` prints the single-GPU breakdown alone, as before.
  ASSERT_EQ(cli.run(""), 0) << cli.log;
  EXPECT_NE(cli.log.find("memory of a training step on the GPU"), std::string::npos) << cli.log;
  EXPECT_EQ(cli.log.find("memory plan"), std::string::npos) << cli.log;
  EXPECT_FALSE(cli.json("").contains("memory_plan"));
  ASSERT_EQ(cli.run("--tp 2 --dp 4 --distributed-optimizer --gpu-memory 0.001"), 0) << cli.log;
  testing::expect_mentions(cli.log,
                           {"memory plan of one GPU: tensor-parallel 2 x data-parallel 4 = 8 GPUs",
                            "its shard over the 4 data-parallel ranks", "peak, a checkpoint save", "fits 0.00 GiB"});
}

TEST(MemoryPlan, TensorParallelRankHoldsItsLayoutAndActivations) {
  const Config config = Config::load(kTiny, {"micro_batch_size=2", "image_size=16"});
  const FluxConfig cfg = FluxConfig::from_config(config);
  const MemoryPlan one = MemoryPlan::of(config, {1, 1, false}), two = MemoryPlan::of(config, {2, 1, false});
  EXPECT_EQ(two.model_params, ParamLayout::build(cfg).total());
  EXPECT_EQ(two.rank_params, ParamLayout::build(cfg, 0, 2).total());
  EXPECT_EQ(two.rank_params, ParamLayout::build(cfg, 1, 2).total());
  EXPECT_LT(two.rank_params, one.rank_params);
  EXPECT_EQ(two.masters, 4.0 * static_cast<double>(two.rank_params));
  EXPECT_EQ(two.gradients, two.masters / 2);  // bf16, the default
  for (const Recompute r : {Recompute::none, Recompute::selective, Recompute::full}) {
    const ActivationEstimate act = FluxModel::estimate_activations(cfg, two.shape, r, 2);
    EXPECT_EQ(two.activations[static_cast<size_t>(r)], act.gpu_bytes(false));
  }
  EXPECT_LT(two.activations[0], one.activations[0]);
  EXPECT_EQ(two.attention_workspace, one.attention_workspace / 2) << "half the heads a rank";

  // flux_12b_dev: the blocks' 8,608,346,112 split parameters halve, the 3,293,062,208 replicated stay.
  const MemoryPlan dev = MemoryPlan::of(Config::load(kDev), {2, 1, false});
  EXPECT_EQ(dev.model_params, 11'901'408'320);
  EXPECT_EQ(dev.rank_params, 8'608'346'112 / 2 + 3'293'062'208);
}

// deterministic_attention_workspace_mib: the deterministic attention backward runs as calls over
// consecutive (sample, head) pairs, as many a call as the bound's dP holds and dividing batch x
// heads; the plan counts one call's dP.
TEST(MemoryPlan, DeterministicAttentionWorkspaceSplitsTheBackwardOverHeads) {
  const double pair = 2.0 * 4608 * 4608;  // one (sample, head) pair's dP at 1024 px: 40.5 MiB
  auto expect_split = [](AttentionBackwardSplit s, int64_t pairs_per_call, int64_t calls, double dp) {
    EXPECT_EQ(s.pairs_per_call, pairs_per_call);
    EXPECT_EQ(s.calls, calls);
    EXPECT_EQ(s.dp_bytes, dp);
  };
  expect_split(split_attention_backward(2, 24, 4608, 0), 48, 1, 48 * pair);  // no bound
  expect_split(split_attention_backward(2, 24, 4608, 512ull << 20), 12, 4, 12 * pair);
  expect_split(split_attention_backward(2, 24, 4608, 1ull << 30), 24, 2, 24 * pair);
  expect_split(split_attention_backward(32, 24, 512, 512ull << 20), 768, 1, 768 * 2.0 * 512 * 512);  // fits
  expect_split(split_attention_backward(1, 7, 1000, 6'000'000), 1, 7, 2e6);  // 7 is prime: one pair a call
  expect_split(split_attention_backward(2, 3, 1000, 1), 1, 6, 2e6);          // one pair over the bound
  expect_split(split_attention_backward(0, 24, 4608, 1), 0, 0, 0);

  for (const int tp : {1, 2}) {
    const std::vector<std::string> w2 = {"image_size=1024", "micro_batch_size=2",
                                         "deterministic_attention_workspace_mib=0"};
    std::vector<std::string> bounded = w2;
    bounded.back() = "deterministic_attention_workspace_mib=512";
    const MemoryPlan all = MemoryPlan::of(Config::load(kDev, w2), {tp, 1, false});
    const MemoryPlan part = MemoryPlan::of(Config::load(kDev, bounded), {tp, 1, false});
    EXPECT_EQ(all.attention_workspace, 48 / tp * pair) << "tp " << tp;
    EXPECT_EQ(part.attention_workspace, 12 * pair) << "tp " << tp;
    EXPECT_DOUBLE_EQ(all.peak(Recompute::none) - part.peak(Recompute::none), (48 / tp - 12) * pair);
  }
  InfoCli cli;
  const std::string w2 = " --image-size 1024 --batch 2 --set deterministic_attention_workspace_mib=512";
  ASSERT_EQ(testing::run_flux8("info -c " + kDev + w2 + " --json", cli.dir.file("log.txt"), &cli.log), 0) << cli.log;
  EXPECT_EQ(nlohmann::json::parse(cli.log)["deterministic_attention_workspace_bytes"].get<double>(), 12 * pair);
  ASSERT_EQ(testing::run_flux8("info -c " + kDev + w2, cli.dir.file("log.txt"), &cli.log), 0) << cli.log;
  testing::expect_mentions(cli.log, {"keeps dP in a workspace of 0.47 GiB", "12 (sample, head) pairs", "4 calls"});
}

// recompute_elementwise plans what the blocks keep with it: by default `none` keeps what
// `selective` keeps, less than with it off, in BF16 and FP8 alike (no Linear input is kept);
// `full`'s region keeps everything either way. The plan is the model's own estimate.
TEST(MemoryPlan, RecomputeElementwiseKeepsLess) {
  const Config on = Config::load(kDev, {"image_size=512", "fp8=hybrid"});
  const Config off = Config::load(kDev, {"image_size=512", "fp8=hybrid", "recompute_elementwise=false"});
  const MemoryPlan a = MemoryPlan::of(on, {}), b = MemoryPlan::of(off, {});
  auto act = [](const MemoryPlan& p, Recompute r) { return p.activations[static_cast<size_t>(r)]; };
  EXPECT_TRUE(a.recompute_elementwise);
  EXPECT_FALSE(b.recompute_elementwise);
  EXPECT_EQ(act(a, Recompute::none), act(a, Recompute::selective));
  EXPECT_LT(act(a, Recompute::none), act(b, Recompute::selective));
  EXPECT_LT(act(b, Recompute::selective), act(b, Recompute::none));
  EXPECT_EQ(act(a, Recompute::full), act(b, Recompute::full));
  const FluxConfig cfg = FluxConfig::from_config(on);
  const ActivationEstimate e = FluxModel::estimate_activations(cfg, a.shape, Recompute::none);
  EXPECT_EQ(act(a, Recompute::none), e.gpu_bytes(true));
  EXPECT_EQ(e.saved.gpu_bytes(true), e.saved.gpu_bytes(false));  // no Linear input kept: the same tensors
  EXPECT_LT(a.step_total(Recompute::none), b.step_total(Recompute::none));
}

// fp8_weight_transpose: in_backward keeps one byte an FP8 block-Linear parameter instead of two,
// plus one transpose buffer of the largest (flux_12b_dev: a single block's linear1, 3072 x 21504).
// auto, the default, is in_backward with the per-tensor recipes and keep with the block-scaled.
TEST(MemoryPlan, WeightsTransposedInTheBackwardKeepOneCast) {
  const Config keep = Config::load(kDev, {"image_size=512", "fp8=hybrid", "fp8_weight_transpose=keep"});
  const Config in_backward = Config::load(kDev, {"image_size=512", "fp8=hybrid", "fp8_weight_transpose=in_backward"});
  const MemoryPlan a = MemoryPlan::of(keep, {}), b = MemoryPlan::of(in_backward, {});
  for (const char* recipe : {"delayed", "tensorwise", "blockwise", "mxfp8"}) {
    const Config dflt = Config::load(kDev, {"image_size=512", "fp8=hybrid", std::string("fp8_recipe=") + recipe});
    const bool per_tensor = std::string(recipe) == "delayed" || std::string(recipe) == "tensorwise";
    EXPECT_EQ(Fp8Config::from_config(dflt).weight_transpose_in_backward, per_tensor) << recipe;
    const Config same =
        Config::load(kDev, {"image_size=512", "fp8=hybrid", std::string("fp8_recipe=") + recipe,
                            per_tensor ? "fp8_weight_transpose=in_backward" : "fp8_weight_transpose=keep"});
    EXPECT_DOUBLE_EQ(MemoryPlan::of(dflt, {}).fp8_casts, MemoryPlan::of(same, {}).fp8_casts) << recipe;
  }
  EXPECT_DOUBLE_EQ(b.fp8_casts, a.fp8_casts / 2 + 3072.0 * 21504.0);
  EXPECT_DOUBLE_EQ(b.operand_copies, a.operand_copies);
  EXPECT_DOUBLE_EQ(a.state() - b.state(), a.fp8_casts - b.fp8_casts);
  const MemoryPlan bf16 = MemoryPlan::of(Config::load(kDev, {"image_size=512"}), {});
  EXPECT_EQ(bf16.fp8_casts, 0.0);
  EXPECT_DOUBLE_EQ(bf16.operand_copies, a.operand_copies + a.fp8_casts);  // every Linear's bf16 copy
}

TEST(MemoryPlan, DistributedOptimizerShardsTheMastersWithTheMoments) {
  const Config config = Config::load(kDev, {"image_size=256", "adam_moment_precision=f32"});
  const MemoryPlan whole = MemoryPlan::of(config, {2, 16, false}), sharded = MemoryPlan::of(config, {2, 16, true});
  const int64_t P = whole.rank_params;
  EXPECT_EQ(whole.moment_elements, P);
  EXPECT_EQ(whole.moments, 8.0 * static_cast<double>(P));
  EXPECT_EQ(whole.masters, 4.0 * static_cast<double>(P));
  EXPECT_EQ(whole.host_checkpoint, 0.0);
  EXPECT_EQ(sharded.moment_elements, FlatSharding::of(P, 16).owned(15).count);
  EXPECT_EQ(sharded.moments, 8.0 * static_cast<double>(sharded.moment_elements));
  EXPECT_NEAR(sharded.moments / whole.moments, 1.0 / 16, 1e-6);
  // The masters of the same shard, beside the small parameters' residents, a staging buffer of
  // the largest parameter and the forms' gather window (ParamStore MasterShards).
  int64_t largest = 0, small = 0;
  const ParamLayout layout = ParamLayout::build(FluxConfig::from_config(config), 0, 2);
  for (const ParamInfo& p : layout.params()) {
    largest = std::max(largest, p.shape.numel());
    if (!p.linear_weight) small += p.shape.numel();
  }
  EXPECT_EQ(sharded.masters, 4.0 * static_cast<double>(sharded.moment_elements + small + largest +
                                                       std::max(ParamStore::kFormsWindowElements, largest)));
  EXPECT_LT(sharded.masters, whole.masters / 2);
  // The gradient buffer and the device forms stay whole on every data-parallel rank.
  const MemoryPlan one_rank = MemoryPlan::of(config, {2, 1, false});
  EXPECT_EQ(sharded.gradients, one_rank.gradients);
  EXPECT_EQ(sharded.operand_copies + sharded.fp8_casts, one_rank.operand_copies + one_rank.fp8_casts);
  // A save gathers masters and moments into rank 0's host memory through a bounded GPU buffer.
  EXPECT_EQ(sharded.host_checkpoint, 12.0 * static_cast<double>(P));
  EXPECT_GT(sharded.checkpoint_buffers, 0.0);
  EXPECT_LE(sharded.checkpoint_buffers, 4.0 * static_cast<double>((int64_t{1} << 26) + largest));
  EXPECT_EQ(sharded.peak(Recompute::full), sharded.step_total(Recompute::full) + sharded.checkpoint_buffers);
  // One data-parallel rank has nothing to shard over (AdamWOptimizer::set_data_parallel).
  EXPECT_EQ(MemoryPlan::of(config, {2, 1, true}).moments, whole.moments);
  EXPECT_EQ(MemoryPlan::of(config, {2, 1, true}).masters, whole.masters);
  // bf16 moments: 4 bytes an element for the two.
  const MemoryPlan bf16 = MemoryPlan::of(Config::load(kDev), {2, 16, true});  // the default
  EXPECT_EQ(bf16.moments, 4.0 * static_cast<double>(sharded.moment_elements));
}

// The plans docs/DISTRIBUTED.md quotes: flux_12b_dev at 1024 px, micro-batch 1, FP8 (delayed),
// distributed optimizer, f32 moments. With f32 gradients TP=2 x DP=1 fits two 141 GB GPUs with
// full recompute only; TP=2 x DP=16 fits 40 GB (37.25 GiB) with full recompute and
// grad_precision: bf16, the masters sharded with the moments — not with f32 gradients.
TEST(MemoryPlan, Flux12bDevOnTwoAndThirtyTwoGpus) {
  const std::vector<std::string> base{"image_size=1024",
                                      "micro_batch_size=1",
                                      "fp8=hybrid",
                                      "fp8_recipe=delayed",
                                      "use_distributed_optimizer=true",
                                      "grad_precision=f32",
                                      "adam_moment_precision=f32"};
  std::vector<std::string> bf16_grads = base;
  std::replace(bf16_grads.begin(), bf16_grads.end(), std::string("grad_precision=f32"),
               std::string("grad_precision=bf16"));
  const Config config = Config::load(kDev, base), lean = Config::load(kDev, bf16_grads);
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const double gpu_141gb = 141e9, gpu_40gb = 37.25 * kGiB;
  const MemoryPlan two = MemoryPlan::of(config, {2, 1, true}), many = MemoryPlan::of(config, {2, 16, true});
  EXPECT_GT(two.peak(Recompute::selective), gpu_141gb);
  EXPECT_LE(two.peak(Recompute::full), gpu_141gb);
  EXPECT_NEAR(two.step_total(Recompute::full) / kGiB, 126.01, 0.005);
  EXPECT_NEAR(two.peak(Recompute::full) / kGiB, 126.25, 0.005);
  EXPECT_NEAR(many.step_total(Recompute::full) / kGiB, 46.84, 0.005);
  EXPECT_GT(many.peak(Recompute::full), gpu_40gb);
  const MemoryPlan fits = MemoryPlan::of(lean, {2, 16, true});
  EXPECT_NEAR(fits.step_total(Recompute::full) / kGiB, 32.69, 0.005);
  EXPECT_NEAR(fits.peak(Recompute::full) / kGiB, 33.06, 0.005);
  EXPECT_LE(fits.peak(Recompute::full), gpu_40gb);
  EXPECT_GT(fits.peak(Recompute::selective), gpu_40gb);
}

// optimizer_offload: moments moves the moments (a rank's shard, with the distributed optimizer) to
// host memory; the GPU keeps one chunk of each, of at least the largest parameter; a checkpoint
// gathers them through the same GPU buffer as moments kept there.
TEST(MemoryPlan, OffloadKeepsAChunkOfTheMomentsOnTheGpu) {
  const Config on_gpu = Config::load(kDev, {"adam_moment_precision=bf16"});
  const Config offloaded = Config::load(
      kDev, {"adam_moment_precision=bf16", "optimizer_offload=moments", "optimizer_offload_overlap=false"});
  int64_t largest = 0;
  const ParamLayout layout = ParamLayout::build(FluxConfig::from_config(on_gpu));
  for (const ParamInfo& p : layout.params()) largest = std::max(largest, p.shape.numel());
  for (const ParallelShape shape : {ParallelShape{1, 1, false}, ParallelShape{1, 8, true}}) {
    const MemoryPlan a = MemoryPlan::of(on_gpu, shape), b = MemoryPlan::of(offloaded, shape);
    EXPECT_TRUE(b.offload);
    EXPECT_EQ(b.host_moments, a.moments);
    EXPECT_EQ(b.moments, 4.0 * static_cast<double>((int64_t{1} << 26) + largest));
    EXPECT_EQ(b.checkpoint_buffers, a.checkpoint_buffers);
    EXPECT_EQ(a.state() - b.state(), a.moments - b.moments);
    // optimizer_offload_overlap (the default): two chunks.
    const MemoryPlan two =
        MemoryPlan::of(Config::load(kDev, {"adam_moment_precision=bf16", "optimizer_offload=moments"}), shape);
    EXPECT_EQ(two.moments, 2 * 4.0 * static_cast<double>((int64_t{1} << 26) + largest));
  }
  // optimizer_offload_update: host (with cpu): AdamW on the host, no chunk of the moments on the GPU.
  const MemoryPlan streamed =
      MemoryPlan::of(Config::load(kDev, {"optimizer_offload=cpu", "optimizer_offload_overlap=false"}), {});
  const MemoryPlan on_host =
      MemoryPlan::of(Config::load(kDev, {"optimizer_offload=cpu", "optimizer_offload_update=host"}), {});
  EXPECT_GT(streamed.moments, 0.0);
  EXPECT_EQ(on_host.moments, 0.0);
  EXPECT_EQ(on_host.host_moments, streamed.host_moments);
  EXPECT_EQ(streamed.state() - on_host.state(), streamed.moments);
}

// optimizer_offload: cpu moves the f32 master weights to host memory too: the GPU keeps the small
// parameters in f32, a staging buffer of the largest and the optimizer's chunk of masters.
TEST(MemoryPlan, OffloadedMastersLeaveTheSmallParametersAndAChunkOnTheGpu) {
  const Config moments = Config::load(kDev, {"optimizer_offload=moments", "optimizer_offload_overlap=false"});
  const Config masters = Config::load(kDev, {"optimizer_offload=cpu", "optimizer_offload_overlap=false"});
  int64_t largest = 0, small = 0;
  const ParamLayout layout = ParamLayout::build(FluxConfig::from_config(masters));
  for (const ParamInfo& p : layout.params()) {
    largest = std::max(largest, p.shape.numel());
    if (!p.linear_weight) small += p.shape.numel();
  }
  const int64_t chunk = (int64_t{1} << 26) + largest;
  const MemoryPlan a = MemoryPlan::of(moments, {}), b = MemoryPlan::of(masters, {});
  EXPECT_TRUE(b.offload);
  EXPECT_TRUE(b.offload_masters);
  EXPECT_FALSE(a.offload_masters);
  EXPECT_EQ(b.host_masters, 4.0 * static_cast<double>(layout.total()));
  EXPECT_EQ(b.masters, 4.0 * static_cast<double>(small + largest + chunk));
  // optimizer_offload_overlap (the default): two chunks of masters.
  const MemoryPlan two = MemoryPlan::of(Config::load(kDev, {"optimizer_offload=cpu"}), {});
  EXPECT_EQ(two.masters, 4.0 * static_cast<double>(small + largest + 2 * chunk));
  EXPECT_EQ(b.host_moments, a.host_moments);
  EXPECT_EQ(a.state() - b.state(), a.masters - b.masters);
  EXPECT_LT(b.masters, 0.1 * a.masters);
}

TEST(MemoryPlan, SizesThatDoNotSplitAreRefusedByName) {
  InfoCli cli;
  EXPECT_NE(cli.run("--tp 3"), 0);
  EXPECT_NE(cli.log.find("num_heads 4 is not divisible by tensor_model_parallel_size 3"), std::string::npos) << cli.log;
  EXPECT_NE(cli.run("--tp 2 --set mlp_ratio=3.03125"), 0);
  testing::expect_mentions(cli.log, {"the MLP width 291", "tensor_model_parallel_size 2"});
  // The config's tensor_model_parallel_size asks for the plan too, and is checked the same way.
  EXPECT_NE(cli.run("--set tensor_model_parallel_size=3"), 0);
  EXPECT_NE(cli.log.find("not divisible by tensor_model_parallel_size 3"), std::string::npos) << cli.log;
  for (const char* tp : {"0", "-1", "two", "1.5", "4096"}) {
    EXPECT_NE(cli.run(fmt::format("--tp={}", tp)), 0) << tp;
    EXPECT_NE(cli.log.find("--tp"), std::string::npos) << tp << ": " << cli.log;
  }
  for (const char* dp : {"0", "-2", "1.5", "x", "100000"}) {
    EXPECT_NE(cli.run(fmt::format("--dp={}", dp)), 0) << dp;
    EXPECT_NE(cli.log.find(fmt::format("--dp '{}': the data-parallel size", dp)), std::string::npos)
        << dp << ": " << cli.log;
  }
  for (const char* gib : {"0", "-80", "lots"}) {
    EXPECT_NE(cli.run(fmt::format("--tp 1 --gpu-memory={}", gib)), 0) << gib;
    EXPECT_NE(cli.log.find(fmt::format("--gpu-memory '{}'", gib)), std::string::npos) << gib << ": " << cli.log;
  }
  EXPECT_NE(cli.run("--tp 2 --set pipeline_model_parallel_size=2"), 0);
  EXPECT_NE(cli.log.find("pipeline_model_parallel_size is 2"), std::string::npos) << cli.log;
  const Config config = Config::load(kTiny);
  EXPECT_NE(error_of([&] { MemoryPlan::of(config, {1, 0, false}); }).find("at least one"), std::string::npos);
}

}  // namespace
}  // namespace flux8
