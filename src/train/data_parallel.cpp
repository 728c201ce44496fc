#include "train/data_parallel.h"

#include <algorithm>

#include "core/error.h"

namespace flux8 {

FlatSharding FlatSharding::of(int64_t total, int ranks) {
  FLUX8_CHECK(ranks >= 1 && total >= 0, "sharding {} elements over {} ranks", total, ranks);
  FlatSharding s;
  s.total = total;
  s.ranks = ranks;
  s.shard = total / ranks / 64 * 64;
  return s;
}

FlatRange FlatSharding::owned(int rank) const {
  FlatRange r{shard * rank, shard};
  if (rank == ranks - 1) r.count = total - r.begin;
  return r;
}

Tensor flat_slice(const Tensor& flat, FlatRange r) {
  FLUX8_CHECK(r.begin >= 0 && r.end() <= flat.numel(), "slice [{}, {}) of {}", r.begin, r.end(), flat.str());
  return Tensor(static_cast<char*>(flat.data) + static_cast<size_t>(r.begin) * dtype_size(flat.dtype), flat.dtype,
                Shape{r.count});
}

DataParallel::DataParallel(Communicator& group, Backend& be) : group_(group), be_(be) {
  scratch_ = Tensor(be.allocate(kScratch * sizeof(double)), DType::f64, Shape{kScratch});
}

DataParallel::~DataParallel() { be_.release(scratch_.data); }

void DataParallel::through_scratch(std::span<double> values, const std::function<void(const Tensor&)>& collective) {
  if (group_.size() == 1) return;
  for (size_t begin = 0; begin < values.size(); begin += kScratch) {
    const size_t n = std::min<size_t>(kScratch, values.size() - begin);
    const Tensor t(scratch_.data, DType::f64, Shape{static_cast<int64_t>(n)});
    be_.upload(t.data, values.data() + begin, n * sizeof(double));
    collective(t);
    be_.download(values.data() + begin, t.data, n * sizeof(double));
  }
}

void DataParallel::sum(std::span<double> values) {
  through_scratch(values, [&](const Tensor& t) { group_.all_reduce(t, ReduceOp::sum); });
}
void DataParallel::max(std::span<double> values) {
  through_scratch(values, [&](const Tensor& t) { group_.all_reduce(t, ReduceOp::max); });
}
void DataParallel::broadcast(std::span<double> values, int root) {
  through_scratch(values, [&](const Tensor& t) { group_.broadcast(t, root); });
}

std::vector<int> DataParallel::ranks_differing_from_lead(const std::string& digest) {
  if (digest.size() < 12) fail("internal error: a digest of 12 hex digits or more is compared, not '{}'", digest);
  // Two 24-bit halves: exact in doubles.
  const std::vector<double> mine{static_cast<double>(std::stoull(digest.substr(0, 6), nullptr, 16)),
                                 static_cast<double>(std::stoull(digest.substr(6, 6), nullptr, 16))};
  std::vector<double> lead = mine;
  broadcast(lead, 0);
  std::vector<double> differ(static_cast<size_t>(size()), 0.0);
  differ[static_cast<size_t>(rank())] = lead != mine ? 1.0 : 0.0;
  max(differ);
  std::vector<int> ranks;
  for (int k = 0; k < size(); ++k)
    if (differ[static_cast<size_t>(k)] > 0) ranks.push_back(k);
  return ranks;
}

void DataParallel::all_reduce_gradients(const Tensor& grads) {
  if (group_.size() == 1) return;
  const int64_t n = grads.numel();
  for (int64_t end = n; end > 0; end -= kBucketElements) {
    const int64_t begin = std::max<int64_t>(0, end - kBucketElements);
    group_.all_reduce(flat_slice(grads, {begin, end - begin}), ReduceOp::sum, /*async=*/true);
  }
  group_.join();
}

void DataParallel::reduce_scatter_gradients(const Tensor& grads, const FlatSharding& s) {
  if (group_.size() == 1) return;
  FLUX8_CHECK(s.ranks == group_.size() && s.total == grads.numel(), "sharding of {} over {} ranks for {}", s.total,
              s.ranks, grads.str());
  if (s.shard > 0) {
    const Tensor all = flat_slice(grads, s.equal_parts());
    group_.reduce_scatter(flat_slice(grads, {s.shard * rank(), s.shard}), all, /*async=*/true);
  }
  // The tail (fewer than 64 elements a rank) is summed on every rank; its owner, the last rank,
  // uses it.
  if (s.tail().count > 0) group_.all_reduce(flat_slice(grads, s.tail()), ReduceOp::sum, /*async=*/true);
  group_.join();
}

void DataParallel::all_gather_params(const Tensor& params, const FlatSharding& s) {
  if (group_.size() == 1) return;
  if (s.shard > 0)
    group_.all_gather(flat_slice(params, s.equal_parts()), flat_slice(params, {s.shard * rank(), s.shard}),
                      /*async=*/true);
  group_.join();
  if (s.tail().count > 0) group_.broadcast(flat_slice(params, s.tail()), s.ranks - 1);
}

}  // namespace flux8
