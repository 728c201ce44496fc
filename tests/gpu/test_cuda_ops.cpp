// Every CUDA op of the op interface against the CPU backend on random data, with odd shapes and
// strided (column-window) tensors. Tolerances, as ‖gpu − cpu‖₂/‖cpu‖₂:
// - data movement (copy, layout, concat/split): exact (0);
// - elementwise f32 ops: the same formula in f32, but the device's expf/tanhf may differ from
//   glibc's by an ulp or two: 1e-6;
// - row statistics and column sums: both sides accumulate in double, then round to f32: 1e-6;
// - f32 GEMMs (cuBLASLt, fp32 compute, no TF32) vs OpenBLAS: only the summation order differs,
//   error ~ √K·2⁻²⁴ relative: 1e-5;
// - the objective noise: Philox bits are identical, but logf/cosf/sqrtf on the device are not
//   glibc's: 1e-6.
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/gemm.h"
#include "core/error.h"
#include "gpu_test_util.h"

namespace flux8::testing {
namespace {

constexpr double kExact = 0.0, kElementwise = 1e-6, kReduce = 1e-6, kGemm = 1e-5;

cuda::Gemm& gemm_of(Backend& be) { return dynamic_cast<CudaBackend&>(be).gemm(); }

#define EXPECT_CLOSE(pair, tol) EXPECT_LE(gpu_vs_cpu(pair), tol) << #pair

// upload() of a large buffer goes through two pinned chunks (the copy of one overlapping the
// transfer of the other): every byte arrives, at its place, for sizes around and between the
// chunk boundaries (8 MiB), and a small upload takes the direct path.
TEST(CudaOps, UploadsArriveWholeThroughThePinnedChunks) {
  FLUX8_REQUIRE_GPU();
  Backend& be = gpu();
  for (const size_t bytes :
       {size_t(100), size_t(4) << 20, (size_t(8) << 20) - 1, (size_t(16) << 20) + 1, size_t(27'000'003)}) {
    SCOPED_TRACE(bytes);
    std::vector<uint8_t> host(bytes), back(bytes);
    uint64_t x = 0x9e3779b97f4a7c15ull ^ bytes;
    for (uint8_t& b : host) x = x * 6364136223846793005ull + 1442695040888963407ull, b = static_cast<uint8_t>(x >> 56);
    void* dev = be.allocate(bytes);
    be.upload(dev, host.data(), bytes);
    be.download(back.data(), dev, bytes);
    EXPECT_TRUE(host == back);
    be.release(dev);
  }
}

TEST(CudaOps, FillCopyAddAccumulate) {
  FLUX8_REQUIRE_GPU();
  Pair y({37, 53}, 3), a({37, 53}, 5), b({37, 53});
  y.randn(1), a.randn(2), b.randn(3);
  run_both([&](Backend& be, bool g) { be.copy(y.t(g), a.t(g)); });
  EXPECT_CLOSE(y, kExact);
  EXPECT_TRUE(y.padding_untouched());
  run_both([&](Backend& be, bool g) { be.add(y.t(g), a.t(g), b.t(g)); });
  EXPECT_CLOSE(y, kExact);
  run_both([&](Backend& be, bool g) { be.accumulate(y.t(g), b.t(g)); });
  EXPECT_CLOSE(y, kExact);
  run_both([&](Backend& be, bool g) { be.fill(y.t(g), -2.5); });
  EXPECT_CLOSE(y, kExact);
  EXPECT_TRUE(y.padding_untouched());
  // Contiguous tensors take flat paths (fills of 0 are memsets).
  Pair c({37, 53}), d({37, 53});
  c.randn(4), d.randn(5);
  run_both([&](Backend& be, bool g) { be.add(c.t(g), d.t(g), b.t(g)); });
  EXPECT_CLOSE(c, kExact);
  run_both([&](Backend& be, bool g) { be.accumulate(c.t(g), d.t(g)); });
  EXPECT_CLOSE(c, kExact);
  for (const double v : {-2.5, 0.0, -0.0}) {
    run_both([&](Backend& be, bool g) { be.fill(c.t(g), v); });
    EXPECT_CLOSE(c, kExact);
    for (const float e : c.down()) ASSERT_EQ(std::signbit(e), std::signbit(v)) << v;  // -0.0 is not a memset
  }
}

TEST(CudaOps, LinearForwardAndBackward) {
  FLUX8_REQUIRE_GPU();
  // 601 rows: the bias gradient's column sums span several row chunks (a partial one last).
  for (const auto [N, K, M] : {std::array<int64_t, 3>{67, 45, 29}, {128, 256, 96}, {1, 7, 3}, {601, 45, 29}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " K=" << K << " M=" << M);
    Pair x({N, K}, 3), w({M, K}), b({M}), y({N, M}, 5);
    x.randn(11), w.randn(12, 0.2), b.randn(13), y.randn(14);
    run_both([&](Backend& be, bool g) { be.linear(y.t(g), x.t(g), w.t(g), b.t(g)); });
    EXPECT_CLOSE(y, kGemm);
    EXPECT_TRUE(y.padding_untouched());
    run_both([&](Backend& be, bool g) { be.linear(y.t(g), x.t(g), w.t(g), Tensor{}); });
    EXPECT_CLOSE(y, kGemm);

    Pair dy({N, M}, 2), dx({N, K}, 4), dw({M, K}), db({M});
    dy.randn(15), dx.randn(16), dw.randn(17), db.randn(18);
    for (bool acc : {false, true}) {
      run_both([&](Backend& be, bool g) {
        be.linear_backward(dx.t(g), dw.t(g), db.t(g), dy.t(g), x.t(g), w.t(g), acc, acc);
      });
      EXPECT_CLOSE(dx, kGemm);
      EXPECT_CLOSE(dw, kGemm);
      EXPECT_CLOSE(db, kReduce);
      EXPECT_TRUE(dx.padding_untouched());
    }
  }
}

// bf16 GEMM mode: both operands rounded to bf16 (relative error ≤ 2⁻⁹ each, random signs), fp32
// accumulation, so ‖error‖/‖y‖ ≈ √2·2⁻⁹/√3 ≈ 1.6e-3 on random data: 5e-3. Memory is device
// memory either way, so the same Pairs serve both backends.
TEST(CudaOps, LinearBf16Gemm) {
  FLUX8_REQUIRE_GPU();
  Backend& bf = gpu_bf16_gemm();
  const int64_t N = 67, K = 45, M = 29;
  Pair x({N, K}, 3), w({M, K}), b({M}), y({N, M}, 5), dy({N, M}, 2), dx({N, K}, 4), dw({M, K}), db({M});
  x.randn(11), w.randn(12, 0.2), b.randn(13), y.randn(14), dy.randn(15), dx.randn(16), dw.fill(0.0f), db.fill(0.0f);
  cpu().linear(y.host.t, x.host.t, w.host.t, b.host.t);
  bf.linear(y.dev, x.dev, w.dev, b.dev);
  // bf runs on its own stream; Pair reads back through gpu()'s: wait for bf first.
  bf.synchronize();
  EXPECT_CLOSE(y, 5e-3);
  EXPECT_GT(gpu_vs_cpu(y), 1e-6) << "the bf16 path should round its operands";
  EXPECT_TRUE(y.padding_untouched());
  cpu().linear_backward(dx.host.t, dw.host.t, db.host.t, dy.host.t, x.host.t, w.host.t, true, true);
  bf.linear_backward(dx.dev, dw.dev, db.dev, dy.dev, x.dev, w.dev, true, true);
  bf.synchronize();
  EXPECT_CLOSE(dx, 5e-3);
  EXPECT_CLOSE(dw, 5e-3);
  EXPECT_CLOSE(db, kReduce);  // the bias gradient is a column sum of dy in f32, not a GEMM
}

// Activations in bf16 storage (x, y, dx, dy bf16; w, b, dw, db f32) against the CPU backend
// that rounds its activation outputs to bf16. x and dy are bf16 values on both sides; the GPU
// also rounds w to bf16 (~2⁻⁹ relative per element, as LinearBf16Gemm) and its outputs once
// from the fp32 sum: 5e-3 as there. Shapes: odd (cuBLASLt's unaligned kernels; x, y, dx are
// column windows) and aligned; with and without bias; dx accumulated in bf16.
TEST(CudaOps, LinearBf16Activations) {
  FLUX8_REQUIRE_GPU();
  // {2, 64, 128}: a modulation Linear of two samples; its dw GEMM (k = 2 rows) is one cuBLASLt
  // offers an algorithm for and then refuses to run on an H200 (the plain-kernel fallback).
  for (const auto [N, K, M, pad] :
       {std::array<int64_t, 4>{67, 45, 29, 3}, {128, 256, 96, 8}, {1, 7, 3, 0}, {2, 64, 128, 0}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " K=" << K << " M=" << M);
    Bf16Pair x({N, K}, pad), y({N, M}, pad + 2), dy({N, M}, pad), dx({N, K}, pad + 1);
    Pair w({M, K}), b({M}), dw({M, K}), db({M});
    x.randn(11), w.randn(12, 0.2), b.randn(13), y.randn(14), dy.randn(15), dx.randn(16), dw.randn(17), db.randn(18);
    for (const bool bias : {true, false}) {
      const int64_t before = gemm_of(gpu()).runs_with_bias();
      run_both_bf16([&](Backend& be, bool g) { be.linear(y.t(g), x.t(g), w.t(g), bias ? b.t(g) : Tensor{}); });
      // Aligned operands: the bias added in cuBLASLt's epilogue, not by a kernel after the GEMM.
      if (bias && pad % 8 == 0 && K % 8 == 0 && M % 8 == 0 && N >= 128)
        EXPECT_EQ(gemm_of(gpu()).runs_with_bias() - before, 1) << "the bias epilogue did not run";
      EXPECT_LE(gpu_vs_cpu(y), 5e-3) << "bias " << bias;
      EXPECT_TRUE(y.padding_untouched());
    }
    for (const bool acc : {false, true}) {
      run_both_bf16([&](Backend& be, bool g) {
        be.linear_backward(dx.t(g), dw.t(g), db.t(g), dy.t(g), x.t(g), w.t(g), acc, acc);
      });
      EXPECT_LE(gpu_vs_cpu(dx), 5e-3) << "accumulate " << acc;
      EXPECT_CLOSE(dw, 5e-3);
      EXPECT_CLOSE(db, kReduce);  // column sums of the same bf16 dy values, in double on both sides
      EXPECT_TRUE(dx.padding_untouched());
    }
  }
  // f32 weights with bf16 activations only: mixing activation types is an error naming the op.
  Bf16Pair x({4, 8});
  Pair y({4, 3}), w({3, 8});
  EXPECT_THROW(gpu().linear(y.dev, x.dev, w.dev, Tensor{}), Error);
}

// linear_gelu against the CPU twin (bf16 rounding, f32 weights: 5e-3 as LinearBf16Activations).
// Aligned shapes run the GELU in cuBLASLt's epilogue (GELU_AUX(_BIAS), counted by the Gemm); odd
// ones (unaligned leading dimensions) take the Linear + GELU kernels. Both y and the kept h are
// checked, for a GELU over all columns and over the last ones (the single block's linear1).
TEST(CudaOps, LinearGeluBf16Activations) {
  FLUX8_REQUIRE_GPU();
  struct Case {
    int64_t N, K, M, My, pad;
    bool epilogue;
  };
  for (const Case c : {Case{128, 256, 160, 160, 8, true}, Case{128, 256, 160, 96, 8, true},
                       Case{67, 45, 29, 13, 3, false}, Case{67, 45, 29, 29, 0, false}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " K=" << c.K << " M=" << c.M << " GELU over " << c.My);
    Bf16Pair x({c.N, c.K}, c.pad), y({c.N, c.My}, c.pad + 8), h({c.N, c.M}, c.pad);
    Pair w({c.M, c.K}), b({c.M});
    x.randn(11), w.randn(12, 0.2), b.randn(13), y.randn(14), h.randn(15);
    for (const bool bias : {true, false}) {
      const int64_t before = gemm_of(gpu()).runs_with(cuda::Epilogue::gelu_aux);
      run_both_bf16(
          [&](Backend& be, bool g) { be.linear_gelu(y.t(g), h.t(g), x.t(g), w.t(g), bias ? b.t(g) : Tensor{}); });
      const int64_t fused = gemm_of(gpu()).runs_with(cuda::Epilogue::gelu_aux) - before;
      EXPECT_EQ(fused, c.epilogue ? 1 : 0) << "bias " << bias;
      EXPECT_LE(gpu_vs_cpu(h), 5e-3) << "bias " << bias;
      EXPECT_LE(gpu_vs_cpu(y), 5e-3) << "bias " << bias;
      EXPECT_GT(rel_l2(y.down(), std::vector<float>(y.down().size(), 0.0f)), 0.1) << "y must be written";
      EXPECT_TRUE(y.padding_untouched());
      EXPECT_TRUE(h.padding_untouched());
    }
  }
}

// linear_dgrad_gelu against the CPU twin: dh through GELU's derivative (DGELU epilogue on aligned
// shapes, counted), dx of the plain columns before it (the single block's attention part).
TEST(CudaOps, LinearDgradGeluBf16Activations) {
  FLUX8_REQUIRE_GPU();
  struct Case {
    int64_t N, K, M, Kh, pad;
    bool epilogue;
  };
  for (const Case c :
       {Case{128, 160, 256, 160, 8, true}, Case{128, 160, 256, 96, 8, true}, Case{67, 29, 45, 13, 3, false}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " K=" << c.K << " M=" << c.M << " GELU over " << c.Kh);
    const int64_t K0 = c.K - c.Kh;
    Bf16Pair dy({c.N, c.M}, c.pad), h({c.N, c.Kh}, c.pad), dh({c.N, c.Kh}, c.pad + 8),
        dx({c.N, std::max<int64_t>(K0, 1)}, c.pad);
    Pair w({c.M, c.K});
    dy.randn(21), h.randn(22, 2.0), w.randn(23, 0.2), dh.randn(24), dx.randn(25);
    const int64_t before = gemm_of(gpu()).runs_with(cuda::Epilogue::dgelu);
    run_both_bf16(
        [&](Backend& be, bool g) { be.linear_dgrad_gelu(K0 ? dx.t(g) : Tensor{}, dh.t(g), dy.t(g), w.t(g), h.t(g)); });
    EXPECT_EQ(gemm_of(gpu()).runs_with(cuda::Epilogue::dgelu) - before, c.epilogue ? 1 : 0);
    EXPECT_LE(gpu_vs_cpu(dh), 5e-3);
    EXPECT_TRUE(dh.padding_untouched());
    if (K0) {
      EXPECT_LE(gpu_vs_cpu(dx), 5e-3);
      EXPECT_TRUE(dx.padding_untouched());
    }
  }
}

// A weight already in bf16 (Backend::weight_operand_dtype: the model's per-step copy,
// ParamStore::operand) gives bit for bit what its f32 original gives, which the GEMM rounds to
// the same bf16 values; with f32 GEMM operands a bf16 weight is refused, naming it.
TEST(CudaOps, LinearBf16WeightOperand) {
  FLUX8_REQUIRE_GPU();
  Backend& bf = gpu_bf16_activations();
  ASSERT_EQ(bf.weight_operand_dtype(DType::f32), DType::bf16);
  const int64_t N = 67, K = 45, M = 29;
  Bf16Pair x({N, K}, 3), y1({N, M}), y2({N, M}), dy({N, M}), dx1({N, K}), dx2({N, K}), w16({M, K});
  Pair w({M, K}), b({M}), dw({M, K}), db({M});
  x.randn(11), w.randn(12, 0.2), b.randn(13), dy.randn(15);
  w16.host.mem = w.host.mem;
  w16.up();  // rounds to bf16 on the way up, as the GEMM's conversion does
  bf.linear(y1.dev, x.dev, w.dev, b.dev);
  bf.linear(y2.dev, x.dev, w16.dev, b.dev);
  bf.linear_backward(dx1.dev, dw.dev, db.dev, dy.dev, x.dev, w.dev, false, false);
  bf.linear_backward(dx2.dev, Tensor{}, Tensor{}, dy.dev, x.dev, w16.dev, false, false);
  bf.synchronize();
  EXPECT_EQ(y2.all_bits(), y1.all_bits());
  EXPECT_EQ(dx2.all_bits(), dx1.all_bits());
  Pair x32({N, K}), y32({N, M});
  try {
    gpu().linear(y32.dev, x32.dev, w16.dev, Tensor{});
    FAIL() << "expected a refusal of the bf16 weight";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("linear: weight 'w' is bf16"), std::string::npos) << e.what();
  }
}

// A Linear's bias as the bf16 copy a model keeps (ParamStore::bias_operand): into a bf16 output
// the same bits as an f32 bias of the same (rounded) values, and where cuBLASLt's epilogue adds
// the bias (which rounds an f32 bias to bf16 itself) the same as the unrounded f32 bias — for
// linear (also with the copy at an address cuBLASLt is not handed: realigned) and linear_gelu
// fused and unfused. An f32 output refuses a bf16 bias, naming it.
TEST(CudaOps, LinearBf16BiasOperand) {
  FLUX8_REQUIRE_GPU();
  Backend& bf = gpu_bf16_activations();
  const int64_t N = 67, K = 48, M = 40;
  Bf16Pair x({N, K}, 8), y1({N, M}), y2({N, M}), y3({N, M}), bias16({M});
  Pair w({M, K}), b({M}), b_rounded({M});
  x.randn(21), w.randn(22, 0.2), b.randn(23);
  bias16.host.mem = b.host.mem;
  bias16.up();  // rounds to nearest even, as AdamW writes the copy (the host values too)
  b_rounded.host.mem = bias16.host.mem;
  b_rounded.up();
  // The same copy one element on: 2-byte aligned.
  Bf16Pair shifted({M + 1});
  shifted.host.mem.assign(shifted.host.mem.size(), 0.0f);
  std::copy(bias16.host.mem.begin(), bias16.host.mem.end(), shifted.host.mem.begin() + 1);
  shifted.up();
  const Tensor bias16_odd(static_cast<char*>(shifted.dev.data) + 2, DType::bf16, Shape{M});

  const int64_t before = gemm_of(bf).runs_with_bias();
  bf.linear(y1.dev, x.dev, w.dev, b.dev);
  const int64_t after_f32 = gemm_of(bf).runs_with_bias();
  bf.linear(y2.dev, x.dev, w.dev, bias16.dev);
  const bool epilogue = after_f32 - before == 1;
  EXPECT_EQ(gemm_of(bf).runs_with_bias() - after_f32, after_f32 - before)
      << "the bf16 bias goes into the epilogue where the f32 one does";
  bf.linear(y3.dev, x.dev, w.dev, b_rounded.dev);
  bf.synchronize();  // (the test reads through gpu()'s stream)
  EXPECT_EQ(y2.all_bits(), y3.all_bits());
  if (epilogue) EXPECT_EQ(y2.all_bits(), y1.all_bits()) << "cuBLASLt rounds the f32 bias to bf16";
  y2.fill(0.0f);
  bf.linear(y2.dev, x.dev, w.dev, bias16_odd);
  bf.synchronize();
  EXPECT_EQ(y2.all_bits(), y3.all_bits()) << "the 2-byte aligned bias";
  // linear_gelu: the GELU over all columns (fused where aligned) and over the last 37 (unfused).
  for (const int64_t My : {M, int64_t{37}}) {
    SCOPED_TRACE(::testing::Message() << "GELU over " << My);
    Bf16Pair g1({N, My}), g2({N, My}), h1({N, M}), h2({N, M});
    bf.linear_gelu(g1.dev, h1.dev, x.dev, w.dev, b_rounded.dev);
    bf.linear_gelu(g2.dev, h2.dev, x.dev, w.dev, bias16.dev);
    bf.synchronize();
    EXPECT_EQ(g2.all_bits(), g1.all_bits());
    EXPECT_EQ(h2.all_bits(), h1.all_bits());
  }
  Pair x32({N, K}), y32({N, M});
  expect_refused("linear: bias 'b' is bf16", [&] { gpu().linear(y32.dev, x32.dev, w.dev, bias16.dev); });
}

TEST(CudaOps, Activations) {
  FLUX8_REQUIRE_GPU();
  // 77 columns: element by element; 76 with row strides of multiples of 4: four per thread.
  for (const auto [cols, pad] : {std::array<int64_t, 2>{77, 3}, {76, 4}}) {
    SCOPED_TRACE(::testing::Message() << "cols=" << cols);
    Pair x({41, cols}, pad), y({41, cols}, pad), dy({41, cols}, 2 * pad), dx({41, cols}, pad);
    x.randn(21, 3.0), y.randn(22), dy.randn(23), dx.randn(24);
    run_both([&](Backend& be, bool g) { be.silu(y.t(g), x.t(g)); });
    EXPECT_CLOSE(y, kElementwise);
    for (bool acc : {false, true}) {
      run_both([&](Backend& be, bool g) { be.silu_backward(dx.t(g), dy.t(g), x.t(g), acc); });
      EXPECT_CLOSE(dx, kElementwise);
    }
    run_both([&](Backend& be, bool g) { be.gelu_tanh(y.t(g), x.t(g)); });
    EXPECT_CLOSE(y, kElementwise);
    run_both([&](Backend& be, bool g) { be.gelu_tanh_backward(dx.t(g), dy.t(g), x.t(g)); });
    EXPECT_CLOSE(dx, kElementwise);
    EXPECT_TRUE(dx.padding_untouched());
  }
}

TEST(CudaOps, LayerNormModulate) {
  FLUX8_REQUIRE_GPU();
  // L = 300: dshift/dscale sum 3 samples x 75 row chunks (4 rows each) of the one-pass backward
  // (several groups and chunks at once). With padded strides (not multiples of 4) H picks the
  // one-column variants: 203 (256 threads, 1 column each), 1500 (512 threads x 3 of 4), 3072
  // (Flux: 512 x 6), 4100 (beyond 4096: the row-loop forward and three-pass backward). Unpadded
  // rows of 256 and 3072 take the 4-column groups and the staged backward (cp.async two pairs
  // of rows ahead): 1200 rows give 5 a block (two pairs and a single row), 1536 give 6.
  for (const auto [L, H, pad] : {std::array<int64_t, 3>{37, 203, 2},
                                 {300, 203, 2},
                                 {33, 1500, 2},
                                 {40, 3072, 2},
                                 {9, 4100, 2},
                                 {400, 256, 0},
                                 {512, 3072, 0}}) {
    SCOPED_TRACE(::testing::Message() << "L=" << L << " H=" << H << " pad=" << pad);
    const int64_t B = 3;
    Pair x({B, L, H}, pad), y({B, L, H}, pad ? 1 : 0), mean({B * L}), rstd({B * L});
    Pair mod({B, 6 * H});  // shift and scale are column windows of one modulation output
    x.randn(31, 2.0), mod.randn(32, 0.5), y.randn(33);
    // A large row mean, as the residual stream has: the two-pass variance must hold up.
    for (int64_t c = 0; c < H; ++c) x.host.at(0, c) += 100.0f;
    x.up();
    auto window = [&](bool g, int64_t k) { return mod.t(g).cols_slice(k * H, H); };
    run_both([&](Backend& be, bool g) {
      be.layernorm_modulate(y.t(g), mean.t(g), rstd.t(g), x.t(g), window(g, 0), window(g, 1), 1e-6);
    });
    EXPECT_CLOSE(y, kReduce);
    EXPECT_CLOSE(mean, kReduce);
    EXPECT_CLOSE(rstd, kReduce);

    Pair dy({B, L, H}, pad ? 3 : 0), dx({B, L, H}), dmod({B, 6 * H});
    dy.randn(34), dx.randn(35), dmod.randn(36);
    for (bool acc : {false, true}) {
      run_both([&](Backend& be, bool g) {
        be.layernorm_modulate_backward(dx.t(g), dmod.t(g).cols_slice(0, H), dmod.t(g).cols_slice(H, H), dy.t(g), x.t(g),
                                       mean.t(g), rstd.t(g), window(g, 1), acc);
      });
      // dx = rstd·(g − mean g − x̂·mean(g x̂)) cancels: a few ulps of the f32 inputs, relative.
      EXPECT_CLOSE(dx, 1e-5);
      EXPECT_CLOSE(dmod, kReduce);
    }
  }
}

TEST(CudaOps, RmsNormHeads) {
  FLUX8_REQUIRE_GPU();
  // rows x heads = 3003 segments: dscale's column sums span several row chunks.
  for (const auto [D, rows] : {std::array<int64_t, 2>{24, 53}, {128, 53}, {128, 1001}}) {
    SCOPED_TRACE(::testing::Message() << "D=" << D << " rows=" << rows);
    const int64_t n = 3;
    Pair x({rows, n * D}, 7), y({rows, n * D}, 1), rstd({rows * n}), scale({D});
    x.randn(41, 1.5), scale.randn(42), y.randn(43);
    run_both([&](Backend& be, bool g) { be.rmsnorm_heads(y.t(g), rstd.t(g), x.t(g), scale.t(g), 1e-6); });
    EXPECT_CLOSE(y, kReduce);
    EXPECT_CLOSE(rstd, kReduce);
    Pair dy({rows, n * D}, 2), dx({rows, n * D}, 3), dscale({D});
    dy.randn(44), dx.randn(45), dscale.randn(46);
    run_both([&](Backend& be, bool g) {
      be.rmsnorm_heads_backward(dx.t(g), dscale.t(g), dy.t(g), x.t(g), rstd.t(g), scale.t(g));
    });
    EXPECT_CLOSE(dx, 1e-5);
    EXPECT_CLOSE(dscale, kReduce);
  }
}

TEST(CudaOps, LayoutAndJointSequence) {
  FLUX8_REQUIRE_GPU();
  // D = 8: rows of whole float4s where the strides allow (16-byte moves; `a`'s pad of 2 keeps
  // one scalar path); D = 16: 8-element moves where rows are aligned to 8 (txt, b, the heads,
  // the joint sequence); D = 6: every copy element by element.
  for (const int64_t D : {int64_t{8}, int64_t{16}, int64_t{6}}) {
    SCOPED_TRACE(::testing::Message() << "D=" << D);
    const int64_t B = 2, n = 3, Lt = 5, Li = 11;
    Pair heads({B, n, Lt + Li, D}), img({B, Li, n * D}, 4), txt({B, Lt, n * D});
    heads.randn(51), img.randn(52), txt.randn(53);
    run_both([&](Backend& be, bool g) {
      be.tokens_to_heads(heads.t(g), txt.t(g), 0);
      be.tokens_to_heads(heads.t(g), img.t(g), Lt);
    });
    EXPECT_CLOSE(heads, kExact);
    img.randn(54);
    run_both([&](Backend& be, bool g) { be.heads_to_tokens(img.t(g), heads.t(g), Lt); });
    EXPECT_CLOSE(img, kExact);
    EXPECT_TRUE(img.padding_untouched());

    Pair joint({B, Lt + Li, n * D}), a({B, Lt, n * D}, 2), b({B, Li, n * D});
    joint.randn(55), a.randn(56), b.randn(57);
    run_both([&](Backend& be, bool g) { be.concat_tokens(joint.t(g), a.t(g), b.t(g)); });
    EXPECT_CLOSE(joint, kExact);
    joint.randn(58);
    run_both([&](Backend& be, bool g) { be.split_tokens(a.t(g), b.t(g), joint.t(g)); });
    EXPECT_CLOSE(a, kExact);
    EXPECT_CLOSE(b, kExact);
    b.randn(59);
    run_both([&](Backend& be, bool g) { be.split_tokens(Tensor{}, b.t(g), joint.t(g)); });
    EXPECT_CLOSE(b, kExact);
  }
}

TEST(CudaOps, GatedResidual) {
  FLUX8_REQUIRE_GPU();
  // H = 45, pad 3: element by element; H = 48, pad 8: rows of whole float4s.
  for (const auto& [H, pad] : {std::pair<int64_t, int64_t>{45, 3}, std::pair<int64_t, int64_t>{48, 8}}) {
    SCOPED_TRACE(::testing::Message() << "H=" << H);
    const int64_t B = 3, L = 29;
    Pair x({B, L, H}, pad), y({B, L, H}), mod({B, 3 * H}), dx({B, L, H}), dy({B, L, H}, 2), dmod({B, 3 * H});
    x.randn(61), y.randn(62), mod.randn(63), dx.randn(64), dy.randn(65), dmod.randn(66);
    Pair out({B, L, H}, 2 * pad);  // out of place (another row stride), then in place
    out.randn(60);
    run_both([&](Backend& be, bool g) { be.gated_residual(out.t(g), x.t(g), y.t(g), mod.t(g).cols_slice(H, H)); });
    EXPECT_CLOSE(out, kElementwise);
    run_both([&](Backend& be, bool g) { be.gated_residual(x.t(g), x.t(g), y.t(g), mod.t(g).cols_slice(H, H)); });
    EXPECT_CLOSE(x, kElementwise);
    run_both([&](Backend& be, bool g) {
      be.gated_residual_backward(dy.t(g), dmod.t(g).cols_slice(2 * H, H), dx.t(g), y.t(g), mod.t(g).cols_slice(H, H));
    });
    EXPECT_CLOSE(dy, kElementwise);
    EXPECT_CLOSE(dmod, kReduce);
  }
}

TEST(CudaOps, RopeTableAndRotation) {
  FLUX8_REQUIRE_GPU();
  const int64_t B = 2, L = 19, n = 3;
  const std::array<int, 3> axes{4, 6, 6};
  const int64_t D = 16;
  Pair ids({B, L, 3}), pe({B, L, D / 2, 2}), x({B, n, L, D});
  for (size_t i = 0; i < ids.host.mem.size(); ++i) ids.host.mem[i] = static_cast<float>((i * 7) % 23);
  ids.up();
  pe.randn(71), x.randn(72);
  run_both([&](Backend& be, bool g) { be.rope_table(pe.t(g), ids.t(g), axes, 10000.0); });
  // Angles in double on both sides, then sin/cos in double: equal to f32 rounding.
  EXPECT_CLOSE(pe, 1e-7);
  for (bool inverse : {false, true}) {
    run_both([&](Backend& be, bool g) { be.rope(x.t(g), pe.t(g), inverse); });
    EXPECT_CLOSE(x, kElementwise);
  }
}

// QK-norm + RoPE + head layout, fused, against the CPU backend (the composition of the unfused
// ops). Per shape: two streams (text at offset 0, image at Lt) of one joint sequence, q/k/v as
// column windows of a padded [Q|K|V] row (pad 2: 8-byte row starts, pairs move as float2; pad
// 1: odd row strides, element by element); D = 6 (3 pairs: most lanes idle), 128 (Flux), 200
// (4 pairs a lane, the last partly used); up to 3·1001·24 = 72k segments, so the backward's
// dscale spans many chunks (the last partial) and chunks longer than 256 segments.
// Rows aligned to 8 elements (pad 0) with D = 8·2^k take the vector path (16-byte accesses, a
// group of D/8 lanes per segment: 16 at Flux's 128, 2 at D = 16), the others the pair path;
// the backend's counter says which ran. Tolerances, ‖gpu − cpu‖₂/‖cpu‖₂: q, k, rstd: rstd comes from a double sum of
// squares rounded once to f32 (another summation order may round it an ulp apart), then f32 products and a rotation the
// device contracts into FMAs: a few ulps, kReduce (1e-6). v, dv: copies, exact. d[Q|K]: rmsnorm_heads_backward's
// cancellation, as in RmsNormHeads: 1e-5. dscale: double sums of the same f32 products up to the rotation's ulps:
// kReduce. A wrong index, pair or term gives errors of order 1.
TEST(CudaOps, QkNormRopeToHeads) {
  FLUX8_REQUIRE_GPU();
  struct Case {
    int64_t D, n, Li, pad;
  };
  const auto vector_calls = [] { return dynamic_cast<CudaBackend&>(gpu()).qk_norm_rope_vector_calls(); };
  for (const Case c : {Case{6, 3, 11, 2}, Case{128, 3, 37, 1}, Case{200, 3, 301, 2}, Case{128, 24, 1001, 2},
                       Case{128, 3, 37, 0}, Case{16, 2, 13, 0}, Case{128, 24, 1001, 0}}) {
    SCOPED_TRACE(::testing::Message() << "D=" << c.D << " n=" << c.n << " Li=" << c.Li << " pad=" << c.pad);
    const int64_t B = 3, Lt = 5, L = Lt + c.Li, D = c.D, n = c.n, H = n * D;
    const Shape heads{B, n, L, D};
    Pair pe({B, L, D / 2, 2}), q_scale({D}), k_scale({D}), txt({B, Lt, 3 * H}, c.pad), img({B, c.Li, 3 * H}, c.pad);
    Pair qh(heads), kh(heads), vh(heads);
    Pair q_rstd_txt({B * Lt * n}), k_rstd_txt({B * Lt * n}), q_rstd_img({B * c.Li * n}), k_rstd_img({B * c.Li * n});
    pe.randn(101), q_scale.randn(102), k_scale.randn(103), txt.randn(104, 2.0), img.randn(105, 2.0);
    qh.randn(106), kh.randn(107), vh.randn(108);
    struct Stream {
      Pair &qkv, &q_rstd, &k_rstd;
      int64_t offset;
    };
    const Stream streams[2] = {{txt, q_rstd_txt, k_rstd_txt, 0}, {img, q_rstd_img, k_rstd_img, Lt}};
    const auto window = [&](const Pair& p, bool g, int64_t i) { return p.t(g).cols_slice(i * H, H); };
    const auto forward = [&](Backend& be, bool g, Pair& q_out, Pair& k_out, Pair& v_out, bool stats) {
      for (const Stream& s : streams)
        be.qk_norm_rope_to_heads(q_out.t(g), k_out.t(g), v_out.t(g), stats ? s.q_rstd.t(g) : Tensor{},
                                 stats ? s.k_rstd.t(g) : Tensor{}, window(s.qkv, g, 0), window(s.qkv, g, 1),
                                 window(s.qkv, g, 2), q_scale.t(g), k_scale.t(g), pe.t(g), s.offset, 1e-6);
    };
    const bool vector_path = c.pad == 0;  // every D here with pad 0 is 8·2^k
    const int64_t calls_before = vector_calls();
    run_both([&](Backend& be, bool g) { forward(be, g, qh, kh, vh, true); });
    EXPECT_EQ(vector_calls() - calls_before, vector_path ? 2 : 0) << "forward path";
    EXPECT_CLOSE(qh, kReduce);
    EXPECT_CLOSE(kh, kReduce);
    EXPECT_CLOSE(vh, kExact);
    for (const Stream& s : streams) {
      EXPECT_CLOSE(s.q_rstd, kReduce);
      EXPECT_CLOSE(s.k_rstd, kReduce);
    }
    // Statistics not saved (recomputation): the same heads.
    Pair qh2(heads), kh2(heads), vh2(heads);
    forward(gpu(), true, qh2, kh2, vh2, false);
    EXPECT_EQ(qh2.down(), qh.down());
    EXPECT_EQ(kh2.down(), kh.down());
    EXPECT_EQ(vh2.down(), vh.down());

    // The backward on both sides from the CPU's statistics, so only the backward is compared.
    for (const Stream& s : streams) s.q_rstd.up(), s.k_rstd.up();
    Pair dqh(heads), dkh(heads), dvh(heads), dq_scale({D}), dk_scale({D});
    Pair dtxt({B, Lt, 3 * H}, c.pad), dimg({B, c.Li, 3 * H}, c.pad);
    dqh.randn(111), dkh.randn(112), dvh.randn(113), dq_scale.randn(114), dk_scale.randn(115);
    dtxt.randn(116), dimg.randn(117);  // garbage to overwrite; the scale gradients accumulate
    const std::vector<float> dq_scale0 = dq_scale.host.mem, dk_scale0 = dk_scale.host.mem;
    Pair* grads[2] = {&dtxt, &dimg};
    const auto backward = [&](Backend& be, bool g) {
      for (int i = 0; i < 2; ++i) {
        const Stream& s = streams[i];
        be.qk_norm_rope_to_heads_backward(window(*grads[i], g, 0), window(*grads[i], g, 1), window(*grads[i], g, 2),
                                          dq_scale.t(g), dk_scale.t(g), dqh.t(g), dkh.t(g), dvh.t(g),
                                          window(s.qkv, g, 0), window(s.qkv, g, 1), s.q_rstd.t(g), s.k_rstd.t(g),
                                          q_scale.t(g), k_scale.t(g), pe.t(g), s.offset);
      }
    };
    const int64_t backward_calls_before = vector_calls();
    run_both(backward);
    EXPECT_EQ(vector_calls() - backward_calls_before, vector_path ? 2 : 0) << "backward path";
    for (Pair* d : grads) {
      std::vector<float> got = d->down(), want = d->cpu_values();
      const auto cols = [&](const std::vector<float>& all, int64_t i) { return window_of_rows(all, 3 * H, i, H); };
      EXPECT_LE(rel_l2(cols(got, 0), cols(want, 0)), 1e-5) << "dq";
      EXPECT_LE(rel_l2(cols(got, 1), cols(want, 1)), 1e-5) << "dk";
      EXPECT_LE(rel_l2(cols(got, 2), cols(want, 2)), kExact) << "dv";
      EXPECT_TRUE(d->padding_untouched());
    }
    EXPECT_CLOSE(dq_scale, kReduce);
    EXPECT_CLOSE(dk_scale, kReduce);

    // dscale is summed in an order fixed by the shape: two runs give the same bits.
    const auto gpu_dscale_bits = [&] {
      dq_scale.host.mem = dq_scale0, dk_scale.host.mem = dk_scale0;
      dq_scale.up(), dk_scale.up();
      backward(gpu(), true);
      std::vector<uint32_t> bits;
      for (const Pair* p : {&dq_scale, &dk_scale})
        for (const float v : p->down()) bits.push_back(std::bit_cast<uint32_t>(v));
      return bits;
    };
    EXPECT_EQ(gpu_dscale_bits(), gpu_dscale_bits());
  }
  // Head dims beyond the 512 the kernels hold in registers are refused by name.
  Pair h({1, 1, 1, 514}), tok({1, 1, 514}), scale({514}), table({1, 1, 257, 2});
  try {
    gpu().qk_norm_rope_to_heads(h.dev, h.dev, h.dev, Tensor{}, Tensor{}, tok.dev, tok.dev, tok.dev, scale.dev,
                                scale.dev, table.dev, 0, 1e-6);
    FAIL() << "expected an error for D = 514";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("qk_norm_rope_to_heads: head dim 514"), std::string::npos) << e.what();
  }
}

