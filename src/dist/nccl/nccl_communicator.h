#pragma once
// Collectives on CUDA device tensors through NCCL: one ncclComm per group, made from a unique id
// that the group's rank 0 draws and shares (over MPI), on a CUDA stream of the communicator's own.
//
// Ordering with the backend's ops (backend/communicator.h): a collective waits, on its stream, for
// an event recorded after the ops queued before the call; the backend's later ops wait for the
// collective's completion event, or, when it is `async`, only at join(). Both go through the
// backend's record_event and wait_event, so an op interceptor issues what it holds first.
//
// Bounded waits: the communicator is non-blocking (ncclConfig_t::blocking = 0). A call that NCCL
// leaves in progress (the set-up, a first connection to a peer) is polled against the collective
// timeout and fails naming the group and rank; every collective on the stream is watched by the
// process's CollectiveWatchdog (dist/watchdog.h) until its completion event fires, and an
// asynchronous NCCL error ends the job the same way. The job's end aborts the communicator
// (ncclCommAbort) so that its kernels let the process go.
//
// Sums: NCCL picks its algorithm (ring, tree) and channel count from the sizes and the machines'
// topology, the same on every run of one layout: repeated runs give the same bits there, and
// NCCL_ALGO / NCCL_PROTO fix the choice across layouts where that matters.
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "backend/communicator.h"

namespace flux8 {

class CudaBackend;
class CollectiveWatchdog;

// What a rank needs to join an NCCL group: the group's name, its place in it, and how the group's
// rank 0 shares NCCL's unique id (registration.cpp: MPI_Bcast over the group's MPI communicator).
struct NcclGroup {
  std::string name;  // "data-parallel", for logs and errors
  int rank = 0, size = 1;
  // Copies `bytes` at `data` from the group's rank 0 to every rank; every rank calls it once.
  // Needed when size > 1.
  std::function<void(void* data, size_t bytes)> share_from_first_rank;
};

// Joins `group` (every rank of it calls this at the same time, in the same order as its other
// groups) on `backend`'s device. Fails naming the group and rank when NCCL cannot set it up in the
// watchdog's timeout.
std::unique_ptr<Communicator> make_nccl_communicator(CudaBackend& backend, const NcclGroup& group,
                                                     CollectiveWatchdog& watchdog);

}  // namespace flux8
