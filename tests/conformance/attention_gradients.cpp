// Gradient checks of the attention family in f64: rope (its inverse is its backward), the
// layouts (each the other's adjoint), the fused QK-norm + RoPE + head layout, and attention.
#include <cmath>

#include "backend/ops.h"
#include "conformance.h"
#include "gradient_check.h"

namespace flux8::conformance {
namespace {

using Checks = std::vector<GradientCase::Check>;
constexpr int64_t B = 2, L = 5, H = 20, NH = 2, D = 10;
const int kAxes[] = {2, 4, 4};

Checks rope_gradient(Backend& be) {
  Buf<double> ids({B, L, 3}), pe({B, L, D / 2, 2});
  ids.randn(22, 4.0);
  be.rope_table(pe.t, ids.t, kAxes, 10000.0);
  Buf<double> x({B, NH, L, D}, 2), work({B, NH, L, D}, 2), probe({B, NH, L, D});
  x.randn(23), probe.randn(24);
  const auto loss = [&] {
    be.copy(work.t, x.t);
    be.rope(work.t, pe.t, false);
    return probe_loss(work, probe);
  };
  Buf<double> dx({B, NH, L, D}, 2);
  be.copy(dx.t, probe.t);
  be.rope(dx.t, pe.t, true);
  return {check_gradient("dx", loss, x, dx, 25)};
}

Checks tokens_to_heads_gradient(Backend& be) {
  const int64_t Lt = 3;
  Buf<double> tokens({B, L, NH * D}, 2), heads({B, NH, Lt + L, D}), probe({B, NH, Lt + L, D});
  tokens.randn(40), probe.randn(41);
  const auto loss = [&] {
    be.tokens_to_heads(heads.t, tokens.t, Lt);
    return probe_loss(heads, probe);
  };
  Buf<double> dtokens({B, L, NH * D}, 2);
  be.heads_to_tokens(dtokens.t, probe.t, Lt);
  return {check_gradient("dtokens", loss, tokens, dtokens, 42)};
}

Checks concat_gradient(Backend& be) {
  const int64_t Lt = 3;
  Buf<double> a({B, Lt, H}, 1), b({B, L, H}), joint({B, Lt + L, H}, 3), probe({B, Lt + L, H});
  a.randn(43), b.randn(44), probe.randn(45);
  const auto loss = [&] {
    be.concat_tokens(joint.t, a.t, b.t);
    return probe_loss(joint, probe);
  };
  Buf<double> da({B, Lt, H}, 1), db({B, L, H});
  be.split_tokens(da.t, db.t, probe.t);
  return {check_gradient("da", loss, a, da, 46), check_gradient("db", loss, b, db, 47)};
}

// One stream (L tokens at offset 3 of an (L + 3)-token joint sequence); q, k, v are column
// windows of one padded [Q|K|V] row, as in the model.
Checks qk_norm_rope_gradient(Backend& be) {
  const int64_t offset = 3, J = L + offset;
  Buf<double> ids({B, J, 3}), pe({B, J, D / 2, 2});
  ids.randn(48, 4.0);
  be.rope_table(pe.t, ids.t, kAxes, 10000.0);
  const Shape heads{B, NH, J, D};
  Buf<double> qkv({B, L, 3 * H}, 1), q_scale({D}), k_scale({D}), q_rstd({B * L * NH}), k_rstd({B * L * NH});
  Buf<double> qh(heads), kh(heads), vh(heads), pq(heads), pk(heads), pv(heads);
  qkv.randn(49, 2.0), q_scale.randn(50, 0.5), k_scale.randn(51, 0.5), pq.randn(52), pk.randn(53), pv.randn(54);
  const Tensor q = qkv.t.cols_slice(0, H), k = qkv.t.cols_slice(H, H), v = qkv.t.cols_slice(2 * H, H);
  const auto loss = [&] {
    be.qk_norm_rope_to_heads(qh.t, kh.t, vh.t, q_rstd.t, k_rstd.t, q, k, v, q_scale.t, k_scale.t, pe.t, offset, 1e-6);
    return probe_loss(qh, pq) + probe_loss(kh, pk) + probe_loss(vh, pv);
  };
  loss();
  Buf<double> dqkv({B, L, 3 * H}, 1), dq_scale({D}), dk_scale({D});
  be.qk_norm_rope_to_heads_backward(dqkv.t.cols_slice(0, H), dqkv.t.cols_slice(H, H), dqkv.t.cols_slice(2 * H, H),
                                    dq_scale.t, dk_scale.t, pq.t, pk.t, pv.t, q, k, q_rstd.t, k_rstd.t, q_scale.t,
                                    k_scale.t, pe.t, offset);
  return {check_gradient("d[Q|K|V]", loss, qkv, dqkv, 55), check_gradient("dq_scale", loss, q_scale, dq_scale, 56),
          check_gradient("dk_scale", loss, k_scale, dk_scale, 57)};
}

// L = 133 spans two query blocks of the CPU implementation (128 + 5): the dK/dV sums over blocks.
Checks attention_gradient(Backend& be) {
  Checks out;
  for (int64_t len : {int64_t{5}, int64_t{133}}) {
    const Shape s{B, NH, len, D};
    Buf<double> q(s, 1), k(s, 2), v(s), o(s, 3), probe(s), lse({B, NH, len});
    q.randn(26), k.randn(27), v.randn(28), probe.randn(29);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    const auto loss = [&] {
      be.attention(o.t, lse.t, q.t, k.t, v.t, scale);
      return probe_loss(o, probe);
    };
    loss();
    Buf<double> dq(s, 1), dk(s, 2), dv(s);
    be.attention_backward(dq.t, dk.t, dv.t, probe.t, q.t, k.t, v.t, o.t, lse.t, scale);
    const std::string at = " (L = " + std::to_string(len) + ")";
    out.push_back(check_gradient(("dq" + at).c_str(), loss, q, dq, 30));
    out.push_back(check_gradient(("dk" + at).c_str(), loss, k, dk, 31));
    out.push_back(check_gradient(("dv" + at).c_str(), loss, v, dv, 32));
  }
  return out;
}

const Cases kAttentionGradients(
    {}, {
            {.forward = "rope", .backward = "rope_inverse", .run = rope_gradient},
            {.forward = "tokens_to_heads", .backward = "heads_to_tokens", .run = tokens_to_heads_gradient},
            {.forward = "concat_tokens", .backward = "split_tokens", .run = concat_gradient},
            {.forward = "qk_norm_rope_to_heads",
             .backward = "qk_norm_rope_to_heads_backward",
             .run = qk_norm_rope_gradient},
            {.forward = "attention", .backward = "attention_backward", .run = attention_gradient},
        });

}  // namespace
}  // namespace flux8::conformance
