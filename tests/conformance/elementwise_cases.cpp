// Conformance cases: fills, copies, activations, the gated residual and the timestep embedding
// (backend/ops/elementwise.h).
#include "backend/ops.h"
#include "conformance.h"
#include "gradient_check.h"

namespace flux8::conformance {
namespace {

constexpr int64_t B = 3, L = 7, H = 20, R = 13, C = 37;
constexpr double kElementwise = 16;  // one formula in f32; the device's expf/tanhf within a few ulps

// Gated residual inputs: gate is the last third of a modulation output [B, 3H] (a column window).
struct GatedInputs {
  Tensor x, y, gate;
  explicit GatedInputs(Run& r)
      : x(r.input({B, L, H}, 31, 1.0, 2)),
        y(r.input({B, L, H}, 32, 1.0, 3)),
        gate(r.input({B, 3 * H}, 33, 0.5).cols_slice(2 * H, H)) {}
};

const Cases kElementwiseCases(
    {
        {.op = "fill",
         .name = "window",
         .why = "-2.5 is exact in every type",
         .build = [](Run& r) -> AnyOp {
           return op::Fill{.y = r.output("y", {R, C}, 3), .value = -2.5};
         }},
        {.op = "fill_random",
         .name = "normal",
         .f32_terms = 4,
         .why = "a double draw rounded to f32; the device's logf/cosf within an ulp",
         .with_bf16 = false,
         .build = [](Run& r) -> AnyOp {
           return op::FillRandom{.y = r.output("y", {R, C}, 0, Role::parameter),
                                 .dist = Random::normal,
                                 .seed = 5,
                                 .stream = 9,
                                 .scale = 0.02};
         }},
        {.op = "fill_random",
         .name = "uniform",
         .f32_terms = 1,
         .why = "a double draw rounded to f32",
         .with_bf16 = false,
         .build = [](Run& r) -> AnyOp {
           return op::FillRandom{.y = r.output("y", {1001}, 0, Role::parameter),
                                 .dist = Random::uniform,
                                 .seed = 6,
                                 .stream = 2,
                                 .scale = 3.0};
         }},
        {.op = "copy",
         .name = "windows",
         .why = "data movement: exact",
         .build = [](Run& r) -> AnyOp {
           return op::Copy{.y = r.output("y", {R, C}, 2), .x = r.input({R, C}, 1, 1.0, 4)};
         }},
        {.op = "copy",
         .name = "parameter_to_activation",
         .why = "the values are bf16 values: the conversion is exact",
         .build = [](Run& r) -> AnyOp {
           return op::Copy{.y = r.output("y", {R, C}, 1), .x = r.input({R, C}, 2, 1.0, 0, Role::parameter)};
         }},
        {.op = "copy_batch",
         .name = "three_pairs",
         .why = "data movement: exact",
         .build = [](Run& r) -> AnyOp {
           return op::CopyBatch{.pairs = List<CopyPair>{{r.output("y0", {R, C}, 1), r.input({R, C}, 3, 1.0, 2)},
                                                        {r.output("y1", {1, 5}), r.input({1, 5}, 4)},
                                                        {r.output("y2", {2, 300}), r.input({2, 300}, 5)}}};
         }},
        {.op = "add",
         .name = "windows",
         .f32_terms = 2,
         .bf16_steps = 1,
         .why = "one f32 rounding; bf16 storage rounds once",
         .build = [](Run& r) -> AnyOp {
           return op::Add{.y = r.output("y", {R, C}, 1), .a = r.input({R, C}, 6, 1.0, 2), .b = r.input({R, C}, 7)};
         }},
        {.op = "accumulate",
         .name = "window",
         .f32_terms = 2,
         .bf16_steps = 1,
         .why = "one f32 rounding; bf16 storage rounds once",
         .build = [](Run& r) -> AnyOp {
           return op::Accumulate{.y = r.update("y", {R, C}, 8, 1.0, 3), .x = r.input({R, C}, 9, 1.0, 1)};
         }},
        {.op = "silu",
         .name = "windows",
         .f32_terms = kElementwise,
         .bf16_steps = 1,
         .why = "x·σ(x) in f32 (expf); bf16: y rounded once",
         .build = [](Run& r) -> AnyOp {
           return op::Silu{.y = r.output("y", {B, L, C}, 2), .x = r.input({B, L, C}, 10, 2.0, 1)};
         }},
        {.op = "silu_backward",
         .name = "overwriting",
         .f32_terms = kElementwise,
         .bf16_steps = 1,
         .why = "σ'(x)·dy in f32 (expf); bf16: dx rounded once",
         .build = [](Run& r) -> AnyOp {
           return op::SiluBackward{.dx = r.output("dx", {B, L, C}, 1),
                                   .dy = r.input({B, L, C}, 11, 1.0, 2),
                                   .x = r.input({B, L, C}, 12, 2.0, 3),
                                   .accumulate_dx = false};
         }},
        {.op = "silu_backward",
         .name = "accumulating",
         .f32_terms = kElementwise,
         .bf16_steps = 1,
         .why = "σ'(x)·dy + dx in f32 (expf); bf16: dx rounded once",
         .build = [](Run& r) -> AnyOp {
           return op::SiluBackward{.dx = r.update("dx", {B, L, C}, 13, 1.0, 1),
                                   .dy = r.input({B, L, C}, 14),
                                   .x = r.input({B, L, C}, 15, 2.0),
                                   .accumulate_dx = true};
         }},
        {.op = "gelu_tanh",
         .name = "windows",
         .f32_terms = kElementwise,
         .bf16_steps = 1,
         .why = "the tanh formula in f32 (tanhf); bf16: y rounded once",
         .build = [](Run& r) -> AnyOp {
           return op::GeluTanh{.y = r.output("y", {B, L, C}, 3), .x = r.input({B, L, C}, 16, 2.0, 2)};
         }},
        {.op = "gelu_tanh_backward",
         .name = "windows",
         .f32_terms = kElementwise,
         .bf16_steps = 1,
         .why = "the derivative's formula in f32 (tanhf); bf16: dx rounded once",
         .build = [](Run& r) -> AnyOp {
           return op::GeluTanhBackward{.dx = r.output("dx", {B, L, C}, 1),
                                       .dy = r.input({B, L, C}, 17, 1.0, 2),
                                       .x = r.input({B, L, C}, 18, 2.0, 3)};
         }},
        {.op = "gated_residual",
         .name = "out_of_place",
         .f32_terms = 4,
         .bf16_steps = 1,
         .why = "x + gate·y: two f32 roundings; bf16: out rounded once",
         .build = [](Run& r) -> AnyOp {
           const GatedInputs in(r);
           return op::GatedResidual{.out = r.output("out", {B, L, H}, 1), .x = in.x, .y = in.y, .gate = in.gate};
         }},
        {.op = "gated_residual",
         .name = "in_place",
         .f32_terms = 4,
         .bf16_steps = 1,
         .why = "x + gate·y: two f32 roundings; bf16: out rounded once",
         .build = [](Run& r) -> AnyOp {
           const GatedInputs in(r);
           const Tensor x = r.update("x", {B, L, H}, 34, 1.0, 2);
           return op::GatedResidual{.out = x, .x = x, .y = in.y, .gate = in.gate};
         }},
        {.op = "gated_residual_stats",
         .name = "statistics_of_a_window",
         .f32_terms = 8 * H,
         .bf16_steps = 2,
         .why = "out as gated_residual; mean, rstd: sums of H = 20 terms; bf16: of the rounded out",
         .build = [](Run& r) -> AnyOp {
           const GatedInputs in(r);
           // The statistics are one stream's rows of a joint [B, L + 4] pair of vectors, whose other
           // rows must keep their values.
           const Tensor mean = r.update("mean", {B, L + 4}, 36, 1.0, 0, Role::parameter);
           const Tensor rstd = r.update("rstd", {B, L + 4}, 37, 1.0, 0, Role::parameter);
           return op::GatedResidualStats{.out = r.output("out", {B, L, H}, 3),
                                         .mean = mean.cols_slice(4, L),
                                         .rstd = rstd.cols_slice(4, L),
                                         .x = in.x,
                                         .y = in.y,
                                         .gate = in.gate,
                                         .eps = 1e-6};
         }},
        {.op = "gated_residual_backward",
         .name = "gate_window",
         .f32_terms = 4 * L,
         .bf16_steps = 1,
         .why = "dy: one f32 product; dgate: f32 sums of L = 7 products; bf16: each rounded once",
         .build = [](Run& r) -> AnyOp {
           const GatedInputs in(r);
           return op::GatedResidualBackward{.dy = r.output("dy", {B, L, H}, 2),
                                            .dgate = r.update("dmod", {B, 3 * H}, 36).cols_slice(2 * H, H),
                                            .dx = r.input({B, L, H}, 35, 1.0, 1),
                                            .y = in.y,
                                            .gate = in.gate};
         }},
        {.op = "timestep_embedding",
         .name = "odd_width",
         .f32_terms = 2,
         .bf16_steps = 1,
         .why = "evaluated in double, rounded once to the output type",
         .build = [](Run& r) -> AnyOp {
           return op::TimestepEmbedding{.out = r.output("out", {4, 33}, 3),
                                        .t = r.input_values({4}, {0.0, 0.25, 0.999, 3.5}),
                                        .time_factor = 1000.0,
                                        .max_period = 10000.0};
         }},
    },
    {
        {.forward = "silu",
         .backward = "silu_backward",
         .run = [](Backend& be) -> std::vector<GradientCase::Check> {
           Buf<double> x({B, L, C}, 3), y({B, L, C}, 1), probe({B, L, C}, 2), dx({B, L, C}, 3);
           x.randn(5, 2.0), probe.randn(6);
           const auto loss = [&] {
             be.silu(y.t, x.t);
             return probe_loss(y, probe);
           };
           be.silu_backward(dx.t, probe.t, x.t, false);
           return {check_gradient("dx", loss, x, dx, 14)};
         }},
        {.forward = "gelu_tanh",
         .backward = "gelu_tanh_backward",
         .run = [](Backend& be) -> std::vector<GradientCase::Check> {
           Buf<double> x({B, L, C}, 3), y({B, L, C}, 1), probe({B, L, C}, 2), dx({B, L, C}, 3);
           x.randn(7, 2.0), probe.randn(8);
           const auto loss = [&] {
             be.gelu_tanh(y.t, x.t);
             return probe_loss(y, probe);
           };
           be.gelu_tanh_backward(dx.t, probe.t, x.t);
           return {check_gradient("dx", loss, x, dx, 15)};
         }},
        {.forward = "gated_residual",
         .backward = "gated_residual_backward",
         .run = [](Backend& be) -> std::vector<GradientCase::Check> {
           Buf<double> x0({B, L, H}, 1), out({B, L, H}, 3), y({B, L, H}, 2), mod({B, 3 * H}, 1), probe({B, L, H}, 1);
           x0.randn(33), y.randn(34), mod.randn(35), probe.randn(36);
           const Tensor gate = mod.t.cols_slice(2 * H, H);
           const auto loss = [&] {
             be.gated_residual(out.t, x0.t, y.t, gate);  // out of place: x0 is the probed input
             return probe_loss(out, probe);
           };
           Buf<double> dy({B, L, H}, 2), dmod({B, 3 * H}, 1), dx0({B, L, H}, 1);
           be.gated_residual_backward(dy.t, dmod.t.cols_slice(2 * H, H), probe.t, y.t, gate);
           be.copy(dx0.t, probe.t);  // the identity path: dx0 = probe, with zero padding
           return {check_gradient("dx (identity)", loss, x0, dx0, 37), check_gradient("dy", loss, y, dy, 38),
                   check_gradient("dgate", loss, mod, dmod, 39)};
         }},
    });

}  // namespace
}  // namespace flux8::conformance
