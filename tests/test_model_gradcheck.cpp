// Finite-difference checks of the hand-written backward of whole blocks and the whole model,
// in double precision, on sizes that are not multiples of 8. Each parameter tensor is checked
// on its own (a random direction within that tensor), so a wrong gradient names its tensor.
// Tolerance: see tests/gradcheck.h (a correct gradient agrees to ~1e-9 here; 1e-6 leaves
// margin; a real mistake gives >1e-3).
#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "backend/backend.h"
#include "core/error.h"
#include "gradcheck.h"
#include "model_test_util.h"

namespace flux8 {
namespace {

using testing::odd_config;

void check_model_gradients(const FluxConfig& cfg, const std::string& only_prefix) {
  auto be = make_backend("cpu");
  FluxModel model(cfg, *be, DType::f64);
  testing::randomize_params(model.params(), 11);
  InputBatch batch(*be, DType::f64);
  FluxInputs in;
  testing::random_inputs(batch, cfg, /*B=*/2, /*Lt=*/3, /*Li=*/5, 7, in);

  const Tensor pred0 = model.forward(in);
  std::vector<double> probe(static_cast<size_t>(pred0.numel()));
  for (size_t i = 0; i < probe.size(); ++i) probe[i] = rng_normal(99, 0, i);
  auto loss = [&]() {
    const std::vector<double> p = to_host(*be, model.forward(in));
    double s = 0;
    for (size_t i = 0; i < p.size(); ++i) s += p[i] * probe[i];
    return s;
  };
  loss();
  model.params().zero_grads();
  model.backward(batch.make(pred0.shape, probe));  // d(Σ pred·probe)/d pred = probe

  ParamStore& P = model.params();
  int checked = 0;
  for (size_t i = 0; i < P.layout().params().size(); ++i) {
    const ParamInfo& info = P.layout().params()[i];
    if (info.name.rfind(only_prefix, 0) != 0) continue;
    std::vector<double> values = to_host(*be, P.param(info.name));
    const std::vector<double> grad = to_host(*be, P.grad(info.name));
    const Tensor t = P.param(info.name);
    auto loss_of_values = [&]() {
      from_host(*be, t, values);
      return loss();
    };
    const auto r = testing::check_directional_derivative(loss_of_values, values, grad, 1000 + i);
    from_host(*be, t, values);
    EXPECT_LT(r.rel_error, 1e-6) << info.name << ": analytic " << r.analytic << " numeric " << r.numeric;
    ++checked;
  }
  EXPECT_GT(checked, 0) << "no parameter matched " << only_prefix;
}

TEST(ModelGradcheck, DoubleBlock) { check_model_gradients(odd_config(1, 0, false), "double_blocks.0."); }

TEST(ModelGradcheck, SingleBlock) { check_model_gradients(odd_config(0, 1, false), "single_blocks.0."); }

TEST(ModelGradcheck, WholeTinyModelWithGuidance) { check_model_gradients(odd_config(2, 2, true), ""); }

TEST(ModelGradcheck, BackwardAccumulatesAcrossCalls) {
  // Parameter gradients are accumulated: two backward passes give twice the gradient (the first
  // after zero_grads() overwrites, the second adds).
  const FluxConfig cfg = odd_config(1, 1, false);
  auto be = make_backend("cpu");
  FluxModel model(cfg, *be, DType::f64);
  testing::randomize_params(model.params(), 3);
  InputBatch batch(*be, DType::f64);
  FluxInputs in;
  testing::random_inputs(batch, cfg, 2, 3, 5, 4, in);
  const Tensor pred = model.forward(in);
  std::vector<double> probe(static_cast<size_t>(pred.numel()), 0.5);
  const Tensor dpred = batch.make(pred.shape, probe);
  model.params().zero_grads();
  model.backward(dpred);
  const std::vector<double> once = to_host(*be, model.params().flat_grads());
  model.backward(dpred);
  const std::vector<double> twice = to_host(*be, model.params().flat_grads());
  for (size_t i = 0; i < once.size(); ++i) ASSERT_NEAR(twice[i], 2 * once[i], 1e-12 * (1 + std::abs(once[i])));

  // zero_grads() does not fill the buffer: each gradient's first write of the step overwrites
  // it. Whatever the buffer held (NaN here) must not reach the gradients.
  model.params().zero_grads();
  be->fill(model.params().flat_grads(), std::numeric_limits<double>::quiet_NaN());
  model.backward(dpred);
  EXPECT_EQ(to_host(*be, model.params().flat_grads()), once);

  // A gradient nothing wrote since zero_grads() is an internal error, named, never stale values.
  model.params().zero_grads();
  EXPECT_THROW(
      {
        try {
          model.params().finish_grads();
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("wrote no gradient for parameter"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
}

}  // namespace
}  // namespace flux8
