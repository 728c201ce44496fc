#include "model/double_block.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace flux8 {

namespace {

// Modulation chunks of a double-block stream: (shift, scale, gate) for attention then MLP.
Tensor chunk(const Tensor& mod, int64_t i, int64_t H) { return mod.cols_slice(i * H, H); }

// LayerNorm of x modulated by chunks i (shift) and i + 1 (scale): a Linear's input.
Backend::CastInput layernorm_input(Tensor x, Tensor mean, Tensor rstd, const Tensor& mod, int64_t i, int64_t H,
                                   double eps) {
  return Backend::CastInput::layernorm_modulate_of(x, mean, rstd, chunk(mod, i, H), chunk(mod, i + 1, H), eps);
}

DoubleStreamParams bind_stream(ParamStore& s, const std::string& p) {
  DoubleStreamParams d;
  d.mod = LinearSite::bind(s, p + "_mod.lin");
  d.qkv = LinearSite::bind(s, p + "_attn.qkv");
  d.proj = LinearSite::bind(s, p + "_attn.proj");
  d.mlp_in = LinearSite::bind(s, p + "_mlp.0");
  d.mlp_out = LinearSite::bind(s, p + "_mlp.2");
  bind_qk_norm(s, p + "_attn.", d.q_norm, d.k_norm);
  return d;
}

DoubleStreamSaved allocate_stream(Arena& a, const BlockWidths& w, int64_t B, int64_t Ls, DType t,
                                  const DoubleStreamParams& p, const Fp8Runtime* fp8, BlockRecompute r) {
  const int64_t H = w.hidden, A = w.attention, M = w.mlp, n = w.heads;
  DoubleStreamSaved s;
  auto act = [&](int64_t cols) { return a.alloc(t, Shape{B, Ls, cols}, SlotKind::activation); };
  auto lin = [&](const LinearSite& site, int64_t cols) {
    return allocate_linear_input(a, site, fp8, Shape{B, Ls, cols}, t);
  };
  auto stat = [&](int64_t per_token) {
    return a.alloc(statistics_dtype(t), Shape{B * Ls * per_token}, SlotKind::statistic);
  };
  // SiLU(vec) is shared by every modulation Linear: only an FP8 cast of it is saved here.
  if (wgrad_in_fp8(p.mod, fp8)) s.mod_in = allocate_linear_input(a, p.mod, fp8, Shape{B, H}, t);
  s.mod = a.alloc(t, Shape{B, 6 * H}, SlotKind::activation);
  s.ln1_mean = stat(1);
  s.ln1_rstd = stat(1);
  if (!r.norms) s.xm1 = lin(p.qkv, H);
  s.qkv = act(3 * A);
  s.q_rstd = stat(n);
  s.k_rstd = stat(n);
  if (!r.copies) s.attn = lin(p.proj, A);
  s.proj_out = act(H);
  if (!r.norms) s.x_mid = act(H);
  s.ln2_mean = stat(1);
  s.ln2_rstd = stat(1);
  if (!r.norms) s.xm2 = lin(p.mlp_in, H);
  s.mlp_h = act(M);
  if (!r.copies) s.mlp_g = lin(p.mlp_out, M);
  s.mlp_out = act(H);
  return s;
}

}  // namespace

DoubleBlockParams DoubleBlockParams::bind(ParamStore& store, int64_t index) {
  const std::string b = "double_blocks." + std::to_string(index) + ".";
  return {bind_stream(store, b + "txt"), bind_stream(store, b + "img")};
}

std::vector<LinearSite*> DoubleBlockParams::sites() {
  std::vector<LinearSite*> out;
  for (DoubleStreamParams* p : {&txt, &img})
    for (LinearSite* s : {&p->mod, &p->qkv, &p->proj, &p->mlp_in, &p->mlp_out}) out.push_back(s);
  return out;
}

