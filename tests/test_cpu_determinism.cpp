// Properties of the CPU backend as a whole, checked on one workload that runs every op with
// independent random inputs: results do not depend on the thread count, f32 agrees with f64,
// and bf16 activation emulation rounds exactly the activation outputs.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstring>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "cpu_ops_util.h"

namespace flux8::testing {
namespace {

// Sizes that are not multiples of 8, with enough rows for several parallel chunks and an
// attention length spanning two query blocks.
constexpr int64_t B = 2, L = 150, NH = 4, D = 10, H = NH * D, M = 70;

template <typename T>
struct Output {
  std::string name;
  bool activation;  // rounded under bf16 emulation; false for statistics and parameter grads
  std::vector<T> values;
};

template <typename T>
std::vector<Output<T>> run_workload(Backend& be) {
  std::vector<Output<T>> out;
  uint64_t seed = 100;
  const auto input = [&](Shape s, int64_t pad = 0, double stddev = 1.0) {
    Buf<T> b(s, pad);
    b.randn(seed++, stddev);
    return b;
  };
  const auto keep = [&](const char* name, bool activation, const Buf<T>& b) {
    out.push_back({name, activation, b.values()});
  };
  {
    auto x = input({B, L, H}, 3), w = input({M, H}, 0, 0.2), bias = input({M}), dy = input({B, L, M}, 1);
    Buf<T> y({B, L, M}, 2), dx({B, L, H}, 3), dw({M, H}), db({M});
    be.linear(y.t, x.t, w.t, bias.t);
    be.linear_backward(dx.t, dw.t, db.t, dy.t, x.t, w.t, false, true);
    keep("linear y", true, y), keep("linear dx", true, dx);
    keep("linear dw", false, dw), keep("linear db", false, db);
  }
  {
    auto x = input({B * L, M}, 1, 2.0), dy = input({B * L, M});
    Buf<T> y1({B * L, M}), y2({B * L, M}), dx1({B * L, M}), dx2({B * L, M});
    be.silu(y1.t, x.t), be.gelu_tanh(y2.t, x.t);
    be.silu_backward(dx1.t, dy.t, x.t, false), be.gelu_tanh_backward(dx2.t, dy.t, x.t);
    keep("silu y", true, y1), keep("gelu y", true, y2);
    keep("silu dx", true, dx1), keep("gelu dx", true, dx2);
  }
  {
    auto x = input({B, L, H}, 2, 3.0), mod = input({B, 3 * H}, 0, 0.5), dy = input({B, L, H});
    Buf<T> y({B, L, H}), mean({B * L}), rstd({B * L}), dx({B, L, H}), dmod({B, 2 * H});
    const Tensor scale = mod.t.cols_slice(H, H);
    be.layernorm_modulate(y.t, mean.t, rstd.t, x.t, mod.t.cols_slice(0, H), scale, 1e-6f);
    be.layernorm_modulate_backward(dx.t, dmod.t.cols_slice(0, H), dmod.t.cols_slice(H, H), dy.t, x.t, mean.t, rstd.t,
                                   scale, false);
    keep("layernorm y", true, y), keep("layernorm mean", false, mean);
    keep("layernorm rstd", false, rstd), keep("layernorm dx", true, dx);
    keep("layernorm dshift/dscale", true, dmod);
  }
  {
    auto x = input({B * L, 3 * H}, 0, 2.0), scale = input({D}), dy = input({B * L, H});
    Buf<T> y({B * L, H}), rstd({B * L * NH}), dx({B * L, H}), dscale({D});
    const Tensor k = x.t.cols_slice(H, H);
    be.rmsnorm_heads(y.t, rstd.t, k, scale.t, 1e-6f);
    be.rmsnorm_heads_backward(dx.t, dscale.t, dy.t, k, rstd.t, scale.t);
    keep("rmsnorm y", true, y), keep("rmsnorm rstd", false, rstd);
    keep("rmsnorm dx", true, dx), keep("rmsnorm dscale", false, dscale);
  }
  {
    const int axes[] = {2, 4, 4};
    auto ids = input({B, L, 3}, 0, 20.0), x = input({B, NH, L, D});
    Buf<T> pe({B, L, D / 2, 2});
    be.rope_table(pe.t, ids.t, axes, 10000.0);
    be.rope(x.t, pe.t, false);
    keep("rope table", false, pe), keep("rope x", true, x);
  }
  {
    const Shape s{B, NH, L, D};
    auto q = input(s), k = input(s, 1), v = input(s), dout = input(s);
    Buf<T> o(s), lse({B, NH, L}), dq(s), dk(s), dv(s);
    be.attention(o.t, lse.t, q.t, k.t, v.t, 0.3f);
    keep("attention o", true, o), keep("attention lse", false, lse);
    // The backward gets an independent o (it only enters through δ = dO·O) so that it sees
    // the same inputs whether or not the forward output was rounded.
    auto o_in = input(s);
    be.attention_backward(dq.t, dk.t, dv.t, dout.t, q.t, k.t, v.t, o_in.t, lse.t, 0.3f);
    keep("attention dq", true, dq), keep("attention dk", true, dk), keep("attention dv", true, dv);
  }
  {
    auto x = input({B, L, H}), y = input({B, L, H}), gate = input({B, H}), dx = input({B, L, H});
    Buf<T> out({B, L, H}), dy({B, L, H}), dgate({B, H});
    be.gated_residual(out.t, x.t, y.t, gate.t);
    be.gated_residual(x.t, x.t, y.t, gate.t);
    be.gated_residual_backward(dy.t, dgate.t, dx.t, y.t, gate.t);
    keep("gated out", true, out), keep("gated x", true, x), keep("gated dy", true, dy);
    keep("gated dgate", true, dgate);
  }
  {
    auto tokens = input({B, L, H}), other = input({B, 7, H});
    Buf<T> heads({B, NH, L + 7, D}), joint({B, L + 7, H});
    be.tokens_to_heads(heads.t, tokens.t, 7);
    be.concat_tokens(joint.t, other.t, tokens.t);
    keep("tokens_to_heads", true, heads), keep("concat_tokens", true, joint);
  }
  {
    Buf<T> t({3}), emb({3, 256});
    t.mem = {T(0.0), T(0.25), T(0.875)};  // exact in f32: same inputs for both dtypes
    be.timestep_embedding(emb.t, t.t, 1000.0f, 10000.0f);
    keep("timestep_embedding", true, emb);
  }
  return out;
}

template <typename T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Parallel loops split only independent rows/heads/samples, and column sums use row chunks
// fixed by the shape, so one thread and several must give the same bits.
TEST(CpuBackendProperties, ThreadCountDoesNotChangeResults) {
  const int saved = omp_get_max_threads();
  auto be = make_backend("cpu");
  omp_set_num_threads(1);
  const auto one = run_workload<float>(*be);
  const auto one64 = run_workload<double>(*be);
  omp_set_num_threads(5);
  const auto many = run_workload<float>(*be);
  const auto many64 = run_workload<double>(*be);
  omp_set_num_threads(saved);
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(one[i].values, many[i].values)) << one[i].name << " (f32)";
    EXPECT_TRUE(bitwise_equal(one64[i].values, many64[i].values)) << one64[i].name << " (f64)";
  }
}

