#pragma once
// Training checkpoints: everything a run needs to resume bit-exactly, as a directory
//
//   ROOT/step-0000100/
//     model.safetensors      all parameters, F32, reference names (also a plain weights file)
//     optimizer.safetensors  AdamW moments "exp_avg.<param>" and "exp_avg_sq.<param>", F32
//                            (bf16 moments, adam_moment_precision, widened exactly)
//     trainer_state.json     TrainerState
//     manifest.json          format version, step, and bytes + sha256 of every other file
//
// A checkpoint is written into ROOT/.tmp-step-N-<pid>/ and renamed into place only when every
// file and the directory are on disk, so a killed run leaves either no step-N or a complete
// one. The manifest catches what renaming cannot: files truncated by a copy, a full disk, or
// bytes altered on disk.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "fp8/meta.h"
#include "io/safetensors.h"
#include "model/flux_config.h"
#include "model/params.h"
#include "model/weights_io.h"
#include "train/data_parallel.h"
#include "train/trainer_state.h"

namespace flux8 {

// 2: the safetensors files' digests are per 32 MiB piece (verified in parallel); 1 (still read):
// one SHA-256 per file.
inline constexpr int kCheckpointFormatVersion = 2;

// "step-0000100" (at least 7 digits; more for steps >= 10^7).
std::string checkpoint_dir_name(int64_t step);

// Writes ROOT/step-N (N = state.step), replacing an existing one, then prunes (keep_last <= 0
// keeps all): it keeps the checkpoint just written and the newest keep_last - 1 others that
// verify, and removes every checkpoint older than those. A damaged checkpoint among the kept
// ones does not count toward keep_last and is not removed: it is left in place, with a warning
// on stderr (once per process) naming it and its problem, for a person to inspect and remove.
// Whether a checkpoint verifies is remembered per process (the ones it wrote or verified, while
// their files' sizes and times are unchanged), so pruning reads only checkpoints it has not
// seen. Then .tmp-* directories left by killed runs are removed. A save that fails removes its
// own temporary directory before it throws, and the checkpoints before it stay as they were.
// adam_m and adam_v are flat moment buffers laid out like store.flat_params(), on
// `moments_backend` (null: the store's backend; offloaded moments are on a host one). Returns the
// checkpoint's path. With `fp8`, the delayed-scaling state is saved too (fp8_state.safetensors).
//
// Test hook: FLUX8_TEST_STOP_IN_SAVE=N in the environment (read once) stops the process with
// SIGSTOP in the save of step N, after its model and optimizer files are written into the
// temporary directory and before its manifest (tests/test_faults.cpp kills it there).
std::string save_checkpoint(const std::string& root, const TrainerState& state, const FluxConfig& cfg,
                            const ParamStore& store, const Tensor& adam_m, const Tensor& adam_v, int keep_last,
                            const Fp8MetaRegistry* fp8 = nullptr, Backend* moments_backend = nullptr);

// The flat buffers a checkpoint writes, laid out like a store's parameters, each on the backend
// whose memory holds it: the store's masters and moments, or (the distributed optimizer) the
// whole-buffer masters and moments its group's rank 0 gathered into host memory
// (AdamWOptimizer::gather_moments, full_masters).
struct CheckpointFlats {
  Tensor params, adam_m, adam_v;
  Backend* params_on = nullptr;
  Backend* moments_on = nullptr;
  // The store's masters (whole on this rank) with these moments (null: on the store's backend).
  static CheckpointFlats of(const ParamStore& store, const Tensor& adam_m, const Tensor& adam_v,
                            Backend* moments_on = nullptr);
};
// save_checkpoint from `flats`, which store.layout() lays out.
std::string save_checkpoint(const std::string& root, const TrainerState& state, const ParamStore& store,
                            const CheckpointFlats& flats, int keep_last, const Fp8MetaRegistry* fp8 = nullptr);

// The same files from flat buffers laid out like `params`, on a backend or in host memory: the
// checkpoint of a tensor-parallel job, whose whole tensors world rank 0 assembled from the
// ranks' shards (train/checkpoint_shards.h). `params` holds whole tensors (a one-rank layout).
std::string save_checkpoint(const std::string& root, const TrainerState& state, const std::vector<ParamInfo>& params,
                            const FlatSource& values, const FlatSource& adam_m, const FlatSource& adam_v, int keep_last,
                            const Fp8MetaRegistry* fp8 = nullptr);

// The bytes of a checkpoint directory's files (what the log says a save wrote).
uint64_t checkpoint_bytes(const std::string& dir);

// A checkpoint's contents copied to host memory between two steps, so that its files can be
// written while training goes on (`async_save`): the copy is what the step loop waits for (the
// parameters and moments as stored: W2's slice 10.5 GB in 0.29 s on the H200's host), the
// conversion, hashing and writing (~5 s at W2) run behind it. The buffers are kept and refilled
// by the next take(); reserve() maps their pages beforehand (faulting them in during the first
// copy took it to 1.27 s).
class CheckpointSnapshot {
 public:
  // Host bytes a snapshot of this state takes: the parameters and both moments in their types.
  static uint64_t bytes_for(const ParamStore& store, const Tensor& adam_m, const Tensor& adam_v);
  // The same from the moments' type alone: the moments are laid out like the parameters (a
  // sharded optimizer's whole-buffer moments need not exist to be counted).
  static uint64_t bytes_for(const ParamStore& store, DType moment_dtype);
  // Allocates and touches the buffers of a snapshot of this state (sizes and types only: no
  // backend call, so any thread may run it before the first take()).
  void reserve(const ParamStore& store, const Tensor& adam_m, const Tensor& adam_v);
  void reserve(const ParamStore& store, DType moment_dtype);
  // Copies the state as save_checkpoint would write it now (same arguments).
  void take(const TrainerState& state, const ParamStore& store, const Tensor& adam_m, const Tensor& adam_v,
            const Fp8MetaRegistry* fp8);
  void take(const TrainerState& state, const ParamStore& store, const CheckpointFlats& flats,
            const Fp8MetaRegistry* fp8);
  // Writes ROOT/step-N from the copy: the same files, byte for byte, as save_checkpoint at
  // take()'s moment, with the same atomic rename and pruning. Uses no backend: any thread.
  std::string write(const std::string& root, int keep_last) const;
  int64_t step() const { return state_.step; }
  uint64_t bytes() const;  // host memory held

