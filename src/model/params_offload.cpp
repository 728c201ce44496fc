// ParamStore with offloaded master weights (optimizer_offload: cpu): the device forms the model
// reads — f32 residents, operand copies — and the staging of masters for FP8 casts. See params.h.
#include <algorithm>

#include "core/error.h"
#include "model/params.h"

namespace flux8 {

void ParamStore::allocate_residents(const std::vector<size_t>& which) {
  if (residents_.empty()) residents_.assign(layout_.params().size(), Tensor{});
  if (which.empty()) return;
  size_t bytes = 0;
  std::vector<size_t> at;
  for (size_t i : which) {
    at.push_back(bytes);
    bytes += padded_bytes(static_cast<size_t>(layout_.params()[i].shape.numel()) * dtype_size(dtype_));
  }
  void* buffer = backend_.allocate(bytes);
  resident_buffers_.push_back(buffer);
  for (size_t k = 0; k < which.size(); ++k)
    residents_[which[k]] = Tensor(static_cast<char*>(buffer) + at[k], dtype_, layout_.params()[which[k]].shape);
  forms_version_ = -1;  // the new residents hold zeros until the next refresh
}

Tensor ParamStore::staging_for(int64_t n) {
  if (!staging_.defined() || staging_.numel() < n) {
    // Sized for the largest parameter once: FP8 casts stage every block weight in turn.
    int64_t largest = n;
    for (const ParamInfo& q : layout_.params()) largest = std::max(largest, q.shape.numel());
    if (staging_.defined()) backend_.release(staging_.data);
    staging_ = Tensor(backend_.allocate(static_cast<size_t>(largest) * dtype_size(dtype_)), dtype_, Shape{largest});
  }
  return staging_;
}

Tensor ParamStore::stage(const ParamInfo& p) {
  const int64_t n = p.shape.numel();
  // upload() returns after the copy, ordered after the ops queued before: an earlier reader of
  // the staging buffer is done with it.
  const Tensor master(static_cast<char*>(params_) + static_cast<size_t>(p.offset) * dtype_size(dtype_), dtype_,
                      p.shape);
  const Tensor staged(staging_for(n).data, dtype_, p.shape);
  backend_.upload(staged.data, master.data, static_cast<size_t>(n) * dtype_size(dtype_));
  return staged;
}

void ParamStore::refresh_device_forms() {
  if (!device_forms() || forms_version_ == params_version_) return;
  if (masters_sharded()) {
    refresh_sharded_forms();
    return;
  }
  for (size_t i = 0; i < layout_.params().size(); ++i) {
    const ParamInfo& p = layout_.params()[i];
    const size_t bytes = static_cast<size_t>(p.shape.numel()) * dtype_size(dtype_);
    const char* master = static_cast<const char*>(params_) + static_cast<size_t>(p.offset) * dtype_size(dtype_);
    if (residents_[i].defined()) backend_.upload(residents_[i].data, master, bytes);
    if (!operands_.empty() && operands_[i].copy.defined()) {
      // Rounded from the f32 value on the backend, as the copy of a master kept there is.
      backend_.copy(operands_[i].copy, residents_[i].defined() ? residents_[i] : stage(p));
      operands_[i].version = params_version_;
    }
  }
  forms_version_ = params_version_;
}

Tensor ParamStore::offloaded_operand(const Tensor& p, std::optional<DType> out) {
  refresh_device_forms();
  const size_t i = index_in(params_, p);
  if (i == kNoParam) fail("ParamStore::operand: tensor {} is not a whole parameter of this model", p.str());
  const Tensor copy = operands_.empty() ? Tensor{} : operands_[i].copy;
  if (copy.defined() && (!out || copy.dtype == *out)) return copy;
  if (residents_[i].defined()) return residents_[i];
  fail(
      "internal error: parameter '{}' has no copy on the device for the model to read (offloaded or sharded master "
      "weights)",
      layout_.params()[i].name);
}

Tensor ParamStore::device_param(std::string_view name) {
  const ParamInfo& p = layout_.at(name);
  const Tensor master = param(name);
  if (!device_forms()) return master;
  const Tensor& resident = residents_[static_cast<size_t>(&p - layout_.params().data())];
  if (!resident.defined())
    fail("internal error: parameter '{}' has no f32 resident on the device (offloaded master weights)", name);
  return resident;
}

Tensor ParamStore::master_on_device(const Tensor& w) {
  if (!device_forms()) return w;
  const size_t i = index_in(params_, w);
  if (i == kNoParam) fail("ParamStore::master_on_device: tensor {} is not a whole parameter of this model", w.str());
  if (residents_[i].defined()) {
    refresh_device_forms();
    return residents_[i];
  }
  const ParamInfo& p = layout_.params()[i];
  if (!masters_sharded()) return stage(p);
  const Tensor staged(staging_for(p.shape.numel()).data, dtype_, p.shape);
  gather_masters(p.offset, p.shape.numel(), staged);
  return staged;
}

std::vector<Backend::CopyPair> ParamStore::resident_copies(int64_t begin, int64_t count,
                                                           const Tensor& chunk_on_device) const {
  std::vector<Backend::CopyPair> pairs;
  if (!masters_offloaded()) return pairs;
  for (size_t i = 0; i < layout_.params().size(); ++i) {
    const ParamInfo& p = layout_.params()[i];
    if (!residents_[i].defined() || p.offset < begin || p.offset >= begin + count) continue;
    if (p.offset + p.shape.numel() > begin + count)
      fail("internal error: parameter '{}' crosses the end of an optimizer chunk", p.name);
    const size_t at = static_cast<size_t>(p.offset - begin) * dtype_size(dtype_);
    pairs.push_back({residents_[i], Tensor(static_cast<char*>(chunk_on_device.data) + at, dtype_, p.shape)});
  }
  return pairs;
}

}  // namespace flux8
