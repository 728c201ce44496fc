#include "model/single_block.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace flux8 {

SingleBlockParams SingleBlockParams::bind(ParamStore& s, int64_t index) {
  const std::string b = "single_blocks." + std::to_string(index) + ".";
  SingleBlockParams p;
  p.mod = LinearSite::bind(s, b + "modulation.lin");
  p.linear1 = LinearSite::bind(s, b + "linear1");
  p.linear2 = LinearSite::bind(s, b + "linear2");
  bind_qk_norm(s, b, p.q_norm, p.k_norm);
  return p;
}

// Recomputation drops q, k, v (3H per token, from u: QK-norm + RoPE + layout), linear2's input
// cat (H + M = 5H: a copy of o and the GELU of u's MLP part) and linear1's input zm (H: the
// LayerNorm of z_in with its statistics) — 9H of the 19H a token keeps, for no GEMM. u and o
// stay: the first is a GEMM output that QK-norm's and GELU's backward need anyway, the second
// would cost the attention forward (with lse) to recompute; out is the GEMM output the gate's
// gradient reads.
SingleBlockSaved SingleBlockSaved::allocate(Arena& a, const BlockWidths& w, StepShape sh, DType t, DType ht,
                                            const SingleBlockParams& p, const Fp8Runtime* fp8, BlockRecompute r) {
  const int64_t B = sh.batch, L = sh.tokens(), H = w.hidden, A = w.attention, M = w.mlp;
  const int64_t n = w.heads;
  SingleBlockSaved s;
  s.recompute = r;
  if (wgrad_in_fp8(p.mod, fp8)) s.mod_in = allocate_linear_input(a, p.mod, fp8, Shape{B, H}, t);
  s.mod = a.alloc(t, Shape{B, 3 * H}, SlotKind::activation);
  const DType st = statistics_dtype(t);
  s.ln_mean = a.alloc(st, Shape{B * L}, SlotKind::statistic);
  s.ln_rstd = a.alloc(st, Shape{B * L}, SlotKind::statistic);
  if (!r.norms) s.zm = allocate_linear_input(a, p.linear1, fp8, Shape{B, L, H}, t);
  s.u = a.alloc(t, Shape{B, L, 3 * A + M}, SlotKind::activation);
  s.q_rstd = a.alloc(st, Shape{B * L * n}, SlotKind::statistic);
  s.k_rstd = a.alloc(st, Shape{B * L * n}, SlotKind::statistic);
  if (p.fp8_attention >= 0) {
    s.att8 = Fp8AttentionSaved::allocate(a, w, sh, fp8);
  } else {
    if (!r.heads) allocate_heads_qkv(a, w, sh, ht, SlotKind::activation, s.q, s.k, s.v);
    s.o = a.alloc(ht, heads_shape(w, sh), SlotKind::activation);
  }
  s.lse = a.alloc(st, Shape{B, n, L}, SlotKind::statistic);
  if (!r.copies) s.cat = allocate_linear_input(a, p.linear2, fp8, Shape{B, L, A + M}, t);
  s.out = a.alloc(t, Shape{B, L, H}, SlotKind::activation);
  return s;
}