 private:
  struct HostFlat {
    std::unique_ptr<std::byte[]> data;
    size_t bytes = 0;
    DType dtype = DType::f32;
    void reserve(size_t n, bool touch);  // keeps the buffer when it has n bytes
  };
  TrainerState state_;
  std::vector<ParamInfo> params_layout_;
  HostFlat params_, m_, v_;
  std::optional<SafetensorsWriter> fp8_;
  bool taken_ = false;
};

// The newest ROOT/step-N whose files all match its manifest (sizes and sha256), or nullopt
// when there is none. Each skipped checkpoint gets a warning line on stderr naming it and the
// failing file; the same lines are appended to *report when given.
std::optional<std::string> find_latest_checkpoint(const std::string& root, std::string* report = nullptr);

// The checkpoint `--resume` continues from: find_latest_checkpoint's, except that when ROOT has
// checkpoints and none of them verifies it fails, naming each one and its problem, instead of
// returning nullopt (a run that started over would overwrite metrics.jsonl and, by pruning, the
// damaged checkpoints someone may still recover). nullopt only when ROOT has no step-N at all.
std::optional<std::string> checkpoint_to_resume(const std::string& root, std::string* report = nullptr);

// For --resume PATH: a checkpoint directory (ROOT/step-N) is verified (every digest) and taken,
// whatever step it is at; a checkpoint root gives checkpoint_to_resume's; anything else fails.
std::string chosen_checkpoint(const std::string& path);

// Fails naming the directory, the file and the problem (missing, wrong size, checksum).
void verify_checkpoint(const std::string& dir);

// How much load_checkpoint checks before it loads: every file's digests, or (right after
// find_latest_checkpoint verified them: a resume need not read the whole checkpoint twice) only
// the files' presence and sizes.
enum class CheckpointVerify { digests, sizes };

// Verifies `dir`, then loads parameters, moments and state exactly as saved (F32 values into
// f32 or f64 buffers; into bf16 moments rounded to nearest even, exact for moments saved from
// bf16). `state` is assigned only when everything loaded. The files hold whole tensors: a
// tensor-parallel rank's store and moments get their shards of them, at any tensor-parallel size.
// With `fp8` (an FP8 run), its state is restored from the checkpoint's FP8 state, or starts
// fresh when the checkpoint has none (a BF16 run); a BF16 run ignores a checkpoint's FP8 state.
// What happened is described in *fp8_note. The moments are on `moments_backend` (null: the
// store's).
// moments_range: adam_m and adam_v hold the moments of that range of the flat buffer only (the
// distributed optimizer's shard, AdamWOptimizer::owned(): each rank reads its part of the file,
// no whole-buffer moments anywhere); a store with sharded masters loads the part it holds.
void load_checkpoint(const std::string& dir, TrainerState& state, const FluxConfig& cfg, ParamStore& store,
                     const Tensor& adam_m, const Tensor& adam_v, Fp8MetaRegistry* fp8 = nullptr,
                     std::string* fp8_note = nullptr, CheckpointVerify verify = CheckpointVerify::digests,
                     Backend* moments_backend = nullptr, std::optional<FlatRange> moments_range = std::nullopt);

// For --init-from: a checkpoint directory -> its model.safetensors, checked against the
// manifest; a file inside a checkpoint directory (step-N/model.safetensors) -> itself, checked
// the same way; any other file, and a diffusers folder (model/weight_source.h) -> itself;
// anything else fails saying what was expected.
std::string resolve_weights_path(const std::string& path_or_dir);

// trainer_state.json text, and its strict reader: every field must be present with its type
// and in range (counts and positions >= 0, skipped_steps <= step), unknown fields are refused;
// errors name `where` and the field (src/train/checkpoint_manifest.cpp).
std::string trainer_state_to_json(const TrainerState& state);
TrainerState trainer_state_from_json(const std::string& text, const std::string& where);

}  // namespace flux8
