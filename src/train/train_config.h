#pragma once
// Everything `flux8 train` reads from its config, typed, read and checked once before any work
// is done (TrainConfig::from_config); the trainer and its helpers read only this afterwards.
// The meaning of each key is in the schema (config/schema.cpp, `flux8 config --list`).
#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "fp8/fp8_config.h"
#include "model/flux_config.h"
#include "model/flux_model.h"
#include "train/batch_pipeline.h"
#include "train/objective.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace flux8 {

class Config;

struct TrainConfig {
  FluxConfig model;
  Fp8Config fp8;
  ObjectiveConfig objective;
  AdamWConfig adam;
  std::string backend;  // backend
  BackendOptions backend_options;

  // Batches: global_batch samples a step in accumulation micro-batches of micro_batch.
  int64_t micro_batch = 1;   // micro_batch_size
  int64_t global_batch = 1;  // global_batch_size (0 there: micro_batch_size)
  int64_t accumulation = 1;
  int64_t train_iters = 1;
  LrSchedule schedule;  // lr, min_lr, lr_warmup_iters, lr_decay_iters (0 there: train_iters), lr_decay_style
  uint64_t seed = 0;
  RecomputePolicy recompute = Recompute::none;  // recompute_granularity, recompute_method, recompute_num_layers
  bool cuda_graph = true;
  bool cuda_graph_set = false;  // cuda_graph was set by the user, not left at its default
  enum class NanPolicy { skip, halt } nan_policy = NanPolicy::skip;
  int64_t nan_max_consecutive_skips = 10;

  // Data.
  std::string train_data, valid_data, empty_prompt_file;
  size_t data_shuffle_buffer = 0;
  size_t data_prefetch = 1;
  bool data_skip_corrupt = false;
  BatchPipelineSpec::Mode data_overlap = BatchPipelineSpec::Mode::automatic;
  int64_t eval_samples = 0;  // 0 = all
  // The embedded demo dataset (demo_data), generated into train_data's directory.
  bool demo_data = false;
  int64_t demo_train_samples = 0, demo_val_samples = 0;
  int64_t image_size = 0;

  // The run's outputs.
  std::string save_dir;
  int64_t save_interval = 0, keep_last_checkpoints = 0;
  enum class AsyncSave { automatic, on, off } async_save = AsyncSave::automatic;
  int64_t eval_interval = 0, log_interval = 1;
  std::vector<std::string> sample_prompts;  // sample_prompts, split at ';' and trimmed
  int64_t sample_steps = 0, samples_per_prompt = 0;
  // Logs beside metrics.jsonl (docs/USAGE.md, "Watching a run").
  std::string tensorboard_dir;  // resolved: SAVE_DIR/tensorboard by default, "" for none
  bool log_timers_to_tensorboard = false;
  struct MlperfSubmission {
    bool on = false;  // mlperf_logging
    std::string org, platform, division, status;
  } mlperf;
  double target_eval_loss = 0;         // 0 = none
  int64_t sample_interval = 0;         // previews into save_dir/samples/ every N steps; 0 = none
  std::string sample_text_embeddings;  // encoded prompts (latent models; pixel-space models may use them too)
  std::string sample_vae;              // decodes latent samples to PNG; empty = latents kept
  double sample_guidance = 3.5;

  // Parallelism (docs/DISTRIBUTED.md): the Megatron keys.
  int tensor_parallel = 1;  // tensor_model_parallel_size
  int pipeline_parallel = 1, context_parallel = 1;
  bool distributed_optimizer = false;  // use_distributed_optimizer
  bool offload_masters = false;        // optimizer_offload: cpu (the f32 master weights in host memory)
  // overlap_grad_reduce: gradient buckets reduced during the backward (train/gradient_buckets.h);
  // overlap_param_gather: accepted, the weights are gathered after the update (docs/DISTRIBUTED.md).
  bool overlap_grad_reduce = false, overlap_param_gather = false;
  double distributed_timeout_s = 600;  // distributed_timeout_minutes

  std::string config_yaml;  // the resolved config (Config::dump), for the checkpoints
  // What the config sets to no effect, or what flux8 honours differently from Megatron, one
  // line each naming the key (the trainer logs them at the start).
  std::vector<std::string> warnings;

  // Reads every key above and checks what the schema cannot check key by key; errors name the
  // key and where it was set.
  static TrainConfig from_config(const Config& cfg);
};

}  // namespace flux8