// bf16 attention heads (Backend::attention_heads_dtype): the QK-norm + RoPE kernel and the
// layout copies store exactly the f32 results rounded to nearest even, and read bf16 heads as
// the f32 path reads the same (widened) values. Bit for bit against the GPU's own f32 path;
// D = 6 (pairs one element at a time), 128 (Flux, paired stores) with an odd offset.
TEST(CudaOps, Bf16AttentionHeads) {
  FLUX8_REQUIRE_GPU();
  for (const int64_t D : {int64_t{6}, int64_t{128}}) {
    SCOPED_TRACE(::testing::Message() << "D=" << D);
    const int64_t B = 2, n = 3, Lt = 5, Li = 9, L = Lt + Li, H = n * D;
    const Shape heads{B, n, L, D};
    Pair pe({B, L, D / 2, 2}), q_scale({D}), k_scale({D}), img({B, Li, 3 * H}, 2), rq({B * Li * n}), rk({B * Li * n});
    pe.randn(201), q_scale.randn(202), k_scale.randn(203), img.randn(204, 2.0);
    const auto win = [&](int64_t i) { return img.dev.cols_slice(i * H, H); };
    Pair qh(heads), kh(heads), vh(heads);
    Bf16Dev qb(heads), kb(heads), vb(heads);
    gpu().qk_norm_rope_to_heads(qh.dev, kh.dev, vh.dev, rq.dev, rk.dev, win(0), win(1), win(2), q_scale.dev,
                                k_scale.dev, pe.dev, Lt, 1e-6);
    const std::vector<float> rq32 = rq.down();
    gpu().qk_norm_rope_to_heads(qb.t, kb.t, vb.t, rq.dev, rk.dev, win(0), win(1), win(2), q_scale.dev, k_scale.dev,
                                pe.dev, Lt, 1e-6);
    // Only the image stream's rows were written (offset Lt): compare those.
    const auto rows_of_image = [&](const std::vector<uint16_t>& all) {
      std::vector<uint16_t> w;
      for (int64_t bh = 0; bh < B * n; ++bh)
        w.insert(w.end(), all.begin() + (bh * L + Lt) * D, all.begin() + (bh + 1) * L * D);
      return w;
    };
    EXPECT_EQ(rows_of_image(qb.bits()), rows_of_image(bf16_bits_of(qh.down()))) << "q";
    EXPECT_EQ(rows_of_image(kb.bits()), rows_of_image(bf16_bits_of(kh.down()))) << "k";
    EXPECT_EQ(rows_of_image(vb.bits()), rows_of_image(bf16_bits_of(vh.down()))) << "v";
    EXPECT_EQ(rq.down(), rq32);

    // Backward from bf16 gradients == from f32 gradients holding the same values.
    Pair dqh(heads), dkh(heads), dvh(heads), d32({B, Li, 3 * H}), d16({B, Li, 3 * H}), ds32({D}), ds16({D});
    dqh.randn(211), dkh.randn(212), dvh.randn(213);
    for (Pair* p : {&dqh, &dkh, &dvh}) round_host_to_bf16(*p);
    Bf16Dev dqb(heads), dkb(heads), dvb(heads);
    dqb.up(dqh.host.mem), dkb.up(dkh.host.mem), dvb.up(dvh.host.mem);
    ds32.fill(0.0f), ds16.fill(0.0f);
    const auto dwin = [&](Pair& p, int64_t i) { return p.dev.cols_slice(i * H, H); };
    gpu().qk_norm_rope_to_heads_backward(dwin(d32, 0), dwin(d32, 1), dwin(d32, 2), ds32.dev, ds32.dev, dqh.dev, dkh.dev,
                                         dvh.dev, win(0), win(1), rq.dev, rk.dev, q_scale.dev, k_scale.dev, pe.dev, Lt);
    gpu().qk_norm_rope_to_heads_backward(dwin(d16, 0), dwin(d16, 1), dwin(d16, 2), ds16.dev, ds16.dev, dqb.t, dkb.t,
                                         dvb.t, win(0), win(1), rq.dev, rk.dev, q_scale.dev, k_scale.dev, pe.dev, Lt);
    EXPECT_EQ(d16.down(), d32.down());
    EXPECT_EQ(ds16.down(), ds32.down());

    // Layout: tokens -> bf16 heads rounds, bf16 heads -> tokens widens.
    Pair tok({B, Li, H}, 4), back({B, Li, H}, 4), f32h(heads);
    tok.randn(221);
    Bf16Dev hb(heads);
    hb.up(std::vector<float>(static_cast<size_t>(B * n * L * D), 0.0f));
    f32h.fill(0.0f);
    gpu().tokens_to_heads(hb.t, tok.dev, Lt);
    gpu().tokens_to_heads(f32h.dev, tok.dev, Lt);
    EXPECT_EQ(hb.bits(), bf16_bits_of(f32h.down()));
    gpu().heads_to_tokens(back.dev, hb.t, Lt);
    std::vector<float> widened = hb.down();
    f32h.host.mem = widened;
    f32h.up();
    Pair back32({B, Li, H}, 4);
    gpu().heads_to_tokens(back32.dev, f32h.dev, Lt);
    EXPECT_EQ(back.down(), back32.down());
    // Mixed heads in one call are refused.
    EXPECT_THROW(gpu().qk_norm_rope_to_heads(qb.t, kh.dev, vb.t, Tensor{}, Tensor{}, win(0), win(1), win(2),
                                             q_scale.dev, k_scale.dev, pe.dev, Lt, 1e-6),
                 Error);
  }
}

