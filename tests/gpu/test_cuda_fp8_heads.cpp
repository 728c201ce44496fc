// The head-layout ops with FP8 heads on the GPU (FP8 attention's neighbours: qk_norm_rope.cu and
// layout.cu write the casts and read the codes inside their kernels) against what they stand
// for: the plain op followed by the cast, or the dequantize followed by the plain op — the
// Backend defaults, run on the same CUDA backend (`be.Backend::...`). Bit for bit: the codes,
// scale_inv, the amax targets and the telemetry counts, the token-side outputs and dscale. Two
// streams of odd lengths at their joint offsets (as a double block calls them), f32 and bf16
// activations, strided token rows, and shapes the fused kernels leave to the defaults.
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "core/rng.h"
#include "fp8/format.h"
#include "fp8/quantize.h"
#include "fp8_test_util.h"

namespace flux8::testing {
namespace {

// An activation in a CUDA backend's storage type (f32, or bf16 when bf16 is set), on the device:
// N(0, std²) values rounded to bf16 (so both types hold the same values), rows ld = cols + pad.
struct DevAct {
  Tensor t;
  DevAct(Shape s, int64_t pad, bool bf16, uint64_t seed, double std) {
    const int64_t cols = s[-1], rows = cols ? s.numel() / cols : 0, ld = cols + pad;
    std::vector<float> v(static_cast<size_t>(rows * ld));
    for (size_t i = 0; i < v.size(); ++i) v[i] = round_to_bf16(static_cast<float>(std * rng_normal(seed, 1, i)));
    const size_t elt = bf16 ? 2 : 4;
    t = Tensor(gpu().allocate(v.size() * elt + 16), bf16 ? DType::bf16 : DType::f32, s);
    t.ld = ld;
    if (bf16) {
      const std::vector<uint16_t> b = bf16_bits_of(v);
      gpu().upload(t.data, b.data(), b.size() * 2);
    } else {
      gpu().upload(t.data, v.data(), v.size() * 4);
    }
  }
  ~DevAct() { gpu().release(t.data); }
  DevAct(const DevAct&) = delete;
  // The whole storage (padding included) as bytes.
  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> b(static_cast<size_t>(t.rows() * t.ld) * dtype_size(t.dtype));
    gpu().download(b.data(), t.data, b.size());
    return b;
  }
  void restore(const std::vector<uint8_t>& b) { gpu().upload(t.data, b.data(), b.size()); }
};

// FP8 heads [rows, D] on the device, codes 0xA5 and scale_inv NaN until written.
struct DevHeads {
  QTensor q;
  DevHeads(int64_t rows, int64_t D, Fp8Format f) {
    q.rows = rows, q.cols = D, q.format = f, q.scaling = Fp8Scaling::per_tensor;
    q.codes = static_cast<uint8_t*>(gpu().allocate(static_cast<size_t>(rows * D) + 16));
    q.scale_inv = static_cast<float*>(gpu().allocate(16));
    const std::vector<uint8_t> fill(static_cast<size_t>(rows * D), 0xA5);
    gpu().upload(q.codes, fill.data(), fill.size());
    const float nan = std::numeric_limits<float>::quiet_NaN();
    gpu().upload(q.scale_inv, &nan, 4);
  }
  ~DevHeads() {
    gpu().release(q.codes);
    gpu().release(q.scale_inv);
  }
  DevHeads(const DevHeads&) = delete;
  std::vector<uint8_t> codes() const {
    std::vector<uint8_t> v(static_cast<size_t>(q.numel()));
    gpu().download(v.data(), q.codes, v.size());
    return v;
  }
  uint32_t scale_inv_bits() const {
    float s = 0;
    gpu().download(&s, q.scale_inv, 4);
    return bits(s);
  }
  // Codes of N(0, std²) values cast on the CPU with scale 1 / scale_inv (a read-side operand);
  // with specials, also NaN codes of both signs and (E5M2) infinities, which the readers decode
  // on their integer path.
  void fill_random(uint64_t seed, double std, float scale_inv, bool specials = false) {
    std::vector<uint8_t> c(static_cast<size_t>(q.numel()));
    for (size_t i = 0; i < c.size(); ++i)
      c[i] = quantize_value(static_cast<float>(std * rng_normal(seed, 2, i)), 1.0f / scale_inv, q.format);
    if (specials && c.size() > 64) {
      const bool e4 = q.format == Fp8Format::e4m3;
      c[3] = e4 ? 0x7F : 0x7E, c[c.size() / 2] = e4 ? 0xFF : 0xFD;   // NaN codes
      c[41] = e4 ? 0x7E : 0x7C, c[c.size() - 5] = e4 ? 0xFE : 0xFC;  // the largest finite / ±inf
    }
    gpu().upload(q.codes, c.data(), c.size());
    gpu().upload(q.scale_inv, &scale_inv, 4);
  }
};

// One written FP8 heads tensor's targets: the delayed scale, the amax slot, the counts.
struct CastTargets {
  Scalar scale, amax{0.0f};
  CastStats stats;
  explicit CastTargets(float s) : scale(s) {}
  Backend::Fp8Heads on(const DevHeads& h, bool counts) {
    Backend::Fp8Heads o;
    o.codes = h.q;
    o.q.format = h.q.format;
    o.q.delayed_scale = scale.on(true);
    o.q.amax = amax.on(true);
    o.q.stats = counts ? &stats : nullptr;
    return o;
  }
};

void expect_same_heads(const DevHeads& got, const DevHeads& want, const char* what) {
  EXPECT_EQ(first_difference(got.codes(), want.codes(), 1), "") << what << " codes";
  EXPECT_EQ(got.scale_inv_bits(), want.scale_inv_bits()) << what << " scale_inv";
}
void expect_same_targets(CastTargets& got, CastTargets& want, bool counts, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(bits(got.amax.gpu_value()), bits(want.amax.gpu_value())) << "amax";
  EXPECT_GT(want.amax.gpu_value(), 0.0f);
  if (counts) expect_same_stats(got.stats, want.stats);
}

struct HeadsCase {
  int64_t B, n, D, Lt, Li, pad;
  bool bf16;   // bf16 activations (the training configuration), else f32
  bool fused;  // whether the fused kernels take it (else the defaults run: the call must still work)
};
// D = 128: Flux (16 lanes a segment); D = 64: 8 lanes; D = 40: not 8·2^k, the pair path (left to
// the defaults); pad 3 misaligns the token rows (the defaults again). The long image stream
// (13,203 segments) gives the forward runs of 2 segments a group and the backward runs of 4
// (segments_per_group), each with a short last run and runs that cross tokens.
const HeadsCase kCases[] = {
    {2, 3, 128, 7, 45, 0, true, true}, {2, 3, 128, 7, 45, 8, false, true}, {1, 2, 64, 5, 19, 0, true, true},
    {2, 2, 40, 3, 11, 0, true, false}, {1, 2, 128, 4, 9, 3, true, false},  {1, 3, 128, 7, 4401, 0, true, true},
};

Backend& backend_for(const HeadsCase& c) { return c.bf16 ? gpu_bf16_activations() : gpu(); }
// The case in a test's trace.
::testing::Message describe(const HeadsCase& c) {
  return ::testing::Message() << "D=" << c.D << " pad=" << c.pad << " bf16=" << c.bf16;
}

TEST(CudaFp8Heads, QkNormRopeWritesTheCastOfThePlainOp) {
  FLUX8_REQUIRE_GPU();
  for (const HeadsCase& c : kCases) {
    for (const bool counts : {false, true}) {
      SCOPED_TRACE(describe(c) << " counts=" << counts);
      Backend& be = backend_for(c);
      const int64_t L = c.Lt + c.Li, H = c.n * c.D, rows = c.B * c.n * L;
      Pair pe({c.B, L, c.D / 2, 2}), q_scale({c.D}), k_scale({c.D});
      pe.randn(801), q_scale.randn(802), k_scale.randn(803);
      DevAct txt({c.B, c.Lt, 3 * H}, c.pad, c.bf16, 804, 2.0), img({c.B, c.Li, 3 * H}, c.pad, c.bf16, 805, 2.0);
      // v is copied, not normalised: huge values saturate under its scale, tiny ones flush.
      const auto win = [&](const DevAct& a, int64_t i) { return a.t.cols_slice(i * H, H); };
      DevHeads q8(rows, c.D, Fp8Format::e4m3), k8(rows, c.D, Fp8Format::e4m3), v8(rows, c.D, Fp8Format::e4m3);
      DevHeads q8r(rows, c.D, Fp8Format::e4m3), k8r(rows, c.D, Fp8Format::e4m3), v8r(rows, c.D, Fp8Format::e4m3);
      CastTargets tq(60.0f), tk(37.0f), tv(300.0f), rq(60.0f), rk(37.0f), rv(300.0f);
      Pair q_rstd({c.B * c.Li * c.n}), k_rstd({c.B * c.Li * c.n}), q_rstd_r({c.B * c.Li * c.n}),
          k_rstd_r({c.B * c.Li * c.n});
      const auto run = [&](bool fused_call, DevHeads& qh, DevHeads& kh, DevHeads& vh, CastTargets& a, CastTargets& b,
                           CastTargets& v, Pair& qr, Pair& kr) {
        for (const auto& [tok, offset, stats] : {std::tuple{&txt, int64_t{0}, false}, std::tuple{&img, c.Lt, true}}) {
          const Tensor rq_t = stats ? qr.dev : Tensor{}, rk_t = stats ? kr.dev : Tensor{};
          const auto [fq, fk, fv] = std::tuple{a.on(qh, counts), b.on(kh, counts), v.on(vh, counts)};
          if (fused_call)
            be.qk_norm_rope_to_heads_fp8(fq, fk, fv, rq_t, rk_t, win(*tok, 0), win(*tok, 1), win(*tok, 2), q_scale.dev,
                                         k_scale.dev, pe.dev, offset, 1e-6);
          else
            be.Backend::qk_norm_rope_to_heads_fp8(fq, fk, fv, rq_t, rk_t, win(*tok, 0), win(*tok, 1), win(*tok, 2),
                                                  q_scale.dev, k_scale.dev, pe.dev, offset, 1e-6);
        }
        be.synchronize();
      };
      const int64_t vector_calls = static_cast<CudaBackend&>(be).qk_norm_rope_vector_calls();
      run(true, q8, k8, v8, tq, tk, tv, q_rstd, k_rstd);
      const int64_t fused_calls = static_cast<CudaBackend&>(be).qk_norm_rope_vector_calls() - vector_calls;
      run(false, q8r, k8r, v8r, rq, rk, rv, q_rstd_r, k_rstd_r);
      EXPECT_EQ(fused_calls, c.fused ? 2 : 0) << "the calls the fused kernel took";
      expect_same_heads(q8, q8r, "q");
      expect_same_heads(k8, k8r, "k");
      expect_same_heads(v8, v8r, "v");
      expect_same_targets(tq, rq, counts, "q");
      expect_same_targets(tk, rk, counts, "k");
      expect_same_targets(tv, rv, counts, "v");
      EXPECT_EQ(bits(q_rstd.down()), bits(q_rstd_r.down()));
      EXPECT_EQ(bits(k_rstd.down()), bits(k_rstd_r.down()));
      if (counts) {
        EXPECT_EQ(tq.stats.elements, rows * c.D) << "both streams' elements, once each";
        EXPECT_GT(tv.stats.saturated, 0) << "the test's v scale saturates some";
      }
    }
  }
}

TEST(CudaFp8Heads, QkNormRopeBackwardReadsTheDequantizedHeads) {
  FLUX8_REQUIRE_GPU();
  for (const HeadsCase& c : kCases) {
    SCOPED_TRACE(describe(c));
    Backend& be = backend_for(c);
    const int64_t L = c.Lt + c.Li, H = c.n * c.D, rows = c.B * c.n * L, S = c.B * c.Li * c.n;
    Pair pe({c.B, L, c.D / 2, 2}), q_scale({c.D}), k_scale({c.D}), q_rstd({S}), k_rstd({S});
    pe.randn(811), q_scale.randn(812), k_scale.randn(813);
    q_rstd.randn(814, 0.3), k_rstd.randn(815, 0.3);
    DevAct img({c.B, c.Li, 3 * H}, c.pad, c.bf16, 816, 2.0), d({c.B, c.Li, 3 * H}, c.pad, c.bf16, 817, 1.0);
    DevHeads dq8(rows, c.D, Fp8Format::e5m2), dk8(rows, c.D, Fp8Format::e5m2), dv8(rows, c.D, Fp8Format::e5m2);
    dq8.fill_random(818, 1.0, 1.0f / 1024), dk8.fill_random(819, 1.0, 1.0f / 3000);
    dv8.fill_random(820, 1.0, 0.37f, true);
    const auto win = [&](const DevAct& a, int64_t i) { return a.t.cols_slice(i * H, H); };
    const std::vector<uint8_t> d_before = d.bytes();
    std::vector<uint8_t> results[2];
    std::vector<uint32_t> dscales[2][2];
    for (const bool fused_call : {true, false}) {
      d.restore(d_before);
      Pair dq_scale({c.D}), dk_scale({c.D});
      dq_scale.randn(821), dk_scale.randn(822);  // accumulated into
      if (fused_call)
        be.qk_norm_rope_to_heads_backward_fp8(win(d, 0), win(d, 1), win(d, 2), dq_scale.dev, dk_scale.dev, dq8.q, dk8.q,
                                              dv8.q, win(img, 0), win(img, 1), q_rstd.dev, k_rstd.dev, q_scale.dev,
                                              k_scale.dev, pe.dev, c.Lt);
      else
        be.Backend::qk_norm_rope_to_heads_backward_fp8(win(d, 0), win(d, 1), win(d, 2), dq_scale.dev, dk_scale.dev,
                                                       dq8.q, dk8.q, dv8.q, win(img, 0), win(img, 1), q_rstd.dev,
                                                       k_rstd.dev, q_scale.dev, k_scale.dev, pe.dev, c.Lt);
      be.synchronize();
      results[fused_call ? 0 : 1] = d.bytes();
      dscales[fused_call ? 0 : 1][0] = bits(dq_scale.down());
      dscales[fused_call ? 0 : 1][1] = bits(dk_scale.down());
    }
    EXPECT_EQ(first_difference(results[0], results[1], dtype_size(d.t.dtype)), "") << "dq | dk | dv (and padding)";
    EXPECT_EQ(dscales[0][0], dscales[1][0]) << "dq_scale";
    EXPECT_EQ(dscales[0][1], dscales[1][1]) << "dk_scale";
    EXPECT_NE(results[0], d_before) << "the op wrote its outputs";
  }
}

// The layout ops: dO written per stream as the cast of the plain layout move (E5M2, counts), o
// read as its dequantized values.
TEST(CudaFp8Heads, LayoutOpsCastAndDequantizeAsThePlainOps) {
  FLUX8_REQUIRE_GPU();
  for (const HeadsCase& c : kCases) {
    for (const bool counts : {false, true}) {
      SCOPED_TRACE(describe(c) << " counts=" << counts);
      Backend& be = backend_for(c);
      const int64_t L = c.Lt + c.Li, H = c.n * c.D, rows = c.B * c.n * L;
      DevAct txt({c.B, c.Lt, H}, c.pad, c.bf16, 831, 1e-3), img({c.B, c.Li, H}, c.pad, c.bf16, 832, 1e-3);
      DevHeads d8(rows, c.D, Fp8Format::e5m2), d8r(rows, c.D, Fp8Format::e5m2);
      CastTargets t(2.0e7f), r(2.0e7f);  // saturates the largest values, flushes none
      for (const auto& [tok, offset] : {std::pair{&txt, int64_t{0}}, std::pair{&img, c.Lt}}) {
        be.tokens_to_heads_fp8(t.on(d8, counts), tok->t, offset);
        be.Backend::tokens_to_heads_fp8(r.on(d8r, counts), tok->t, offset);
      }
      be.synchronize();
      expect_same_heads(d8, d8r, "dO");
      expect_same_targets(t, r, counts, "dO");
      if (counts) EXPECT_GT(t.stats.saturated, 0);

      // o: read back into each stream's tokens (padding untouched either way).
      DevHeads o8(rows, c.D, Fp8Format::e4m3);
      o8.fill_random(833, 2.0, 1.0f / 64, true);
      for (const auto& [tok, offset] : {std::pair{&txt, int64_t{0}}, std::pair{&img, c.Lt}}) {
        const std::vector<uint8_t> before = tok->bytes();
        be.heads_to_tokens_fp8(tok->t, o8.q, offset);
        be.synchronize();
        const std::vector<uint8_t> fused = tok->bytes();
        tok->restore(before);
        be.Backend::heads_to_tokens_fp8(tok->t, o8.q, offset);
        be.synchronize();
        EXPECT_EQ(first_difference(fused, tok->bytes(), dtype_size(tok->t.dtype)), "") << "o at offset " << offset;
        EXPECT_NE(fused, before);
      }
    }
  }
}

// The FP8-heads ops name what does not fit: heads not whole rows of the joint sequence, a
// stream past its end, heads of different shapes.
TEST(CudaFp8Heads, RefusesHeadsThatDoNotFitByName) {
  FLUX8_REQUIRE_GPU();
  const int64_t B = 1, n = 2, D = 128, L = 16, H = n * D;
  DevAct tok({B, 4, H}, 0, true, 841, 1.0);
  DevHeads o8(B * n * L, D, Fp8Format::e4m3), odd(B * n * L + 1, D, Fp8Format::e4m3);
  Backend& be = gpu_bf16_activations();
  expect_refused("heads_to_tokens_fp8: FP8 heads 'heads' have 33 rows",
                 [&] { be.heads_to_tokens_fp8(tok.t, odd.q, 0); });
  expect_refused("do not fit the joint length L = 16", [&] { be.heads_to_tokens_fp8(tok.t, o8.q, 13); });
  CastTargets t(1.0f);
  expect_refused("FP8 heads 'k_heads' are [33, 128] but 'q_heads' [32, 128]", [&] {
    DevAct qkv({B, 4, 3 * H}, 0, true, 842, 1.0);
    Pair pe({B, L, D / 2, 2}), s({D});
    be.qk_norm_rope_to_heads_fp8(t.on(o8, false), t.on(odd, false), t.on(o8, false), Tensor{}, Tensor{},
                                 qkv.t.cols_slice(0, H), qkv.t.cols_slice(H, H), qkv.t.cols_slice(2 * H, H), s.dev,
                                 s.dev, pe.dev, 0, 1e-6);
  });
}

}  // namespace
}  // namespace flux8::testing
