// The CUDA FP8 ops against the CPU backend. quantize must agree BIT FOR BIT (codes, scales,
// CastStats, amax): both run the same FLUX8_HD per-element and per-block functions on the same
// fp32 operands, so any difference is a bug, not rounding. gemm_fp8_tn is compared by relative
// L2 error: its summation order, and on the tensor cores its accumulation precision, are
// backend-specific (see kTensorCoreTolerance).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/error.h"
#include "fp8/fp8_config.h"
#include "fp8/quantize.h"
#include "fp8_test_util.h"
#include "gpu_test_util.h"
#include "model/fp8_runtime.h"
#include "model/linear_site.h"

namespace flux8::testing {
namespace {

// ---- quantize ------------------------------------------------------------------------------

struct CastShape {
  int64_t rows, cols, pad;
  bool with_inf;
};
// Awkward on purpose: single element, smaller than every block, partial tiles on both edges,
// and exact tiles; every input is a strided window (pad > 0).
const CastShape kCastShapes[] = {
    {1, 1, 3, false},     {3, 5, 2, false},     {130, 257, 5, false},
    {257, 129, 1, false}, {128, 256, 4, false}, {130, 257, 3, true},
};

// N(0,1) with plant_cast_extremes.
void fill_input(Buf<float>& x, uint64_t seed, bool with_inf) {
  x.randn(seed);
  plant_cast_extremes([&](int64_t r, int64_t c) -> float& { return x.at(r, c); }, x.t.rows(), x.t.cols(), with_inf);
}

class CudaQuantize : public ::testing::TestWithParam<std::tuple<int, Fp8Format>> {};

TEST_P(CudaQuantize, EqualsCpuBitForBit) {
  FLUX8_REQUIRE_GPU();
  const Recipe& recipe = kRecipes[std::get<0>(GetParam())];
  const Fp8Format format = std::get<1>(GetParam());
  uint64_t seed = 100;
  for (const CastShape& shape : kCastShapes)
    for (const int copies : {1, 2, 3}) {  // bit 0: rowwise, bit 1: columnwise
      const bool want_row = copies & 1, want_col = copies & 2;
      SCOPED_TRACE(fmt::format("{} {} x [{}, {}] (ld {}){} rowwise {} columnwise {}", recipe.name,
                               fp8_format_name(format), shape.rows, shape.cols, shape.cols + shape.pad,
                               shape.with_inf ? " with inf" : "", want_row, want_col));
      Pair x(Shape{shape.rows, shape.cols}, shape.pad);
      fill_input(x.host, ++seed, shape.with_inf);
      x.up();
      QPair row(shape.rows, shape.cols, format, recipe.scaling), col(shape.cols, shape.rows, format, recipe.scaling);

      // Registry-like targets start non-empty, so the merge (sum of counts, max of amax) is
      // compared as well as this cast's own numbers.
      const CastStats start{0.5f, 10, 9, 1, 2};
      CastStats stats_cpu = start, stats_gpu = start;
      Scalar amax(0.25f);
      Backend::Quantize q = quantize_for(recipe, format, false);
      q.amax = amax.on(false);
      q.stats = &stats_cpu;
      cpu().quantize(want_row ? row.host : QTensor{}, want_col ? col.host : QTensor{}, x.host.t, q);
      q = quantize_for(recipe, format, true);
      q.amax = amax.on(true);
      q.stats = &stats_gpu;
      gpu().quantize(want_row ? row.dev : QTensor{}, want_col ? col.dev : QTensor{}, x.dev, q);
      gpu().synchronize();  // the CUDA backend delivers the statistics at the next synchronisation
      const float amax_cpu = amax.cpu_value(), amax_gpu = amax.gpu_value();

      if (want_row) expect_equals_cpu(row, "rowwise");
      if (want_col) expect_equals_cpu(col, "columnwise");
      EXPECT_EQ(bits(amax_gpu), bits(amax_cpu)) << amax_gpu << " vs " << amax_cpu;
      expect_same_stats(stats_gpu, stats_cpu);
    }
}

INSTANTIATE_TEST_SUITE_P(AllRecipes, CudaQuantize,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(std::size(kRecipes))),
                                            ::testing::Values(Fp8Format::e4m3, Fp8Format::e5m2)),
                         [](const ::testing::TestParamInfo<CudaQuantize::ParamType>& info) {
                           return std::string(kRecipes[std::get<0>(info.param)].name) + "_" +
                                  fp8_format_name(std::get<1>(info.param));
                         });

