#include "model/fp8_attention.h"

#include <cmath>

namespace flux8 {

namespace {

using T = Fp8Runtime::AttentionTensor;

QTensor heads_cast(Arena& a, const BlockWidths& w, StepShape sh, Fp8Format f, SlotKind kind) {
  return allocate_qtensor(a, sh.batch * w.heads * sh.tokens(), w.head_dim, f, Fp8Scaling::per_tensor, kind);
}

Shape heads_shape(const BlockContext& ctx) { return flux8::heads_shape(ctx.widths, ctx.shape); }

}  // namespace

Fp8AttentionSaved Fp8AttentionSaved::allocate(Arena& a, const BlockWidths& w, StepShape sh, const Fp8Runtime* fp8) {
  Fp8AttentionSaved s;
  const Fp8Format f = fp8 ? fp8->attention_format(T::q) : Fp8Format::e4m3;
  s.q = heads_cast(a, w, sh, f, SlotKind::fp8_heads);
  s.k = heads_cast(a, w, sh, f, SlotKind::fp8_heads);
  s.v = heads_cast(a, w, sh, f, SlotKind::fp8_heads);
  s.o = heads_cast(a, w, sh, fp8 ? fp8->attention_format(T::o) : Fp8Format::e4m3, SlotKind::fp8_heads);
  return s;
}

Fp8AttentionGrads Fp8AttentionGrads::allocate(Arena& a, const BlockWidths& w, StepShape sh, const Fp8Config& fp8) {
  const Fp8Format g = operand_format(fp8, Operand::grad_output);  // Fp8Runtime::attention_format of the gradients
  Fp8AttentionGrads d;
  d.dout = heads_cast(a, w, sh, g, SlotKind::workspace);
  d.dq = heads_cast(a, w, sh, g, SlotKind::workspace);
  d.dk = heads_cast(a, w, sh, g, SlotKind::workspace);
  d.dv = heads_cast(a, w, sh, g, SlotKind::workspace);
  return d;
}

AttentionHeadGrads AttentionHeadGrads::allocate(const BlockContext& ctx, bool fp8_attention) {
  AttentionHeadGrads g;
  if (fp8_attention) {
    g.fp8 = Fp8AttentionGrads::allocate(ctx.scratch, ctx.widths, ctx.shape, ctx.fp8->config());
  } else {
    g.o = ctx.scratch.alloc(ctx.heads_dtype, heads_shape(ctx), SlotKind::workspace);
    allocate_heads_qkv(ctx.scratch, ctx.widths, ctx.shape, ctx.heads_dtype, SlotKind::workspace, g.q, g.k, g.v);
  }
  return g;
}

void fp8_attention_qkv(const BlockContext& ctx, int index, const Fp8AttentionSaved& s, Tensor q_rstd, Tensor k_rstd,
                       Tensor q, Tensor k, Tensor v, Tensor q_scale, Tensor k_scale, int64_t token_offset) {
  Fp8Runtime& fp8 = *ctx.fp8;
  ctx.be.run(op::QkNormRopeToHeadsFp8{.q_heads = {s.q, fp8.attention_cast(index, T::q)},
                                      .k_heads = {s.k, fp8.attention_cast(index, T::k)},
                                      .v_heads = {s.v, fp8.attention_cast(index, T::v)},
                                      .q_rstd = q_rstd,
                                      .k_rstd = k_rstd,
                                      .q = q,
                                      .k = k,
                                      .v = v,
                                      .q_scale = q_scale,
                                      .k_scale = k_scale,
                                      .pe = ctx.pe,
                                      .token_offset = token_offset,
                                      .eps = ctx.cfg.qk_norm_eps});
}

void fp8_attention_forward(const BlockContext& ctx, int index, const Fp8AttentionSaved& s, Tensor lse) {
  ctx.be.attention_fp8(s.o, lse, s.q, s.k, s.v, heads_shape(ctx), attention_scale(ctx.cfg),
                       ctx.fp8->attention_scales(index));
}

void fp8_attention_dout(const BlockContext& ctx, int index, const Fp8AttentionGrads& d, Tensor d_attn,
                        int64_t token_offset) {
  ctx.be.run(op::TokensToHeadsFp8{
      .heads = {d.dout, ctx.fp8->attention_cast(index, T::dout)}, .tokens = d_attn, .token_offset = token_offset});
}

void attention_output_to_tokens(Backend& be, const Tensor& tokens, const Fp8AttentionSaved& att8, const Tensor& o,
                                int64_t token_offset) {
  if (att8.defined())
    be.heads_to_tokens_fp8(tokens, att8.o, token_offset);
  else
    be.heads_to_tokens(tokens, o, token_offset);
}

void fp8_attention_backward(const BlockContext& ctx, int index, const Fp8AttentionSaved& s, Tensor lse,
                            const Fp8AttentionGrads& d) {
  ctx.be.attention_fp8_backward(d.dq, d.dk, d.dv, d.dout, s.q, s.k, s.v, s.o, lse, heads_shape(ctx),
                                attention_scale(ctx.cfg), ctx.fp8->attention_scales(index));
}

}  // namespace flux8
