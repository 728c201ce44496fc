// The CUDA attention ops (cuDNN flash attention and the f32 reference kernel) against the CPU
// backend, on random data at odd sequence lengths and the head dims Flux and the tests use.
// The path is chosen per test with cuda::set_attention_path; AttentionCounters show which
// path ran and that cuDNN plans are built once per shape.
#include <fmt/core.h>

#include <cmath>
#include <cstdio>
#include <iterator>
#include <memory>
#include <utility>
#include <vector>

#include "backend/cuda/attention.h"
#include "core/error.h"
#include "gpu_test_util.h"

namespace flux8::testing {
namespace {

using cuda::AttentionPath;

// Select a path for one test and restore the previous one after it.
class PathScope {
 public:
  explicit PathScope(AttentionPath p) : saved_(cuda::attention_path()) { cuda::set_attention_path(p); }
  ~PathScope() { cuda::set_attention_path(saved_); }

 private:
  AttentionPath saved_;
};

// A CUDA backend with cuDNN's faster attention backward (deterministic_attention: false); the
// tests' other backends keep the default, deterministic one.
Backend& gpu_atomic_attention() {
  static std::unique_ptr<Backend> be = [] {
    BackendOptions o;
    o.deterministic_attention = false;
    return make_cuda_backend(o);
  }();
  return *be;
}

struct Heads {
  int64_t B, n, L, D;
  Shape shape() const { return {B, n, L, D}; }
};

// Relative L2 errors of one GPU forward + backward against the CPU backend.
struct Errors {
  double o, lse, dq, dk, dv;
};

// Both backends get the same q, k, v, dO (N(0, input_std²)); the backward also gets the same
// o and lse (the CPU's), so each op is judged on its own. `dev` runs the ops (the buffers
// belong to gpu(), whose uploads and downloads wait for their copies; dev's ops are waited for).
Errors compare_with_cpu(const Heads& h, double input_std = 1.0, uint64_t seed = 1, Backend& dev = gpu()) {
  Pair q(h.shape()), k(h.shape()), v(h.shape()), o(h.shape()), dout(h.shape());
  Pair dq(h.shape()), dk(h.shape()), dv(h.shape()), lse({h.B, h.n, h.L});
  q.randn(seed, input_std);
  k.randn(seed + 1, input_std);
  v.randn(seed + 2);
  dout.randn(seed + 3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(h.D));

  cpu().attention(o.host.t, lse.host.t, q.host.t, k.host.t, v.host.t, scale);
  dev.attention(o.dev, lse.dev, q.dev, k.dev, v.dev, scale);
  dev.synchronize();
  Errors e{};
  e.o = gpu_vs_cpu(o);
  e.lse = gpu_vs_cpu(lse);

  o.up();
  lse.up();
  cpu().attention_backward(dq.host.t, dk.host.t, dv.host.t, dout.host.t, q.host.t, k.host.t, v.host.t, o.host.t,
                           lse.host.t, scale);
  dev.attention_backward(dq.dev, dk.dev, dv.dev, dout.dev, q.dev, k.dev, v.dev, o.dev, lse.dev, scale);
  dev.synchronize();
  e.dq = gpu_vs_cpu(dq);
  e.dk = gpu_vs_cpu(dk);
  e.dv = gpu_vs_cpu(dv);
  std::printf("[B, n, L, D] = [%ld, %ld, %ld, %ld], input std %g: o %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n",
              static_cast<long>(h.B), static_cast<long>(h.n), static_cast<long>(h.L), static_cast<long>(h.D), input_std,
              e.o, e.lse, e.dq, e.dk, e.dv);
  return e;
}

void expect_within(const Errors& e, double tol_forward, double tol_lse, double tol_grad) {
  EXPECT_LE(e.o, tol_forward) << "o";
  EXPECT_LE(e.lse, tol_lse) << "lse";
  EXPECT_LE(e.dq, tol_grad) << "dq";
  EXPECT_LE(e.dk, tol_grad) << "dk";
  EXPECT_LE(e.dv, tol_grad) << "dv";
}

// Odd sequence lengths (not multiples of any tile), the Flux head dim, small test head dims.
const Heads kCases[] = {{2, 3, 77, 64}, {1, 2, 512 + 17, 128}, {2, 2, 33, 16}, {1, 3, 100, 32}};

// The reference kernel is f32 like the CPU backend; only summation orders differ (the CPU sums
// exp in double, the GPU in f32 over tiles). On the H200: o ≤ 9e-7, lse ≤ 1.2e-7, gradients
// ≤ 3.2e-6 (the peaked case; they pass through the cancellation dP − δ). The tolerances keep
// about 10x headroom over those: 1e-5, 1e-6, 3e-5.
constexpr double kRefTolForward = 1e-5, kRefTolLse = 1e-6, kRefTolGrad = 3e-5;

TEST(CudaAttention, ReferenceKernelMatchesCpu) {
  FLUX8_REQUIRE_GPU();
  PathScope path(AttentionPath::reference);
  for (const Heads& h : kCases) expect_within(compare_with_cpu(h), kRefTolForward, kRefTolLse, kRefTolGrad);
  // Head dims that are not multiples of 8 or 32 (only the reference kernel takes them).
  expect_within(compare_with_cpu({1, 2, 45, 12}), kRefTolForward, kRefTolLse, kRefTolGrad);
  expect_within(compare_with_cpu({1, 1, 9, 200}), kRefTolForward, kRefTolLse, kRefTolGrad);
}

// Peaked softmax (scores with std 9): the online max must keep exp in range.
TEST(CudaAttention, ReferenceKernelHandlesPeakedSoftmax) {
  FLUX8_REQUIRE_GPU();
  PathScope path(AttentionPath::reference);
  expect_within(compare_with_cpu({1, 2, 150, 64}, 3.0), kRefTolForward, kRefTolLse, kRefTolGrad);
}

// cuDNN computes in f32 from bf16 copies of q, k, v (o and dO in the backward), rounds the
// probabilities P and dS to bf16 before the second products, and returns o, dq, dk, dv in bf16:
// each rounding is up to 2⁻⁹ relative. Measured on the H200 against the f32 CPU: o ≤ 3.7e-3,
// dq ≤ 5.6e-3, dk ≤ 5.9e-3, dv ≤ 4.5e-3: 1e-2 keeps ~2x headroom, as FlashAttention's tests
// allow twice a same-precision implementation's error. lse (≈ log L + O(1)) is an f32 sum of exponentials of
// scores from bf16 inputs; its relative error is far smaller (≤ 2.8e-4): 2e-3.
constexpr double kCudnnTolForward = 1e-2, kCudnnTolLse = 2e-3, kCudnnTolGrad = 1e-2;

TEST(CudaAttention, CudnnMatchesCpu) {
  FLUX8_REQUIRE_GPU();
  PathScope path(AttentionPath::cudnn);  // an unsupported shape fails here instead of falling back
  const cuda::AttentionCounters before = cuda::attention_counters();
  for (const Heads& h : kCases) expect_within(compare_with_cpu(h), kCudnnTolForward, kCudnnTolLse, kCudnnTolGrad);
  const cuda::AttentionCounters after = cuda::attention_counters();
  EXPECT_EQ(after.cudnn_calls - before.cudnn_calls, 2 * static_cast<int64_t>(std::size(kCases)));
  EXPECT_EQ(after.reference_calls, before.reference_calls);
}

// The faster backward (deterministic_attention: false: dQ summed with atomics into cuDNN's
// f32 dQ_accum) against the CPU, each shape twice with other inputs: the second call finds the
// first call's values in the staging buffer, where dQ_accum must start from zero.
TEST(CudaAttention, AtomicBackwardMatchesCpu) {
  FLUX8_REQUIRE_GPU();
  PathScope path(AttentionPath::cudnn);
  for (const Heads& h : kCases)
    for (const uint64_t seed : {uint64_t{11}, uint64_t{21}})
      expect_within(compare_with_cpu(h, 1.0, seed, gpu_atomic_attention()), kCudnnTolForward, kCudnnTolLse,
                    kCudnnTolGrad);
}

// A second opinion at Flux's head dim and a longer sequence, without the (slow) CPU: cuDNN and
// the reference kernel on the same device inputs; the reference is within 1e-5 of f32 exact, so
// the tolerances are cuDNN's against the CPU.
TEST(CudaAttention, CudnnAgreesWithReferenceKernel) {
  FLUX8_REQUIRE_GPU();
  const Heads h{1, 6, 1536 + 5, 128};
  Pair q(h.shape()), k(h.shape()), v(h.shape()), dout(h.shape()), lse({h.B, h.n, h.L});
  q.randn(11);
  k.randn(12);
  v.randn(13);
  dout.randn(14);
  const double scale = 1.0 / std::sqrt(128.0);
  struct Out {
    std::vector<float> o, lse, dq, dk, dv;
  };
  auto run = [&](AttentionPath p) {
    PathScope path(p);
    Pair o(h.shape()), l({h.B, h.n, h.L}), dq(h.shape()), dk(h.shape()), dv(h.shape());
    gpu().attention(o.dev, l.dev, q.dev, k.dev, v.dev, scale);
    gpu().attention_backward(dq.dev, dk.dev, dv.dev, dout.dev, q.dev, k.dev, v.dev, o.dev, l.dev, scale);
    return Out{o.down(), l.down(), dq.down(), dk.down(), dv.down()};
  };
  const Out ref = run(AttentionPath::reference), dnn = run(AttentionPath::cudnn);
  const Errors e{rel_l2(dnn.o, ref.o), rel_l2(dnn.lse, ref.lse), rel_l2(dnn.dq, ref.dq), rel_l2(dnn.dk, ref.dk),
                 rel_l2(dnn.dv, ref.dv)};
  std::printf("cuDNN vs reference, [1, 6, 1541, 128]: o %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", e.o, e.lse, e.dq,
              e.dk, e.dv);
  expect_within(e, kCudnnTolForward, kCudnnTolLse, kCudnnTolGrad);
}

// Plans are built at the first call of a shape and reused: a training step after the first
// builds nothing. The scale is a by-value input of the graph, so a new scale needs no plan.
TEST(CudaAttention, CudnnPlansAreBuiltOncePerShape) {
  FLUX8_REQUIRE_GPU();
  PathScope path(AttentionPath::cudnn);
  const Heads h{1, 2, 64 + 3, 64};
  compare_with_cpu(h);
  const cuda::AttentionCounters first = cuda::attention_counters();
  const Errors e = compare_with_cpu(h, 1.0, 7);
  const cuda::AttentionCounters second = cuda::attention_counters();
  EXPECT_EQ(second.cudnn_plans_built, first.cudnn_plans_built);
  EXPECT_EQ(second.cudnn_calls - first.cudnn_calls, 2);
  expect_within(e, kCudnnTolForward, kCudnnTolLse, kCudnnTolGrad);

  // Another scale through the same plans: compare with the CPU at scale 0.3.
  Pair q(h.shape()), k(h.shape()), v(h.shape()), o(h.shape()), lse({h.B, h.n, h.L});
  q.randn(21);
  k.randn(22);
  v.randn(23);
  cpu().attention(o.host.t, lse.host.t, q.host.t, k.host.t, v.host.t, 0.3);
  gpu().attention(o.dev, lse.dev, q.dev, k.dev, v.dev, 0.3);
  EXPECT_LE(gpu_vs_cpu(o), kCudnnTolForward);
  EXPECT_LE(gpu_vs_cpu(lse), kCudnnTolLse);
  EXPECT_EQ(cuda::attention_counters().cudnn_plans_built, first.cudnn_plans_built);
}

// The first forward of a shape starts its backward's plan on the helper thread (Cudnn::prefetch,
// so the two compilations overlap on a cold machine); the backward then runs that plan — built
// with the helper's own handle, executed with the backend's — and matches the CPU. A shape
// seen before prefetches nothing.
TEST(CudaAttention, BackwardPlanPrefetchedAtTheFirstForward) {
  FLUX8_REQUIRE_GPU();
  PathScope path(AttentionPath::cudnn);
  const Heads h{2, 3, 96 + 5, 64};
  const cuda::AttentionCounters before = cuda::attention_counters();
  const Errors e = compare_with_cpu(h, 1.0, 31);
  const cuda::AttentionCounters after = cuda::attention_counters();
  EXPECT_EQ(after.cudnn_plans_prefetched - before.cudnn_plans_prefetched, 1);
  EXPECT_EQ(after.cudnn_plans_built - before.cudnn_plans_built, 2) << "forward and backward, once each";
  expect_within(e, kCudnnTolForward, kCudnnTolLse, kCudnnTolGrad);
  compare_with_cpu(h, 1.0, 32);
  EXPECT_EQ(cuda::attention_counters().cudnn_plans_prefetched, after.cudnn_plans_prefetched);
}

// The default path takes cuDNN where it can and the reference kernel for head dims cuDNN does
// not support (D % 8 != 0), with the reference kernel's f32 accuracy.
TEST(CudaAttention, AutomaticPathFallsBackForOddHeadDims) {
  FLUX8_REQUIRE_GPU();
  PathScope path(AttentionPath::automatic);
  const cuda::AttentionCounters before = cuda::attention_counters();
  expect_within(compare_with_cpu({2, 2, 31, 10}), kRefTolForward, kRefTolLse, kRefTolGrad);
  const cuda::AttentionCounters after = cuda::attention_counters();
  EXPECT_EQ(after.reference_calls - before.reference_calls, 2);
  EXPECT_EQ(after.cudnn_calls, before.cudnn_calls);
}

// Undefined gradients are skipped; the defined ones equal those of a full call. Also covers
// lse and dq that are not 16-byte aligned (cuDNN then works in staging buffers).
TEST(CudaAttention, PartialGradientsAndUnalignedStatistics) {
  FLUX8_REQUIRE_GPU();
  const Heads h{1, 2, 40, 32};
  for (AttentionPath p : {AttentionPath::cudnn, AttentionPath::reference}) {
    PathScope path(p);
    Pair q(h.shape()), k(h.shape()), v(h.shape()), o(h.shape()), dout(h.shape());
    Pair lse_storage({h.B * h.n * h.L + 1}), dq_storage({h.B * h.n * h.L * h.D + 1});
    Pair dq(h.shape()), dk(h.shape()), dv(h.shape()), dk2(h.shape()), dv2(h.shape());
    q.randn(31);
    k.randn(32);
    v.randn(33);
    dout.randn(34);
    // Views one float into their storage: 4-byte aligned only.
    Tensor lse(static_cast<float*>(lse_storage.dev.data) + 1, DType::f32, {h.B, h.n, h.L});
    Tensor dq_unaligned(static_cast<float*>(dq_storage.dev.data) + 1, DType::f32, h.shape());
    const double scale = 0.2;
    gpu().attention(o.dev, lse, q.dev, k.dev, v.dev, scale);
    gpu().attention_backward(dq.dev, dk.dev, dv.dev, dout.dev, q.dev, k.dev, v.dev, o.dev, lse, scale);
    gpu().attention_backward(dq_unaligned, Tensor(), Tensor(), dout.dev, q.dev, k.dev, v.dev, o.dev, lse, scale);
    gpu().attention_backward(Tensor(), dk2.dev, dv2.dev, dout.dev, q.dev, k.dev, v.dev, o.dev, lse, scale);
    std::vector<float> all(static_cast<size_t>(h.B * h.n * h.L * h.D + 1));
    gpu().download(all.data(), dq_storage.dev.data, all.size() * sizeof(float));
    const std::vector<float> dq_partial(all.begin() + 1, all.end());
    // The same inputs and plans give the same bits, except that cuDNN sums dq's contributions
    // of different key blocks with atomics in any order (see DeterministicBackward): the f32
    // sums differ in the last bits, which can move an element of the bf16 dq by one step, 2⁻⁸.
    if (p == AttentionPath::cudnn)
      EXPECT_LE(rel_l2(dq_partial, dq.down()), 1e-3);
    else
      EXPECT_EQ(dq_partial, dq.down());
    EXPECT_EQ(dk2.down(), dk.down());
    EXPECT_EQ(dv2.down(), dv.down());

    // The unaligned lse holds the forward's statistics: compare with the CPU.
    Pair lse_cpu({h.B, h.n, h.L});
    cpu().attention(o.host.t, lse_cpu.host.t, q.host.t, k.host.t, v.host.t, scale);
    std::vector<float> lse_all(static_cast<size_t>(h.B * h.n * h.L + 1));
    gpu().download(lse_all.data(), lse_storage.dev.data, lse_all.size() * sizeof(float));
    const std::vector<float> lse_gpu(lse_all.begin() + 1, lse_all.end());
    EXPECT_LE(rel_l2(lse_gpu, lse_cpu.cpu_values()), kCudnnTolLse);
  }
}

// Deterministic mode: cuDNN's backward without atomics gives the same bits on every run, with
// the accuracy of the default backward.
TEST(CudaAttention, DeterministicBackwardRepeatsBitForBit) {
  FLUX8_REQUIRE_GPU();
  PathScope path(AttentionPath::cudnn);
  ASSERT_TRUE(gpu().options().deterministic_attention);  // the default
  const Heads h{2, 3, 300 + 7, 64};
  expect_within(compare_with_cpu(h, 1.0, 41), kCudnnTolForward, kCudnnTolLse, kCudnnTolGrad);
  Pair q(h.shape()), k(h.shape()), v(h.shape()), o(h.shape()), dout(h.shape()), lse({h.B, h.n, h.L});
  q.randn(42);
  k.randn(43);
  v.randn(44);
  dout.randn(45);
  gpu().attention(o.dev, lse.dev, q.dev, k.dev, v.dev, 0.125);
  std::vector<float> first[3];
  for (int run = 0; run < 3; ++run) {
    Pair dq(h.shape()), dk(h.shape()), dv(h.shape());
    gpu().attention_backward(dq.dev, dk.dev, dv.dev, dout.dev, q.dev, k.dev, v.dev, o.dev, lse.dev, 0.125);
    const std::vector<float> got[3] = {dq.down(), dk.down(), dv.down()};
    for (int i = 0; i < 3; ++i) {
      if (run == 0)
        first[i] = got[i];
      else
        EXPECT_EQ(got[i], first[i]) << "gradient " << i << ", run " << run;
    }
  }
}

// A bound on the deterministic backward's dP (deterministic_attention_workspace_mib): the
// backward runs as calls over consecutive (sample, head) pairs — 3 pairs a call, or one (a bound
// below one pair's dP) — and gives the unbounded backward's bits, for f32 and bf16 heads and for
// partial gradients. The calls' lse start 921 and 307 floats apart: not 16-byte aligned, staged.
TEST(CudaAttention, DeterministicBackwardSplitOverHeadsGivesTheSameBits) {
  FLUX8_REQUIRE_GPU();
  PathScope path(AttentionPath::cudnn);
  const Heads h{2, 3, 300 + 7, 64};
  const uint64_t pair_dp = 2 * 307 * 307;
  Pair q(h.shape()), k(h.shape()), v(h.shape()), o(h.shape()), dout(h.shape()), lse({h.B, h.n, h.L});
  q.randn(51), k.randn(52), v.randn(53), dout.randn(54);
  for (Pair* p : {&q, &k, &v, &dout}) round_host_to_bf16(*p);
  Bf16Dev q16(h.shape()), k16(h.shape()), v16(h.shape()), o16(h.shape()), do16(h.shape());
  q16.up(q.host.mem), k16.up(k.host.mem), v16.up(v.host.mem), do16.up(dout.host.mem);
  const double scale = 0.125;
  gpu().attention(o.dev, lse.dev, q.dev, k.dev, v.dev, scale);
  gpu().attention(o16.t, lse.dev, q16.t, k16.t, v16.t, scale);
  Pair dq(h.shape()), dk(h.shape()), dv(h.shape());
  Bf16Dev dq16(h.shape()), dk16(h.shape()), dv16(h.shape());
  gpu().attention_backward(dq.dev, dk.dev, dv.dev, dout.dev, q.dev, k.dev, v.dev, o.dev, lse.dev, scale);
  gpu().attention_backward(dq16.t, dk16.t, dv16.t, do16.t, q16.t, k16.t, v16.t, o16.t, lse.dev, scale);
  const std::vector<float> want[3] = {dq.down(), dk.down(), dv.down()};
  const std::vector<uint16_t> want16[3] = {dq16.bits(), dk16.bits(), dv16.bits()};

  for (const auto& [limit, calls] : {std::pair<uint64_t, int64_t>{3 * pair_dp, 2}, {pair_dp - 1, 6}}) {
    SCOPED_TRACE(fmt::format("dP bound {} bytes", limit));
    BackendOptions opts;
    opts.attention_workspace_limit = limit;
    const std::unique_ptr<Backend> bounded = make_cuda_backend(opts);
    Pair gq(h.shape()), gk(h.shape()), gv(h.shape());
    const int64_t before = cuda::attention_counters().cudnn_calls;
    bounded->attention_backward(gq.dev, gk.dev, gv.dev, dout.dev, q.dev, k.dev, v.dev, o.dev, lse.dev, scale);
    bounded->synchronize();
    EXPECT_EQ(cuda::attention_counters().cudnn_calls - before, calls);
    EXPECT_EQ(gq.down(), want[0]) << "dq";
    EXPECT_EQ(gk.down(), want[1]) << "dk";
    EXPECT_EQ(gv.down(), want[2]) << "dv";
    Bf16Dev gq16(h.shape()), gk16(h.shape()), gv16(h.shape()), dv_only(h.shape());
    bounded->attention_backward(gq16.t, gk16.t, gv16.t, do16.t, q16.t, k16.t, v16.t, o16.t, lse.dev, scale);
    bounded->attention_backward(Tensor{}, Tensor{}, dv_only.t, do16.t, q16.t, k16.t, v16.t, o16.t, lse.dev, scale);
    bounded->synchronize();
    EXPECT_EQ(gq16.bits(), want16[0]) << "dq, bf16 heads";
    EXPECT_EQ(gk16.bits(), want16[1]) << "dk, bf16 heads";
    EXPECT_EQ(gv16.bits(), want16[2]) << "dv, bf16 heads";
    EXPECT_EQ(dv_only.bits(), want16[2]) << "dv alone";
    expect_within(compare_with_cpu(h, 1.0, 61, *bounded), kCudnnTolForward, kCudnnTolLse, kCudnnTolGrad);
  }
}

// bf16 heads (what Backend::attention_heads_dtype picks on the cuDNN path) give the bits f32
// heads give: the f32 path rounds q, k, v, o, dO to bf16 for cuDNN and widens its bf16 results,
// the bf16 path hands cuDNN the tensors as they are. On the reference kernel bf16 heads are
// widened for the f32 kernel and its results rounded back: equal to rounding the f32 path's
// results. Inputs are bf16 values, so both paths see the same numbers; the backward gets the
// bf16 o and the same lse on both paths.
TEST(CudaAttention, Bf16HeadsEqualRoundedF32Heads) {
  FLUX8_REQUIRE_GPU();
  for (const AttentionPath path : {AttentionPath::cudnn, AttentionPath::reference}) {
    SCOPED_TRACE(path == AttentionPath::cudnn ? "cudnn" : "reference");
    PathScope scope(path);
    const Heads h{2, 3, 77, 64};
    Pair q(h.shape()), k(h.shape()), v(h.shape()), dout(h.shape()), o(h.shape()), lse({h.B, h.n, h.L});
    Pair dq(h.shape()), dk(h.shape()), dv(h.shape()), lse16({h.B, h.n, h.L});
    q.randn(31), k.randn(32), v.randn(33), dout.randn(34);
    for (Pair* p : {&q, &k, &v, &dout}) round_host_to_bf16(*p);
    Bf16Dev q16(h.shape()), k16(h.shape()), v16(h.shape()), o16(h.shape()), do16(h.shape());
    Bf16Dev dq16(h.shape()), dk16(h.shape()), dv16(h.shape());
    q16.up(q.host.mem), k16.up(k.host.mem), v16.up(v.host.mem), do16.up(dout.host.mem);
    const double scale = 0.125;

    gpu().attention(o.dev, lse.dev, q.dev, k.dev, v.dev, scale);
    gpu().attention(o16.t, lse16.dev, q16.t, k16.t, v16.t, scale);
    EXPECT_EQ(o16.bits(), bf16_bits_of(o.down())) << "o";
    EXPECT_EQ(lse16.down(), lse.down()) << "lse";

    const std::vector<float> o_rounded = o16.down();  // both backwards get this o
    o.host.mem.assign(o_rounded.begin(), o_rounded.end());
    o.up();
    gpu().attention_backward(dq.dev, dk.dev, dv.dev, dout.dev, q.dev, k.dev, v.dev, o.dev, lse.dev, scale);
    gpu().attention_backward(dq16.t, dk16.t, dv16.t, do16.t, q16.t, k16.t, v16.t, o16.t, lse.dev, scale);
    EXPECT_EQ(dq16.bits(), bf16_bits_of(dq.down())) << "dq";
    EXPECT_EQ(dk16.bits(), bf16_bits_of(dk.down())) << "dk";
    EXPECT_EQ(dv16.bits(), bf16_bits_of(dv.down())) << "dv";
    // Partial gradients: only dv wanted.
    Bf16Dev dv_only(h.shape());
    gpu().attention_backward(Tensor{}, Tensor{}, dv_only.t, do16.t, q16.t, k16.t, v16.t, o16.t, lse.dev, scale);
    EXPECT_EQ(dv_only.bits(), dv16.bits());
  }
  // One call's heads share a dtype; attention_heads_dtype follows the path and head dim.
  const Heads h{1, 1, 8, 64};
  Pair q(h.shape()), lse({1, 1, 8});
  Bf16Dev o16(h.shape());
  EXPECT_THROW(gpu().attention(o16.t, lse.dev, q.dev, q.dev, q.dev, 0.1), Error);
  {
    PathScope scope(AttentionPath::automatic);
    EXPECT_EQ(gpu().attention_heads_dtype(DType::f32, 128), DType::bf16);
    EXPECT_EQ(gpu().attention_heads_dtype(DType::f32, 6), DType::f32);  // the reference kernel's
  }
  {
    PathScope scope(AttentionPath::reference);
    EXPECT_EQ(gpu().attention_heads_dtype(DType::f32, 128), DType::f32);
  }
  EXPECT_EQ(cpu().attention_heads_dtype(DType::f32, 128), DType::f32);
}

TEST(CudaAttention, RejectsStridedHeads) {
  FLUX8_REQUIRE_GPU();
  const Heads h{1, 2, 8, 16};
  Pair q(h.shape(), 3), k(h.shape()), v(h.shape()), o(h.shape()), lse({h.B, h.n, h.L});
  EXPECT_THROW(gpu().attention(o.dev, lse.dev, q.dev, k.dev, v.dev, 0.25), Error);
  Pair bad_lse({h.B, h.n, h.L + 1});
  EXPECT_THROW(gpu().attention(o.dev, bad_lse.dev, k.dev, k.dev, v.dev, 0.25), Error);
}

}  // namespace
}  // namespace flux8::testing