// f32 unit roundoff is 6e-8; the longest reductions here (150 keys, 70 outputs) and exp/log
// keep the normwise error near 1e-6, so 1e-5 detects an f32-only bug without flaking.
TEST(CpuBackendProperties, F32AgreesWithF64) {
  auto be = make_backend("cpu");
  const auto f32 = run_workload<float>(*be);
  const auto f64 = run_workload<double>(*be);
  for (size_t i = 0; i < f32.size(); ++i) {
    EXPECT_LT(rel_diff(f32[i].values, f64[i].values), 1e-5) << f32[i].name;
  }
}

// With rounding on, each activation output is exactly the bf16 rounding of the unrounded
// result (so it is bf16-representable), while statistics and parameter gradients are
// bit-identical to the unrounded run.
TEST(CpuBackendProperties, Bf16EmulationRoundsActivationsOnly) {
  auto plain = make_backend("cpu");
  BackendOptions opts;
  opts.round_activations_to_bf16 = true;
  auto rounding = make_backend("cpu", opts);
  const auto ref = run_workload<float>(*plain);
  const auto got = run_workload<float>(*rounding);
  for (size_t i = 0; i < ref.size(); ++i) {
    SCOPED_TRACE(ref[i].name);
    bool any_unrepresentable = false;
    for (size_t j = 0; j < ref[i].values.size(); ++j) {
      const float r = ref[i].values[j], g = got[i].values[j];
      any_unrepresentable |= round_to_bf16(r) != r;
      if (ref[i].activation) {
        ASSERT_EQ(g, round_to_bf16(r)) << "element " << j;
      } else {
        ASSERT_EQ(g, r) << "element " << j;
      }
    }
    // Otherwise the comparison above could not tell rounded from unrounded.
    EXPECT_TRUE(any_unrepresentable);
  }
  // f64 tensors are never rounded.
  const auto ref64 = run_workload<double>(*plain);
  const auto got64 = run_workload<double>(*rounding);
  for (size_t i = 0; i < ref64.size(); ++i)
    EXPECT_TRUE(bitwise_equal(ref64[i].values, got64[i].values)) << ref64[i].name;
}

}  // namespace
}  // namespace flux8::testing
