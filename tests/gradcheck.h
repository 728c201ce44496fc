#pragma once
// Finite-difference gradient checking along a random direction, for ops and whole models run
// in double precision on the CPU backend.
//
// Given a loss L(p) evaluated in double and an analytic gradient g = ∂L/∂p, pick a random
// direction u and compare the analytic directional derivative g·u with the central difference
//   (L(p + h·u) − L(p − h·u)) / 2h.
// With f64 and h ≈ 1e-5 the truncation error is O(h²·|L'''|) ≈ 1e-10 and the rounding error is
// O(ε·|L|/h) ≈ 1e-16/1e-5 = 1e-11 (relative to the loss scale), so a correct gradient agrees to
// about 1e-10 relative (the op checks measure 1e-12 to 1e-10); 1e-6 leaves margin, while a
// real mistake (a missing term, a wrong index, a transposed operand) gives 1e-2 or more.
// One random direction checks every component at once: a wrong component j changes g·u by
// (error_j)·u_j, which a Gaussian u almost surely does not cancel.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "core/rng.h"

namespace flux8::testing {

struct DirectionalCheck {
  double analytic = 0;   // g·u
  double numeric = 0;    // central difference
  double rel_error = 0;  // |analytic − numeric| / max(|analytic|, |numeric|, abs_floor)
};

// `loss` reads `values` (it is re-evaluated with values perturbed in place; they are restored
// before returning). `grad` has the layout of `values`; entries the loss does not depend on
// (padding of a column window, for example) must have zero gradient, which the check then
// verifies as well. `abs_floor` keeps the relative error meaningful when the true derivative
// is zero.
inline DirectionalCheck check_directional_derivative(const std::function<double()>& loss, std::span<double> values,
                                                     std::span<const double> grad, uint64_t seed, double h = 1e-5,
                                                     double abs_floor = 1e-12) {
  std::vector<double> u(values.size());
  for (size_t i = 0; i < u.size(); ++i) u[i] = rng_normal(seed, 0x67726164ull, i);
  const std::vector<double> saved(values.begin(), values.end());
  DirectionalCheck r;
  for (size_t i = 0; i < u.size(); ++i) r.analytic += grad[i] * u[i];
  const auto loss_at = [&](double step) {
    for (size_t i = 0; i < u.size(); ++i) values[i] = saved[i] + step * u[i];
    return loss();
  };
  const double plus = loss_at(h), minus = loss_at(-h);
  std::copy(saved.begin(), saved.end(), values.begin());
  r.numeric = (plus - minus) / (2 * h);
  r.rel_error = std::abs(r.analytic - r.numeric) / std::max({std::abs(r.analytic), std::abs(r.numeric), abs_floor});
  return r;
}

}  // namespace flux8::testing
