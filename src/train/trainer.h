#pragma once
// The training loop: data -> objective -> forward/backward with gradient accumulation ->
// clipping + AdamW -> metrics, validation, checkpoints; resumable bit for bit.
#include <memory>
#include <string>
#include <vector>

namespace flux8 {

struct TrainOptions {
  std::string config_path;
  std::vector<std::string> overrides;  // --set key=value
  bool resume = false;                 // continue from the newest valid checkpoint in save_dir
  std::string init_from;               // load weights only (a checkpoint dir or .safetensors)
  int64_t stop_after = 0;              // stop (with a checkpoint) after this many steps in this run
};

struct TrainResult {
  int64_t steps_done = 0;      // optimizer steps completed in total (including before a resume)
  double first_val_loss = 0;   // validation score at the start of this run (NaN without validation)
  double last_val_loss = 0;    // at the end
  double last_loss = 0;        // training loss of the last step
  bool stopped_early = false;  // by a signal or stop_after
  std::string last_checkpoint;
};

TrainResult run_training(const TrainOptions& options);

}  // namespace flux8