// Recomputation drops what is large per token but cheap to rebuild from what stays, as a
// compiler's min-cut partitioner does: q, k, v (3H per token, from qkv, which QK-norm's backward
// keeps anyway), each stream's attention output in token layout (H, a copy of o) and GELU output
// (M = 4H, from mlp_h), the two LayerNorm outputs (2H, from x_in and x_mid with their statistics)
// and x_mid (H, the gated residual of x_in and proj_out) — 11H of the 22H a token keeps, for no
// GEMM: the backward redoes QK-norm + RoPE + layout of q, k, v (one op per stream), the layout
// copy of o, one GELU, one gated residual, two LayerNorms and, in FP8, the four casts. mlp_h
// stays because GELU cannot be inverted and recomputing it is the mlp_in GEMM, which in FP8
// cannot even be redone bit-exactly (only the transposed cast of its input is kept); proj_out and
// mlp_out are GEMM outputs the gates' gradients read. o and lse stay: recomputing them is the
// attention forward, the most expensive op that is not a GEMM.
DoubleBlockSaved DoubleBlockSaved::allocate(Arena& a, const BlockWidths& w, StepShape sh, DType t, DType ht,
                                            const DoubleBlockParams& p, const Fp8Runtime* fp8, BlockRecompute r) {
  DoubleBlockSaved s;
  s.recompute = r;
  s.txt = allocate_stream(a, w, sh.batch, sh.txt_tokens, t, p.txt, fp8, r);
  s.img = allocate_stream(a, w, sh.batch, sh.img_tokens, t, p.img, fp8, r);
  if (p.fp8_attention >= 0) {
    s.att8 = Fp8AttentionSaved::allocate(a, w, sh, fp8);
  } else {
    if (!r.heads) allocate_heads_qkv(a, w, sh, ht, SlotKind::activation, s.q, s.k, s.v);
    s.o = a.alloc(ht, heads_shape(w, sh), SlotKind::activation);
  }
  s.lse = a.alloc(statistics_dtype(t), Shape{sh.batch, w.heads, sh.tokens()}, SlotKind::statistic);
  return s;
}

