#pragma once
// The sample grid a run writes when it finishes (sample_prompts), so the user sees what the
// model learned without another command.
#include <string>

#include "model/flux_model.h"
#include "train/train_config.h"

namespace flux8 {

class Progress;

// Writes SAVE_DIR/samples.png (pixel-space models; also TensorBoard's image "samples" at `step`)
// for the prompts in sample_prompts; nothing when sample_prompts is empty.
void write_end_of_run_samples(const TrainConfig& cfg, FluxModel& model, int64_t step, Progress& progress);

}  // namespace flux8
