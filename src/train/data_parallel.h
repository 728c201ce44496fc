#pragma once
// What the trainer reduces over its data-parallel group: the gradients (summed, bucket by bucket
// in a fixed order, so runs repeat bit for bit) and a few host values (validation sums, the
// gradient norm's shards), sent through a small buffer in the backend's memory because device
// communicators take device tensors only.
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/communicator.h"
#include "model/params.h"

namespace flux8 {

// A contiguous range of the flat parameter buffer.
struct FlatRange {
  int64_t begin = 0, count = 0;
  int64_t end() const { return begin + count; }
};

// How a flat buffer of `total` elements is split over `ranks` for the distributed optimizer:
// rank r owns [r * shard, (r + 1) * shard), the last rank also the tail past ranks * shard.
// `shard` is a multiple of 64 elements (aligned slices for every dtype's kernels), so the equal
// parts are one reduce-scatter and one all-gather, and the short tail one all-reduce and one
// broadcast.
struct FlatSharding {
  int64_t total = 0, shard = 0;
  int ranks = 1;
  static FlatSharding of(int64_t total, int ranks);
  FlatRange owned(int rank) const;
  FlatRange equal_parts() const { return {0, shard * ranks}; }
  FlatRange tail() const { return {shard * ranks, total - shard * ranks}; }
};

class DataParallel {
 public:
  DataParallel(Communicator& group, Backend& be);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  Communicator& group() { return group_; }
  int rank() const { return group_.rank(); }
  int size() const { return group_.size(); }

  // Elementwise over the group, in place; the same values on every rank after.
  void sum(std::span<double> values);
  void max(std::span<double> values);
  // root's values on every rank.
  void broadcast(std::span<double> values, int root);
  // The ranks whose `digest` (a hex string: its first 12 digits are compared) differs from rank
  // 0's, ascending — the same list on every rank. For state that must agree over the group (the
  // resolved config, FP8 scales).
  std::vector<int> ranks_differing_from_lead(const std::string& digest);

  // The sum over the group of every gradient in `grads` (the flat buffer or a range of it), in
  // buckets of kBucketElements from the end (the order the backward finishes them).
  static constexpr int64_t kBucketElements = int64_t{1} << 24;
  void all_reduce_gradients(const Tensor& grads);
  // The distributed optimizer's reduction: afterwards this rank's owned range of `grads` holds
  // the group's sum (the rest of the buffer is left as it was and must not be read).
  void reduce_scatter_gradients(const Tensor& grads, const FlatSharding& sharding);
  // The inverse for the parameters: every rank's owned range gathered into every rank's buffer.
  void all_gather_params(const Tensor& params, const FlatSharding& sharding);

 private:
  // values through the scratch buffer, kScratch at a time, each piece handed to `collective`.
  void through_scratch(std::span<double> values, const std::function<void(const Tensor&)>& collective);
  Communicator& group_;
  Backend& be_;
  Tensor scratch_;  // f64 [kScratch] in backend memory
  static constexpr int64_t kScratch = 64;
};

// Elements [r.begin, r.end()) of a flat 1-D tensor.
Tensor flat_slice(const Tensor& flat, FlatRange r);

}  // namespace flux8
