// ParamStore with sharded master weights (MasterShards, the distributed optimizer): this rank's
// masters, the gather of the others' through the group, and the device forms made from it. See
// params.h.
#include <sys/mman.h>

#include <algorithm>

#include "core/error.h"
#include "model/params.h"

namespace flux8 {

void ParamStore::shard_masters(MasterShards shards) {
  const int ranks = shards.group->size(), me = shards.group->rank();
  const std::vector<int64_t>& b = shards.begins;
  bool ordered = static_cast<int>(b.size()) == ranks + 1 && b.front() == 0 && b.back() == layout_.total();
  for (size_t r = 1; ordered && r < b.size(); ++r) ordered = b[r - 1] <= b[r];
  if (!ordered)
    fail("internal error: the master shards' {} boundaries do not split the {} parameters' flat buffer over {} ranks",
         b.size(), layout_.total(), ranks);
  shards_ = std::move(shards);
  held_begin_ = shards_.begins[static_cast<size_t>(me)];
  held_count_ = shards_.begins[static_cast<size_t>(me) + 1] - held_begin_;
  held_ = backend_.allocate(static_cast<size_t>(std::max<int64_t>(held_count_, 1)) * dtype_size(dtype_));
  // The keys of param() and flat_params(): address space only, never backed, so that a read of a
  // master this rank does not hold faults instead of returning stale values.
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(layout_.total()) * dtype_size(dtype_));
  params_ = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (params_ == MAP_FAILED) {
    params_ = nullptr;
    fail("cannot reserve {} bytes of address space for the parameters' keys (sharded master weights)", bytes);
  }
}

void ParamStore::release_masters() {
  if (!masters_sharded()) {
    masters_.release(params_);
    return;
  }
  if (params_) ::munmap(params_, std::max<size_t>(1, static_cast<size_t>(layout_.total()) * dtype_size(dtype_)));
  backend_.release(held_);
  if (window_.defined()) backend_.release(window_.data);
}

Tensor ParamStore::held_masters() const {
  if (masters_sharded()) return Tensor(held_, dtype_, Shape{held_count_});
  return flat_params();
}

ParamStore::HeldPart ParamStore::held_part(const ParamInfo& p) const {
  const int64_t begin = std::max(p.offset, held_begin_);
  const int64_t end = std::min(p.offset + p.shape.numel(), held_begin_ + held_count_);
  if (end <= begin) return {};
  const Tensor held = held_masters();
  return {Tensor(static_cast<char*>(held.data) + static_cast<size_t>(begin - held_begin_) * dtype_size(dtype_), dtype_,
                 Shape{end - begin}),
          begin - p.offset};
}

void ParamStore::gather_masters(int64_t begin, int64_t count, const Tensor& out) {
  Communicator& group = *shards_.group;
  const size_t es = dtype_size(dtype_);
  // Every rank walks the same holders in the same order: one broadcast for each holder's part.
  for (int r = 0; r < group.size(); ++r) {
    const int64_t b = std::max(begin, shards_.begins[static_cast<size_t>(r)]);
    const int64_t e = std::min(begin + count, shards_.begins[static_cast<size_t>(r) + 1]);
    if (e <= b) continue;
    const Tensor piece(static_cast<char*>(out.data) + static_cast<size_t>(b - begin) * es, dtype_, Shape{e - b});
    if (r == group.rank())
      backend_.copy(
          piece, Tensor(static_cast<char*>(held_) + static_cast<size_t>(b - held_begin_) * es, dtype_, Shape{e - b}));
    group.broadcast(piece, r);
  }
}

void ParamStore::set_cast_forms(CastForms forms) {
  if (!masters_sharded()) fail("internal error: cast forms are written from gathered masters (sharded masters only)");
  has_cast_.assign(layout_.params().size(), 0);
  for (const int64_t offset : forms.offsets) {
    const auto it = by_offset_.find(offset);
    if (it == by_offset_.end()) fail("internal error: no parameter starts at flat offset {} for a cast form", offset);
    has_cast_[it->second] = 1;
  }
  cast_forms_ = std::move(forms);
}

void ParamStore::rewrite_cast_forms() {
  if (masters_sharded() && cast_forms_.write) refresh_sharded_forms(true);
}

void ParamStore::refresh_sharded_forms(bool casts_only) {
  // Windows of whole parameters that have a form, in flat order (the layout's), each gathered
  // once into window_ and its forms written from there.
  const auto has_cast = [&](size_t i) { return i < has_cast_.size() && has_cast_[i]; };
  const auto has_form = [&](size_t i) {
    if (has_cast(i)) return true;
    if (casts_only) return false;
    return (i < residents_.size() && residents_[i].defined()) || (i < operands_.size() && operands_[i].copy.defined());
  };
  std::vector<std::pair<int64_t, std::vector<size_t>>> windows;  // (begin, parameters)
  int64_t largest = 0;
  for (size_t i = 0; i < layout_.params().size(); ++i) {
    if (!has_form(i)) continue;
    const ParamInfo& p = layout_.params()[i];
    if (windows.empty() || p.offset + p.shape.numel() - windows.back().first > kFormsWindowElements)
      windows.push_back({p.offset, {}});
    windows.back().second.push_back(i);
    largest = std::max(largest, p.offset + p.shape.numel() - windows.back().first);
  }
  if (!window_.defined() || window_.numel() < largest) {
    if (window_.defined()) backend_.release(window_.data);
    window_ = Tensor(backend_.allocate(static_cast<size_t>(std::max<int64_t>(largest, 1)) * dtype_size(dtype_)), dtype_,
                     Shape{std::max<int64_t>(largest, 1)});
  }
  for (const auto& [begin, params] : windows) {
    const ParamInfo& last = layout_.params()[params.back()];
    const int64_t count = last.offset + last.shape.numel() - begin;
    gather_masters(begin, count, window_);
    for (size_t i : params) {
      const ParamInfo& p = layout_.params()[i];
      const Tensor value(static_cast<char*>(window_.data) + static_cast<size_t>(p.offset - begin) * dtype_size(dtype_),
                         dtype_, p.shape);
      if (has_cast(i)) cast_forms_.write(p.offset, value);
      if (casts_only) continue;
      if (residents_[i].defined()) backend_.copy(residents_[i], value);
      if (i < operands_.size() && operands_[i].copy.defined()) {
        backend_.copy(operands_[i].copy, value);  // rounded from the f32 master, as with whole masters
        operands_[i].version = params_version_;
      }
    }
  }
  if (!casts_only) forms_version_ = params_version_;
}

}  // namespace flux8