namespace {

// q, k, v of one stream (column windows of its qkv output) into the joint head-major q, k, v
// at the stream's token offset: QK-norm, RoPE at the joint positions and the layout, one op
// (with FP8 attention, `fp8_attention` its index, the FP8 casts in joint.att8 instead).
// q_rstd, k_rstd undefined: not saved (recomputation).
void stream_qkv_to_heads(const BlockContext& ctx, DoubleStreamParams& p, const Tensor& qkv, Tensor q_rstd,
                         Tensor k_rstd, const DoubleBlockSaved& joint, int64_t offset, int fp8_attention) {
  const int64_t A = ctx.widths.attention;
  if (joint.att8.defined())
    fp8_attention_qkv(ctx, fp8_attention, joint.att8, q_rstd, k_rstd, qkv.cols_slice(0, A), qkv.cols_slice(A, A),
                      qkv.cols_slice(2 * A, A), p.q_norm.s, p.k_norm.s, offset);
  else
    ctx.be.qk_norm_rope_to_heads(joint.q, joint.k, joint.v, q_rstd, k_rstd, qkv.cols_slice(0, A), qkv.cols_slice(A, A),
                                 qkv.cols_slice(2 * A, A), p.q_norm.s, p.k_norm.s, ctx.pe, offset, ctx.cfg.qk_norm_eps);
}

// Stream part before attention: modulation, LayerNorm 1, qkv, then QK-norm + RoPE into the
// joint head-major q/k/v at this stream's token offset. x, the block input, is saved as it is
// (the caller keeps it unchanged until the block's backward).
void stream_pre_attention(const BlockContext& ctx, DoubleStreamParams& p, DoubleStreamSaved& s, DoubleBlockSaved& joint,
                          Tensor x, int64_t offset, int fp8_attention) {
  Backend& be = ctx.be;
  const int64_t H = ctx.widths.hidden;
  const size_t mark = ctx.scratch.mark();
  s.x_in = x;
  if (!s.mod_in.cast_t.defined()) s.mod_in.full = ctx.silu_vec;
  site_forward(be, ctx.fp8, ctx.scratch, p.mod, s.mod, ctx.silu_vec, s.mod_in);
  Backend::CastInput ln1 = layernorm_input(x, s.ln1_mean, s.ln1_rstd, s.mod, 0, H, ctx.cfg.layernorm_eps);
  ln1.statistics_ready = s.ln1_ready;
  s.ln1_ready = false;
  SavedLinearInput xm1 = forward_linear_input(ctx.scratch, p.qkv, ctx.fp8, s.xm1, x.shape, ctx.dtype);
  site_forward_fused(be, ctx.fp8, ctx.scratch, p.qkv, s.qkv, ln1, xm1, ctx.dtype);
  stream_qkv_to_heads(ctx, p, s.qkv, s.q_rstd, s.k_rstd, joint, offset, fp8_attention);
  ctx.scratch.release_to(mark);
}

// Stream part after attention: projection, gated residual, LayerNorm 2, MLP, gated residual.
// Both residuals are written out of place — x_mid = x + gate1 ⊙ proj into its saved slot,
// out = x_mid + gate2 ⊙ mlp — so neither the block input nor x_mid needs a copy. Where LayerNorm
// 2 runs inside mlp_in's FP8 cast, the first residual writes its statistics, and the second
// those of the next LayerNorm (`next`), if any. proj and mlp_out are row-parallel: their outputs
// are summed over the tensor-parallel group before they join the residual.
void stream_post_attention(const BlockContext& ctx, DoubleStreamParams& p, DoubleStreamSaved& s,
                           const DoubleBlockSaved& joint, Tensor x, Tensor out, int64_t offset, NormStatsOut next) {
  Backend& be = ctx.be;
  const int64_t H = ctx.widths.hidden, B = x.shape[0], Ls = x.shape[1];
  const double eps = ctx.cfg.layernorm_eps;
  const size_t mark = ctx.scratch.mark();
  // What the block does not keep is made in scratch, by the same ops (forward_linear_input).
  Arena& a = ctx.scratch;
  const Shape attn_tok{B, Ls, ctx.widths.attention};
  SavedLinearInput attn_in = forward_linear_input(a, p.proj, ctx.fp8, s.attn, attn_tok, ctx.dtype);
  SavedLinearInput xm2 = forward_linear_input(a, p.mlp_in, ctx.fp8, s.xm2, x.shape, ctx.dtype);
  SavedLinearInput mlp_g = forward_linear_input(a, p.mlp_out, ctx.fp8, s.mlp_g, s.mlp_h.shape, ctx.dtype);
  const Tensor x_mid = s.x_mid.defined() ? s.x_mid : a.alloc(ctx.dtype, x.shape, SlotKind::workspace);
  const Tensor attn = linear_input_buffer(a, attn_in, attn_tok, ctx.dtype);
  attention_output_to_tokens(be, attn, joint.att8, joint.o, offset);
  site_forward(be, ctx.fp8, a, p.proj, s.proj_out, attn, attn_in);
  ctx.tp.all_reduce(s.proj_out);
  Backend::CastInput ln2 = layernorm_input(x_mid, s.ln2_mean, s.ln2_rstd, s.mod, 3, H, eps);
  ln2.statistics_ready = ctx.norm_stats_in_residual && layernorm_in_cast(p.mlp_in, ctx.fp8, xm2);
  const NormStatsOut ln2_stats = ln2.statistics_ready
                                     ? NormStatsOut{stats_rows(s.ln2_mean, B, Ls), stats_rows(s.ln2_rstd, B, Ls)}
                                     : NormStatsOut{};
  gated_residual_to(be, x_mid, x, s.proj_out, chunk(s.mod, 2, H), ln2_stats, eps);
  if (gelu_in_epilogues(p.mlp_in, p.mlp_out, ctx.fp8)) {  // BF16: mlp_in's GEMM writes the GELU too
    const Tensor g = linear_input_buffer(a, mlp_g, s.mlp_h.shape, ctx.dtype);
    site_forward_gelu(be, ctx.fp8, a, p.mlp_in, g, s.mlp_h, ln2, xm2, ctx.dtype);
    site_forward(be, ctx.fp8, a, p.mlp_out, s.mlp_out, g, mlp_g);
  } else {  // FP8: the LayerNorm and the GELU inside the casts of the Linears' inputs
    site_forward_fused(be, ctx.fp8, a, p.mlp_in, s.mlp_h, ln2, xm2, ctx.dtype);
    site_forward_fused(be, ctx.fp8, a, p.mlp_out, s.mlp_out, Backend::CastInput::gelu_tanh_of(s.mlp_h), mlp_g,
                       ctx.dtype);
  }
  ctx.tp.all_reduce(s.mlp_out);
  gated_residual_to(be, out, x_mid, s.mlp_out, chunk(s.mod, 5, H), next, eps);
  ctx.scratch.release_to(mark);
}

// Backward of stream_post_attention: dx holds d(block output) and becomes d(x_mid); the
// attention-output gradient is scattered into the joint dO (with FP8 attention: d8's, cast).
// What the block did not keep is recomputed (as stream_post_attention made it) just before its
// use: x_mid first, then each Linear's input right before that Linear's backward. mlp_in is
// column-parallel: its input gradient is summed over the tensor-parallel group.
void stream_post_attention_backward(const BlockContext& ctx, DoubleStreamParams& p, const DoubleStreamSaved& s,
                                    const DoubleBlockSaved& joint, Tensor dmod, Tensor dx, Tensor d_o,
                                    const Fp8AttentionGrads& d8, int fp8_attention, int64_t offset) {
  Backend& be = ctx.be;
  const int64_t H = ctx.widths.hidden, M = ctx.widths.mlp;
  const Shape tok = s.x_in.shape;
  const int64_t B = tok[0], Ls = tok[1];
  const Shape attn_tok{B, Ls, ctx.widths.attention};
  Arena& a = ctx.scratch;
  const size_t mark = a.mark();
  // BF16: GELU's backward in the epilogue of mlp_out's dgrad GEMM, which writes d_m2 itself;
  // d_m, the GELU output's gradient, exists only where it does not.
  const bool gelu_fused = gelu_in_epilogues(p.mlp_in, p.mlp_out, ctx.fp8);
  Tensor d_h = a.alloc(ctx.dtype, tok, SlotKind::workspace);  // reused for every [B,Ls,H] grad
  Tensor d_m = gelu_fused ? Tensor{} : a.alloc(ctx.dtype, Shape{B, Ls, M}, SlotKind::workspace);
  // d_m2: mlp_in's output gradient, stored where a BF16 GEMM reads it (its wgrad, or the epilogue's dgrad).
  Tensor d_m2 = gelu_fused || !wgrad_in_fp8(p.mlp_in, ctx.fp8)
                    ? a.alloc(ctx.dtype, Shape{B, Ls, M}, SlotKind::workspace)
                    : Tensor{};
  const double eps = ctx.cfg.layernorm_eps;
  Tensor x_mid = s.x_mid;
  if (joint.recompute.norms) {  // the forward's gated residual, one fused multiply-add an element
    x_mid = a.alloc(ctx.dtype, tok, SlotKind::workspace);
    be.gated_residual(x_mid, s.x_in, s.proj_out, chunk(s.mod, 2, H));
  }

  // mlp_out's output gradient gate ⊙ dx: inside its FP8 casts, or written to d_h.
  const Backend::CastInput d_mlp_out =
      gated_branch_backward(be, p.mlp_out, ctx.fp8, d_h, chunk(dmod, 5, H), dx, s.mlp_out, chunk(s.mod, 5, H));
  const size_t gelu_mark = a.mark();
  const SavedLinearInput mlp_g =
      joint.recompute.copies
          ? recompute_linear_input_of(be, ctx.fp8, a, p.mlp_out, Backend::CastInput::gelu_tanh_of(s.mlp_h), ctx.dtype)
          : s.mlp_g;
  if (gelu_fused)
    site_backward_gelu(be, ctx.fp8, p.mlp_out, Tensor{}, d_m2, s.mlp_h, d_h, mlp_g);
  else
    site_backward_fused(be, ctx.fp8, a, p.mlp_out, d_m, d_mlp_out, d_h, mlp_g, false);
  a.release_to(gelu_mark);
  const SavedLinearInput xm2 =
      joint.recompute.norms
          ? recompute_linear_input_of(be, ctx.fp8, a, p.mlp_in,
                                      layernorm_input(x_mid, s.ln2_mean, s.ln2_rstd, s.mod, 3, H, eps), ctx.dtype)
          : s.xm2;
  if (gelu_fused)
    site_backward(be, ctx.fp8, a, p.mlp_in, d_h, d_m2, xm2, false);
  else  // GELU's backward inside the casts of the MLP input's output gradient (FP8), or into d_m2.
    site_backward_fused(be, ctx.fp8, a, p.mlp_in, d_h, Backend::CastInput::gelu_tanh_backward_of(d_m, s.mlp_h), d_m2,
                        xm2, false);
  ctx.tp.all_reduce(d_h);
  be.layernorm_modulate_backward(dx, chunk(dmod, 3, H), chunk(dmod, 4, H), d_h, x_mid, s.ln2_mean, s.ln2_rstd,
                                 chunk(s.mod, 4, H), true);

  Tensor d_attn = a.alloc(ctx.dtype, attn_tok, SlotKind::workspace);
  const Backend::CastInput d_proj =
      gated_branch_backward(be, p.proj, ctx.fp8, d_h, chunk(dmod, 2, H), dx, s.proj_out, chunk(s.mod, 2, H));
  SavedLinearInput attn = s.attn;
  if (joint.recompute.copies) {
    const Tensor x = a.alloc(ctx.dtype, attn_tok, SlotKind::workspace);
    attention_output_to_tokens(be, x, joint.att8, joint.o, offset);
    attn = recompute_linear_input(be, ctx.fp8, a, p.proj, x);
  }
  site_backward_fused(be, ctx.fp8, a, p.proj, d_attn, d_proj, d_h, attn, false);
  if (d8.defined())
    fp8_attention_dout(ctx, fp8_attention, d8, d_attn, offset);
  else
    be.tokens_to_heads(d_o, d_attn, offset);
  a.release_to(mark);
}

// recompute.heads: q, k, v (scratch views in `joint`) recomputed from each stream's kept qkv by the
// op of stream_pre_attention. QK-norm's statistics are not written again: the kept ones are
// the same values and stay in use.
void recompute_joint_qkv(const BlockContext& ctx, DoubleBlockParams& p, const DoubleBlockSaved& joint) {
  stream_qkv_to_heads(ctx, p.txt, joint.txt.qkv, Tensor{}, Tensor{}, joint, 0, p.fp8_attention);
  stream_qkv_to_heads(ctx, p.img, joint.img.qkv, Tensor{}, Tensor{}, joint, ctx.shape.txt_tokens, p.fp8_attention);
}

// Backward of stream_pre_attention: this stream's d(qkv) from the joint dq/dk/dv (with FP8
// attention: d8's) through RoPE, the layout and QK-norm in one op, then d(block input) in dx
// (qkv is column-parallel: its input gradient is summed over the tensor-parallel group).
// recompute_norms: qkv's input is recomputed from x_in right before qkv's backward.
void stream_pre_attention_backward(const BlockContext& ctx, DoubleStreamParams& p, const DoubleStreamSaved& s,
                                   Tensor dmod, Tensor dx, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                   const Fp8AttentionGrads& d8, int64_t offset, bool recompute_norms) {
  Backend& be = ctx.be;
  const int64_t H = ctx.widths.hidden, A = ctx.widths.attention;
  const Shape tok = s.x_in.shape;
  Arena& a = ctx.scratch;
  const size_t mark = a.mark();
  Tensor d_qkv = a.alloc(ctx.dtype, Shape{tok[0], tok[1], 3 * A}, SlotKind::workspace);
  Tensor d_h = a.alloc(ctx.dtype, tok, SlotKind::workspace);

  p.q_norm.prepare_grad();
  p.k_norm.prepare_grad();
  if (d8.defined())
    be.qk_norm_rope_to_heads_backward_fp8(d_qkv.cols_slice(0, A), d_qkv.cols_slice(A, A), d_qkv.cols_slice(2 * A, A),
                                          p.q_norm.ds, p.k_norm.ds, d8.dq, d8.dk, d8.dv, s.qkv.cols_slice(0, A),
                                          s.qkv.cols_slice(A, A), s.q_rstd, s.k_rstd, p.q_norm.s, p.k_norm.s, ctx.pe,
                                          offset);
  else
    be.qk_norm_rope_to_heads_backward(
        d_qkv.cols_slice(0, A), d_qkv.cols_slice(A, A), d_qkv.cols_slice(2 * A, A), p.q_norm.ds, p.k_norm.ds, dq, dk,
        dv, s.qkv.cols_slice(0, A), s.qkv.cols_slice(A, A), s.q_rstd, s.k_rstd, p.q_norm.s, p.k_norm.s, ctx.pe, offset);
  const SavedLinearInput xm1 =
      recompute_norms
          ? recompute_linear_input_of(
                be, ctx.fp8, a, p.qkv,
                layernorm_input(s.x_in, s.ln1_mean, s.ln1_rstd, s.mod, 0, H, ctx.cfg.layernorm_eps), ctx.dtype)
          : s.xm1;
  site_backward(be, ctx.fp8, a, p.qkv, d_h, d_qkv, xm1, false);
  ctx.tp.all_reduce(d_h);
  be.layernorm_modulate_backward(dx, chunk(dmod, 0, H), chunk(dmod, 1, H), d_h, s.x_in, s.ln1_mean, s.ln1_rstd,
                                 chunk(s.mod, 1, H), true);
  site_backward(be, ctx.fp8, a, p.mod, ctx.d_silu_vec, dmod, s.mod_in, true);
  a.release_to(mark);
}

}  // namespace

