// Conformance cases: FP8 casts, the delayed-scaling update, the FP8 GEMM and the FP8-heads ops
// (backend/ops/fp8.h, fp8_attention.h). The CPU runs them in f32 only: they are judged against
// the CPU backend in f32, codes and scales bit for bit where every backend must give the same
// bits, and through their dequantized values where rounding upstream of the cast may differ by
// an ulp (then a code may be one step off).
#include <cmath>

#include "backend/ops.h"
#include "conformance.h"
#include "core/rng.h"
#include "fp8/recipe.h"

namespace flux8::conformance {
namespace {

constexpr int64_t R = 37, C = 45;

// A per-tensor cast of x with its own amax (current scaling): an FP8 operand for the ops below.
QTensor cast_of(Run& r, const Tensor& x, Fp8Format f = Fp8Format::e4m3) {
  const QTensor q = r.qtensor("", x.rows(), x.cols(), f);
  r.be.quantize(q, QTensor{}, x, QuantizeSpec{.format = f});
  return q;
}

// Compares an FP8 tensor through its values (code · scale_inv).
void compare_values(Run& r, const std::string& name, const QTensor& q) {
  r.be.dequantize(r.output(name, {q.rows, q.cols}, 0, Role::parameter), q);
}

AnyOp quantize_case(Run& r, int64_t rows, int64_t cols, Fp8Scaling scaling, bool columnwise) {
  return op::Quantize{
      .rowwise = r.qtensor("rowwise", rows, cols, Fp8Format::e4m3, scaling),
      .columnwise = columnwise ? r.qtensor("columnwise", cols, rows, Fp8Format::e4m3, scaling) : QTensor{},
      .x = r.input({rows, cols}, 101, 3.0, 3),
      .q = {.format = Fp8Format::e4m3, .scaling = scaling, .amax = r.scalars("amax", 1, 0.0f)}};
}

const Cases kFp8Cases({
    {.op = "quantize",
     .name = "per_tensor_current_both_copies",
     .why = "the same cast on every backend: bit for bit",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) { return quantize_case(r, R, C, Fp8Scaling::per_tensor, true); }},
    {.op = "quantize",
     .name = "block_1x128_partial_blocks",
     .why = "the same cast on every backend: bit for bit",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) { return quantize_case(r, R, 200, Fp8Scaling::block_1x128, true); }},
    {.op = "quantize",
     .name = "block_128x128_partial_tile",
     .why = "the same cast on every backend: bit for bit",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) { return quantize_case(r, 130, 257, Fp8Scaling::block_128x128, true); }},
    {.op = "quantize",
     .name = "mx_1x32_partial_blocks",
     .why = "the same cast on every backend: bit for bit",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) { return quantize_case(r, R, 70, Fp8Scaling::mx_1x32, false); }},
    {.op = "quantize",
     .name = "delayed_e5m2_column_sums",
     .f32_terms = 2 * R,
     .why = "codes bit for bit (a code off by one is ≥ 1/255 of the largest); column sums: f32 sums of 37 rows",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) -> AnyOp {
       return op::Quantize{.rowwise = r.qtensor("rowwise", R, C, Fp8Format::e5m2),
                           .x = r.input({R, C}, 102, 1.0, 2),
                           .q = {.format = Fp8Format::e5m2,
                                 .delayed_scale = r.scalars("", 1, 3000.0f),
                                 .amax = r.scalars("amax", 1, 0.5f),
                                 .column_sums = r.update("column_sums", {C}, 103, 1.0, 0, Role::gradient)}};
     }},
    {.op = "quantize",
     .name = "per_tensor_scale_from_whole_amax",
     .why = "the scale from the given amax on every backend: bit for bit",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) -> AnyOp {
       // x's own amax (~3·3.5) lies below the whole tensor's 40: the codes use 448/40.
       return op::Quantize{.rowwise = r.qtensor("rowwise", R, C),
                           .columnwise = r.qtensor("columnwise", C, R),
                           .x = r.input({R, C}, 115, 3.0, 2),
                           .q = {.whole_amax = r.scalars("", 1, 40.0f), .amax = r.scalars("amax", 1, 0.0f)}};
     }},
    {.op = "cast_amax",
     .name = "window_overwritten",
     .why = "a max: exact on every backend",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) -> AnyOp {
       return op::CastAmax{.amax = Tensor(r.scalars("amax", 1, 1e30f), DType::f32, Shape{1}),
                           .in = CastInput{.x = r.input({R, C}, 116, 3.0, 3)}};
     }},
    {.op = "cast_amax",
     .name = "gelu",
     .f32_terms = 16,
     .bf16_steps = 1,
     .why = "the GELU (tanhf) may round an ulp apart from the CPU's, and then to another bf16 value",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) -> AnyOp {
       return op::CastAmax{.amax = Tensor(r.scalars("amax", 1, 0.0f), DType::f32, Shape{1}),
                           .in = CastInput::gelu_tanh_of(r.input({R, 70}, 117, 3.0, 1))};
     }},
    {.op = "cast_amax",
     .name = "gelu_with_larger_head",
     .why = "the head's values, read as they are, hold the max (stddev 8 against the GELU's 2): exact",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) -> AnyOp {
       return op::CastAmax{
           .amax = Tensor(r.scalars("amax", 1, 0.0f), DType::f32, Shape{1}),
           .in = CastInput::gelu_tanh_of(r.input({R, 70}, 118, 2.0, 1)).with_head(r.input({R, 19}, 119, 8.0, 2))};
     }},
    {.op = "transpose_codes",
     .name = "odd_shape",
     .why = "data movement: exact",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) -> AnyOp {
       return op::TransposeCodes{.dst = r.qtensor("dst", C, R), .src = cast_of(r, r.input({R, C}, 104, 2.0, 1))};
     }},
    {.op = "delayed_scaling_update",
     .name = "five_slots_both_formats",
     .why = "delayed_update_slot() per slot on every backend: bit for bit",
     .judge = Judge::cpu_f32,
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       std::vector<double> history, scales;
       for (int i = 0; i < 4 * 5; ++i)
         history.push_back(std::abs(rng_normal(105, 1, static_cast<uint64_t>(i))) * (i % 5 + 1));
       for (int i = 0; i < 5; ++i) scales.push_back(1.0 + i);
       return op::DelayedScalingUpdate{.amax_history = r.update_values("amax_history", {4, 5}, history),
                                       .scale = r.update_values("scale", {5}, scales),
                                       .scale_inv = r.update_values("scale_inv", {5}, scales),
                                       .fp8_max = r.input_values({5}, {448, 57344, 448, 448, 57344}),
                                       .algo = AmaxAlgo::max,
                                       .margin = 1};
     }},
    {.op = "dequantize",
     .name = "window",
     .bf16_steps = 1,
     .why = "code · scale_inv is exact in f32: bit for bit; a bf16 y is that value rounded once",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) -> AnyOp {
       return op::Dequantize{.y = r.output("y", {R, C}, 2), .x = cast_of(r, r.input({R, C}, 106, 2.0))};
     }},
    {.op = "quantize_fused",
     .name = "gelu_input",
     .fp8_steps = 1,
     .why = "the GELU (tanhf) may round an ulp apart from the CPU's, moving a code by one step",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) -> AnyOp {
       const QTensor row = r.qtensor("", R, C);
       r.kept.push_back(row);
       return op::QuantizeFused{.rowwise = row,
                                .in = CastInput::gelu_tanh_of(r.input({R, C}, 107, 2.0, 3)),
                                .q = {.amax = r.scalars("amax", 1, 0.0f)}};
     },
     .finish = [](Run& r) { compare_values(r, "rowwise", r.kept.at(0)); }},
    {.op = "quantize_fused",
     .name = "gelu_input_columnwise_only",
     .fp8_steps = 1,
     .why = "a recomputed Linear input cast again for its wgrad alone (recompute_elementwise): the GELU (tanhf) "
            "may round an ulp apart from the CPU's, moving a code by one step",
     .judge = Judge::cpu_f32,
     .build = [](Run& r) -> AnyOp {
       const QTensor col = r.qtensor("", C, R);
       r.kept.push_back(col);
       return op::QuantizeFused{.columnwise = col,
                                .in = CastInput::gelu_tanh_of(r.input({R, C}, 114, 2.0, 3)),
                                .q = {.amax = r.scalars("amax", 1, 0.0f)}};
     },
     .finish = [](Run& r) { compare_values(r, "columnwise", r.kept.at(0)); }},
    {.op = "gemm_fp8_tn",
     .name = "bias_window",
     .f32_terms = 2 * 64,
     .why = "exact products, f32 sums of K = 64 in another order",
     .judge = Judge::cpu_f32,
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       return op::GemmFp8Tn{.c = r.output("c", {40, 24}, 3, Role::parameter),
                            .a = cast_of(r, r.input({40, 64}, 108)),
                            .b = cast_of(r, r.input({24, 64}, 109, 0.2)),
                            .bias = r.input({24}, 110, 1.0, 0, Role::parameter),
                            .accumulate = false,
                            .sum = Fp8Accumulation::fp32};
     }},
    {.op = "gemm_fp8_tn",
     .name = "accumulating",
     .f32_terms = 8192,
     .why = "Hopper's FP8 MMA keeps ~14 bits within each 32-wide k-slice before the fp32 sum (fp8/qtensor.h): "
            "2 slices of K = 64 at 2^-14 each, 2^11 f32 roundings, x4 margin",
     .judge = Judge::cpu_f32,
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       return op::GemmFp8Tn{.c = r.update("c", {52, 24}, 111, 1.0, 0, Role::parameter),
                            .a = cast_of(r, r.input({52, 64}, 112)),
                            .b = cast_of(r, r.input({24, 64}, 113, 0.2)),
                            .accumulate = true,
                            .sum = Fp8Accumulation::fp32};
     }},
});

}  // namespace
}  // namespace flux8::conformance
