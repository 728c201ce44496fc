#include "dist/mpi_runtime.h"

#include <fmt/core.h>

#include <cstdio>
#include <cstdlib>

#include "core/error.h"

namespace flux8 {

namespace {
JobPlacement g_placement;
bool g_initialised_here = false;

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  fail("MPI: {} failed: {}", what, std::string(text, static_cast<size_t>(len)));
}
}  // namespace

bool launched_by_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(var)) return true;
  return false;
}

const JobPlacement& start_job(int* argc, char*** argv) {
  int already = 0;
  MPI_Initialized(&already);
  if (already || !launched_by_mpi()) {
    if (already) g_placement.launched = true;
    return g_placement;
  }
  int provided = 0;
  check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  g_initialised_here = true;
  // Errors come back as codes and become exceptions that name the rank, never a silent abort.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  JobPlacement p;
  p.launched = true;
  MPI_Comm_rank(MPI_COMM_WORLD, &p.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &p.size);
  MPI_Comm node;
  check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, p.rank, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type (the ranks of this node)");
  MPI_Comm_rank(node, &p.local_rank);
  MPI_Comm_size(node, &p.local_size);
  MPI_Comm_free(&node);
  g_placement = p;
  return g_placement;
}

const JobPlacement& job_placement() { return g_placement; }

void finish_job() {
  if (!g_initialised_here) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
  g_initialised_here = false;
}

std::string rank_prefix() {
  if (!g_placement.launched) return "";
  return fmt::format("rank {} of {}: ", g_placement.rank, g_placement.size);
}

void abort_job(const std::string& message, int exit_code) {
  std::fprintf(stderr, "%s%s\n", rank_prefix().c_str(), message.c_str());
  std::fflush(stderr);
  int initialised = 0, finalized = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalized);
  if (initialised && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

void job_barrier() {
  if (g_placement.launched) check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier (waiting for the job's ranks)");
}

MPI_Comm job_world() { return g_placement.launched ? MPI_COMM_WORLD : MPI_COMM_SELF; }

}  // namespace flux8
