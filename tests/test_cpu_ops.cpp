// Forward results of the CPU ops against direct formulas, and the interface's semantics:
// round trips, accumulate-vs-overwrite, column windows, error messages. f64 is used where a
// result is compared with a naive formula, so the tolerances (1e-12) only absorb summation
// order differences (≈ n·ε for n ≤ a few hundred terms).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "core/error.h"
#include "cpu_ops_util.h"
#include "fp8/qtensor.h"

namespace flux8::testing {
namespace {

constexpr double kExact = 1e-12;
const double kNaN = std::numeric_limits<double>::quiet_NaN();

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// What a call's Error says ("no error" when it throws none).
template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return std::string(e.what());
  }
  return std::string("no error");
}

// A 1x128-block FP8 tensor [rows, cols] over host codes and scales (the CPU backend's casts
// write host memory).
QTensor block_qtensor(std::vector<uint8_t>& codes, std::vector<float>& scales, int64_t rows, int64_t cols) {
  QTensor q;
  q.codes = codes.data(), q.rows = rows, q.cols = cols, q.scaling = Fp8Scaling::block_1x128;
  q.scale_inv = scales.data();
  return q;
}

class CpuOps : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_backend("cpu");
};

TEST_F(CpuOps, LinearMatchesNaiveAndKeepsOutputPadding) {
  const int64_t N = 7, K = 19, M = 37;
  Buf<double> x({N, K}, 3), w({M, K}), b({M}), y({N, M}, 2);
  x.randn(1), w.randn(2), b.randn(3), y.fill_padding(kNaN);
  be->linear(y.t, x.t, w.t, b.t);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      double ref = b.mem[m];
      for (int64_t k = 0; k < K; ++k) ref += x.at(n, k) * w.at(m, k);
      EXPECT_NEAR(y.at(n, m), ref, kExact);
    }
  EXPECT_TRUE(y.padding_is_nan()) << "linear wrote outside its output window";
  be->linear(y.t, x.t, w.t, Tensor{});  // no bias
  double ref = 0;
  for (int64_t k = 0; k < K; ++k) ref += x.at(3, k) * w.at(5, k);
  EXPECT_NEAR(y.at(3, 5), ref, kExact);
}

// linear_gelu is linear into h then the GELU of h's last My columns, bit for bit (the same GEMM,
// the same formula on the same values), for the whole output and for a tail (the single
// block's MLP part after q, k, v); with bf16 rounding both outputs round once from the
// unrounded values (y is not the GELU of the rounded h).
TEST_F(CpuOps, LinearGeluIsLinearThenGeluOfItsLastColumns) {
  const int64_t N = 9, K = 21, M = 17;
  for (const int64_t My : {M, int64_t{6}}) {
    SCOPED_TRACE(::testing::Message() << "GELU over the last " << My << " of " << M << " columns");
    Buf<float> x({N, K}, 3), w({M, K}), b({M}), y({N, My}, 2), h({N, M}, 4), ref_h({N, M}), ref_y({N, My});
    x.randn(31), w.randn(32, 0.3), b.randn(33), y.fill_padding(NAN), h.fill_padding(NAN);
    be->linear_gelu(y.t, h.t, x.t, w.t, b.t);
    be->linear(ref_h.t, x.t, w.t, b.t);
    be->gelu_tanh(ref_y.t, ref_h.t.cols_slice(M - My, My));
    EXPECT_EQ(h.values(), ref_h.values());
    EXPECT_EQ(y.values(), ref_y.values());
    EXPECT_TRUE(y.padding_is_nan() && h.padding_is_nan()) << "linear_gelu wrote outside its outputs";
    Buf<double> xd({N, K}), wd({M, K}), yd({N, My}), hd({N, M}), ref_hd({N, M}), ref_yd({N, My});
    xd.randn(31), wd.randn(32, 0.3);
    be->linear_gelu(yd.t, hd.t, xd.t, wd.t, Tensor{});
    be->linear(ref_hd.t, xd.t, wd.t, Tensor{});
    be->gelu_tanh(ref_yd.t, ref_hd.t.cols_slice(M - My, My));
    EXPECT_EQ(hd.values(), ref_hd.values());
    EXPECT_EQ(yd.values(), ref_yd.values());

    BackendOptions o;
    o.round_activations_to_bf16 = true;
    const auto rounding = make_backend("cpu", o);
    Buf<float> yr({N, My}), hr({N, M});
    rounding->linear_gelu(yr.t, hr.t, x.t, w.t, b.t);
    int64_t not_gelu_of_rounded_h = 0;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t m = 0; m < M; ++m) ASSERT_EQ(hr.at(n, m), round_to_bf16(h.at(n, m)));
      for (int64_t m = 0; m < My; ++m) ASSERT_EQ(yr.at(n, m), round_to_bf16(y.at(n, m)));
    }
    Buf<float> y_of_rounded({N, My});
    rounding->gelu_tanh(y_of_rounded.t, hr.t.cols_slice(M - My, My));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t m = 0; m < My; ++m) not_gelu_of_rounded_h += yr.at(n, m) != y_of_rounded.at(n, m);
    EXPECT_GT(not_gelu_of_rounded_h, 0) << "y must be the GELU of the unrounded sum";
  }
}

