#pragma once
// The parametrised conformance test, shared by the CPU and GPU test binaries: each instantiates
// it with the variants it runs (FLUX8_CONFORMANCE_INSTANTIATE).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "conformance.h"

namespace flux8::conformance {

struct CaseOnVariant {
  size_t index;  // into all_cases()
  Variant variant;
};

// Every case on every one of `variants` where the case is meaningful.
inline std::vector<CaseOnVariant> cases_on(std::vector<Variant> variants) {
  std::vector<CaseOnVariant> out;
  for (size_t i = 0; i < all_cases().size(); ++i)
    for (Variant v : variants)
      if (all_cases()[i].with_bf16 || !variant_rounds_to_bf16(v)) out.push_back({i, v});
  return out;
}

inline std::string case_test_name(const ::testing::TestParamInfo<CaseOnVariant>& info) {
  const Case& c = all_cases()[info.param.index];
  return c.op + "_" + c.name + "_" + std::string(variant_name(info.param.variant));
}

class Conformance : public ::testing::TestWithParam<CaseOnVariant> {};

// Test names must be unique within a binary: each binary instantiates it once.
#define FLUX8_CONFORMANCE_INSTANTIATE(prefix, ...)                                                         \
  TEST_P(Conformance, MatchesTheReference) {                                                               \
    const CaseOnVariant& p = GetParam();                                                                   \
    if (const std::string why = unavailable_reason(p.variant); !why.empty())                               \
      GTEST_SKIP() << variant_name(p.variant) << " unavailable: " << why;                                  \
    const Case& c = all_cases()[p.index];                                                                  \
    const std::string failures = run_case(c, p.variant);                                                   \
    EXPECT_TRUE(failures.empty()) << c.op << " / " << c.name << " on " << variant_name(p.variant) << ":\n" \
                                  << failures;                                                             \
  }                                                                                                        \
  INSTANTIATE_TEST_SUITE_P(prefix, Conformance, ::testing::ValuesIn(cases_on({__VA_ARGS__})), case_test_name)

}  // namespace flux8::conformance
