#pragma once
// tests/mpi: the job the suite runs in (tests/mpi/main.cpp started it under mpirun).
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "dist/mpi_runtime.h"

namespace flux8::testing {

inline int world_rank() { return job_placement().rank; }
inline int world_size() { return job_placement().size; }

// Skips the calling test unless the job has `n` ranks (the suite runs at several sizes).
#define FLUX8_REQUIRE_RANKS(n)                                                             \
  do {                                                                                     \
    if (::flux8::testing::world_size() != (n)) GTEST_SKIP() << "needs mpirun -np " << (n); \
  } while (0)

// A temporary directory every rank of the job names the same (rank 0's pid, `tag` telling the
// tests apart), removed at the end.
class SharedDir {
 public:
  explicit SharedDir(const std::string& tag) {
    int pid = static_cast<int>(::getpid());
    MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
    path_ = std::filesystem::temp_directory_path() / ("flux8_" + tag + "_" + std::to_string(pid));
    if (world_rank() == 0) std::filesystem::remove_all(path_);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  ~SharedDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) std::filesystem::remove_all(path_);
  }
  SharedDir(const SharedDir&) = delete;
  SharedDir& operator=(const SharedDir&) = delete;
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline std::string file_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

}  // namespace flux8::testing
