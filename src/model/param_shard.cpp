#include "model/param_shard.h"

#include <cstring>

#include "core/error.h"

namespace flux8 {

namespace {

int split_dim(const ParamShard& s) { return s.split == ShardSplit::rows ? 0 : 1; }

void check(const ParamShard& s, int rank) {
  FLUX8_CHECK(rank >= 0 && rank < s.size, "rank {} of a tensor-parallel group of {}", rank, s.size);
  if (s.split == ShardSplit::replicated) return;
  FLUX8_CHECK(s.split == ShardSplit::rows || s.full.rank == 2, "a column split of the {}-D shape {}", s.full.rank,
              s.full.str());
  int64_t total = 0;
  for (const int64_t seg : s.segments) {
    FLUX8_CHECK(seg % s.size == 0, "segment {} of {} is not divisible by {} ranks", seg, s.full.str(), s.size);
    total += seg;
  }
  FLUX8_CHECK(total == s.full[split_dim(s)], "segments summing to {} along dim {} of {}", total, split_dim(s),
              s.full.str());
}

// Copies rank `rank`'s elements between the full tensor and its shard (to_local: full -> local).
void copy_shard(const ParamShard& s, int rank, const char* from, char* to, size_t esize, bool to_local) {
  check(s, rank);
  const Shape local = s.local_shape();
  if (s.split == ShardSplit::replicated) {
    std::memcpy(to, from, static_cast<size_t>(s.full.numel()) * esize);
    return;
  }
  const std::vector<ShardPiece> pieces = shard_pieces(s, rank);
  if (s.split == ShardSplit::rows) {
    const auto row = static_cast<size_t>(s.full.numel() / s.full[0]) * esize;  // bytes a row (1-D: an element)
    for (const ShardPiece& p : pieces) {
      const size_t full_at = static_cast<size_t>(p.full_begin) * row,
                   local_at = static_cast<size_t>(p.local_begin) * row;
      const size_t bytes = static_cast<size_t>(p.count) * row;
      if (to_local)
        std::memcpy(to + local_at, from + full_at, bytes);
      else
        std::memcpy(to + full_at, from + local_at, bytes);
    }
    return;
  }
  const int64_t rows = s.full[0], full_cols = s.full[1], local_cols = local[1];
  for (int64_t r = 0; r < rows; ++r)
    for (const ShardPiece& p : pieces) {
      const size_t full_at = static_cast<size_t>(r * full_cols + p.full_begin) * esize;
      const size_t local_at = static_cast<size_t>(r * local_cols + p.local_begin) * esize;
      const size_t bytes = static_cast<size_t>(p.count) * esize;
      if (to_local)
        std::memcpy(to + local_at, from + full_at, bytes);
      else
        std::memcpy(to + full_at, from + local_at, bytes);
    }
}

}  // namespace

Shape ParamShard::local_shape() const {
  if (split == ShardSplit::replicated) return full;
  Shape s = full;
  s.d[static_cast<size_t>(split_dim(*this))] /= size;
  return s;
}

std::vector<ShardPiece> shard_pieces(const ParamShard& s, int rank) {
  check(s, rank);
  if (s.split == ShardSplit::replicated) return {{0, 0, s.full.numel()}};
  std::vector<ShardPiece> pieces;
  int64_t full_at = 0, local_at = 0;
  for (const int64_t seg : s.segments) {
    const int64_t part = seg / s.size;
    pieces.push_back({full_at + rank * part, local_at, part});
    full_at += seg;
    local_at += part;
  }
  return pieces;
}

void take_shard(const ParamShard& s, int rank, const void* full, void* local, size_t element_bytes) {
  copy_shard(s, rank, static_cast<const char*>(full), static_cast<char*>(local), element_bytes, true);
}

void place_shard(const ParamShard& s, int rank, const void* local, void* full, size_t element_bytes) {
  copy_shard(s, rank, static_cast<const char*>(local), static_cast<char*>(full), element_bytes, false);
}

std::vector<double> take_shard(const ParamShard& s, int rank, const std::vector<double>& full) {
  if (static_cast<int64_t>(full.size()) != s.full.numel())
    fail("take_shard: {} values for a tensor of shape {}", full.size(), s.full.str());
  std::vector<double> local(static_cast<size_t>(s.local_shape().numel()));
  take_shard(s, rank, full.data(), local.data(), sizeof(double));
  return local;
}

std::vector<double> assemble_full(const ParamShard& s, const std::vector<std::vector<double>>& shards) {
  if (static_cast<int>(shards.size()) != s.size)
    fail("assemble_full: {} shards for a tensor-parallel group of {} ranks", shards.size(), s.size);
  std::vector<double> full(static_cast<size_t>(s.full.numel()));
  const auto local = static_cast<size_t>(s.local_shape().numel());
  for (int r = 0; r < s.size; ++r) {
    if (shards[static_cast<size_t>(r)].size() != local)
      fail("assemble_full: rank {}'s shard has {} values, a shard of {} has {}", r,
           shards[static_cast<size_t>(r)].size(), s.full.str(), local);
    place_shard(s, r, shards[static_cast<size_t>(r)].data(), full.data(), sizeof(double));
  }
  return full;
}

}  // namespace flux8