// quantize_fused: the cast computes LayerNorm + modulation, GELU, GELU's backward (dy·f'(x),
// x a second strided input) or a gate's product (per sample) per element instead of reading a
// stored f32 tensor. It must give exactly what the GPU's own op followed by quantize gives (the
// op's values against the CPU's are the op tests' business), for every recipe, on a strided
// input with partial tiles; LayerNorm's statistics-only pass must store the same mean and rstd
// as the full op.
TEST(CudaQuantize, FusedOpEqualsOpThenCast) {
  FLUX8_REQUIRE_GPU();
  using Op = Backend::CastInput::Op;
  // [3, 43, 257] strided: partial tiles, element loads. [3, 200, 256] contiguous: whole tiles
  // with 16-byte loads and a sample boundary inside a tile, the per-tensor kernel's kFull path
  // when only the amax is wanted (no counts).
  struct FusedCase {
    int64_t B, L, H, pad;
  };
  for (const FusedCase fc : {FusedCase{3, 43, 257, 3}, FusedCase{3, 200, 256, 0}}) {
    const int64_t B = fc.B, L = fc.L, H = fc.H;
    Pair x({B, L, H}, fc.pad), mod({B, 2 * H}), mean({B * L}), rstd({B * L}), mean2({B * L}), rstd2({B * L});
    x.randn(61, 2.0), mod.randn(62, 0.5);
    x.host.at(5, 7) = 40.0f;  // an outlier: per-tensor scales shrink, small values flush
    x.up();
    Pair y({B, L, H}), gx({B, L, H}, fc.pad ? 1 : 0);  // gelu_tanh_backward: x is dy, gx the GELU's input
    gx.randn(63, 2.0);
    for (const bool counts : {true, false})
      for (const Op op : {Op::gelu_tanh, Op::layernorm_modulate, Op::gelu_tanh_backward, Op::gated})
        for (const Recipe& recipe : kRecipes)
          for (const Fp8Format format : {Fp8Format::e4m3, Fp8Format::e5m2}) {
            SCOPED_TRACE(fmt::format("[{}, {}, {}] {} {} {} {}", B, L, H, counts ? "with counts" : "amax only",
                                     cast_op_name(op), recipe.name, fp8_format_name(format)));
            Backend::CastInput in = Backend::CastInput::gelu_tanh_of(x.dev);
            in.op = op;
            in.gelu_x = gx.dev;
            in.gate = mod.dev.cols_slice(H, H);  // gated: a gate per sample, rows 8-byte aligned or not
            if (op == Op::layernorm_modulate) {
              in.mean = mean.dev, in.rstd = rstd.dev, in.eps = 1e-6;
              in.shift = mod.dev.cols_slice(0, H), in.scale = mod.dev.cols_slice(H, H);
              gpu().layernorm_modulate(Tensor{}, mean.dev, rstd.dev, x.dev, in.shift, in.scale, in.eps);
              gpu().layernorm_modulate(y.dev, mean2.dev, rstd2.dev, x.dev, in.shift, in.scale, in.eps);
              EXPECT_EQ(mean.down(), mean2.down());
              EXPECT_EQ(rstd.down(), rstd2.down());
            }
            gpu().produce(y.dev, in);
            QPair row_f(B * L, H, format, recipe.scaling), col_f(H, B * L, format, recipe.scaling);
            QPair row_u(B * L, H, format, recipe.scaling), col_u(H, B * L, format, recipe.scaling);
            CastStats stats_f, stats_u;
            Scalar amax_f(0.0f), amax_u(0.0f);
            Backend::Quantize q = quantize_for(recipe, format, true);
            q.amax = amax_f.on(true);
            if (counts) q.stats = &stats_f;
            gpu().quantize_fused(row_f.dev, col_f.dev, in, q);
            q.amax = amax_u.on(true);
            if (counts) q.stats = &stats_u;
            gpu().quantize(row_u.dev, col_u.dev, y.dev.reshaped(Shape{B * L, H}), q);
            gpu().synchronize();
            expect_same_on_gpu(row_f, row_u, "rowwise");
            expect_same_on_gpu(col_f, col_u, "columnwise");
            EXPECT_EQ(bits(amax_f.gpu_value()), bits(amax_u.gpu_value()));
            EXPECT_GT(amax_f.gpu_value(), 0.0f);
            if (!counts) continue;
            EXPECT_GT(stats_f.nonzero, 0);
            EXPECT_EQ(stats_f.elements, stats_u.elements);
            EXPECT_EQ(stats_f.nonzero, stats_u.nonzero);
            EXPECT_EQ(stats_f.saturated, stats_u.saturated);
            EXPECT_EQ(stats_f.flushed, stats_u.flushed);
          }
  }
}

// Quantize::column_sums, the bias gradient taken in the cast of the output gradient: the GPU
// sums each 128-row tile's columns in the cast kernel and adds the tiles in order; the CPU
// sums in double as linear_backward does. Both accumulate into the target. Partial tiles,
// a strided input, and the path without any FP8 copy.
TEST(CudaQuantize, ColumnSumsMatchCpu) {
  FLUX8_REQUIRE_GPU();
  expect_column_sums_match_cpu<Pair>();
}

// The CUDA backend keeps each cast's statistics on the device until the next synchronisation
// (and flushes its pending list when full): many casts into the same targets, with no
// synchronisation between them, must merge exactly as the CPU's immediate merges do.
TEST(CudaQuantize, DeferredStatisticsMergeInOrder) {
  FLUX8_REQUIRE_GPU();
  constexpr int kCasts = 4100;  // more than the backend's pending capacity
  // Three inputs (different amaxes, zeros and saturation under the delayed scale) cast in turn
  // into three targets: a total delivered to the wrong entry, a lost or doubled entry, or a bad
  // wrap at the capacity changes some target's numbers.
  std::vector<std::unique_ptr<Pair>> xs;
  for (int k = 0; k < 3; ++k) {
    xs.push_back(std::make_unique<Pair>(Shape{3 + k, 37}, 2));
    fill_input(xs.back()->host, 11 + k, false);
    xs.back()->host.at(0, 1) = static_cast<float>(100 * (k + 1));
    xs.back()->up();
  }
  std::vector<std::unique_ptr<QPair>> rows;
  for (int k = 0; k < 3; ++k)
    rows.push_back(std::make_unique<QPair>(3 + k, 37, Fp8Format::e4m3, Fp8Scaling::per_tensor));
  CastStats stats_cpu[3], stats_gpu[3];
  Scalar amax[3] = {Scalar(0.0f), Scalar(0.0f), Scalar(0.0f)};
  Backend::Quantize q;
  for (int i = 0; i < kCasts; ++i) {
    const int k = i % 3, t = (i / 3 + i) % 3;  // input and target vary independently
    q.delayed_scale = delayed_scale_on(false);
    q.amax = amax[t].on(false);
    q.stats = &stats_cpu[t];
    cpu().quantize(rows[k]->host, QTensor{}, xs[k]->host.t, q);
    q.delayed_scale = delayed_scale_on(true);
    q.amax = amax[t].on(true);
    q.stats = &stats_gpu[t];
    gpu().quantize(rows[k]->dev, QTensor{}, xs[k]->dev, q);
  }
  gpu().synchronize();
  for (int t = 0; t < 3; ++t) {
    SCOPED_TRACE(t);
    EXPECT_EQ(bits(amax[t].gpu_value()), bits(amax[t].cpu_value()));
    expect_same_stats(stats_gpu[t], stats_cpu[t]);
  }
}

// Without an amax or stats target the cast skips its statistics:
// the codes and scales must not change.
TEST(CudaQuantize, WithoutStatisticsSameCodes) {
  FLUX8_REQUIRE_GPU();
  for (const Recipe& recipe : kRecipes) {
    SCOPED_TRACE(recipe.name);
    Pair x(Shape{257, 129}, 2);
    fill_input(x.host, 7, false);
    x.up();
    QPair row(257, 129, Fp8Format::e4m3, recipe.scaling), col(129, 257, Fp8Format::e4m3, recipe.scaling);
    cpu().quantize(row.host, col.host, x.host.t, quantize_for(recipe, Fp8Format::e4m3, false));
    gpu().quantize(row.dev, col.dev, x.dev, quantize_for(recipe, Fp8Format::e4m3, true));
    expect_equals_cpu(row, "rowwise");
    expect_equals_cpu(col, "columnwise");
    // The training steps between telemetry reports: the amax (delayed scaling) without the
    // counts (the per-tensor kernel's kCount = false instantiation; one atomic max per tile).
    // The target is max-accumulated, as a staging slot shared by several casts of a step is:
    // one already above the cast's amax stays, one below rises to it.
    for (const float start : {0.0f, 0.25f, 1e30f}) {
      SCOPED_TRACE(fmt::format("amax target starting at {}", start));
      Scalar amax(start);
      for (const bool g : {false, true}) {
        Backend::Quantize q = quantize_for(recipe, Fp8Format::e4m3, g);
        q.amax = amax.on(g);
        (g ? gpu() : cpu()).quantize(g ? row.dev : row.host, g ? col.dev : col.host, x.t(g), q);
      }
      expect_equals_cpu(row, "rowwise, amax only");
      expect_equals_cpu(col, "columnwise, amax only");
      EXPECT_EQ(bits(amax.gpu_value()), bits(amax.cpu_value()));
      EXPECT_GT(amax.cpu_value(), 0.25f);  // the cast's amax is above 0.25: not vacuous
      if (start > 1.0f) EXPECT_EQ(amax.cpu_value(), start);
    }
  }
}

