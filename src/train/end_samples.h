#pragma once
// The sample grid a run writes when it finishes (sample_prompts), so the user sees what the
// model learned without another command.
#include <string>

#include "model/flux_model.h"

namespace flux8 {

class Config;
class Progress;

// Writes SAVE_DIR/samples.png (pixel-space models) or SAVE_DIR/samples.safetensors (latent
// models, when the config names text embeddings) for the prompts in sample_prompts; nothing
// when sample_prompts is empty.
void write_end_of_run_samples(const Config& cfg, const FluxConfig& model_cfg, FluxModel& model,
                              const std::string& save_dir, Progress& progress);

}  // namespace flux8
