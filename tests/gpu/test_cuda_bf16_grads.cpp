// Parameter gradients stored in bf16 (grad_precision: bf16, Backend::gradient_dtype) on the CUDA
// backend. Every writer sums as it does for f32 gradients and rounds once as it stores (+= reads
// the old bf16 value back), so a bf16 gradient is the f32 path's value rounded to nearest even:
// bit for bit where the sums are the same (the column sums — bias and QK-norm scale gradients),
// within one bf16 ulp where a GEMM may take another algorithm for a bf16 output (weight
// gradients). The readers, the gradient norm and AdamW, equal the CPU's on the f32 values of the
// same bf16 numbers. The model-level check is CudaModel.Bf16GradientsAreF32GradientsRounded.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>

#include "fp8_test_util.h"
#include "gpu_test_util.h"
#include "model/flux_model.h"
#include "model_test_util.h"

namespace flux8::testing {
namespace {

// The same start values in an f32 twin and a bf16 gradient (values representable in bf16).
void same_start(Pair& f32, Bf16Pair& bf16, uint64_t seed, double stddev) {
  bf16.randn(seed, stddev);
  f32.host.mem = bf16.host.mem;
  f32.up();
}

TEST(CudaBf16Grads, GradientTypeFollowsTheOption) {
  FLUX8_REQUIRE_GPU();
  EXPECT_EQ(gpu_bf16_grads().gradient_dtype(DType::f32), DType::bf16);
  EXPECT_EQ(gpu_bf16_activations().gradient_dtype(DType::f32), DType::f32);
  BackendOptions o;
  o.bf16_grads = true;
  EXPECT_EQ(make_backend("cpu", o)->gradient_dtype(DType::f32), DType::f32);  // the CPU keeps f32 gradients
  // The model's store allocates its gradient buffer so; parameters stay f32.
  FluxModel model(odd_config(1, 1, false), gpu_bf16_grads());
  EXPECT_EQ(model.params().grad_dtype(), DType::bf16);
  EXPECT_EQ(model.params().flat_grads().dtype, DType::bf16);
  EXPECT_EQ(model.params().grad("img_in.weight").dtype, DType::bf16);
  EXPECT_EQ(model.params().flat_params().dtype, DType::f32);
}

// linear_backward's dw (the wgrad GEMM's output type) and db (column sums) in bf16, overwritten
// and accumulated, on bf16 activations, on f32 activations with bf16 GEMM operands, and with
// exact f32 GEMMs (for which cuBLASLt has no bf16 output: an f32 temporary, rounded), odd sizes.
TEST(CudaBf16Grads, LinearBackwardRoundsItsSums) {
  FLUX8_REQUIRE_GPU();
  const int64_t N = 37, K = 45, M = 29;
  Pair dy32({N, M}), x32({N, K}), w({M, K});
  Bf16Pair dy16({N, M}), x16({N, K});
  same_start(dy32, dy16, 1, 1.0);
  same_start(x32, x16, 2, 1.0);
  w.randn(3);
  for (Backend* be : {&gpu_bf16_activations(), &gpu_bf16_gemm(), &gpu()}) {
    const bool act16 = be == &gpu_bf16_activations();
    SCOPED_TRACE(act16 ? "bf16 activations" : be == &gpu() ? "f32 GEMMs" : "bf16 GEMM operands");
    const Tensor dy = act16 ? dy16.dev : dy32.dev, x = act16 ? x16.dev : x32.dev;
    for (const bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "accumulated" : "overwritten");
      Pair dw32({M, K}), db32({M});
      Bf16Pair dw16({M, K}), db16({M});
      same_start(dw32, dw16, 4, 0.5);
      same_start(db32, db16, 5, 0.5);
      be->linear_backward(Tensor{}, dw32.dev, db32.dev, dy, x, w.dev, false, accumulate);
      be->linear_backward(Tensor{}, dw16.dev, db16.dev, dy, x, w.dev, false, accumulate);
      be->synchronize();
      EXPECT_EQ(db16.all_bits(), bf16_bits_of(db32.down()));  // the same sums, rounded once more
      EXPECT_EQ(beyond_one_bf16_ulp(dw16.down(), dw32.down()), 0);
      EXPECT_LE(rel_l2(dw16.down(), dw32.down()), 4e-3);  // and not all at the bound
    }
  }
  // Mixed gradient types in one call are refused, naming the tensor.
  Pair db32({M});
  Bf16Pair dw16({M, K});
  expect_refused("'db'",
                 [&] { gpu().linear_backward(Tensor{}, dw16.dev, db32.dev, dy32.dev, x32.dev, w.dev, false, false); });
}

// Quantize::column_sums (an FP8 Linear's bias gradient, summed in the cast of its output
// gradient) into a bf16 vector: every recipe, with and without the casts' tiles to sum in,
// overwritten and accumulated, from f32 and bf16 activations.
TEST(CudaBf16Grads, CastColumnSumsIntoBf16) {
  FLUX8_REQUIRE_GPU();
  expect_column_sums_match_cpu<Pair, Bf16Pair>();
  expect_column_sums_match_cpu<Bf16Pair, Bf16Pair>();
}

// The QK-norm backward's scale gradients (they accumulate: one call per stream) in bf16, on the
// vector path (D = 8·2^k, rows aligned) and the pair path (pad 1, D = 6; pad 2): the f32 path's
// sums rounded, bit for bit, and the same head gradients.
TEST(CudaBf16Grads, QkNormScaleGradientsRoundTheirSums) {
  FLUX8_REQUIRE_GPU();
  struct Case {
    int64_t D, n, Ls, pad;
  };
  for (const Case& c : {Case{128, 3, 37, 0}, Case{8, 3, 11, 0}, Case{6, 3, 11, 1}, Case{128, 3, 37, 2}}) {
    SCOPED_TRACE(::testing::Message() << "D=" << c.D << " Ls=" << c.Ls << " pad=" << c.pad);
    const int64_t B = 2, Lt = 5, L = Lt + c.Ls, D = c.D, H = c.n * D, S = B * c.Ls * c.n;
    const Shape heads{B, c.n, L, D};
    Pair pe({B, L, D / 2, 2}), q_scale({D}), k_scale({D}), q_rstd({S}), k_rstd({S});
    pe.randn(11), q_scale.randn(12), k_scale.randn(13);
    for (size_t i = 0; i < q_rstd.host.mem.size(); ++i) {
      q_rstd.host.mem[i] = 0.5f + 0.1f * static_cast<float>(i % 7);
      k_rstd.host.mem[i] = 0.7f + 0.1f * static_cast<float>(i % 5);
    }
    q_rstd.up(), k_rstd.up();
    Bf16Pair tok({B, c.Ls, 3 * H}, c.pad), dqh(heads), dkh(heads), dvh(heads);
    tok.randn(14, 2.0), dqh.randn(15), dkh.randn(16), dvh.randn(17);
    Bf16Pair d32({B, c.Ls, 3 * H}, c.pad), d16({B, c.Ls, 3 * H}, c.pad);
    Pair dqs32({D}), dks32({D});
    Bf16Pair dqs16({D}), dks16({D});
    same_start(dqs32, dqs16, 18, 0.5);
    same_start(dks32, dks16, 19, 0.5);
    const auto win = [&](const Bf16Pair& p, int64_t i) { return p.dev.cols_slice(i * H, H); };
    const auto backward = [&](const Bf16Pair& d, const Tensor& dqs, const Tensor& dks) {
      gpu().qk_norm_rope_to_heads_backward(win(d, 0), win(d, 1), win(d, 2), dqs, dks, dqh.dev, dkh.dev, dvh.dev,
                                           win(tok, 0), win(tok, 1), q_rstd.dev, k_rstd.dev, q_scale.dev, k_scale.dev,
                                           pe.dev, Lt);
    };
    backward(d32, dqs32.dev, dks32.dev);
    backward(d16, dqs16.dev, dks16.dev);
    gpu().synchronize();
    EXPECT_EQ(dqs16.all_bits(), bf16_bits_of(dqs32.down()));
    EXPECT_EQ(dks16.all_bits(), bf16_bits_of(dks32.down()));
    EXPECT_EQ(d16.all_bits(), d32.all_bits());  // the head gradients do not depend on the scales' type
  }
}

// The gradient norm over bf16 gradients (16-byte loads of 8; sizes with a partial last load and
// views not 16-byte aligned, low-rank ranges whose flat elements hold NaN) and sum_squares of a
// bf16 tensor equal the CPU's over the f32 values of the same numbers, up to the order of their
// double sums; AdamW reading bf16 gradients (4 at a time, and one by one) equals the CPU's bit for
// bit, with a bf16 operand copy and low-rank gradients beside it; a non-finite bf16 gradient
// shows in the norm.
TEST(CudaBf16Grads, NormAndAdamWReadBf16Gradients) {
  FLUX8_REQUIRE_GPU();
  for (const int64_t size : {int64_t(70001), int64_t(3 * 65536 + 5), int64_t(4099)}) {
    SCOPED_TRACE(size);
    Bf16Pair xs({size});
    xs.randn(20 + static_cast<uint64_t>(size));
    double sq[2];
    run_both([&](Backend& be, bool g) { sq[g] = be.sum_squares(xs.t(g)); });
    EXPECT_NEAR(sq[1], sq[0], 1e-12 * sq[0]);
    for (const int64_t from : {int64_t(1), int64_t(8)}) {  // the element path; aligned 16-byte loads
      const auto view = [&](bool g) {
        Tensor t = xs.t(g);
        t.data = static_cast<char*>(t.data) + from * dtype_size(t.dtype);
        t.shape = Shape{size - from};
        t.ld = size - from;
        return t;
      };
      run_both([&](Backend& be, bool g) { sq[g] = be.sum_squares(view(g)); });
      EXPECT_NEAR(sq[1], sq[0], 1e-12 * sq[0]) << "from element " << from;
    }
  }

  const int64_t n = 200003;
  const LowRankFactors factors({{1000, 2, 37, 64}, {5001, 3, 13, 7}, {20000, 5, 300, 512}}, 42);
  Bf16Pair gr({n});
  gr.randn(41, 0.01);
  factors.plant_nan(gr);
  expect_norm_and_adamw_match_cpu(gr, factors);

  // Views from element 1: the gradient 2-byte aligned only, AdamW element by element.
  gr.randn(43, 0.01);  // finite everywhere: no low-rank ranges this time
  Pair p({n}), m({n}), v({n});
  p.randn(61), m.randn(62, 0.001), v.fill(1e-6f);
  const auto from1 = [&](auto& x, bool g) {
    Tensor t = x.t(g);
    t.data = static_cast<char*>(t.data) + dtype_size(t.dtype);
    t.shape = Shape{n - 1};
    t.ld = n - 1;
    return t;
  };
  const Backend::AdamW h{1e-3, 0.9, 0.95, 1e-8, 0.1, 0.6, 3};
  run_both([&](Backend& be, bool g) { be.adamw(from1(p, g), from1(gr, g), from1(m, g), from1(v, g), h, {}, {}, {}); });
  EXPECT_EQ(p.down(), p.host.mem);
  EXPECT_EQ(m.down(), m.host.mem);
  EXPECT_EQ(v.down(), v.host.mem);

  gr.host.mem[12345] = std::numeric_limits<float>::infinity();
  gr.up();
  EXPECT_TRUE(std::isinf(gpu().gradient_sum_squares(gr.dev, factors.on(true))));
  EXPECT_TRUE(std::isinf(gpu().sum_squares(gr.dev)));
}

}  // namespace
}  // namespace flux8::testing
