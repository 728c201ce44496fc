#pragma once
// The MLPerf Training log (mlperf_logging: true): `:::MLLOG {json}` lines in SAVE_DIR/mlperf.log
// with the events and keys of the Flux benchmark (flux1), as the mlperf-logging package's
// compliance checker reads them: the submission, init_start/init_stop, the hyperparameters,
// run_start, blocks of training between evaluations (block_start/block_stop by samples_count),
// eval_start/eval_accuracy/eval_stop, and run_stop with status success or aborted. Rank 0 writes
// it. docs/USAGE.md ("MLPerf log") says what a submission must add.
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "train/train_config.h"

namespace flux8 {

class MlperfLog {
 public:
  explicit MlperfLog(const std::string& path);
  // A run that ends without run_stop (an error) logs run_stop with status aborted.
  ~MlperfLog();
  const std::string& path() const { return path_; }

  // One line: event_type POINT_IN_TIME, INTERVAL_START or INTERVAL_END.
  void point(const std::string& key, const nlohmann::json& value, const nlohmann::json& metadata = {});
  void start(const std::string& key, const nlohmann::json& metadata = {});
  void end(const std::string& key, const nlohmann::json& metadata = {});

  // The submission keys, cache_clear and init_start.
  void init_start(const TrainConfig& cfg, const std::string& config_path);
  // The run's hyperparameters and submission_platform: mlperf_submission_platform, or the
  // device's name when that is empty.
  void hyperparameters(const TrainConfig& cfg, int64_t eval_samples, const std::string& device);
  // init_stop and run_start; then the first block of training starts.
  void run_start(int64_t samples);
  // A block starts unless one is open; block_stop ends the open one, if any.
  void block_start(int64_t samples);
  void block_stop(int64_t samples);
  void eval(int64_t samples, double val_loss);
  void run_stop(int64_t samples, bool success);
  bool stopped() const { return stopped_; }

 private:
  void write(const char* type, const std::string& key, const nlohmann::json& value, const nlohmann::json& metadata);
  std::string path_;
  std::ofstream out_;
  bool run_started_ = false, stopped_ = false, in_block_ = false;
  int64_t last_samples_ = 0;
};

}  // namespace flux8