TEST(CudaOps, TimestepEmbedding) {
  FLUX8_REQUIRE_GPU();
  for (const int64_t dim : {int64_t{256}, int64_t{33}}) {
    Pair out({4, dim}, 3), t({4});
    out.randn(81);
    t.host.mem = {0.0f, 0.25f, 0.999f, 3.5f};
    t.up();
    run_both([&](Backend& be, bool g) { be.timestep_embedding(out.t(g), t.t(g), 1000.0, 10000.0); });
    EXPECT_CLOSE(out, 1e-7);
  }
}

// The stream ids travel in the kernel's arguments up to 256 samples, through the scratch buffer
// beyond: both paths, and their edge, against the CPU.
TEST(CudaOps, FlowMatchInputsForAnyBatchSize) {
  FLUX8_REQUIRE_GPU();
  for (const int64_t B : {int64_t(1), int64_t(5), int64_t(256), int64_t(257), int64_t(300)}) {
    SCOPED_TRACE(B);
    Pair x0({B, 7}), t({B}), xt({B, 7}), target({B, 7});
    x0.randn(81), xt.randn(82), target.randn(83);
    for (int64_t b = 0; b < B; ++b) t.host.mem[static_cast<size_t>(b)] = static_cast<float>((b * 37 % 101) / 101.0);
    t.up();
    std::vector<uint64_t> streams;
    for (int64_t b = 0; b < B; ++b) streams.push_back(rng_stream(static_cast<uint64_t>(b), 9));
    run_both([&](Backend& be, bool g) { be.flow_match_inputs(xt.t(g), target.t(g), x0.t(g), t.t(g), 78, streams); });
    EXPECT_CLOSE(xt, kElementwise);
    EXPECT_CLOSE(target, kElementwise);
  }
}

