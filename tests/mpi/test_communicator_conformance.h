#pragma once
// The collective conformance suite: every communicator kind (the one-rank group, MPI on host
// memory, MPI staged through the host for CUDA tensors, NCCL) passes the same tests, run by every
// rank of MPI's world at once (tests/mpi's main initialises MPI; CTest runs the binaries at
// several world sizes). Each test makes its communicator over the world, so each kind's tests run
// at every world size the binary is started with; the one-rank group is a group of its own in
// every process.
//
// Values are small integers, so every sum is exact in every dtype (bf16 included) and results
// are compared bit for bit with a host reference. Every rank calls the same collectives in the
// same order whatever it finds, so that a failed check on one rank cannot hang the others.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "backend/backend.h"
#include "backend/communicator.h"

namespace flux8::testing {

struct CommunicatorKind {
  std::string name;  // a test-name suffix: "mpi_cpu", "nccl"
  // "" when the kind can run in this process, else why not (the test is skipped; every rank
  // finds the same answer).
  std::function<std::string()> unavailable;
  std::function<Backend&()> backend;
  // Called by every rank at once: a communicator over MPI's world (or the one-rank group).
  std::function<std::unique_ptr<Communicator>(Backend&)> make;
};

class CommunicatorConformance : public ::testing::TestWithParam<CommunicatorKind> {
 protected:
  void SetUp() override;
  Backend* be = nullptr;
  std::unique_ptr<Communicator> comm;
};

// For INSTANTIATE_TEST_SUITE_P's name generator, and gtest's printing of a test's parameter.
std::string kind_name(const ::testing::TestParamInfo<CommunicatorKind>& info);
inline void PrintTo(const CommunicatorKind& kind, std::ostream* os) { *os << kind.name; }

}  // namespace flux8::testing
