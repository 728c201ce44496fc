// qk_norm_rope_to_heads and its backward on the CPU backend are the unfused chain the model ran
// before, bit for bit: rmsnorm_heads → tokens_to_heads per stream, then rope once over the joint
// sequence; and rope(inverse) over the joint gradients → heads_to_tokens → rmsnorm_heads_backward
// per stream. Shapes are odd on purpose: 3 samples, two streams of 5 and 7 tokens (offsets 0
// and 5 of a 12-token joint sequence), q/k/v as column windows of a padded [Q|K|V] row; in f64,
// f32 and f32 with bf16 activation rounding (where every op rounds its output). Also: outputs
// left undefined are skipped, and argument errors name the op and the tensor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "cpu_ops_util.h"
#include "test_util.h"

namespace flux8::testing {
namespace {

constexpr int64_t B = 3, NH = 2, D = 10, H = NH * D, Lt = 5, Li = 7, L = Lt + Li, kPad = 3;
constexpr double kEps = 1e-6;

// Bitwise equality (so −0 vs +0 and NaN payloads count); names the first difference.
template <typename T>
::testing::AssertionResult same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0)
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}

// Everything one run needs: the joint RoPE table, both streams' [Q|K|V] rows and the norm scales.
template <typename T>
struct Inputs {
  Buf<T> ids{{B, L, 3}}, pe{{B, L, D / 2, 2}};
  Buf<T> txt{{B, Lt, 3 * H}, kPad}, img{{B, Li, 3 * H}, kPad};
  Buf<T> q_scale{{D}}, k_scale{{D}};

  explicit Inputs(Backend& be) {
    const int axes[] = {2, 4, 4};
    ids.randn(1, 5.0);
    be.rope_table(pe.t, ids.t, axes, 10000.0);
    txt.randn(2, 2.0), img.randn(3, 2.0), q_scale.randn(4), k_scale.randn(5);
  }
  Buf<T>& stream(int s) { return s == 0 ? txt : img; }
  static int64_t offset(int s) { return s == 0 ? 0 : Lt; }
  static int64_t tokens(int s) { return s == 0 ? Lt : Li; }
};

template <typename T>
Tensor part(Buf<T>& qkv, int i) {  // 0: q, 1: k, 2: v
  return qkv.t.cols_slice(i * H, H);
}

// The forward's outputs: joint q, k, v and each stream's statistics.
template <typename T>
struct Heads {
  Buf<T> q{{B, NH, L, D}}, k{{B, NH, L, D}}, v{{B, NH, L, D}};
  Buf<T> q_rstd[2]{Buf<T>({B * Lt * NH}), Buf<T>({B * Li * NH})};
  Buf<T> k_rstd[2]{Buf<T>({B * Lt * NH}), Buf<T>({B * Li * NH})};
};

// The model's former chain.
template <typename T>
void forward_chain(Backend& be, Inputs<T>& in, Heads<T>& out) {
  for (int s = 0; s < 2; ++s) {
    Buf<T> normed({B, in.tokens(s), H});
    be.rmsnorm_heads(normed.t, out.q_rstd[s].t, part(in.stream(s), 0), in.q_scale.t, kEps);
    be.tokens_to_heads(out.q.t, normed.t, in.offset(s));
    be.rmsnorm_heads(normed.t, out.k_rstd[s].t, part(in.stream(s), 1), in.k_scale.t, kEps);
    be.tokens_to_heads(out.k.t, normed.t, in.offset(s));
    be.tokens_to_heads(out.v.t, part(in.stream(s), 2), in.offset(s));
  }
  be.rope(out.q.t, in.pe.t, false);
  be.rope(out.k.t, in.pe.t, false);
}

