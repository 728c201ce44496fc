// Conformance cases: linear, its backward and the GELU epilogues (backend/ops/linear.h).
#include "backend/ops.h"
#include "conformance.h"
#include "gradient_check.h"

namespace flux8::conformance {
namespace {

// 21 rows of 45 inputs into 29 outputs: none a multiple of 8; x and y are column windows.
constexpr int64_t B = 3, L = 7, N = B * L, K = 45, M = 29, Kh = 30, My = 17;
constexpr double kGemm = 2 * K;  // f32 sums of K products: K·2⁻²⁴ of Σ|x·w| ≲ 2K·2⁻²⁴ of max|y|

const Cases kLinearCases(
    {
        {.op = "linear",
         .name = "odd_shape_windows",
         .f32_terms = kGemm,
         .bf16_steps = 1,
         .why = "f32 sum of K = 45 products; bf16: y rounded once",
         .build = [](Run& r) -> AnyOp {
           return op::Linear{.y = r.output("y", {B, L, M}, 5),
                             .x = r.input({B, L, K}, 1, 1.0, 3),
                             .w = r.input({M, K}, 2, 0.2, 0, Role::parameter),
                             .b = r.input({M}, 3, 1.0, 0, Role::parameter)};
         }},
        {.op = "linear",
         .name = "without_bias",
         .f32_terms = kGemm,
         .bf16_steps = 1,
         .why = "f32 sum of 3 products (bounded by K = 45's); bf16: y rounded once",
         .build = [](Run& r) -> AnyOp {
           return op::Linear{
               .y = r.output("y", {1, 7}), .x = r.input({1, 3}, 4), .w = r.input({7, 3}, 5, 0.5, 0, Role::parameter)};
         }},
        {.op = "bias_add",
         .name = "odd_shape_window",
         .f32_terms = 1,
         .bf16_steps = 1,
         .why = "one f32 addition an element; bf16: y rounded once",
         .build = [](Run& r) -> AnyOp {
           return op::BiasAdd{.y = r.update("y", {B, L, M}, 14, 1.0, 2),
                              .b = r.input({M}, 15, 1.0, 0, Role::parameter)};
         }},
        {.op = "linear_backward",
         .name = "accumulating_params",
         .f32_terms = 2 * M,
         .bf16_steps = 2,
         .why = "f32 sums of M = 29 (dx) and N = 21 (dw, db) products; bf16: dx rounded, dw's += of a rounded store",
         .build = [](Run& r) -> AnyOp {
           return op::LinearBackward{.dx = r.output("dx", {B, L, K}, 4),
                                     .dw = r.update("dw", {M, K}, 6, 1.0, 0, Role::gradient),
                                     .db = r.update("db", {M}, 7, 1.0, 0, Role::gradient),
                                     .dy = r.input({B, L, M}, 8, 1.0, 2),
                                     .x = r.input({B, L, K}, 9, 1.0, 3),
                                     .w = r.input({M, K}, 10, 0.2, 0, Role::parameter),
                                     .accumulate_dx = false,
                                     .accumulate_params = true};
         }},
        {.op = "linear_backward",
         .name = "accumulating_dx_overwriting_params",
         .f32_terms = 2 * M,
         .bf16_steps = 2,
         .why = "f32 sums of M = 29 (dx) and N = 21 (dw, db) products; bf16: dx's += of a rounded store",
         .build = [](Run& r) -> AnyOp {
           return op::LinearBackward{.dx = r.update("dx", {N, K}, 11, 1.0, 1),
                                     .dw = r.output("dw", {M, K}, 0, Role::gradient),
                                     .db = r.output("db", {M}, 0, Role::gradient),
                                     .dy = r.input({N, M}, 12),
                                     .x = r.input({N, K}, 13),
                                     .w = r.input({M, K}, 14, 0.2, 0, Role::parameter),
                                     .accumulate_dx = true,
                                     .accumulate_params = false};
         }},
        {.op = "linear_gelu",
         .name = "gelu_of_last_columns",
         .f32_terms = kGemm + 16,
         .bf16_steps = 2,
         .why = "f32 sum of K = 45 products, then tanhf; bf16: h rounded, y from the rounded or unrounded h",
         .build = [](Run& r) -> AnyOp {
           return op::LinearGelu{.y = r.output("y", {N, My}, 3),
                                 .h = r.output("h", {N, M}, 2),
                                 .x = r.input({N, K}, 15, 1.0, 1),
                                 .w = r.input({M, K}, 16, 0.2, 0, Role::parameter),
                                 .b = r.input({M}, 17, 1.0, 0, Role::parameter)};
         }},
        {.op = "linear_dgrad_gelu",
         .name = "split_input_gradient",
         .f32_terms = 2 * M + 16,
         .bf16_steps = 2,
         .why = "f32 sum of M = 29 products times the GELU's derivative (tanhf); bf16: dx, dh rounded once",
         .build = [](Run& r) -> AnyOp {
           return op::LinearDgradGelu{.dx = r.output("dx", {N, K - Kh}, 2),
                                      .dh = r.output("dh", {N, Kh}, 3),
                                      .dy = r.input({N, M}, 18, 1.0, 1),
                                      .w = r.input({M, K}, 19, 0.2, 0, Role::parameter),
                                      .h = r.input({N, Kh}, 20, 1.5, 4)};
         }},
    },
    {
        {.forward = "linear",
         .backward = "linear_backward",
         .run = [](Backend& be) -> std::vector<GradientCase::Check> {
           Buf<double> x({B, L, K}, 3), w({M, K}, 2), b({M}), y({B, L, M}, 4), probe({B, L, M}, 1);
           x.randn(1), w.randn(2, 0.3), b.randn(3), probe.randn(4);
           const auto loss = [&] {
             be.linear(y.t, x.t, w.t, b.t);
             return probe_loss(y, probe);
           };
           Buf<double> dx({B, L, K}, 3), dw({M, K}, 2), db({M});
           be.linear_backward(dx.t, dw.t, db.t, probe.t, x.t, w.t, false, true);
           return {check_gradient("dx", loss, x, dx, 11), check_gradient("dw", loss, w, dw, 12),
                   check_gradient("db", loss, b, db, 13)};
         }},
        // The GELU part of the input: linear_dgrad_gelu's dh is the gradient of
        // y = linear([x₀ | gelu_tanh(h)]) with respect to h, dx that of x₀.
        {.forward = "linear_gelu",
         .backward = "linear_dgrad_gelu",
         .run = [](Backend& be) -> std::vector<GradientCase::Check> {
           Buf<double> x0({N, K - Kh}, 2), h({N, Kh}, 1), w({M, K}), in({N, K}), y({N, M}, 3), probe({N, M}, 3);
           x0.randn(21), h.randn(22, 1.5), w.randn(23, 0.3), probe.randn(24);
           const auto loss = [&] {
             be.copy(in.t.cols_slice(0, K - Kh), x0.t);
             be.gelu_tanh(in.t.cols_slice(K - Kh, Kh), h.t);
             be.linear(y.t, in.t, w.t, Tensor{});
             return probe_loss(y, probe);
           };
           Buf<double> dx0({N, K - Kh}, 2), dh({N, Kh}, 1);
           be.linear_dgrad_gelu(dx0.t, dh.t, probe.t, w.t, h.t);
           return {check_gradient("dx", loss, x0, dx0, 25), check_gradient("dh", loss, h, dh, 26)};
         }},
    });

}  // namespace
}  // namespace flux8::conformance
