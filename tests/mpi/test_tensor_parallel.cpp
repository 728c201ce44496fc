// Tensor parallelism across MPI ranks (CPU backend, f64): the model split over the job's
// tensor-parallel groups (2 ranks, and at 4 ranks TP=2 x DP=2 and TP=4) against the whole model,
// which every rank also runs on its own. Each rank checks its shards of every gradient against
// the same shards of the whole model's (and, after AdamW steps, of its parameters) within 1e-12,
// and that what it holds whole — the prediction, the replicated tensors' gradients — is the same
// bits as on the other ranks of its group.
#include <string>
#include <vector>

#include "backend/registry.h"
#include "dist/process_groups.h"
#include "mpi/mpi_test_util.h"
#include "test_tp_util.h"

namespace flux8 {
namespace {

using testing::full_params;
using testing::RankResult;
using testing::run_rank;
using testing::tp_config;
using testing::TpOptions;
using testing::Values;
using testing::world_size;

// The whole model's tensors cut to this rank's shards.
Values shards_of(const FluxConfig& cfg, int tp_rank, int tp_size, const Values& whole) {
  const ParamLayout layout = ParamLayout::build(cfg, tp_rank, tp_size);
  Values out;
  for (size_t i = 0; i < whole.size(); ++i) {
    const ParamShard& s = layout.params()[i].shard;
    out.emplace_back(whole[i].first, s.sharded() ? take_shard(s, tp_rank, whole[i].second) : whole[i].second);
  }
  return out;
}

// `values` are the same bits on every rank of `group`: rank 0's, broadcast, against this rank's.
void expect_same_on_every_rank(Communicator& group, const std::vector<double>& values, const std::string& what) {
  std::vector<double> root = values;
  group.broadcast(Tensor(root.data(), DType::f64, Shape{static_cast<int64_t>(root.size())}), 0);
  EXPECT_EQ(values, root) << what << " differs from tensor-parallel rank 0's";
}

void expect_tp_matches_whole_model(int tp, const FluxConfig& cfg, const TpOptions& o) {
  if (world_size() % tp != 0) GTEST_SKIP() << "needs a multiple of " << tp << " ranks";
  auto be = make_backend("cpu");
  ProcessGroups groups(MPI_COMM_WORLD, ParallelSizes{.tp = tp}, *be);
  const Values full = full_params(cfg, o.dtype);
  const RankResult whole = run_rank(cfg, TensorParallel{}, o, full);
  const RankResult mine = run_rank(cfg, TensorParallel{&groups.tp()}, o, full);
  const int r = groups.tp_rank();
  EXPECT_LE(testing::max_rel_error(mine.pred, whole.pred), 1e-12) << "prediction";
  testing::expect_close(mine.grads, shards_of(cfg, r, tp, whole.grads), 1e-12, "gradient");
  if (o.optimizer) testing::expect_close(mine.params, shards_of(cfg, r, tp, whole.params), 1e-12, "parameter");

  std::vector<double> replicated = mine.pred;
  const ParamLayout layout = ParamLayout::build(cfg, r, tp);
  for (size_t i = 0; i < layout.params().size(); ++i)
    if (!layout.params()[i].shard.sharded())
      replicated.insert(replicated.end(), mine.grads[i].second.begin(), mine.grads[i].second.end());
  expect_same_on_every_rank(groups.tp(), replicated, "the prediction or a replicated gradient");
}

TEST(TensorParallel, TwoRanksEqualTheWholeModel) { expect_tp_matches_whole_model(2, tp_config(2, 2), {}); }

TEST(TensorParallel, FourRanksEqualTheWholeModel) { expect_tp_matches_whole_model(4, tp_config(1, 1), {}); }

TEST(TensorParallel, FullRecomputeEqualsTheWholeModel) {
  expect_tp_matches_whole_model(2, tp_config(1, 1), {.recompute = Recompute::full});
}

TEST(TensorParallel, FiveAdamWStepsEqualTheWholeModel) {
  expect_tp_matches_whole_model(2, tp_config(1, 1), {.steps = 5, .optimizer = true});
}

}  // namespace
}  // namespace flux8
