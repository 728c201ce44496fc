// Process groups: the tp x dp arrangement of the job's ranks and the MPI communicator's results.
#include <vector>

#include "backend/registry.h"
#include "dist/process_groups.h"
#include "mpi/mpi_test_util.h"

namespace flux8 {
namespace {

using testing::world_rank;
using testing::world_size;

TEST(ProcessGroups, TensorParallelRanksAreNeighbours) {
  auto be = make_backend("cpu");
  for (int tp : {1, 2, 4}) {
    if (world_size() % tp != 0) continue;
    ProcessGroups g(MPI_COMM_WORLD, ParallelSizes{.tp = tp}, *be);
    EXPECT_EQ(g.tp_size(), tp);
    EXPECT_EQ(g.dp_size(), world_size() / tp);
    EXPECT_EQ(g.tp_rank(), world_rank() % tp);
    EXPECT_EQ(g.dp_rank(), world_rank() / tp);
    EXPECT_EQ(g.tp().size(), tp);
    EXPECT_EQ(g.tp().rank(), g.tp_rank());
    EXPECT_EQ(g.dp().rank(), g.dp_rank());
    // The sum of world ranks over each group says who is in it.
    std::vector<double> v{static_cast<double>(world_rank())};
    Tensor t(v.data(), DType::f64, Shape{1});
    g.tp().all_reduce(t);
    const int first = (world_rank() / tp) * tp;
    EXPECT_EQ(v[0], tp * first + tp * (tp - 1) / 2);
  }
}

TEST(ProcessGroups, RefusesSizesThatDoNotDivide) {
  auto be = make_backend("cpu");
  if (world_size() % 3 != 0) EXPECT_ANY_THROW(ProcessGroups(MPI_COMM_WORLD, ParallelSizes{.tp = 3}, *be));
  EXPECT_ANY_THROW(ProcessGroups(MPI_COMM_WORLD, ParallelSizes{.pp = 2}, *be));
  EXPECT_ANY_THROW(ProcessGroups(MPI_COMM_WORLD, ParallelSizes{.cp = 2}, *be));
}

TEST(MpiCommunicator, RankOrderedSumIsIdenticalOnEveryRank) {
  auto be = make_backend("cpu");
  ProcessGroups g(MPI_COMM_WORLD, ParallelSizes{}, *be);
  // Values whose sum depends on the order: every rank must hold the same bits, those of the
  // rank-ordered sum.
  const int n = 1001;
  std::vector<float> v(n), expect(n, 0.f);
  for (int i = 0; i < n; ++i) v[i] = 1.f / static_cast<float>(3 + i + 7 * world_rank());
  for (int i = 0; i < n; ++i)
    for (int r = 0; r < world_size(); ++r) expect[i] += 1.f / static_cast<float>(3 + i + 7 * r);
  g.world().all_reduce(Tensor(v.data(), DType::f32, Shape{n}));
  for (int i = 0; i < n; ++i) ASSERT_EQ(v[i], expect[i]) << i;
}

}  // namespace
}  // namespace flux8