// linear_dgrad_gelu is linear_backward's dx of the whole input, then GELU's backward over its
// last Kh columns, bit for bit; with bf16 rounding each output rounds once (the product is not
// rounded before the derivative multiplies it).
TEST_F(CpuOps, LinearDgradGeluIsDgradThenGeluBackward) {
  const int64_t N = 9, K = 21, M = 17;
  for (const int64_t Kh : {K, int64_t{8}}) {
    SCOPED_TRACE(::testing::Message() << "GELU over the last " << Kh << " of " << K << " input columns");
    const int64_t K0 = K - Kh;
    Buf<float> dy({N, M}, 2), w({M, K}), h({N, Kh}, 1), dh({N, Kh}, 3), dx({N, std::max<int64_t>(K0, 1)}, 2);
    dy.randn(41), w.randn(42, 0.3), h.randn(43, 2.0), dh.fill_padding(NAN), dx.fill_padding(NAN);
    const Tensor dx_t = K0 ? dx.t : Tensor{};
    be->linear_dgrad_gelu(dx_t, dh.t, dy.t, w.t, h.t);
    Buf<float> p({N, K}), ref_dh({N, Kh});
    be->linear_backward(p.t, Tensor{}, Tensor{}, dy.t, Tensor{}, w.t, false, false);
    be->gelu_tanh_backward(ref_dh.t, p.t.cols_slice(K0, Kh), h.t);
    EXPECT_EQ(dh.values(), ref_dh.values());
    EXPECT_TRUE(dh.padding_is_nan());
    if (K0) {
      Buf<float> ref_dx({N, K0});
      be->copy(ref_dx.t, p.t.cols_slice(0, K0));
      EXPECT_EQ(dx.values(), ref_dx.values());
      EXPECT_TRUE(dx.padding_is_nan());
    }
    BackendOptions o;
    o.round_activations_to_bf16 = true;
    const auto rounding = make_backend("cpu", o);
    Buf<float> dhr({N, Kh}), dxr({N, std::max<int64_t>(K0, 1)});
    rounding->linear_dgrad_gelu(K0 ? dxr.t : Tensor{}, dhr.t, dy.t, w.t, h.t);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = 0; k < Kh; ++k) ASSERT_EQ(dhr.at(n, k), round_to_bf16(dh.at(n, k)));
      for (int64_t k = 0; k < K0; ++k) ASSERT_EQ(dxr.at(n, k), round_to_bf16(dx.at(n, k)));
    }
  }
}

TEST_F(CpuOps, LinearGeluArgumentsAreChecked) {
  Buf<double> x({3, 4}), w({5, 4}), h({3, 5}), y_wide({3, 6}), dy({3, 5}), hk({3, 4}), dx({3, 2}), h2({3, 2});
  std::string m = error_message([&] { be->linear_gelu(y_wide.t, h.t, x.t, w.t, Tensor{}); });
  EXPECT_NE(m.find("linear_gelu: GELU output 'y' f64[3, 6]"), std::string::npos) << m;
  m = error_message([&] { be->linear_dgrad_gelu(dx.t, hk.t, dy.t, w.t, hk.t); });
  EXPECT_NE(m.find("linear_dgrad_gelu: input gradient 'dx' f64[3, 2] given"), std::string::npos) << m;
  m = error_message([&] { be->linear_dgrad_gelu(Tensor{}, h2.t, dy.t, w.t, h2.t); });
  EXPECT_NE(m.find("linear_dgrad_gelu: input gradient 'dx'"), std::string::npos) << m;
  m = error_message([&] { be->linear_dgrad_gelu(Tensor{}, hk.t, dy.t, w.t, h2.t); });
  EXPECT_NE(m.find("'dh' f64[3, 4] and 'h' f64[3, 2]"), std::string::npos) << m;
}

TEST_F(CpuOps, ActivationsMatchKnownValues) {
  Buf<double> x({1, 3}), y({1, 3});
  x.mem = {-1.0, 0.0, 1.0};
  x.t.data = x.mem.data();
  be->silu(y.t, x.t);
  EXPECT_NEAR(y.mem[0], -0.2689414213699951, 1e-15);
  EXPECT_NEAR(y.mem[2], 0.7310585786300049, 1e-15);
  be->gelu_tanh(y.t, x.t);
  // 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715x³))) at ±1
  EXPECT_NEAR(y.mem[0], -0.15880800939172324, 1e-15);
  EXPECT_NEAR(y.mem[1], 0.0, 0.0);
  EXPECT_NEAR(y.mem[2], 0.8411919906082768, 1e-15);
}

