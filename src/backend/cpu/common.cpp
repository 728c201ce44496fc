#include "backend/cpu/common.h"

namespace flux8::cpu {

DType call_dtype(std::string_view op, std::initializer_list<Named> tensors) {
  const Named* first = nullptr;
  for (const Named& a : tensors) {
    if (!a.t.defined()) continue;
    if (a.t.dtype != DType::f32 && a.t.dtype != DType::f64)
      fail(
          "{}: tensor '{}' is {}; the CPU backend computes in f32 or f64 (convert storage "
          "types such as bf16 first)",
          op, a.name, a.t.str());
    if (first && a.t.dtype != first->t.dtype)
      fail("{}: tensor '{}' is {} but '{}' is {}; all tensors of one call must share one dtype", op,
           a.name, a.t.str(), first->name, first->t.str());
    if (a.t.ld < a.t.cols())
      fail("{}: tensor '{}' ({}) has row stride {} smaller than its {} columns", op, a.name,
           a.t.str(), a.t.ld, a.t.cols());
    if (!first) first = &a;
  }
  if (!first) fail("{}: no tensor argument is defined", op);
  return first->t.dtype;
}

void require_defined(std::string_view op, Named a) {
  if (!a.t.defined()) fail("{}: tensor '{}' is required but undefined", op, a.name);
}

void require_rank(std::string_view op, Named a, int rank) {
  require_defined(op, a);
  if (a.t.shape.rank != rank)
    fail("{}: tensor '{}' is {} but must have rank {}", op, a.name, a.t.str(), rank);
}

void require_shape(std::string_view op, Named a, const Shape& expected) {
  require_defined(op, a);
  if (a.t.shape != expected)
    fail("{}: tensor '{}' is {} but must have shape {}", op, a.name, a.t.str(), expected.str());
}

void require_same_matrix(std::string_view op, Named a, Named b) {
  require_defined(op, a);
  require_defined(op, b);
  if (a.t.rows() != b.t.rows() || a.t.cols() != b.t.cols())
    fail("{}: tensors '{}' {} and '{}' {} must have the same [rows, cols]", op, a.name, a.t.str(),
         b.name, b.t.str());
}

void require_vector(std::string_view op, Named a, int64_t n) {
  require_defined(op, a);
  if (a.t.numel() != n || !a.t.contiguous())
    fail("{}: tensor '{}' is {} (ld {}) but must be a contiguous vector of {} elements", op, a.name,
         a.t.str(), a.t.ld, n);
}

}  // namespace flux8::cpu
