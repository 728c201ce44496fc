#pragma once
// The data-parallel reduction of a step's gradients, bucket by bucket, started as the backward of
// the step's last micro-batch finishes each bucket's gradients (overlap_grad_reduce) or all after
// it. Either way the same collectives run in the same order on the same bytes, so a run repeats
// bit for bit and overlapping changes no result.
//
// Buckets are DataParallel::kBucketElements of the flat gradient buffer from its end: the layout
// puts the final layer last and the blocks in order before it, so the backward finishes the
// buckets nearly in order. A bucket is started once the model has said (FinalGradients) that
// every parameter it meets is final, and never before the bucket ahead of it: every rank starts
// the same collectives in the same order. Plain data parallelism all-reduces a bucket; with the
// distributed optimizer (FlatSharding) each part of it inside a rank's owned range is reduced to
// that rank alone — the bytes of a reduce-scatter, not of an all-reduce.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "model/final_gradients.h"
#include "model/params.h"
#include "train/data_parallel.h"

namespace flux8 {

class GradientBuckets final : public FinalGradients {
 public:
  // `sharding`: the distributed optimizer's split of the flat buffer over dp's ranks (none: every
  // rank needs the whole sum). `overlap`: start buckets during the backward.
  GradientBuckets(ParamStore& store, DataParallel& dp, std::optional<FlatSharding> sharding, bool overlap,
                  int64_t bucket_elements = DataParallel::kBucketElements);

  // Before a step's micro-batches: every gradient pending again.
  void begin_step();
  // From the step's last backward (FluxModel::backward's `final`).
  void gradients_final(std::span<const size_t> params) override;
  // After the step's last backward: starts the buckets not started yet, in order, and joins. The
  // gradients are then the group's sums — all of them, or with sharding this rank's owned range.
  void finish_step();

  const std::vector<FlatRange>& buckets() const { return buckets_; }
  // Of the last step: the buckets started before finish_step() (during the backward).
  size_t started_in_backward() const { return started_in_backward_; }
  // The collectives a step runs (one a bucket, or one a bucket's part in each owner's range).
  size_t collectives_per_step() const;

 private:
  void start(size_t bucket);
  void start_ready();
  ParamStore& store_;
  DataParallel& dp_;
  std::optional<FlatSharding> sharding_;
  bool overlap_;
  std::vector<FlatRange> buckets_;  // in the order they are started
  // Per parameter: the buckets it meets, [first, last] in buckets_'s order.
  std::vector<std::pair<size_t, size_t>> param_buckets_;
  std::vector<int64_t> params_in_bucket_;  // parameters meeting each bucket
  std::vector<int64_t> pending_;           // of those, not final yet this step
  std::vector<uint8_t> final_;             // per parameter, this step
  size_t next_ = 0;                        // the next bucket to start
  size_t started_in_backward_ = 0;
};

}  // namespace flux8