// Per-tensor casts encode with the GPU's FP8 conversion instruction, the CPU with integer
// arithmetic: every bf16 bit pattern (as f32: all signs, zeros, f32 subnormals, every exponent,
// ±inf, NaNs) plus f32 values with low mantissa bits set (ties and near-ties of both formats),
// at a power-of-2 and an inexact scale, both formats, both copies: codes and counts bit-equal.
TEST(CudaQuantize, PerTensorCodesEqualCpuOnEveryBf16Pattern) {
  FLUX8_REQUIRE_GPU();
  const int64_t rows = 520, cols = 256;  // 133,120 values: a partial row tile (520 = 4·128 + 8)
  Pair x(Shape{rows, cols}, 0);
  std::mt19937 rng(5);
  for (int64_t i = 0; i < rows * cols; ++i) {
    // then random patterns: values between bf16 neighbours, ties of both formats among them
    const uint32_t bits = i < 65536 ? static_cast<uint32_t>(i) << 16 : static_cast<uint32_t>(rng());
    float f;
    std::memcpy(&f, &bits, 4);
    x.host.mem[static_cast<size_t>(i)] = f;
  }
  x.up();
  for (const float scale : {1.0f, 37.0f})
    for (const Fp8Format format : {Fp8Format::e4m3, Fp8Format::e5m2}) {
      SCOPED_TRACE(fmt::format("scale {} {}", scale, fp8_format_name(format)));
      Scalar sc(scale);
      QPair row(rows, cols, format, Fp8Scaling::per_tensor), col(cols, rows, format, Fp8Scaling::per_tensor);
      CastStats st_cpu, st_gpu;
      Backend::Quantize q;
      q.format = format;
      q.delayed_scale = sc.on(false);
      q.stats = &st_cpu;
      cpu().quantize(row.host, col.host, x.host.t, q);
      q.delayed_scale = sc.on(true);
      q.stats = &st_gpu;
      gpu().quantize(row.dev, col.dev, x.dev, q);
      gpu().synchronize();
      EXPECT_EQ(first_difference(row.dev_codes(), row.codes, 1), "") << "rowwise codes";
      EXPECT_EQ(first_difference(col.dev_codes(), col.codes, 1), "") << "columnwise codes";
      // The amax alone (no counts): the per-tensor kernel's kFull path on the whole tiles, NaN
      // and inf quads falling back to the element-wise encoder.
      QPair row2(rows, cols, format, Fp8Scaling::per_tensor), col2(cols, rows, format, Fp8Scaling::per_tensor);
      Scalar amax(0.0f);
      for (const bool g : {false, true}) {
        Backend::Quantize qa;
        qa.format = format;
        qa.delayed_scale = sc.on(g);
        qa.amax = amax.on(g);
        (g ? gpu() : cpu()).quantize(row2.on(g), col2.on(g), x.t(g), qa);
      }
      EXPECT_EQ(first_difference(row2.dev_codes(), row2.codes, 1), "") << "rowwise codes, amax only";
      EXPECT_EQ(first_difference(col2.dev_codes(), col2.codes, 1), "") << "columnwise codes, amax only";
      EXPECT_EQ(bits(amax.gpu_value()), bits(amax.cpu_value()));
      EXPECT_EQ(st_gpu.nonzero, st_cpu.nonzero);
      EXPECT_EQ(st_gpu.saturated, st_cpu.saturated);
      EXPECT_EQ(st_gpu.flushed, st_cpu.flushed);
      EXPECT_GT(st_cpu.saturated, 0);
      EXPECT_GT(st_cpu.flushed, 0);
    }
}

// ---- delayed_scaling_update -------------------------------------------------------------

