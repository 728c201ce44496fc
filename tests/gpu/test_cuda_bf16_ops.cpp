// The CUDA ops on bf16 activations (BackendOptions::bf16_activations) against their CPU twin,
// the CPU backend with round_activations_to_bf16: the same bf16 inputs on both sides (Bf16Pair
// holds bf16 values in its host buffer), f32 parameters and statistics (Pair). Odd shapes take
// the one-element-a-thread paths, column windows with strides and row starts that allow it the
// 4-wide (8-byte) ones; every test also checks that the padding of strided outputs is untouched.
// After a comparison the CPU's result is uploaded (up()) where a later op reads it, so the
// inputs of every op, even those that are results of a bf16 op, are the same bits on both sides.
//
// Tolerances:
// - data movement and conversions (copy, fill, add/accumulate of bf16 values, layout, concat/
//   split): bit-exact, 0 mismatching elements. A sum of two bf16 values is exact in f32 and
//   rounds once on both sides.
// - ops computed in f32 (or double) and then rounded: the device's expf/tanhf/cos may differ from
//   glibc's by an ulp or two, sums of double may run in another order and the device contracts
//   into FMAs, so the f32 values agree to a few f32 ulps. Both sides then round to bf16, which
//   flips only where an f32 value lies within those ulps of a rounding midpoint (~2⁻¹⁶ of the
//   elements per ulp): almost all elements are bit-equal and the rest one bf16 ulp (2⁻⁸
//   relative) apart. Required: ‖gpu − cpu‖₂/‖cpu‖₂ ≤ 1e-3 (one flipped element in a few
//   hundred would still pass; a wrong rounding mode — truncation: ~2e-3 — or a wrong term
//   would not) and at most 1% of the elements differing at all.
// - reductions (dshift, dscale, dgate: products of bf16 values summed in double on both sides,
//   in different orders): the same reasoning, the same bounds.
// - statistics (mean, rstd, f32): double sums of the same bf16 inputs, rounded once: 1e-6, as
//   for f32 activations.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu_test_util.h"

