// The backend registry: the implementations linked into a program register themselves, and
// make_backend creates them by name without the caller depending on any of them.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "backend/registry.h"
#include "core/error.h"
#include "test_util.h"

namespace flux8 {
namespace {

bool registered(const std::string& name) {
  const auto& all = registered_backends();
  return std::any_of(all.begin(), all.end(), [&](const BackendEntry& e) { return e.name == name; });
}

TEST(BackendRegistry, HoldsTheBackendsOfThisBuild) {
  EXPECT_TRUE(registered("cpu"));
#if FLUX8_HAVE_CUDA
  EXPECT_TRUE(registered("cuda"));
#else
  EXPECT_FALSE(registered("cuda"));
  testing::expect_refused("this build of flux8 has no CUDA backend", [] { make_backend("cuda"); });
#endif
  EXPECT_EQ(make_backend("cpu")->name(), "cpu");
}

TEST(BackendRegistry, RefusesASecondBackendOfTheSameName) {
  testing::expect_refused("backend 'cpu' registered twice", [] {
    register_backend(BackendEntry{.name = "cpu",
                                  .create = registered_backends().front().create,
                                  .unavailable_reason = [] { return std::string(); }});
  });
}

// The CPU backend's ops (its attention backward too) sum in a fixed order whatever
// deterministic_attention says, so runs repeat bit for bit.
TEST(BackendRegistry, CpuRepeatsBitForBit) {
  BackendOptions fast;
  fast.deterministic_attention = false;
  EXPECT_TRUE(make_backend("cpu", fast)->repeats_bit_for_bit());
}

}  // namespace
}  // namespace flux8