namespace {

// recompute.copies: linear2's input as single_block_forward made it — the attention output in token
// layout next to GELU(u's MLP part) — in scratch; where the site keeps only an FP8 cast, the cast
// alone, the GELU run inside it with o's tokens as its head (the forward's op: same codes).
SavedLinearInput recompute_cat(const BlockContext& ctx, SingleBlockParams& p, const SingleBlockSaved& s) {
  const int64_t A = ctx.widths.attention, M = ctx.widths.mlp;
  const Shape tok{s.z_in.shape[0], s.z_in.shape[1], A};
  Arena& a = ctx.scratch;
  if (wgrad_in_fp8(p.linear2, ctx.fp8)) {  // as the forward: the GELU inside the cast, o's tokens as its head
    const Tensor o_tokens = a.alloc(ctx.dtype, tok, SlotKind::workspace);
    attention_output_to_tokens(ctx.be, o_tokens, s.att8, s.o, 0);
    return recompute_linear_input_of(ctx.be, ctx.fp8, a, p.linear2,
                                     Backend::CastInput::gelu_tanh_of(s.u.cols_slice(3 * A, M)).with_head(o_tokens),
                                     ctx.dtype);
  }
  const Tensor cat = a.alloc(ctx.dtype, Shape{tok[0], tok[1], A + M}, SlotKind::workspace);
  attention_output_to_tokens(ctx.be, cat.cols_slice(0, A), s.att8, s.o, 0);
  ctx.be.gelu_tanh(cat.cols_slice(A, M), s.u.cols_slice(3 * A, M));
  return recompute_linear_input(ctx.be, ctx.fp8, a, p.linear2, cat);
}

// q, k, v (column windows of u) into the head-major q, k, v of `s`: QK-norm, RoPE and the
// layout, one op (with FP8 attention the FP8 casts in s.att8 instead). q_rstd, k_rstd
// undefined: not saved (recomputation).
void qkv_to_heads(const BlockContext& ctx, SingleBlockParams& p, const SingleBlockSaved& s, Tensor q_rstd,
                  Tensor k_rstd) {
  const int64_t A = ctx.widths.attention;
  if (s.att8.defined())
    fp8_attention_qkv(ctx, p.fp8_attention, s.att8, q_rstd, k_rstd, s.u.cols_slice(0, A), s.u.cols_slice(A, A),
                      s.u.cols_slice(2 * A, A), p.q_norm.s, p.k_norm.s, 0);
  else
    ctx.be.qk_norm_rope_to_heads(s.q, s.k, s.v, q_rstd, k_rstd, s.u.cols_slice(0, A), s.u.cols_slice(A, A),
                                 s.u.cols_slice(2 * A, A), p.q_norm.s, p.k_norm.s, ctx.pe, 0, ctx.cfg.qk_norm_eps);
}

// recompute.heads: q, k, v (scratch views in `r`) from the kept u, by single_block_forward's op.
// QK-norm's statistics are not written again: the kept ones are the same values and stay in use.
void recompute_qkv(const BlockContext& ctx, SingleBlockParams& p, const SingleBlockSaved& r) {
  qkv_to_heads(ctx, p, r, Tensor{}, Tensor{});
}

}  // namespace