// Two naive loops: scores, softmax with the max subtracted, weighted sum. L = 300 covers
// several query blocks of the implementation plus a remainder.
TEST_F(CpuOps, AttentionMatchesNaiveSoftmax) {
  const int64_t B = 2, NH = 3, L = 300, D = 12;
  const Shape s{B, NH, L, D};
  Buf<double> q(s), k(s), v(s, 1), o(s, 2), lse({B, NH, L});
  q.randn(4), k.randn(5), v.randn(6), o.fill_padding(kNaN);
  const double scale = 0.3;
  be->attention(o.t, lse.t, q.t, k.t, v.t, static_cast<float>(scale));
  EXPECT_TRUE(o.padding_is_nan());
  double worst = 0;
  for (int64_t bh = 0; bh < B * NH; bh += 5)
    for (int64_t i = 0; i < L; i += 7) {
      std::vector<double> sc(L);
      double mx = -INFINITY, sum = 0;
      for (int64_t j = 0; j < L; ++j) {
        sc[j] = 0;
        for (int64_t d = 0; d < D; ++d) sc[j] += q.at(bh * L + i, d) * k.at(bh * L + j, d);
        sc[j] *= static_cast<double>(static_cast<float>(scale));
        mx = std::max(mx, sc[j]);
      }
      for (int64_t j = 0; j < L; ++j) sum += std::exp(sc[j] - mx);
      EXPECT_NEAR(lse.mem[bh * L + i], mx + std::log(sum), kExact);
      for (int64_t d = 0; d < D; ++d) {
        double ref = 0;
        for (int64_t j = 0; j < L; ++j) ref += std::exp(sc[j] - mx) / sum * v.at(bh * L + j, d);
        worst = std::max(worst, std::abs(o.at(bh * L + i, d) - ref));
      }
    }
  EXPECT_LT(worst, kExact);
}

TEST_F(CpuOps, LayerNormModulateMatchesFormula) {
  const int64_t B = 2, L = 3, H = 21;
  Buf<double> x({B, L, H}, 1), mod({B, 2 * H}), y({B, L, H}, 1), mean({B * L}), rstd({B * L});
  x.randn(7, 2.0), mod.randn(8), y.fill_padding(kNaN);
  for (double& v : x.mem) v += 10;  // a large mean: variance must not cancel
  const float eps = 1e-6f;
  be->layernorm_modulate(y.t, mean.t, rstd.t, x.t, mod.t.cols_slice(0, H), mod.t.cols_slice(H, H), eps);
  EXPECT_TRUE(y.padding_is_nan());
  for (int64_t r = 0; r < B * L; ++r) {
    double mu = 0, var = 0;
    for (int64_t j = 0; j < H; ++j) mu += x.at(r, j) / H;
    for (int64_t j = 0; j < H; ++j) var += (x.at(r, j) - mu) * (x.at(r, j) - mu) / H;  // biased
    const double rs = 1 / std::sqrt(var + static_cast<double>(eps));
    EXPECT_NEAR(mean.mem[r], mu, kExact);
    EXPECT_NEAR(rstd.mem[r], rs, kExact * rs);
    for (int64_t j = 0; j < H; ++j) {
      const int64_t b = r / L;
      const double ref = (1 + mod.at(b, H + j)) * (x.at(r, j) - mu) * rs + mod.at(b, j);
      EXPECT_NEAR(y.at(r, j), ref, 1e-10);
    }
  }
}

// y undefined: only mean and rstd (what a fused LayerNorm + cast needs first), the same values.
TEST_F(CpuOps, LayerNormStatisticsOnly) {
  const int64_t B = 2, L = 5, H = 33;
  Buf<float> x({B, L, H}, 2), mod({B, 2 * H}), y({B, L, H}), mean({B * L}), rstd({B * L}), mean2({B * L}),
      rstd2({B * L});
  x.randn(17, 3.0), mod.randn(18);
  be->layernorm_modulate(y.t, mean.t, rstd.t, x.t, mod.t.cols_slice(0, H), mod.t.cols_slice(H, H), 1e-6);
  be->layernorm_modulate(Tensor{}, mean2.t, rstd2.t, x.t, mod.t.cols_slice(0, H), mod.t.cols_slice(H, H), 1e-6);
  EXPECT_EQ(mean.mem, mean2.mem);
  EXPECT_EQ(rstd.mem, rstd2.mem);
  EXPECT_THROW(
      be->layernorm_modulate(Tensor{}, mean2.t, rstd2.t, x.t, mod.t.cols_slice(0, H - 1), mod.t.cols_slice(H, H), 1e-6),
      Error);
}

// Backend::quantize_fused's default (the CPU's): the op's output, then the cast — the same
// codes, scales and statistics as doing the two by hand.
TEST_F(CpuOps, QuantizeFusedIsOpThenCast) {
  using Op = Backend::CastInput::Op;
  const int64_t B = 2, L = 9, H = 140;
  Buf<float> x({B, L, H}, 3), mod({B, 2 * H}), mean({B * L}), rstd({B * L}), y({B, L, H}), gx({B, L, H}, 1);
  x.randn(21, 2.0), mod.randn(22, 0.5), gx.randn(23, 2.0);
  for (const Op op : {Op::identity, Op::gelu_tanh, Op::layernorm_modulate, Op::gelu_tanh_backward, Op::gated}) {
    SCOPED_TRACE(static_cast<int>(op));
    Backend::CastInput in = Backend::CastInput::layernorm_modulate_of(x.t, mean.t, rstd.t, mod.t.cols_slice(0, H),
                                                                      mod.t.cols_slice(H, H), 1e-6);
    in.op = op;
    in.gelu_x = gx.t;                  // gelu_tanh_backward: x is dy, gx the GELU's input
    in.gate = mod.t.cols_slice(H, H);  // gated: x is the residual's gradient
    be->produce(y.t, in);
    std::vector<uint8_t> fused(B * L * H, 0xA5), by_hand(B * L * H, 0x5A);
    std::vector<float> s_fused(B * L * 2, -1), s_hand(B * L * 2, -2);
    auto qt = [&](std::vector<uint8_t>& codes, std::vector<float>& scales) {
      return block_qtensor(codes, scales, B * L, H);
    };
    Backend::Quantize q;
    q.scaling = Fp8Scaling::block_1x128;
    CastStats st_fused, st_hand;
    q.stats = &st_fused;
    be->quantize_fused(qt(fused, s_fused), QTensor{}, in, q);
    q.stats = &st_hand;
    be->quantize(qt(by_hand, s_hand), QTensor{}, y.t.reshaped(Shape{B * L, H}), q);
    EXPECT_EQ(fused, by_hand);
    EXPECT_EQ(s_fused, s_hand);
    EXPECT_EQ(st_fused.elements, st_hand.elements);
    EXPECT_EQ(st_fused.nonzero, st_hand.nonzero);
    EXPECT_EQ(st_fused.flushed, st_hand.flushed);
    EXPECT_EQ(bits_of(st_fused.amax), bits_of(st_hand.amax));
  }
}

