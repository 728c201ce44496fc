#include "train/tensorboard_log.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <sstream>

namespace flux8 {

std::string fp8_tensor_group(const std::string& tensor, const std::string& role) {
  std::string out;
  std::istringstream parts(tensor);
  for (std::string part; std::getline(parts, part, '.');) {
    const bool index =
        !part.empty() && std::all_of(part.begin(), part.end(), [](unsigned char c) { return std::isdigit(c); });
    if (index) continue;
    out += (out.empty() ? "" : ".") + part;
  }
  return out + "." + role;
}

TensorBoardLog::TensorBoardLog(const std::string& dir, bool timers, int64_t resume_step)
    : writer_(dir), timers_(timers) {
  if (resume_step >= 0) writer_.add_session_start(resume_step);
}

// A number field of the record, when it is there and not null.
void TensorBoardLog::scalar(const char* tag, int64_t step, const nlohmann::json& r, const char* field, double scale) {
  const auto it = r.find(field);
  if (it == r.end() || !it->is_number()) return;
  writer_.add_scalar(tag, step, it->get<double>() * scale);
}

void TensorBoardLog::step_record(int64_t step, const nlohmann::json& r) {
  scalar("train/loss", step, r, "loss");
  scalar("train/lr", step, r, "lr");
  scalar("train/grad_norm", step, r, "grad_norm");
  scalar("perf/step_time_s", step, r, "step_time_s");
  scalar("perf/samples_per_s", step, r, "samples_per_s");
  scalar("perf/tokens_per_s", step, r, "tokens_per_s");
  scalar("perf/model_tflops_per_s", step, r, "model_tflops_per_s");
  constexpr double kGiB = 1.0 / (1ull << 30);
  scalar("memory/allocated_gib", step, r, "mem_allocated_bytes", kGiB);
  scalar("memory/peak_gib", step, r, "mem_peak_bytes", kGiB);
  scalar("energy/j_per_step", step, r, "energy_j_per_step");
  scalar("energy/power_w", step, r, "gpu_power_w");
  if (!timers_) return;
  scalar("timers/step_s", step, r, "step_time_s");
  scalar("timers/data_wait_s", step, r, "data_wait_s");
  scalar("timers/data_read_s", step, r, "data_read_s");
  scalar("timers/data_assemble_s", step, r, "data_assemble_s");
  scalar("timers/data_upload_s", step, r, "data_upload_s");
}

// The worst saturation and underflow of each group (fp8_tensor_group) at this step.
void TensorBoardLog::fp8_record(int64_t step, const nlohmann::json& r) {
  std::map<std::string, std::pair<double, double>> worst;
  for (const nlohmann::json& t : r.at("fp8")) {
    if (!t.contains("saturated") || !t.contains("underflow")) continue;  // cast inside cuDNN's attention
    auto& w = worst[fp8_tensor_group(t.at("tensor").get<std::string>(), t.at("role").get<std::string>())];
    w.first = std::max(w.first, t["saturated"].get<double>());
    w.second = std::max(w.second, t["underflow"].get<double>());
  }
  for (const auto& [group, w] : worst) {
    writer_.add_scalar("fp8/saturated/" + group, step, w.first);
    writer_.add_scalar("fp8/underflow/" + group, step, w.second);
  }
}

void TensorBoardLog::record(RecordKind kind, const nlohmann::json& r) {
  const int64_t step = r.at("step").get<int64_t>();
  switch (kind) {
    case RecordKind::step: step_record(step, r); break;
    case RecordKind::eval:
      scalar("val/loss", step, r, "val_loss");
      if (timers_) scalar("timers/validation_s", step, r, "seconds");
      break;
    case RecordKind::fp8: fp8_record(step, r); break;
    case RecordKind::checkpoint:
      // What training waited for: a save in line, or the host copy of a save behind training (whose
      // write, off the training thread, is not a timer).
      if (!timers_ || r.value("async", false)) break;
      scalar("timers/checkpoint_save_s", step, r, "seconds");
      scalar("timers/checkpoint_snapshot_s", step, r, "snapshot_seconds");
      break;
    case RecordKind::sample:
    case RecordKind::run: break;
  }
}

void TensorBoardLog::image(const std::string& tag, int64_t step, const std::string& png, int width, int height) {
  writer_.add_image(tag, step, png, width, height);
}

}  // namespace flux8
