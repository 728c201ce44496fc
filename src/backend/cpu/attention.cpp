// Exact (non-causal, unmasked) softmax attention per (sample, head). Query rows are processed
// in fixed blocks so the score matrix held at once is [kQueryBlock, L], bounded for long
// sequences; products go through GEMM. The backward recomputes probabilities from the saved
// log-sum-exp, as FlashAttention does, instead of storing them.
#include <cmath>
#include <limits>

#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"

namespace flux8 {
using namespace cpu;

namespace {

// Fixed (not thread-dependent) so results never depend on the machine.
constexpr int64_t kQueryBlock = 128;

}  // namespace

void CpuBackend::execute(const op::Attention& args) {
  constexpr std::string_view op = "attention";
  const auto [t, c] = begin_call(options_, args);
  const auto [B, n, L, D] = ops::check(op, args);
  dispatch(t, [&]<typename T>(T) {
    std::vector<T> s(static_cast<size_t>(std::min(kQueryBlock, L) * L));
    for (int64_t bh = 0; bh < B * n; ++bh) {
      const T *kh = row<T>(args.k, bh * L), *vh = row<T>(args.v, bh * L);
      for (int64_t i0 = 0; i0 < L; i0 += kQueryBlock) {
        const int64_t m = std::min(kQueryBlock, L - i0);
        gemm<T>(false, true, m, L, D, static_cast<T>(args.scale), row<T>(args.q, bh * L + i0), args.q.ld, kh, args.k.ld,
                T(0), s.data(), L);
        // Row softmax, shifted by the row max so exp never overflows; the sum is in double.
        parallel_for(m, c, [&](int64_t i) {
          T* si = s.data() + i * L;
          T mx = -std::numeric_limits<T>::infinity();
          for (int64_t j = 0; j < L; ++j) mx = std::max(mx, si[j]);
          double sum = 0;
          for (int64_t j = 0; j < L; ++j) sum += (si[j] = std::exp(si[j] - mx));
          for (int64_t j = 0; j < L; ++j) si[j] = static_cast<T>(si[j] / sum);
          args.lse.ptr<T>()[bh * L + i0 + i] = static_cast<T>(mx + std::log(sum));
        });
        T* oh = row<T>(args.o, bh * L + i0);
        gemm<T>(false, false, m, D, L, T(1), s.data(), L, vh, args.v.ld, T(0), oh, args.o.ld);
        if (c.round_bf16)
          parallel_for(m, c, [&](int64_t i) {
            for (int64_t d = 0; d < D; ++d) oh[i * args.o.ld + d] = act<T>(oh[i * args.o.ld + d], c);
          });
      }
    }
  });
}

// With P = exp(S − lse), dP = dO·Vᵀ and δ_i = dO_i·O_i (= Σ_j P_ij dP_ij):
//   dV = Pᵀ·dO,  dS = P ⊙ (dP − δ)·scale,  dQ = dS·K,  dK = dSᵀ·Q.
void CpuBackend::execute(const op::AttentionBackward& args) {
  constexpr std::string_view op = "attention_backward";
  const auto [t, c] = begin_call(options_, args);
  const auto [B, n, L, D] = ops::check(op, args);
  dispatch(t, [&]<typename T>(T) {
    const size_t block = static_cast<size_t>(std::min(kQueryBlock, L) * L);
    std::vector<T> p(block), dp(block);
    for (int64_t bh = 0; bh < B * n; ++bh) {
      const T *kh = row<T>(args.k, bh * L), *vh = row<T>(args.v, bh * L);
      for (int64_t i0 = 0; i0 < L; i0 += kQueryBlock) {
        const int64_t m = std::min(kQueryBlock, L - i0);
        const T *qb = row<T>(args.q, bh * L + i0), *dob = row<T>(args.dout, bh * L + i0);
        const T beta = i0 == 0 ? T(0) : T(1);  // dK, dV sum over query blocks
        gemm<T>(false, true, m, L, D, static_cast<T>(args.scale), qb, args.q.ld, kh, args.k.ld, T(0), p.data(), L);
        parallel_for(m, c, [&](int64_t i) {
          const T l = args.lse.ptr<T>()[bh * L + i0 + i];
          for (int64_t j = 0; j < L; ++j) p[i * L + j] = std::exp(p[i * L + j] - l);
        });
        if (args.dv.defined())
          gemm<T>(true, false, L, D, m, T(1), p.data(), L, dob, args.dout.ld, beta, row<T>(args.dv, bh * L),
                  args.dv.ld);
        if (!args.dq.defined() && !args.dk.defined()) continue;
        gemm<T>(false, true, m, L, D, T(1), dob, args.dout.ld, vh, args.v.ld, T(0), dp.data(), L);
        parallel_for(m, c, [&](int64_t i) {
          const T *doi = dob + i * args.dout.ld, *oi = row<T>(args.o, bh * L + i0 + i);
          double delta = 0;
          for (int64_t d = 0; d < D; ++d) delta += static_cast<double>(doi[d]) * oi[d];
          for (int64_t j = 0; j < L; ++j)
            dp[i * L + j] = static_cast<T>(p[i * L + j] * (dp[i * L + j] - delta) * args.scale);
        });
        if (args.dq.defined())
          gemm<T>(false, false, m, D, L, T(1), dp.data(), L, kh, args.k.ld, T(0), row<T>(args.dq, bh * L + i0),
                  args.dq.ld);
        if (args.dk.defined())
          gemm<T>(true, false, L, D, m, T(1), dp.data(), L, qb, args.q.ld, beta, row<T>(args.dk, bh * L), args.dk.ld);
      }
    }
    // Round once the block sums are complete, as a kernel storing bf16 results would.
    if (c.round_bf16)
      for (const Tensor* g : {&args.dq, &args.dk, &args.dv})
        if (g->defined())
          parallel_for(g->rows(), c, [&](int64_t r) {
            T* gr = row<T>(*g, r);
            for (int64_t d = 0; d < D; ++d) gr[d] = act<T>(gr[d], c);
          });
  });
}

}  // namespace flux8
