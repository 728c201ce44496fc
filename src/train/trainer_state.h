#pragma once
// Everything besides weights and optimizer moments that a resumed run needs to continue
// exactly where it stopped. Saved as trainer_state.json in every checkpoint.
#include <cstdint>
#include <string>

namespace flux8 {

struct TrainerState {
  int64_t step = 0;              // optimizer steps completed
  int64_t consumed_samples = 0;  // training samples drawn so far (all ranks)
  int64_t data_epoch = 0;        // data loader position: epoch ...
  int64_t data_position = 0;     // ... and samples consumed within it
  uint64_t seed = 0;             // run seed; noise is keyed by (seed, step, rank, sample)
  int64_t skipped_steps = 0;     // steps skipped for a non-finite loss or gradient
  double last_loss = 0;          // loss of the last completed step (for the log line on resume)
  std::string config_yaml;       // the resolved config of the run (Config::dump())
  std::string flux8_version = "0.1.0";
};

}  // namespace flux8
