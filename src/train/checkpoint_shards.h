#pragma once
// Checkpoints of a tensor-parallel job. A checkpoint is one directory whatever the job's layout,
// the one a one-rank run writes (train/checkpoint.h): model.safetensors and
// optimizer.safetensors hold whole tensors under the reference names, so a checkpoint loads at
// any tensor × data-parallel layout (resharding) and in diffusers or ComfyUI as before.
//
// Saving: the ranks of tensor-parallel group 0 bring their shards to world rank 0, which
// assembles the whole tensors in host memory and writes the directory (with the distributed
// optimizer, each data-parallel group's rank 0 first gathers its group's shards of the masters
// and moments into host memory: AdamWOptimizer::gather_moments). Loading: load_checkpoint
// (train/checkpoint.h) reads the file's whole tensors on every rank and keeps this rank's part:
// its tensor-parallel shard of each (upload_file_shard), and of that the elements whose masters
// and moments it holds (load_checkpoint's moments_range).
#include <string>

#include "backend/backend.h"
#include "core/tensor.h"
#include "dist/process_groups.h"
#include "fp8/meta.h"
#include "io/safetensors.h"
#include "model/flux_config.h"
#include "model/params.h"
#include "model/weights_io.h"
#include "train/checkpoint.h"
#include "train/trainer_state.h"

namespace flux8 {

// Writes ROOT/step-N (N = state.step) as save_checkpoint does for a one-rank run with the same
// weights and moments: the same files, byte for byte, with the same atomic rename, verification
// and pruning. Every rank of the job calls it with its store (its tensor-parallel shard of the
// model) and its whole-buffer moments (AdamWOptimizer::full_exp_avg/_sq, gathered over the
// data-parallel group beforehand); `fp8` is read on rank 0 only. Ranks outside tensor-parallel
// group 0 hold the same state as that group and return at once. The split tensors are gathered
// one at a time over groups.tp(): peak memory is, on rank 0's host, the whole model's parameters
// and both moments in their types (CheckpointSnapshot::bytes_for of a one-rank store) plus one
// split tensor's shards, and on each rank of group 0 one backend buffer of the largest split
// tensor's whole size. Returns the checkpoint's path on world rank 0, "" on the other ranks.
// A rank that fails here throws; rank 0 renames the directory into place only after every shard
// arrived, so the previous checkpoint stays the newest.
std::string save_checkpoint_shards(ProcessGroups& groups, const std::string& root, const TrainerState& state,
                                   const FluxConfig& cfg, const ParamStore& store, const Tensor& adam_m,
                                   const Tensor& adam_v, int keep_last, const Fp8MetaRegistry* fp8 = nullptr);
// The same from `flats` (the distributed optimizer's whole-buffer state, gathered into the host
// memory of each data-parallel group's rank 0): a flat in host memory goes up to the backend a
// split tensor's shard at a time for the tensor-parallel gather.
std::string save_checkpoint_shards(ProcessGroups& groups, const std::string& root, const TrainerState& state,
                                   const FluxConfig& cfg, const ParamStore& store, const CheckpointFlats& flats,
                                   int keep_last, const Fp8MetaRegistry* fp8 = nullptr);

// Uploads into `t` (parameter p's tensor, or its slice of a moment buffer) this rank's part of
// the file's whole tensor `name`: all of it for a tensor held whole, p.shard's part of it for a
// split one (through f64: exact into f32 and f64, rounded to nearest even into bf16). The caller
// checked the file tensor's shape against p.shard.full.
void upload_file_shard(Backend& be, const SafetensorsReader& file, const std::string& name, const ParamInfo& p,
                       const Tensor& t, UploadBuffers& buffers);

}  // namespace flux8