// A cast with a head (CastInput::head): produce() writes [head | op(x)] — the head copied, or
// left where it already is y's first columns — and quantize_fused casts exactly that tensor.
// A head with other rows is an error naming it.
TEST_F(CpuOps, CastWithAHeadIsTheAssembledTensor) {
  using Op = Backend::CastInput::Op;
  const int64_t B = 2, L = 5, H = 12, Hd = 7, C = Hd + H;
  Buf<float> x({B, L, H}, 2), gx({B, L, H}), head({B, L, Hd}, 3), y({B, L, C}, 1), op_only({B, L, H});
  x.randn(31, 2.0), gx.randn(32, 2.0), head.randn(33, 4.0);
  for (const Op op : {Op::identity, Op::gelu_tanh, Op::gelu_tanh_backward}) {
    SCOPED_TRACE(static_cast<int>(op));
    Backend::CastInput in;
    in.op = op, in.x = x.t, in.gelu_x = gx.t;
    be->produce(op_only.t, in);
    const Backend::CastInput with = in.with_head(head.t);
    EXPECT_EQ(with.cols(), C);
    EXPECT_EQ(with.shape(), (Shape{B, L, C}));
    y.fill_padding(kNaN);
    be->produce(y.t, with);
    for (int64_t r = 0; r < B * L; ++r) {
      for (int64_t c = 0; c < Hd; ++c) ASSERT_EQ(y.at(r, c), head.at(r, c)) << r << ", " << c;
      for (int64_t c = 0; c < H; ++c) ASSERT_EQ(y.at(r, Hd + c), op_only.at(r, c)) << r << ", " << c;
    }
    EXPECT_TRUE(y.padding_is_nan());
    // The head already in place: y's own first columns.
    Buf<float> y2({B, L, C});
    be->copy(y2.t.cols_slice(0, Hd), head.t);
    be->produce(y2.t, in.with_head(y2.t.cols_slice(0, Hd)));
    EXPECT_EQ(y2.values(), y.values());

    std::vector<uint8_t> fused(B * L * C, 0xA5), assembled(B * L * C, 0x5A);
    std::vector<float> s_fused(B * L, -1), s_assembled(B * L, -2);
    auto qt = [&](std::vector<uint8_t>& codes, std::vector<float>& scales) {
      return block_qtensor(codes, scales, B * L, C);
    };
    Backend::Quantize q;
    q.scaling = Fp8Scaling::block_1x128;
    be->quantize_fused(qt(fused, s_fused), QTensor{}, with, q);
    be->quantize(qt(assembled, s_assembled), QTensor{}, y.t, q);
    EXPECT_EQ(fused, assembled);
    EXPECT_EQ(s_fused, s_assembled);
  }
  Buf<float> short_head({B, L - 1, Hd});
  Backend::CastInput in;
  in.op = Op::gelu_tanh, in.x = x.t;
  EXPECT_NE(error_message([&] { be->produce(y.t, in.with_head(short_head.t)); }).find("head"), std::string::npos);
  std::vector<uint8_t> codes(B * L * C);
  std::vector<float> scales(B * L);
  const QTensor qt = block_qtensor(codes, scales, B * L, C);
  Backend::Quantize q;
  q.scaling = Fp8Scaling::block_1x128;
  EXPECT_NE(error_message([&] { be->quantize_fused(qt, QTensor{}, in.with_head(short_head.t), q); }).find("head"),
            std::string::npos);
}

// Quantize::column_sums (a Linear's bias gradient taken in the cast of its output gradient):
// exactly linear_backward's db, accumulated; also with no FP8 copy wanted; a wrong-sized
// target is an error naming it.
TEST_F(CpuOps, QuantizeColumnSumsAreTheBiasGradient) {
  const int64_t N = 37, M = 130;
  Buf<float> dy({N, M}, 3), w({M, 5}), db({M}), sums({M});
  dy.randn(31, 2.0), w.randn(32);
  for (int64_t j = 0; j < M; ++j) db.mem[j] = sums.mem[j] = 0.25f * static_cast<float>(j % 7);
  be->linear_backward(Tensor{}, Tensor{}, db.t, dy.t, Tensor{}, w.t, false, true);
  std::vector<uint8_t> codes(N * M);
  std::vector<float> scale(1);
  QTensor row;
  row.codes = codes.data(), row.rows = N, row.cols = M, row.scale_inv = scale.data();
  Backend::Quantize q;
  q.column_sums = sums.t;
  be->quantize(row, QTensor{}, dy.t, q);
  EXPECT_EQ(sums.mem, db.mem);
  be->quantize(QTensor{}, QTensor{}, dy.t, q);  // no copy wanted: the sums still accumulate
  be->linear_backward(Tensor{}, Tensor{}, db.t, dy.t, Tensor{}, w.t, false, true);
  EXPECT_EQ(sums.mem, db.mem);
  q.column_sums = Tensor(sums.mem.data(), DType::f32, Shape{M - 1});
  try {
    be->quantize(row, QTensor{}, dy.t, q);
    ADD_FAILURE() << "a column_sums of the wrong size was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("column_sums"), std::string::npos) << e.what();
  }
}

