#pragma once
// The processes of one job. A run started by a launcher — `mpirun -np N`, or `srun` under Slurm
// with Open MPI's PMIx — is one rank of N; a run started alone is the whole job and never touches
// MPI, so it starts and behaves exactly as a single-process program.
#include <mpi.h>

#include <string>

namespace flux8 {

struct JobPlacement {
  int rank = 0, size = 1;              // in the job
  int local_rank = 0, local_size = 1;  // among the job's ranks on this node (MPI shared-memory split)
  bool launched = false;               // MPI is initialised: a launcher started this process
};

// True when the environment says a launcher started this process (Open MPI's mpirun, PMIx, or
// Slurm's PMI), before anything is initialised.
bool launched_by_mpi();

// Initialises MPI when launched_by_mpi() (with threads: the collective watchdog runs beside the
// trainer) and finds this rank's place; a no-op placement otherwise. Idempotent.
const JobPlacement& start_job(int* argc, char*** argv);
const JobPlacement& job_placement();
// Finalises MPI if start_job initialised it.
void finish_job();
// Ends every rank of the job with `exit_code` (MPI_Abort) after printing `message` on this rank's
// stderr, prefixed with the rank; outside a launched job, exits with the code.
[[noreturn]] void abort_job(const std::string& message, int exit_code);
// "rank 3 of 8: " inside a launched job, "" outside: the prefix of this rank's messages.
std::string rank_prefix();

// Returns when every rank of a launched job has called it (no-op alone): for host work one rank
// does for all, such as generating the demo dataset, before the others read it.
void job_barrier();

// The job's ranks as an MPI communicator (MPI_COMM_WORLD; MPI_COMM_SELF before start_job).
MPI_Comm job_world();

}  // namespace flux8