template <typename T>
void forward_fused(Backend& be, Inputs<T>& in, Heads<T>& out, int s) {
  be.qk_norm_rope_to_heads(out.q.t, out.k.t, out.v.t, out.q_rstd[s].t, out.k_rstd[s].t, part(in.stream(s), 0),
                           part(in.stream(s), 1), part(in.stream(s), 2), in.q_scale.t, in.k_scale.t, in.pe.t,
                           in.offset(s), kEps);
}

// Gradients of one run: d[Q|K|V] per stream (padded like the inputs) and the scale gradients.
template <typename T>
struct Grads {
  Buf<T> dqkv[2]{Buf<T>({B, Lt, 3 * H}, kPad), Buf<T>({B, Li, 3 * H}, kPad)};
  Buf<T> dq_scale{{D}}, dk_scale{{D}};
  Grads() {
    // Garbage that must be overwritten, NaN padding that must stay, scale gradients that
    // must be accumulated into.
    for (int s = 0; s < 2; ++s) dqkv[s].randn(10 + s).fill_padding(std::numeric_limits<T>::quiet_NaN());
    dq_scale.randn(12), dk_scale.randn(13);
  }
};

template <typename T>
void backward_chain(Backend& be, Inputs<T>& in, Heads<T>& fwd, Heads<T>& dheads, Grads<T>& g) {
  Buf<T> dq({B, NH, L, D}), dk({B, NH, L, D});
  be.copy(dq.t, dheads.q.t);
  be.copy(dk.t, dheads.k.t);
  be.rope(dq.t, in.pe.t, true);
  be.rope(dk.t, in.pe.t, true);
  for (int s = 0; s < 2; ++s) {
    Buf<T> d_h({B, in.tokens(s), H});
    be.heads_to_tokens(d_h.t, dq.t, in.offset(s));
    be.rmsnorm_heads_backward(part(g.dqkv[s], 0), g.dq_scale.t, d_h.t, part(in.stream(s), 0), fwd.q_rstd[s].t,
                              in.q_scale.t);
    be.heads_to_tokens(d_h.t, dk.t, in.offset(s));
    be.rmsnorm_heads_backward(part(g.dqkv[s], 1), g.dk_scale.t, d_h.t, part(in.stream(s), 1), fwd.k_rstd[s].t,
                              in.k_scale.t);
    be.heads_to_tokens(part(g.dqkv[s], 2), dheads.v.t, in.offset(s));
  }
}

template <typename T>
void backward_fused(Backend& be, Inputs<T>& in, Heads<T>& fwd, Heads<T>& dheads, Grads<T>& g, int s) {
  be.qk_norm_rope_to_heads_backward(part(g.dqkv[s], 0), part(g.dqkv[s], 1), part(g.dqkv[s], 2), g.dq_scale.t,
                                    g.dk_scale.t, dheads.q.t, dheads.k.t, dheads.v.t, part(in.stream(s), 0),
                                    part(in.stream(s), 1), fwd.q_rstd[s].t, fwd.k_rstd[s].t, in.q_scale.t, in.k_scale.t,
                                    in.pe.t, in.offset(s));
}

