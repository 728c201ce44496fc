// Finite-difference checks of every CPU backward op, in f64, on shapes that are not multiples
// of 8 and with column-window (ld > cols) inputs and outputs. The tolerance 1e-6 is explained in
// gradcheck.h: a correct gradient agrees to ~1e-9, a wrong one is off by ≳1e-2.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "backend/backend.h"
#include "cpu_ops_util.h"
#include "gradcheck.h"

namespace flux8::testing {
namespace {

constexpr double kTol = 1e-6;
constexpr int64_t B = 2, L = 5, H = 20, NH = 2, D = 10, M = 37;

// `grad` must have the layout of `param` (same shape and padding).
void expect_gradient(const char* what, const std::function<double()>& loss, Buf<double>& param,
                     const Buf<double>& grad, uint64_t seed) {
  ASSERT_EQ(param.mem.size(), grad.mem.size()) << what;
  const auto r = check_directional_derivative(loss, param.mem, grad.mem, seed);
  EXPECT_LT(r.rel_error, kTol) << what << ": analytic " << r.analytic << ", numeric " << r.numeric;
}

class CpuGradcheck : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_backend("cpu");
};

TEST_F(CpuGradcheck, Linear) {
  Buf<double> x({B, L, H}, 3), w({M, H}, 2), b({M}), y({B, L, M}, 4), probe({B, L, M}, 1);
  x.randn(1), w.randn(2, 0.3), b.randn(3), probe.randn(4);
  const auto loss = [&] {
    be->linear(y.t, x.t, w.t, b.t);
    return probe_loss(y, probe);
  };
  loss();
  Buf<double> dx({B, L, H}, 3), dw({M, H}, 2), db({M});
  be->linear_backward(dx.t, dw.t, db.t, probe.t, x.t, w.t, false, true);
  expect_gradient("linear dx", loss, x, dx, 11);
  expect_gradient("linear dw", loss, w, dw, 12);
  expect_gradient("linear db", loss, b, db, 13);
}

TEST_F(CpuGradcheck, Activations) {
  for (bool gelu : {false, true}) {
    Buf<double> x({B, L, M}, 3), y({B, L, M}, 1), probe({B, L, M}, 2);
    x.randn(5, 2.0), probe.randn(6);
    const auto loss = [&] {
      gelu ? be->gelu_tanh(y.t, x.t) : be->silu(y.t, x.t);
      return probe_loss(y, probe);
    };
    Buf<double> dx({B, L, M}, 3);
    gelu ? be->gelu_tanh_backward(dx.t, probe.t, x.t)
         : be->silu_backward(dx.t, probe.t, x.t, false);
    expect_gradient(gelu ? "gelu_tanh dx" : "silu dx", loss, x, dx, 14);
  }
}

// shift and scale are column windows of one modulation output [B, 3H], as in the model.
TEST_F(CpuGradcheck, LayerNormModulate) {
  Buf<double> x({B, L, H}, 2), mod({B, 3 * H}, 1), y({B, L, H}, 3), probe({B, L, H});
  Buf<double> mean({B * L}), rstd({B * L});
  x.randn(7, 3.0), mod.randn(8, 0.5), probe.randn(9);
  for (double& v : x.mem) v += 1.5;  // a non-zero mean exercises the centring
  const Tensor shift = mod.t.cols_slice(0, H), scale = mod.t.cols_slice(H, H);
  const auto loss = [&] {
    be->layernorm_modulate(y.t, mean.t, rstd.t, x.t, shift, scale, 1e-6f);
    return probe_loss(y, probe);
  };
  loss();
  Buf<double> dx({B, L, H}, 2), dmod({B, 3 * H}, 1);
  be->layernorm_modulate_backward(dx.t, dmod.t.cols_slice(0, H), dmod.t.cols_slice(H, H), probe.t,
                                  x.t, mean.t, rstd.t, scale, false);
  expect_gradient("layernorm dx", loss, x, dx, 15);
  expect_gradient("layernorm dshift/dscale", loss, mod, dmod, 16);
}

// x is the K window of a fused [Q|K|V] row, as QK-norm reads it.
TEST_F(CpuGradcheck, RmsNormHeads) {
  Buf<double> qkv({B * L, 3 * H}, 1), scale({D}), y({B * L, H}, 2), probe({B * L, H}, 2);
  Buf<double> rstd({B * L * NH});
  qkv.randn(17, 2.0), scale.randn(18, 0.5), probe.randn(19);
  const Tensor x = qkv.t.cols_slice(H, H);
  const auto loss = [&] {
    be->rmsnorm_heads(y.t, rstd.t, x, scale.t, 1e-6f);
    return probe_loss(y, probe);
  };
  loss();
  Buf<double> dqkv({B * L, 3 * H}, 1), dscale({D});
  be->rmsnorm_heads_backward(dqkv.t.cols_slice(H, H), dscale.t, probe.t, x, rstd.t, scale.t);
  expect_gradient("rmsnorm dx", loss, qkv, dqkv, 20);
  expect_gradient("rmsnorm dscale", loss, scale, dscale, 21);
}

TEST_F(CpuGradcheck, Rope) {
  const int axes[] = {2, 4, 4};
  Buf<double> ids({B, L, 3}), pe({B, L, D / 2, 2});
  ids.randn(22, 4.0);
  be->rope_table(pe.t, ids.t, axes, 10000.0);
  Buf<double> x({B, NH, L, D}, 2), work({B, NH, L, D}, 2), probe({B, NH, L, D});
  x.randn(23), probe.randn(24);
  const auto loss = [&] {
    be->copy(work.t, x.t);
    be->rope(work.t, pe.t, false);
    return probe_loss(work, probe);
  };
  Buf<double> dx({B, NH, L, D}, 2);
  be->copy(dx.t, probe.t);
  be->rope(dx.t, pe.t, true);  // the backward of a rotation is the inverse rotation
  expect_gradient("rope dx", loss, x, dx, 25);
}

// One stream (L tokens at offset 3 of an (L + 3)-token joint sequence) through QK-norm, RoPE
// and the head layout; q, k, v are column windows of one padded [Q|K|V] row, as in the model.
TEST_F(CpuGradcheck, QkNormRopeToHeads) {
  const int axes[] = {2, 4, 4};
  const int64_t offset = 3, J = L + offset;
  Buf<double> ids({B, J, 3}), pe({B, J, D / 2, 2});
  ids.randn(48, 4.0);
  be->rope_table(pe.t, ids.t, axes, 10000.0);
  const Shape heads{B, NH, J, D};
  Buf<double> qkv({B, L, 3 * H}, 1), q_scale({D}), k_scale({D}), q_rstd({B * L * NH}), k_rstd({B * L * NH});
  Buf<double> qh(heads), kh(heads), vh(heads), pq(heads), pk(heads), pv(heads);
  qkv.randn(49, 2.0), q_scale.randn(50, 0.5), k_scale.randn(51, 0.5), pq.randn(52), pk.randn(53), pv.randn(54);
  const Tensor q = qkv.t.cols_slice(0, H), k = qkv.t.cols_slice(H, H), v = qkv.t.cols_slice(2 * H, H);
  const auto loss = [&] {
    be->qk_norm_rope_to_heads(qh.t, kh.t, vh.t, q_rstd.t, k_rstd.t, q, k, v, q_scale.t, k_scale.t, pe.t, offset,
                              1e-6f);
    return probe_loss(qh, pq) + probe_loss(kh, pk) + probe_loss(vh, pv);
  };
  loss();
  Buf<double> dqkv({B, L, 3 * H}, 1), dq_scale({D}), dk_scale({D});
  be->qk_norm_rope_to_heads_backward(dqkv.t.cols_slice(0, H), dqkv.t.cols_slice(H, H), dqkv.t.cols_slice(2 * H, H),
                                     dq_scale.t, dk_scale.t, pq.t, pk.t, pv.t, q, k, q_rstd.t, k_rstd.t, q_scale.t,
                                     k_scale.t, pe.t, offset);
  expect_gradient("qk_norm_rope_to_heads d[Q|K|V]", loss, qkv, dqkv, 55);
  expect_gradient("qk_norm_rope_to_heads dq_scale", loss, q_scale, dq_scale, 56);
  expect_gradient("qk_norm_rope_to_heads dk_scale", loss, k_scale, dk_scale, 57);
}

// L = 133 spans two query blocks of the implementation (128 + 5), so the dK/dV sums over
// blocks are checked too.
TEST_F(CpuGradcheck, Attention) {
  for (int64_t len : {int64_t{5}, int64_t{133}}) {
    const Shape s{B, NH, len, D};
    Buf<double> q(s, 1), k(s, 2), v(s), o(s, 3), probe(s), lse({B, NH, len});
    q.randn(26), k.randn(27), v.randn(28), probe.randn(29);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const auto loss = [&] {
      be->attention(o.t, lse.t, q.t, k.t, v.t, scale);
      return probe_loss(o, probe);
    };
    loss();
    Buf<double> dq(s, 1), dk(s, 2), dv(s);
    be->attention_backward(dq.t, dk.t, dv.t, probe.t, q.t, k.t, v.t, o.t, lse.t, scale);
    SCOPED_TRACE(len);
    expect_gradient("attention dq", loss, q, dq, 30);
    expect_gradient("attention dk", loss, k, dk, 31);
    expect_gradient("attention dv", loss, v, dv, 32);
  }
}

TEST_F(CpuGradcheck, GatedResidual) {
  Buf<double> x0({B, L, H}, 1), out({B, L, H}, 3), y({B, L, H}, 2), mod({B, 3 * H}, 1);
  Buf<double> probe({B, L, H}, 1);
  x0.randn(33), y.randn(34), mod.randn(35), probe.randn(36);
  const Tensor gate = mod.t.cols_slice(2 * H, H);
  const auto loss = [&] {
    be->gated_residual(out.t, x0.t, y.t, gate);  // out of place: x0 is the probed input
    return probe_loss(out, probe);
  };
  Buf<double> dy({B, L, H}, 2), dmod({B, 3 * H}, 1);
  be->gated_residual_backward(dy.t, dmod.t.cols_slice(2 * H, H), probe.t, y.t, gate);
  Buf<double> dx0({B, L, H}, 1);  // the identity path: dx0 = probe, with zero padding
  be->copy(dx0.t, probe.t);
  expect_gradient("gated_residual dx (identity)", loss, x0, dx0, 37);
  expect_gradient("gated_residual dy", loss, y, dy, 38);
  expect_gradient("gated_residual dgate", loss, mod, dmod, 39);
}

// Layout ops have no backward of their own: each is the other's adjoint.
TEST_F(CpuGradcheck, LayoutAdjoints) {
  const int64_t Lt = 3, Li = 5;
  Buf<double> tokens({B, Li, NH * D}, 2), heads({B, NH, Lt + Li, D}), probe({B, NH, Lt + Li, D});
  tokens.randn(40), probe.randn(41);
  const auto loss = [&] {
    be->tokens_to_heads(heads.t, tokens.t, Lt);
    return probe_loss(heads, probe);
  };
  Buf<double> dtokens({B, Li, NH * D}, 2);
  be->heads_to_tokens(dtokens.t, probe.t, Lt);
  expect_gradient("tokens_to_heads", loss, tokens, dtokens, 42);

  Buf<double> a({B, Lt, H}, 1), b({B, Li, H}), joint({B, Lt + Li, H}, 3), jprobe({B, Lt + Li, H});
  a.randn(43), b.randn(44), jprobe.randn(45);
  const auto cat_loss = [&] {
    be->concat_tokens(joint.t, a.t, b.t);
    return probe_loss(joint, jprobe);
  };
  Buf<double> da({B, Lt, H}, 1), dbb({B, Li, H});
  be->split_tokens(da.t, dbb.t, jprobe.t);
  expect_gradient("concat_tokens a", cat_loss, a, da, 46);
  expect_gradient("concat_tokens b", cat_loss, b, dbb, 47);
}

}  // namespace
}  // namespace flux8::testing
