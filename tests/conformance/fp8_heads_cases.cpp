// Conformance cases: FP8 attention and the head-layout ops that take or give FP8 heads
// (backend/ops/fp8_attention.h), judged against the CPU backend in f32 (fp8_cases.cpp says how).
#include <cmath>

#include "backend/ops.h"
#include "conformance.h"

namespace flux8::conformance {
namespace {

// FP8 attention: cuDNN's FP8 graphs take head dim 128 on Hopper, and its backward computes right
// at sequence lengths that are multiples of 64 (others are refused). Gradients in E5M2 (hybrid).
constexpr int64_t AB = 1, AN = 2, AL = 64, AD = 128, ARows = AB * AN * AL;
// FP8 heads of one whole joint sequence (every row written); 2 heads of D = 16.
constexpr int64_t B = 2, NH = 2, D = 16, H = NH * D, J = 12, Rows = B * NH * J;
const List<int> kAxes{4, 6, 6};

QTensor cast_of(Run& r, const Tensor& x, Fp8Format f = Fp8Format::e4m3) {
  const QTensor q = r.qtensor("", x.rows(), x.cols(), f);
  r.be.quantize(q, QTensor{}, x, QuantizeSpec{.format = f});
  return q;
}

// Each kept FP8 tensor compared through its values (code · scale_inv), in order.
void compare_kept(Run& r, std::initializer_list<const char*> names) {
  size_t i = 0;
  for (const char* name : names) {
    const QTensor& q = r.kept.at(i++);
    r.be.dequantize(r.output(name, {q.rows, q.cols}, 0, Role::parameter), q);
  }
}

// Fixed delayed scales (powers of two: exact inverses) and compared amax slots. P's amax is not
// compared: cuDNN records that of exp(S − running max), the CPU that of the normalised P.
Fp8AttentionScales attention_scales(Run& r) {
  Fp8AttentionScales sc;
  sc.o = r.scalars("", 1, 64.0f), sc.ds = r.scalars("", 1, 256.0f), sc.ds_inv = r.scalars("", 1, 1.0f / 256);
  sc.dq = r.scalars("", 1, 16.0f), sc.dk = r.scalars("", 1, 16.0f), sc.dv = r.scalars("", 1, 16.0f);
  sc.amax_s = r.scalars("", 1, 0.0f), sc.amax_o = r.scalars("amax_o", 1, 0.0f);
  sc.amax_ds = r.scalars("amax_ds", 1, 0.0f), sc.amax_dq = r.scalars("amax_dq", 1, 0.0f);
  sc.amax_dk = r.scalars("amax_dk", 1, 0.0f), sc.amax_dv = r.scalars("amax_dv", 1, 0.0f);
  return sc;
}

struct Fp8Qkv {
  QTensor q, k, v;
  explicit Fp8Qkv(Run& r)
      : q(cast_of(r, r.input({ARows, AD}, 121))),
        k(cast_of(r, r.input({ARows, AD}, 122))),
        v(cast_of(r, r.input({ARows, AD}, 123))) {}
};

// codes_name "": the codes are compared through their values (compare_kept), not bit for bit.
Fp8Heads fp8_heads(Run& r, const std::string& codes_name, const std::string& amax_name) {
  const QTensor codes = r.qtensor(codes_name, Rows, D);
  return {.codes = codes, .q = {.delayed_scale = r.scalars("", 1, 32.0f), .amax = r.scalars(amax_name, 1, 0.0f)}};
}

// The joint RoPE table and the token-major q, k, v (column windows of a padded [Q|K|V] row).
struct TokenInputs {
  Tensor q, k, v, q_scale, k_scale, pe;
  explicit TokenInputs(Run& r) {
    std::vector<double> ids;
    for (int64_t i = 0; i < B * J * 3; ++i) ids.push_back(static_cast<double>((i * 7) % 23));
    pe = r.scratch({B, J, D / 2, 2}, Role::parameter);
    r.be.rope_table(pe, r.input_values({B, J, 3}, ids), kAxes, 10000.0);
    const Tensor qkv = r.input({B, J, 3 * H}, 124, 2.0, 2);
    q = qkv.cols_slice(0, H), k = qkv.cols_slice(H, H), v = qkv.cols_slice(2 * H, H);
    q_scale = r.input({D}, 125, 0.5, 0, Role::parameter), k_scale = r.input({D}, 126, 0.5, 0, Role::parameter);
  }
};

const Cases kFp8HeadsCases({
    {.op = "attention_fp8",
     .name = "head_dim_128",
     .f32_terms = 8 * AL,
     .fp8_steps = 2,
     .why = "cuDNN casts P before normalising it, the CPU after: P8, then o, an E4M3 step apart each",
     .judge = Judge::cpu_f32,
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       const Fp8Qkv in(r);
       const QTensor o = r.qtensor("", ARows, AD);
       r.kept.push_back(o);
       return op::AttentionFp8{.o = o,
                               .lse = r.output("lse", {ARows}, 0, Role::parameter),
                               .q = in.q,
                               .k = in.k,
                               .v = in.v,
                               .heads = {AB, AN, AL, AD},
                               .scale = 1.0 / std::sqrt(double(AD)),
                               .sc = attention_scales(r)};
     },
     .finish = [](Run& r) { compare_kept(r, {"o"}); }},
    {.op = "attention_fp8_backward",
     .name = "head_dim_128",
     .f32_terms = 8 * AL,
     .fp8_steps = 4,
     .why = "P8 (cast before or after normalising) and the E5M2 outputs (steps of 2⁻²) a step apart each",
     .judge = Judge::cpu_f32,
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       const Fp8Qkv in(r);
       const QTensor o = r.qtensor("", ARows, AD), dout = cast_of(r, r.input({ARows, AD}, 127), Fp8Format::e5m2);
       const Tensor lse = r.scratch({ARows}, Role::parameter);
       const Fp8AttentionScales sc = attention_scales(r);
       const double scale = 1.0 / std::sqrt(double(AD));
       r.be.attention_fp8(o, lse, in.q, in.k, in.v, {AB, AN, AL, AD}, scale, sc);
       const QTensor dq = r.qtensor("", ARows, AD, Fp8Format::e5m2), dk = r.qtensor("", ARows, AD, Fp8Format::e5m2),
                     dv = r.qtensor("", ARows, AD, Fp8Format::e5m2);
       r.kept = {dq, dk, dv};
       return op::AttentionFp8Backward{.dq = dq,
                                       .dk = dk,
                                       .dv = dv,
                                       .dout = dout,
                                       .q = in.q,
                                       .k = in.k,
                                       .v = in.v,
                                       .o = o,
                                       .lse = lse,
                                       .heads = {AB, AN, AL, AD},
                                       .scale = scale,
                                       .sc = sc};
     },
     .finish =
         [](Run& r) {
           compare_kept(r, {"dq", "dk", "dv"});
         }},
    {.op = "qk_norm_rope_to_heads_fp8",
     .name = "joint_sequence",
     .f32_terms = 64,
     .bf16_steps = 1,
     .fp8_steps = 1,
     .why = "the plain op's heads (rsqrt, rotation) may round an ulp apart, moving a code by one step",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) -> AnyOp {
       const TokenInputs in(r);
       const Fp8Heads q = fp8_heads(r, "", "q_amax"), k = fp8_heads(r, "", "k_amax"), v = fp8_heads(r, "", "v_amax");
       r.kept = {q.codes, k.codes, v.codes};
       return op::QkNormRopeToHeadsFp8{.q_heads = q,
                                       .k_heads = k,
                                       .v_heads = v,
                                       .q_rstd = r.output("q_rstd", {B * J * NH}, 0, Role::parameter),
                                       .k_rstd = r.output("k_rstd", {B * J * NH}, 0, Role::parameter),
                                       .q = in.q,
                                       .k = in.k,
                                       .v = in.v,
                                       .q_scale = in.q_scale,
                                       .k_scale = in.k_scale,
                                       .pe = in.pe,
                                       .token_offset = 0,
                                       .eps = 1e-6};
     },
     .finish =
         [](Run& r) {
           compare_kept(r, {"q_heads", "k_heads", "v_heads"});
         }},
    {.op = "qk_norm_rope_to_heads_backward_fp8",
     .name = "joint_sequence",
     .f32_terms = 256,
     .bf16_steps = 2,
     .why = "as qk_norm_rope_to_heads_backward, from the dequantized heads (exact)",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) -> AnyOp {
       const TokenInputs in(r);
       const Shape heads{B, NH, J, D};
       const Tensor q_rstd = r.scratch({B * J * NH}, Role::parameter),
                    k_rstd = r.scratch({B * J * NH}, Role::parameter);
       r.be.qk_norm_rope_to_heads(r.scratch(heads, Role::heads), r.scratch(heads, Role::heads),
                                  r.scratch(heads, Role::heads), q_rstd, k_rstd, in.q, in.k, in.v, in.q_scale,
                                  in.k_scale, in.pe, 0, 1e-6);
       const Tensor dqkv = r.output("dqkv", {B, J, 3 * H}, 1);
       return op::QkNormRopeToHeadsBackwardFp8{.dq = dqkv.cols_slice(0, H),
                                               .dk = dqkv.cols_slice(H, H),
                                               .dv = dqkv.cols_slice(2 * H, H),
                                               .dq_scale = r.update("dq_scale", {D}, 128, 1.0, 0, Role::gradient),
                                               .dk_scale = r.update("dk_scale", {D}, 129, 1.0, 0, Role::gradient),
                                               .dq_heads = cast_of(r, r.input({Rows, D}, 130)),
                                               .dk_heads = cast_of(r, r.input({Rows, D}, 131)),
                                               .dv_heads = cast_of(r, r.input({Rows, D}, 132)),
                                               .q = in.q,
                                               .k = in.k,
                                               .q_rstd = q_rstd,
                                               .k_rstd = k_rstd,
                                               .q_scale = in.q_scale,
                                               .k_scale = in.k_scale,
                                               .pe = in.pe,
                                               .token_offset = 0};
     }},
    {.op = "tokens_to_heads_fp8",
     .name = "joint_sequence",
     .why = "a copy, then the same cast everywhere: bit for bit",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) -> AnyOp {
       return op::TokensToHeadsFp8{
           .heads = fp8_heads(r, "heads", "amax"), .tokens = r.input({B, J, H}, 133, 1.0, 3), .token_offset = 0};
     }},
    {.op = "heads_to_tokens_fp8",
     .name = "stream_at_offset",
     .bf16_steps = 1,
     .why = "code · scale_inv is exact in f32: bit for bit; where the run's heads are bf16 (the CUDA backend's "
            "attention_heads_dtype, also beside f32 tokens) the value read is that one rounded once",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) -> AnyOp {
       r.scratch({Rows, D}, Role::heads);  // a tensor of the heads' type: the run counts its bf16 rounding
       return op::HeadsToTokensFp8{
           .tokens = r.output("tokens", {B, 7, H}, 3), .heads = cast_of(r, r.input({Rows, D}, 134)), .token_offset = 5};
     }},
});

}  // namespace
}  // namespace flux8::conformance
