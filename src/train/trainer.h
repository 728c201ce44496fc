#pragma once
// The training loop: data -> objective -> forward/backward with gradient accumulation ->
// clipping + AdamW -> metrics, validation, checkpoints; resumable bit for bit.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace flux8 {

// Tests only (no command-line option): a NaN written into one parameter's gradient before the
// optimizer update of the given steps, which the run must then skip (tests/test_faults.cpp).
struct NanGradientFault {
  std::string param;           // a parameter's reference name, e.g. "final_layer.linear.weight"
  std::vector<int64_t> steps;  // 1-based, as in the log
};

struct TrainOptions {
  std::string config_path;
  std::vector<std::string> overrides;  // --set key=value
  bool resume = false;     // continue from the newest checkpoint in save_dir that verifies (checkpoint_to_resume)
  std::string resume_from;  // with resume: this checkpoint (or root's newest) instead (chosen_checkpoint)
  std::string init_from;   // load weights only (a checkpoint dir or .safetensors)
  int64_t stop_after = 0;  // stop (with a checkpoint) after this many steps in this run
  NanGradientFault nan_gradient;  // tests only
  std::string decode_script;      // tools/decode_latents.py: decodes latent samples to PNG (train/latent_decoder.h)
};

struct TrainResult {
  int64_t steps_done = 0;      // optimizer steps completed in total (including before a resume)
  double first_val_loss = 0;   // validation score at the start of this run (NaN without validation)
  double last_val_loss = 0;    // at the end
  double last_loss = 0;        // training loss of the last step
  bool stopped_early = false;  // by a signal or stop_after
  // Validation reached target_eval_loss: the run stopped there, finished.
  bool reached_target = false;
  std::string last_checkpoint;
};

TrainResult run_training(const TrainOptions& options);

}  // namespace flux8
