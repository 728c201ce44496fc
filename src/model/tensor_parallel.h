#pragma once
// Megatron-style tensor parallelism of the Flux blocks (docs/DISTRIBUTED.md). A group of T ranks
// runs every block together: each rank holds and runs n/T of the attention heads (q, k and v of
// whole heads: column-parallel qkv / linear1) and M/T of the MLP (column-parallel mlp.0 / the MLP
// rows of linear1), and the Linears back to the residual width H (proj, mlp.2, linear2) are
// row-parallel: each rank's partial output is summed over the group (one all-reduce each), and
// the column-parallel Linears' input gradients likewise in the backward. The residual stream,
// the modulation, the embedders and the final layer are replicated: every rank computes them
// whole, from the same values, and ends with the same numbers.
#include <cstdint>

#include "backend/communicator.h"
#include "core/tensor.h"
#include "fp8/fp8_config.h"
#include "model/flux_config.h"

namespace flux8 {

// The tensor-parallel group a model runs in. No group (or a group of one) is no tensor
// parallelism: the model as it runs on one process.
struct TensorParallel {
  Communicator* group = nullptr;

  int rank() const { return group ? group->rank() : 0; }
  int size() const { return group ? group->size() : 1; }
  bool sharded() const { return size() > 1; }
  // t (contiguous) = its sum over the group; nothing on one rank.
  void all_reduce(const Tensor& t) const {
    if (sharded()) group->all_reduce(t, ReduceOp::sum);
  }
};

// The widths one rank of a tensor-parallel group computes in a block. Under tensor parallelism
// the attention width differs from the residual width: H stays whole, q, k, v and the attention
// output are heads · D = H / T wide.
struct BlockWidths {
  int64_t hidden = 0;     // H: the residual stream, the modulation (whole on every rank)
  int64_t heads = 0;      // this rank's attention heads: n / T
  int64_t head_dim = 0;   // D
  int64_t attention = 0;  // heads · D
  int64_t mlp = 0;        // this rank's MLP width: M / T
  // Fails naming the model and the numbers when the heads or the MLP width do not split over
  // tp_size ranks.
  static BlockWidths of(const FluxConfig& cfg, int tp_size);
};

// Whether `cfg` splits over tp_size tensor-parallel ranks: fails naming the model, the number
// that does not divide and what to change.
void check_tensor_parallel(const FluxConfig& cfg, int tp_size);

// Whether the FP8 recipe's scales of a rank's shards are the whole tensors' at tp_size ranks.
// Per-block scales (blockwise: blocks of 128 along the split dimensions; mxfp8: 32) are when
// every block of a shard is a block of the whole tensor: when each rank's share of the attention
// width (H / T: the qkv and linear1 rows of each of q, k, v, and the proj and linear2 columns) and
// of the MLP width (M / T) is a multiple of the block length. Fails naming the model, the widths
// and what to change when it is not. Per-tensor recipes always are (the amaxes are reduced over
// the group: Fp8Runtime::cast_args, and the delayed recipe's amax all-reduce).
void check_fp8_tensor_parallel(const FluxConfig& cfg, const Fp8Config& fp8, int tp_size);

}  // namespace flux8