TEST(CudaOps, ObjectiveLossNormAdamW) {
  FLUX8_REQUIRE_GPU();
  const int64_t B = 3, per = 1000;
  Pair x0({B, 10, 100}), t({B}), xt({B, 10, 100}), target({B, 10, 100});
  x0.randn(91), xt.randn(92), target.randn(93);
  t.host.mem = {0.1f, 0.5f, 0.97f};
  t.up();
  const std::vector<uint64_t> streams{rng_stream(1, 2), rng_stream(3, 4), rng_stream(5, 6)};
  run_both([&](Backend& be, bool g) { be.flow_match_inputs(xt.t(g), target.t(g), x0.t(g), t.t(g), 77, streams); });
  EXPECT_CLOSE(xt, kElementwise);
  EXPECT_CLOSE(target, kElementwise);
  (void)per;

  target.up();  // the loss below then sees the same target on both sides (noise differs by ulps)
  Pair pred({B, 10, 100}), dpred({B, 10, 100});
  pred.randn(94), dpred.randn(95);
  double loss[2];
  run_both([&](Backend& be, bool g) { loss[g] = be.mse_loss(dpred.t(g), pred.t(g), target.t(g), 0.5); });
  EXPECT_NEAR(loss[1], loss[0], 1e-12 * loss[0]);  // the same f32 inputs summed in double
  EXPECT_CLOSE(dpred, kElementwise);

  // The vector path over whole blocks of 65,536 and a partial one, the 1-3 elements after the
  // last quad, and (from element 1: not 16-byte aligned) the element-by-element path.
  for (const int64_t size : {int64_t(70001), int64_t(3 * 65536 + 3), int64_t(4099)}) {
    SCOPED_TRACE(size);
    Pair xs({size});
    xs.randn(96 + size);
    double sq[2];
    run_both([&](Backend& be, bool g) { sq[g] = be.sum_squares(xs.t(g)); });
    EXPECT_NEAR(sq[1], sq[0], 1e-12 * sq[0]);  // the same f32 inputs summed in double: order only
    const auto from1 = [&](bool g) {
      return Tensor(static_cast<float*>(xs.t(g).data) + 1, DType::f32, Shape{size - 1});
    };
    run_both([&](Backend& be, bool g) { sq[g] = be.sum_squares(from1(g)); });
    EXPECT_NEAR(sq[1], sq[0], 1e-12 * sq[0]);
  }
  Pair big({70001});
  big.randn(96);
  // A non-finite gradient must show in the norm (the trainer skips the step on it).
  big.host.mem[12345] = std::numeric_limits<float>::infinity();
  big.up();
  EXPECT_TRUE(std::isinf(gpu().sum_squares(big.dev)));

  const int64_t n = 5003;
  Pair p({n}), gr({n}), m({n}), v({n});
  p.randn(97), gr.randn(98, 0.01), m.randn(99, 0.001), v.fill(1e-6f);
  for (int64_t step = 1; step <= 3; ++step) {
    const Backend::AdamW h{1e-3, 0.9, 0.95, 1e-8, 0.1, 0.5, step};
    run_both([&](Backend& be, bool g) { be.adamw(p.t(g), gr.t(g), m.t(g), v.t(g), h, {}, {}, {}); });
  }
  // The same fp32 operations in the same order, none fused, on both backends (the CPU file is
  // built with -ffp-contract=off): equal bit for bit; the bound is loose on purpose.
  EXPECT_CLOSE(p, 1e-7);
  EXPECT_CLOSE(m, 1e-7);
  EXPECT_CLOSE(v, 1e-7);
}

