// StepGraph (cuda_graph) on the CPU: its twin replays a segment's first record wherever the same
// signature comes again — the calls of an earlier step run instead of the fresh ones. Training
// steps so replayed must equal eager ones bit for bit: an argument missing from the signature
// (a pointer, a scalar, a span's contents) would make a replayed step compute with stale values.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "backend/step_graph.h"
#include "backend/transfer.h"
#include "bench/op_profiler.h"
#include "fp8/fp8_config.h"
#include "model_test_util.h"
#include "test_util.h"

namespace flux8::testing {
namespace {

Backend& cpu() {
  static std::unique_ptr<Backend> be = make_backend("cpu");
  return *be;
}

// Four optimizer steps, each forward and backward a region cut into segments of 1 and of 5 ops:
// from the second step on the segments replay the first step's records. The inputs stay, the weights,
// FP8 scales and probes change: the replayed calls must read them through the same pointers.
TEST(StepGraph, ReplayedStepsEqualEagerOnes) {
  const FluxConfig cfg = odd_config(1, 2, true);
  const Fp8Config delayed = delayed_hybrid_fp8(false), delayed_attention = delayed_hybrid_fp8(true);
  struct Case {
    const char* name;
    const Fp8Config* fp8;
    int64_t low_rank_rows;
    Recompute recompute;
  };
  for (const Case& c :
       {Case{"f32", nullptr, 0, Recompute::none}, Case{"f32, low-rank gradients", nullptr, 4, Recompute::none},
        Case{"FP8 delayed", &delayed, 0, Recompute::none},
        Case{"FP8 delayed + FP8 attention, selective recompute", &delayed_attention, 4, Recompute::selective}}) {
    SCOPED_TRACE(c.name);
    ModelRunOptions o{.fp8 = c.fp8,
                      .recompute = c.recompute,
                      .batch = 2,
                      .txt_tokens = 4,
                      .img_tokens = 7,
                      .steps = 4,
                      .weight_std = 0.2,
                      .optimizer = true,
                      .collect_stats = false,
                      .low_rank_rows = c.low_rank_rows};
    const ModelRun eager = run_model(cpu(), cfg, o);
    // A segment per op: two calls of one op on same-shaped tensors (the two single blocks) then
    // differ only by their pointers. Five: segments that straddle blocks.
    for (int segment_ops : {1, 5}) {
      SCOPED_TRACE(segment_ops);
      o.graph_segment_ops = segment_ops;
      const ModelRun graphed = run_model(cpu(), cfg, o);
      expect_identical_runs(graphed, eager);
      // Most of steps 2-4 replayed (the first step records; a weight cast's first use and the
      // like differ between steps and run eagerly): the comparison above was about replays.
      EXPECT_GT(graphed.graph.ops_launched, 2 * graphed.graph.ops_eager / 3)
          << graphed.graph.ops_launched << " replayed, " << graphed.graph.ops_eager << " eager";
      EXPECT_EQ(graphed.graph.captured, 0);  // the CPU has no graphs: replays only
    }
  }
}

// FP8 telemetry (Quantize::stats) is counted when a cast is issued: a segment with such a cast
// never replays, and the counts are those of an eager run.
TEST(StepGraph, CastsThatCountStatisticsRunEagerly) {
  const FluxConfig cfg = odd_config(1, 1, false);
  const Fp8Config fp8 = delayed_hybrid_fp8(false);
  ModelRunOptions o{
      .fp8 = &fp8, .batch = 2, .txt_tokens = 4, .img_tokens = 7, .steps = 3, .optimizer = true, .collect_stats = true};
  const ModelRun eager = run_model(cpu(), cfg, o);
  o.graph_segment_ops = 1;  // a segment per op: exactly the counting casts stay eager
  const ModelRun graphed = run_model(cpu(), cfg, o);
  expect_identical_runs(graphed, eager);
  EXPECT_GT(graphed.graph.ops_eager, 0);
  EXPECT_GT(graphed.graph.ops_launched, 0);
}

// A segment replays only for the same values: a scalar or a span's contents that differ make a
// new signature (run eagerly), the same ones replay the first record.
TEST(StepGraph, SignatureHoldsScalarsAndSpanContents) {
  Backend& be = cpu();
  StepGraph g(be, StepGraph::Options{.segment_ops = 1});
  const Tensor y = Tensor(be.allocate(4 * sizeof(float)), DType::f32, Shape{2, 2});
  const Tensor x = Tensor(be.allocate(4 * sizeof(float)), DType::f32, Shape{2, 2});
  from_host(be, x, std::vector<double>{1, 2, 3, 4});
  auto fill_in_region = [&](double v) {
    g.begin_region();
    be.fill(y, v);
    g.end_region();
    return to_host(be, y);
  };
  EXPECT_EQ(fill_in_region(1.5), (std::vector<double>{1.5, 1.5, 1.5, 1.5}));
  EXPECT_EQ(fill_in_region(2.5), (std::vector<double>{2.5, 2.5, 2.5, 2.5}));  // not the 1.5 record
  EXPECT_EQ(fill_in_region(1.5), (std::vector<double>{1.5, 1.5, 1.5, 1.5}));  // replayed
  EXPECT_EQ(g.stats().launched, 1);
  EXPECT_EQ(g.stats().eager, 2);

  // copy_batch's pairs are a span: its elements, not its address, make the signature.
  auto copy_rows = [&](std::vector<Backend::CopyPair> pairs) {
    be.fill(y, 0.0);
    g.begin_region();
    be.copy_batch(pairs);
    pairs.assign(pairs.size(), Backend::CopyPair{});  // the caller's array changes after the call
    g.end_region();
    return to_host(be, y);
  };
  const std::vector<Backend::CopyPair> row0{{y.rows_slice(0, 1), x.rows_slice(0, 1)}};
  const std::vector<Backend::CopyPair> row1{{y.rows_slice(1, 1), x.rows_slice(1, 1)}};
  EXPECT_EQ(copy_rows(row0), (std::vector<double>{1, 2, 0, 0}));
  EXPECT_EQ(copy_rows(row1), (std::vector<double>{0, 0, 3, 4}));
  EXPECT_EQ(copy_rows(row0), (std::vector<double>{1, 2, 0, 0}));  // replayed from its own copy
  EXPECT_EQ(g.stats().launched, 2);
  be.release(x.data);
  be.release(y.data);
}

// Graphs and the per-op profiler both intercept the backend's ops: one at a time, and the second
// is refused with a message instead of silently taking the ops from the first.
TEST(StepGraph, OneInterceptorAtATime) {
  Backend& be = cpu();
  {
    StepGraph g(be, StepGraph::Options{.segment_ops = 100});
    expect_refused("do not combine", [&] { OpProfiler prof(be); });
    EXPECT_EQ(be.interceptor(), &g);
  }
  EXPECT_EQ(be.interceptor(), nullptr) << "a graph recorder uninstalls itself";
  OpProfiler prof(be);
  EXPECT_EQ(be.interceptor(), &prof);
}

// What needs the device's results or memory issues the open segment first: a download inside a
// region sees the ops recorded before it.
TEST(StepGraph, ReadsInsideARegionSeeTheRecordedOps) {
  Backend& be = cpu();
  StepGraph g(be, StepGraph::Options{.segment_ops = 100});
  const Tensor y = Tensor(be.allocate(3 * sizeof(float)), DType::f32, Shape{3});
  g.begin_region();
  be.fill(y, 4.0);
  EXPECT_EQ(to_host(be, y), (std::vector<double>{4, 4, 4}));
  be.fill(y, 5.0);
  EXPECT_DOUBLE_EQ(be.sum_squares(y), 75.0);
  be.fill(y, 6.0);
  g.end_region();
  EXPECT_EQ(to_host(be, y), (std::vector<double>{6, 6, 6}));
  EXPECT_EQ(g.stats().eager, 3);
  be.release(y.data);
}

// A region left by an exception drops what it recorded and not yet issued; the next opens.
TEST(StepGraph, AnAbandonedRegionDropsItsUnissuedCalls) {
  Backend& be = cpu();
  StepGraph g(be, StepGraph::Options{.segment_ops = 100});
  const Tensor y = Tensor(be.allocate(2 * sizeof(float)), DType::f32, Shape{2});
  be.fill(y, 1.0);
  EXPECT_THROW(
      {
        StepGraph::Region region(&g);
        be.fill(y, 9.0);
        throw std::runtime_error("the step failed");
      },
      std::runtime_error);
  EXPECT_FALSE(g.recording());
  EXPECT_EQ(to_host(be, y), (std::vector<double>{1, 1}));
  StepGraph::Region again(&g);
  be.fill(y, 2.0);
  again.end();
  EXPECT_EQ(to_host(be, y), (std::vector<double>{2, 2}));
  expect_refused("without begin_region", [&] { g.end_region(); });
  g.begin_region();
  expect_refused("do not nest", [&] { g.begin_region(); });
  g.abandon_region();
  be.release(y.data);
}

// The loss written to the device is the value mse_loss returns.
TEST(StepGraph, MseLossIntoEqualsMseLoss) {
  Backend& be = cpu();
  const Tensor pred(be.allocate(5 * sizeof(float)), DType::f32, Shape{5});
  const Tensor target(be.allocate(5 * sizeof(float)), DType::f32, Shape{5});
  const Tensor d1(be.allocate(5 * sizeof(float)), DType::f32, Shape{5}),
      d2(be.allocate(5 * sizeof(float)), DType::f32, Shape{5});
  const Tensor loss(be.allocate(sizeof(double)), DType::f64, Shape{1});
  from_host(be, pred, std::vector<double>{0.1, -2, 3.5, 4, 1e-3});
  from_host(be, target, std::vector<double>{1, 2, 3, -4, 5});
  const double expected = be.mse_loss(d1, pred, target, 0.25);
  be.mse_loss_into(loss, d2, pred, target, 0.25);
  EXPECT_EQ(to_host(be, loss)[0], expected);
  EXPECT_EQ(to_host(be, d2), to_host(be, d1));
  expect_refused("one contiguous f64 element", [&] { be.mse_loss_into(d1, d2, pred, target, 1.0); });
  for (const Tensor& t : {pred, target, d1, d2, loss}) be.release(t.data);
}

}  // namespace
}  // namespace flux8::testing
