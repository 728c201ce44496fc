#pragma once
// Data a training run needs besides the shard stream: the embedded demo dataset generated on
// first use, the empty-prompt encodings, and the validation set held in memory.
#include <string>
#include <vector>

#include "data/sample.h"
#include "model/flux_config.h"
#include "train/objective.h"
#include "train/train_config.h"

namespace flux8 {

// With demo_data on: writes the demo dataset into the directory of train_data unless a
// matching one is already there. Returns true when it generated.
bool prepare_demo_data(const TrainConfig& cfg);

// The encodings of the empty prompt: empty_prompt_file is a .safetensors holding "t5" and
// "clip", or a path prefix P with P.t5.npy and P.clip.npy (the demo writes those); empty
// means zeros (what the demo's encoder gives for "").
EmptyPrompt load_empty_prompt(const TrainConfig& cfg);

// All validation samples (at most eval_samples; 0 = all), in file order.
std::vector<Sample> load_validation_set(const TrainConfig& cfg);

}  // namespace flux8
