#include "dist/process_groups.h"

#include <fmt/core.h>

#include <cstdlib>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "dist/mpi_communicator.h"
#include "dist/mpi_runtime.h"
#include "dist/watchdog.h"

namespace flux8 {

namespace {
std::vector<DeviceCommunicatorFactory>& device_factories() {
  static std::vector<DeviceCommunicatorFactory> f;
  return f;
}
// FLUX8_COMM: "mpi", "nccl", or "" (unset: the device's own where there is one).
std::string_view communicator_choice() {
  const char* value = std::getenv("FLUX8_COMM");
  const std::string_view choice = value ? value : "";
  if (!choice.empty() && choice != "mpi" && choice != "nccl")
    fail("FLUX8_COMM={}: expected mpi (host-staged, several ranks may share a GPU) or nccl", choice);
  return choice;
}
}  // namespace

void register_device_communicator(DeviceCommunicatorFactory factory) {
  device_factories().push_back(std::move(factory));
}

void place_on_node(BackendOptions& options) {
  const JobPlacement& job = job_placement();
  if (!job.launched) return;
  options.device = job.local_rank;
  options.share_device = communicator_choice() == "mpi";
}

int ParallelSizes::dp_for(int world) const {
  if (pp != 1)
    fail(
        "pipeline_model_parallel_size: {} is not supported (flux8 splits a model by tensor parallelism only); set it "
        "to 1",
        pp);
  if (cp != 1)
    fail("context_parallel_size: {} is not supported (sequences are not split across ranks); set it to 1", cp);
  if (tp < 1) fail("tensor_model_parallel_size: {} must be at least 1", tp);
  if (world % tp != 0)
    fail(
        "tensor_model_parallel_size: {} does not divide the job's {} ranks; launch a multiple of {} ranks or change "
        "it",
        tp, world, tp);
  return world / tp;
}

std::unique_ptr<Communicator> make_group_communicator(MPI_Comm comm, Backend& be, const std::string& what) {
  // MPI collectives block the calling thread: the watchdog times each from its call to its return.
  auto mpi = [&](Device* device) {
    return watch_host_collectives(std::make_unique<MpiCommunicator>(comm, device, what), collective_watchdog());
  };
  if (be.memory_is_host()) return mpi(nullptr);
  const std::string_view choice = communicator_choice();
  if (choice != "mpi")
    for (const DeviceCommunicatorFactory& f : device_factories())
      if (auto c = f(comm, be, what)) return c;
  if (choice == "nccl") fail("FLUX8_COMM=nccl: this build has no NCCL communicator for the {} backend", be.name());
  return mpi(&be);
}

ProcessGroups::ProcessGroups(MPI_Comm world, const ParallelSizes& sizes, Backend& be) {
  if (world == MPI_COMM_NULL) {
    sizes.dp_for(1);  // the same checks as a launched job's
    world_ = make_single_rank_communicator(be, "world");
    tp_ = make_single_rank_communicator(be, "tensor-parallel");
    dp_ = make_single_rank_communicator(be, "data-parallel");
    return;
  }
  MPI_Comm_rank(world, &world_rank_);
  MPI_Comm_size(world, &world_size_);
  sizes.dp_for(world_size_);
  tp_size_ = sizes.tp;
  world_ = make_group_communicator(world, be, "world");
  MPI_Comm tp_comm, dp_comm;
  MPI_Comm_split(world, world_rank_ / tp_size_, world_rank_, &tp_comm);
  MPI_Comm_split(world, world_rank_ % tp_size_, world_rank_, &dp_comm);
  tp_ = make_group_communicator(tp_comm, be, "tensor-parallel");
  dp_ = make_group_communicator(dp_comm, be, "data-parallel");
  MPI_Comm_free(&tp_comm);
  MPI_Comm_free(&dp_comm);
}

ProcessGroups::~ProcessGroups() = default;

std::string ProcessGroups::describe() const {
  return fmt::format("TP={} x DP={} ({} rank{})", tp_size_, dp_size(), world_size_, world_size_ == 1 ? "" : "s");
}

}  // namespace flux8
