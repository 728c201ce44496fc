#pragma once
// What a run tells its user: a progress bar with ETA on a terminal (plain lines otherwise),
// metrics.jsonl with one JSON object per record (a logged step, a validation, FP8 telemetry, a
// checkpoint, samples, run events), and the same records as TensorBoard scalars where
// tensorboard_dir is set (train/tensorboard_log.h). docs/USAGE.md ("Watching a run") lists the
// fields and tags.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace flux8 {

class Device;
class TensorBoardLog;

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

// Every metrics.jsonl record's `kind`.
enum class RecordKind { step, eval, fp8, checkpoint, sample, run };
std::string_view record_kind_name(RecordKind k);
std::optional<RecordKind> record_kind_from_name(std::string_view name);

// Keeps the records of `path` (metrics.jsonl) up to and including `step`, dropping the later
// ones, the validation at `step` (a resumed run validates there again) and any line that does not
// parse (the tail of a write cut short), so that a run resumed from the checkpoint of that step
// writes each record once. The file is rewritten in place
// through a temporary and a rename. Returns the records kept at `step`.
std::vector<nlohmann::json> truncate_metrics_after(const std::string& path, int64_t step);

class Progress {
 public:
  // metrics_path "" disables the file; resume_step >= 0 keeps the records up to that step (a
  // resumed run), otherwise the file starts empty. print false: nothing on stdout either (the
  // ranks of a job other than rank 0, whose lines would repeat its own).
  Progress(const std::string& metrics_path, int64_t resume_step, int64_t start_step, int64_t total_steps,
           bool print = true);
  ~Progress();

  // Every record then carries the device's allocated and peak memory (Device::memory_use).
  void set_device(const Device* device) { device_ = device; }
  // Every record from then on is also written to TensorBoard; after a resume, first the records
  // kept at the resumed step (TensorBoardLog drops what earlier event files hold from there on).
  void set_tensorboard(std::unique_ptr<TensorBoardLog> tb);
  TensorBoardLog* tensorboard() { return tb_.get(); }

  void step(const StepReport& r, bool log_line);
  // A record of `kind` (it must hold "step") with its log line; a line "" prints nothing.
  void event(const std::string& line, RecordKind kind, nlohmann::json record);
  // A log line only.
  void note(const std::string& line);
  // An image (PNG bytes, width × height RGB) for TensorBoard's Images tab, at `step`; nothing
  // without TensorBoard. The PNG file itself is the caller's (with its `sample` record).
  void image(const std::string& tag, int64_t step, const std::string& png, int width, int height);
  void finish();

 private:
  void write_record(RecordKind kind, nlohmann::json& record);
  void clear_bar();
  std::ofstream metrics_;
  const Device* device_ = nullptr;
  std::unique_ptr<TensorBoardLog> tb_;
  std::vector<nlohmann::json> resumed_step_records_;
  bool tty_;
  bool print_ = true;
  bool bar_shown_ = false;
  int64_t start_step_, total_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace flux8
