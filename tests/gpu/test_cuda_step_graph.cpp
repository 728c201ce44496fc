// cuda_graph on the GPU: a model's forward and backward recorded by StepGraph and launched as
// captured CUDA graphs train exactly as the same steps issued op by op — every prediction,
// gradient, FP8 scale and amax history bit for bit — with the segments actually captured and
// launched (no capture failing: cuBLASLt, cuDNN's BF16 and FP8 attention and every flux8 kernel
// are capturable once their scratch has grown).
#include <gtest/gtest.h>

#include "backend/step_graph.h"
#include "backend/transfer.h"
#include "fp8/fp8_config.h"
#include "gpu_test_util.h"
#include "model_test_util.h"

namespace flux8::testing {
namespace {

// `fallbacks`: the shapes send some ops to paths that allocate temporaries (the emulated FP8 GEMM
// of rows that are not 16-byte aligned), whose captures fail and which then run op by op.
void expect_graphs_ran(const ModelRun& graphed, bool fallbacks) {
  const StepGraph::Stats& s = graphed.graph;
  std::printf("graphs: %lld captured, %lld launched holding %lld ops, %lld ops eager, %lld captures failed\n",
              static_cast<long long>(s.captured), static_cast<long long>(s.launched),
              static_cast<long long>(s.ops_launched), static_cast<long long>(s.ops_eager),
              static_cast<long long>(s.capture_failed));
  EXPECT_GT(s.captured, 0);
  if (fallbacks)
    EXPECT_GT(s.capture_failed, 0);
  else
    EXPECT_EQ(s.capture_failed, 0);
  EXPECT_GT(s.ops_launched, s.ops_eager / 3);
}

TEST(CudaStepGraph, GraphedStepsEqualEagerOnesBitForBit) {
  FLUX8_REQUIRE_GPU();
  FluxConfig odd = odd_config(1, 2, true);   // D = 10: attention on the reference kernel
  FluxConfig wide = odd_config(1, 1, true);  // D = 128: cuDNN, BF16 and FP8
  wide.hidden_size = 256;
  wide.num_heads = 2;
  wide.mlp_ratio = 4.0;
  wide.axes_dim = {16, 56, 56};
  const Fp8Config fp8 = delayed_hybrid_fp8(), fp8_attention = delayed_hybrid_fp8(true);
  struct Case {
    const char* name;
    Backend* be;
    const FluxConfig* cfg;
    const Fp8Config* fp8;
    int64_t low_rank_rows;
    bool fallbacks;
  };
  for (const Case& c :
       {Case{"odd, bf16 activations, low-rank", &gpu_bf16_activations(), &odd, nullptr, 4, false},
        Case{"odd, bf16 gradients, FP8 delayed (emulated GEMMs: failed captures)", &gpu_bf16_grads(), &odd, &fp8, 0,
             true},
        Case{"D = 128, BF16 (cuDNN)", &gpu_bf16_activations(), &wide, nullptr, 0, false},
        Case{"D = 128, FP8 delayed + FP8 attention, low-rank", &gpu_bf16_grads(), &wide, &fp8_attention, 4, false}}) {
    SCOPED_TRACE(c.name);
    ModelRunOptions o{.fp8 = c.fp8,
                      .batch = 2,
                      .txt_tokens = 16,
                      .img_tokens = 48,
                      .steps = 4,
                      .weight_std = 0.1,
                      .optimizer = true,
                      .collect_stats = false,
                      .low_rank_rows = c.low_rank_rows};
    const ModelRun eager = run_model(*c.be, *c.cfg, o);
    o.graph_segment_ops = 16;
    const ModelRun graphed = run_model(*c.be, *c.cfg, o);
    expect_identical_runs(graphed, eager);
    expect_graphs_ran(graphed, c.fallbacks);
  }
}

// The FP8 telemetry steps (Quantize::stats) keep their casts out of the graphs and count what
// an eager run counts.
TEST(CudaStepGraph, TelemetryStepsCountAsEagerOnes) {
  FLUX8_REQUIRE_GPU();
  const FluxConfig cfg = odd_config(1, 1, false);
  Fp8Config fp8;
  fp8.enabled = true;
  fp8.hybrid = true;
  fp8.recipe = Fp8Recipe::delayed;
  ModelRunOptions o{
      .fp8 = &fp8, .batch = 2, .txt_tokens = 6, .img_tokens = 20, .steps = 3, .optimizer = true, .collect_stats = true};
  const ModelRun eager = run_model(gpu_bf16_activations(), cfg, o);
  o.graph_segment_ops = 4;
  const ModelRun graphed = run_model(gpu_bf16_activations(), cfg, o);
  expect_identical_runs(graphed, eager);
  EXPECT_EQ(graphed.graph.capture_failed, 0);
}

// mse_loss_into leaves the value mse_loss returns in device memory, and can be captured.
TEST(CudaStepGraph, MseLossIntoEqualsMseLoss) {
  FLUX8_REQUIRE_GPU();
  Backend& be = gpu();
  const int64_t n = 100003;  // several partial-sum chunks and a ragged last one
  std::vector<double> p(n), t(n);
  for (int64_t i = 0; i < n; ++i) p[i] = std::sin(0.37 * i), t[i] = std::cos(0.11 * i);
  const Tensor pred(be.allocate(n * 4), DType::f32, Shape{n}), target(be.allocate(n * 4), DType::f32, Shape{n});
  const Tensor d1(be.allocate(n * 4), DType::f32, Shape{n}), d2(be.allocate(n * 4), DType::f32, Shape{n});
  const Tensor loss(be.allocate(sizeof(double)), DType::f64, Shape{1});
  from_host(be, pred, p);
  from_host(be, target, t);
  const double expected = be.mse_loss(d1, pred, target, 0.5);
  be.mse_loss_into(loss, d2, pred, target, 0.5);
  EXPECT_EQ(to_host(be, loss)[0], expected);
  EXPECT_EQ(to_host(be, d2), to_host(be, d1));
  const double zero = 0.0;
  be.upload(loss.data, &zero, sizeof zero);
  be.begin_capture();
  be.mse_loss_into(loss, d2, pred, target, 0.5);
  const std::unique_ptr<Backend::Graph> g = be.end_capture();
  ASSERT_TRUE(g);
  EXPECT_EQ(to_host(be, loss)[0], 0.0);  // captured, not run
  be.launch_graph(*g);
  EXPECT_EQ(to_host(be, loss)[0], expected);
  for (const Tensor& x : {pred, target, d1, d2, loss}) be.release(x.data);
}

// A capture that an op breaks (here a synchronising upload) fails cleanly: end_capture returns
// nothing, and the stream runs work again.
TEST(CudaStepGraph, AFailedCaptureLeavesTheBackendUsable) {
  FLUX8_REQUIRE_GPU();
  Backend& be = gpu();
  const Tensor y(be.allocate(16), DType::f32, Shape{4});
  const std::vector<float> host{1, 2, 3, 4};
  be.begin_capture();
  EXPECT_ANY_THROW(be.upload(y.data, host.data(), 16));
  EXPECT_FALSE(be.end_capture());
  be.fill(y, 3.0);
  EXPECT_EQ(to_host(be, y), (std::vector<double>{3, 3, 3, 3}));
  be.release(y.data);
}

}  // namespace
}  // namespace flux8::testing
