// Data parallelism against one process over the same global batch (f64 on the CPU backend):
// every rank computes the single-process reference itself, then its share of the batch with
// gradients and losses summed over the job, and compares losses, gradients and the weights after
// five AdamW steps — plain and with the distributed optimizer (ZeRO-1). Runs at any job size.
#include <cstdio>
#include <cstring>
#include <vector>

#include "backend/registry.h"
#include "backend/transfer.h"
#include "data/demo.h"
#include "dist/process_groups.h"
#include "model_test_util.h"
#include "mpi/mpi_test_util.h"
#include "train/data_parallel.h"
#include "train/optimizer.h"
#include "train/train_step.h"
#include "train_test_util.h"

namespace flux8 {
namespace {

using testing::world_rank;
using testing::world_size;

using testing::demo_batch;
using testing::zero_prompt;

struct Trajectory {
  std::vector<double> losses, norms;
  std::vector<double> first_grads;  // after the first step's reduction
  std::vector<double> weights;      // after the last step
};

// `steps` AdamW steps of a global batch of `global` samples in micro-batches of 2; with `dp`, this
// rank's share of each batch and the sums over dp's group.
Trajectory train(const FluxConfig& cfg, DType dtype, int64_t global, int steps, DataParallel* dp, bool distributed,
                 const Fp8Config* fp8 = nullptr) {
  auto be = make_backend("cpu");
  FluxModel model(cfg, *be, dtype, fp8);
  testing::randomize_params(model.params(), 3);
  AdamWConfig ac;
  ac.clip_grad = 0.05;  // small enough to clip: the norm must span every shard
  AdamWOptimizer opt(model.params(), ac);
  std::unique_ptr<DataParallel> local_dp;
  if (dp) {
    local_dp = std::make_unique<DataParallel>(dp->group(), *be);
    opt.set_data_parallel(local_dp.get(), distributed);
    if (model.fp8())
      model.fp8()->registry().set_allreduce_hook([&](float* row, int n) {
        std::vector<double> v(row, row + n);
        local_dp->max(v);
        for (int i = 0; i < n; ++i) row[i] = static_cast<float>(v[static_cast<size_t>(i)]);
      });
  }
  const ObjectiveConfig obj;
  const EmptyPrompt empty = zero_prompt(cfg);
  StepBuffers buf(*be, dtype);
  StepContext ctx{model, cfg, obj, empty, buf, 77};
  const int ranks = dp ? dp->size() : 1, rank = dp ? dp->rank() : 0;
  const int64_t share = global / ranks;
  if (local_dp) ctx.data_parallel = &local_dp->group();
  Trajectory t;
  for (int step = 0; step < steps; ++step) {
    const std::vector<Sample> samples =
        demo_batch(cfg, static_cast<int>(share), static_cast<int>(step * global + rank * share));
    const StepLoss sl = accumulate_step_gradients(ctx, samples, 2, static_cast<uint64_t>(step), rank * share, global);
    t.losses.push_back(sl.loss);
    if (step == 0 && local_dp && !distributed) {
      local_dp->all_reduce_gradients(model.params().flat_grads());
      t.first_grads = to_host(*be, model.params().flat_grads());
      // step() reduces them again: start that step from this rank's own gradients.
      accumulate_step_gradients(ctx, samples, 2, static_cast<uint64_t>(step), rank * share, global);
    } else if (step == 0 && !local_dp) {
      t.first_grads = to_host(*be, model.params().flat_grads());
    }
    const StepStats st = apply_optimizer_step(model, opt, step + 1, 1e-2);
    t.norms.push_back(st.grad_norm);
  }
  t.weights = to_host(*be, model.params().flat_params());
  return t;
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b, double tol, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  const double e = testing::max_rel_error(a, b);
  EXPECT_LT(e, tol) << what;
  if (world_rank() == 0) std::printf("%d ranks, %s: largest relative difference %.3g\n", world_size(), what, e);
}

// The weights of every rank bit for bit equal rank 0's.
void expect_same_on_every_rank(DataParallel& dp, const std::vector<double>& mine) {
  std::vector<double> lead = mine;
  dp.broadcast(lead, 0);
  EXPECT_EQ(0, std::memcmp(lead.data(), mine.data(), mine.size() * sizeof(double)))
      << "rank " << world_rank() << " holds other weights than rank 0";
}

// The ranks whose digest differs from rank 0's, the same list on every rank: none when all agree;
// the odd ranks when they hold another digest (only the first 12 hex digits count).
TEST(DataParallel, RanksDifferingFromLeadAreNamedOnEveryRank) {
  auto be = make_backend("cpu");
  ProcessGroups groups(MPI_COMM_WORLD, ParallelSizes{}, *be);
  DataParallel world(groups.world(), *be);
  EXPECT_TRUE(world.ranks_differing_from_lead("0123456789abcdef").empty());
  const int me = world_rank();
  EXPECT_TRUE(world.ranks_differing_from_lead(me % 2 ? "0123456789abffff" : "0123456789ab0000").empty());
  std::vector<int> odd;
  for (int k = 1; k < world_size(); k += 2) odd.push_back(k);
  EXPECT_EQ(world.ranks_differing_from_lead(me % 2 ? "fedcba987654" : "0123456789ab"), odd);
  EXPECT_EQ(world.ranks_differing_from_lead(me % 2 ? "0123456789ab" : "0123456789ac"), odd);
}

TEST(DataParallel, EqualsOneProcessInF64) {
  const FluxConfig cfg = testing::tiny_demo_model();
  auto be = make_backend("cpu");
  ProcessGroups groups(MPI_COMM_WORLD, ParallelSizes{}, *be);
  DataParallel dp(groups.dp(), *be);
  const int64_t global = 8;
  if (global % (2 * world_size())) GTEST_SKIP() << "8 samples do not split into micro-batches of 2 over this job";
  const Trajectory one = train(cfg, DType::f64, global, 5, nullptr, false);
  for (const bool distributed : {false, true}) {
    SCOPED_TRACE(distributed ? "distributed optimizer" : "all-reduced gradients");
    const Trajectory many = train(cfg, DType::f64, global, 5, &dp, distributed);
    expect_close(many.losses, one.losses, 1e-12, "losses");
    expect_close(many.norms, one.norms, 1e-12, "gradient norms");
    if (!distributed) expect_close(many.first_grads, one.first_grads, 1e-12, "gradients of the first step");
    expect_close(many.weights, one.weights, 1e-12, "weights after 5 steps");
    expect_same_on_every_rank(dp, many.weights);
  }
}

// FP8: the delayed recipe's amaxes are max-reduced before the scale update, so every rank holds
// the same scales — those of one process; tensorwise scales come from tensors that are the same
// on every rank. The ranks' weights stay identical bit for bit.
TEST(DataParallel, Fp8RanksStayIdenticalAndFollowOneProcess) {
  const FluxConfig cfg = testing::tiny_demo_model();
  auto be = make_backend("cpu");
  ProcessGroups groups(MPI_COMM_WORLD, ParallelSizes{}, *be);
  DataParallel dp(groups.dp(), *be);
  const int64_t global = 8;
  if (global % (2 * world_size())) GTEST_SKIP() << "8 samples do not split into micro-batches of 2 over this job";
  for (const Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise}) {
    Fp8Config fp8 = testing::delayed_hybrid_fp8();
    fp8.recipe = recipe;
    const Trajectory one = train(cfg, DType::f32, global, 4, nullptr, false, &fp8);
    const Trajectory many = train(cfg, DType::f32, global, 4, &dp, false, &fp8);
    // Delayed scaling: the scales come from the reduced amax history, and the losses stay within
    // f32 rounding (the gradients are summed in another order) of one process's. Current
    // (tensorwise) scaling takes each weight's scale from its exact amax, where that rounding
    // moves every code of the tensor: equal for the first steps, then apart by 1e-3 at step 4.
    const size_t compared = recipe == Fp8Recipe::delayed ? one.losses.size() : 2;
    expect_close(std::vector<double>(many.losses.begin(), many.losses.begin() + compared),
                 std::vector<double>(one.losses.begin(), one.losses.begin() + compared), 1e-6, "FP8 losses");
    expect_same_on_every_rank(dp, many.weights);
  }
}

}  // namespace
}  // namespace flux8