// adamw writing bf16 copies of parameter ranges (the weights' operand copies): the update equals
// the CPU's bit for bit and each copy is the new values rounded to nearest even, for copies
// spanning several of the kernel's chunks, ending in a partial one, at an offset that is not a
// multiple of 4 (the per-element path) and ending at the last parameter; then with another set
// of copies (a new chunk table) and on views that are not 16-byte aligned.
TEST(CudaOps, AdamWWritesRoundedCopies) {
  FLUX8_REQUIRE_GPU();
  const int64_t n = 100011;
  Pair p({n}), gr({n}), m({n}), v({n});
  p.randn(31), gr.randn(32, 0.01), m.randn(33, 0.001), v.fill(1e-6f);
  struct Range {
    int64_t offset, count;
  };
  const auto check = [&](const std::vector<Range>& ranges, int64_t first, int64_t step, const char* what) {
    SCOPED_TRACE(what);
    std::vector<std::vector<uint16_t>> host;
    std::vector<std::unique_ptr<Bf16Dev>> dev;
    std::vector<Backend::ParamCopy> cpu_copies, gpu_copies;
    for (const Range& r : ranges) {
      host.emplace_back(static_cast<size_t>(r.count), uint16_t{0xFFFF});
      dev.push_back(std::make_unique<Bf16Dev>(Shape{r.count}));
    }
    for (size_t i = 0; i < ranges.size(); ++i) {
      cpu_copies.push_back({ranges[i].offset - first, Tensor(host[i].data(), DType::bf16, Shape{ranges[i].count})});
      gpu_copies.push_back({ranges[i].offset - first, dev[i]->t});
    }
    const auto part = [&](Pair& x, bool g) {
      Tensor t = x.t(g);
      t.data = static_cast<float*>(t.data) + first;
      t.shape = Shape{n - first};
      t.ld = n - first;
      return t;
    };
    const Backend::AdamW h{1e-3, 0.9, 0.95, 1e-8, 0.1, 0.7, step};
    run_both([&](Backend& be, bool g) {
      be.adamw(part(p, g), part(gr, g), part(m, g), part(v, g), h, g ? gpu_copies : cpu_copies, {}, {});
    });
    EXPECT_EQ(p.down(), p.host.mem);
    EXPECT_EQ(m.down(), m.host.mem);
    EXPECT_EQ(v.down(), v.host.mem);
    for (size_t i = 0; i < ranges.size(); ++i) {
      const std::vector<float> want(p.host.mem.begin() + ranges[i].offset,
                                    p.host.mem.begin() + ranges[i].offset + ranges[i].count);
      EXPECT_EQ(host[i], bf16_bits_of(want)) << "CPU copy " << i;
      EXPECT_EQ(dev[i]->bits(), host[i]) << "GPU copy " << i;
    }
  };
  const std::vector<Range> ranges{{0, 40000 + 5}, {50000, 1234}, {70003, 999}, {72288, n - 72288}};
  check(ranges, 0, 1, "first step");
  check(ranges, 0, 2, "second step, the same chunk table");
  check({{8, 3}, {9000, 50000}}, 0, 3, "other copies");
  check({{9, 100}, {9001, 40000}}, 1, 4, "views not 16-byte aligned");
}