// fill_random: core/rng.h's value of (seed, stream, index), scaled, for any thread count and
// both storage types; a strided target is an error.
TEST_F(CpuOps, FillRandomIsAPureFunctionOfTheIndex) {
  Buf<float> a({300, 7}), b({300, 7});
  Buf<double> d({300, 7});
  BackendOptions one;
  one.threads = 1;
  const auto single = make_backend("cpu", one);
  be->fill_random(a.t, Backend::Random::normal, 9, 4, 0.02);
  single->fill_random(b.t, Backend::Random::normal, 9, 4, 0.02);
  be->fill_random(d.t, Backend::Random::normal, 9, 4, 0.02);
  EXPECT_EQ(a.mem, b.mem);
  for (size_t i = 0; i < a.mem.size(); ++i) {
    const double want = 0.02 * static_cast<double>(rng_normal(9, 4, i));
    ASSERT_EQ(a.mem[i], static_cast<float>(want)) << i;
    ASSERT_EQ(d.mem[i], want) << i;
  }
  be->fill_random(a.t, Backend::Random::uniform, 9, 5, 0.5);
  for (size_t i = 0; i < a.mem.size(); ++i)
    ASSERT_EQ(a.mem[i], static_cast<float>(0.5 * (2.0 * static_cast<double>(rng_uniform(9, 5, i)) - 1.0))) << i;
  Buf<float> strided({4, 5}, 2);
  EXPECT_THROW(be->fill_random(strided.t, Backend::Random::uniform, 1, 1, 1.0), Error);
}

TEST_F(CpuOps, RmsNormHeadsMatchesFormula) {
  const int64_t rows = 7, n = 3, D = 10;
  Buf<double> x({rows, n * D}, 5), scale({D}), y({rows, n * D}), rstd({rows * n});
  x.randn(9), scale.randn(10);
  be->rmsnorm_heads(y.t, rstd.t, x.t, scale.t, 1e-6f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < n; ++h) {
      double ms = 0;
      for (int64_t d = 0; d < D; ++d) ms += x.at(r, h * D + d) * x.at(r, h * D + d) / D;
      const double rs = 1 / std::sqrt(ms + static_cast<double>(1e-6f));
      EXPECT_NEAR(rstd.mem[r * n + h], rs, kExact * rs);
      for (int64_t d = 0; d < D; ++d) EXPECT_NEAR(y.at(r, h * D + d), x.at(r, h * D + d) * rs * scale.mem[d], kExact);
    }
}

TEST_F(CpuOps, RopeTableMatchesFormula) {
  const int axes[] = {2, 4, 6};  // 1 + 2 + 3 pairs
  Buf<double> ids({1, 2, 3}), pe({1, 2, 6, 2});
  ids.mem = {0, 3, 5, 1, 2, 7};
  be->rope_table(pe.t, ids.t, axes, 10000.0);
  int64_t p = 0;
  for (int i = 0; i < 3; ++i)
    for (int k = 0; k < axes[i] / 2; ++k, ++p) {
      const double angle = ids.mem[3 + i] * std::pow(10000.0, -2.0 * k / axes[i]);
      EXPECT_NEAR(pe.mem[(6 + p) * 2 + 0], std::cos(angle), 1e-15) << "pair " << p;
      EXPECT_NEAR(pe.mem[(6 + p) * 2 + 1], std::sin(angle), 1e-15) << "pair " << p;
    }
}

TEST_F(CpuOps, RopeRotatesAdjacentPairsAndInverseUndoesIt) {
  const int axes[] = {2, 4, 4};
  const int64_t B = 2, NH = 2, L = 5, D = 10;
  Buf<double> ids({B, L, 3}), pe({B, L, D / 2, 2}), x({B, NH, L, D}, 3), x0({B, NH, L, D}, 3);
  ids.randn(11, 5.0), x.randn(12);
  be->rope_table(pe.t, ids.t, axes, 10000.0);
  be->copy(x0.t, x.t);
  be->rope(x.t, pe.t, false);
  // Element pair p = 3 of head 1, sample 1, token 4: (c·x0 − s·x1, s·x0 + c·x1).
  const int64_t r = (1 * NH + 1) * L + 4, p = 3;
  const double c = pe.mem[((1 * L + 4) * (D / 2) + p) * 2], s = pe.mem[((1 * L + 4) * (D / 2) + p) * 2 + 1];
  EXPECT_NEAR(x.at(r, 2 * p), c * x0.at(r, 2 * p) - s * x0.at(r, 2 * p + 1), kExact);
  EXPECT_NEAR(x.at(r, 2 * p + 1), s * x0.at(r, 2 * p) + c * x0.at(r, 2 * p + 1), kExact);
  be->rope(x.t, pe.t, true);
  EXPECT_LT(rel_diff(x.values(), x0.values()), kExact);
}

