#include "train/progress.h"

#include <fmt/core.h>
#include <unistd.h>

#include <filesystem>

#include "backend/device.h"
#include "core/error.h"
#include "io/tfevents.h"
#include "train/tensorboard_log.h"

namespace flux8 {

std::string_view record_kind_name(RecordKind k) {
  switch (k) {
    case RecordKind::step: return "step";
    case RecordKind::eval: return "eval";
    case RecordKind::fp8: return "fp8";
    case RecordKind::checkpoint: return "checkpoint";
    case RecordKind::sample: return "sample";
    case RecordKind::run: return "run";
  }
  return "run";
}

std::optional<RecordKind> record_kind_from_name(std::string_view name) {
  for (RecordKind k : {RecordKind::step, RecordKind::eval, RecordKind::fp8, RecordKind::checkpoint, RecordKind::sample,
                       RecordKind::run})
    if (record_kind_name(k) == name) return k;
  return std::nullopt;
}

std::vector<nlohmann::json> truncate_metrics_after(const std::string& path, int64_t step) {
  std::vector<nlohmann::json> at_step;
  std::ifstream in(path);
  if (!in) return at_step;  // no metrics yet
  std::string kept;
  int64_t dropped = 0;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    // (An eval record at `step` goes too: the resumed run validates there first and writes it again.)
    const bool keep = j.is_object() && (!j.contains("step") || (j["step"].is_number_integer() && j["step"] <= step &&
                                                                !(j["step"] == step && j.value("kind", "") == "eval")));
    if (keep) {
      kept += line + "\n";
      if (j.contains("step") && j["step"] == step) at_step.push_back(j);
    } else {
      ++dropped;
    }
  }
  in.close();
  if (dropped == 0) return at_step;
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kept;
    out.flush();
    if (!out) fail("cannot write {} (metrics.jsonl rewritten for the resume): is the disk full?", tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) fail("cannot replace {} with {}: {}", path, tmp, ec.message());
  return at_step;
}

Progress::Progress(const std::string& path, int64_t resume_step, int64_t start_step, int64_t total, bool print)
    : tty_(::isatty(STDOUT_FILENO) != 0),
      print_(print),
      start_step_(start_step),
      total_(total),
      t0_(std::chrono::steady_clock::now()) {
  if (!path.empty()) {
    const bool append = resume_step >= 0;
    if (append) resumed_step_records_ = truncate_metrics_after(path, resume_step);
    metrics_.open(path, append ? std::ios::app : std::ios::trunc);
    if (!metrics_) fail("cannot open {} for writing (metrics)", path);
  }
}

Progress::~Progress() { finish(); }

void Progress::set_tensorboard(std::unique_ptr<TensorBoardLog> tb) {
  tb_ = std::move(tb);
  for (const nlohmann::json& r : resumed_step_records_)
    if (const auto kind = record_kind_from_name(r.value("kind", ""))) tb_->record(*kind, r);
  resumed_step_records_.clear();
}

void Progress::clear_bar() {
  if (bar_shown_) fmt::print("\r\033[K");
  bar_shown_ = false;
}

static std::string clock_text(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

static nlohmann::json or_null(double v) { return v >= 0 ? nlohmann::json(v) : nlohmann::json(nullptr); }

// Every record: its kind, the wall time (Unix seconds) and the device's memory as of now.
void Progress::write_record(RecordKind kind, nlohmann::json& record) {
  if (!record.contains("step")) fail("flux8 bug: a metrics record without \"step\": {}", record.dump());
  record["kind"] = record_kind_name(kind);
  record["time"] = unix_seconds();
  if (device_) {
    const MemoryUse m = device_->memory_use();
    record["mem_allocated_bytes"] = m.allocated;
    record["mem_peak_bytes"] = m.peak_allocated;
  }
  if (metrics_) {
    metrics_ << record.dump() << "\n";
    metrics_.flush();
  }
  if (tb_) tb_->record(kind, record);
}

void Progress::step(const StepReport& r, bool log_line) {
  if (log_line) {
    nlohmann::json rec{{"step", r.step},
                       {"loss", r.loss},
                       {"lr", r.lr},
                       {"grad_norm", r.grad_norm},
                       {"step_time_s", r.step_seconds},
                       {"samples_per_s", r.samples_per_second},
                       {"tokens_per_s", r.tokens_per_second},
                       {"model_tflops_per_s", r.model_tflops_per_second},
                       {"data_wait_s", r.data.wait_s},
                       {"data_read_s", r.data.read_s},
                       {"data_assemble_s", r.data.assemble_s},
                       {"data_upload_s", r.data.upload_s},
                       {"energy_j_per_step", or_null(r.energy_j_per_step)},
                       {"gpu_power_w", or_null(r.power_w)},
                       {"skipped", r.skipped}};
    write_record(RecordKind::step, rec);
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  const int64_t done = r.step - start_step_;
  const double eta = done > 0 ? elapsed / static_cast<double>(done) * static_cast<double>(total_ - r.step) : 0;
  const std::string stats = fmt::format(
      "loss {:.4f}  lr {:.2e}  grad {:.3f}  {:.0f} ms/step  {:.1f} samples/s  {:.0f} tok/s  "
      "{:.1f} TFLOP/s{}  data wait {:.0f} ms{}",
      r.loss, r.lr, r.grad_norm, r.step_seconds * 1e3, r.samples_per_second, r.tokens_per_second,
      r.model_tflops_per_second,
      r.energy_j_per_step >= 0 ? fmt::format("  {:.1f} J/step {:.0f} W", r.energy_j_per_step, r.power_w) : "",
      r.data.wait_s * 1e3, r.skipped ? "  SKIPPED (non-finite)" : "");
  if (!print_) return;
  if (tty_) {
    const int width = 24;
    const int filled = total_ > 0 ? static_cast<int>(width * r.step / total_) : width;
    fmt::print("\r\033[K[{}{}] {}/{}  {}  ETA {}", std::string(static_cast<size_t>(filled), '#'),
               std::string(static_cast<size_t>(width - filled), '.'), r.step, total_, stats, clock_text(eta));
    std::fflush(stdout);
    bar_shown_ = true;
  } else if (log_line) {
    fmt::print("step {}/{}  {}  eta {}\n", r.step, total_, stats, clock_text(eta));
    std::fflush(stdout);
  }
}

void Progress::note(const std::string& line) {
  clear_bar();
  if (print_) {
    fmt::print("{}\n", line);
    std::fflush(stdout);
  }
}

void Progress::event(const std::string& line, RecordKind kind, nlohmann::json record) {
  if (!line.empty()) note(line);
  write_record(kind, record);
}

void Progress::image(const std::string& tag, int64_t step, const std::string& png, int width, int height) {
  if (tb_) tb_->image(tag, step, png, width, height);
}

void Progress::finish() {
  if (bar_shown_) fmt::print("\n");
  bar_shown_ = false;
  std::fflush(stdout);
}

}  // namespace flux8
