// The per-op profiler (flux8 bench --profile) intercepts each op of the backend it is installed on
// and times it as that op: an op with a default in Backend (composed of other ops) shows as the
// op, not as its parts (the FP8-heads ops' default is a cast per (sample, head)).
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "bench/op_profiler.h"
#include "fp8/fp8_config.h"
#include "model_test_util.h"

namespace flux8 {
namespace {

// The profiler's rows after a synchronize() (it reads its timing marks there), but the idle row.
std::map<std::string, int64_t> calls_of(Backend& be, OpProfiler& p) {
  be.synchronize();
  std::map<std::string, int64_t> m;
  for (const OpProfiler::Row& r : p.rows())
    if (r.op != OpProfiler::kIdle) m[r.op] = r.calls;
  return m;
}

TEST(OpProfiler, TimesTheFp8HeadsOpsAsThemselves) {
  auto cpu = make_backend("cpu");
  OpProfiler prof(*cpu);
  const int64_t B = 1, n = 2, D = 8, L = 4, H = n * D, rows = B * n * L;
  std::vector<float> tok(static_cast<size_t>(B * L * 3 * H), 0.5f), pe(static_cast<size_t>(B * L * D), 0.25f),
      scale(static_cast<size_t>(D), 1.0f), stats(static_cast<size_t>(B * L * n)), dscale(static_cast<size_t>(D));
  std::vector<uint8_t> codes[4];
  float scale_inv[4] = {1, 1, 1, 1}, delayed = 1.0f;
  QTensor q[4];
  for (int i = 0; i < 4; ++i) {
    codes[i].assign(static_cast<size_t>(rows * D), 0x38);
    q[i].codes = codes[i].data(), q[i].rows = rows, q[i].cols = D, q[i].scale_inv = &scale_inv[i];
  }
  Backend::Quantize cast;
  cast.delayed_scale = &delayed;
  const Tensor qkv(tok.data(), DType::f32, Shape{B, L, 3 * H});
  const Tensor pe_t(pe.data(), DType::f32, Shape{B, L, D / 2, 2}), s(scale.data(), DType::f32, Shape{D});
  const Tensor st(stats.data(), DType::f32, Shape{B * L * n}), ds(dscale.data(), DType::f32, Shape{D});
  cpu->qk_norm_rope_to_heads_fp8(Fp8Heads{q[0], cast}, Fp8Heads{q[1], cast}, Fp8Heads{q[2], cast}, st, st,
                                 qkv.cols_slice(0, H), qkv.cols_slice(H, H), qkv.cols_slice(2 * H, H), s, s, pe_t, 0,
                                 1e-6);
  cpu->qk_norm_rope_to_heads_backward_fp8(qkv.cols_slice(0, H), qkv.cols_slice(H, H), qkv.cols_slice(2 * H, H), ds, ds,
                                          q[0], q[1], q[2], qkv.cols_slice(0, H), qkv.cols_slice(H, H), st, st, s, s,
                                          pe_t, 0);
  cpu->tokens_to_heads_fp8(Fp8Heads{q[3], cast}, qkv.cols_slice(0, H), 0);
  cpu->heads_to_tokens_fp8(qkv.cols_slice(0, H), q[3], 0);
  const std::map<std::string, int64_t> c = calls_of(*cpu, prof);
  EXPECT_EQ(c.size(), 4u) << "only the four ops themselves, none of their parts";
  EXPECT_EQ(c.count("qk_norm_rope_to_heads_fp8 (+ fp8 casts)"), 1u);
  EXPECT_EQ(c.count("qk_norm_rope_to_heads_backward_fp8"), 1u);
  EXPECT_EQ(c.count("tokens_to_heads_fp8 (+ fp8 cast)"), 1u);
  EXPECT_EQ(c.count("heads_to_tokens_fp8"), 1u);
  EXPECT_EQ(c.count("quantize (fp8 cast)"), 0u);
  EXPECT_EQ(c.count("dequantize"), 0u);
}

// The FP8 GEMMs' summation as the model asks for it, seen through the profiler's rows (the CPU
// sums in fp32 whatever is asked; CudaGemmFp8.FastAccumulationReachesCublasAndStaysWithinItsBound
// checks that the request reaches cuBLASLt): with fp8_fprop_fast_accumulation each FP8 site's
// forward GEMM — one per site and step — asks for fast accumulation, and its dgrad and wgrad
// GEMMs for fp32; without it all ask fp32. FP8 MLPs run their GELU and its backward in the
// casts (the single block's through casts with a head), so every FP8 site's GEMMs are plain.
TEST(OpProfiler, ForwardFp8GemmsAskForFastAccumulationGradientsForFp32) {
  FluxConfig cfg = testing::odd_config(1, 1, false);
  cfg.hidden_size = 64, cfg.num_heads = 4, cfg.mlp_ratio = 4.0, cfg.axes_dim = {4, 6, 6};
  for (const bool fast : {true, false}) {
    SCOPED_TRACE(fast ? "fp8_fprop_fast_accumulation: true" : "false");
    Fp8Config fp8;
    fp8.enabled = fp8.hybrid = true;
    fp8.fprop_fast_accumulation = fast;
    auto cpu = make_backend("cpu");
    OpProfiler prof(*cpu);
    testing::run_model(*cpu, cfg, {.fp8 = &fp8, .batch = 2, .txt_tokens = 6, .img_tokens = 20});
    std::map<std::string, int64_t> c = calls_of(*cpu, prof);
    // Per block: double 2 x (qkv, proj, mlp in, mlp out), single linear1 and linear2.
    const int64_t sites = 8 + 2;
    if (fast) {
      EXPECT_EQ(c["gemm_fp8_tn (fast accumulation)"], sites);
      EXPECT_EQ(c["gemm_fp8_tn"], 2 * sites);  // dgrad and wgrad
    } else {
      EXPECT_EQ(c["gemm_fp8_tn"], 3 * sites);
      for (const auto& [op, n] : c) EXPECT_EQ(op.find("fast"), std::string::npos) << op;
    }
    // the double block's mlp.2 inputs, cast again in the backward (recompute_elementwise)
    EXPECT_EQ(c["quantize_fused (gelu_tanh + fp8 cast)"], 2 * 2);
    EXPECT_EQ(c["quantize_fused (gelu_tanh_backward + fp8 cast)"], 2);  // ... mlp.0 output gradients
    EXPECT_EQ(c["quantize_fused ([head | gelu_tanh] + fp8 cast)"], 2);  // the single block's linear2 input, twice
    EXPECT_EQ(c["quantize_fused ([head | gelu_tanh_backward] + fp8 cast)"], 1);  // ... linear1 output gradient
  }
}

// Nothing waits while ops are timed: each op is read from the wrapped backend's timing marks at
// the next synchronize(), its own span from its first to its last work, and what lies between
// two ops goes to the idle row — so the rows add up to the span from the first op's start to
// the last op's end, and a stretch of host work between two ops (here a sleep after a
// synchronisation) lands in the idle row, not in either op. Across a pause nothing is counted.
TEST(OpProfiler, RowsAddUpToTheStepAndHostTimeIsIdle) {
  auto cpu = make_backend("cpu");
  OpProfiler prof(*cpu);
  std::vector<float> a(4096, 1.0f), b(4096, 2.0f), y(4096);
  const Tensor ta(a.data(), DType::f32, Shape{64, 64}), tb(b.data(), DType::f32, Shape{64, 64});
  const Tensor ty(y.data(), DType::f32, Shape{64, 64});
  const int64_t start = cpu->timing_mark();
  cpu->add(ty, ta, tb);
  EXPECT_TRUE(prof.rows().empty()) << "rows are read at synchronize(), not before";
  cpu->copy(ta, ty);
  cpu->synchronize();
  EXPECT_EQ(prof.rows().size(), 3u);                           // add, copy, and the idle time between them
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // host work between two ops
  cpu->add(ty, ta, tb);
  const int64_t stop = cpu->timing_mark();
  std::map<std::string, OpProfiler::Row> rows;
  const double span = cpu->timing_elapsed_ms(start, stop);
  cpu->synchronize();
  for (const OpProfiler::Row& r : prof.rows()) rows[r.op] = r;
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows["add"].calls, 2);
  EXPECT_EQ(rows["copy"].calls, 1);
  // The sleep is idle time; with the rows within the span, it is in no op's row either (no
  // bound on the ops' own time: on a loaded machine a CPU op can take 20 ms too).
  EXPECT_GE(rows[OpProfiler::kIdle].ms, 20.0);
  // The idle time split by the op that waited: the sleep is before the second add, and the
  // split adds up to the idle row.
  const std::vector<OpProfiler::Row> waits = prof.idle_before();
  ASSERT_EQ(waits.size(), 2u);  // before copy (right after the first add) and before the second add
  EXPECT_EQ(waits[0].op, "add");
  EXPECT_EQ(waits[0].calls, 1);
  EXPECT_GE(waits[0].ms, 20.0);
  EXPECT_EQ(waits[1].op, "copy");
  EXPECT_NEAR(waits[0].ms + waits[1].ms, rows[OpProfiler::kIdle].ms, 1e-9);
  const double total = rows["add"].ms + rows["copy"].ms + rows[OpProfiler::kIdle].ms;
  EXPECT_LE(total, span);
  EXPECT_GT(total, 0.9 * span);
  EXPECT_EQ(y[0], 5.0f);  // the ops ran: y = (1 + 2) + 2
  // A pause (the bench's data upload) between two ops: its time is nobody's.
  prof.pause(true);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  cpu->synchronize();
  prof.pause(false);
  cpu->add(ty, ta, tb);
  cpu->synchronize();
  for (const OpProfiler::Row& r : prof.rows()) rows[r.op] = r;
  EXPECT_EQ(rows["add"].calls, 3);
  EXPECT_LT(rows[OpProfiler::kIdle].ms, total + 5.0) << "the paused 20 ms went to the idle row";
  prof.reset();
  EXPECT_TRUE(prof.rows().empty());
}

}  // namespace
}  // namespace flux8
