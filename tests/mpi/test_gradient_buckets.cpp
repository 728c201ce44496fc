// The data-parallel gradient buckets (train/gradient_buckets.h) under mpirun on the CPU backend:
// started during the last micro-batch's backward (overlap_grad_reduce) or after it, they give the
// same bits — losses, gradient norms and weights after several AdamW steps — and the same bits as
// the optimizer's own reduction after the backward (the MPI sums are rank-ordered whichever
// collective forms them). Plain and distributed optimizer, gradient accumulation, FP8 delayed
// scaling, and tensor × data parallelism; buckets of the default size and small ones that cut
// through parameters and through the ranks' shards.
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "backend/registry.h"
#include "backend/transfer.h"
#include "dist/process_groups.h"
#include "model_test_util.h"
#include "mpi/mpi_test_util.h"
#include "train/data_parallel.h"
#include "train/gradient_buckets.h"
#include "train/optimizer.h"
#include "train/train_step.h"
#include "train_test_util.h"

namespace flux8 {
namespace {

using testing::world_rank;
using testing::world_size;

// How the step's gradients are reduced over the data-parallel group.
enum class Reduction { optimizer, buckets_after_backward, buckets_in_backward };

struct RunSpec {
  int tp = 1;
  bool distributed = false;
  const Fp8Config* fp8 = nullptr;
  int64_t bucket_elements = DataParallel::kBucketElements;
  int64_t global = 16;  // samples a step, in micro-batches of 2
  int steps = 3;
};

struct Trajectory {
  std::vector<double> losses, norms, weights;
  size_t buckets = 0, started_in_backward = 0;  // of the last step
  size_t collectives = 0;                       // a step
  int64_t total = 0;                            // the rank's flat buffer
  int dp_size = 1;
};

FluxConfig model_config() {
  FluxConfig cfg = testing::tiny_demo_model();
  cfg.num_double_blocks = 2;
  cfg.num_single_blocks = 2;
  return cfg;
}

Trajectory train(const RunSpec& run, Reduction how) {
  const FluxConfig cfg = model_config();
  auto be = make_backend("cpu");
  ProcessGroups groups(MPI_COMM_WORLD, ParallelSizes{.tp = run.tp}, *be);
  DataParallel dp(groups.dp(), *be), world(groups.world(), *be), tp(groups.tp(), *be);
  const DType dtype = run.fp8 ? DType::f32 : DType::f64;
  FluxModel model(cfg, *be, dtype, run.fp8, Recompute::none, TensorParallel{&groups.tp()});
  testing::randomize_params(model.params(), 3);
  AdamWConfig ac;
  ac.clip_grad = 0.05;  // clipping: the norm spans every shard
  AdamWOptimizer opt(model.params(), ac);
  opt.set_data_parallel(&dp, run.distributed);
  opt.set_tensor_parallel(&tp);
  if (model.fp8())
    model.fp8()->registry().set_allreduce_hook([&](float* row, int n) {
      std::vector<double> v(row, row + n);
      world.max(v);
      for (int i = 0; i < n; ++i) row[i] = static_cast<float>(v[static_cast<size_t>(i)]);
    });
  std::unique_ptr<GradientBuckets> buckets;
  if (how != Reduction::optimizer) {
    std::optional<FlatSharding> sharding;
    if (opt.sharded()) sharding = FlatSharding::of(model.params().layout().total(), dp.size());
    buckets = std::make_unique<GradientBuckets>(model.params(), dp, sharding, how == Reduction::buckets_in_backward,
                                                run.bucket_elements);
    opt.set_gradients_reduced_by_caller(true);
  }
  const ObjectiveConfig obj;
  const EmptyPrompt empty = testing::zero_prompt(cfg);
  StepBuffers buf(*be, dtype);
  StepContext ctx{model, cfg, obj, empty, buf, 77};
  ctx.data_parallel = &groups.dp();
  ctx.final_gradients = buckets.get();
  const int64_t share = run.global / dp.size();
  Trajectory t;
  for (int step = 0; step < run.steps; ++step) {
    const int first = static_cast<int>(step * run.global + dp.rank() * share);
    const std::vector<Sample> samples = testing::demo_batch(cfg, static_cast<int>(share), first);
    if (buckets) buckets->begin_step();
    const StepLoss sl =
        accumulate_step_gradients(ctx, samples, 2, static_cast<uint64_t>(step), dp.rank() * share, run.global);
    if (buckets) buckets->finish_step();
    t.losses.push_back(sl.loss);
    t.norms.push_back(apply_optimizer_step(model, opt, step + 1, 1e-2).grad_norm);
  }
  t.weights = to_host(*be, model.params().flat_params());
  if (buckets) {
    t.buckets = buckets->buckets().size();
    t.started_in_backward = buckets->started_in_backward();
    t.collectives = buckets->collectives_per_step();
  }
  t.total = model.params().layout().total();
  t.dp_size = dp.size();
  return t;
}

void expect_same_bits(const std::vector<double>& a, const std::vector<double>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(double)))
      << what << " differ (rank " << world_rank() << ", largest relative difference " << testing::max_rel_error(a, b)
      << ")";
}