// cos first, then sin, of (factor·t)·P^(−k/half), evaluated in double: the f64 result matches
// an independent formula (pow instead of exp∘log) to rounding of arguments up to 10³
// (1e3·ε ≈ 2e-13), and the f32 result is that value rounded once (half an ulp ≤ 6e-8).
TEST_F(CpuOps, TimestepEmbeddingMatchesFormula) {
  const int64_t B = 3, dim = 256, half = 128;
  Buf<double> t({B}), out({B, dim}, 4);
  Buf<float> t32({B}), out32({B, dim}, 4);
  t.mem = {0.0, 0.375, 1.0};
  for (int64_t b = 0; b < B; ++b) t32.mem[b] = static_cast<float>(t.mem[b]);
  be->timestep_embedding(out.t, t.t, 1000.0f, 10000.0f);
  be->timestep_embedding(out32.t, t32.t, 1000.0f, 10000.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < half; ++k) {
      const double arg = 1000.0 * t.mem[b] * std::pow(10000.0, -static_cast<double>(k) / half);
      EXPECT_NEAR(out.at(b, k), std::cos(arg), 1e-12) << b << "," << k;
      EXPECT_NEAR(out.at(b, half + k), std::sin(arg), 1e-12) << b << "," << k;
      EXPECT_NEAR(out32.at(b, k), out.at(b, k), 6e-8) << b << "," << k;
      EXPECT_NEAR(out32.at(b, half + k), out.at(b, half + k), 6e-8) << b << "," << k;
    }
}

TEST_F(CpuOps, TokensHeadsRoundTripWithOffset) {
  const int64_t B = 2, NH = 3, D = 4, Lt = 3, Li = 5;
  Buf<double> txt({B, Lt, NH * D}, 2), img({B, Li, NH * D}, 1), heads({B, NH, Lt + Li, D});
  txt.randn(13), img.randn(14);
  be->tokens_to_heads(heads.t, txt.t, 0);
  be->tokens_to_heads(heads.t, img.t, Lt);
  // heads[b, h, offset + l, d] = tokens[b, l, h·D + d]
  EXPECT_EQ(heads.at((1 * NH + 2) * (Lt + Li) + Lt + 4, 3), img.at(1 * Li + 4, 2 * D + 3));
  EXPECT_EQ(heads.at((0 * NH + 1) * (Lt + Li) + 2, 0), txt.at(0 * Lt + 2, 1 * D + 0));
  Buf<double> img2({B, Li, NH * D}, 3), txt2({B, Lt, NH * D});
  be->heads_to_tokens(img2.t, heads.t, Lt);
  be->heads_to_tokens(txt2.t, heads.t, 0);
  EXPECT_EQ(img2.values(), img.values());
  EXPECT_EQ(txt2.values(), txt.values());
}

TEST_F(CpuOps, ConcatSplitRoundTrip) {
  const int64_t B = 2, La = 3, Lb = 4, C = 6;
  Buf<double> a({B, La, C}, 1), b({B, Lb, C}, 2), joint({B, La + Lb, C}, 3);
  a.randn(15), b.randn(16);
  be->concat_tokens(joint.t, a.t, b.t);
  EXPECT_EQ(joint.at(1 * (La + Lb) + La + 2, 5), b.at(1 * Lb + 2, 5));  // per sample, a first
  EXPECT_EQ(joint.at(1 * (La + Lb) + 1, 0), a.at(1 * La + 1, 0));
  Buf<double> a2({B, La, C}), b2({B, Lb, C}, 1);
  be->split_tokens(a2.t, b2.t, joint.t);
  EXPECT_EQ(a2.values(), a.values());
  EXPECT_EQ(b2.values(), b.values());
  Buf<double> b3({B, Lb, C});  // only the image part, as the model does before the final layer
  be->split_tokens(Tensor{}, b3.t, joint.t);
  EXPECT_EQ(b3.values(), b.values());
}

TEST_F(CpuOps, ElementwiseOpsHonourWindows) {
  Buf<double> a({4, 5}, 2), b({4, 5}, 1), y({4, 5}, 3);
  a.randn(17), b.randn(18), y.fill_padding(kNaN);
  be->add(y.t, a.t, b.t);
  EXPECT_EQ(y.at(3, 4), a.at(3, 4) + b.at(3, 4));
  be->accumulate(y.t, a.t);
  EXPECT_EQ(y.at(2, 1), (a.at(2, 1) + b.at(2, 1)) + a.at(2, 1));
  be->copy(y.t, b.t);
  EXPECT_EQ(y.values(), b.values());
  be->fill(y.t, 0.25);
  for (double v : y.values()) EXPECT_EQ(v, 0.25);
  EXPECT_TRUE(y.padding_is_nan());
}

