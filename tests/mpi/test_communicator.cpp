// The collective conformance suite (test_communicator_conformance.h) on the CPU backend: the
// one-rank group and MPI on host memory, at every size CTest runs tests/mpi at.
#include <memory>
#include <string>

#include "backend/registry.h"
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

}  // namespace flux8::testing
