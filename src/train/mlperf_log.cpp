#include "train/mlperf_log.h"

#include <chrono>

#include "core/error.h"

namespace flux8 {

namespace {

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The narrowest number format a part of the step computes in, in the checker's words.
const char* linear_precision(const TrainConfig& c) {
  if (c.fp8.enabled) return "fp8";
  const BackendOptions& b = c.backend_options;
  return b.bf16_gemm || b.bf16_activations || b.round_activations_to_bf16 ? "bfloat16" : "fp32";
}
const char* attention_precision(const TrainConfig& c) {
  if (c.fp8.enabled && c.fp8.dot_product_attention) return "fp8";
  const BackendOptions& b = c.backend_options;
  return b.bf16_activations || b.round_activations_to_bf16 ? "bfloat16" : "fp32";
}

}  // namespace

MlperfLog::MlperfLog(const std::string& path) : path_(path), out_(path, std::ios::trunc) {
  if (!out_) fail("cannot open {} for writing (the MLPerf log, mlperf_logging: true)", path);
}

MlperfLog::~MlperfLog() {
  if (run_started_ && !stopped_) {
    try {
      run_stop(last_samples_, false);
    } catch (...) {  // unwinding already: the log stays without its last line
    }
  }
}

void MlperfLog::write(const char* type, const std::string& key, const nlohmann::json& value,
                      const nlohmann::json& metadata) {
  nlohmann::json meta = metadata.is_object() ? metadata : nlohmann::json::object();
  meta["file"] = "flux8";
  const nlohmann::json line{{"namespace", ""}, {"time_ms", unix_ms()}, {"event_type", type},
                            {"key", key},      {"value", value},       {"metadata", meta}};
  out_ << ":::MLLOG " << line.dump() << "\n";
  out_.flush();
  if (!out_) fail("cannot write {} (the MLPerf log): is the disk full?", path_);
}

void MlperfLog::point(const std::string& key, const nlohmann::json& value, const nlohmann::json& metadata) {
  write("POINT_IN_TIME", key, value, metadata);
}
void MlperfLog::start(const std::string& key, const nlohmann::json& metadata) {
  write("INTERVAL_START", key, nullptr, metadata);
}
void MlperfLog::end(const std::string& key, const nlohmann::json& metadata) {
  write("INTERVAL_END", key, nullptr, metadata);
}

void MlperfLog::init_start(const TrainConfig& cfg, const std::string& config_path) {
  point("submission_benchmark", "flux1");
  point("submission_org", cfg.mlperf.org);
  point("submission_division", cfg.mlperf.division);
  point("submission_status", cfg.mlperf.status);
  // flux8 does not drop the page cache itself: a submission's launch script that does logs its
  // own cache_clear line with value true.
  point("cache_clear", false);
  start("init_start");
  point("config_filename", config_path);
}

void MlperfLog::hyperparameters(const TrainConfig& cfg, int64_t eval_samples, const std::string& device) {
  point("submission_platform", cfg.mlperf.platform.empty() ? device : cfg.mlperf.platform);
  point("seed", cfg.seed);
  point("global_batch_size", cfg.global_batch);
  point("micro_batch_size", cfg.micro_batch);
  point("gradient_accumulation_steps", cfg.accumulation);
  // The demo's dataset size where flux8 made it, else the samples the run is set to train on.
  point("train_samples", cfg.demo_data ? cfg.demo_train_samples : cfg.train_iters * cfg.global_batch);
  point("eval_samples", eval_samples);
  point("evaluation_frequency", cfg.eval_interval * cfg.global_batch);
  point("opt_name", "adamw");
  point("opt_base_learning_rate", cfg.schedule.lr);
  point("opt_learning_rate_warmup_steps", cfg.schedule.warmup_iters);
  point("opt_adamw_beta_1", cfg.adam.beta1);
  point("opt_adamw_beta_2", cfg.adam.beta2);
  point("opt_adamw_epsilon", cfg.adam.eps);
  point("opt_adamw_weight_decay", cfg.adam.weight_decay);
  point("opt_gradient_clip_norm", cfg.adam.clip_grad);
  point("lowest_numerical_precision_in_linear", linear_precision(cfg));
  point("lowest_numerical_precision_in_attn", attention_precision(cfg));
  point("lowest_numerical_precision_in_comm", cfg.backend_options.bf16_grads ? "bfloat16" : "fp32");
  point("tensor_parallelism", cfg.tensor_parallel);
  point("pipeline_parallelism", cfg.pipeline_parallel);
  point("context_parallelism", cfg.context_parallel);
  point("expert_parallelism", 1);
}

void MlperfLog::run_start(int64_t samples) {
  end("init_stop");
  start("run_start");
  run_started_ = true;
  last_samples_ = samples;
}

void MlperfLog::block_start(int64_t samples) {
  if (in_block_) return;
  start("block_start", {{"samples_count", samples}});
  in_block_ = true;
  last_samples_ = samples;
}

void MlperfLog::block_stop(int64_t samples) {
  if (!in_block_) return;
  end("block_stop", {{"samples_count", samples}});
  in_block_ = false;
  last_samples_ = samples;
}

void MlperfLog::eval(int64_t samples, double val_loss) {
  const nlohmann::json at{{"samples_count", samples}};
  start("eval_start", at);
  // The Flux reference's score is the validation loss; open-division rules name it
  // averaged_validation_loss.
  point("eval_accuracy", val_loss, at);
  point("averaged_validation_loss", val_loss, at);
  end("eval_stop", at);
  last_samples_ = samples;
}

void MlperfLog::run_stop(int64_t samples, bool success) {
  if (stopped_) return;
  block_stop(samples);
  end("run_stop", {{"status", success ? "success" : "aborted"}, {"samples_count", samples}});
  stopped_ = true;
}

}  // namespace flux8
