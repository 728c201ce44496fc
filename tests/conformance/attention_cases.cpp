// Conformance cases: the joint sequence's layouts, rotary embedding, the fused QK-norm + RoPE +
// head layout, and attention (backend/ops/attention.h).
#include <cmath>

#include "backend/ops.h"
#include "conformance.h"
#include "gradient_check.h"

namespace flux8::conformance {
namespace {

// One stream of Ls = 7 tokens at offset 5 of a joint sequence of 12; 2 heads of D = 10.
constexpr int64_t B = 2, NH = 2, D = 10, H = NH * D, Ls = 7, Off = 5, J = Ls + Off;
const Shape kHeads{B, NH, J, D};
const List<int> kAxes{2, 4, 4};

// The joint RoPE table for integer positions (as the model's ids are).
Tensor rope_table_of(Run& r, int64_t joint) {
  std::vector<double> ids;
  for (int64_t i = 0; i < B * joint * 3; ++i) ids.push_back(static_cast<double>((i * 7) % 23));
  const Tensor pe = r.scratch({B, joint, D / 2, 2}, Role::parameter);
  r.be.rope_table(pe, r.input_values({B, joint, 3}, ids), kAxes, 10000.0);
  return pe;
}

// q, k, v: column windows of one padded [Q|K|V] row, as the qkv Linear writes them.
struct QkvInputs {
  Tensor q, k, v, q_scale, k_scale, pe;
  explicit QkvInputs(Run& r) {
    const Tensor qkv = r.input({B, Ls, 3 * H}, 61, 2.0, 1);
    q = qkv.cols_slice(0, H), k = qkv.cols_slice(H, H), v = qkv.cols_slice(2 * H, H);
    q_scale = r.input({D}, 62, 0.5, 0, Role::parameter), k_scale = r.input({D}, 63, 0.5, 0, Role::parameter);
    pe = rope_table_of(r, J);
  }
};

AnyOp attention_of(Run& r, int64_t b, int64_t n, int64_t l, int64_t d) {
  const Shape s{b, n, l, d};
  return op::Attention{.o = r.output("o", s, 0, Role::heads),
                       .lse = r.output("lse", {b, n, l}, 0, Role::parameter),
                       .q = r.input(s, 71, 1.0, 0, Role::heads),
                       .k = r.input(s, 72, 1.0, 0, Role::heads),
                       .v = r.input(s, 73, 1.0, 0, Role::heads),
                       .scale = 1.0 / std::sqrt(static_cast<double>(d))};
}

AnyOp attention_backward_of(Run& r, int64_t b, int64_t n, int64_t l, int64_t d) {
  const Shape s{b, n, l, d};
  const Tensor q = r.input(s, 74, 1.0, 0, Role::heads), k = r.input(s, 75, 1.0, 0, Role::heads),
               v = r.input(s, 76, 1.0, 0, Role::heads);
  const Tensor o = r.scratch(s, Role::heads), lse = r.scratch({b, n, l}, Role::parameter);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  r.be.attention(o, lse, q, k, v, scale);
  return op::AttentionBackward{.dq = r.output("dq", s, 0, Role::heads),
                               .dk = r.output("dk", s, 0, Role::heads),
                               .dv = r.output("dv", s, 0, Role::heads),
                               .dout = r.input(s, 77, 1.0, 0, Role::heads),
                               .q = q,
                               .k = k,
                               .v = v,
                               .o = o,
                               .lse = lse,
                               .scale = scale};
}

constexpr double kAttention = 8 * 133;  // f32 softmax sums over up to L = 133 keys and expf
const char* const kAttentionWhy = "f32 sums over L keys and expf; bf16: P and o rounded (cuDNN's bf16 heads)";

const Cases kAttentionCases({
    {.op = "concat_tokens",
     .name = "windows",
     .why = "data movement: exact",
     .build = [](Run& r) -> AnyOp {
       return op::ConcatTokens{
           .out = r.output("out", {B, J, H}, 1), .a = r.input({B, Off, H}, 51, 1.0, 2), .b = r.input({B, Ls, H}, 52)};
     }},
    {.op = "split_tokens",
     .name = "both_parts",
     .why = "data movement: exact",
     .build = [](Run& r) -> AnyOp {
       return op::SplitTokens{
           .a = r.output("a", {B, Off, H}, 3), .b = r.output("b", {B, Ls, H}), .in = r.input({B, J, H}, 53, 1.0, 1)};
     }},
    {.op = "split_tokens",
     .name = "second_part_only",
     .why = "data movement: exact",
     .build = [](Run& r) -> AnyOp {
       return op::SplitTokens{.b = r.output("b", {B, Ls, H}, 2), .in = r.input({B, J, H}, 54)};
     }},
    {.op = "tokens_to_heads",
     .name = "stream_at_offset",
     .why = "data movement: exact; the other stream's rows keep their values",
     .build = [](Run& r) -> AnyOp {
       return op::TokensToHeads{.heads = r.update("heads", kHeads, 55, 1.0, 0, Role::heads),
                                .tokens = r.input({B, Ls, H}, 56, 1.0, 3),
                                .token_offset = Off};
     }},
    {.op = "heads_to_tokens",
     .name = "stream_at_offset",
     .why = "data movement: exact",
     .build = [](Run& r) -> AnyOp {
       return op::HeadsToTokens{.tokens = r.output("tokens", {B, Ls, H}, 3),
                                .heads = r.input(kHeads, 57, 1.0, 0, Role::heads),
                                .token_offset = Off};
     }},
    {.op = "rope_table",
     .name = "three_axes",
     .f32_terms = 2,
     .why = "angles and cos/sin in double, rounded once to f32",
     .build = [](Run& r) -> AnyOp {
       std::vector<double> ids;
       for (int64_t i = 0; i < B * J * 3; ++i) ids.push_back(static_cast<double>((i * 5) % 31));
       return op::RopeTable{.pe = r.output("pe", {B, J, D / 2, 2}, 0, Role::parameter),
                            .ids = r.input_values({B, J, 3}, ids),
                            .axes_dim = kAxes,
                            .theta = 10000.0};
     }},
    {.op = "rope",
     .name = "forward",
     .f32_terms = 8,
     .why = "a 2x2 rotation in f32 (the CUDA backend rotates f32 heads only: no bf16 variant)",
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       const Tensor pe = rope_table_of(r, J);
       return op::Rope{.x = r.update("x", kHeads, 58, 1.0, 0, Role::heads), .pe = pe, .inverse = false};
     }},
    {.op = "rope",
     .name = "inverse",
     .f32_terms = 8,
     .why = "a 2x2 rotation in f32 (the CUDA backend rotates f32 heads only: no bf16 variant)",
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       const Tensor pe = rope_table_of(r, J);
       return op::Rope{.x = r.update("x", kHeads, 59, 1.0, 0, Role::heads), .pe = pe, .inverse = true};
     }},
    {.op = "qk_norm_rope_to_heads",
     .name = "stream_at_offset",
     .f32_terms = 64,
     .bf16_steps = 1,
     .why = "rmsnorm (f32 sums of D = 10 squares) and a rotation; bf16: heads rounded once",
     .build = [](Run& r) -> AnyOp {
       const QkvInputs in(r);
       return op::QkNormRopeToHeads{.q_heads = r.update("q_heads", kHeads, 64, 1.0, 0, Role::heads),
                                    .k_heads = r.update("k_heads", kHeads, 65, 1.0, 0, Role::heads),
                                    .v_heads = r.update("v_heads", kHeads, 66, 1.0, 0, Role::heads),
                                    .q_rstd = r.output("q_rstd", {B * Ls * NH}, 0, Role::parameter),
                                    .k_rstd = r.output("k_rstd", {B * Ls * NH}, 0, Role::parameter),
                                    .q = in.q,
                                    .k = in.k,
                                    .v = in.v,
                                    .q_scale = in.q_scale,
                                    .k_scale = in.k_scale,
                                    .pe = in.pe,
                                    .token_offset = Off,
                                    .eps = 1e-6};
     }},
    {.op = "qk_norm_rope_to_heads_backward",
     .name = "stream_at_offset",
     .f32_terms = 256,
     .bf16_steps = 2,
     .why = "rmsnorm's backward (f32 sums of D = 10 products, and of B·Ls·n = 28 rows for dscale) after the "
            "inverse rotation; bf16: outputs rounded once",
     .build = [](Run& r) -> AnyOp {
       const QkvInputs in(r);
       const Tensor q_rstd = r.scratch({B * Ls * NH}, Role::parameter),
                    k_rstd = r.scratch({B * Ls * NH}, Role::parameter);
       r.be.qk_norm_rope_to_heads(r.scratch(kHeads, Role::heads), r.scratch(kHeads, Role::heads),
                                  r.scratch(kHeads, Role::heads), q_rstd, k_rstd, in.q, in.k, in.v, in.q_scale,
                                  in.k_scale, in.pe, Off, 1e-6);
       const Tensor dqkv = r.output("dqkv", {B, Ls, 3 * H}, 1);
       return op::QkNormRopeToHeadsBackward{.dq = dqkv.cols_slice(0, H),
                                            .dk = dqkv.cols_slice(H, H),
                                            .dv = dqkv.cols_slice(2 * H, H),
                                            .dq_scale = r.update("dq_scale", {D}, 67, 1.0, 0, Role::gradient),
                                            .dk_scale = r.update("dk_scale", {D}, 68, 1.0, 0, Role::gradient),
                                            .dq_heads = r.input(kHeads, 69, 1.0, 0, Role::heads),
                                            .dk_heads = r.input(kHeads, 70, 1.0, 0, Role::heads),
                                            .dv_heads = r.input(kHeads, 71, 1.0, 0, Role::heads),
                                            .q = in.q,
                                            .k = in.k,
                                            .q_rstd = q_rstd,
                                            .k_rstd = k_rstd,
                                            .q_scale = in.q_scale,
                                            .k_scale = in.k_scale,
                                            .pe = in.pe,
                                            .token_offset = Off};
     }},
    {.op = "attention",
     .name = "odd_length",
     .f32_terms = kAttention,
     .bf16_steps = 3,
     .why = kAttentionWhy,
     .build = [](Run& r) { return attention_of(r, 2, 3, 37, D); }},
    {.op = "attention",
     .name = "two_query_blocks",
     .f32_terms = kAttention,
     .bf16_steps = 3,
     .why = kAttentionWhy,
     .build = [](Run& r) { return attention_of(r, 1, 2, 133, D); }},
    {.op = "attention",
     .name = "head_dim_64",
     .f32_terms = kAttention,
     .bf16_steps = 3,
     .why = kAttentionWhy,
     .build = [](Run& r) { return attention_of(r, 1, 2, 77, 64); }},
    {.op = "attention_backward",
     .name = "odd_length",
     .f32_terms = 4 * kAttention,
     .bf16_steps = 6,
     .why = "f32 sums over L keys of the recomputed P; bf16: P, dS and the outputs rounded",
     .build = [](Run& r) { return attention_backward_of(r, 2, 3, 37, D); }},
    {.op = "attention_backward",
     .name = "two_query_blocks",
     .f32_terms = 4 * kAttention,
     .bf16_steps = 6,
     .why = "f32 sums over L keys of the recomputed P; bf16: P, dS and the outputs rounded",
     .build = [](Run& r) { return attention_backward_of(r, 1, 2, 133, D); }},
    {.op = "attention_backward",
     .name = "head_dim_64",
     .f32_terms = 4 * kAttention,
     .bf16_steps = 6,
     .why = "f32 sums over L keys of the recomputed P; bf16: P, dS and the outputs rounded",
     .build = [](Run& r) { return attention_backward_of(r, 1, 2, 77, 64); }},
});

}  // namespace
}  // namespace flux8::conformance
