// NCCL as the device communicator of the CUDA backend (dist/process_groups.h): a group of ranks
// training on GPUs collects through NCCL unless FLUX8_COMM=mpi.
#include <mpi.h>

#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "dist/nccl/nccl_communicator.h"
#include "dist/process_groups.h"
#include "dist/watchdog.h"

namespace flux8 {

namespace {

std::unique_ptr<Communicator> make_for_cuda(MPI_Comm comm, Backend& backend, const std::string& what) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  if (!cuda) return nullptr;
  NcclGroup group;
  group.name = what;
  MPI_Comm_rank(comm, &group.rank);
  MPI_Comm_size(comm, &group.size);
  group.share_from_first_rank = [comm, what](void* data, size_t bytes) {
    if (MPI_Bcast(data, static_cast<int>(bytes), MPI_BYTE, 0, comm) != MPI_SUCCESS)
      fail(
          "{} group (NCCL): sharing NCCL's unique id over MPI failed (another rank of the job may have failed; its "
          "message says why)",
          what);
  };
  return make_nccl_communicator(*cuda, group, collective_watchdog());
}

const bool registered = [] {
  register_device_communicator(make_for_cuda);
  return true;
}();

}  // namespace

}  // namespace flux8
