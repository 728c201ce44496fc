#pragma once
// What a run tells its user: a progress bar with ETA on a terminal (plain lines otherwise),
// and metrics.jsonl with one JSON object per logged step and per validation.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace flux8 {

struct StepReport {
  int64_t step = 0, total = 0;
  double loss = 0, lr = 0, grad_norm = 0, step_seconds = 0;
  double samples_per_second = 0, tokens_per_second = 0;
  // The step's micro-batches' host time (train/batch_pipeline.h): the training thread's wait
  // for them, and the producer's loader wait, assembly and copies.
  double data_wait_seconds = 0, data_read_seconds = 0, data_assemble_seconds = 0, data_upload_seconds = 0;
  bool skipped = false;
};

class Progress {
 public:
  // metrics_path "" disables the file; append keeps earlier lines (resume).
  Progress(const std::string& metrics_path, bool append, int64_t start_step, int64_t total_steps);
  ~Progress();

  void step(const StepReport& r, bool log_line);
  // Any other event (validation, checkpoint, resume): a log line and a metrics record.
  void event(const std::string& line, const nlohmann::json& record);
  void finish();

 private:
  void clear_bar();
  std::ofstream metrics_;
  bool tty_;
  bool bar_shown_ = false;
  int64_t start_step_, total_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace flux8
