// Conformance cases: the modulated LayerNorm and the per-head RMSNorm, with backwards
// (backend/ops/norms.h).
#include "backend/ops.h"
#include "conformance.h"
#include "gradient_check.h"

namespace flux8::conformance {
namespace {

constexpr int64_t B = 3, L = 7, H = 20, NH = 2, D = 10;
constexpr double kRowSums = 8 * H;  // f32 row sums of H = 20 terms, and an rsqrt

// x with a large row mean (as the residual stream has, so the centring matters), shift and scale
// column windows of one modulation output [B, 3H].
struct LayernormInputs {
  Tensor x, shift, scale;
  explicit LayernormInputs(Run& r) {
    std::vector<double> xs;
    for (int64_t i = 0; i < B * L * H; ++i)
      xs.push_back(3.0 * rng_normal(41, 1, static_cast<uint64_t>(i)) + (i / H == 0 ? 40.0 : 1.5));
    x = r.input_values({B, L, H}, xs, Role::activation);
    const Tensor mod = r.input({B, 3 * H}, 42, 0.5, 1);
    shift = mod.cols_slice(0, H), scale = mod.cols_slice(H, H);
  }
};

// x is the K window of a [Q|K|V] row, as QK-norm reads it; the gradient goes to the same window of
// d[Q|K|V], whose other columns keep their values.
Tensor rms_input(Run& r) { return r.input({B * L, 3 * H}, 43, 2.0, 1).cols_slice(H, H); }

const Cases kNormCases(
    {
        {.op = "layernorm_modulate",
         .name = "windows_large_mean",
         .f32_terms = kRowSums,
         .bf16_steps = 1,
         .why = "f32 row statistics of H = 20 values; bf16: y rounded once",
         .build = [](Run& r) -> AnyOp {
           const LayernormInputs in(r);
           return op::LayernormModulate{.y = r.output("y", {B, L, H}, 3),
                                        .mean = r.output("mean", {B * L}, 0, Role::parameter),
                                        .rstd = r.output("rstd", {B * L}, 0, Role::parameter),
                                        .x = in.x,
                                        .shift = in.shift,
                                        .scale = in.scale,
                                        .eps = 1e-6};
         }},
        {.op = "layernorm_modulate",
         .name = "statistics_only",
         .f32_terms = kRowSums,
         .why = "f32 row statistics of H = 20 values",
         .build = [](Run& r) -> AnyOp {
           const LayernormInputs in(r);
           return op::LayernormModulate{.mean = r.output("mean", {B * L}, 0, Role::parameter),
                                        .rstd = r.output("rstd", {B * L}, 0, Role::parameter),
                                        .x = in.x,
                                        .shift = in.shift,
                                        .scale = in.scale,
                                        .eps = 1e-6};
         }},
        {.op = "layernorm_modulate_backward",
         .name = "modulation_windows",
         .f32_terms = 4 * kRowSums,
         .bf16_steps = 2,
         .why = "f32 row sums of H = 20 and column sums of L = 7 products; bf16: from rounded statistics' inputs, "
                "outputs rounded once",
         .build = [](Run& r) -> AnyOp {
           const LayernormInputs in(r);
           const Tensor mean = r.scratch({B * L}, Role::parameter), rstd = r.scratch({B * L}, Role::parameter);
           r.be.layernorm_modulate(Tensor{}, mean, rstd, in.x, in.shift, in.scale, 1e-6);
           const Tensor dmod = r.update("dmod", {B, 3 * H}, 52, 1.0, 1);  // the gate's third keeps its values
           return op::LayernormModulateBackward{.dx = r.output("dx", {B, L, H}, 2),
                                                .dshift = dmod.cols_slice(0, H),
                                                .dscale = dmod.cols_slice(H, H),
                                                .dy = r.input({B, L, H}, 44, 1.0, 1),
                                                .x = in.x,
                                                .mean = mean,
                                                .rstd = rstd,
                                                .scale = in.scale,
                                                .accumulate_dx = false};
         }},
        {.op = "layernorm_modulate_backward",
         .name = "accumulating_dx",
         .f32_terms = 4 * kRowSums,
         .bf16_steps = 2,
         .why = "f32 row sums of H = 20 and column sums of L = 7 products; bf16: dx's += of a rounded store",
         .build = [](Run& r) -> AnyOp {
           const LayernormInputs in(r);
           const Tensor mean = r.scratch({B * L}, Role::parameter), rstd = r.scratch({B * L}, Role::parameter);
           r.be.layernorm_modulate(Tensor{}, mean, rstd, in.x, in.shift, in.scale, 1e-6);
           return op::LayernormModulateBackward{.dx = r.update("dx", {B, L, H}, 45, 1.0, 2),
                                                .dshift = r.output("dshift", {B, H}),
                                                .dscale = r.output("dscale", {B, H}),
                                                .dy = r.input({B, L, H}, 46),
                                                .x = in.x,
                                                .mean = mean,
                                                .rstd = rstd,
                                                .scale = in.scale,
                                                .accumulate_dx = true};
         }},
        {.op = "rmsnorm_heads",
         .name = "k_window",
         .f32_terms = kRowSums,
         .why = "f32 sums of D = 10 squares and an rsqrt (the CUDA backend normalises f32 heads only: no bf16 "
                "variant)",
         .with_bf16 = false,
         .build = [](Run& r) -> AnyOp {
           return op::RmsnormHeads{.y = r.output("y", {B * L, H}, 2),
                                   .rstd = r.output("rstd", {B * L * NH}, 0, Role::parameter),
                                   .x = rms_input(r),
                                   .scale = r.input({D}, 47, 0.5, 0, Role::parameter),
                                   .eps = 1e-6};
         }},
        {.op = "rmsnorm_heads_backward",
         .name = "k_window_accumulating_dscale",
         .f32_terms = 4 * kRowSums,
         .why = "f32 sums of D = 10 products per head and of B·L = 21 rows for dscale (f32 heads only, as "
                "rmsnorm_heads)",
         .with_bf16 = false,
         .build = [](Run& r) -> AnyOp {
           const Tensor x = rms_input(r), scale = r.input({D}, 48, 0.5, 0, Role::parameter);
           const Tensor rstd = r.scratch({B * L * NH}, Role::parameter);
           r.be.rmsnorm_heads(r.scratch({B * L, H}), rstd, x, scale, 1e-6);
           return op::RmsnormHeadsBackward{.dx = r.update("dqkv", {B * L, 3 * H}, 51, 1.0, 1).cols_slice(H, H),
                                           .dscale = r.update("dscale", {D}, 49, 1.0, 0, Role::gradient),
                                           .dy = r.input({B * L, H}, 50, 1.0, 2),
                                           .x = x,
                                           .rstd = rstd,
                                           .scale = scale};
         }},
    },
    {
        {.forward = "layernorm_modulate",
         .backward = "layernorm_modulate_backward",
         .run = [](Backend& be) -> std::vector<GradientCase::Check> {
           Buf<double> x({B, L, H}, 2), mod({B, 3 * H}, 1), y({B, L, H}, 3), probe({B, L, H});
           Buf<double> mean({B * L}), rstd({B * L});
           x.randn(7, 3.0), mod.randn(8, 0.5), probe.randn(9);
           for (double& v : x.mem) v += 1.5;  // a non-zero mean exercises the centring
           const Tensor shift = mod.t.cols_slice(0, H), scale = mod.t.cols_slice(H, H);
           const auto loss = [&] {
             be.layernorm_modulate(y.t, mean.t, rstd.t, x.t, shift, scale, 1e-6);
             return probe_loss(y, probe);
           };
           loss();
           Buf<double> dx({B, L, H}, 2), dmod({B, 3 * H}, 1);
           be.layernorm_modulate_backward(dx.t, dmod.t.cols_slice(0, H), dmod.t.cols_slice(H, H), probe.t, x.t, mean.t,
                                          rstd.t, scale, false);
           return {check_gradient("dx", loss, x, dx, 15), check_gradient("dshift, dscale", loss, mod, dmod, 16)};
         }},
        {.forward = "rmsnorm_heads",
         .backward = "rmsnorm_heads_backward",
         .run = [](Backend& be) -> std::vector<GradientCase::Check> {
           Buf<double> qkv({B * L, 3 * H}, 1), scale({D}), y({B * L, H}, 2), probe({B * L, H}, 2);
           Buf<double> rstd({B * L * NH});
           qkv.randn(17, 2.0), scale.randn(18, 0.5), probe.randn(19);
           const Tensor x = qkv.t.cols_slice(H, H);
           const auto loss = [&] {
             be.rmsnorm_heads(y.t, rstd.t, x, scale.t, 1e-6);
             return probe_loss(y, probe);
           };
           loss();
           Buf<double> dqkv({B * L, 3 * H}, 1), dscale({D});
           be.rmsnorm_heads_backward(dqkv.t.cols_slice(H, H), dscale.t, probe.t, x, rstd.t, scale.t);
           return {check_gradient("dx", loss, qkv, dqkv, 20), check_gradient("dscale", loss, scale, dscale, 21)};
         }},
    });

}  // namespace
}  // namespace flux8::conformance
