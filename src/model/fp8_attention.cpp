#include "model/fp8_attention.h"

#include <cmath>

namespace flux8 {

namespace {

using T = Fp8Runtime::AttentionTensor;

Shape heads_shape(const FluxConfig& c, StepShape sh) { return {sh.batch, c.num_heads, sh.tokens(), c.head_dim()}; }

QTensor heads_cast(Arena& a, const FluxConfig& c, StepShape sh, Fp8Format f, SlotKind kind) {
  const Shape h = heads_shape(c, sh);
  return allocate_qtensor(a, h[0] * h[1] * h[2], h[3], f, Fp8Scaling::per_tensor, kind);
}

double attention_scale(const FluxConfig& c) { return 1.0 / std::sqrt(static_cast<double>(c.head_dim())); }

}  // namespace

Fp8AttentionSaved Fp8AttentionSaved::allocate(Arena& a, const FluxConfig& c, StepShape sh, const Fp8Runtime* fp8) {
  Fp8AttentionSaved s;
  const Fp8Format f = fp8 ? fp8->attention_format(T::q) : Fp8Format::e4m3;
  s.q = heads_cast(a, c, sh, f, SlotKind::fp8_heads);
  s.k = heads_cast(a, c, sh, f, SlotKind::fp8_heads);
  s.v = heads_cast(a, c, sh, f, SlotKind::fp8_heads);
  s.o = heads_cast(a, c, sh, fp8 ? fp8->attention_format(T::o) : Fp8Format::e4m3, SlotKind::fp8_heads);
  return s;
}

void fp8_attention_forward(const BlockContext& ctx, int index, Fp8AttentionSaved& s, Tensor o, Tensor lse, Tensor q,
                           Tensor k, Tensor v) {
  Backend& be = ctx.be;
  Fp8Runtime& fp8 = *ctx.fp8;
  be.quantize(s.q, QTensor{}, q, fp8.attention_cast(index, T::q));
  be.quantize(s.k, QTensor{}, k, fp8.attention_cast(index, T::k));
  be.quantize(s.v, QTensor{}, v, fp8.attention_cast(index, T::v));
  be.attention_fp8(s.o, lse, s.q, s.k, s.v, q.shape, attention_scale(ctx.cfg), fp8.attention_scales(index));
  be.dequantize(o, s.o);
}

void fp8_attention_backward(const BlockContext& ctx, int index, const Fp8AttentionSaved& s, Tensor lse, Tensor dq,
                            Tensor dk, Tensor dv, Tensor dout) {
  Backend& be = ctx.be;
  Fp8Runtime& fp8 = *ctx.fp8;
  Arena& a = ctx.scratch;
  const size_t mark = a.mark();
  const Fp8Format g = fp8.attention_format(T::dout);
  QTensor d_o = heads_cast(a, ctx.cfg, ctx.shape, g, SlotKind::workspace);
  QTensor d_q = heads_cast(a, ctx.cfg, ctx.shape, g, SlotKind::workspace);
  QTensor d_k = heads_cast(a, ctx.cfg, ctx.shape, g, SlotKind::workspace);
  QTensor d_v = heads_cast(a, ctx.cfg, ctx.shape, g, SlotKind::workspace);
  be.quantize(d_o, QTensor{}, dout, fp8.attention_cast(index, T::dout));
  be.attention_fp8_backward(d_q, d_k, d_v, d_o, s.q, s.k, s.v, s.o, lse, dout.shape, attention_scale(ctx.cfg),
                            fp8.attention_scales(index));
  be.dequantize(dq, d_q);
  be.dequantize(dk, d_k);
  be.dequantize(dv, d_v);
  a.release_to(mark);
}

void plan_fp8_attention_scratch(Arena& a, const FluxConfig& c, StepShape sh) {
  for (int i = 0; i < 4; ++i) heads_cast(a, c, sh, Fp8Format::e5m2, SlotKind::workspace);
}

}  // namespace flux8