template <typename T>
void expect_fused_equals_chain(Backend& be) {
  Inputs<T> in(be);
  Heads<T> ref, fused;
  forward_chain(be, in, ref);
  // NaN sentinels: the image stream alone must leave the text rows of the joint tensors alone.
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (Buf<T>* h : {&fused.q, &fused.k, &fused.v}) std::fill(h->mem.begin(), h->mem.end(), nan);
  forward_fused(be, in, fused, 1);
  for (Buf<T>* h : {&fused.q, &fused.k, &fused.v})
    for (int64_t bh = 0; bh < B * NH; ++bh)
      for (int64_t l = 0; l < L; ++l)
        ASSERT_EQ(std::isnan(h->at(bh * L + l, 0)), l < Lt) << "head row " << bh << ", position " << l;
  forward_fused(be, in, fused, 0);
  EXPECT_TRUE(same_bits(fused.q.values(), ref.q.values())) << "q";
  EXPECT_TRUE(same_bits(fused.k.values(), ref.k.values())) << "k";
  EXPECT_TRUE(same_bits(fused.v.values(), ref.v.values())) << "v";
  for (int s = 0; s < 2; ++s) {
    EXPECT_TRUE(same_bits(fused.q_rstd[s].values(), ref.q_rstd[s].values())) << "q_rstd of stream " << s;
    EXPECT_TRUE(same_bits(fused.k_rstd[s].values(), ref.k_rstd[s].values())) << "k_rstd of stream " << s;
  }

  Heads<T> dheads;
  dheads.q.randn(20), dheads.k.randn(21), dheads.v.randn(22);
  Grads<T> g_ref, g_fused;
  backward_chain(be, in, ref, dheads, g_ref);
  for (int s = 0; s < 2; ++s) backward_fused(be, in, ref, dheads, g_fused, s);  // txt then img, as the model
  for (int s = 0; s < 2; ++s) {
    EXPECT_TRUE(same_bits(g_fused.dqkv[s].values(), g_ref.dqkv[s].values())) << "d[Q|K|V] of stream " << s;
    EXPECT_TRUE(g_fused.dqkv[s].padding_is_nan()) << "stray write into the padding of stream " << s;
  }
  EXPECT_TRUE(same_bits(g_fused.dq_scale.values(), g_ref.dq_scale.values())) << "dq_scale";
  EXPECT_TRUE(same_bits(g_fused.dk_scale.values(), g_ref.dk_scale.values())) << "dk_scale";
}

TEST(CpuQkNormRope, EqualsUnfusedChainF64) {
  auto be = make_backend("cpu");
  expect_fused_equals_chain<double>(*be);
}

TEST(CpuQkNormRope, EqualsUnfusedChainF32) {
  auto be = make_backend("cpu");
  expect_fused_equals_chain<float>(*be);
}

TEST(CpuQkNormRope, EqualsUnfusedChainF32Bf16Rounding) {
  BackendOptions o;
  o.round_activations_to_bf16 = true;
  auto be = make_backend("cpu", o);
  expect_fused_equals_chain<float>(*be);
}

// Undefined statistics (recomputation) and undefined gradients are skipped; what is computed
// does not change.
TEST(CpuQkNormRope, UndefinedOutputsAreSkipped) {
  auto be = make_backend("cpu");
  Inputs<double> in(*be);
  Heads<double> full, bare;
  for (int s = 0; s < 2; ++s) forward_fused(*be, in, full, s);
  for (int s = 0; s < 2; ++s)
    be->qk_norm_rope_to_heads(bare.q.t, bare.k.t, bare.v.t, Tensor{}, Tensor{}, part(in.stream(s), 0),
                              part(in.stream(s), 1), part(in.stream(s), 2), in.q_scale.t, in.k_scale.t, in.pe.t,
                              in.offset(s), kEps);
  EXPECT_EQ(bare.q.values(), full.q.values());
  EXPECT_EQ(bare.k.values(), full.k.values());
  EXPECT_EQ(bare.v.values(), full.v.values());

  Heads<double> dheads;
  dheads.q.randn(20), dheads.k.randn(21), dheads.v.randn(22);
  Grads<double> all, some;
  backward_fused(*be, in, full, dheads, all, 1);
  // Only dq_scale and dk: dq, dv, dk_scale and dv_heads undefined.
  const std::vector<double> dq_before = some.dqkv[1].values();
  be->qk_norm_rope_to_heads_backward(Tensor{}, part(some.dqkv[1], 1), Tensor{}, some.dq_scale.t, Tensor{}, dheads.q.t,
                                     dheads.k.t, Tensor{}, part(in.stream(1), 0), part(in.stream(1), 1),
                                     full.q_rstd[1].t, full.k_rstd[1].t, in.q_scale.t, in.k_scale.t, in.pe.t, Lt);
  EXPECT_EQ(some.dq_scale.values(), all.dq_scale.values());
  EXPECT_EQ(some.dk_scale.values(), Grads<double>().dk_scale.values()) << "dk_scale was not asked for";
  const std::vector<double> dqkv_some = some.dqkv[1].values(), dqkv_all = all.dqkv[1].values();
  for (int64_t r = 0; r < B * Li; ++r)
    for (int64_t c = 0; c < 3 * H; ++c) {
      const size_t i = static_cast<size_t>(r * 3 * H + c);
      // k's window is computed; q's and v's are left as they were.
      EXPECT_EQ(dqkv_some[i], (c >= H && c < 2 * H) ? dqkv_all[i] : dq_before[i]) << r << ", " << c;
    }
}