void double_block_forward(const BlockContext& ctx, DoubleBlockParams& p, DoubleBlockSaved& s, Tensor txt, Tensor img,
                          Tensor txt_out, Tensor img_out, NormStatsOut next_txt, NormStatsOut next_img) {
  const int64_t Lt = ctx.shape.txt_tokens;
  // (FP8 attention: q, k, v and o exist only as the FP8 casts in s.att8)
  stream_pre_attention(ctx, p.txt, s.txt, s, txt, 0, p.fp8_attention);
  stream_pre_attention(ctx, p.img, s.img, s, img, Lt, p.fp8_attention);
  if (s.att8.defined())
    fp8_attention_forward(ctx, p.fp8_attention, s.att8, s.lse);
  else
    ctx.be.attention(s.o, s.lse, s.q, s.k, s.v, attention_scale(ctx.cfg));
  stream_post_attention(ctx, p.txt, s.txt, s, txt, txt_out, 0, next_txt);
  stream_post_attention(ctx, p.img, s.img, s, img, img_out, Lt, next_img);
}

void double_block_backward(const BlockContext& ctx, DoubleBlockParams& p, const DoubleBlockSaved& s, Tensor dtxt,
                           Tensor dimg) {
  Backend& be = ctx.be;
  const int64_t Lt = ctx.shape.txt_tokens, B = ctx.shape.batch, H = ctx.widths.hidden;
  Arena& a = ctx.scratch;
  const size_t mark = a.mark();
  Tensor dmod_txt = a.alloc(ctx.dtype, Shape{B, 6 * H}, SlotKind::workspace);
  Tensor dmod_img = a.alloc(ctx.dtype, Shape{B, 6 * H}, SlotKind::workspace);
  // The joint head gradients: bf16 (or f32) heads, or with FP8 attention only their FP8 casts.
  const bool fp8_attention = s.att8.defined();
  const auto [d_o, d_q, d_k, d_v, d8] = AttentionHeadGrads::allocate(ctx, fp8_attention);

  DoubleBlockSaved joint = s;  // views; recompute.heads without FP8 attention: q, k, v rebuilt in scratch
  stream_post_attention_backward(ctx, p.txt, s.txt, joint, dmod_txt, dtxt, d_o, d8, p.fp8_attention, 0);
  stream_post_attention_backward(ctx, p.img, s.img, joint, dmod_img, dimg, d_o, d8, p.fp8_attention, Lt);
  const size_t qkv_mark = a.mark();
  if (fp8_attention) {
    fp8_attention_backward(ctx, p.fp8_attention, s.att8, s.lse, d8);
  } else {
    if (s.recompute.heads) {
      joint.place_recomputed(a, ctx.widths, ctx.shape, ctx.heads_dtype);
      recompute_joint_qkv(ctx, p, joint);
    }
    be.attention_backward(d_q, d_k, d_v, d_o, joint.q, joint.k, joint.v, s.o, s.lse, attention_scale(ctx.cfg));
  }
  a.release_to(qkv_mark);
  stream_pre_attention_backward(ctx, p.txt, s.txt, dmod_txt, dtxt, d_q, d_k, d_v, d8, 0, s.recompute.norms);
  stream_pre_attention_backward(ctx, p.img, s.img, dmod_img, dimg, d_q, d_k, d_v, d8, Lt, s.recompute.norms);
  if (p.txt.mod.store) p.txt.mod.store->flush_low_rank_copies();  // dmod's rows, before their release
  a.release_to(mark);
}

