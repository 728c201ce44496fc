// Running one case on one variant and judging it against its reference run.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "backend/registry.h"
#include "conformance.h"
#include "core/error.h"

namespace flux8::conformance {

namespace {

BackendOptions options_of(Variant v) {
  BackendOptions o;
  o.round_activations_to_bf16 = v == Variant::cpu_bf16_rounding;
  o.bf16_gemm = o.bf16_activations = v == Variant::cuda_bf16;
  return o;
}

// Runs the case on `be` and returns its outputs; `damage` gets every stray write.
std::vector<Run::Output> outputs_of(const Case& c, Backend& be, DType compute, std::vector<std::string>& damage,
                                    bool* stores_bf16 = nullptr) {
  Run run(be, compute);
  const AnyOp op = c.build(run);
  if (op_name(op) != c.op) throw std::logic_error(fmt::format("case {} builds op {}", c.op, op_name(op)));
  const double result = be.execute_any(op);
  if (c.finish) c.finish(run);
  if (std::visit(
          []<typename Op>(const Op&) {
            if constexpr (std::is_same_v<Op, std::monostate>)
              return false;
            else
              return !std::is_void_v<typename Op::result_type>;
          },
          op))
    run.value("returned", result);
  if (stores_bf16) *stores_bf16 = run.stores_bf16();
  return run.collect(damage);
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// "" or what differs between one output and its reference.
std::string judge_output(const Case& c, const Run::Output& got, const Run::Output& ref, double tol) {
  if (got.values.size() != ref.values.size())
    return fmt::format("{}: {} values, the reference has {}", got.name, got.values.size(), ref.values.size());
  for (size_t i = 0; i < got.values.size(); ++i)
    if (std::isnan(got.values[i]))
      return fmt::format("{}[{}] is NaN (reference {}): unwritten, or a NaN the op made", got.name, i, ref.values[i]);
  if (tol == 0) {
    for (size_t i = 0; i < got.values.size(); ++i)
      if (!same_bits(got.values[i], ref.values[i]))
        return fmt::format("{}[{}] = {}, the CPU gives {} (bit for bit expected)", got.name, i, got.values[i],
                           ref.values[i]);
    return "";
  }
  double err = 0, scale = 0;
  size_t worst = 0;
  for (size_t i = 0; i < got.values.size(); ++i) {
    const double d = std::abs(got.values[i] - ref.values[i]);
    if (std::isnan(d)) return fmt::format("{}[{}]: the reference is NaN", got.name, i);
    if (d > err) err = d, worst = i;
    scale = std::max(scale, std::abs(ref.values[i]));
  }
  const double normalised = scale > 0 ? err / scale : err;
  if (normalised <= tol) return "";
  return fmt::format("{}: normalised error {:.3g} > tolerance {:.3g} ({}); worst [{}] = {} vs reference {}", got.name,
                     normalised, tol, c.why, worst, got.values[worst], ref.values[worst]);
}

}  // namespace

std::string_view variant_name(Variant v) {
  switch (v) {
    case Variant::cpu_f32: return "cpu_f32";
    case Variant::cpu_bf16_rounding: return "cpu_bf16_rounding";
    case Variant::cuda_f32: return "cuda_f32";
    case Variant::cuda_bf16: return "cuda_bf16";
  }
  return "?";
}
bool variant_on_cuda(Variant v) { return v == Variant::cuda_f32 || v == Variant::cuda_bf16; }
bool variant_rounds_to_bf16(Variant v) { return v == Variant::cpu_bf16_rounding || v == Variant::cuda_bf16; }

std::string unavailable_reason(Variant v) {
  const std::string name = variant_on_cuda(v) ? "cuda" : "cpu";
  for (const BackendEntry& e : registered_backends())
    if (e.name == name) return e.unavailable_reason ? e.unavailable_reason() : "";
  return "this binary has no " + name + " backend";
}

Backend& backend_of(Variant v) {
  static std::map<Variant, std::unique_ptr<Backend>> backends;
  auto& be = backends[v];
  if (!be) be = make_backend(variant_on_cuda(v) ? "cuda" : "cpu", options_of(v));
  return *be;
}

std::string run_case(const Case& c, Variant v) {
  static std::unique_ptr<Backend> cpu_f64 = make_backend("cpu");
  Backend& target = backend_of(v);
  std::vector<std::string> damage, reference_damage;
  bool stores_bf16 = false;
  const std::vector<Run::Output> got = outputs_of(c, target, DType::f32, damage, &stores_bf16);
  // The reference: the CPU in f64, or (bit for bit) the CPU in f32 with the variant's rounding.
  Backend& ref_be = c.judge == Judge::f64_reference
                        ? *cpu_f64
                        : backend_of(variant_rounds_to_bf16(v) ? Variant::cpu_bf16_rounding : Variant::cpu_f32);
  const std::vector<Run::Output> ref =
      outputs_of(c, ref_be, c.judge == Judge::f64_reference ? DType::f64 : DType::f32, reference_damage);
  std::string failures;
  for (const std::string& d : damage) failures += d + "\n";
  for (const std::string& d : reference_damage) failures += "reference run: " + d + "\n";
  if (got.size() != ref.size()) return failures + "the runs compared different numbers of outputs\n";
  const double tol = c.f32_terms * std::ldexp(1.0, -24) + (stores_bf16 ? c.bf16_steps * std::ldexp(1.0, -8) : 0.0) +
                     c.fp8_steps * std::ldexp(1.0, -3);
  for (size_t i = 0; i < got.size(); ++i)
    if (const std::string f = judge_output(c, got[i], ref[i], tol); !f.empty()) failures += f + "\n";
  return failures;
}

}  // namespace flux8::conformance