void single_block_forward(const BlockContext& ctx, SingleBlockParams& p, SingleBlockSaved& s, Tensor z, Tensor z_out,
                          NormStatsOut next) {
  Backend& be = ctx.be;
  const int64_t H = ctx.widths.hidden, A = ctx.widths.attention, M = ctx.widths.mlp;
  const size_t outer = ctx.scratch.mark();
  s.z_in = z;  // saved as it is: the caller keeps it unchanged until the block's backward
  if (!s.mod_in.cast_t.defined()) s.mod_in.full = ctx.silu_vec;
  site_forward(be, ctx.fp8, ctx.scratch, p.mod, s.mod, ctx.silu_vec, s.mod_in);
  Backend::CastInput ln = Backend::CastInput::layernorm_modulate_of(z, s.ln_mean, s.ln_rstd, s.mod.cols_slice(0, H),
                                                                    s.mod.cols_slice(H, H), ctx.cfg.layernorm_eps);
  ln.statistics_ready = s.ln_ready;
  s.ln_ready = false;
  // What the block does not keep is made in scratch, by the same ops (forward_linear_input).
  const Shape tok{z.shape[0], z.shape[1], A + M};
  SavedLinearInput zm = forward_linear_input(ctx.scratch, p.linear1, ctx.fp8, s.zm, z.shape, ctx.dtype);
  SavedLinearInput cat_in = forward_linear_input(ctx.scratch, p.linear2, ctx.fp8, s.cat, tok, ctx.dtype);
  // linear2's input is cat = [o in token layout | GELU(u's MLP part)]. BF16: linear1's GEMM
  // writes u and, GELU in its epilogue, cat's MLP part. FP8: linear1 is a plain GEMM and the
  // GELU runs inside linear2's input cast, which reads o's tokens and u as they are (a cast
  // with a head: cat is never assembled, the GELU's output never stored). Under tensor
  // parallelism u and cat are this rank's heads and MLP share: [q | k | v | mlp] of A, A, A, M and
  // [attention | mlp] of A, M; linear2 is row-parallel, its output summed over the group.
  const bool gelu_epilogue = gelu_in_epilogues(p.linear1, p.linear2, ctx.fp8);
  Tensor cat, o_tokens;
  if (gelu_epilogue) {
    cat = linear_input_buffer(ctx.scratch, cat_in, tok, ctx.dtype);
    site_forward_gelu(be, ctx.fp8, ctx.scratch, p.linear1, cat.cols_slice(A, M), s.u, ln, zm, ctx.dtype);
    o_tokens = cat.cols_slice(0, A);
  } else {
    site_forward_fused(be, ctx.fp8, ctx.scratch, p.linear1, s.u, ln, zm, ctx.dtype);
    o_tokens = ctx.scratch.alloc(ctx.dtype, Shape{z.shape[0], z.shape[1], A}, SlotKind::workspace);
  }

  // (FP8 attention: q, k, v and o exist only as the FP8 casts in s.att8)
  qkv_to_heads(ctx, p, s, s.q_rstd, s.k_rstd);
  if (s.att8.defined())
    fp8_attention_forward(ctx, p.fp8_attention, s.att8, s.lse);
  else
    be.attention(s.o, s.lse, s.q, s.k, s.v, attention_scale(ctx.cfg));
  attention_output_to_tokens(be, o_tokens, s.att8, s.o, 0);
  if (gelu_epilogue)
    site_forward(be, ctx.fp8, ctx.scratch, p.linear2, s.out, cat, cat_in);
  else
    site_forward_fused(be, ctx.fp8, ctx.scratch, p.linear2, s.out,
                       Backend::CastInput::gelu_tanh_of(s.u.cols_slice(3 * A, M)).with_head(o_tokens), cat_in,
                       ctx.dtype);
  ctx.tp.all_reduce(s.out);
  gated_residual_to(be, z_out, z, s.out, s.mod.cols_slice(2 * H, H), next, ctx.cfg.layernorm_eps);
  ctx.scratch.release_to(outer);
}

