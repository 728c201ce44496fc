// `flux8 train`: the training loop (see src/train/trainer.h).
#include <fmt/core.h>

#include <cmath>

#include "bench/memory_advice.h"
#include "cli/commands.h"
#include "cli/exit_codes.h"
#include "config/config.h"
#include "dist/mpi_runtime.h"
#include "train/signals.h"
#include "train/trainer.h"

namespace flux8::cli {

namespace {

// The run's out-of-memory error with the settings that would fit it (bench/memory_advice.h), for
// this job's split of the GPUs. The advice is planned from the config alone: if the config
// cannot be read again, the error goes out as it came.
[[noreturn]] void rethrow_with_memory_advice(const OutOfMemoryError& e, const TrainOptions& o) {
  std::string advice;
  try {
    const Config cfg = Config::load(o.config_path, o.overrides);
    ParallelShape parallel;
    parallel.tp = static_cast<int>(cfg.get_int("tensor_model_parallel_size"));
    parallel.dp = std::max(1, job_placement().size / parallel.tp);
    parallel.distributed_optimizer = cfg.get_bool("use_distributed_optimizer");
    const AllocationFailure failure{static_cast<double>(e.requested), static_cast<double>(e.free),
                                    static_cast<double>(e.total)};
    advice = describe_memory_advice(memory_advice(cfg, parallel), failure, o.config_path, parallel);
  } catch (const Error&) {
  }
  throw OutOfMemoryError(e.what() + advice, e.requested, e.free, e.total);
}

}  // namespace

Command add_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "train a Flux model (rectified flow) from a YAML config");
  cmd->footer(
      std::string("Watching a run: tensorboard --logdir SAVE_DIR/tensorboard (tensorboard_dir names another; loss, "
                  "lr, grad norm,\n  throughput, memory, validation, FP8 health, samples); every record is also in "
                  "SAVE_DIR/metrics.jsonl,\n  and mlperf_logging: true writes SAVE_DIR/mlperf.log.\n\n") +
      kExitCodesHelp);
  auto o = std::make_shared<TrainOptions>();
  o->decode_script = std::string(FLUX8_SOURCE_DIR) + "/tools/decode_latents.py";
  cmd->add_option("-c,--config", o->config_path, "experiment YAML (e.g. configs/demo.yaml)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", o->overrides, "override a config key: --set key=value (repeatable)");
  cmd->add_option("--resume", o->resume_from,
                  "continue from the newest checkpoint in save_dir that verifies (with none there, say so and start "
                  "from step 0; refuse to start if there are checkpoints but none verifies); --resume PATH: from "
                  "that checkpoint directory (ROOT/step-N), or the newest of that checkpoint root")
      ->expected(0, 1);
  cmd->add_option("--init-from", o->init_from,
                  "start from these weights (a checkpoint directory, a .safetensors in reference or diffusers "
                  "naming in F32/BF16/F16 or FP8 with ComfyUI's scales, e.g. flux1-schnell.safetensors, or a "
                  "diffusers folder, sharded or not; a checkpoint's model file is checked against its manifest); "
                  "optimizer state starts fresh");
  cmd->add_option("--stop-after", o->stop_after,
                  "stop after N steps of this run, saving a checkpoint, as a SIGTERM would (exit status 75: "
                  "resume with --resume)");
  return {cmd, [o, cmd]() {
            o->resume = cmd->count("--resume") > 0;
            TrainResult r;
            try {
              r = run_training(*o);
            } catch (const OutOfMemoryError& e) {
              rethrow_with_memory_advice(e, *o);
            }
            if (job_placement().rank == 0 && !r.stopped_early && std::isfinite(r.first_val_loss) &&
                std::isfinite(r.last_val_loss))
              fmt::print("done: {} steps; validation loss {:.4f} -> {:.4f} ({:+.1f}%)\n", r.steps_done,
                         r.first_val_loss, r.last_val_loss,
                         100.0 * (r.last_val_loss - r.first_val_loss) / r.first_val_loss);
            return r.stopped_early ? kExitStopped : kExitFinished;
          }};
}

}  // namespace flux8::cli