TEST(CpuQkNormRope, ErrorsNameOpAndTensor) {
  auto be = make_backend("cpu");
  Inputs<double> in(*be);
  Heads<double> h;
  const auto run = [&](Tensor q_heads, Tensor k, Tensor pe, int64_t offset) {
    be->qk_norm_rope_to_heads(q_heads, h.k.t, h.v.t, Tensor{}, Tensor{}, part(in.img, 0), k, part(in.img, 2),
                              in.q_scale.t, in.k_scale.t, pe, offset, kEps);
  };
  EXPECT_NO_THROW(run(h.q.t, part(in.img, 1), in.pe.t, Lt));
  expect_mentions(error_of([&] { run(h.q.t, in.img.t.cols_slice(H, H - 1), in.pe.t, Lt); }),
                  {"qk_norm_rope_to_heads: tensor 'k'"});
  expect_mentions(error_of([&] { run(h.q.t, part(in.img, 1), in.pe.t, Lt + 1); }), {"token_offset 6"});
  Buf<double> odd_q({B, NH, L, D - 1}), odd_k({B, NH, L, D - 1}), odd_v({B, NH, L, D - 1});
  expect_mentions(error_of([&] {
                    be->qk_norm_rope_to_heads(odd_q.t, odd_k.t, odd_v.t, Tensor{}, Tensor{}, part(in.img, 0),
                                              part(in.img, 1), part(in.img, 2), in.q_scale.t, in.k_scale.t, in.pe.t, Lt,
                                              kEps);
                  }),
                  {"qk_norm_rope_to_heads: head dim 9 of 'q_heads'", "must be even"});
  Buf<double> pe_short({B, L - 1, D / 2, 2});
  expect_mentions(error_of([&] { run(h.q.t, part(in.img, 1), pe_short.t, Lt); }), {"tensor 'pe'"});
  Buf<float> k32({B, Li, H});
  expect_mentions(error_of([&] { run(h.q.t, k32.t, in.pe.t, Lt); }), {"tensor 'k'", "dtype"});

  Grads<double> g;
  std::string m = error_of([&] {
    be->qk_norm_rope_to_heads_backward(part(g.dqkv[1], 0), part(g.dqkv[1], 1), part(g.dqkv[1], 2), g.dq_scale.t,
                                       g.dk_scale.t, h.q.t, h.k.t, h.v.t, part(in.img, 0), part(in.img, 1), Tensor{},
                                       h.k_rstd[1].t, in.q_scale.t, in.k_scale.t, in.pe.t, Lt);
  });
  expect_mentions(m, {"qk_norm_rope_to_heads_backward: tensor 'q_rstd' is required"});
  m = error_of([&] {
    be->qk_norm_rope_to_heads_backward(part(g.dqkv[1], 0), part(g.dqkv[1], 1), part(g.dqkv[1], 2), g.dq_scale.t,
                                       g.dk_scale.t, h.q.t, h.k.t, Tensor{}, part(in.img, 0), part(in.img, 1),
                                       h.q_rstd[1].t, h.k_rstd[1].t, in.q_scale.t, in.k_scale.t, in.pe.t, Lt);
  });
  expect_mentions(m, {"tensor 'dv_heads' is required"});
}

}  // namespace
}  // namespace flux8::testing