void double_block_plan_scratch(Arena& a, const BlockWidths& w, StepShape sh, DType t, const Fp8Config* fp8,
                               BlockRecompute r) {
  // double_block_backward's allocations in its order (the stream parts at the longer stream's
  // tokens), then apart from it the block's forward's: the arena's peak is their simultaneous use
  // (an overflow would fail loudly in Arena::alloc).
  const int64_t B = sh.batch, H = w.hidden, A = w.attention, M = w.mlp;
  const int64_t rows = B * std::max(sh.txt_tokens, sh.img_tokens);
  const BlockScratchPlan p(a, w, sh, t, fp8, rows);
  const size_t start = a.mark();
  for (int i = 0; i < 2; ++i) a.alloc(t, Shape{B, 6 * H}, SlotKind::workspace);  // dmod of each stream
  if (p.attention8)
    Fp8AttentionGrads::allocate(a, w, sh, *fp8);
  else
    p.head_tensors(4);  // dO, dq, dk, dv
  const size_t base = a.mark();
  // After attention, a stream: d_h, d_m (GELU's backward not in a dgrad epilogue), d_m2 (mlp_in's
  // stored output gradient), x_mid; mlp_out's recomputed input and casts, released before
  // mlp_in's; then d_attn, and proj's input (o's tokens, and the cast) and casts.
  p.tokens(H);
  if (p.fp8_sites) p.tokens(M);
  if (!p.wgrad8) p.tokens(M);
  if (r.norms) p.tokens(H);
  const size_t stream = a.mark();
  if (r.copies) p.recomputed_input(M);
  plan_site_backward(a, fp8, rows, H);
  a.release_to(stream);
  if (r.norms) p.recomputed_input(H);
  plan_site_backward(a, fp8, rows, M);
  p.tokens(A);
  if (r.copies) {
    p.tokens(A);
    plan_recompute_linear_input(a, fp8, rows, A);
  }
  plan_site_backward(a, fp8, rows, H);
  a.release_to(base);
  // The joint attention's backward: q, k, v recomputed (FP8 attention recomputes none).
  if (r.heads && !p.attention8) p.head_tensors(3);
  a.release_to(base);
  // Before attention, a stream: d_qkv, d_h, qkv's recomputed input and casts, the modulation's.
  p.tokens(3 * A);
  p.tokens(H);
  if (r.norms) p.recomputed_input(H);
  plan_site_backward(a, fp8, rows, 3 * A);
  plan_site_backward(a, p.modulation, B, 6 * H);
  a.release_to(start);
  // The forward: q, k, v in scratch where recomputed; before attention the modulation's and qkv's
  // input casts and qkv's input where stored; after it the Linear inputs it does not keep where a
  // site stores its input, x_mid where not kept, o's tokens for an FP8 proj, and the input casts.
  if (r.heads && !p.attention8) p.head_tensors(3);
  const size_t forward = a.mark();
  plan_site_forward(a, p.modulation, B, H);
  if (r.norms && !p.wgrad8) p.tokens(H);
  plan_site_forward(a, fp8, rows, H);
  a.release_to(forward);
  if (r.copies && !p.wgrad8) p.tokens(A);
  if (r.norms && !p.wgrad8) p.tokens(H);
  if (r.copies && !p.wgrad8) p.tokens(M);
  if (r.norms) p.tokens(H);
  if (p.wgrad8) p.tokens(A);
  plan_site_forward(a, fp8, rows, A);
  plan_site_forward(a, fp8, rows, H);
  plan_site_forward(a, fp8, rows, M);
}

}  // namespace flux8
