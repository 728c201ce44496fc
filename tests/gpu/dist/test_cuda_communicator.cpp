// The collective conformance suite (tests/mpi/test_communicator_conformance.h) on the CUDA
// backend: NCCL, which needs a GPU per rank, and MPI staged through host memory, which lets
// several ranks share one GPU (FLUX8_COMM=mpi). Run under mpirun with tests/mpi's main (CTest:
// gpu.dist.*); every test skips itself without a usable GPU.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/cuda/factory.h"
#include "backend/registry.h"
#include "backend/step_graph.h"
#include "backend_buffer.h"
#include "dist/process_groups.h"
#include "mpi/mpi_test_util.h"
#include "mpi/test_communicator_conformance.h"

namespace flux8::testing {

namespace {

int gpu_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

std::string no_gpu() {
  if (const std::string why = cuda_unavailable_reason(); !why.empty()) return "no usable GPU: " + why;
  if (!job_placement().launched) return "MPI is not running: start the suite with mpirun (CTest does)";
  return "";
}

// NCCL refuses two ranks on one device.
std::string fewer_gpus_than_ranks() {
  if (std::string why = no_gpu(); !why.empty()) return why;
  if (gpu_count() < job_placement().local_size)
    return fmt::format(
        "NCCL needs a GPU per rank: {} ranks on this node, {} GPUs (FLUX8_COMM=mpi stages them "
        "through the host)",
        job_placement().local_size, gpu_count());
  return "";
}

// The rank's GPU, as the trainer picks it: its local rank's, the ranks wrapping around the GPUs
// where there are fewer (the host-staged kind; the NCCL kind skips itself there).
Backend& cuda_backend() {
  static std::unique_ptr<Backend> be = [] {
    BackendOptions options;
    options.device = job_placement().local_rank;
    options.share_device = true;
    return make_backend("cuda", options);
  }();
  return *be;
}

// make_group_communicator over the world with FLUX8_COMM set to `choice` for the call.
std::unique_ptr<Communicator> world_with(const char* choice, Backend& be) {
  const char* saved = std::getenv("FLUX8_COMM");
  const std::optional<std::string> restore = saved ? std::optional<std::string>(saved) : std::nullopt;
  setenv("FLUX8_COMM", choice, 1);
  auto comm = make_group_communicator(MPI_COMM_WORLD, be, "world");
  if (restore)
    setenv("FLUX8_COMM", restore->c_str(), 1);
  else
    unsetenv("FLUX8_COMM");
  return comm;
}

const CommunicatorKind kNccl{
    .name = "nccl_cuda",
    .unavailable = fewer_gpus_than_ranks,
    .backend = cuda_backend,
    .make = [](Backend& be) { return world_with("nccl", be); },
};

const CommunicatorKind kMpiStaged{
    .name = "mpi_staged_cuda",
    .unavailable = no_gpu,
    .backend = cuda_backend,
    .make = [](Backend& be) { return world_with("mpi", be); },
};

}  // namespace

INSTANTIATE_TEST_SUITE_P(Cuda, CommunicatorConformance, ::testing::Values(kNccl, kMpiStaged), kind_name);

// What the trainer gets: NCCL by default, MPI staged through the host under FLUX8_COMM=mpi.
TEST(CudaCommunicatorSelection, FollowsFlux8Comm) {
  if (const std::string why = no_gpu(); !why.empty()) GTEST_SKIP() << why;
  const char* choice = std::getenv("FLUX8_COMM");
  if (choice && std::string(choice) == "mpi") {
    const auto comm = make_group_communicator(MPI_COMM_WORLD, cuda_backend(), "world");
    EXPECT_NE(comm->describe().find("host-staged"), std::string::npos) << comm->describe();
    return;
  }
  if (const std::string why = fewer_gpus_than_ranks(); !why.empty()) GTEST_SKIP() << why;
  const auto comm = make_group_communicator(MPI_COMM_WORLD, cuda_backend(), "world");
  EXPECT_NE(comm->describe().find("NCCL"), std::string::npos) << comm->describe();
  EXPECT_EQ(comm->rank(), world_rank());
  EXPECT_EQ(comm->size(), world_size());
}

// The NCCL communicator's set-up and a first collective wait for the other ranks within the
// collective timeout, and the communicator is released cleanly: made and dropped repeatedly.
TEST(CudaCommunicatorSelection, NcclCommunicatorsComeAndGo) {
  if (const std::string why = fewer_gpus_than_ranks(); !why.empty()) GTEST_SKIP() << why;
  for (int i = 0; i < 3; ++i) {
    const auto comm = world_with("nccl", cuda_backend());
    comm->barrier();
  }
}

// With the trainer's graph recorder on the backend (cuda_graph), a collective between recorded ops
// reads what the ops before it wrote and is read by the ops after it: the recorder issues what it
// holds before the collective's events, and the ops after go into a graph of their own. Repeated
// so that the segments are captured and launched as graphs, not only run op by op.
TEST(CudaCommunicatorSelection, CollectivesBetweenGraphedOpsKeepTheirOrder) {
  if (const std::string why = no_gpu(); !why.empty()) GTEST_SKIP() << why;
  for (const char* choice : {"nccl", "mpi"}) {
    if (std::string(choice) == "nccl" && !fewer_gpus_than_ranks().empty()) continue;
    Backend& be = cuda_backend();
    const auto comm = world_with(choice, be);
    const int64_t n = 100003;
    BackendBuffer src(be, DType::f32, n), a(be, DType::f32, n), b(be, DType::f32, n);
    std::vector<float> values(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>(i)] = static_cast<float>((i + comm->rank()) % 17);
    be.upload(src.mem, values.data(), src.t.bytes());
    StepGraph graph(be);
    for (int round = 0; round < 4; ++round) {
      be.fill(b.t, 0.0);
      StepGraph::Region region(&graph);
      be.copy(a.t, src.t);
      comm->all_reduce(a.t);
      be.copy(b.t, a.t);
      region.end();
      std::vector<float> got(static_cast<size_t>(n));
      be.download(got.data(), b.mem, b.t.bytes());
      int64_t wrong = 0;
      for (int64_t i = 0; i < n; ++i) {
        float want = 0;
        for (int r = 0; r < comm->size(); ++r) want += static_cast<float>((i + r) % 17);
        wrong += got[static_cast<size_t>(i)] != want;
      }
      EXPECT_EQ(wrong, 0) << comm->describe() << ", round " << round;
    }
    EXPECT_GT(graph.stats().launched, 0) << "no segment was launched as a graph";
  }
}

}  // namespace flux8::testing