// The update of every slot in one launch must equal delayed_update_slot() per slot bit for bit
// (history roll, window max, scale and scale_inv), for history lengths that leave the kernel's
// row chunks empty, partial or full, slot counts around its 32-slot blocks, both amax
// algorithms, a margin, both formats' maxima, and the odd cases: slots not cast this step (row 0
// zero: nothing may change), NaN and inf in the staging row and in past rows. Three steps in a
// row, so a roll that misplaces a row also shows up in the next step's window.
TEST(CudaFp8, DelayedScalingUpdateMatchesCpu) {
  FLUX8_REQUIRE_GPU();
  const float kNaN = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
  for (const int64_t L : {1, 2, 5, 33, 1024})
    for (const int64_t n : {1, 31, 33, 100})
      for (const AmaxAlgo algo : {AmaxAlgo::max, AmaxAlgo::most_recent}) {
        const int margin = L == 5 ? 2 : 0;
        SCOPED_TRACE(fmt::format("L {} n {} {} margin {}", L, n, amax_algo_name(algo), margin));
        Pair history(Shape{L, n}), scale(Shape{n}), scale_inv(Shape{n}), fmax(Shape{n});
        history.randn(static_cast<uint64_t>(L * 1000 + n), 3.0);
        for (float& v : history.host.mem) v = std::fabs(v);
        for (int64_t s = 0; s < n; ++s) {
          scale.host.mem[static_cast<size_t>(s)] = 1.0f + 0.25f * static_cast<float>(s % 7);
          scale_inv.host.mem[static_cast<size_t>(s)] = 1.0f / scale.host.mem[static_cast<size_t>(s)];
          fmax.host.mem[static_cast<size_t>(s)] = fp8_max(s % 2 ? Fp8Format::e5m2 : Fp8Format::e4m3);
          if (s % 5 == 3 && L > 3) history.host.mem[static_cast<size_t>(2 * n + s)] = kNaN;   // a past NaN
          if (s % 11 == 4 && L > 4) history.host.mem[static_cast<size_t>(3 * n + s)] = kInf;  // a past overflow
        }
        history.up(), scale.up(), scale_inv.up(), fmax.up();
        for (int step = 0; step < 3; ++step) {
          for (int64_t s = 0; s < n; ++s) {  // this step's staging row, in both copies
            float& v = history.host.mem[static_cast<size_t>(s)];
            v = (s + step) % 4 == 0 ? 0.0f : 0.5f + static_cast<float>((s * 7 + step * 3) % 13);
            if (s == 6 && step == 1) v = kNaN;
            if (s == 9 && step == 2) v = kInf;
          }
          const std::vector<float> row0(history.host.mem.begin(), history.host.mem.begin() + n);
          gpu().upload(history.dev.data, row0.data(), row0.size() * sizeof(float));
          cpu().delayed_scaling_update(history.host.t, scale.host.t, scale_inv.host.t, fmax.host.t, algo, margin);
          gpu().delayed_scaling_update(history.dev, scale.dev, scale_inv.dev, fmax.dev, algo, margin);
          auto as_bytes = [](const std::vector<float>& v) {
            std::vector<uint8_t> b(v.size() * sizeof(float));
            std::memcpy(b.data(), v.data(), b.size());
            return b;
          };
          EXPECT_EQ(first_difference(as_bytes(history.down()), as_bytes(history.host.mem), 4), "")
              << "history, step " << step;
          EXPECT_EQ(first_difference(as_bytes(scale.down()), as_bytes(scale.host.mem), 4), "")
              << "scale, step " << step;
          EXPECT_EQ(first_difference(as_bytes(scale_inv.down()), as_bytes(scale_inv.host.mem), 4), "")
              << "scale_inv, step " << step;
        }
        // Not vacuous: the reference moved (slot n-1 > 0 was cast at step 0, or at step 1 when
        // n = 1, so its scale left its start value).
        EXPECT_NE(scale.host.mem[static_cast<size_t>(n - 1)], 1.0f + 0.25f * static_cast<float>((n - 1) % 7));
      }
  Pair bad(Shape{4});
  EXPECT_THROW(gpu().delayed_scaling_update(bad.dev, bad.dev, bad.dev, bad.dev, AmaxAlgo::max, 0), Error);
}

// The FP8 runtime with its delayed-scaling state on the GPU (casts max their amax into device
// memory, one update launch per step, the host registry a mirror) against the same runtime on
// the CPU backend: after every step the mirrors must hold the same history and scales, bit for
// bit — with a restored state (uploaded before the first cast), an all-reduce hook (row 0 taken
// to the host and back), and an unrecorded cast between steps (a validation pass: its amax goes
// to the runtime's scratch, not the history).
// AdamW writing per-tensor FP8 casts of weights with the new values (Backend::ParamCast, the
// delayed recipe's next-step casts): the codes, scale_inv and max-accumulated amax the CPU's
// quantize() gives for the same new values, bit for bit — E4M3 and E5M2, a scale that saturates
// part of the tensor, an offset that is not a multiple of 4 (the per-element path), a weight
// spanning several of the kernel's chunks, next to a bf16 copy.
TEST(CudaFp8, AdamWCastsEqualQuantizeOfTheNewWeights) {
  FLUX8_REQUIRE_GPU();
  const int64_t n = 90007;
  Pair p({n}), gr({n}), m({n}), v({n});
  p.randn(41, 0.5), gr.randn(42, 0.01), m.randn(43, 0.001), v.fill(1e-6f);
  struct Weight {
    int64_t offset, rows, cols;
    Fp8Format format;
    float scale, amax_before;
  };
  const Weight weights[] = {{0, 137, 301, Fp8Format::e4m3, 300.0f, 0.0f},      // 41237: several chunks
                            {50001, 7, 13, Fp8Format::e5m2, 2.0f, 0.25f},      // odd offset, per element
                            {60000, 64, 96, Fp8Format::e4m3, 1500.0f, 9.0f}};  // saturates; amax stays 9
  std::vector<std::unique_ptr<QPair>> codes;
  Pair scales({3}), amax({3});
  for (int i = 0; i < 3; ++i) {
    const Weight& w = weights[i];
    codes.push_back(std::make_unique<QPair>(w.rows, w.cols, w.format, Fp8Scaling::per_tensor));
    scales.host.mem[static_cast<size_t>(i)] = w.scale;
    amax.host.mem[static_cast<size_t>(i)] = w.amax_before;
  }
  scales.up(), amax.up();
  Bf16Dev copy(Shape{1000});
  std::vector<uint16_t> copy_host(1000);
  for (int64_t step = 1; step <= 2; ++step) {
    const Backend::AdamW h{1e-2, 0.9, 0.95, 1e-8, 0.1, 1.0, step};
    run_both([&](Backend& be, bool g) {
      std::vector<Backend::ParamCast> casts;
      for (int i = 0; i < 3; ++i)
        casts.push_back({weights[i].offset, codes[static_cast<size_t>(i)]->on(g),
                         static_cast<const float*>(scales.t(g).data) + i, static_cast<float*>(amax.t(g).data) + i});
      const Backend::ParamCopy copies[] = {{70000, g ? copy.t : Tensor(copy_host.data(), DType::bf16, Shape{1000})}};
      be.adamw(p.t(g), gr.t(g), m.t(g), v.t(g), h, copies, casts, {});
    });
    EXPECT_EQ(p.down(), p.host.mem);
    for (int i = 0; i < 3; ++i) expect_equals_cpu(*codes[static_cast<size_t>(i)], fmt::format("weight {}", i).c_str());
    EXPECT_EQ(bits(amax.down()), bits(amax.host.mem));
    EXPECT_EQ(copy.bits(), copy_host);
  }
  EXPECT_EQ(amax.host.mem[2], 9.0f) << "max-accumulated: the larger amax already there stays";
  const std::vector<uint8_t> c2 = codes[2]->codes;
  EXPECT_TRUE(std::count(c2.begin(), c2.end(), uint8_t{0x7E}) > 0) << "the scale saturates some values (E4M3 448)";
}