namespace flux8::testing {
namespace {

constexpr double kRounded = 1e-3, kStatistics = 1e-6;

// A result both sides compute in f32 before rounding to bf16: see the tolerances above.
void expect_rounded_close(const Bf16Pair& p, const char* name) {
  const std::vector<float> g = p.down(), c = p.cpu_values();
  const int64_t mismatches = bf16_mismatches(p), n = static_cast<int64_t>(g.size());
  EXPECT_LE(rel_l2(g, c), kRounded) << name << ": " << mismatches << " of " << n << " elements differ";
  EXPECT_LE(mismatches * 100, n) << name << ": " << mismatches << " of " << n << " elements differ";
}

#define EXPECT_ROUNDED_CLOSE(pair) expect_rounded_close(pair, #pair)
#define EXPECT_BITS_EQUAL(pair) EXPECT_EQ(bf16_mismatches(pair), 0) << #pair
#define EXPECT_F32_CLOSE(pair, tol) EXPECT_LE(gpu_vs_cpu(pair), tol) << #pair

// Shapes of one elementwise case: columns, the pad of the outputs and of the inputs.
struct Strides {
  int64_t cols, pad_out, pad_in;
};
// 53 columns, pads 3/5: one element a thread; 52, pads 4/8: rows of 8-byte groups; no pads:
// contiguous (flat, 37·53 elements: a tail after the groups of 4).
constexpr std::array<Strides, 4> kStrides{Strides{53, 3, 5}, Strides{52, 4, 8}, Strides{53, 0, 0}, Strides{52, 0, 0}};

TEST(CudaBf16Ops, FillAddAccumulate) {
  FLUX8_REQUIRE_GPU();
  for (const Strides s : kStrides) {
    SCOPED_TRACE(::testing::Message() << "cols=" << s.cols << " pads=" << s.pad_out << "/" << s.pad_in);
    Bf16Pair y({37, s.cols}, s.pad_out), a({37, s.cols}, s.pad_in), b({37, s.cols});
    y.randn(1), a.randn(2), b.randn(3, 0.01);  // b small: the sums round (a + b is not a bf16 value)
    run_both_bf16([&](Backend& be, bool g) { be.add(y.t(g), a.t(g), b.t(g)); });
    EXPECT_BITS_EQUAL(y);
    EXPECT_GT(rel_l2(y.cpu_values(), a.cpu_values()), 0.0) << "add must change the values";
    EXPECT_TRUE(y.padding_untouched());
    y.up();  // the CPU's sum is f32: continue from its bf16 value on both sides
    run_both_bf16([&](Backend& be, bool g) { be.accumulate(y.t(g), b.t(g)); });
    EXPECT_BITS_EQUAL(y);
    EXPECT_TRUE(y.padding_untouched());
    // Values that are not bf16 values round to nearest (1/3) and -0.0 keeps its sign (no memset).
    for (const double v : {-2.5, 1.0 / 3.0, 0.0, -0.0}) {
      run_both_bf16([&](Backend& be, bool g) { be.fill(y.t(g), v); });
      EXPECT_BITS_EQUAL(y) << v;
      EXPECT_TRUE(y.padding_untouched()) << v;
      for (const float e : y.down()) ASSERT_EQ(std::signbit(e), std::signbit(v)) << v;
    }
  }
}

TEST(CudaBf16Ops, CopyConverts) {
  FLUX8_REQUIRE_GPU();
  for (const Strides s : kStrides) {
    SCOPED_TRACE(::testing::Message() << "cols=" << s.cols << " pads=" << s.pad_out << "/" << s.pad_in);
    Bf16Pair y16({37, s.cols}, s.pad_out), x16({37, s.cols}, s.pad_in);
    Pair y32({37, s.cols}, s.pad_in), x32({37, s.cols}, s.pad_out);
    y16.randn(11), x16.randn(12), y32.randn(13), x32.randn(14);
    // Ties of f32 -> bf16 rounding: 1 + 2⁻⁸ and −(1 + 2⁻⁸) round down to even, 1 + 3·2⁻⁸ up.
    x32.host.at(0, 0) = 1.00390625f, x32.host.at(0, 1) = -1.00390625f, x32.host.at(0, 2) = 1.01171875f;
    x32.up();
    run_both_bf16([&](Backend& be, bool g) { be.copy(y16.t(g), x16.t(g)); });  // bf16 -> bf16
    EXPECT_BITS_EQUAL(y16);
    EXPECT_EQ(y16.down(), x16.cpu_values());
    EXPECT_TRUE(y16.padding_untouched());
    run_both_bf16([&](Backend& be, bool g) { be.copy(y16.t(g), x32.t(g)); });  // f32 -> bf16
    EXPECT_BITS_EQUAL(y16);
    EXPECT_EQ(y16.down()[0], 1.0f);
    EXPECT_EQ(y16.down()[1], -1.0f);
    EXPECT_EQ(y16.down()[2], 1.015625f);
    EXPECT_TRUE(y16.padding_untouched());
    run_both_bf16([&](Backend& be, bool g) { be.copy(y32.t(g), x16.t(g)); });  // bf16 -> f32
    EXPECT_F32_CLOSE(y32, 0.0);
    EXPECT_EQ(y32.down(), x16.cpu_values());
    EXPECT_TRUE(y32.padding_untouched());
  }
  // Contiguous vectors whose bf16 side starts at an odd element (2 bytes past an alignment):
  // element by element; the element before stays untouched.
  const int64_t n = 301;
  Bf16Pair y({1, n + 1});
  Pair x({n}), back({n});
  y.randn(15), x.randn(16), back.randn(17);
  const auto shifted = [&](bool g) {
    Tensor t = y.t(g);
    t.data = static_cast<char*>(t.data) + (g ? 2 : 4);
    t.shape = Shape{n}, t.ld = n;
    return t;
  };
  run_both_bf16([&](Backend& be, bool g) { be.copy(shifted(g), x.t(g)); });
  EXPECT_BITS_EQUAL(y);
  y.up();  // the CPU's copy holds x's f32 values: read back its bf16 values on both sides
  run_both_bf16([&](Backend& be, bool g) { be.copy(back.t(g), shifted(g)); });
  EXPECT_F32_CLOSE(back, 0.0);
}

// copy_batch: what copy() gives each pair, in one launch a batch of 16 — 20 pairs (two
// launches) of every type pair and of 1 to 3 rows, with row strides on either side, and the
// padding around every output untouched.
TEST(CudaBf16Ops, CopyBatchEqualsCopies) {
  FLUX8_REQUIRE_GPU();
  std::vector<std::unique_ptr<Bf16Pair>> y16, x16;
  std::vector<std::unique_ptr<Pair>> y32, x32;
  std::vector<int> kind;  // 0: bf16 -> bf16, 1: f32 -> bf16, 2: bf16 -> f32, 3: f32 -> f32
  for (int i = 0; i < 20; ++i) {
    const int64_t rows = 1 + i % 3, cols = 7 + 13 * i, pad = i % 4;
    kind.push_back(i % 4);
    y16.push_back(std::make_unique<Bf16Pair>(Shape{rows, cols}, pad));
    x16.push_back(std::make_unique<Bf16Pair>(Shape{rows, cols}, 3 - pad));
    y32.push_back(std::make_unique<Pair>(Shape{rows, cols}, 3 - pad));
    x32.push_back(std::make_unique<Pair>(Shape{rows, cols}, pad));
    y16.back()->randn(100 + i), x16.back()->randn(200 + i), y32.back()->randn(300 + i), x32.back()->randn(400 + i);
  }
  run_both_bf16([&](Backend& be, bool g) {
    std::vector<Backend::CopyPair> pairs;
    for (size_t i = 0; i < kind.size(); ++i) {
      const bool y_bf = kind[i] < 2, x_bf = kind[i] % 2 == 0;
      pairs.push_back({y_bf ? y16[i]->t(g) : y32[i]->t(g), x_bf ? x16[i]->t(g) : x32[i]->t(g)});
    }
    be.copy_batch(pairs);
  });
  for (size_t i = 0; i < kind.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "pair " << i << " kind " << kind[i]);
    if (kind[i] < 2) {
      EXPECT_BITS_EQUAL(*y16[i]);
      EXPECT_TRUE(y16[i]->padding_untouched());
    } else {
      EXPECT_EQ(y32[i]->down(), y32[i]->cpu_values());
      EXPECT_TRUE(y32[i]->padding_untouched());
    }
  }
  Bf16Pair a({2, 3}), b({3, 2});
  const Backend::CopyPair bad[] = {{a.dev, b.dev}};
  EXPECT_THROW(gpu().copy_batch(bad), Error) << "each pair one [rows, cols]";
}

TEST(CudaBf16Ops, Activations) {
  FLUX8_REQUIRE_GPU();
  // 77 columns: element by element; 76 with row strides of multiples of 4: four per thread.
  for (const auto [cols, pad] : {std::array<int64_t, 2>{77, 3}, {76, 4}, {76, 0}}) {
    SCOPED_TRACE(::testing::Message() << "cols=" << cols << " pad=" << pad);
    Bf16Pair x({41, cols}, pad), y({41, cols}, pad), dy({41, cols}, 2 * pad), dx({41, cols}, pad);
    x.randn(21, 3.0), y.randn(22), dy.randn(23), dx.randn(24);
    run_both_bf16([&](Backend& be, bool g) { be.silu(y.t(g), x.t(g)); });
    EXPECT_ROUNDED_CLOSE(y);
    EXPECT_TRUE(y.padding_untouched());
    for (bool acc : {false, true}) {
      dx.up();  // the same old values to accumulate into
      run_both_bf16([&](Backend& be, bool g) { be.silu_backward(dx.t(g), dy.t(g), x.t(g), acc); });
      EXPECT_ROUNDED_CLOSE(dx);
      EXPECT_TRUE(dx.padding_untouched());
    }
    // GELU of the SiLU output: an input that is itself a bf16 result.
    y.up();
    Bf16Pair z({41, cols}, pad);
    z.randn(25);
    run_both_bf16([&](Backend& be, bool g) { be.gelu_tanh(z.t(g), y.t(g)); });
    EXPECT_ROUNDED_CLOSE(z);
    EXPECT_TRUE(z.padding_untouched());
    run_both_bf16([&](Backend& be, bool g) { be.gelu_tanh_backward(dx.t(g), dy.t(g), y.t(g)); });
    EXPECT_ROUNDED_CLOSE(dx);
    EXPECT_TRUE(dx.padding_untouched());
  }
}

TEST(CudaBf16Ops, LayerNormModulate) {
  FLUX8_REQUIRE_GPU();
  struct Case {
    int64_t L, H, pad;
  };
  // The variants (with_row_variant in norms.cu): H = 203 or an odd stride: one column at a time
  // (256 or 512 threads, 1 to 8 columns each); H a multiple of 4 with strides of multiples of
  // 4: groups of 4 bf16 (128 threads up to 512 columns, then 256 threads of 1 to 4 groups:
  // 3 for Flux's 3072); 4100: beyond 4096, the row-loop forward and three-pass backward. Rows
  // per block of the backward (⌈B·L/264⌉, 1 to 32, taken two at a time): B·L = 111 rows give 1
  // (37 chunks a sample, the one-row step alone), 900 give 4, 3000 give 12 (a partial chunk of
  // 4 last), 1536 give 6 and 8700 the most, 32. The 4-column variants run the staged backward
  // (cp.async two pairs of rows ahead): 111 rows of 200 (one row a block: the single-row step
  // alone) and 1200 rows of 256 (5 a block: two pairs, then a single row) too.
  for (const Case c : {Case{37, 203, 2}, Case{37, 200, 0}, Case{400, 256, 0}, Case{300, 200, 4}, Case{1000, 36, 3},
                       Case{2900, 200, 0}, Case{33, 1500, 0}, Case{33, 1500, 2}, Case{40, 3072, 4}, Case{512, 3072, 0},
                       Case{20, 3000, 1}, Case{9, 4000, 0}, Case{9, 4100, 2}}) {
    SCOPED_TRACE(::testing::Message() << "L=" << c.L << " H=" << c.H << " pad=" << c.pad);
    const int64_t B = 3, L = c.L, H = c.H;
    Bf16Pair x({B, L, H}, c.pad), y({B, L, H}, c.pad), mod({B, 6 * H});  // shift, scale: windows of mod
    Pair mean({B * L}), rstd({B * L});
    x.randn(31, 2.0), mod.randn(32, 0.5), y.randn(33), mean.randn(34), rstd.randn(35);
    // A large row mean, as the residual stream has: the two-pass variance must hold up.
    for (int64_t j = 0; j < H; ++j) x.host.at(0, j) += 100.0f;
    x.up();
    const auto window = [&](const Bf16Pair& p, bool g, int64_t k) { return p.t(g).cols_slice(k * H, H); };
    run_both_bf16([&](Backend& be, bool g) {
      be.layernorm_modulate(y.t(g), mean.t(g), rstd.t(g), x.t(g), window(mod, g, 0), window(mod, g, 1), 1e-6);
    });
    EXPECT_ROUNDED_CLOSE(y);
    EXPECT_TRUE(y.padding_untouched());
    EXPECT_F32_CLOSE(mean, kStatistics);
    EXPECT_F32_CLOSE(rstd, kStatistics);

    // The backward from the forward's x and statistics (the CPU's, on both sides).
    mean.up(), rstd.up();
    Bf16Pair dy({B, L, H}, 2 * c.pad), dx({B, L, H}, c.pad), dmod({B, 6 * H});
    dy.randn(36), dx.randn(37), dmod.randn(38);
    for (bool acc : {false, true}) {
      dx.up(), dmod.up();
      run_both_bf16([&](Backend& be, bool g) {
        be.layernorm_modulate_backward(dx.t(g), window(dmod, g, 2), window(dmod, g, 3), dy.t(g), x.t(g), mean.t(g),
                                       rstd.t(g), window(mod, g, 1), acc);
      });
      EXPECT_ROUNDED_CLOSE(dx);
      EXPECT_TRUE(dx.padding_untouched());
      EXPECT_ROUNDED_CLOSE(dmod);  // dshift, dscale; the other windows untouched on both sides
    }
    // dshift/dscale alone (no dx), and their bits from run to run: a fixed summation order.
    const auto gpu_dmod_bits = [&] {
      gpu().layernorm_modulate_backward(Tensor{}, window(dmod, true, 2), window(dmod, true, 3), dy.dev, x.dev, mean.dev,
                                        rstd.dev, window(mod, true, 1), false);
      return dmod.all_bits();
    };
    const std::vector<uint16_t> first = gpu_dmod_bits();
    EXPECT_EQ(first, gpu_dmod_bits());
    EXPECT_ROUNDED_CLOSE(dmod);  // the same values as with dx
  }
}

TEST(CudaBf16Ops, LayoutAndJointSequence) {
  FLUX8_REQUIRE_GPU();
  // D = 8 with token pads of 4: groups of 4 bf16 (8-byte moves); pad 8 and D = 16 with pad 0:
  // groups of 8 (16-byte moves); pad 2 or D = 6: element by element.
  struct Case {
    int64_t D, pad;
  };
  for (const Case c : {Case{8, 4}, Case{8, 8}, Case{16, 0}, Case{8, 2}, Case{6, 4}}) {
    SCOPED_TRACE(::testing::Message() << "D=" << c.D << " pad=" << c.pad);
    const int64_t B = 2, n = 3, Lt = 5, Li = 11, D = c.D, C = n * D;
    Bf16Pair heads({B, n, Lt + Li, D}), img({B, Li, C}, c.pad), txt({B, Lt, C});
    heads.randn(51), img.randn(52), txt.randn(53);
    run_both_bf16([&](Backend& be, bool g) {
      be.tokens_to_heads(heads.t(g), txt.t(g), 0);
      be.tokens_to_heads(heads.t(g), img.t(g), Lt);
    });
    EXPECT_BITS_EQUAL(heads);
    img.randn(54);
    run_both_bf16([&](Backend& be, bool g) { be.heads_to_tokens(img.t(g), heads.t(g), Lt); });
    EXPECT_BITS_EQUAL(img);
    EXPECT_TRUE(img.padding_untouched());

    // f32 tokens with bf16 heads (attention_heads_dtype): rounded on the way in, exact back.
    Pair img32({B, Li, C}, c.pad);
    img32.randn(55);
    run_both_bf16([&](Backend& be, bool g) { be.tokens_to_heads(heads.t(g), img32.t(g), Lt); });
    EXPECT_BITS_EQUAL(heads);
    img32.randn(56);
    run_both_bf16([&](Backend& be, bool g) { be.heads_to_tokens(img32.t(g), heads.t(g), 0); });
    EXPECT_F32_CLOSE(img32, 0.0);
    EXPECT_TRUE(img32.padding_untouched());

    Bf16Pair joint({B, Lt + Li, C}), a({B, Lt, C}, c.pad), b({B, Li, C});
    joint.randn(57), a.randn(58), b.randn(59);
    run_both_bf16([&](Backend& be, bool g) { be.concat_tokens(joint.t(g), a.t(g), b.t(g)); });
    EXPECT_BITS_EQUAL(joint);
    joint.randn(60);
    run_both_bf16([&](Backend& be, bool g) { be.split_tokens(a.t(g), b.t(g), joint.t(g)); });
    EXPECT_BITS_EQUAL(a);
    EXPECT_BITS_EQUAL(b);
    EXPECT_TRUE(a.padding_untouched());
    a.randn(61), b.randn(62);
    run_both_bf16([&](Backend& be, bool g) { be.split_tokens(Tensor{}, b.t(g), joint.t(g)); });
    EXPECT_BITS_EQUAL(b);
    run_both_bf16([&](Backend& be, bool g) { be.split_tokens(a.t(g), Tensor{}, joint.t(g)); });
    EXPECT_BITS_EQUAL(a);
  }
}

TEST(CudaBf16Ops, GatedResidual) {
  FLUX8_REQUIRE_GPU();
  // H = 45, pad 3: element by element, one column chunk of the dgate sums; H = 44, pads of 4
  // (the gate window of [B, 3H] starts 88 bytes in): groups of 4, and L = 600 rows per sample
  // span several chunks (19 of 32 rows: column_sums4_chunk_rows).
  struct Case {
    int64_t L, H, pad;
  };
  for (const Case c : {Case{29, 45, 3}, Case{600, 44, 4}}) {
    SCOPED_TRACE(::testing::Message() << "L=" << c.L << " H=" << c.H);
    const int64_t B = 3, L = c.L, H = c.H;
    Bf16Pair x({B, L, H}, c.pad), y({B, L, H}), mod({B, 3 * H}), dx({B, L, H}, c.pad), dy({B, L, H}, 2 * c.pad);
    Bf16Pair dmod({B, 3 * H});
    x.randn(61), y.randn(62), mod.randn(63), dx.randn(64), dy.randn(65), dmod.randn(66);
    const auto gate = [&](const Bf16Pair& p, bool g) { return p.t(g).cols_slice(H, H); };
    // Out of place (out's rows padded differently from x's), then in place: the same bits.
    Bf16Pair out({B, L, H}, 2 * c.pad);
    out.randn(69);
    run_both_bf16([&](Backend& be, bool g) { be.gated_residual(out.t(g), x.t(g), y.t(g), gate(mod, g)); });
    EXPECT_BITS_EQUAL(out);
    EXPECT_TRUE(out.padding_untouched());
    run_both_bf16([&](Backend& be, bool g) { be.gated_residual(x.t(g), x.t(g), y.t(g), gate(mod, g)); });
    // g·y of two bf16 values is exact in f32: x + g·y rounds once on both sides (FMA or not).
    EXPECT_BITS_EQUAL(x);
    EXPECT_EQ(x.down(), out.down());
    EXPECT_TRUE(x.padding_untouched());
    // The backward of the updated residual stream x as the incoming gradient.
    x.up();
    run_both_bf16(
        [&](Backend& be, bool g) { be.gated_residual_backward(dy.t(g), gate(dmod, g), x.t(g), y.t(g), gate(mod, g)); });
    EXPECT_BITS_EQUAL(dy);  // one exact product, rounded once
    EXPECT_TRUE(dy.padding_untouched());
    EXPECT_ROUNDED_CLOSE(dmod);
    // dgate alone, and dy alone.
    dmod.randn(67), dy.randn(68);
    run_both_bf16([&](Backend& be, bool g) {
      be.gated_residual_backward(Tensor{}, gate(dmod, g), dx.t(g), y.t(g), gate(mod, g));
    });
    EXPECT_ROUNDED_CLOSE(dmod);
    run_both_bf16(
        [&](Backend& be, bool g) { be.gated_residual_backward(dy.t(g), Tensor{}, dx.t(g), Tensor{}, gate(mod, g)); });
    EXPECT_BITS_EQUAL(dy);
    EXPECT_TRUE(dy.padding_untouched());
  }
}

// gated_residual_stats: the gated residual's out (the same bits as gated_residual's) and the
// row statistics of the stored out into a [B, L] window of wider rows (the stream's part of the
// joint sequence's statistics), the padding around it untouched; on the GPU the same bits as
// gated_residual followed by layernorm_modulate's statistics pass over out. H = 45 (pads 3):
// one column a thread; 3072 (Flux, pads 4): groups of 4; 4100: beyond the row kernels, the
// two ops one after the other.
TEST(CudaBf16Ops, GatedResidualStats) {
  FLUX8_REQUIRE_GPU();
  struct Case {
    int64_t L, H, pad;
  };
  for (const Case c : {Case{29, 45, 3}, Case{37, 3072, 4}, Case{9, 4100, 0}}) {
    SCOPED_TRACE(::testing::Message() << "L=" << c.L << " H=" << c.H);
    const int64_t B = 3, L = c.L, H = c.H;
    Bf16Pair x({B, L, H}, c.pad), y({B, L, H}, c.pad), mod({B, 3 * H}), out({B, L, H}, c.pad);
    Pair mean({B, L}, 5), rstd({B, L}, 5);
    x.randn(71, 2.0), y.randn(72), mod.randn(73), out.randn(74), mean.randn(75), rstd.randn(76);
    for (int64_t j = 0; j < H; ++j) x.host.at(1, j) += 50.0f;  // a row with a large mean
    x.up();
    const auto window = [&](const Bf16Pair& p, bool g, int64_t k) { return p.t(g).cols_slice(k * H, H); };
    run_both_bf16([&](Backend& be, bool g) {
      be.gated_residual_stats(out.t(g), mean.t(g), rstd.t(g), x.t(g), y.t(g), window(mod, g, 2), 1e-6);
    });
    EXPECT_BITS_EQUAL(out);  // as gated_residual: one exact product, one rounding
    EXPECT_TRUE(out.padding_untouched());
    EXPECT_F32_CLOSE(mean, kStatistics);
    EXPECT_F32_CLOSE(rstd, kStatistics);
    EXPECT_TRUE(mean.padding_untouched());
    EXPECT_TRUE(rstd.padding_untouched());

    // The two ops on the GPU: the same out, and the same statistics bit for bit.
    Bf16Pair out2({B, L, H}, c.pad);
    Pair mean2({B * L}), rstd2({B * L});
    gpu().gated_residual(out2.dev, x.dev, y.dev, window(mod, true, 2));
    gpu().layernorm_modulate(Tensor{}, mean2.dev, rstd2.dev, out2.dev, window(mod, true, 0), window(mod, true, 1),
                             1e-6);
    EXPECT_EQ(out2.down(), out.down());
    const std::vector<float> m = mean.down(), m2 = mean2.down(), r = rstd.down(), r2 = rstd2.down();
    int64_t differ = 0;
    for (size_t i = 0; i < m.size(); ++i)
      differ += std::memcmp(&m[i], &m2[i], 4) != 0 || std::memcmp(&r[i], &r2[i], 4) != 0;
    EXPECT_EQ(differ, 0) << "rows whose statistics differ from layernorm_modulate's";
  }
  // out may not be x (the statistics are of the stored out, read back); mean must be [B, L].
  Bf16Pair a({2, 3, 8}), b({2, 3, 8}), g({2, 8});
  Pair m({2, 3}), wrong({6});
  EXPECT_THROW(gpu().gated_residual_stats(a.dev, m.dev, m.dev, a.dev, b.dev, g.dev, 1e-6), Error);
  EXPECT_THROW(gpu().gated_residual_stats(a.dev, wrong.dev, wrong.dev, b.dev, b.dev, g.dev, 1e-6), Error);
}

TEST(CudaBf16Ops, TimestepEmbedding) {
  FLUX8_REQUIRE_GPU();
  for (const int64_t dim : {int64_t{256}, int64_t{33}}) {
    SCOPED_TRACE(::testing::Message() << "dim=" << dim);
    Bf16Pair out({4, dim}, 3);
    Pair t({4});
    out.randn(81);
    t.host.mem = {0.0f, 0.25f, 0.999f, 3.5f};
    t.up();
    run_both_bf16([&](Backend& be, bool g) { be.timestep_embedding(out.t(g), t.t(g), 1000.0, 10000.0); });
    // cos/sin in double on both sides (the device's within an ulp of glibc's), rounded to f32 and
    // then to bf16.
    EXPECT_ROUNDED_CLOSE(out);
    EXPECT_TRUE(out.padding_untouched());
  }
}

// Activations of one call share one storage type; parameters and statistics stay f32. Each
// refusal names the op and the offending tensor.
TEST(CudaBf16Ops, MixedTypesAreRefused) {
  FLUX8_REQUIRE_GPU();
  const int64_t B = 2, L = 3, H = 8;
  Bf16Pair a16({B, L, H}), b16({B, L, H}), v16({B, H});
  Pair a32({B, L, H}), v32({B, H}), stat({B * L}), heads32({B, 2, L, 4});
  Bf16Pair stat16({B * L}), t16({B});
  Backend& be = gpu();
  expect_refused("fill_random: tensor 'y'", [&] { be.fill_random(a16.dev, Backend::Random::normal, 1, 2, 1.0); });
  expect_refused("add: tensor 'b'", [&] { be.add(a16.dev, b16.dev, a32.dev); });
  expect_refused("accumulate: tensor 'x'", [&] { be.accumulate(a16.dev, a32.dev); });
  expect_refused("silu: tensor 'x'", [&] { be.silu(a16.dev, a32.dev); });
  expect_refused("silu_backward: tensor 'dy'", [&] { be.silu_backward(a16.dev, a32.dev, b16.dev, false); });
  expect_refused("gelu_tanh: tensor 'x'", [&] { be.gelu_tanh(a16.dev, a32.dev); });
  expect_refused("gelu_tanh_backward: tensor 'x'", [&] { be.gelu_tanh_backward(a16.dev, b16.dev, a32.dev); });
  expect_refused("layernorm_modulate: tensor 'shift'",
                 [&] { be.layernorm_modulate(a16.dev, stat.dev, stat.dev, b16.dev, v32.dev, v16.dev, 1e-6); });
  expect_refused("layernorm_modulate: tensor 'mean'",
                 [&] { be.layernorm_modulate(a16.dev, stat16.dev, stat.dev, b16.dev, v16.dev, v16.dev, 1e-6); });
  expect_refused("layernorm_modulate_backward: tensor 'scale'", [&] {
    be.layernorm_modulate_backward(a16.dev, v16.dev, v16.dev, b16.dev, a16.dev, stat.dev, stat.dev, v32.dev, false);
  });
  expect_refused("layernorm_modulate_backward: tensor 'rstd'", [&] {
    be.layernorm_modulate_backward(a16.dev, v16.dev, v16.dev, b16.dev, a16.dev, stat.dev, stat16.dev, v16.dev, false);
  });
  expect_refused("tokens_to_heads: tokens", [&] { be.tokens_to_heads(heads32.dev, a16.dev, 0); });
  expect_refused("heads_to_tokens: tokens", [&] { be.heads_to_tokens(a16.dev, heads32.dev, 0); });
  expect_refused("concat_tokens: tensor 'b'", [&] { be.concat_tokens(a16.dev, b16.dev, a32.dev); });
  expect_refused("split_tokens: tensor 'in'", [&] { be.split_tokens(a16.dev, Tensor{}, a32.dev); });
  expect_refused("gated_residual: tensor 'gate'", [&] { be.gated_residual(a16.dev, a16.dev, b16.dev, v32.dev); });
  expect_refused("gated_residual_backward: tensor 'y'",
                 [&] { be.gated_residual_backward(a16.dev, v16.dev, b16.dev, a32.dev, v16.dev); });
  expect_refused("timestep_embedding: tensor 't'", [&] { be.timestep_embedding(v16.dev, t16.dev, 1.0, 1e4); });
  // Nothing was written by the refused calls.
  EXPECT_EQ(bf16_mismatches(a16), 0);
}

}  // namespace
}  // namespace flux8::testing
