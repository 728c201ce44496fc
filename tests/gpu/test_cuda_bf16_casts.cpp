// bf16 activations (Backend::activation_dtype: the CUDA backend with bf16_activations) in the
// FP8 casts and in the fused QK-norm + RoPE of the attention inputs. Both kernels widen each
// bf16 value to f32 as they load it, which is exact, and then run the f32 code; parameters,
// statistics and parameter gradients stay f32. So:
// - quantize of a bf16 x must agree BIT FOR BIT with the CPU's quantize of the same values in
//   f32: codes, scales, amax and CastStats, exactly as the f32 cast does (test_cuda_fp8.cpp).
// - quantize_fused (GELU, its backward, LayerNorm + modulation) must give bit for bit what the
//   GPU's own op followed by the cast gives for the same values. Not the CPU: it evaluates those
//   ops with glibc's tanhf and without FMA contraction, some f32 ulps from the device, which moves an occasional code
//   (and with current scaling the amax, hence every scale). The f32 fused path is tied to the GPU's op followed by the
//   cast in test_cuda_fp8.cpp, and the op to the CPU in test_cuda_ops.cpp.
// - qk_norm_rope_to_heads and its backward store the f32 path's results rounded once to
//   nearest even: bit for bit against the GPU's f32 path, close to the CPU (see below).
#include <array>
#include <bit>
#include <random>
#include <string>
#include <vector>

#include "fp8_test_util.h"
#include "gpu_test_util.h"

