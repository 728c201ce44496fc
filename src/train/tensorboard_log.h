#pragma once
// metrics.jsonl's records as TensorBoard scalars (io/tfevents.h writes the file). The tags, and
// the record field each one shows (docs/USAGE.md, "Watching a run"):
//   train/loss, train/lr, train/grad_norm                          loss, lr, grad_norm
//   perf/step_time_s, perf/samples_per_s, perf/tokens_per_s,        step_time_s, samples_per_s,
//   perf/model_tflops_per_s                                         tokens_per_s, model_tflops_per_s
//   memory/allocated_gib, memory/peak_gib                           mem_allocated_bytes, mem_peak_bytes / 2^30
//   energy/j_per_step, energy/power_w                               energy_j_per_step, gpu_power_w (when counted)
//   val/loss                                                        an eval record's val_loss
//   fp8/saturated/<group>, fp8/underflow/<group>                    an fp8 record: the largest fraction over
//                                                                   the blocks of one Linear and operand
//   timers/<name>_s (log_timers_to_tensorboard)                     step_time_s, data_*_s, an eval's
//                                                                   seconds, a checkpoint's seconds
// Each at its record's step. Images (samples) go to the Images tab under their own tag.
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "io/tfevents.h"
#include "train/progress.h"

namespace flux8 {

// "double_blocks.3.img_attn.qkv" with role "input" -> "double_blocks.img_attn.qkv.input": one
// Linear and operand over all the blocks.
std::string fp8_tensor_group(const std::string& tensor, const std::string& role);

class TensorBoardLog {
 public:
  // resume_step >= 0: a resumed run, whose first event tells TensorBoard to drop what the
  // earlier files hold from that step on (Progress writes that step's kept records again).
  TensorBoardLog(const std::string& dir, bool timers, int64_t resume_step);
  const std::string& path() const { return writer_.path(); }

  void record(RecordKind kind, const nlohmann::json& r);
  void image(const std::string& tag, int64_t step, const std::string& png, int width, int height);

 private:
  void scalar(const char* tag, int64_t step, const nlohmann::json& r, const char* field, double scale = 1);
  void step_record(int64_t step, const nlohmann::json& r);
  void fp8_record(int64_t step, const nlohmann::json& r);
  EventFileWriter writer_;
  bool timers_;
};

}  // namespace flux8