// dw, db, dscale (parameter gradients) accumulate over calls (linear_backward's dw and db unless
// accumulate_params is false: then overwritten, their old contents — NaN here — never read);
// input gradients accumulate only when the flag says so.
TEST_F(CpuOps, AccumulateVersusOverwrite) {
  const int64_t N = 6, K = 5, M = 7;
  Buf<double> x({N, K}), w({M, K}), dy({N, M});
  x.randn(19), w.randn(20), dy.randn(21);
  Buf<double> dx1({N, K}), dw1({M, K}), db1({M}), dx2({N, K}), dw2({M, K}), db2({M});
  be->linear_backward(dx1.t, dw1.t, db1.t, dy.t, x.t, w.t, false, true);
  be->linear_backward(dx2.t, dw2.t, db2.t, dy.t, x.t, w.t, false, true);
  be->linear_backward(dx2.t, dw2.t, db2.t, dy.t, x.t, w.t, false, true);
  EXPECT_EQ(dx2.values(), dx1.values()) << "dx must be overwritten without accumulate_dx";
  for (size_t i = 0; i < dw1.mem.size(); ++i) EXPECT_NEAR(dw2.mem[i], 2 * dw1.mem[i], kExact);
  for (size_t i = 0; i < db1.mem.size(); ++i) EXPECT_NEAR(db2.mem[i], 2 * db1.mem[i], kExact);
  be->linear_backward(dx2.t, Tensor{}, Tensor{}, dy.t, x.t, w.t, true, true);
  for (size_t i = 0; i < dx1.mem.size(); ++i) EXPECT_NEAR(dx2.mem[i], 2 * dx1.mem[i], kExact);
  Buf<double> dw3({M, K}), db3({M});
  std::fill(dw3.mem.begin(), dw3.mem.end(), std::numeric_limits<double>::quiet_NaN());
  std::fill(db3.mem.begin(), db3.mem.end(), std::numeric_limits<double>::quiet_NaN());
  be->linear_backward(Tensor{}, dw3.t, db3.t, dy.t, x.t, w.t, false, false);
  EXPECT_EQ(dw3.values(), dw1.values()) << "dw must be overwritten without accumulate_params";
  EXPECT_EQ(db3.values(), db1.values()) << "db must be overwritten without accumulate_params";

  Buf<double> sx({N, K}), sdx({N, K}), sdx_acc({N, K});
  sx.randn(22);
  be->silu_backward(sdx.t, x.t, sx.t, false);
  be->silu_backward(sdx.t, x.t, sx.t, false);
  be->silu_backward(sdx_acc.t, x.t, sx.t, true);
  be->silu_backward(sdx_acc.t, x.t, sx.t, true);
  for (size_t i = 0; i < sdx.mem.size(); ++i) EXPECT_NEAR(sdx_acc.mem[i], 2 * sdx.mem[i], kExact);

  // LayerNorm: dx follows the flag; dshift/dscale are overwritten.
  const int64_t B = 2, L = 3, H = 5;
  Buf<double> lx({B, L, H}), mod({B, 2 * H}), ly({B, L, H}), mean({B * L}), rstd({B * L});
  Buf<double> ldy({B, L, H}), ldx({B, L, H}), dmod({B, 2 * H}), dmod2({B, 2 * H});
  lx.randn(23), mod.randn(24), ldy.randn(25);
  const Tensor shift = mod.t.cols_slice(0, H), scale = mod.t.cols_slice(H, H);
  be->layernorm_modulate(ly.t, mean.t, rstd.t, lx.t, shift, scale, 1e-6f);
  be->layernorm_modulate_backward(ldx.t, dmod.t.cols_slice(0, H), dmod.t.cols_slice(H, H), ldy.t, lx.t, mean.t, rstd.t,
                                  scale, false);
  const auto once = ldx.values();
  dmod2.randn(26);  // garbage that must be overwritten
  be->layernorm_modulate_backward(ldx.t, dmod2.t.cols_slice(0, H), dmod2.t.cols_slice(H, H), ldy.t, lx.t, mean.t,
                                  rstd.t, scale, true);
  EXPECT_EQ(dmod2.values(), dmod.values());
  for (size_t i = 0; i < once.size(); ++i) EXPECT_NEAR(ldx.values()[i], 2 * once[i], kExact);

  // RMSNorm: dscale accumulates, dx is overwritten.
  Buf<double> rx({N, 2 * K}), rsc({K}), ry({N, 2 * K}), rrs({N * 2}), rdy({N, 2 * K});
  Buf<double> rdx({N, 2 * K}), rds({K});
  rx.randn(27), rsc.randn(28), rdy.randn(29);
  be->rmsnorm_heads(ry.t, rrs.t, rx.t, rsc.t, 1e-6f);
  be->rmsnorm_heads_backward(rdx.t, rds.t, rdy.t, rx.t, rrs.t, rsc.t);
  const auto rdx1 = rdx.values(), rds1 = rds.values();
  be->rmsnorm_heads_backward(rdx.t, rds.t, rdy.t, rx.t, rrs.t, rsc.t);
  EXPECT_EQ(rdx.values(), rdx1);
  for (int64_t d = 0; d < K; ++d) EXPECT_NEAR(rds.mem[d], 2 * rds1[d], kExact);
}

