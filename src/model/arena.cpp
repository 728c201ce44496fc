#include "model/arena.h"

#include <algorithm>

#include "backend/backend.h"
#include "core/error.h"

namespace flux8 {

namespace {
constexpr size_t kAlign = 256;  // keeps every slot aligned for vector loads / TMA on the GPU
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace

double ArenaUsage::bytes(double element_bytes, bool fp8_linear_inputs) const {
  return static_cast<double>(elements[0]) * (fp8_linear_inputs ? 1.0 : element_bytes) +
         static_cast<double>(elements[1]) * element_bytes + static_cast<double>(elements[2]) * 4.0 +
         static_cast<double>(elements[3]) * element_bytes + static_cast<double>(elements[4]);
}

Arena::~Arena() {
  if (base_) backend_->release(base_);
}

void Arena::reserve(Backend& backend, size_t bytes) {
  if (base_) backend_->release(base_);
  backend_ = &backend;
  base_ = static_cast<char*>(backend.allocate(bytes));
  capacity_ = bytes;
  used_ = peak_ = 0;
  usage_ = peak_usage_ = {};
  slots_.clear();
}

void Arena::release_to(size_t mark) {
  while (!slots_.empty() && slots_.back().offset >= mark) {
    usage_.elements[static_cast<int>(slots_.back().kind)] -= slots_.back().elements;
    slots_.pop_back();
  }
  used_ = std::min(used_, mark);
}

Tensor Arena::alloc(DType dtype, Shape shape, SlotKind kind) {
  const size_t bytes = align_up(static_cast<size_t>(shape.numel()) * dtype_size(dtype));
  if (!measuring() && used_ + bytes > capacity_)
    fail(
        "activation arena overflow: need {} more bytes beyond {} of {} (a step shape larger "
        "than the one planned; call plan() with the largest shape)",
        bytes, used_, capacity_);
  Tensor t(measuring() ? nullptr : base_ + used_, dtype, shape);
  slots_.push_back(Slot{used_, kind, shape.numel()});
  used_ += bytes;
  usage_.elements[static_cast<int>(kind)] += shape.numel();
  if (used_ > peak_) {
    peak_ = used_;
    peak_usage_ = usage_;
  }
  return t;
}

}  // namespace flux8
