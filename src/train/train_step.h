#pragma once
// One training step's gradients: the global batch split into micro-batches, each through the
// objective, forward, loss and backward, gradients accumulated in the flat buffer.
#include <functional>
#include <vector>

#include "backend/communicator.h"
#include "backend/step_graph.h"
#include "data/loader.h"
#include "data/sample.h"
#include "model/flux_model.h"
#include "model/owned_tensors.h"
#include "train/objective.h"
#include "train/optimizer.h"
#include "train/progress.h"

namespace flux8 {

// Backend buffers for one micro-batch, allocated once per shape (not per step).
class StepBuffers {
 public:
  StepBuffers(Backend& be, DType dtype) : be_(be), owned_(be, dtype), losses_owned_(be, DType::f64) {}

  // Uploads a host batch and draws the flow-matching noise; returns the model inputs
  // (img = x_t); x0, target and dpred are filled or sized to match. The three steps below.
  const FluxInputs& upload(const HostBatch& b, const FluxConfig& m, uint64_t seed);

  // Whether the buffers have b's shape; reserve() reallocates them for it when not.
  bool holds(const HostBatch& b) const;
  void reserve(const HostBatch& b, const FluxConfig& m);
  // b's tensors into the buffers (which hold its shape) through `copy`: host -> backend memory,
  // the backend's upload or a copy queue's (train/batch_pipeline.h).
  using Copy = std::function<void(void* dst, const void* host_src, size_t bytes)>;
  void copy_in(const HostBatch& b, const Copy& copy);
  // x_t and the target from x0, t and b's noise streams, on the backend's queue.
  void draw_noise(const HostBatch& b, uint64_t seed);

  FluxInputs in;
  Tensor x0, target, dpred;
  // The micro-batch on the host, written in place by each step (make_train_batch's reuse).
  HostBatch host;
  // f64 [n] in backend memory: the losses of a step's n micro-batches (mse_loss_into), read
  // once after the last backward. Grown, never shrunk; kept when upload() reallocates the rest.
  Tensor losses(int64_t n);

 private:
  void allocate(const HostBatch& b, const FluxConfig& m);
  Backend& be_;
  StepShape shape_{0, 0, 0};
  OwnedTensors owned_;
  std::vector<char> staging_;  // copy_in's converted values
  OwnedTensors losses_owned_;  // holds losses_ alone
  Tensor losses_;
};

struct StepContext {
  FluxModel& model;
  const FluxConfig& cfg;
  const ObjectiveConfig& obj;
  const EmptyPrompt& empty;
  StepBuffers& buffers;
  uint64_t seed;
  // cuda_graph: the model's backend, whose regions each micro-batch's forward, loss and
  // backward run in (null: op by op).
  StepGraph* graph = nullptr;
  // The data-parallel group (null: one rank): the step's losses are summed over it.
  Communicator* data_parallel = nullptr;
  // Told which gradients are final during the backward of each step's last micro-batch
  // (FluxModel::backward): the data-parallel gradient buckets (train/gradient_buckets.h).
  FinalGradients* final_gradients = nullptr;
};

struct StepLoss {
  double loss = 0;     // mean loss over the global batch
  int64_t tokens = 0;  // text + image tokens processed
  double model_flops =
      0;            // model FLOPs of the step's forward and backward (docs/WORKLOADS.md's convention, model/flops.h)
  DataTiming data;  // from a BatchPipeline: the micro-batches' host time, summed
};

// Zeroes the gradients, then accumulates the gradient of the step's mean loss over
// `samples` (the whole global batch of optimizer step `step`, 0-based) in micro-batches of
// `micro` samples. Each micro-batch's loss gradient is scaled by micro/global, so any split
// gives the same gradient up to rounding. The losses stay on the device until the last backward
// is queued: nothing in between waits for it.
// With data parallelism (ctx.data_parallel), `samples` are this rank's share of a step of
// `global_samples`, starting at index `first_index` of the global batch (its draws are keyed by
// that index); the loss is then the whole step's, summed over the ranks. 0: samples.size().
StepLoss accumulate_step_gradients(const StepContext& ctx, const std::vector<Sample>& samples, int64_t micro,
                                   uint64_t step, int64_t first_index = 0, int64_t global_samples = 0);

class BatchPipeline;
// The same with the micro-batches of step `step` (0-based) taken from `pipeline`, which built
// and uploaded them (the trainer's path: the next is built while this one computes); the
// loader's position after the step's last sample goes to *loader_after.
StepLoss accumulate_step_gradients(const StepContext& ctx, BatchPipeline& pipeline, int64_t step,
                                   LoaderState* loader_after);

// The optimizer update of step `step` (1-based) with the model's FP8 bookkeeping around it, in
// the order the delayed recipe needs: the scale update (all the step's amaxes are in), AdamW
// writing the new weights and their FP8 casts with the next step's scales, then those casts
// completed. With `finite_loss` false AdamW is skipped (the weights stay; their casts are redone
// with the new scales) and the result is not applied.
StepStats apply_optimizer_step(FluxModel& model, AdamWOptimizer& opt, int64_t step, double lr, bool finite_loss = true);

}  // namespace flux8