// The three reductions of `run` give the same bits; the buckets all start inside the backward
// when overlapped, none otherwise.
void expect_reductions_agree(const RunSpec& run) {
  if (world_size() % run.tp || run.global % (2 * (world_size() / run.tp)))
    GTEST_SKIP() << run.global << " samples in micro-batches of 2 do not split over this job at TP=" << run.tp;
  const Trajectory reference = train(run, Reduction::optimizer);
  const Trajectory after = train(run, Reduction::buckets_after_backward);
  const Trajectory during = train(run, Reduction::buckets_in_backward);
  for (const Trajectory* t : {&after, &during}) {
    SCOPED_TRACE(t == &after ? "buckets after the backward" : "buckets during the backward");
    expect_same_bits(t->losses, reference.losses, "losses");
    expect_same_bits(t->norms, reference.norms, "gradient norms");
    expect_same_bits(t->weights, reference.weights, "weights");
  }
  // One collective a bucket, and one more for each shard boundary inside a bucket.
  size_t expected = during.buckets;
  if (run.distributed && during.dp_size > 1) {
    const FlatSharding sharding = FlatSharding::of(during.total, during.dp_size);
    for (int r = 1; r < during.dp_size; ++r)
      expected += (during.total - sharding.owned(r).begin) % run.bucket_elements != 0 ? 1 : 0;
  }
  EXPECT_EQ(during.collectives, expected);
  EXPECT_EQ(after.started_in_backward, 0u);
  EXPECT_EQ(during.started_in_backward, during.buckets);
  if (world_rank() == 0)
    std::printf("%d ranks, TP=%d: %zu buckets, loss after %d steps %.17g\n", world_size(), run.tp, during.buckets,
                run.steps, during.losses.back());
}

TEST(GradientBuckets, OverlappedEqualsAfterTheBackwardBitForBit) {
  expect_reductions_agree(RunSpec{});
  expect_reductions_agree(RunSpec{.bucket_elements = 1000});
}

TEST(GradientBuckets, DistributedOptimizerReducesEachBucketToItsOwners) {
  expect_reductions_agree(RunSpec{.distributed = true});
  // Small buckets: many meet two ranks' shards, the last one the tail.
  expect_reductions_agree(RunSpec{.distributed = true, .bucket_elements = 1000});
}

TEST(GradientBuckets, Fp8DelayedScalingBitForBit) {
  const Fp8Config fp8 = testing::delayed_hybrid_fp8();
  expect_reductions_agree(RunSpec{.fp8 = &fp8, .bucket_elements = 4096});
  expect_reductions_agree(RunSpec{.distributed = true, .fp8 = &fp8, .bucket_elements = 4096});
}

TEST(GradientBuckets, TensorTimesDataParallelBitForBit) {
  if (world_size() != 4) GTEST_SKIP() << "TP=2 x DP=2 needs 4 ranks";
  expect_reductions_agree(RunSpec{.tp = 2, .bucket_elements = 1000, .global = 8});
  expect_reductions_agree(RunSpec{.tp = 2, .distributed = true, .bucket_elements = 1000, .global = 8});
}

// A listener between the model and the buckets that notes, at each report, how many buckets have
// started: they start one after another as the backward goes, not all at its end.
class StartsPerReport final : public FinalGradients {
 public:
  explicit StartsPerReport(GradientBuckets& b) : buckets_(b) {}
  void gradients_final(std::span<const size_t> params) override {
    buckets_.gradients_final(params);
    started.push_back(buckets_.started_in_backward());
  }
  std::vector<size_t> started;

 private:
  GradientBuckets& buckets_;
};

TEST(GradientBuckets, StartAsTheBackwardFinishesThemFromTheFinalLayer) {
  const FluxConfig cfg = model_config();
  auto be = make_backend("cpu");
  ProcessGroups groups(MPI_COMM_WORLD, ParallelSizes{}, *be);
  DataParallel dp(groups.dp(), *be);
  FluxModel model(cfg, *be, DType::f64);
  testing::randomize_params(model.params(), 3);
  GradientBuckets buckets(model.params(), dp, std::nullopt, true, 1000);
  StartsPerReport listener(buckets);
  const ObjectiveConfig obj;
  const EmptyPrompt empty = testing::zero_prompt(cfg);
  StepBuffers buf(*be, DType::f64);
  StepContext ctx{model, cfg, obj, empty, buf, 77};
  ctx.data_parallel = &groups.dp();
  ctx.final_gradients = &listener;
  buckets.begin_step();
  accumulate_step_gradients(ctx, testing::demo_batch(cfg, 4), 2, 0);
  buckets.finish_step();
  // final layer, 2 single and 2 double blocks, the input Linears, 2 or 3 embedders.
  ASSERT_GE(listener.started.size(), 8u);
  EXPECT_GE(listener.started.front(), 1u) << "the final layer's bucket waits for the rest of the backward";
  EXPECT_LT(listener.started[listener.started.size() / 2], buckets.buckets().size())
      << "every bucket started halfway through the backward";
  for (size_t i = 1; i < listener.started.size(); ++i) EXPECT_LE(listener.started[i - 1], listener.started[i]);
  EXPECT_EQ(listener.started.back(), buckets.buckets().size());
  // A second step starts from nothing; a parameter reported twice is an internal error.
  buckets.begin_step();
  const std::vector<size_t> first{0};
  buckets.gradients_final(first);
  EXPECT_THROW(buckets.gradients_final(first), Error);
  // The step's backward left a gradient unreported: finish_step names it.
  buckets.begin_step();
  try {
    buckets.finish_step();
    ADD_FAILURE() << "finish_step passed with no gradient reported final";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(model.params().layout().params()[0].name), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flux8
