// `flux8 train`: the training loop (see src/train/trainer.h).
#include <fmt/core.h>

#include <cmath>

#include "cli/commands.h"
#include "dist/mpi_runtime.h"
#include "train/signals.h"
#include "train/trainer.h"

namespace flux8::cli {

Command add_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "train a Flux model (rectified flow) from a YAML config");
  auto o = std::make_shared<TrainOptions>();
  cmd->add_option("-c,--config", o->config_path, "experiment YAML (e.g. configs/demo.yaml)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", o->overrides, "override a config key: --set key=value (repeatable)");
  cmd->add_option("--resume", o->resume_from,
                  "continue from the newest checkpoint in save_dir that verifies (start fresh if there is none; "
                  "refuse to start if there are checkpoints but none verifies); --resume PATH: from that "
                  "checkpoint directory (ROOT/step-N), or the newest of that checkpoint root")
      ->expected(0, 1);
  cmd->add_option("--init-from", o->init_from,
                  "start from these weights (a checkpoint directory, a .safetensors in reference or diffusers "
                  "naming in F32/BF16/F16 or FP8 with ComfyUI's scales, e.g. flux1-schnell.safetensors, or a "
                  "diffusers folder, sharded or not; a checkpoint's model file is checked against its manifest); "
                  "optimizer state starts fresh");
  cmd->add_option("--stop-after", o->stop_after,
                  "stop after N steps of this run, saving a checkpoint, as a SIGTERM would (exit status 0)");
  return {cmd, [o, cmd]() {
            o->resume = cmd->count("--resume") > 0;
            const TrainResult r = run_training(*o);
            if (job_placement().rank == 0 && !r.stopped_early && std::isfinite(r.first_val_loss) &&
                std::isfinite(r.last_val_loss))
              fmt::print("done: {} steps; validation loss {:.4f} -> {:.4f} ({:+.1f}%)\n", r.steps_done,
                         r.first_val_loss, r.last_val_loss,
                         100.0 * (r.last_val_loss - r.first_val_loss) / r.first_val_loss);
            return r.stopped_early ? kStoppedExitCode : 0;
          }};
}

}  // namespace flux8::cli
