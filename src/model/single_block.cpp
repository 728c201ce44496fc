#include "model/single_block.h"

#include <cmath>
#include <string>

namespace flux8 {

SingleBlockParams SingleBlockParams::bind(const ParamStore& s, int64_t index) {
  const std::string b = "single_blocks." + std::to_string(index) + ".";
  SingleBlockParams p;
  p.mod = LinearParams::bind(s, b + "modulation.lin");
  p.linear1 = LinearParams::bind(s, b + "linear1");
  p.linear2 = LinearParams::bind(s, b + "linear2");
  p.q_norm = ScaleParam::bind(s, b + "norm.query_norm.scale");
  p.k_norm = ScaleParam::bind(s, b + "norm.key_norm.scale");
  return p;
}

SingleBlockSaved SingleBlockSaved::allocate(Arena& a, const FluxConfig& c, StepShape sh, DType t) {
  const int64_t B = sh.batch, L = sh.tokens(), H = c.hidden_size, M = c.mlp_hidden();
  const int64_t n = c.num_heads;
  SingleBlockSaved s;
  s.z_in = a.alloc(t, Shape{B, L, H}, SlotKind::activation);
  s.mod = a.alloc(t, Shape{B, 3 * H}, SlotKind::activation);
  s.ln_mean = a.alloc(t, Shape{B * L}, SlotKind::statistic);
  s.ln_rstd = a.alloc(t, Shape{B * L}, SlotKind::statistic);
  s.zm = a.alloc(t, Shape{B, L, H}, SlotKind::linear_input);
  s.u = a.alloc(t, Shape{B, L, 3 * H + M}, SlotKind::activation);
  s.q_rstd = a.alloc(t, Shape{B * L * n}, SlotKind::statistic);
  s.k_rstd = a.alloc(t, Shape{B * L * n}, SlotKind::statistic);
  const Shape heads{B, n, L, c.head_dim()};
  s.q = a.alloc(t, heads, SlotKind::activation);
  s.k = a.alloc(t, heads, SlotKind::activation);
  s.v = a.alloc(t, heads, SlotKind::activation);
  s.o = a.alloc(t, heads, SlotKind::activation);
  s.lse = a.alloc(t, Shape{B, n, L}, SlotKind::statistic);
  s.cat = a.alloc(t, Shape{B, L, H + M}, SlotKind::linear_input);
  s.out = a.alloc(t, Shape{B, L, H}, SlotKind::activation);
  return s;
}

void single_block_forward(const BlockContext& ctx, const SingleBlockParams& p,
                          SingleBlockSaved& s, Tensor z) {
  Backend& be = ctx.be;
  const int64_t H = ctx.cfg.hidden_size, M = ctx.cfg.mlp_hidden();
  const double qk_eps = ctx.cfg.qk_norm_eps;
  be.copy(s.z_in, z);
  be.linear(s.mod, ctx.silu_vec, p.mod.w, p.mod.b);
  be.layernorm_modulate(s.zm, s.ln_mean, s.ln_rstd, z, s.mod.cols_slice(0, H),
                        s.mod.cols_slice(H, H), ctx.cfg.layernorm_eps);
  be.linear(s.u, s.zm, p.linear1.w, p.linear1.b);

  const size_t mark = ctx.scratch.mark();
  Tensor normed = ctx.scratch.alloc(ctx.dtype, z.shape, SlotKind::workspace);
  be.rmsnorm_heads(normed, s.q_rstd, s.u.cols_slice(0, H), p.q_norm.s, qk_eps);
  be.tokens_to_heads(s.q, normed, 0);
  be.rmsnorm_heads(normed, s.k_rstd, s.u.cols_slice(H, H), p.k_norm.s, qk_eps);
  be.tokens_to_heads(s.k, normed, 0);
  be.tokens_to_heads(s.v, s.u.cols_slice(2 * H, H), 0);
  ctx.scratch.release_to(mark);

  be.rope(s.q, ctx.pe, false);
  be.rope(s.k, ctx.pe, false);
  be.attention(s.o, s.lse, s.q, s.k, s.v,
               1.0 / std::sqrt(static_cast<double>(ctx.cfg.head_dim())));
  be.heads_to_tokens(s.cat.cols_slice(0, H), s.o, 0);
  be.gelu_tanh(s.cat.cols_slice(H, M), s.u.cols_slice(3 * H, M));
  be.linear(s.out, s.cat, p.linear2.w, p.linear2.b);
  be.gated_residual(z, s.out, s.mod.cols_slice(2 * H, H));
}

void single_block_backward(const BlockContext& ctx, const SingleBlockParams& p,
                           const SingleBlockSaved& s, Tensor dz) {
  Backend& be = ctx.be;
  const int64_t H = ctx.cfg.hidden_size, M = ctx.cfg.mlp_hidden();
  const int64_t B = ctx.shape.batch, L = ctx.shape.tokens();
  Arena& a = ctx.scratch;
  const size_t mark = a.mark();
  Tensor dmod = a.alloc(ctx.dtype, Shape{B, 3 * H}, SlotKind::workspace);
  Tensor d_h = a.alloc(ctx.dtype, Shape{B, L, H}, SlotKind::workspace);
  Tensor d_cat = a.alloc(ctx.dtype, Shape{B, L, H + M}, SlotKind::workspace);
  Tensor d_u = a.alloc(ctx.dtype, Shape{B, L, 3 * H + M}, SlotKind::workspace);
  Tensor d_o = a.alloc(ctx.dtype, s.o.shape, SlotKind::workspace);
  Tensor d_q = a.alloc(ctx.dtype, s.q.shape, SlotKind::workspace);
  Tensor d_k = a.alloc(ctx.dtype, s.k.shape, SlotKind::workspace);
  Tensor d_v = a.alloc(ctx.dtype, s.v.shape, SlotKind::workspace);

  be.gated_residual_backward(d_h, dmod.cols_slice(2 * H, H), dz, s.out, s.mod.cols_slice(2 * H, H));
  be.linear_backward(d_cat, p.linear2.dw, p.linear2.db, d_h, s.cat, p.linear2.w, false);
  be.gelu_tanh_backward(d_u.cols_slice(3 * H, M), d_cat.cols_slice(H, M), s.u.cols_slice(3 * H, M));
  be.tokens_to_heads(d_o, d_cat.cols_slice(0, H), 0);
  be.attention_backward(d_q, d_k, d_v, d_o, s.q, s.k, s.v, s.o, s.lse,
                        1.0 / std::sqrt(static_cast<double>(ctx.cfg.head_dim())));
  be.rope(d_q, ctx.pe, true);
  be.rope(d_k, ctx.pe, true);
  be.heads_to_tokens(d_h, d_q, 0);
  be.rmsnorm_heads_backward(d_u.cols_slice(0, H), p.q_norm.ds, d_h, s.u.cols_slice(0, H), s.q_rstd,
                            p.q_norm.s);
  be.heads_to_tokens(d_h, d_k, 0);
  be.rmsnorm_heads_backward(d_u.cols_slice(H, H), p.k_norm.ds, d_h, s.u.cols_slice(H, H), s.k_rstd,
                            p.k_norm.s);
  be.heads_to_tokens(d_u.cols_slice(2 * H, H), d_v, 0);
  be.linear_backward(d_h, p.linear1.dw, p.linear1.db, d_u, s.zm, p.linear1.w, false);
  be.layernorm_modulate_backward(dz, dmod.cols_slice(0, H), dmod.cols_slice(H, H), d_h, s.z_in,
                                 s.ln_mean, s.ln_rstd, s.mod.cols_slice(H, H), true);
  be.linear_backward(ctx.d_silu_vec, p.mod.dw, p.mod.db, dmod, ctx.silu_vec, p.mod.w, true);
  a.release_to(mark);
}

void single_block_plan_scratch(Arena& a, const FluxConfig& c, StepShape sh, DType t) {
  // Everything single_block_backward takes (the forward takes less).
  const int64_t B = sh.batch, L = sh.tokens(), H = c.hidden_size, M = c.mlp_hidden();
  a.alloc(t, Shape{B, 3 * H}, SlotKind::workspace);
  a.alloc(t, Shape{B, L, H}, SlotKind::workspace);
  a.alloc(t, Shape{B, L, H + M}, SlotKind::workspace);
  a.alloc(t, Shape{B, L, 3 * H + M}, SlotKind::workspace);
  for (int i = 0; i < 4; ++i) a.alloc(t, Shape{B, c.num_heads, L, c.head_dim()}, SlotKind::workspace);
}

}  // namespace flux8