TEST_F(CpuOps, AttentionAndGatedGradientsAreOverwritten) {
  const Shape s{1, 2, 9, 4};
  Buf<double> q(s), k(s), v(s), o(s), lse({1, 2, 9}), dout(s);
  q.randn(30), k.randn(31), v.randn(32), dout.randn(33);
  be->attention(o.t, lse.t, q.t, k.t, v.t, 0.5f);
  Buf<double> dq(s), dk(s), dv(s), dq2(s), dk2(s), dv2(s);
  be->attention_backward(dq.t, dk.t, dv.t, dout.t, q.t, k.t, v.t, o.t, lse.t, 0.5f);
  dq2.randn(34), dk2.randn(35), dv2.randn(36);
  be->attention_backward(dq2.t, dk2.t, dv2.t, dout.t, q.t, k.t, v.t, o.t, lse.t, 0.5f);
  EXPECT_EQ(dq2.values(), dq.values());
  EXPECT_EQ(dk2.values(), dk.values());
  EXPECT_EQ(dv2.values(), dv.values());
  // Undefined gradients are skipped without touching the others.
  Buf<double> dk3(s);
  be->attention_backward(Tensor{}, dk3.t, Tensor{}, dout.t, q.t, k.t, v.t, o.t, lse.t, 0.5f);
  EXPECT_EQ(dk3.values(), dk.values());

  Buf<double> y({2, 3, 4}), dx({2, 3, 4}), gate({2, 4}), dgate({2, 4});
  y.randn(37), dx.randn(38), gate.randn(39), dgate.randn(40);
  be->gated_residual_backward(Tensor{}, dgate.t, dx.t, y.t, gate.t);
  double ref = 0;
  for (int64_t l = 0; l < 3; ++l) ref += dx.at(3 + l, 2) * y.at(3 + l, 2);
  EXPECT_NEAR(dgate.at(1, 2), ref, kExact);

  // Out of place: out = x + gate ⊙ y, x untouched; in place gives the same values.
  Buf<double> x({2, 3, 4}), x_before({2, 3, 4}), out({2, 3, 4}, 2);
  x.randn(41);
  be->copy(x_before.t, x.t);
  be->gated_residual(out.t, x.t, y.t, gate.t);
  EXPECT_EQ(x.values(), x_before.values());
  EXPECT_NEAR(out.at(4, 1), x.at(4, 1) + gate.at(1, 1) * y.at(4, 1), kExact);
  be->gated_residual(x.t, x.t, y.t, gate.t);
  EXPECT_EQ(x.values(), out.values());
  Buf<double> wrong({2, 4, 4});
  const std::string msg = error_message([&] { be->gated_residual(wrong.t, x.t, y.t, gate.t); });
  EXPECT_NE(msg.find("gated_residual"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'out'"), std::string::npos) << msg;
}

TEST_F(CpuOps, ErrorsNameOpAndTensors) {
  Buf<double> x({3, 4}), w({5, 4}), y({3, 5});
  Buf<float> wf({5, 4});
  const std::string dtype_msg = error_message([&] { be->linear(y.t, x.t, wf.t, Tensor{}); });
  EXPECT_NE(dtype_msg.find("linear"), std::string::npos) << dtype_msg;
  EXPECT_NE(dtype_msg.find("'w'"), std::string::npos) << dtype_msg;
  EXPECT_NE(dtype_msg.find("f32[5, 4]"), std::string::npos) << dtype_msg;
  Buf<double> w_bad({5, 3});
  const std::string shape_msg = error_message([&] { be->linear(y.t, x.t, w_bad.t, Tensor{}); });
  EXPECT_NE(shape_msg.find("f64[5, 3]"), std::string::npos) << shape_msg;
  Buf<double> lse_bad({1, 2, 8});
  const Shape s{1, 2, 9, 4};
  Buf<double> q(s), o(s);
  const std::string attn_msg = error_message([&] { be->attention(o.t, lse_bad.t, q.t, q.t, q.t, 1.0f); });
  EXPECT_NE(attn_msg.find("attention: tensor 'lse'"), std::string::npos) << attn_msg;
  Buf<double> a({3, 4}), bb({3, 5});
  EXPECT_THROW(be->add(a.t, a.t, bb.t), Error);
}

TEST_F(CpuOps, AllocateIsAlignedAndZeroed) {
  for (size_t bytes : {size_t{1}, size_t{1000}, size_t{4096 + 4}}) {
    auto* p = static_cast<unsigned char*>(be->allocate(bytes));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u);
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(p[i], 0) << i;
    std::vector<unsigned char> host(bytes, 7), back(bytes);
    be->upload(p, host.data(), bytes);
    be->download(back.data(), p, bytes);
    EXPECT_EQ(back, host);
    be->release(p);
  }
}

}  // namespace
}  // namespace flux8::testing

namespace flux8::testing {
namespace {

// to_host / from_host of a bf16 tensor (an activation in bf16 storage; the CPU backend only moves
// its bytes): values go in rounded to nearest even (ties to even) and come back widened exactly.
TEST(Transfer, Bf16RoundsToNearestEvenAndWidensExactly) {
  const std::unique_ptr<Backend> be = make_backend("cpu");
  const std::vector<double> in = {1.0, 1.0 + 1.0 / 256, 1.0 + 3.0 / 256, -2.5, 1e-3, 65504.0};
  Tensor t(be->allocate(in.size() * 2), DType::bf16, Shape{static_cast<int64_t>(in.size())});
  from_host(*be, t, in);
  const std::vector<double> out = to_host(*be, t);
  // 1 + 2⁻⁸ is halfway between 1 and 1 + 2⁻⁷: to even (1); 1 + 3·2⁻⁸: to 1 + 2⁻⁶ (even mantissa).
  const std::vector<double> want = {1.0, 1.0, 1.0 + 4.0 / 256, -2.5, round_to_bf16(1e-3f), 65536.0};
  EXPECT_EQ(out, want);
  be->release(t.data);
}

}  // namespace
}  // namespace flux8::testing
