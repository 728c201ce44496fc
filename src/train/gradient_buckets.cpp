#include "train/gradient_buckets.h"

#include <algorithm>

#include "core/error.h"

namespace flux8 {

GradientBuckets::GradientBuckets(ParamStore& store, DataParallel& dp, std::optional<FlatSharding> sharding,
                                 bool overlap, int64_t bucket_elements)
    : store_(store), dp_(dp), sharding_(sharding), overlap_(overlap) {
  const int64_t total = store.layout().total();
  FLUX8_CHECK(bucket_elements > 0, "gradient buckets of {} elements", bucket_elements);
  if (sharding_)
    FLUX8_CHECK(sharding_->total == total && sharding_->ranks == dp.size(),
                "gradient buckets: a sharding of {} elements over {} ranks for {} gradients over {} ranks",
                sharding_->total, sharding_->ranks, total, dp.size());
  for (int64_t end = total; end > 0; end -= bucket_elements) {
    const int64_t begin = std::max<int64_t>(0, end - bucket_elements);
    buckets_.push_back({begin, end - begin});
  }
  // Bucket k holds [total - (k + 1) * size, total - k * size): element e is in (total - 1 - e) / size.
  const auto bucket_of = [&](int64_t element) { return static_cast<size_t>((total - 1 - element) / bucket_elements); };
  params_in_bucket_.assign(buckets_.size(), 0);
  for (const ParamInfo& p : store.layout().params()) {
    const int64_t n = p.shape.numel();
    if (n == 0) {
      param_buckets_.push_back({1, 0});  // meets no bucket
      continue;
    }
    const size_t first = bucket_of(p.offset + n - 1), last = bucket_of(p.offset);
    param_buckets_.push_back({first, last});
    for (size_t b = first; b <= last; ++b) ++params_in_bucket_[b];
  }
  begin_step();
}

void GradientBuckets::begin_step() {
  pending_ = params_in_bucket_;
  final_.assign(param_buckets_.size(), 0);
  next_ = 0;
  started_in_backward_ = 0;
  // Kept low-rank gradients (ParamStore::keep_low_rank_grads) are not in the flat buffer; the
  // trainer keeps them only on one data-parallel rank.
  FLUX8_CHECK(store_.low_rank_rows() == 0 || dp_.size() == 1,
              "gradient buckets: low-rank gradients kept on {} data-parallel ranks", dp_.size());
}

void GradientBuckets::gradients_final(std::span<const size_t> params) {
  for (const size_t i : params) {
    FLUX8_CHECK(i < final_.size() && !final_[i], "gradient buckets: parameter {} reported final {}", i,
                i < final_.size() ? "twice" : "but not in the layout");
    final_[i] = 1;
    const auto [first, last] = param_buckets_[i];
    for (size_t b = first; b <= last; ++b) --pending_[b];
  }
  if (overlap_) {
    const size_t before = next_;
    start_ready();
    started_in_backward_ += next_ - before;
  }
}

void GradientBuckets::start_ready() {
  while (next_ < buckets_.size() && pending_[next_] == 0) start(next_++);
}

void GradientBuckets::finish_step() {
  for (size_t i = 0; i < final_.size(); ++i)
    if (!final_[i])
      fail("internal error: the backward never reported the gradient of {} final; its bucket cannot be reduced",
           store_.layout().params()[i].name);
  start_ready();
  FLUX8_CHECK(next_ == buckets_.size(), "gradient buckets: {} of {} started", next_, buckets_.size());
  dp_.group().join();
}

void GradientBuckets::start(size_t bucket) {
  if (dp_.size() == 1) return;
  const FlatRange b = buckets_[bucket];
  const Tensor grads = store_.flat_grads();
  Communicator& group = dp_.group();
  if (!sharding_) {
    group.all_reduce(flat_slice(grads, b), ReduceOp::sum, /*async=*/true);
    return;
  }
  // The owners' ranges are contiguous and ascending: reduce each part to its owner.
  for (int r = 0; r < sharding_->ranks; ++r) {
    const FlatRange own = sharding_->owned(r);
    const int64_t begin = std::max(own.begin, b.begin), end = std::min(own.end(), b.end());
    if (end > begin) group.reduce(flat_slice(grads, {begin, end - begin}), r, /*async=*/true);
  }
}

size_t GradientBuckets::collectives_per_step() const {
  if (!sharding_) return buckets_.size();
  size_t n = 0;
  for (const FlatRange& b : buckets_)
    for (int r = 0; r < sharding_->ranks; ++r) {
      const FlatRange own = sharding_->owned(r);
      n += std::max(own.begin, b.begin) < std::min(own.end(), b.end()) ? 1 : 0;
    }
  return n;
}

}  // namespace flux8
