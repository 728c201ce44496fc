#pragma once
// Checkpoints written behind training (`async_save`): at a save the step loop waits only for a
// host copy of the state (CheckpointSnapshot); a thread of its own converts, hashes and writes
// the files while the next steps run. At most one save is in flight: the next one first waits
// for it. A save that fails is reported, with its step and directory, by the next call (poll,
// start or wait), which throws; the destructor finishes a save in flight, so a run that stops
// on an error still leaves its last snapshot on disk.
#include <cstdint>
#include <future>
#include <optional>
#include <string>

#include "train/checkpoint.h"

namespace flux8 {

// MemAvailable of /proc/meminfo in bytes, or nullopt where it cannot be read.
std::optional<uint64_t> host_memory_available();

class AsyncCheckpointer {
 public:
  AsyncCheckpointer(std::string root, int keep_last);
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // Whether a snapshot of `bytes` fits beside what the run needs: at most half of the host
  // memory available now (the rest for the data loader, the page cache the files go through,
  // and other processes). Where the memory cannot be read, it is assumed to fit.
  static bool fits(uint64_t bytes, std::optional<uint64_t> available);

  // Maps the snapshot's host memory on a thread of its own now, while training starts, so that
  // the first save's copy costs what later ones do (optional; start() waits for it).
  void prepare(const ParamStore& store, const Tensor& adam_m, const Tensor& adam_v);
  void prepare(const ParamStore& store, DType moment_dtype);  // moments laid out like the parameters

  struct Finished {
    int64_t step = 0;
    std::string dir;
    uint64_t bytes = 0;          // the checkpoint's files
    double write_seconds = 0.0;  // from the snapshot's end to the rename and pruning
  };
  struct Started {
    std::string dir;              // ROOT/step-N, complete once the write finishes
    uint64_t snapshot_bytes = 0;  // host memory the copy holds
    double wait_seconds = 0.0;    // for the previous save (or prepare) to finish
    double snapshot_seconds = 0.0;
    std::optional<Finished> previous;  // the save this one waited for, not yet polled
  };
  // Waits for the save in flight (throwing if it failed), copies the state (save_checkpoint's
  // arguments) and starts writing it.
  Started start(const TrainerState& state, const ParamStore& store, const Tensor& adam_m, const Tensor& adam_v,
                const Fp8MetaRegistry* fp8);
  Started start(const TrainerState& state, const ParamStore& store, const CheckpointFlats& flats,
                const Fp8MetaRegistry* fp8);

  // The save that finished since the last call, if one did; throws if it failed.
  std::optional<Finished> poll();
  // Waits for the save in flight: its result, or nullopt when none was in flight; throws if it
  // failed.
  std::optional<Finished> wait();
  bool busy() const { return pending_.valid(); }

 private:
  Finished collect();

  std::string root_;
  int keep_last_;
  CheckpointSnapshot snapshot_;
  std::future<void> preparing_;
  int64_t pending_step_ = -1;
  std::future<Finished> pending_;
};

}  // namespace flux8
