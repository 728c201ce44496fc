// FP8 attention on the CPU: cuDNN's FP8 flash-attention graphs (cuda/attention_fp8.cu)
// evaluated operation by operation — codes decoded to their FP8 values (exact in f32), the
// matmuls in f32, each descale and scale applied to the f32 result in the graph's order, P and
// dS cast with the quantizers' per-element cast — so the CUDA backend is checked against what
// its graph asks for. The two differ in summation order and in where cuDNN's kernels round P:
// its online softmax casts exp(S − running max) before dividing by the row sum.
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"
#include "fp8/quantize.h"

namespace flux8 {
using namespace cpu;

namespace {

// Query rows per block: the score block held at once is [kQueryBlock, L]. Fixed, so results
// never depend on the machine.
constexpr int64_t kQueryBlock = 128;

// The FP8 values of a tensor's codes, scale not applied.
std::vector<float> decode(const QTensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = fp8_decode(t.codes[i], t.format);
  return v;
}

// max over per-row amaxes (NaN ignored), into *target when given.
void record_amax(float* target, const std::vector<float>& row_amax) {
  if (!target) return;
  float a = 0.0f;
  for (float x : row_amax) a = amax_accumulate(a, x);
  *target = amax_accumulate(*target, a);
}

// Writes `value`·scale cast to t's format as element i of t.
inline void put(const QTensor& t, int64_t i, float value, float scale) {
  t.codes[i] = quantize_value(value, scale, t.format);
}

}  // namespace

void CpuBackend::execute(const op::Dequantize& args) {
  ops::check("dequantize", args);
  const float scale_inv = args.x.scale_inv[0];
  const Ctx c = make_ctx(options_, DType::f32);
  parallel_for(args.x.rows, c, [&](int64_t r) {
    for (int64_t col = 0; col < args.x.cols; ++col) {
      const float v = dequantize_value(args.x.codes[r * args.x.cols + col], scale_inv, args.x.format);
      if (args.y.dtype == DType::bf16)
        args.y.ptr<uint16_t>()[r * args.y.ld + col] = f32_to_bf16_bits(v);
      else
        args.y.ptr<float>()[r * args.y.ld + col] = v;
    }
  });
}

void CpuBackend::execute(const op::AttentionFp8& args) {
  constexpr std::string_view op = "attention_fp8";
  const auto [B, n, L, D] = ops::check(op, args);
  const Ctx c = make_ctx(options_, DType::f32);
  const std::vector<float> qv = decode(args.q), kv = decode(args.k), vv = decode(args.v);
  const float attn = static_cast<float>(args.scale), descale_q = args.q.scale_inv[0], descale_k = args.k.scale_inv[0],
              descale_v = args.v.scale_inv[0], scale_s = Fp8AttentionScales::p_scale(args.q.format),
              descale_s = scale_inverse(scale_s), scale_o = *args.sc.o;
  const int64_t rows = B * n * L;
  std::vector<float> amax_s(static_cast<size_t>(rows), 0.0f), amax_o(static_cast<size_t>(rows), 0.0f);
  std::vector<float> p(static_cast<size_t>(std::min(kQueryBlock, L) * L)), acc(static_cast<size_t>(kQueryBlock * D));
  for (int64_t bh = 0; bh < B * n; ++bh) {
    const float *kh = kv.data() + bh * L * D, *vh = vv.data() + bh * L * D;
    for (int64_t i0 = 0; i0 < L; i0 += kQueryBlock) {
      const int64_t m = std::min(kQueryBlock, L - i0), r0 = bh * L + i0;
      gemm<float>(false, true, m, L, D, 1.0f, qv.data() + r0 * D, D, kh, D, 0.0f, p.data(), L);
      parallel_for(m, c, [&](int64_t i) {
        float* pi = p.data() + i * L;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < L; ++j) mx = std::max(mx, pi[j] = pi[j] * attn * descale_q * descale_k);
        float sum = 0.0f;
        for (int64_t j = 0; j < L; ++j) sum += (pi[j] = std::exp(pi[j] - mx));
        args.lse.ptr<float>()[r0 + i] = mx + std::log(sum);
        float a = 0.0f;
        for (int64_t j = 0; j < L; ++j) {
          const float prob = pi[j] / sum;
          a = amax_accumulate(a, prob);
          pi[j] = fp8_decode(quantize_value(prob, scale_s, args.q.format), args.q.format);  // P8's value
        }
        amax_s[static_cast<size_t>(r0 + i)] = a;
      });
      gemm<float>(false, false, m, D, L, 1.0f, p.data(), L, vh, D, 0.0f, acc.data(), D);
      parallel_for(m, c, [&](int64_t i) {
        float a = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          const float x = acc[static_cast<size_t>(i * D + d)] * descale_s * descale_v;
          a = amax_accumulate(a, x);
          put(args.o, (r0 + i) * D + d, x, scale_o);
        }
        amax_o[static_cast<size_t>(r0 + i)] = a;
      });
    }
  }
  args.o.scale_inv[0] = scale_inverse(scale_o);
  record_amax(args.sc.amax_s, amax_s);
  record_amax(args.sc.amax_o, amax_o);
}