// transpose_codes: the columnwise copy of a per-tensor cast from its rowwise codes, the CPU's
// bytes on shapes of 16-byte pieces (whole and partial 128x128 tiles) and odd ones.
TEST(CudaFp8, TransposeCodesEqualsCpu) {
  FLUX8_REQUIRE_GPU();
  std::mt19937 rng(5);
  for (const auto& [R, C] :
       {std::pair<int64_t, int64_t>{64, 128}, {256, 384}, {144, 272}, {132, 260}, {37, 53}, {1, 5}, {5, 1}, {4, 8}}) {
    QPair src(R, C, Fp8Format::e4m3, Fp8Scaling::per_tensor), dst(C, R, Fp8Format::e4m3, Fp8Scaling::per_tensor);
    for (uint8_t& b : src.codes) b = static_cast<uint8_t>(rng());
    src.scales[0] = 0.0123f;
    src.upload();
    run_both([&](Backend& be, bool g) { be.transpose_codes(dst.on(g), src.on(g)); });
    expect_equals_cpu(dst, fmt::format("{}x{}", R, C).c_str());
    EXPECT_EQ(dst.codes[static_cast<size_t>(C > 1 ? 1 * R : 0)], src.codes[C > 1 ? 1 : 0]);
  }
  QPair a(4, 8, Fp8Format::e4m3, Fp8Scaling::per_tensor), b(4, 8, Fp8Format::e4m3, Fp8Scaling::per_tensor);
  EXPECT_THROW(gpu().transpose_codes(b.dev, a.dev), Error) << "dst must be src's shape transposed";
}

TEST(CudaFp8, RuntimeStateOnDeviceMatchesCpuRuntime) {
  FLUX8_REQUIRE_GPU();
  const int64_t N = 40, K = 48, M = 24;
  Pair x(Shape{N, K}), w(Shape{M, K}), dw(Shape{M, K}), dy(Shape{N, M}), y(Shape{N, M}), dx(Shape{N, K});
  x.randn(1), w.randn(2, 0.2), dy.randn(3, 0.01), dw.fill(0.0f);
  Fp8Config cfg;
  cfg.enabled = true;
  cfg.recipe = Fp8Recipe::delayed;
  cfg.hybrid = true;
  cfg.amax_history_len = 4;
  struct Run {
    Backend& be;
    bool g;
    Fp8Runtime rt;
    LinearSite site;
    Arena saved, scratch;
    Run(Backend& b, bool gpu_side, const Fp8Config& c) : be(b), g(gpu_side), rt(c, b) {}
  };
  Run runs[2] = {Run(cpu(), false, cfg), Run(gpu(), true, cfg)};
  const auto doubling = [](float* row0, int count) {
    for (int s = 0; s < count; ++s) row0[s] *= 2.0f;
  };
  for (Run& r : runs) {
    r.site.name = "test.linear";
    r.site.w = w.t(r.g), r.site.dw = dw.t(r.g);
    r.rt.add_site(r.site);
    std::vector<LinearSite*> sites = {&r.site};
    r.rt.allocate_weight_casts(sites);
    r.saved.reserve(r.be, 1 << 20);
    r.scratch.reserve(r.be, 1 << 20);
    const int n = r.rt.registry().size();
    std::vector<float> scale(static_cast<size_t>(n)), history(static_cast<size_t>(4 * n), 0.0f);
    for (int s = 0; s < n; ++s) {
      scale[static_cast<size_t>(s)] = 2.0f + static_cast<float>(s);
      for (int row = 1; row < 4; ++row) history[static_cast<size_t>(row * n + s)] = 0.5f * static_cast<float>(row + s);
    }
    r.rt.registry().set_state(scale, history, 4);
    r.rt.registry().set_allreduce_hook(doubling);
  }
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(step);
    for (Run& r : runs) {
      r.saved.reset();
      SavedLinearInput saved = allocate_linear_input(r.saved, r.site, &r.rt, x.host.t.shape, DType::f32);
      site_forward(r.be, &r.rt, r.scratch, r.site, y.t(r.g), x.t(r.g), saved);
      site_backward(r.be, &r.rt, r.scratch, r.site, dx.t(r.g), dy.t(r.g), saved, false);
      r.rt.end_step();
      r.rt.weights_updated();
      r.rt.set_recording(false);  // a validation forward: casts that must not enter the history
      site_forward(r.be, &r.rt, r.scratch, r.site, y.t(r.g), x.t(r.g), saved);
      r.rt.set_recording(true);
    }
    const Fp8MetaRegistry &c = runs[0].rt.current_registry(), &g = runs[1].rt.current_registry();
    for (size_t i = 0; i < c.amax_history().size(); ++i)
      ASSERT_EQ(bits(g.amax_history()[i]), bits(c.amax_history()[i])) << "history element " << i;
    for (int s = 0; s < c.size(); ++s) {
      EXPECT_EQ(bits(g.scale(s)), bits(c.scale(s))) << "scale of slot " << s;
      EXPECT_EQ(bits(g.scale_inv(s)), bits(c.scale_inv(s))) << "scale_inv of slot " << s;
      EXPECT_NE(c.scale(s), 2.0f + static_cast<float>(s)) << "slot " << s << " never moved";
    }
  }
}

TEST(CudaQuantize, RejectsWhatTheCpuRejects) {
  FLUX8_REQUIRE_GPU();
  Pair x(Shape{4, 8});
  QPair transposed_wrong(4, 8, Fp8Format::e4m3, Fp8Scaling::per_tensor);
  QPair wrong_recipe(4, 8, Fp8Format::e4m3, Fp8Scaling::block_1x128);
  Backend::Quantize q;
  EXPECT_THROW(gpu().quantize(QTensor{}, transposed_wrong.dev, x.dev, q), Error);  // columnwise must be [8, 4]
  EXPECT_THROW(gpu().quantize(wrong_recipe.dev, QTensor{}, x.dev, q), Error);      // per_tensor cast, 1x128 output
}

// ---- gemm_fp8_tn ---------------------------------------------------------------------------

// Tolerances of gemm_fp8_tn against the CPU's dequantize + fp32 GEMM (relative L2):
// - emulated path (the GPU also dequantizes and sums in fp32): the products of the dequantized
//   values are the same fp32 numbers on both backends (exact for power-of-2 scales); only the
//   summation order differs, an fp32 rounding effect far below 1e-5.
// - cuBLASLt on Hopper's FP8 tensor cores: the MMA sums the products of each k-slice keeping only
//   about 14 significant bits (DeepSeek-V3 report, §3.3.2: FP8 GEMM accumulation on H800 "limited
//   to retaining around 14 bits"; on an H200, 448 + 31·2^-6 summed over k = 32 returns 448), and
//   cuBLASLt's split accumulation adds the slices in fp32. That is ~2^-13 relative per slice,
//   measured as 0.8-1.3e-4 on these shapes (H200, cuBLAS 13); 5e-4 leaves a 4x margin and stays
//   far below the error of a single misapplied block scale here (~1e-2).
constexpr double kFp32Tolerance = 1e-5, kTensorCoreTolerance = 5e-4;
// Fp8Accumulation::fast: no fp32 promotion between k-slices, so ~2^-13 relative per slice adds up
// over k / 32 slices (FastAccumulationReachesCublasAndStaysWithinItsBound).
constexpr double kFastTolerance = 5e-3;

