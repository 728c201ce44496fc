// The trainer's input pipeline (train/batch_pipeline.h): micro-batches built on a thread of
// its own equal those built on the training thread, carry the loader's position after their own
// samples, report a loader error at the micro-batch it stopped, and stop cleanly mid-run; and a
// training run with the overlap on equals one with it off, also across a resume.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "core/error.h"
#include "data/loader.h"
#include "train/batch_pipeline.h"
#include "train/train_step.h"
#include "train_test_util.h"

namespace flux8 {
namespace {

namespace fs = std::filesystem;
using Mode = BatchPipelineSpec::Mode;

using testing::download;
using testing::Downloaded;
using testing::PipelineFixture;

TEST(BatchPipeline, MicroBatchesEqualThoseBuiltOnTheTrainingThread) {
  const PipelineFixture f;
  auto be = make_backend("cpu");
  // What the trainer did before: the loader read on the training thread, each micro-batch
  // assembled and uploaded through StepBuffers. Steps 3..5 of a run resumed at its state.
  const int64_t global = 4, micro = 2, first = 3, end = 6;
  std::vector<Downloaded> expected;
  std::vector<LoaderState> expected_after;
  {
    DataLoader loader(f.loader_options());
    StepBuffers buf(*be, DType::f32);
    for (int64_t step = first; step < end; ++step)
      for (int64_t part = 0; part < global / micro; ++part) {
        std::vector<Sample> samples;
        for (int64_t i = 0; i < micro; ++i) samples.push_back(loader.next());
        expected_after.push_back(loader.state());
        make_train_batch(buf.host, samples, f.model, f.obj, f.empty, 99, static_cast<uint64_t>(step), 0, part * micro);
        const FluxInputs& in = buf.upload(buf.host, f.model, 99);
        expected.push_back(download(*be, in, buf.target));
      }
  }
  for (const Mode mode : {Mode::caller, Mode::thread}) {
    SCOPED_TRACE(mode == Mode::thread ? "thread" : "caller");
    DataLoader loader(f.loader_options());
    BatchPipeline pipeline(*be, loader, f.spec(mode, global, micro, first, end));
    EXPECT_EQ(pipeline.background(), mode == Mode::thread);
    size_t k = 0;
    for (int64_t step = first; step < end; ++step)
      for (int64_t part = 0; part < global / micro; ++part, ++k) {
        // Give the producer time to run ahead into the other slot.
        if (mode == Mode::thread) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        const BatchPipeline::MicroBatch mb = pipeline.acquire();
        EXPECT_EQ(mb.step, step);
        EXPECT_EQ(mb.part, part);
        EXPECT_EQ(mb.loader_after, expected_after[k]) << "micro-batch " << k;
        EXPECT_EQ(download(*be, *mb.in, mb.target), expected[k]) << "micro-batch " << k;
        EXPECT_EQ(mb.dpred.shape, mb.target.shape);
        // Where the host time went; on the caller's thread acquire() waited for all of it.
        EXPECT_GT(mb.timing.read_s, 0.0);
        EXPECT_GT(mb.timing.assemble_s, 0.0);
        EXPECT_GT(mb.timing.upload_s, 0.0);
        if (mode == Mode::caller)
          EXPECT_GE(mb.timing.wait_s, mb.timing.read_s + mb.timing.assemble_s + mb.timing.upload_s);
        pipeline.release();
      }
    EXPECT_THROW(pipeline.acquire(), Error);  // the run ends at step `end`
  }
}

TEST(BatchPipeline, LoaderErrorReachesTheMicroBatchItStopped) {
  const PipelineFixture f;
  auto be = make_backend("cpu");
  for (const Mode mode : {Mode::caller, Mode::thread}) {
    SCOPED_TRACE(mode == Mode::thread ? "thread" : "caller");
    // One pass over 23 samples: micro-batches of 4 run out in the sixth.
    DataLoader loader(f.loader_options(/*single_pass=*/true));
    BatchPipeline pipeline(*be, loader, f.spec(mode, 4, 4, 0, 100));
    for (int k = 0; k < 5; ++k) {
      EXPECT_EQ(pipeline.acquire().step, k);
      pipeline.release();
    }
    try {
      pipeline.acquire();
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("single pass"), std::string::npos) << e.what();
    }
    EXPECT_THROW(pipeline.acquire(), Error);  // and again, not a wait for the stopped producer
  }
}

TEST(BatchPipeline, StopsWhileItsProducerWaitsAndRejectsMisuse) {
  const PipelineFixture f;
  auto be = make_backend("cpu");
  {
    DataLoader loader(f.loader_options());
    BatchPipeline pipeline(*be, loader, f.spec(Mode::thread, 2, 2, 0, 50));  // never acquired
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  {
    DataLoader loader(f.loader_options());
    BatchPipeline pipeline(*be, loader, f.spec(Mode::thread, 2, 2, 0, 50));
    EXPECT_THROW(pipeline.release(), Error);
    pipeline.acquire();
    EXPECT_THROW(pipeline.acquire(), Error);                     // twice without release
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the producer waits for a slot
  }  // destroyed with a micro-batch in use and the other slot full
  DataLoader loader(f.loader_options());
  EXPECT_THROW(BatchPipeline(*be, loader, f.spec(Mode::thread, 3, 2, 0, 5)), Error);
}

// The trainer with the overlap on (the CPU's default is off): the same losses, validation and
// checkpoint as with it off, also when the run stops at step 3 — while the producer has read
// step 4's samples already — and resumes.
TEST(Trainer, DataOverlapChangesNothingAcrossAResume) {
  const testing::RunDir dir("trainer_data_overlap");
  testing::expect_overlap_changes_nothing(dir, {}, "on");
  // Each step's line in metrics.jsonl says where its data's host time went.
  std::ifstream metrics(dir.root / "on" / "metrics.jsonl");
  int steps = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    ++steps;
    for (const char* key : {"data_wait_s", "data_read_s", "data_assemble_s", "data_upload_s"})
      EXPECT_GE(j.at(key).get<double>(), 0.0) << key;
    EXPECT_GT(j.at("data_read_s").get<double>() + j.at("data_assemble_s").get<double>(), 0.0) << line;
  }
  EXPECT_EQ(steps, 6);
}

}  // namespace
}  // namespace flux8
