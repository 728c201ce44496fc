// The per-op profiler (flux8 bench --profile) forwards each op to the backend it wraps as that
// op. An op with a default in Backend (composed of other ops) that the profiler did not override
// would run the default on the profiler instead: the profile then shows the parts, not the op,
// and times a path the backend never takes (this happened to the FP8-heads ops, whose default
// is a cast per (sample, head)).
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "bench/op_profiler.h"

namespace flux8 {
namespace {

std::map<std::string, int64_t> calls_of(const OpProfiler& p) {
  std::map<std::string, int64_t> m;
  for (const OpProfiler::Row& r : p.rows()) m[r.op] = r.calls;
  return m;
}

TEST(OpProfiler, TimesTheFp8HeadsOpsAsThemselves) {
  auto cpu = make_backend("cpu");
  OpProfiler prof(*cpu);
  const int64_t B = 1, n = 2, D = 8, L = 4, H = n * D, rows = B * n * L;
  std::vector<float> tok(static_cast<size_t>(B * L * 3 * H), 0.5f), pe(static_cast<size_t>(B * L * D), 0.25f),
      scale(static_cast<size_t>(D), 1.0f), stats(static_cast<size_t>(B * L * n)), dscale(static_cast<size_t>(D));
  std::vector<uint8_t> codes[4];
  float scale_inv[4] = {1, 1, 1, 1}, delayed = 1.0f;
  QTensor q[4];
  for (int i = 0; i < 4; ++i) {
    codes[i].assign(static_cast<size_t>(rows * D), 0x38);
    q[i].codes = codes[i].data(), q[i].rows = rows, q[i].cols = D, q[i].scale_inv = &scale_inv[i];
  }
  Backend::Quantize cast;
  cast.delayed_scale = &delayed;
  const Tensor qkv(tok.data(), DType::f32, Shape{B, L, 3 * H});
  const Tensor pe_t(pe.data(), DType::f32, Shape{B, L, D / 2, 2}), s(scale.data(), DType::f32, Shape{D});
  const Tensor st(stats.data(), DType::f32, Shape{B * L * n}), ds(dscale.data(), DType::f32, Shape{D});
  prof.qk_norm_rope_to_heads_fp8({q[0], cast}, {q[1], cast}, {q[2], cast}, st, st, qkv.cols_slice(0, H),
                                 qkv.cols_slice(H, H), qkv.cols_slice(2 * H, H), s, s, pe_t, 0, 1e-6);
  prof.qk_norm_rope_to_heads_backward_fp8(qkv.cols_slice(0, H), qkv.cols_slice(H, H), qkv.cols_slice(2 * H, H), ds,
                                          ds, q[0], q[1], q[2], qkv.cols_slice(0, H), qkv.cols_slice(H, H), st, st, s,
                                          s, pe_t, 0);
  prof.tokens_to_heads_fp8({q[3], cast}, qkv.cols_slice(0, H), 0);
  prof.heads_to_tokens_fp8(qkv.cols_slice(0, H), q[3], 0);
  const std::map<std::string, int64_t> c = calls_of(prof);
  EXPECT_EQ(c.size(), 4u) << "only the four ops themselves, none of their parts";
  EXPECT_EQ(c.count("qk_norm_rope_to_heads_fp8 (+ fp8 casts)"), 1u);
  EXPECT_EQ(c.count("qk_norm_rope_to_heads_backward_fp8"), 1u);
  EXPECT_EQ(c.count("tokens_to_heads_fp8 (+ fp8 cast)"), 1u);
  EXPECT_EQ(c.count("heads_to_tokens_fp8"), 1u);
  EXPECT_EQ(c.count("quantize (fp8 cast)"), 0u);
  EXPECT_EQ(c.count("dequantize"), 0u);
}

}  // namespace
}  // namespace flux8