// The backward graph's order: δ = rowsum(dO ⊙ O)·descale_dO·descale_O; P = exp(S − lse);
// dV = P8ᵀ·dO; dP = dO·vᵀ; dS = (dP − δ)·P·scale; dQ = dS8·k; dK = dS8ᵀ·q.
void CpuBackend::execute(const op::AttentionFp8Backward& args) {
  constexpr std::string_view op = "attention_fp8_backward";
  const auto [B, n, L, D] = ops::check(op, args);
  const Ctx c = make_ctx(options_, DType::f32);
  const std::vector<float> qv = decode(args.q), kv = decode(args.k), vv = decode(args.v), ov = decode(args.o),
                           dov = decode(args.dout);
  const float attn = static_cast<float>(args.scale), descale_q = args.q.scale_inv[0], descale_k = args.k.scale_inv[0],
              descale_v = args.v.scale_inv[0], descale_o = args.o.scale_inv[0], descale_do = args.dout.scale_inv[0],
              scale_s = Fp8AttentionScales::p_scale(args.q.format), descale_s = scale_inverse(scale_s),
              scale_ds = *args.sc.ds, descale_ds = *args.sc.ds_inv;
  const int64_t rows = B * n * L, per_head = L * D;
  // dQ, dK, dV in f32 before their casts: dK and dV sum over query blocks.
  std::vector<float> dq32(static_cast<size_t>(rows * D)), dk32(dq32.size()), dv32(dq32.size());
  std::vector<float> amax_ds(static_cast<size_t>(rows), 0.0f);
  const size_t block = static_cast<size_t>(std::min(kQueryBlock, L) * L);
  std::vector<float> p(block), p8(block), dp(block);
  for (int64_t bh = 0; bh < B * n; ++bh) {
    const float *kh = kv.data() + bh * per_head, *vh = vv.data() + bh * per_head;
    for (int64_t i0 = 0; i0 < L; i0 += kQueryBlock) {
      const int64_t m = std::min(kQueryBlock, L - i0), r0 = bh * L + i0;
      const float *qb = qv.data() + r0 * D, *dob = dov.data() + r0 * D;
      const float beta = i0 == 0 ? 0.0f : 1.0f;
      gemm<float>(false, true, m, L, D, 1.0f, qb, D, kh, D, 0.0f, p.data(), L);
      parallel_for(m, c, [&](int64_t i) {
        const float l = args.lse.ptr<float>()[r0 + i];
        for (int64_t j = 0; j < L; ++j) {
          const size_t e = static_cast<size_t>(i * L + j);
          p[e] = std::exp(p[e] * attn * descale_q * descale_k - l);
          p8[e] = fp8_decode(quantize_value(p[e], scale_s, args.q.format), args.q.format);
        }
      });
      gemm<float>(true, false, L, D, m, 1.0f, p8.data(), L, dob, D, beta, dv32.data() + bh * per_head, D);
      gemm<float>(false, true, m, L, D, 1.0f, dob, D, vh, D, 0.0f, dp.data(), L);
      parallel_for(m, c, [&](int64_t i) {
        float delta = 0.0f;
        for (int64_t d = 0; d < D; ++d)
          delta += dov[static_cast<size_t>((r0 + i) * D + d)] * ov[static_cast<size_t>((r0 + i) * D + d)];
        delta = delta * descale_do * descale_o;
        float a = 0.0f;
        for (int64_t j = 0; j < L; ++j) {
          const size_t e = static_cast<size_t>(i * L + j);
          const float ds = (dp[e] * descale_do * descale_v - delta) * p[e] * attn;
          a = amax_accumulate(a, ds);
          dp[e] = fp8_decode(quantize_value(ds, scale_ds, args.dout.format), args.dout.format);  // dS8's value
        }
        amax_ds[static_cast<size_t>(r0 + i)] = a;
      });
      gemm<float>(false, false, m, D, L, 1.0f, dp.data(), L, kh, D, 0.0f, dq32.data() + r0 * D, D);
      gemm<float>(true, false, L, D, m, 1.0f, dp.data(), L, qb, D, beta, dk32.data() + bh * per_head, D);
    }
  }
  // Descale, record the amaxes, cast: the graph's dQ = (dS8·k)·descale_dS·descale_k, and alike.
  struct Out {
    const QTensor& t;
    std::vector<float>& x;
    float descale_a, descale_b, scale;
    float* amax;
  };
  for (Out g : {Out{args.dq, dq32, descale_ds, descale_k, *args.sc.dq, args.sc.amax_dq},
                Out{args.dk, dk32, descale_ds, descale_q, *args.sc.dk, args.sc.amax_dk},
                Out{args.dv, dv32, descale_s, descale_do, *args.sc.dv, args.sc.amax_dv}}) {
    std::vector<float> row_amax(static_cast<size_t>(rows), 0.0f);
    parallel_for(rows, c, [&](int64_t r) {
      float a = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        const float x = g.x[static_cast<size_t>(r * D + d)] * g.descale_a * g.descale_b;
        a = amax_accumulate(a, x);
        put(g.t, r * D + d, x, g.scale);
      }
      row_amax[static_cast<size_t>(r)] = a;
    });
    g.t.scale_inv[0] = scale_inverse(g.scale);
    record_amax(g.amax, row_amax);
  }
  record_amax(args.sc.amax_ds, amax_ds);
}

}  // namespace flux8
