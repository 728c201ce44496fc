#pragma once
// The finite-difference check of one gradient, for the gradient cases (GradientCase): f64 host
// buffers (tests/cpu_ops_util.h) that the CPU backend reads directly, checked along a random
// direction (tests/gradcheck.h).
#include <functional>

#include "../cpu_ops_util.h"
#include "../gradcheck.h"
#include "conformance.h"

namespace flux8::conformance {

using testing::Buf;
using testing::probe_loss;

// `grad` must have the layout of `param` (same shape and padding); padding entries of a column
// window must have zero gradient, which the check verifies as well.
inline GradientCase::Check check_gradient(const char* what, const std::function<double()>& loss, Buf<double>& param,
                                          const Buf<double>& grad, uint64_t seed) {
  if (param.mem.size() != grad.mem.size()) return {std::string(what) + ": gradient layout differs", INFINITY, 0, 0};
  const auto r = testing::check_directional_derivative(loss, param.mem, grad.mem, seed);
  return {what, r.rel_error, r.analytic, r.numeric};
}

}  // namespace flux8::conformance
