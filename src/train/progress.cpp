#include "train/progress.h"

#include <fmt/core.h>
#include <unistd.h>

#include "core/error.h"

namespace flux8 {

Progress::Progress(const std::string& path, bool append, int64_t start_step, int64_t total, bool print)
    : tty_(::isatty(STDOUT_FILENO) != 0),
      print_(print),
      start_step_(start_step),
      total_(total),
      t0_(std::chrono::steady_clock::now()) {
  if (!path.empty()) {
    metrics_.open(path, append ? std::ios::app : std::ios::trunc);
    if (!metrics_) fail("cannot open {} for writing (metrics)", path);
  }
}

Progress::~Progress() { finish(); }

void Progress::clear_bar() {
  if (bar_shown_) fmt::print("\r\033[K");
  bar_shown_ = false;
}

static std::string clock_text(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

void Progress::step(const StepReport& r, bool log_line) {
  if (metrics_ && log_line) {
    metrics_ << nlohmann::json{{"step", r.step},
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
                               {"energy_j_per_step", r.energy_j_per_step >= 0 ? nlohmann::json(r.energy_j_per_step)
                                                                              : nlohmann::json(nullptr)},
                               {"gpu_power_w", r.power_w >= 0 ? nlohmann::json(r.power_w) : nlohmann::json(nullptr)},
                               {"skipped", r.skipped}}
                    .dump()
             << "\n";
    metrics_.flush();
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

void Progress::event(const std::string& line, const nlohmann::json& record) {
  clear_bar();
  if (print_) {
    fmt::print("{}\n", line);
    std::fflush(stdout);
  }
  if (metrics_ && !record.is_null()) {
    metrics_ << record.dump() << "\n";
    metrics_.flush();
  }
}

void Progress::finish() {
  if (bar_shown_) fmt::print("\n");
  bar_shown_ = false;
  std::fflush(stdout);
}

}  // namespace flux8
