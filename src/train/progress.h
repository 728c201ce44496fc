#pragma once
// What a run tells its user: a progress bar with ETA on a terminal (plain lines otherwise),
// and metrics.jsonl with one JSON object per logged step and per validation.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace flux8 {

// Where a step's (or a micro-batch's) data took host time, in seconds (train/batch_pipeline.h):
// taking the samples from the loader (which decodes on threads of its own: this is the wait for
// it), assembling them (make_train_batch), the copies to the device; and how long the training
// thread waited for its data (with the producer on the training thread, all three).
struct DataTiming {
  double read_s = 0, assemble_s = 0, upload_s = 0, wait_s = 0;
  DataTiming& operator+=(const DataTiming& o) {
    read_s += o.read_s, assemble_s += o.assemble_s, upload_s += o.upload_s, wait_s += o.wait_s;
    return *this;
  }
};

struct StepReport {
  int64_t step = 0, total = 0;
  double loss = 0, lr = 0, grad_norm = 0, step_seconds = 0;
  double samples_per_second = 0, tokens_per_second = 0;
  double model_tflops_per_second = 0;  // model FLOPs (docs/WORKLOADS.md's convention) / step time
  DataTiming data;                     // the step's micro-batches', summed
  bool skipped = false;
  // The device's energy over the steps since the last logged one (a device with an energy
  // counter, on logged steps; validation and checkpoints left out), else negative.
  double energy_j_per_step = -1, power_w = -1;
};

class Progress {
 public:
  // metrics_path "" disables the file; append keeps earlier lines (resume). print false: nothing
  // on stdout either (the ranks of a job other than rank 0, whose lines would repeat its own).
  Progress(const std::string& metrics_path, bool append, int64_t start_step, int64_t total_steps, bool print = true);
  ~Progress();

  void step(const StepReport& r, bool log_line);
  // Any other event (validation, checkpoint, resume): a log line and a metrics record.
  void event(const std::string& line, const nlohmann::json& record);
  void finish();

 private:
  void clear_bar();
  std::ofstream metrics_;
  bool tty_;
  bool print_ = true;
  bool bar_shown_ = false;
  int64_t start_step_, total_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace flux8
