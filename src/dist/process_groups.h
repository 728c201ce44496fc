#pragma once
// The job's ranks arranged as tensor-parallel groups × data-parallel groups, and a Communicator
// for each group this rank belongs to. Tensor-parallel groups are neighbouring ranks (rank / tp
// the same: within a node when a node's GPUs are a multiple of tp), data-parallel groups the
// ranks with the same place in their tensor-parallel group:
//   rank = dp_rank * tp + tp_rank.
#include <mpi.h>

#include <functional>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "backend/communicator.h"

namespace flux8 {

// How a job is split (the Megatron keys of the same names).
struct ParallelSizes {
  int tp = 1;  // tensor_model_parallel_size
  int pp = 1;  // pipeline_model_parallel_size: 1 only
  int cp = 1;  // context_parallel_size: 1 only
  // The data-parallel size of a job of `world` ranks; fails naming what does not divide.
  int dp_for(int world) const;
};

class ProcessGroups {
 public:
  // The groups of a job whose ranks are those of `world` (a launched job's MPI_COMM_WORLD, or
  // MPI_COMM_NULL: a process alone, with one-rank groups and no MPI at all); collectives on
  // tensors in `be`'s memory.
  ProcessGroups(MPI_Comm world, const ParallelSizes& sizes, Backend& be);
  ~ProcessGroups();
  ProcessGroups(const ProcessGroups&) = delete;
  ProcessGroups& operator=(const ProcessGroups&) = delete;

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  int tp_rank() const { return world_rank_ % tp_size_; }
  int tp_size() const { return tp_size_; }
  int dp_rank() const { return world_rank_ / tp_size_; }
  int dp_size() const { return world_size_ / tp_size_; }
  bool distributed() const { return world_size_ > 1; }
  // "TP=2 x DP=4 (8 ranks, NCCL)", for the log.
  std::string describe() const;

  Communicator& world() { return *world_; }
  Communicator& tp() { return *tp_; }
  Communicator& dp() { return *dp_; }

 private:
  int world_rank_ = 0, world_size_ = 1, tp_size_ = 1;
  std::unique_ptr<Communicator> world_, tp_, dp_;
};

// A launched rank's device: its index among the job's ranks on its node, shared with other
// ranks (wrapping around the node's GPUs) only with FLUX8_COMM=mpi. Unchanged outside a job.
void place_on_node(BackendOptions& options);

// The communicator of one group over `comm` for tensors in `be`'s memory: MPI on host memory;
// on a device, the device's own communicator where one is registered (NCCL) unless the
// environment says FLUX8_COMM=mpi, else MPI staged through host buffers.
std::unique_ptr<Communicator> make_group_communicator(MPI_Comm comm, Backend& be, const std::string& what);

// A device communicator implementation (src/dist/nccl registers NCCL's for the CUDA backend):
// returns null for a backend it does not serve.
using DeviceCommunicatorFactory =
    std::function<std::unique_ptr<Communicator>(MPI_Comm comm, Backend& be, const std::string& what)>;
void register_device_communicator(DeviceCommunicatorFactory factory);

}  // namespace flux8