struct GemmOperands {
  Fp8Scaling sa, sb;
  Fp8Format fa, fb;
};
// Operand pairs cuBLASLt multiplies on Hopper: per tensor x per tensor, and block pairs with at
// least one 1x128 operand.
bool cublas_pair(const GemmOperands& o) {
  if (o.sa == Fp8Scaling::per_tensor || o.sb == Fp8Scaling::per_tensor) return o.sa == o.sb;
  if (o.sa == Fp8Scaling::mx_1x32 || o.sb == Fp8Scaling::mx_1x32) return false;
  return o.sa == Fp8Scaling::block_1x128 || o.sb == Fp8Scaling::block_1x128;
}
const GemmOperands kGemmOperands[] = {
    // per tensor: every pair cuBLASLt has (fprop E4M3xE4M3; hybrid dgrad/wgrad E5M2 x E4M3)
    {Fp8Scaling::per_tensor, Fp8Scaling::per_tensor, Fp8Format::e4m3, Fp8Format::e4m3},
    {Fp8Scaling::per_tensor, Fp8Scaling::per_tensor, Fp8Format::e4m3, Fp8Format::e5m2},
    {Fp8Scaling::per_tensor, Fp8Scaling::per_tensor, Fp8Format::e5m2, Fp8Format::e4m3},
    // blockwise: fprop/dgrad (activation 1x128 · weight 128x128), wgrad (1x128 · 1x128), and the
    // transposed pairing; 128x128 · 128x128 has no cuBLASLt kernel (emulated)
    {Fp8Scaling::block_1x128, Fp8Scaling::block_128x128, Fp8Format::e4m3, Fp8Format::e4m3},
    {Fp8Scaling::block_1x128, Fp8Scaling::block_128x128, Fp8Format::e5m2, Fp8Format::e4m3},
    {Fp8Scaling::block_128x128, Fp8Scaling::block_1x128, Fp8Format::e4m3, Fp8Format::e4m3},
    {Fp8Scaling::block_1x128, Fp8Scaling::block_1x128, Fp8Format::e5m2, Fp8Format::e4m3},
    {Fp8Scaling::block_128x128, Fp8Scaling::block_128x128, Fp8Format::e4m3, Fp8Format::e4m3},
    // MXFP8 (emulated on Hopper) and a per-tensor x blockwise mix (emulated)
    {Fp8Scaling::mx_1x32, Fp8Scaling::mx_1x32, Fp8Format::e4m3, Fp8Format::e4m3},
    {Fp8Scaling::mx_1x32, Fp8Scaling::mx_1x32, Fp8Format::e5m2, Fp8Format::e4m3},
    {Fp8Scaling::per_tensor, Fp8Scaling::block_1x128, Fp8Format::e4m3, Fp8Format::e4m3},
};

struct GemmShape {
  int64_t m, n, k, c_pad;
  bool cublas;  // k % 16 == 0, m and n multiples of 8, c rows 16-byte aligned
};
const GemmShape kGemmShapes[] = {
    {37, 29, 45, 3, false},    // odd k: emulated for every recipe
    {64, 96, 80, 4, true},     // one partial k block (the 128x128 scales padded to 4 k blocks)
    {136, 264, 656, 4, true},  // partial 128-row tiles, 6 k blocks (padded to 8)
    {256, 384, 512, 4, true},  // the plain cuBLASLt case
    {40, 24, 64, 3, false},    // k % 16 == 0 but c rows not 16-byte aligned: emulated
    {52, 192, 64, 0, true},    // m % 8 != 0 (a text stream's B·L): cuBLASLt, or the emulated kernel
                               // where it refuses (bf16 c at such shapes, GemmRefused)
};

// x [rows, cols] quantized on the CPU with a recipe's current scales; the same bytes go to the device.
void make_operand(QPair& q, uint64_t seed) {
  Buf<float> x(Shape{q.host.rows, q.host.cols});
  x.randn(seed);
  Backend::Quantize args;
  args.format = q.host.format;
  args.scaling = q.host.scaling;
  args.pow2 = false;  // inexact scale_inv: the GEMM must apply them as the CPU does
  cpu().quantize(q.host, QTensor{}, x.t, args);
  q.upload();
}

// gemm_fp8_tn of operand pair o on both backends (the CPU one: cpu_be) for every shape, with and
// without bias, overwriting and accumulating, into c of type C (Pair: f32; Bf16Pair: an
// activation in bf16 storage), within tolerance(shape) relative L2 and its padding untouched.
template <typename C, typename Tolerance>
void expect_gemms_match_cpu(const GemmOperands& o, uint64_t seed, Backend& cpu_be, const char* c_name,
                            Tolerance tolerance) {
  for (const GemmShape& s : kGemmShapes)
    for (const bool with_bias : {false, true})
      for (const bool accumulate : {false, true}) {
        SCOPED_TRACE(fmt::format("{}a {} {} [{}, {}] · b {} {} [{}, {}]ᵀ, c ld {}{}{}", c_name, fp8_scaling_name(o.sa),
                                 fp8_format_name(o.fa), s.m, s.k, fp8_scaling_name(o.sb), fp8_format_name(o.fb), s.n,
                                 s.k, s.n + s.c_pad, with_bias ? " +bias" : "", accumulate ? " +=" : ""));
        QPair a(s.m, s.k, o.fa, o.sa), b(s.n, s.k, o.fb, o.sb);
        make_operand(a, ++seed);
        make_operand(b, ++seed);
        C c(Shape{s.m, s.n}, s.c_pad);
        c.host.randn(++seed).fill_padding(-7.0f);
        c.up();
        Pair bias(Shape{s.n});
        bias.randn(++seed);
        const Tensor bias_cpu = with_bias ? bias.host.t : Tensor{}, bias_gpu = with_bias ? bias.dev : Tensor{};
        cpu_be.gemm_fp8_tn(c.host.t, a.host, b.host, bias_cpu, accumulate, Fp8Accumulation::fp32);
        gpu().gemm_fp8_tn(c.dev, a.dev, b.dev, bias_gpu, accumulate, Fp8Accumulation::fp32);
        EXPECT_LE(gpu_vs_cpu(c), tolerance(s));
        EXPECT_TRUE(c.padding_untouched());
      }
}

