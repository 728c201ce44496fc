#pragma once
// How one tensor-parallel rank's parameter maps onto the full reference tensor (the Black Forest
// Labs tensor of the same name, whatever the tensor-parallel size). A tensor is replicated (every
// rank holds all of it) or split along its rows (dim 0: a column-parallel Linear's weight and
// bias) or its columns (dim 1: a row-parallel Linear's weight). A fused tensor's split dimension
// is a list of segments — the double block's qkv rows [q | k | v], the single block's linear1
// rows [q | k | v | mlp] and linear2 columns [attention | mlp] — and every segment is split evenly:
// rank r holds slice r of each, in segment order.
//
// The functions here are pure functions of host data: a rank's shard out of a full tensor, and a
// full tensor out of every rank's shard (checkpoints, weight loading, the tests).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace flux8 {

enum class ShardSplit : uint8_t { replicated, rows, cols };

struct ParamShard {
  ShardSplit split = ShardSplit::replicated;
  Shape full;                     // the reference tensor's shape
  std::vector<int64_t> segments;  // rows/cols: the full extent along the split dimension, in segments
  int rank = 0, size = 1;         // this shard's rank in its tensor-parallel group, and the group's size
  // A replicated tensor whose gradient is partial on each rank (the QK-norm scales, which every
  // head shares while each rank runs its own heads): the model sums it over the group in its
  // backward, so the gradients it leaves are complete and the same on every rank.
  bool reduce_grad = false;

  bool sharded() const { return split != ShardSplit::replicated && size > 1; }
  Shape local_shape() const;  // this rank's tensor
};

// Along the split dimension: [full_begin, +count) of the full tensor is [local_begin, +count) of
// rank `rank`'s shard. One piece per segment; a replicated tensor is one piece of everything.
struct ShardPiece {
  int64_t full_begin = 0, local_begin = 0, count = 0;
};
std::vector<ShardPiece> shard_pieces(const ParamShard& s, int rank);

// Rank `rank`'s shard out of the full tensor (row-major, s.full), and back: elements of
// `element_bytes` each (any type). place_shard writes only the shard's elements of `full`.
void take_shard(const ParamShard& s, int rank, const void* full, void* local, size_t element_bytes);
void place_shard(const ParamShard& s, int rank, const void* local, void* full, size_t element_bytes);

std::vector<double> take_shard(const ParamShard& s, int rank, const std::vector<double>& full);
// The full tensor from every rank's shard: shards[r] is rank r's (s.size of them).
std::vector<double> assemble_full(const ParamShard& s, const std::vector<std::vector<double>>& shards);

}  // namespace flux8
