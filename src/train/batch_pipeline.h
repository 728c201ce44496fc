#pragma once
// The trainer's input pipeline: micro-batch k + 1 is read, assembled and uploaded while the
// device computes micro-batch k.
//
// Why: at W1's shape a step's batch is 32 samples of 4.2 MB; assembling it (make_train_batch)
// and uploading it in line takes the host about as long as the GPU's step, with the GPU idle
// (docs/PERFORMANCE.md). Here a producer thread takes each micro-batch's
// samples from the loader, builds the host batch and uploads it into one of two device slots on
// the backend's copy queue (a CUDA stream of its own), while the training thread runs the
// model on the other slot. Events order the two queues: a slot is refilled only after the ops
// that read it, and read only after its copies — no host wait on either side.
//
// What does not change: the order of samples, every random draw (make_train_batch's are keyed
// by step and sample index; the flow-matching noise is drawn on the training thread at
// acquire()), and the loader position a checkpoint stores — each micro-batch carries the
// loader's state right after its samples were taken, so a run stopped at step k resumes at
// step k + 1's samples though the producer had already read them. Bit for bit the results of
// building each batch on the training thread (TrainStep.PipelinedStepsEqualPlainOnes).
//
// Device memory is allocated only on the training thread (an allocation synchronises, and a
// CUDA graph may be being captured there): a slot whose shape changes, its first fill
// included, is uploaded by acquire() itself. A loader error reaches the training thread at the
// acquire() of the micro-batch it stopped, after the steps before it completed.
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "data/loader.h"
#include "model/flux_model.h"
#include "train/objective.h"
#include "train/progress.h"
#include "train/train_step.h"

namespace flux8 {

struct BatchPipelineSpec {
  const FluxConfig& model;
  const ObjectiveConfig& obj;
  const EmptyPrompt& empty;
  uint64_t seed = 0;
  int64_t global = 1, micro = 1;  // samples a step (all ranks) and a micro-batch
  int64_t first_step = 0;         // 0-based index of the first step's batch
  int64_t end_step = 0;           // no batch is built for this step or later
  // Build and upload on a thread of its own, or inside acquire() on the caller's; automatic:
  // a thread when the backend's copy queue is asynchronous (CUDA), the caller's otherwise (the
  // CPU backend computes on every core, and its batches are small beside its steps).
  enum class Mode { automatic, thread, caller } mode = Mode::automatic;
  // Data parallelism: rank dp_rank of dp_size builds the micro-batches of its consecutive share
  // of each step's samples, global / dp_size of them (a multiple of micro). Every rank reads the
  // whole step's samples from its loader (the same stream on every rank) and builds only its
  // own, so the global batch and every draw keyed by a sample's index in it are those of one
  // process, whatever dp_size is.
  int dp_rank = 0, dp_size = 1;
};

class BatchPipeline {
 public:
  // Takes samples from `loader` (nothing else may, until the pipeline is destroyed).
  BatchPipeline(Backend& be, DataLoader& loader, const BatchPipelineSpec& spec);
  ~BatchPipeline();  // stops the producer (also while it waits) and frees the slots
  BatchPipeline(const BatchPipeline&) = delete;
  BatchPipeline& operator=(const BatchPipeline&) = delete;

  bool background() const { return background_; }
  // Micro-batches a step on this rank.
  int64_t parts() const { return parts_; }
  const BatchPipelineSpec& spec() const { return spec_; }

  // A micro-batch on the device: the model's inputs with x_t and the target drawn.
  struct MicroBatch {
    const FluxInputs* in = nullptr;
    Tensor target, dpred;
    const HostBatch* host = nullptr;  // t, noise streams, shape
    int64_t step = 0, part = 0;       // 0-based step, micro-batch within it
    LoaderState loader_after;         // the loader's position after this micro-batch's samples
    DataTiming timing;
  };
  // The next micro-batch in order (step first_step, part 0, then 1, ...): waits until it is
  // built, queues the wait for its copies and draws the flow-matching noise. Rethrows the
  // producer's error for this micro-batch. Beyond end_step it fails.
  MicroBatch acquire();
  // The acquired micro-batch's last op is queued: its slot may be refilled after that.
  void release();

 private:
  enum class State { free, filling, host_ready, ready, in_use };
  struct Slot {
    State state = State::free;
    int64_t step = 0, part = 0;
    LoaderState loader_after;
    DataTiming timing;
    std::exception_ptr error;
    // The host batch and its device tensors (allocated and reallocated on the training thread).
    std::unique_ptr<StepBuffers> buffers;
    std::unique_ptr<Backend::Event> copied, read;  // its copies are in / its readers are done
  };

  void produce(Slot& s, int64_t index);  // host batch, then upload if the buffers hold its shape
  void run();                            // the producer thread

  Backend& be_;
  DataLoader& loader_;
  BatchPipelineSpec spec_;
  int64_t parts_ = 1;
  int64_t end_index_ = 0;  // micro-batches to build: (end_step - first_step) * parts
  bool background_ = false;
  std::unique_ptr<Backend::CopyQueue> queue_;
  Slot slots_[2];
  std::vector<Sample> samples_;  // producer's

  int64_t consumed_ = 0;  // micro-batches acquired (and released, but the one in use)
  bool acquired_ = false;
  std::exception_ptr error_;  // the producer's, once acquire() has met it
  std::mutex mutex_;
  std::condition_variable changed_;
  bool stopping_ = false;
  std::thread producer_;
};

}  // namespace flux8
