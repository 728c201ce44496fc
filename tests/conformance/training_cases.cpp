// Conformance cases: the training objective and the optimizer (backend/ops/training.h). Their
// tensors are f32 in training whatever the activation type, so they run on the f32 variants.
#include <cmath>

#include "backend/ops.h"
#include "conformance.h"
#include "core/rng.h"

namespace flux8::conformance {
namespace {

constexpr int64_t B = 3, L = 7, C = 20, N = 3000;

std::vector<double> positive(uint64_t seed, int64_t n, double scale) {
  std::vector<double> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(scale * std::abs(rng_normal(seed, 1, static_cast<uint64_t>(i))) + 1e-6);
  return v;
}

// Flat gradients whose low-rank range [500, 500 + 30·40) holds NaN: an op that reads it shows it.
Tensor gradients_with_low_rank_range(Run& r) {
  std::vector<double> g;
  for (int64_t i = 0; i < N; ++i)
    g.push_back(i >= 500 && i < 500 + 30 * 40 ? NAN : rng_normal(81, 1, static_cast<uint64_t>(i)));
  return r.input_values({N}, g, Role::gradient);
}
List<LowRankGrad> low_rank_of(Run& r) {
  return List<LowRankGrad>{
      {500, r.input_typed({2, 30}, 82, 0.1, DType::f32), r.input_typed({2, 40}, 83, 1.0, DType::f32)}};
}

const AdamWHyper kStep3{
    .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .grad_scale = 0.6, .step = 3};

const Cases kTrainingCases({
    {.op = "flow_match_inputs",
     .name = "three_samples",
     .f32_terms = 4,
     .why = "two f32 products and a sum; the noise is the same f32 draw (the device's logf within an ulp)",
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       return op::FlowMatchInputs{.xt = r.output("xt", {B, L, C}, 0, Role::parameter),
                                  .target = r.output("target", {B, L, C}, 0, Role::parameter),
                                  .x0 = r.input({B, L, C}, 84, 1.0, 0, Role::parameter),
                                  .t = r.input_values({B}, {0.1, 0.5, 0.95}),
                                  .seed = 7,
                                  .streams = {11, 12, 13}};
     }},
    {.op = "mse_loss",
     .name = "loss_and_gradient",
     .f32_terms = 4,
     .why = "dpred: one f32 difference and product; the loss summed in double",
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       return op::MseLoss{.dpred = r.output("dpred", {B, L, C}, 0, Role::parameter),
                          .pred = r.input({B, L, C}, 85, 1.0, 0, Role::parameter),
                          .target = r.input({B, L, C}, 86, 1.0, 0, Role::parameter),
                          .grad_scale = 0.5};
     }},
    {.op = "mse_loss_into",
     .name = "loss_in_backend_memory",
     .f32_terms = 4,
     .why = "as mse_loss: the loss summed in double",
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       return op::MseLossInto{.loss = r.output_typed("loss", {1}, DType::f64),
                              .dpred = r.output("dpred", {B, L, C}, 0, Role::parameter),
                              .pred = r.input({B, L, C}, 87, 1.0, 0, Role::parameter),
                              .target = r.input({B, L, C}, 88, 1.0, 0, Role::parameter),
                              .grad_scale = 2.0};
     }},
    {.op = "sum_squares",
     .name = "odd_length",
     .f32_terms = 1,
     .why = "squares of the same values summed in double: the order only",
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       return op::SumSquares{.x = r.input({13, 37}, 89, 1.0, 0, Role::parameter)};
     }},
    {.op = "ranges_sum_squares",
     .name = "unaligned_empty_and_long_ranges",
     .f32_terms = 1,
     .why = "squares of the same values summed in double: the order only",
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       // Ranges that start and end off 16-byte boundaries, an empty one, one longer than a
       // CUDA block's chunk (65,536), and one out of order.
       return op::RangesSumSquares{
           .x = r.input({70001}, 79, 1.0, 0, Role::gradient),
           .ranges = List<ElementRange>{{3, 517}, {600, 0}, {1001, 65999}, {67001, 2999}, {0, 1}}};
     }},
    {.op = "gradient_sum_squares",
     .name = "flat",
     .f32_terms = 1,
     .why = "squares of the same values summed in double: the order only",
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       return op::GradientSumSquares{.grads = r.input({N}, 80, 1.0, 0, Role::gradient)};
     }},
    // Low-rank factors are f32 on every backend: against the CPU in f32.
    {.op = "gradient_sum_squares",
     .name = "low_rank_range_unread",
     .f32_terms = 4,
     .why = "sums in double; the low-rank range's norm from its factors' Gram matrices on both",
     .judge = Judge::cpu_f32,
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       return op::GradientSumSquares{.grads = gradients_with_low_rank_range(r), .low_rank = low_rank_of(r)};
     }},
    {.op = "adamw",
     .name = "third_step",
     .f32_terms = 16,
     .why = "the update's few f32 operations per element, against the same update in double",
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       return op::Adamw{.param = r.update("param", {N}, 90, 1.0, 0, Role::parameter),
                        .grad = r.input({N}, 97, 1.0, 0, Role::gradient),
                        .m = r.update("m", {N}, 91, 0.01, 0, Role::parameter),
                        .v = r.update_values("v", {N}, positive(92, N, 1e-3)),
                        .h = kStep3};
     }},
    // Every backend writes the same bits: the parameters and moments, the bf16 operand copy, the
    // FP8 cast of a range and the update of a low-rank range (the CPU is the reference in f32).
    {.op = "adamw",
     .name = "copies_casts_low_rank_bit_for_bit",
     .why = "every product and sum rounded on its own in f32 on every backend: bit for bit",
     .judge = Judge::cpu_f32,
     .with_bf16 = false,
     .build = [](Run& r) -> AnyOp {
       QTensor codes = r.qtensor("cast", 20, 30);
       return op::Adamw{.param = r.update("param", {N}, 93, 1.0, 0, Role::parameter),
                        .grad = gradients_with_low_rank_range(r),
                        .m = r.update("m", {N}, 95, 0.01, 0, Role::parameter),
                        .v = r.update_values("v", {N}, positive(96, N, 1e-3)),
                        .h = kStep3,
                        .copies = List<ParamCopy>{{100, r.output_typed("copy", {20, 30}, DType::bf16)}},
                        .casts = List<ParamCast>{{1000, codes, r.scalars("", 1, 150.0f), r.scalars("amax", 1, 0.0f)}},
                        .low_rank = low_rank_of(r)};
     }},
});

}  // namespace
}  // namespace flux8::conformance