class CudaGemmFp8 : public ::testing::TestWithParam<int> {};

TEST_P(CudaGemmFp8, MatchesCpu) {
  FLUX8_REQUIRE_GPU();
  const GemmOperands& o = kGemmOperands[GetParam()];
  expect_gemms_match_cpu<Pair>(o, 1000 + 100 * static_cast<uint64_t>(GetParam()), cpu(), "", [&](const GemmShape& s) {
    return cublas_pair(o) && s.cublas ? kTensorCoreTolerance : kFp32Tolerance;
  });
}

// An output in bf16 storage (an activation: fprop's y, dgrad's dx): both backends round the fp32
// result once (the CPU twin rounds activations to bf16). Tolerance: the fp32 results differ as
// above, so some elements round to the neighbouring bf16 value (one ulp, ≤ 2⁻⁸ relative), and
// cuBLASLt's bf16-D GEMMs add a bias rounded to bf16 (≤ 2⁻⁹ of it): 3e-3 relative L2, still
// well below a misapplied block scale (~1e-2) or a missing bias (~1e-1 here). bf16 rows are
// 16-byte aligned when ld % 8 == 0: pad 4 (ld % 8 == 0 for n % 8 == 4) keeps the native path
// where it is for f32; odd pads take the emulated one.
constexpr double kBf16OutputTolerance = 3e-3;

TEST_P(CudaGemmFp8, Bf16OutputMatchesCpu) {
  FLUX8_REQUIRE_GPU();
  expect_gemms_match_cpu<Bf16Pair>(kGemmOperands[GetParam()], 5000 + 100 * static_cast<uint64_t>(GetParam()),
                                   cpu_bf16(), "bf16 c: ", [](const GemmShape&) { return kBf16OutputTolerance; });
}

INSTANTIATE_TEST_SUITE_P(AllOperandPairs, CudaGemmFp8, ::testing::Range(0, static_cast<int>(std::size(kGemmOperands))),
                         [](const ::testing::TestParamInfo<int>& info) {
                           const GemmOperands& o = kGemmOperands[info.param];
                           return fmt::format("{}_{}_x_{}_{}", fp8_scaling_name(o.sa), fp8_format_name(o.fa),
                                              fp8_scaling_name(o.sb), fp8_format_name(o.fb));
                         });

TEST(CudaGemmFp8, RejectsE5m2TimesE5m2) {
  FLUX8_REQUIRE_GPU();
  QPair a(32, 64, Fp8Format::e5m2, Fp8Scaling::per_tensor), b(16, 64, Fp8Format::e5m2, Fp8Scaling::per_tensor);
  make_operand(a, 1);
  make_operand(b, 2);
  Pair c(Shape{32, 16});
  try {
    gpu().gemm_fp8_tn(c.dev, a.dev, b.dev, Tensor{}, false, Fp8Accumulation::fp32);
    ADD_FAILURE() << "E5M2 x E5M2 ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("E5M2"), std::string::npos) << e.what();
  }
}

// A cast on the GPU followed by its GEMM: the whole FP8 linear as the model runs it
// (quantize_args -> quantize -> gemm_fp8_tn), against the CPU doing the same.
TEST(CudaGemmFp8, CastThenGemmMatchesCpu) {
  FLUX8_REQUIRE_GPU();
  const int64_t m = 192, n = 256, k = 384;
  for (const auto& [sx, sw] : {std::pair{Fp8Scaling::per_tensor, Fp8Scaling::per_tensor},
                               std::pair{Fp8Scaling::block_1x128, Fp8Scaling::block_128x128},
                               std::pair{Fp8Scaling::mx_1x32, Fp8Scaling::mx_1x32}}) {
    SCOPED_TRACE(fp8_scaling_name(sw));
    Pair x(Shape{m, k}, 4), w(Shape{n, k});
    x.randn(11);
    w.randn(12, 0.05);
    QPair xq(m, k, Fp8Format::e4m3, sx), wq(n, k, Fp8Format::e4m3, sw);
    Backend::Quantize qx, qw;
    qx.scaling = sx;
    qw.scaling = sw;
    qx.pow2 = qw.pow2 = true;
    cpu().quantize(xq.host, QTensor{}, x.host.t, qx);
    cpu().quantize(wq.host, QTensor{}, w.host.t, qw);
    gpu().quantize(xq.dev, QTensor{}, x.dev, qx);
    gpu().quantize(wq.dev, QTensor{}, w.dev, qw);
    Pair y(Shape{m, n});
    cpu().gemm_fp8_tn(y.host.t, xq.host, wq.host, Tensor{}, false, Fp8Accumulation::fp32);
    gpu().gemm_fp8_tn(y.dev, xq.dev, wq.dev, Tensor{}, false, Fp8Accumulation::fp32);
    // Same operands bit for bit; the tolerances are explained above kFp32Tolerance.
    EXPECT_LE(gpu_vs_cpu(y), sx == Fp8Scaling::mx_1x32 ? kFp32Tolerance : kTensorCoreTolerance);
  }
}

