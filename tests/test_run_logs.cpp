// What a run writes beside its checkpoints: metrics.jsonl cut back for a resume, the TensorBoard
// tags of FP8 telemetry, and the MLPerf log's lines (the whole files are read back by
// tests/python/test_tensorboard.py).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/text_file.h"
#include "test_util.h"
#include "train/mlperf_log.h"
#include "train/progress.h"
#include "train/tensorboard_log.h"

namespace flux8 {
namespace {

using namespace flux8::testing;

std::vector<nlohmann::json> read_lines(const std::string& path, const std::string& prefix = "") {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line.substr(prefix.size())));
  return out;
}

TEST(Metrics, ResumeKeepsTheRecordsUpToTheCheckpointsStep) {
  TempDir dir;
  const std::string path = dir.write("metrics.jsonl",
                                     R"({"kind":"eval","step":0,"val_loss":1.5}
{"kind":"step","step":1,"loss":1.0}
{"kind":"step","step":2,"loss":0.9}
{"kind":"checkpoint","step":2,"path":"step-0000002"}
{"kind":"eval","step":2,"val_loss":1.25}
{"kind":"step","step":3,"loss":0.8}
{"kind":"checkpoint","step":2,"path":"step-0000002","async":true}
{"kind":"step","step":4,"lo)");
  const std::vector<nlohmann::json> at_step = truncate_metrics_after(path, 2);
  const std::vector<nlohmann::json> kept = read_lines(path);
  std::vector<std::string> kinds;
  for (const auto& r : kept) kinds.push_back(r["kind"].get<std::string>() + "@" + std::to_string(r["step"].get<int>()));
  // Step 3 goes, and the line cut short; the validation at step 2 goes too (the resumed run
  // validates there first); the save of step 2 reported late stays.
  EXPECT_EQ(kinds, (std::vector<std::string>{"eval@0", "step@1", "step@2", "checkpoint@2", "checkpoint@2"}));
  ASSERT_EQ(at_step.size(), 3u);
  EXPECT_EQ(at_step[0]["kind"], "step");
}

TEST(Metrics, ResumeLeavesAFileWithNothingLaterAsItIs) {
  TempDir dir;
  const std::string text = "{\"kind\":\"step\",\"step\":1}\n";
  const std::string path = dir.write("metrics.jsonl", text);
  EXPECT_EQ(truncate_metrics_after(path, 1).size(), 1u);
  EXPECT_EQ(read_text_or_fail(path, "metrics"), text);
  EXPECT_TRUE(truncate_metrics_after(dir.file("none.jsonl"), 5).empty());
}

TEST(Metrics, EveryRecordHasKindTimeAndStep) {
  TempDir dir;
  {
    Progress p(dir.file("metrics.jsonl"), -1, 0, 10, false);
    p.event("", RecordKind::checkpoint, {{"step", 3}, {"path", "x"}});
    EXPECT_THROW(p.event("", RecordKind::run, {{"event", "no step"}}), std::exception);
  }
  const auto recs = read_lines(dir.file("metrics.jsonl"));
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_EQ(recs[0]["kind"], "checkpoint");
  EXPECT_EQ(recs[0]["step"], 3);
  EXPECT_GT(recs[0]["time"].get<double>(), 1.7e9);  // Unix seconds
}

TEST(TensorBoardLog, Fp8GroupIsOneLinearAndOperandOverTheBlocks) {
  EXPECT_EQ(fp8_tensor_group("double_blocks.3.img_attn.qkv", "input"), "double_blocks.img_attn.qkv.input");
  EXPECT_EQ(fp8_tensor_group("single_blocks.17.linear2", "grad_output"), "single_blocks.linear2.grad_output");
  EXPECT_EQ(fp8_tensor_group("final_layer.linear", "weight"), "final_layer.linear.weight");
}

TEST(MlperfLog, ARunEndingInAnErrorStopsAborted) {
  TempDir dir;
  const std::string path = dir.file("mlperf.log");
  {
    MlperfLog log(path);
    log.run_start(0);
    log.block_start(0);
    log.block_start(4);  // a block is open: no second one
    log.eval(8, 0.5);
  }  // the open block is closed, then the run stopped
  const auto lines = read_lines(path, ":::MLLOG ");
  std::vector<std::string> keys;
  for (const auto& l : lines) keys.push_back(l["key"]);
  EXPECT_EQ(keys, (std::vector<std::string>{"init_stop", "run_start", "block_start", "eval_start", "eval_accuracy",
                                            "averaged_validation_loss", "eval_stop", "block_stop", "run_stop"}));
  EXPECT_EQ(lines.back()["metadata"]["status"], "aborted");
  EXPECT_EQ(lines.back()["metadata"]["samples_count"], 8);
  EXPECT_EQ(lines.back()["event_type"], "INTERVAL_END");
  EXPECT_EQ(lines[4]["value"], 0.5);
}

}  // namespace
}  // namespace flux8