void single_block_backward(const BlockContext& ctx, SingleBlockParams& p, const SingleBlockSaved& s, Tensor dz) {
  Backend& be = ctx.be;
  const int64_t H = ctx.widths.hidden, A = ctx.widths.attention, M = ctx.widths.mlp;
  const int64_t B = ctx.shape.batch, L = ctx.shape.tokens();
  Arena& a = ctx.scratch;
  const size_t mark = a.mark();
  Tensor dmod = a.alloc(ctx.dtype, Shape{B, 3 * H}, SlotKind::workspace);
  // d_u: u's gradient [dq dk dv | MLP part] (A = the attention width, H / T under tensor
  // parallelism). linear2's input gradient is [d_attn | d(GELU output)]. BF16: GELU's backward in
  // the dgrad GEMM's epilogue writes d_u's MLP part and d_attn is a buffer of its own. FP8: the
  // dgrad writes [d_attn | d(GELU output)] into d_u's last A + M columns, and GELU's backward
  // runs inside linear1's output-gradient cast (a cast with d_u's first 3A columns as its head).
  // d_attn then sits on dv's columns: it is read (into the attention's dO) before QK-norm's
  // backward writes dv there. linear1 is column-parallel: its input gradient is summed over the
  // tensor-parallel group.
  const bool gelu_epilogue = gelu_in_epilogues(p.linear1, p.linear2, ctx.fp8);
  Tensor d_u = a.alloc(ctx.dtype, Shape{B, L, 3 * A + M}, SlotKind::workspace);
  Tensor d_attn = gelu_epilogue ? a.alloc(ctx.dtype, Shape{B, L, A}, SlotKind::workspace) : d_u.cols_slice(2 * A, A);
  SingleBlockSaved r = s;  // views; recompute.heads without FP8 attention: q, k, v rebuilt in scratch

  // linear2's backward. Its output gradient gate ⊙ dz runs inside its FP8 casts, or is stored for
  // a BF16 wgrad; that buffer and linear2's recomputed input live for this backward only.
  const size_t linear2_mark = a.mark();
  const Tensor d_out_buffer =
      wgrad_in_fp8(p.linear2, ctx.fp8) ? Tensor{} : a.alloc(ctx.dtype, Shape{B, L, H}, SlotKind::workspace);
  const Backend::CastInput d_out = gated_branch_backward(
      be, p.linear2, ctx.fp8, d_out_buffer, dmod.cols_slice(2 * H, H), dz, s.out, s.mod.cols_slice(2 * H, H));
  const SavedLinearInput cat = s.recompute.copies ? recompute_cat(ctx, p, r) : s.cat;
  if (gelu_epilogue)
    site_backward_gelu(be, ctx.fp8, p.linear2, d_attn, d_u.cols_slice(3 * A, M), s.u.cols_slice(3 * A, M), d_out_buffer,
                       cat);
  else
    site_backward_fused(be, ctx.fp8, a, p.linear2, d_u.cols_slice(2 * A, A + M), d_out, d_out_buffer, cat, false);
  a.release_to(linear2_mark);
  // The head gradients (bf16 or f32 heads, or with FP8 attention only their FP8 casts) live from
  // the attention's dO to QK-norm's backward, after linear2's recomputed input and before
  // linear1's casts.
  const bool fp8_attention = s.att8.defined();
  const auto [d_o, d_q, d_k, d_v, d8] = AttentionHeadGrads::allocate(ctx, fp8_attention);
  const size_t qkv_mark = a.mark();
  if (fp8_attention) {
    fp8_attention_dout(ctx, p.fp8_attention, d8, d_attn, 0);
    fp8_attention_backward(ctx, p.fp8_attention, s.att8, s.lse, d8);
  } else {
    be.tokens_to_heads(d_o, d_attn, 0);
    if (s.recompute.heads) {
      r.place_recomputed(a, ctx.widths, ctx.shape, ctx.heads_dtype);
      recompute_qkv(ctx, p, r);
    }
    be.attention_backward(d_q, d_k, d_v, d_o, r.q, r.k, r.v, s.o, s.lse, attention_scale(ctx.cfg));
  }
  a.release_to(qkv_mark);
  p.q_norm.prepare_grad();
  p.k_norm.prepare_grad();
  if (fp8_attention)
    be.qk_norm_rope_to_heads_backward_fp8(d_u.cols_slice(0, A), d_u.cols_slice(A, A), d_u.cols_slice(2 * A, A),
                                          p.q_norm.ds, p.k_norm.ds, d8.dq, d8.dk, d8.dv, s.u.cols_slice(0, A),
                                          s.u.cols_slice(A, A), s.q_rstd, s.k_rstd, p.q_norm.s, p.k_norm.s, ctx.pe, 0);
  else
    be.qk_norm_rope_to_heads_backward(d_u.cols_slice(0, A), d_u.cols_slice(A, A), d_u.cols_slice(2 * A, A), p.q_norm.ds,
                                      p.k_norm.ds, d_q, d_k, d_v, s.u.cols_slice(0, A), s.u.cols_slice(A, A), s.q_rstd,
                                      s.k_rstd, p.q_norm.s, p.k_norm.s, ctx.pe, 0);
  a.release_to(linear2_mark);                                                  // the head gradients
  const Tensor d_h = a.alloc(ctx.dtype, Shape{B, L, H}, SlotKind::workspace);  // linear1's input gradient
  const SavedLinearInput zm = s.recompute.norms
                                  ? recompute_linear_input_of(be, ctx.fp8, a, p.linear1,
                                                              Backend::CastInput::layernorm_modulate_of(
                                                                  s.z_in, s.ln_mean, s.ln_rstd, s.mod.cols_slice(0, H),
                                                                  s.mod.cols_slice(H, H), ctx.cfg.layernorm_eps),
                                                              ctx.dtype)
                                  : s.zm;
  if (gelu_epilogue)
    site_backward(be, ctx.fp8, a, p.linear1, d_h, d_u, zm, false);
  else  // GELU's backward inside the casts of linear1's output gradient (or, BF16 wgrad, into d_u)
    site_backward_fused(be, ctx.fp8, a, p.linear1, d_h,
                        Backend::CastInput::gelu_tanh_backward_of(d_u.cols_slice(3 * A, M), s.u.cols_slice(3 * A, M))
                            .with_head(d_u.cols_slice(0, 3 * A)),
                        d_u, zm, false);
  ctx.tp.all_reduce(d_h);
  be.layernorm_modulate_backward(dz, dmod.cols_slice(0, H), dmod.cols_slice(H, H), d_h, s.z_in, s.ln_mean, s.ln_rstd,
                                 s.mod.cols_slice(H, H), true);
  site_backward(be, ctx.fp8, a, p.mod, ctx.d_silu_vec, dmod, s.mod_in, true);
  if (p.mod.store) p.mod.store->flush_low_rank_copies();  // dmod's rows, before their release
  a.release_to(mark);
}

