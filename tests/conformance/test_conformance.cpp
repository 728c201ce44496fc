// The conformance table on the CPU backend (f32, and f32 with bf16 activation rounding), the
// gradient checks in f64, and the rule that no op of FLUX8_OPS goes without a case.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "backend/ops.h"
#include "conformance_test.h"

namespace flux8::conformance {
namespace {

FLUX8_CONFORMANCE_INSTANTIATE(Cpu, Variant::cpu_f32, Variant::cpu_bf16_rounding);

TEST(ConformanceTable, EveryListedOpHasACase) {
  std::set<std::string> covered;
  for (const Case& c : all_cases()) covered.insert(c.op);
  std::string missing;
  for (const std::string& op : listed_ops())
    if (!covered.count(op)) missing += " " + op;
  EXPECT_TRUE(missing.empty()) << "ops of FLUX8_OPS (backend/ops.h) without a conformance case (add one in "
                                  "tests/conformance/<family>_cases.cpp):"
                               << missing;
}

TEST(ConformanceTable, EveryCaseNamesAListedOpAndItsTolerance) {
  const std::vector<std::string> ops = listed_ops();
  std::set<std::string> names;
  for (const Case& c : all_cases()) {
    EXPECT_NE(std::find(ops.begin(), ops.end(), c.op), ops.end()) << c.op << " is not in FLUX8_OPS";
    EXPECT_TRUE(names.insert(c.op + "_" + c.name).second) << c.op << " / " << c.name << " registered twice";
    EXPECT_FALSE(c.why.empty()) << c.op << " / " << c.name << ": say where the tolerance comes from";
  }
}

// Every backward op (and linear_dgrad_gelu, the input gradient through linear_gelu's GELU) has a
// finite-difference check (the FP8 ones, with casts in between, have no f64 path: their cases
// compare them with the CPU backend).
TEST(ConformanceTable, EveryBackwardHasAGradientCheck) {
  std::set<std::string> checked;
  for (const GradientCase& g : all_gradient_cases()) checked.insert(g.backward);
  std::string missing;
  for (const std::string& op : listed_ops()) {
    const bool backward = op.ends_with("_backward") || op == "linear_dgrad_gelu";
    if (backward && op.find("fp8") == std::string::npos && !checked.count(op)) missing += " " + op;
  }
  EXPECT_TRUE(missing.empty()) << "backward ops without a gradient check:" << missing;
}

// The judge itself: a stray write into padding or past a buffer, an output left unwritten and a
// wrong value each fail a case (faulty cases built here, not registered).
TEST(ConformanceTable, TheRunnerCatchesStrayWritesUnwrittenOutputsAndWrongValues) {
  const auto fill_case = [](Shape seen) {
    return Case{.op = "fill", .name = "faulty", .why = "exact", .build = [seen](conformance::Run& r) -> AnyOp {
                  Tensor y = r.output("y", {5, 7}, 2);
                  y.shape = seen;  // the op sees another shape than the buffer has
                  return op::Fill{.y = y, .value = 1.0};
                }};
  };
  EXPECT_NE(run_case(fill_case({5, 8}), Variant::cpu_f32).find("padding columns"), std::string::npos);
  EXPECT_NE(run_case(fill_case({6, 7}), Variant::cpu_f32).find("written past its end"), std::string::npos);
  EXPECT_NE(run_case(fill_case({4, 7}), Variant::cpu_f32).find("is NaN"), std::string::npos);
  EXPECT_EQ(run_case(fill_case({5, 7}), Variant::cpu_f32), "");
  const Case wrong{
      .op = "add", .name = "faulty", .f32_terms = 2, .why = "one rounding", .build = [](conformance::Run& r) -> AnyOp {
        // The reference adds other values than the variant does.
        return op::Add{
            .y = r.output("y", {3, 5}), .a = r.input({3, 5}, 1), .b = r.input({3, 5}, r.compute == DType::f64 ? 2 : 3)};
      }};
  EXPECT_NE(run_case(wrong, Variant::cpu_f32).find("normalised error"), std::string::npos);
}

class Gradient : public ::testing::TestWithParam<size_t> {};

// Central differences in f64 of a random projection of the forward's output (tests/gradcheck.h:
// a correct gradient agrees to ~1e-10, a wrong one is off by ≳1e-2).
TEST_P(Gradient, MatchesFiniteDifferences) {
  static std::unique_ptr<Backend> cpu = make_backend("cpu");
  const GradientCase& g = all_gradient_cases()[GetParam()];
  for (const GradientCase::Check& c : g.run(*cpu))
    EXPECT_LT(c.rel_error, 1e-6) << g.backward << ": " << c.what << ": analytic " << c.analytic << ", numeric "
                                 << c.numeric;
}

INSTANTIATE_TEST_SUITE_P(Cpu, Gradient, ::testing::Range(size_t{0}, all_gradient_cases().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           const GradientCase& g = all_gradient_cases()[info.param];
                           return g.forward + "_" + g.backward;
                         });

}  // namespace
}  // namespace flux8::conformance