// Fp8Accumulation::fast (the forward GEMMs' default, fp8_fprop_fast_accumulation): cuBLASLt's
// FAST_ACCUM keeps the running sum in the MMA's ~14-bit accumulator across k-slices, so its error
// grows with k where split accumulation's stays at one slice's. Per-tensor E4M3 operands (the
// forward's pair) at growing k, Flux's 3072 and 12288 among them, into f32 (the accumulation
// alone) and into bf16 with a bias (the model's forward GEMM): the fast result within
// kFastTolerance of the CPU's fp32 sums, and at k ≥ 3072 measurably less precise than the fp32
// mode — otherwise the mode is not reaching cuBLASLt. Block-scaled operands take fp32 whatever is
// asked (cuBLASLt promotes each 128-wide block): the same bits as the fp32 mode.
TEST(CudaGemmFp8, FastAccumulationReachesCublasAndStaysWithinItsBound) {
  FLUX8_REQUIRE_GPU();
  const int64_t m = 128, n = 256;
  for (const int64_t k : {512, 3072, 12288}) {
    SCOPED_TRACE(fmt::format("m {} n {} k {}", m, n, k));
    QPair a(m, k, Fp8Format::e4m3, Fp8Scaling::per_tensor), b(n, k, Fp8Format::e4m3, Fp8Scaling::per_tensor);
    make_operand(a, 31 + static_cast<uint64_t>(k));
    make_operand(b, 32 + static_cast<uint64_t>(k));
    Pair c(Shape{m, n});
    cpu().gemm_fp8_tn(c.host.t, a.host, b.host, Tensor{}, false, Fp8Accumulation::fast);  // fp32 sums on the CPU
    gpu().gemm_fp8_tn(c.dev, a.dev, b.dev, Tensor{}, false, Fp8Accumulation::fp32);
    const double e_fp32 = gpu_vs_cpu(c);
    gpu().gemm_fp8_tn(c.dev, a.dev, b.dev, Tensor{}, false, Fp8Accumulation::fast);
    const double e_fast = gpu_vs_cpu(c);
    std::printf("k %5lld: fp32 accumulation %.3g, fast %.3g relative L2\n", static_cast<long long>(k), e_fp32, e_fast);
    EXPECT_LE(e_fp32, kTensorCoreTolerance);
    EXPECT_LE(e_fast, kFastTolerance);
    if (k >= 3072) EXPECT_GT(e_fast, 1.5 * e_fp32) << "fast accumulation did not reach cuBLASLt";

    Bf16Pair y(Shape{m, n}, 8);
    Pair bias(Shape{n});
    bias.randn(33);
    y.host.randn(34).fill_padding(-7.0f);
    y.up();
    cpu_bf16().gemm_fp8_tn(y.host.t, a.host, b.host, bias.host.t, false, Fp8Accumulation::fast);
    gpu().gemm_fp8_tn(y.dev, a.dev, b.dev, bias.dev, false, Fp8Accumulation::fast);
    EXPECT_LE(gpu_vs_cpu(y), kFastTolerance + kBf16OutputTolerance);
    EXPECT_TRUE(y.padding_untouched());

    QPair ab(m, k, Fp8Format::e4m3, Fp8Scaling::block_1x128), bb(n, k, Fp8Format::e4m3, Fp8Scaling::block_128x128);
    make_operand(ab, 35);
    make_operand(bb, 36);
    gpu().gemm_fp8_tn(c.dev, ab.dev, bb.dev, Tensor{}, false, Fp8Accumulation::fp32);
    const std::vector<float> block_fp32 = c.down();
    gpu().gemm_fp8_tn(c.dev, ab.dev, bb.dev, Tensor{}, false, Fp8Accumulation::fast);
    EXPECT_EQ(c.down(), block_fp32) << "block-scaled operands must sum in fp32";
  }
}

// The forward GEMM's bias as the bf16 copy a model keeps (ParamStore::bias_operand): into a bf16
// output the same bits as an f32 bias of the same (rounded) values — on the cuBLASLt path
// (per-tensor and block-scaled operands), where it also equals the unrounded f32 bias (cuBLASLt's
// bf16-D epilogue rounds it to bf16 itself), and on the emulated one (k = 24, not a multiple of
// 16); into an f32 output it is refused, naming it.
TEST(CudaGemmFp8, Bf16BiasEqualsTheF32Bias) {
  FLUX8_REQUIRE_GPU();
  const int64_t m = 72, n = 104;
  for (const auto [k, scaling] :
       {std::pair{int64_t{256}, Fp8Scaling::per_tensor}, std::pair{int64_t{256}, Fp8Scaling::block_1x128},
        std::pair{int64_t{24}, Fp8Scaling::per_tensor}}) {
    SCOPED_TRACE(fmt::format("k {} {}", k, fp8_scaling_name(scaling)));
    const Fp8Scaling b_scaling = scaling == Fp8Scaling::per_tensor ? scaling : Fp8Scaling::block_128x128;
    QPair a(m, k, Fp8Format::e4m3, scaling), b(n, k, Fp8Format::e4m3, b_scaling);
    make_operand(a, 41 + static_cast<uint64_t>(k));
    make_operand(b, 42 + static_cast<uint64_t>(k));
    Pair bias(Shape{n}), bias_rounded(Shape{n});
    bias.randn(43);
    Bf16Pair bias16(Shape{n});
    bias16.host.mem = bias.host.mem;
    bias16.up();  // rounds the host values too
    bias_rounded.host.mem = bias16.host.mem;
    bias_rounded.up();
    Bf16Pair y1(Shape{m, n}, 8), y2(Shape{m, n}, 8), y3(Shape{m, n}, 8);
    gpu().gemm_fp8_tn(y1.dev, a.dev, b.dev, bias.dev, false, Fp8Accumulation::fast);
    gpu().gemm_fp8_tn(y2.dev, a.dev, b.dev, bias16.dev, false, Fp8Accumulation::fast);
    gpu().gemm_fp8_tn(y3.dev, a.dev, b.dev, bias_rounded.dev, false, Fp8Accumulation::fast);
    EXPECT_EQ(y2.all_bits(), y3.all_bits());
    if (k % 16 == 0) EXPECT_EQ(y2.all_bits(), y1.all_bits()) << "cuBLASLt rounds the f32 bias to bf16";
  }
  QPair a(m, 256, Fp8Format::e4m3, Fp8Scaling::per_tensor), b(n, 256, Fp8Format::e4m3, Fp8Scaling::per_tensor);
  make_operand(a, 44);
  make_operand(b, 45);
  Bf16Pair bias16(Shape{n});
  Pair c(Shape{m, n});
  expect_refused("gemm_fp8_tn: bias 'b' is bf16",
                 [&] { gpu().gemm_fp8_tn(c.dev, a.dev, b.dev, bias16.dev, false, Fp8Accumulation::fp32); });
}

// What cuBLASLt can multiply must not fall back to the emulated path, which says on stderr why it
// was taken (once per reason: this shape is used by no other test).
TEST(CudaGemmFp8, SupportedRecipesRunOnTensorCores) {
  FLUX8_REQUIRE_GPU();
  const int64_t m = 128, n = 256, k = 384;
  for (const GemmOperands& o : kGemmOperands) {
    if (!cublas_pair(o)) continue;
    SCOPED_TRACE(fmt::format("{} {} x {} {}", fp8_scaling_name(o.sa), fp8_format_name(o.fa), fp8_scaling_name(o.sb),
                             fp8_format_name(o.fb)));
    QPair a(m, k, o.fa, o.sa), b(n, k, o.fb, o.sb);
    make_operand(a, 21);
    make_operand(b, 22);
    Pair c(Shape{m, n});
    ::testing::internal::CaptureStderr();
    gpu().gemm_fp8_tn(c.dev, a.dev, b.dev, Tensor{}, false, Fp8Accumulation::fp32);
    gpu().synchronize();
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(log.find("emulated"), std::string::npos) << log;
  }
}

}  // namespace
}  // namespace flux8::testing