void single_block_plan_scratch(Arena& a, const BlockWidths& w, StepShape sh, DType t, const Fp8Config* fp8,
                               BlockRecompute r) {
  // single_block_backward's allocations in its order, then apart from it the block's forward's:
  // the arena's peak is their simultaneous use (an overflow would fail loudly in Arena::alloc).
  const int64_t B = sh.batch, L = sh.tokens(), H = w.hidden, A = w.attention, M = w.mlp;
  const int64_t rows = B * L;
  const BlockScratchPlan p(a, w, sh, t, fp8, rows);
  const size_t start = a.mark();
  a.alloc(t, Shape{B, 3 * H}, SlotKind::workspace);  // dmod
  p.tokens(3 * A + M);                               // d_u
  if (!p.fp8_sites) p.tokens(A);                     // d_attn (GELU's backward in an epilogue)
  const size_t part = a.mark();
  // linear2's backward: its stored output gradient (BF16 wgrad), its recomputed input (with FP8
  // wgrad o's tokens and the cast), its casts.
  if (!p.wgrad8) p.tokens(H);
  if (r.copies && p.wgrad8) {
    p.tokens(A);
    plan_recompute_linear_input(a, fp8, rows, A + M);
  } else if (r.copies) {
    p.tokens(A + M);
  }
  plan_site_backward(a, fp8, rows, H);
  a.release_to(part);
  // The head gradients, and in the attention's backward q, k, v where recomputed.
  if (p.attention8)
    Fp8AttentionGrads::allocate(a, w, sh, *fp8);
  else
    p.head_tensors(r.heads ? 7 : 4);
  a.release_to(part);
  // linear1's backward: its input gradient, its recomputed input, its casts; the modulation's.
  p.tokens(H);
  if (r.norms) p.recomputed_input(H);
  plan_site_backward(a, fp8, rows, 3 * A + M);
  plan_site_backward(a, p.modulation, B, 3 * H);
  a.release_to(start);
  // The forward: q, k, v in scratch where recomputed, the Linear inputs it does not keep where a
  // site stores its input, o's tokens (FP8 MLPs), and each FP8 site's input cast.
  if (r.heads && !p.attention8) p.head_tensors(3);
  plan_site_forward(a, p.modulation, B, H);
  if (r.norms && !p.wgrad8) p.tokens(H);
  if (r.copies && !p.wgrad8) p.tokens(A + M);
  plan_site_forward(a, fp8, rows, H);
  if (p.fp8_sites) p.tokens(A);
  plan_site_forward(a, fp8, rows, A + M);
}

}  // namespace flux8
