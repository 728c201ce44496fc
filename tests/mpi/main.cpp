// The tests/mpi suite's main: every rank runs every test; tests agree through collectives. Only
// rank 0 prints the full report; the other ranks print their failures, each line prefixed with
// the rank, so one interleaved log stays readable.
#include <gtest/gtest.h>

#include <cstdio>

#include "dist/mpi_runtime.h"

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "%s%s:%d: failure\n%s\n", flux8::rank_prefix().c_str(), r.file_name() ? r.file_name() : "?",
                 r.line_number(), r.summary());
  }
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const flux8::JobPlacement& job = flux8::start_job(&argc, &argv);
  if (job.rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter);
  }
  const int rc = RUN_ALL_TESTS();
  flux8::finish_job();
  return rc;
}