// Low-rank gradients (Backend::LowRankGrad) in the gradient norm and AdamW: the quad path (a
// row of factors in 16-byte loads: offset and K multiples of 4) over a gradient spanning several
// chunks of both kernels, the element path (K = 7; K a multiple of 4 at an offset that is not),
// ranks 1 to 5, next to dense ranges of every alignment and under a bf16 copy. The flat buffer
// holds NaN at the low-rank ranges: neither kernel may read it. AdamW equals the CPU twin bit
// for bit; the norm up to the order of its double sums; a NaN factor shows in the norm.
TEST(CudaOps, LowRankGradientsEqualTheCpu) {
  FLUX8_REQUIRE_GPU();
  const int64_t n = 200003;
  const LowRankFactors factors({{1000, 2, 37, 64}, {5001, 3, 13, 7}, {20000, 5, 300, 512}, {180002, 1, 10, 16}}, 42);
  Pair gr({n});
  gr.randn(41, 0.01);
  factors.plant_nan(gr);
  expect_norm_and_adamw_match_cpu(gr, factors);

  factors.a[2]->host.mem[7] = NAN;
  factors.a[2]->up();
  EXPECT_TRUE(std::isnan(gpu().gradient_sum_squares(gr.dev, factors.on(true))));
}

// Parameter initialisation on the device: the CPU's values (uniform: the same bits; normal:
// the device's logf/cosf may round the last f32 bit differently), and the values depend on
// (seed, stream, index) only.
TEST(CudaOps, FillRandomMatchesCpu) {
  FLUX8_REQUIRE_GPU();
  Pair u({1000, 7}), n({70001});
  run_both([&](Backend& be, bool g) { be.fill_random(u.t(g), Backend::Random::uniform, 5, 77, 0.3); });
  EXPECT_CLOSE(u, kExact);
  run_both([&](Backend& be, bool g) { be.fill_random(n.t(g), Backend::Random::normal, 5, 78, 0.02); });
  EXPECT_CLOSE(n, kElementwise);
  const std::vector<float> v = n.down();
  gpu().fill(n.dev, 7.0);
  gpu().fill_random(n.dev, Backend::Random::normal, 5, 78, 0.02);
  EXPECT_EQ(n.down(), v) << "the same (seed, stream, index), the same values";
  gpu().fill_random(n.dev, Backend::Random::normal, 5, 79, 0.02);
  EXPECT_NE(n.down(), v) << "another stream, other values";
  double mean = 0, sq = 0;
  for (float x : v) mean += x / v.size(), sq += double(x) * x / v.size();
  EXPECT_NEAR(mean, 0.0, 0.001);
  EXPECT_NEAR(std::sqrt(sq), 0.02, 0.001);
}

TEST(CudaOps, ErrorsNameTheOpAndTensor) {
  FLUX8_REQUIRE_GPU();
  Pair x({4, 8}), w({5, 7}), y({4, 5});
  try {
    gpu().linear(y.dev, x.dev, w.dev, Tensor{});
    FAIL() << "expected a shape error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("linear: weight 'w'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flux8::testing
