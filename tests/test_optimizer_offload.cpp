// optimizer_offload (train/optimizer.h): the moments (moments), and the moments with the f32 master
// weights (cpu), in host memory, streamed through the backend in chunks, give the same training bit
// for bit as state kept on the backend — with f32 and with stochastically rounded bf16 moments,
// with FP8 weight casts written by the update or cast from staged masters, across a checkpoint and
// a resume, AdamW on the device or on the host — and the update of a slice rounds as the update of
// the whole buffer.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "model_test_util.h"
#include "test_util.h"
#include "train/data_parallel.h"
#include "train_test_util.h"

namespace flux8 {
namespace {

using testing::RunDir;

// Straight runs with the moments on the backend and offloaded in chunks of 256 elements (the
// tiny model's largest parameter has 576: chunks of one parameter and of several); the offloaded
// one stops after step 3 and resumes.
// `offloaded_only`: keys of the offloaded run alone.
void expect_offload_changes_nothing(const std::string& offload, const std::vector<std::string>& extra,
                                    const std::vector<std::string>& offloaded_only = {}) {
  const RunDir dir("offload");
  auto options = [&](const char* save, bool offloaded) {
    TrainOptions o = dir.options(save);
    o.overrides.insert(o.overrides.end(), extra.begin(), extra.end());
    o.overrides.push_back("save_interval=3");
    if (offloaded) {
      o.overrides.push_back("optimizer_offload=" + offload);
      o.overrides.push_back("optimizer_offload_chunk=256");
      o.overrides.insert(o.overrides.end(), offloaded_only.begin(), offloaded_only.end());
    }
    return o;
  };
  run_training(options("device", false));
  testing::train_across_a_resume(options("host", true), 3, 6);
  const std::vector<double> a = testing::step_losses(dir.root / "device" / "metrics.jsonl");
  ASSERT_EQ(a.size(), 6u);
  EXPECT_EQ(testing::step_losses(dir.root / "host" / "metrics.jsonl"), a);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    testing::expect_same_tensors((dir.root / "device" / "step-0000006" / file).string(),
                                 (dir.root / "host" / "step-0000006" / file).string());
}

TEST(OptimizerOffload, SameTrainingAsMomentsOnTheBackend) {
  expect_offload_changes_nothing("moments", {"adam_moment_precision=f32"});
}

TEST(OptimizerOffload, SameTrainingWithBf16MomentsAndFp8Casts) {
  expect_offload_changes_nothing("moments", {"adam_moment_precision=bf16", "fp8=hybrid", "fp8_recipe=delayed"});
}

TEST(OptimizerOffload, SameTrainingWithMastersInHostMemory) {
  expect_offload_changes_nothing("cpu", {"adam_moment_precision=f32"});
}

// Delayed scaling: the update writes the casts; tensorwise: every cast reads a staged master.
TEST(OptimizerOffload, SameTrainingWithMastersInHostMemoryAndFp8) {
  expect_offload_changes_nothing("cpu", {"adam_moment_precision=bf16", "fp8=hybrid", "fp8_recipe=delayed"});
  expect_offload_changes_nothing("cpu", {"fp8=e4m3", "fp8_recipe=tensorwise", "adam_moment_precision=f32"});
}

// optimizer_offload_overlap passes the chunks through two device slots, uploads and downloads on
// copy queues of their own (the default, off: one slot, each chunk's copies and update in turn).
TEST(OptimizerOffload, OverlappedChunksTrainAsStateOnTheBackend) {
  const std::vector<std::string> overlapped{"optimizer_offload_overlap=true"};
  expect_offload_changes_nothing("moments", {"adam_moment_precision=f32"}, overlapped);
  expect_offload_changes_nothing("cpu", {"adam_moment_precision=bf16", "fp8=hybrid", "fp8_recipe=delayed"}, overlapped);
}

// optimizer_offload_update: host — AdamW on the host's cores, the gradients down and the masters
// up, the device writing the forms from them — trains as the update on the backend: f32 and bf16
// moments, FP8 casts written with the update (delayed) and cast from staged masters (tensorwise).
TEST(OptimizerOffload, HostUpdateTrainsAsTheUpdateOnTheBackend) {
  const std::vector<std::string> host{"optimizer_offload_update=host"};
  expect_offload_changes_nothing("cpu", {"adam_moment_precision=f32"}, host);
  expect_offload_changes_nothing("cpu", {"adam_moment_precision=bf16", "fp8=hybrid", "fp8_recipe=delayed"}, host);
  expect_offload_changes_nothing("cpu", {"fp8=e4m3", "fp8_recipe=tensorwise"}, host);
}

TEST(OptimizerOffload, HostUpdateNeedsTheMastersInHostMemory) {
  for (const char* offload : {"none", "moments"}) {
    const RunDir dir("offload_host_update");
    TrainOptions o = dir.options("run");
    o.overrides.push_back(std::string("optimizer_offload=") + offload);
    o.overrides.push_back("optimizer_offload_update=host");
    const std::string e = testing::error_of([&] { run_training(o); });
    testing::expect_mentions(e, {"optimizer_offload_update: host", "optimizer_offload: cpu"});
  }
}

TEST(OptimizerOffload, MastersInHostMemoryRefusedWithTheDistributedOptimizer) {
  const RunDir dir("offload_zero");
  TrainOptions o = dir.options("run");
  o.overrides.push_back("optimizer_offload=cpu");
  o.overrides.push_back("use_distributed_optimizer=true");
  const std::string e = testing::error_of([&] { run_training(o); });
  testing::expect_mentions(e, {"optimizer_offload: cpu", "use_distributed_optimizer", "optimizer_offload: moments"});
}

TEST(OptimizerOffload, RefusedWithTensorParallelism) {
  const RunDir dir("offload_tp");
  TrainOptions o = dir.options("run");
  o.overrides.push_back("optimizer_offload=cpu");
  o.overrides.push_back("tensor_model_parallel_size=2");
  const std::string e = testing::error_of([&] { run_training(o); });
  EXPECT_NE(e.find("optimizer_offload: cpu"), std::string::npos) << e;
  EXPECT_NE(e.find("tensor_model_parallel_size"), std::string::npos) << e;
}

// The model on offloaded masters reads their device forms (residents, operand copies, casts of
// staged masters) and trains as the model on masters kept on the backend: predictions and every
// gradient after three AdamW steps, odd shapes, with low-rank gradients, in f32 and in FP8 with the
// casts written by the update and cast at first use.
TEST(OptimizerOffload, ModelOnOffloadedMastersMatchesBitForBit) {
  auto be = make_backend("cpu");
  const FluxConfig cfg = testing::odd_config(1, 1, true);
  const Fp8Config fp8 = testing::delayed_hybrid_fp8();
  for (const bool in_fp8 : {false, true})
    for (const bool fused_casts : {true, false}) {
      SCOPED_TRACE(fmt::format("fp8 {} fused casts {}", in_fp8, fused_casts));
      testing::ModelRunOptions o;
      o.fp8 = in_fp8 ? &fp8 : nullptr;
      o.steps = 3;
      o.optimizer = true;
      o.fused_weight_casts = fused_casts;
      o.low_rank_rows = 4;
      o.moment_dtype = DType::bf16;
      const testing::ModelRun on_backend = testing::run_model(*be, cfg, o);
      o.offload_chunk = 300;
      testing::expect_identical_runs(on_backend, testing::run_model(*be, cfg, o));
    }
}

// adamw over two halves of a buffer, each told its flat index (AdamWHyper::index_base), writes the
// bf16 moments the update of the whole buffer writes: their rounding noise is drawn per flat index.
TEST(OptimizerOffload, SlicesRoundTheirMomentsAsTheWholeBuffer) {
  auto be = make_backend("cpu");
  const int64_t n = 1000, half = 500;
  std::vector<Tensor> owned;
  auto fill = [&](DType dt, double scale, uint64_t seed) {
    const Tensor t(be->allocate(static_cast<size_t>(n) * dtype_size(dt)), dt, Shape{n});
    owned.push_back(t);
    std::vector<double> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = scale * std::sin(0.37 * static_cast<double>(i + seed));
    from_host(*be, t, v);
    return t;
  };
  const Backend::AdamW h{1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, 3};
  const Tensor p1 = fill(DType::f32, 1.0, 1), p2 = fill(DType::f32, 1.0, 1), g = fill(DType::f32, 0.01, 2);
  const Tensor m1 = fill(DType::bf16, 0.001, 3), m2 = fill(DType::bf16, 0.001, 3);
  const Tensor v1 = fill(DType::bf16, 1e-5, 4), v2 = fill(DType::bf16, 1e-5, 4);
  for (const Tensor* t : {&v1, &v2}) {  // second moments are not negative
    std::vector<double> x = to_host(*be, *t);
    for (double& e : x) e = std::abs(e);
    from_host(*be, *t, x);
  }
  be->adamw(p1, g, m1, v1, h, {}, {}, {});
  for (const FlatRange r : {FlatRange{0, half}, FlatRange{half, n - half}}) {
    Backend::AdamW at = h;
    at.index_base = r.begin;
    be->adamw(flat_slice(p2, r), flat_slice(g, r), flat_slice(m2, r), flat_slice(v2, r), at, {}, {}, {});
  }
  EXPECT_EQ(to_host(*be, p1), to_host(*be, p2));
  EXPECT_EQ(to_host(*be, m1), to_host(*be, m2));
  EXPECT_EQ(to_host(*be, v1), to_host(*be, v2));
  Backend::AdamW odd = h;
  odd.index_base = 3;
  const std::string e = testing::error_of([&] { be->adamw(p2, g, m2, v2, odd, {}, {}, {}); });
  EXPECT_NE(e.find("index_base 3 is odd"), std::string::npos) << e;
  for (const Tensor& t : owned) be->release(t.data);
}

}  // namespace
}  // namespace flux8
