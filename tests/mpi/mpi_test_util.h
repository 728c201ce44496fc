#pragma once
// tests/mpi: the job the suite runs in (tests/mpi/main.cpp started it under mpirun).
#include <gtest/gtest.h>
#include <mpi.h>

#include "dist/mpi_runtime.h"

namespace flux8::testing {

inline int world_rank() { return job_placement().rank; }
inline int world_size() { return job_placement().size; }

// Skips the calling test unless the job has `n` ranks (the suite runs at several sizes).
#define FLUX8_REQUIRE_RANKS(n)                                                             \
  do {                                                                                     \
    if (::flux8::testing::world_size() != (n)) GTEST_SKIP() << "needs mpirun -np " << (n); \
  } while (0)

}  // namespace flux8::testing
