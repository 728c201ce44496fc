// The collective conformance suite (test_communicator_conformance.h) on the CPU backend: the
// one-rank group and MPI on host memory, at every size CTest runs tests/mpi at.
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/registry.h"
#include "backend_buffer.h"
#include "dist/process_groups.h"
#include "mpi/mpi_test_util.h"
#include "mpi/test_communicator_conformance.h"

namespace flux8::testing {

namespace {

Backend& cpu_backend() {
  static std::unique_ptr<Backend> be = make_backend("cpu");
  return *be;
}

std::string needs_launcher() {
  return job_placement().launched ? "" : "MPI is not running: start the suite with mpirun (CTest does)";
}

const CommunicatorKind kSingleRank{
    .name = "single_rank_cpu",
    .unavailable = [] { return std::string(); },
    .backend = cpu_backend,
    .make = [](Backend& be) { return make_single_rank_communicator(be, "one-rank"); },
};

const CommunicatorKind kMpiHost{
    .name = "mpi_cpu",
    .unavailable = needs_launcher,
    .backend = cpu_backend,
    .make = [](Backend& be) { return make_group_communicator(MPI_COMM_WORLD, be, "world"); },
};

}  // namespace

INSTANTIATE_TEST_SUITE_P(Cpu, CommunicatorConformance, ::testing::Values(kSingleRank, kMpiHost), kind_name);

TEST(CommunicatorSelection, TheCpuBackendCollectsWithMpiOnHostMemory) {
  if (const std::string why = needs_launcher(); !why.empty()) GTEST_SKIP() << why;
  const auto comm = make_group_communicator(MPI_COMM_WORLD, cpu_backend(), "world");
  EXPECT_NE(comm->describe().find("MPI"), std::string::npos) << comm->describe();
  EXPECT_EQ(comm->describe().find("host-staged"), std::string::npos) << comm->describe();
  EXPECT_EQ(comm->size(), world_size());
  EXPECT_EQ(comm->rank(), world_rank());
}

// The distributed optimizer reduces a gradient bucket to the ranks whose shards it meets, where
// the plain one all-reduces it: the same rank-ordered sums, so the two give the same bits.
TEST(CommunicatorSelection, MpiReduceGivesTheBitsOfAllReduceAndReduceScatter) {
  if (const std::string why = needs_launcher(); !why.empty()) GTEST_SKIP() << why;
  const auto comm = make_group_communicator(MPI_COMM_WORLD, cpu_backend(), "world");
  const int size = comm->size(), rank = comm->rank();
  const int64_t n = 100003;
  std::vector<float> values(static_cast<size_t>(n * size));
  std::mt19937 rng(99u + static_cast<unsigned>(rank));
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (float& v : values) v = uniform(rng);
  const size_t bytes = values.size() * sizeof(float);
  BackendBuffer all(cpu_backend(), DType::f32, n * size), scattered(cpu_backend(), DType::f32, n),
      rooted(cpu_backend(), DType::f32, n * size);
  std::memcpy(all.mem, values.data(), bytes);
  std::memcpy(rooted.mem, values.data(), bytes);
  comm->reduce_scatter(scattered.t, all.t);
  comm->all_reduce(all.t);
  // Slice r reduced to rank r: this rank's slice then holds what the other two give it.
  for (int r = 0; r < size; ++r) comm->reduce(Tensor(static_cast<float*>(rooted.mem) + r * n, DType::f32, Shape{n}), r);
  const float* mine = static_cast<const float*>(rooted.mem) + rank * n;
  EXPECT_EQ(0, std::memcmp(mine, static_cast<const float*>(all.mem) + rank * n, static_cast<size_t>(n) * 4))
      << comm->describe() << ": reduce and all_reduce sums differ";
  EXPECT_EQ(0, std::memcmp(mine, scattered.mem, static_cast<size_t>(n) * 4))
      << comm->describe() << ": reduce and reduce_scatter sums differ";
}

}  // namespace flux8::testing