namespace flux8::testing {
namespace {

// ---- FP8 casts -------------------------------------------------------------------------------

constexpr Fp8Format kFormats[] = {Fp8Format::e4m3, Fp8Format::e5m2};

// x: columns [offset, offset + cols) of rows of offset + cols + pad bf16 elements. The per-tensor
// kernel loads a thread's 4 columns as one 8-byte access only when the window's start and row
// stride allow it; the cases take that path and the element-wise one.
struct CastCase {
  int64_t rows, cols, pad, offset;
  bool with_inf;
};
const CastCase kCastCases[] = {
    {1, 1, 3, 0, false},      // a single element
    {3, 5, 2, 0, false},      // smaller than every block
    {130, 257, 3, 0, false},  // ld 260: 8-byte loads, partial tiles and a partial last quad
    {257, 129, 1, 0, false},  // ld 130: element loads
    {128, 256, 0, 0, false},  // contiguous, whole tiles
    {128, 256, 2, 2, false},  // ld 260 but the window starts 4 bytes in: element loads
    {64, 128, 0, 4, false},   // a window starting 8 bytes in, ld 132: 8-byte loads
    {130, 257, 3, 0, true},   // +inf: amax inf (scale 1 per tensor or block, NaN E8M0 scale)
};

// N(0, 1) with plant_cast_extremes in the window, all rounded to bf16 on both sides.
void fill_input(Bf16Pair& x, const CastCase& c, uint64_t seed) {
  x.randn(seed);
  plant_cast_extremes([&](int64_t r, int64_t j) -> float& { return x.host.at(r, c.offset + j); }, c.rows, c.cols,
                      c.with_inf);
  x.up();
}

TEST(CudaBf16Casts, QuantizeEqualsCpuBitForBit) {
  FLUX8_REQUIRE_GPU();
  uint64_t seed = 300;
  for (const Recipe& recipe : kRecipes)
    for (const Fp8Format format : kFormats)
      for (const CastCase& c : kCastCases)
        for (const int copies : {1, 2, 3}) {  // bit 0: rowwise, bit 1: columnwise
          const bool want_row = copies & 1, want_col = copies & 2;
          SCOPED_TRACE(fmt::format("{} {} bf16 x [{}, {}] at column {} (ld {}){} rowwise {} columnwise {}", recipe.name,
                                   fp8_format_name(format), c.rows, c.cols, c.offset, c.offset + c.cols + c.pad,
                                   c.with_inf ? " with inf" : "", want_row, want_col));
          Bf16Pair x(Shape{c.rows, c.offset + c.cols}, c.pad);
          fill_input(x, c, ++seed);
          QPair row(c.rows, c.cols, format, recipe.scaling), col(c.cols, c.rows, format, recipe.scaling);
          // Registry-like targets that start non-empty: the merge is compared too.
          const CastStats start{0.5f, 10, 9, 1, 2};
          CastStats stats[2] = {start, start};  // [cpu, gpu]
          Scalar amax(0.25f);
          for (const bool g : {false, true}) {
            Backend::Quantize q = quantize_for(recipe, format, g);
            q.amax = amax.on(g);
            q.stats = &stats[g];
            (g ? gpu() : cpu())
                .quantize(want_row ? row.on(g) : QTensor{}, want_col ? col.on(g) : QTensor{},
                          x.t(g).cols_slice(c.offset, c.cols), q);
          }
          gpu().synchronize();  // the CUDA backend delivers the statistics at the next synchronisation
          if (want_row) expect_equals_cpu(row, "rowwise");
          if (want_col) expect_equals_cpu(col, "columnwise");
          EXPECT_EQ(bits(amax.gpu_value()), bits(amax.cpu_value())) << amax.gpu_value() << " vs " << amax.cpu_value();
          expect_same_stats(stats[1], stats[0]);
          EXPECT_TRUE(x.padding_untouched());
        }
}

// A per-tensor cast over more tiles than one wave of the kernel's blocks (41 x 31 = 1271, partial
// at the bottom and the right), with an outlier that flushes small values, equals the CPU's cast
// bit for bit — amax only (the whole-tile fast path) and with counts (the general path).
TEST(CudaBf16Casts, PerTensorCastOverManyTilesEqualsCpu) {
  FLUX8_REQUIRE_GPU();
  const int64_t rows = 128 * 40 + 8, cols = 128 * 30 + 64;
  Bf16Pair x(Shape{rows, cols}, 0);
  x.randn(901, 2.0);
  x.host.at(777, 1234) = 300.0f;  // an outlier: per-tensor scales shrink, small values flush
  x.up();
  for (const Recipe& recipe : kRecipes) {
    if (recipe.scaling != Fp8Scaling::per_tensor) continue;
    for (const bool counts : {false, true}) {
      SCOPED_TRACE(fmt::format("{} {}", recipe.name, counts ? "with counts" : "amax only"));
      QPair row(rows, cols, Fp8Format::e4m3, recipe.scaling), col(cols, rows, Fp8Format::e4m3, recipe.scaling);
      CastStats stats[2];  // [cpu, gpu]
      Scalar amax(0.25f);
      for (const bool g : {false, true}) {
        Backend::Quantize q = quantize_for(recipe, Fp8Format::e4m3, g);
        q.amax = amax.on(g);
        if (counts) q.stats = &stats[g];
        (g ? gpu() : cpu()).quantize(row.on(g), col.on(g), x.t(g), q);
      }
      gpu().synchronize();
      expect_equals_cpu(row, "rowwise");
      expect_equals_cpu(col, "columnwise");
      EXPECT_EQ(bits(amax.gpu_value()), bits(amax.cpu_value())) << amax.gpu_value() << " vs " << amax.cpu_value();
      EXPECT_EQ(amax.gpu_value(), 300.0f);
      if (counts) expect_same_stats(stats[1], stats[0]);
    }
  }
}

// The kernels widen bf16 themselves (bits to the high half: NaNs keep their sign, which their
// FP8 code carries): every bf16 bit pattern, as f32 all signs, zeros, f32 subnormals, every
// exponent, ±inf and NaNs of both signs (quieted, as every bf16 store leaves them), then random
// patterns, through both load paths of the per-tensor kernel (8-byte and element loads, unpacked
// by hand) and the tile kernels, every recipe (delayed at a power-of-2 and an inexact scale),
// both formats, both copies: codes, scales, amax and counts bit-equal to the CPU's cast of the
// same f32 values.
TEST(CudaBf16Casts, EveryBf16PatternEqualsCpu) {
  FLUX8_REQUIRE_GPU();
  const int64_t rows = 520, cols = 256;  // 133,120 values: a partial row tile (520 = 4·128 + 8)
  for (const int64_t pad : {0, 1}) {     // ld 256: 8-byte loads; ld 257: element loads
    Bf16Pair x(Shape{rows, cols}, pad);
    std::mt19937 rng(5);
    for (int64_t i = 0; i < rows * cols; ++i) {
      const uint32_t b = i < 65536 ? static_cast<uint32_t>(i) << 16 : static_cast<uint32_t>(rng()) & 0xFFFF0000u;
      x.host.at(i / cols, i % cols) = std::bit_cast<float>(b);
    }
    x.up();
    for (const Recipe& recipe : kRecipes)
      for (const float scale : recipe.delayed ? std::vector<float>{1.0f, kDelayedScale} : std::vector<float>{0.0f})
        for (const Fp8Format format : kFormats) {
          SCOPED_TRACE(fmt::format("ld {} {} (scale {}) {}", cols + pad, recipe.name, scale, fp8_format_name(format)));
          Scalar sc(scale), amax(0.0f);
          QPair row(rows, cols, format, recipe.scaling), col(cols, rows, format, recipe.scaling);
          CastStats stats[2];
          for (const bool g : {false, true}) {
            Backend::Quantize q = quantize_for(recipe, format, g);
            if (recipe.delayed) q.delayed_scale = sc.on(g);
            q.amax = amax.on(g);
            q.stats = &stats[g];
            (g ? gpu() : cpu()).quantize(row.on(g), col.on(g), x.t(g), q);
          }
          gpu().synchronize();
          expect_equals_cpu(row, "rowwise");
          expect_equals_cpu(col, "columnwise");
          EXPECT_EQ(bits(amax.gpu_value()), bits(amax.cpu_value()));
          expect_same_stats(stats[1], stats[0]);
          // The amax alone (no counts: the per-tensor kernel's kFull path on ld 256's whole tiles,
          // NaN and inf quads falling back to the element-wise encoder): the same codes and amax.
          Scalar amax_only(0.0f);
          QPair row2(rows, cols, format, recipe.scaling), col2(cols, rows, format, recipe.scaling);
          for (const bool g : {false, true}) {
            Backend::Quantize q = quantize_for(recipe, format, g);
            if (recipe.delayed) q.delayed_scale = sc.on(g);
            q.amax = amax_only.on(g);
            (g ? gpu() : cpu()).quantize(row2.on(g), col2.on(g), x.t(g), q);
          }
          expect_equals_cpu(row2, "rowwise, amax only");
          expect_equals_cpu(col2, "columnwise, amax only");
          EXPECT_EQ(bits(amax_only.gpu_value()), bits(amax_only.cpu_value()));
          if (recipe.delayed) {  // not vacuous: both ends of the format were reached
            EXPECT_GT(stats[0].saturated, 0);
            EXPECT_GT(stats[0].flushed, 0);
          }
        }
  }
}

// quantize_fused with bf16 activations (x; LayerNorm's shift and scale, column windows of the
// modulation Linear's output) against its definition on the same backend: the op stored into a
// bf16 activation (produce(), which rounds its output), then quantize() of that — for every op
// and recipe, both formats and every choice of copies: codes, scales, amax, CastStats and the
// column sums bit for bit (the fused cast rounds the op's output as storing it would).
TEST(CudaBf16Casts, FusedCastsEqualOpThenCastBitForBit) {
  FLUX8_REQUIRE_GPU();
  using Op = Backend::CastInput::Op;
  // [3, 43, 257] with padded rows: partial tiles, element loads of x. [3, 200, 384] contiguous:
  // whole 128x128 tiles, every access 8 bytes, a sample boundary inside a tile (LayerNorm's
  // shift and scale change mid-tile) — the per-tensor kernel's kFull path when no counts are
  // wanted (amax only, as between telemetry reports), its general loop otherwise.
  struct FusedCase {
    int64_t B, L, H, pad;
  };
  uint64_t seed = 400;
  for (const FusedCase fc : {FusedCase{3, 43, 257, 3}, FusedCase{3, 200, 384, 0}}) {
    const int64_t B = fc.B, L = fc.L, H = fc.H;
    const double eps = 1e-6;
    Bf16Pair x16({B, L, H}, fc.pad), mod16({B, 2 * H}, fc.pad ? 1 : 0), y16({B, L, H}), gx16({B, L, H}, fc.pad);
    x16.randn(81, 2.0);
    gx16.randn(83, 2.0);        // gelu_tanh_backward: x16 is dy, gx16 the GELU's input (rows of whole 8-byte
                                // quads, read 4 at a time; test_cuda_fp8.cpp's f32 one is not aligned)
    x16.host.at(5, 7) = 40.0f;  // an outlier: per-tensor scales shrink, small values flush
    x16.up();
    mod16.randn(82, 0.5);
    Pair mean({B * L}), rstd({B * L});
    // LayerNorm's statistics, as the GPU op saves them (produce() writes the same values again).
    gpu().layernorm_modulate(Tensor{}, mean.dev, rstd.dev, x16.dev, mod16.dev.cols_slice(0, H),
                             mod16.dev.cols_slice(H, H), eps);
    const auto input = [&](Op op) {
      Backend::CastInput in;
      in.op = op;
      in.x = x16.dev;
      if (op == Op::layernorm_modulate) {
        in.mean = mean.dev, in.rstd = rstd.dev, in.eps = eps;
        in.shift = mod16.dev.cols_slice(0, H), in.scale = mod16.dev.cols_slice(H, H);
      }
      if (op == Op::gelu_tanh_backward) in.gelu_x = gx16.dev;
      if (op == Op::gated) in.gate = mod16.dev.cols_slice(0, H);  // changes mid-tile too
      return in;
    };
    for (const bool counts : {true, false})
      for (const Op op : {Op::identity, Op::gelu_tanh, Op::layernorm_modulate, Op::gelu_tanh_backward, Op::gated})
        for (const Recipe& recipe : kRecipes)
          for (const Fp8Format format : kFormats)
            for (const int copies : {1, 2, 3}) {
              const bool want_row = copies & 1, want_col = copies & 2;
              SCOPED_TRACE(fmt::format("[{}, {}, {}] pad {} {} {} {} {} rowwise {} columnwise {}", B, L, H, fc.pad,
                                       counts ? "with counts" : "amax only", cast_op_name(op), recipe.name,
                                       fp8_format_name(format), want_row, want_col));
              QPair row16(B * L, H, format, recipe.scaling), col16(H, B * L, format, recipe.scaling);
              QPair row32(B * L, H, format, recipe.scaling), col32(H, B * L, format, recipe.scaling);
              Pair sums16({H}), sums32({H});  // Quantize::column_sums accumulate: start from the same values
              sums16.randn(++seed), sums32.randn(seed);
              CastStats stats16, stats32;
              Scalar amax16(0.25f), amax32(0.25f);
              for (const bool fused : {true, false}) {
                Backend::Quantize q = quantize_for(recipe, format, true);
                q.amax = (fused ? amax16 : amax32).on(true);
                if (counts) q.stats = fused ? &stats16 : &stats32;
                q.column_sums = (fused ? sums16 : sums32).dev;
                const QPair &row = fused ? row16 : row32, &col = fused ? col16 : col32;
                const QTensor r = want_row ? row.dev : QTensor{}, c = want_col ? col.dev : QTensor{};
                if (fused) {
                  gpu().quantize_fused(r, c, input(op), q);
                } else {
                  gpu().produce(y16.dev, input(op));
                  gpu().quantize(r, c, y16.dev, q);
                }
              }
              gpu().synchronize();
              if (want_row) expect_same_on_gpu(row16, row32, "rowwise");
              if (want_col) expect_same_on_gpu(col16, col32, "columnwise");
              EXPECT_EQ(bits(amax16.gpu_value()), bits(amax32.gpu_value()));
              expect_same_stats(stats16, stats32);
              EXPECT_EQ(bits(sums16.down()), bits(sums32.down())) << "column sums";
              // Not vacuous: the cast saw the values.
              EXPECT_GT(amax16.gpu_value(), 0.25f);
              if (counts) EXPECT_GT(stats16.nonzero, 0);
              EXPECT_NE(sums16.down(), sums16.cpu_values());
            }
  }
}

// A fused cast with a head (CastInput::head: the single block's [attention output | GELU(h)]
// and [dq dk dv | GELU's backward]) against the assembled tensor, produce() then quantize(),
// bit for bit: codes, scales, amax, CastStats and column sums. Heads 128 and 256 columns wide
// (the per-tensor kernel takes them tile by tile, kFull too when only the amax is wanted) and
// 70 (straddling a tile: per-tensor casts assemble first, block casts read element by element),
// contiguous and in a padded window of a wider buffer; LayerNorm as the op goes the general way.
TEST(CudaBf16Casts, CastsWithAHeadEqualTheAssembledTensorCast) {
  FLUX8_REQUIRE_GPU();
  using Op = Backend::CastInput::Op;
  struct HeadCase {
    int64_t B, L, H, head, pad;
  };
  uint64_t seed = 700;
  // The last case has more tiles than a wave of the per-tensor kernel's blocks (41 x 24), head
  // tiles and op tiles in one grid.
  for (const HeadCase hc : {HeadCase{3, 200, 384, 128, 0}, HeadCase{2, 150, 256, 256, 0}, HeadCase{3, 43, 257, 70, 3},
                            HeadCase{2, 130, 384, 128, 4}, HeadCase{2, 2600, 2048, 1024, 0}}) {
    const int64_t B = hc.B, L = hc.L, H = hc.H, C = hc.head + H;
    Bf16Pair x16({B, L, H}, hc.pad), gx16({B, L, H}, hc.pad), mod16({B, 2 * H});
    // The head: a column window of a wider buffer (its ld is not its width) when padded.
    Bf16Pair wide({B, L, hc.head + 8}, hc.pad);
    x16.randn(++seed, 2.0), gx16.randn(++seed, 2.0), mod16.randn(++seed, 0.5), wide.randn(++seed, 3.0);
    wide.host.at(7, (hc.pad ? 8 : 0) + 3) = -50.0f;  // the head holds the outlier: the scales follow it
    wide.up();
    const Tensor head = wide.dev.cols_slice(hc.pad ? 8 : 0, hc.head);
    Bf16Pair y16({B, L, C});
    Pair mean({B * L}), rstd({B * L});
    gpu().layernorm_modulate(Tensor{}, mean.dev, rstd.dev, x16.dev, mod16.dev.cols_slice(0, H),
                             mod16.dev.cols_slice(H, H), 1e-6);
    for (const Op op : {Op::gelu_tanh, Op::gelu_tanh_backward, Op::identity, Op::layernorm_modulate, Op::gated}) {
      Backend::CastInput in;
      in.op = op, in.x = x16.dev, in.gelu_x = gx16.dev;
      in.mean = mean.dev, in.rstd = rstd.dev, in.eps = 1e-6;
      in.shift = mod16.dev.cols_slice(0, H), in.scale = mod16.dev.cols_slice(H, H), in.gate = in.scale;
      in = in.with_head(head);
      gpu().produce(y16.dev, in);
      for (const bool counts : {true, false})
        for (const Recipe& recipe : kRecipes)
          for (const Fp8Format format : kFormats) {
            SCOPED_TRACE(fmt::format("[{}, {}, {}] head {} pad {} op {} {} {} {}", B, L, H, hc.head, hc.pad,
                                     static_cast<int>(op), counts ? "with counts" : "amax only", recipe.name,
                                     fp8_format_name(format)));
            QPair row_f(B * L, C, format, recipe.scaling), col_f(C, B * L, format, recipe.scaling);
            QPair row_a(B * L, C, format, recipe.scaling), col_a(C, B * L, format, recipe.scaling);
            Pair sums_f({C}), sums_a({C});
            sums_f.randn(++seed), sums_a.randn(seed);
            CastStats stats_f, stats_a;
            Scalar amax_f(0.25f), amax_a(0.25f);
            for (const bool fused : {true, false}) {
              Backend::Quantize q = quantize_for(recipe, format, true);
              q.amax = (fused ? amax_f : amax_a).on(true);
              if (counts) q.stats = fused ? &stats_f : &stats_a;
              q.column_sums = (fused ? sums_f : sums_a).dev;
              const QPair &row = fused ? row_f : row_a, &col = fused ? col_f : col_a;
              if (fused)
                gpu().quantize_fused(row.dev, col.dev, in, q);
              else
                gpu().quantize(row.dev, col.dev, y16.dev.reshaped(Shape{B * L, C}), q);
            }
            gpu().synchronize();
            expect_same_on_gpu(row_f, row_a, "rowwise");
            expect_same_on_gpu(col_f, col_a, "columnwise");
            EXPECT_EQ(bits(amax_f.gpu_value()), bits(amax_a.gpu_value()));
            EXPECT_EQ(amax_f.gpu_value(), 50.0f) << "the head's outlier sets the amax";
            expect_same_stats(stats_f, stats_a);
            EXPECT_EQ(bits(sums_f.down()), bits(sums_a.down())) << "column sums";
          }
    }
  }
}

// Quantize::column_sums (the bias gradient of the Linear whose output gradient is cast) over a
// bf16 x: the GPU sums each tile's columns of the widened values in double, the CPU the f32
// values in double; both round once to f32, so the comparison is test_cuda_fp8.cpp's 1e-6.
// Partial tiles, a strided input, and the path with no FP8 copy (the sums on their own).
TEST(CudaBf16Casts, ColumnSumsMatchCpu) {
  FLUX8_REQUIRE_GPU();
  expect_column_sums_match_cpu<Bf16Pair>();
}

// The activation arguments of one cast share one type; statistics stay f32, column sums (a bias
// gradient) are f32 or bf16 (grad_precision: bf16) of the input's width. Each refusal names the
// tensor.
TEST(CudaBf16Casts, CastsRejectMixedTypesByName) {
  FLUX8_REQUIRE_GPU();
  const int64_t B = 2, L = 3, H = 8;
  Bf16Pair x16({B, L, H}), mod16({B, 2 * H}), mean16({B * L}), sums16({H + 1});
  Pair mod32({B, 2 * H}), mean({B * L}), rstd({B * L});
  QPair row(B * L, H, Fp8Format::e4m3, Fp8Scaling::per_tensor);
  Backend::Quantize q;
  q.delayed_scale = delayed_scale_on(true);
  const auto refused = [&](const Backend::CastInput& in, const Backend::Quantize& args, const std::string& name) {
    expect_refused("'" + name + "'", [&] { gpu().quantize_fused(row.dev, QTensor{}, in, args); });
  };
  using CastInput = Backend::CastInput;
  refused(CastInput::layernorm_modulate_of(x16.dev, mean.dev, rstd.dev, mod32.dev.cols_slice(0, H),
                                           mod32.dev.cols_slice(H, H), 1e-6),
          q, "shift");
  refused(CastInput::layernorm_modulate_of(x16.dev, mean16.dev, rstd.dev, mod16.dev.cols_slice(0, H),
                                           mod16.dev.cols_slice(H, H), 1e-6),
          q, "mean");
  Backend::Quantize with_sums = q;
  with_sums.column_sums = sums16.dev;
  refused(CastInput::gelu_tanh_of(x16.dev), with_sums, "column_sums");
  Pair gx32({B, L, H});
  refused(CastInput::gelu_tanh_backward_of(x16.dev, gx32.dev), q, "gelu_x");
  // The same arguments with the types right are taken.
  EXPECT_NO_THROW(
      gpu().quantize_fused(row.dev, QTensor{},
                           CastInput::layernorm_modulate_of(x16.dev, mean.dev, rstd.dev, mod16.dev.cols_slice(0, H),
                                                            mod16.dev.cols_slice(H, H), 1e-6),
                           q));
  gpu().synchronize();
}

// ---- QK-norm + RoPE + head layout -------------------------------------------------------------

// One stream's q, k, v as column windows of a [B, Ls, 3H] row, and the joint heads it writes at
// token_offset: Lt text tokens first, so the image stream sits at an offset.
struct QkCase {
  int64_t D, n, Ls, pad;
};
// D = 6: 3 pairs (most lanes idle), pad 1: odd row strides, pairs one element at a time; 128
// (Flux) with pad 2: pairs as one 4-byte bf16 access; 200: 4 pairs a lane, the last partly used.
// pad 0: the vector path (rows aligned to 8 elements, D = 8·2^k), the others the pair path.
const QkCase kQkCases[] = {{6, 3, 11, 1}, {128, 3, 37, 2}, {200, 3, 29, 2}, {128, 3, 37, 0}, {8, 3, 11, 0}};

// bf16 q, k, v (and in the backward bf16 q, k, dq, dk, dv, bf16 head gradients) against the
// GPU's f32 path on the same values: the kernels load the same f32 values and run the same
// arithmetic in the same order, so the bf16 outputs are the f32 outputs rounded to nearest even
// and rstd and dscale (f32 either way) the same bits. With f32 heads beside bf16 tokens (the
// two types are independent) the heads are the f32 path's exactly.
TEST(CudaBf16Casts, QkNormRopeEqualsF32PathRounded) {
  FLUX8_REQUIRE_GPU();
  for (const QkCase& c : kQkCases) {
    SCOPED_TRACE(::testing::Message() << "D=" << c.D << " n=" << c.n << " Ls=" << c.Ls << " pad=" << c.pad);
    const int64_t B = 2, Lt = 5, L = Lt + c.Ls, D = c.D, n = c.n, H = n * D, S = B * c.Ls * n;
    const Shape heads{B, n, L, D};
    Pair pe({B, L, D / 2, 2}), q_scale({D}), k_scale({D});
    pe.randn(501), q_scale.randn(502), k_scale.randn(503);
    Bf16Pair tok16({B, c.Ls, 3 * H}, c.pad);
    tok16.randn(504, 2.0);
    Pair tok32({B, c.Ls, 3 * H}, c.pad);
    tok32.host.mem = tok16.host.mem;
    tok32.up();
    const auto win = [&](const Tensor& t, int64_t i) { return t.cols_slice(i * H, H); };

    Pair qh32(heads), kh32(heads), vh32(heads), rq32({S}), rk32({S}), rq16({S}), rk16({S});
    Bf16Dev qh16(heads), kh16(heads), vh16(heads);
    gpu().qk_norm_rope_to_heads(qh32.dev, kh32.dev, vh32.dev, rq32.dev, rk32.dev, win(tok32.dev, 0), win(tok32.dev, 1),
                                win(tok32.dev, 2), q_scale.dev, k_scale.dev, pe.dev, Lt, 1e-6);
    gpu().qk_norm_rope_to_heads(qh16.t, kh16.t, vh16.t, rq16.dev, rk16.dev, win(tok16.dev, 0), win(tok16.dev, 1),
                                win(tok16.dev, 2), q_scale.dev, k_scale.dev, pe.dev, Lt, 1e-6);
    // Whole tensors: the rows of the other stream are zero in both.
    EXPECT_EQ(qh16.bits(), bf16_bits_of(qh32.down())) << "q_heads";
    EXPECT_EQ(kh16.bits(), bf16_bits_of(kh32.down())) << "k_heads";
    EXPECT_EQ(vh16.bits(), bf16_bits_of(vh32.down())) << "v_heads";
    EXPECT_EQ(bits(rq16.down()), bits(rq32.down())) << "q_rstd";
    EXPECT_EQ(bits(rk16.down()), bits(rk32.down())) << "k_rstd";
    EXPECT_NE(qh16.bits(), std::vector<uint16_t>(qh16.bits().size(), 0));
    Pair qhx(heads), khx(heads), vhx(heads);
    gpu().qk_norm_rope_to_heads(qhx.dev, khx.dev, vhx.dev, Tensor{}, Tensor{}, win(tok16.dev, 0), win(tok16.dev, 1),
                                win(tok16.dev, 2), q_scale.dev, k_scale.dev, pe.dev, Lt, 1e-6);
    EXPECT_EQ(bits(qhx.down()), bits(qh32.down())) << "f32 q_heads from bf16 q";
    EXPECT_EQ(bits(khx.down()), bits(kh32.down())) << "f32 k_heads from bf16 k";
    EXPECT_EQ(bits(vhx.down()), bits(vh32.down())) << "f32 v_heads from bf16 v";

    // Backward from bf16 head gradients (f32 ones holding the same values for the f32 path).
    Pair dqh32(heads), dkh32(heads), dvh32(heads);
    dqh32.randn(511), dkh32.randn(512), dvh32.randn(513);
    for (Pair* p : {&dqh32, &dkh32, &dvh32}) round_host_to_bf16(*p);
    Bf16Dev dqh16(heads), dkh16(heads), dvh16(heads);
    dqh16.up(dqh32.host.mem), dkh16.up(dkh32.host.mem), dvh16.up(dvh32.host.mem);
    Pair d32({B, c.Ls, 3 * H}, c.pad);
    Bf16Pair d16({B, c.Ls, 3 * H}, c.pad);
    d32.randn(514), d16.randn(514);                       // garbage to overwrite
    Pair dqs32({D}), dks32({D}), dqs16({D}), dks16({D});  // accumulated: the same start
    dqs32.randn(515), dqs16.randn(515), dks32.randn(516), dks16.randn(516);
    gpu().qk_norm_rope_to_heads_backward(win(d32.dev, 0), win(d32.dev, 1), win(d32.dev, 2), dqs32.dev, dks32.dev,
                                         dqh32.dev, dkh32.dev, dvh32.dev, win(tok32.dev, 0), win(tok32.dev, 1),
                                         rq32.dev, rk32.dev, q_scale.dev, k_scale.dev, pe.dev, Lt);
    gpu().qk_norm_rope_to_heads_backward(win(d16.dev, 0), win(d16.dev, 1), win(d16.dev, 2), dqs16.dev, dks16.dev,
                                         dqh16.t, dkh16.t, dvh16.t, win(tok16.dev, 0), win(tok16.dev, 1), rq32.dev,
                                         rk32.dev, q_scale.dev, k_scale.dev, pe.dev, Lt);
    EXPECT_EQ(bf16_bits_of(d16.down()), bf16_bits_of(d32.down())) << "dq | dk | dv";
    EXPECT_EQ(bits(dqs16.down()), bits(dqs32.down())) << "dq_scale";
    EXPECT_EQ(bits(dks16.down()), bits(dks32.down())) << "dk_scale";
    EXPECT_NE(dqs16.down(), dqs16.cpu_values());  // not vacuous: something was accumulated
    EXPECT_TRUE(d16.padding_untouched());
  }
}

// Against the CPU backend. The reference is the plain CPU backend on the same (bf16) values with
// its f32 results rounded to bf16 at the end (Bf16Pair::cpu_values): the same f32 computation up
// to the ulps of rsqrt/sincos, FMA contraction and the order of the double sums, then both
// sides round to bf16, where an f32 difference of an ulp or two moves a value to the
// neighbouring bf16 now and then: ≤ 1e-3 for the rounded outputs (an element of a wrong index,
// pair or term is off by its own size: errors of order 1). v, dv: bf16 copies, exact. rstd and
// dscale stay f32 and see the same inputs as the f32 path: test_cuda_ops.cpp's 1e-6 (kReduce).
// Two streams of a joint sequence (text at offset 0, image at Lt) as there, and a long one
// whose backward sums dscale over many chunks of segments (in runs of 18 segments a group:
// segments_per_group, runs that cross tokens).
TEST(CudaBf16Casts, QkNormRopeMatchesCpu) {
  FLUX8_REQUIRE_GPU();
  constexpr double kRounded = 1e-3, kReduce = 1e-6;
  std::vector<QkCase> cases(std::begin(kQkCases), std::end(kQkCases));
  cases.push_back({128, 24, 1001, 2});
  cases.push_back({128, 24, 1001, 0});
  for (const QkCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "D=" << c.D << " n=" << c.n << " Li=" << c.Ls << " pad=" << c.pad);
    const int64_t B = 3, Lt = 5, Li = c.Ls, L = Lt + Li, D = c.D, n = c.n, H = n * D;
    const Shape heads{B, n, L, D};
    Pair pe({B, L, D / 2, 2}), q_scale({D}), k_scale({D});
    pe.randn(601), q_scale.randn(602), k_scale.randn(603);
    Bf16Pair txt({B, Lt, 3 * H}, c.pad), img({B, Li, 3 * H}, c.pad), qh(heads), kh(heads), vh(heads);
    txt.randn(604, 2.0), img.randn(605, 2.0);
    Pair q_rstd_txt({B * Lt * n}), k_rstd_txt({B * Lt * n}), q_rstd_img({B * Li * n}), k_rstd_img({B * Li * n});
    struct Stream {
      Bf16Pair& qkv;
      Pair &q_rstd, &k_rstd;
      int64_t offset;
    };
    const Stream streams[2] = {{txt, q_rstd_txt, k_rstd_txt, 0}, {img, q_rstd_img, k_rstd_img, Lt}};
    const auto window = [&](const Bf16Pair& p, bool g, int64_t i) { return p.t(g).cols_slice(i * H, H); };
    run_both([&](Backend& be, bool g) {
      for (const Stream& s : streams)
        be.qk_norm_rope_to_heads(qh.t(g), kh.t(g), vh.t(g), s.q_rstd.t(g), s.k_rstd.t(g), window(s.qkv, g, 0),
                                 window(s.qkv, g, 1), window(s.qkv, g, 2), q_scale.t(g), k_scale.t(g), pe.t(g),
                                 s.offset, 1e-6);
    });
    EXPECT_LE(gpu_vs_cpu(qh), kRounded) << "q_heads";
    EXPECT_LE(gpu_vs_cpu(kh), kRounded) << "k_heads";
    EXPECT_EQ(gpu_vs_cpu(vh), 0.0) << "v_heads";
    for (const Stream& s : streams) {
      EXPECT_LE(gpu_vs_cpu(s.q_rstd), kReduce) << "q_rstd";
      EXPECT_LE(gpu_vs_cpu(s.k_rstd), kReduce) << "k_rstd";
    }

    // The backward on both sides from the CPU's statistics, so only the backward is compared.
    for (const Stream& s : streams) s.q_rstd.up(), s.k_rstd.up();
    Bf16Pair dqh(heads), dkh(heads), dvh(heads), dtxt({B, Lt, 3 * H}, c.pad), dimg({B, Li, 3 * H}, c.pad);
    dqh.randn(611), dkh.randn(612), dvh.randn(613);
    dtxt.randn(614), dimg.randn(615);  // garbage to overwrite
    Pair dq_scale({D}), dk_scale({D});
    dq_scale.randn(616), dk_scale.randn(617);  // the scale gradients accumulate
    Bf16Pair* grads[2] = {&dtxt, &dimg};
    run_both([&](Backend& be, bool g) {
      for (int i = 0; i < 2; ++i) {
        const Stream& s = streams[i];
        be.qk_norm_rope_to_heads_backward(window(*grads[i], g, 0), window(*grads[i], g, 1), window(*grads[i], g, 2),
                                          dq_scale.t(g), dk_scale.t(g), dqh.t(g), dkh.t(g), dvh.t(g),
                                          window(s.qkv, g, 0), window(s.qkv, g, 1), s.q_rstd.t(g), s.k_rstd.t(g),
                                          q_scale.t(g), k_scale.t(g), pe.t(g), s.offset);
      }
    });
    for (const Bf16Pair* d : grads) {
      const std::vector<float> got = d->down(), want = d->cpu_values();
      const auto cols = [&](const std::vector<float>& all, int64_t i) { return window_of_rows(all, 3 * H, i, H); };
      EXPECT_LE(rel_l2(cols(got, 0), cols(want, 0)), kRounded) << "dq";
      EXPECT_LE(rel_l2(cols(got, 1), cols(want, 1)), kRounded) << "dk";
      EXPECT_EQ(rel_l2(cols(got, 2), cols(want, 2)), 0.0) << "dv";
      EXPECT_TRUE(d->padding_untouched());
    }
    EXPECT_LE(gpu_vs_cpu(dq_scale), kReduce) << "dq_scale";
    EXPECT_LE(gpu_vs_cpu(dk_scale), kReduce) << "dk_scale";
  }
}

// Against the CPU twin of bf16 storage (round_activations_to_bf16), which runs this op as the
// unfused chain rmsnorm_heads → rope and so also rounds what the fused kernel never stores: the
// normalised q and k before the rotation, and in the backward the rotated head gradients, from
// which it then takes dx and dscale. That second rounding (2⁻⁹ relative at most, per element)
// puts the twin up to 3.0e-3 (heads), 2.3e-3 (dq | dk | dv) and 1.7e-3 (dscale: a sum of terms
// each rounded on its own) from the single rounding here: measured on the CPU for exactly these
// inputs, with the plain CPU's result rounded to bf16 standing in for the GPU's. 6e-3 leaves a
// 2x margin and is still far below an indexing error (order 1). The tight relation is the one
// QkNormRopeMatchesCpu checks.
TEST(CudaBf16Casts, QkNormRopeNearCpuBf16Twin) {
  FLUX8_REQUIRE_GPU();
  constexpr double kTwin = 6e-3;
  // The cases the bound was measured for (the first three of kQkCases; both paths round the
  // same f32 values once, which QkNormRopeMatchesCpu checks on all of them).
  for (const QkCase& c : {kQkCases[0], kQkCases[1], kQkCases[2]}) {
    SCOPED_TRACE(::testing::Message() << "D=" << c.D << " n=" << c.n << " Ls=" << c.Ls << " pad=" << c.pad);
    const int64_t B = 3, Lt = 5, L = Lt + c.Ls, D = c.D, n = c.n, H = n * D, S = B * c.Ls * n;
    const Shape heads{B, n, L, D};
    Pair pe({B, L, D / 2, 2}), q_scale({D}), k_scale({D}), q_rstd({S}), k_rstd({S});
    pe.randn(701), q_scale.randn(702), k_scale.randn(703);
    Bf16Pair tok({B, c.Ls, 3 * H}, c.pad), qh(heads), kh(heads), vh(heads);
    tok.randn(704, 2.0);
    const auto window = [&](const Bf16Pair& p, bool g, int64_t i) { return p.t(g).cols_slice(i * H, H); };
    run_both_bf16([&](Backend& be, bool g) {
      be.qk_norm_rope_to_heads(qh.t(g), kh.t(g), vh.t(g), q_rstd.t(g), k_rstd.t(g), window(tok, g, 0),
                               window(tok, g, 1), window(tok, g, 2), q_scale.t(g), k_scale.t(g), pe.t(g), Lt, 1e-6);
    });
    EXPECT_LE(gpu_vs_cpu(qh), kTwin) << "q_heads";
    EXPECT_LE(gpu_vs_cpu(kh), kTwin) << "k_heads";
    EXPECT_EQ(gpu_vs_cpu(vh), 0.0) << "v_heads";
    EXPECT_LE(gpu_vs_cpu(q_rstd), 1e-6) << "q_rstd";  // from the bf16 inputs, not rounded

    q_rstd.up(), k_rstd.up();
    Bf16Pair dqh(heads), dkh(heads), dvh(heads), d({B, c.Ls, 3 * H}, c.pad);
    dqh.randn(711), dkh.randn(712), dvh.randn(713), d.randn(714);
    Pair dq_scale({D}), dk_scale({D});
    dq_scale.fill(0.0f), dk_scale.fill(0.0f);  // the sums alone, not diluted by a start value
    run_both_bf16([&](Backend& be, bool g) {
      be.qk_norm_rope_to_heads_backward(window(d, g, 0), window(d, g, 1), window(d, g, 2), dq_scale.t(g), dk_scale.t(g),
                                        dqh.t(g), dkh.t(g), dvh.t(g), window(tok, g, 0), window(tok, g, 1), q_rstd.t(g),
                                        k_rstd.t(g), q_scale.t(g), k_scale.t(g), pe.t(g), Lt);
    });
    EXPECT_LE(gpu_vs_cpu(d), kTwin) << "dq | dk | dv";
    EXPECT_LE(gpu_vs_cpu(dq_scale), kTwin) << "dq_scale";
    EXPECT_LE(gpu_vs_cpu(dk_scale), kTwin) << "dk_scale";
    EXPECT_TRUE(d.padding_untouched());
  }
}

// The activation arguments of one call share one type (f32 or bf16); statistics, scales and the
// table stay f32. Each refusal names a tensor of the call.
TEST(CudaBf16Casts, QkNormRopeRejectsMixedTypesByName) {
  FLUX8_REQUIRE_GPU();
  const int64_t B = 1, n = 2, Ls = 3, L = 3, D = 8, H = n * D, S = B * Ls * n;
  const Shape heads{B, n, L, D};
  Bf16Pair tok16({B, Ls, 3 * H}), rstd16({S}), dscale16({D});
  Pair tok32({B, Ls, 3 * H}), pe({B, L, D / 2, 2}), scale({D}), rstd({S}), dscale({D});
  Bf16Dev qh(heads), kh(heads), vh(heads), dh16(heads);
  const auto w16 = [&](int64_t i) { return tok16.dev.cols_slice(i * H, H); };
  const auto w32 = [&](int64_t i) { return tok32.dev.cols_slice(i * H, H); };
  const auto refused = [](auto call, const std::string& name) { expect_refused("'" + name + "'", call); };
  refused(
      [&] {
        gpu().qk_norm_rope_to_heads(qh.t, kh.t, vh.t, rstd.dev, rstd.dev, w16(0), w16(1), w32(2), scale.dev, scale.dev,
                                    pe.dev, 0, 1e-6);
      },
      "v");
  refused(
      [&] {
        gpu().qk_norm_rope_to_heads(qh.t, kh.t, vh.t, rstd16.dev, rstd16.dev, w16(0), w16(1), w16(2), scale.dev,
                                    scale.dev, pe.dev, 0, 1e-6);
      },
      "q_rstd");
  refused(
      [&] {
        gpu().qk_norm_rope_to_heads_backward(w32(0), w32(1), w32(2), dscale.dev, dscale.dev, dh16.t, dh16.t, dh16.t,
                                             w16(0), w16(1), rstd.dev, rstd.dev, scale.dev, scale.dev, pe.dev, 0);
      },
      "q");
  // The scale gradients are f32 or bf16 (grad_precision: bf16), the two of a call alike.
  refused(
      [&] {
        gpu().qk_norm_rope_to_heads_backward(w16(0), w16(1), w16(2), dscale16.dev, dscale.dev, dh16.t, dh16.t, dh16.t,
                                             w16(0), w16(1), rstd.dev, rstd.dev, scale.dev, scale.dev, pe.dev, 0);
      },
      "dk_scale");
  EXPECT_NO_THROW(gpu().qk_norm_rope_to_heads(qh.t, kh.t, vh.t, rstd.dev, rstd.dev, w16(0), w16(1), w16(2), scale.dev,
                                              scale.dev, pe.dev, 0, 1e-6));
  gpu().synchronize();
}

}  // namespace
}  // namespace flux8::testing
