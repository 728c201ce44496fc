// Parity with an outside reference: tests/golden/flux_tiny_diffusers.safetensors holds a float64
// forward and backward of Hugging Face diffusers' FluxTransformer2DModel (random weights, 2
// heads, 2 double + 2 single blocks, text + image tokens, guidance on), made by
// tools/make_goldens.py. flux8's CPU model must reproduce its prediction, loss and every
// parameter gradient.
//
// Tolerances (max |flux8 − golden| / max |golden|, per tensor):
// - f64 run: 1e-9. Both sides compute the same function in double; differences are
//   summation-order rounding (~1e-15 per op, grown over ~30 sequential ops and softmax).
// - f32 run: 1e-5 for pred/loss, 1e-4 for gradients. f32 rounding (6e-8 per op) compounds
//   through ~20 sequential ops and gradient chains are longer; tools/make_goldens.py
//   --precision-study measures 2.6e-6 (pred) and 1.9e-5 (gradients) for an f32 diffusers run
//   with the embedding evaluated in double, as flux8 does.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "io/safetensors.h"
#include "model/weights_io.h"
#include "model_test_util.h"

namespace flux8 {
namespace {

const std::string kGolden = std::string(FLUX8_SOURCE_DIR) + "/tests/golden/flux_tiny_diffusers.safetensors";

FluxConfig golden_config(const SafetensorsReader& f) {
  const auto j = nlohmann::json::parse(f.metadata().at("config"));
  FluxConfig c;
  c.name = "golden_tiny";
  c.hidden_size = j.at("hidden_size");
  c.num_heads = j.at("num_attention_heads");
  c.num_double_blocks = j.at("num_double_blocks");
  c.num_single_blocks = j.at("num_single_blocks");
  c.in_channels = j.at("in_channels");
  c.out_channels = j.at("out_channels");
  c.context_dim = j.at("context_dim");
  c.vec_dim = j.at("vec_dim");
  c.mlp_ratio = j.at("mlp_ratio");
  c.guidance_embed = j.at("guidance_embed");
  c.qkv_bias = j.at("qkv_bias");
  c.axes_dim = j.at("axes_dim").get<std::vector<int>>();
  c.rope_theta = j.at("rope_theta");
  c.qk_norm_eps = j.at("qk_norm_eps");
  c.layernorm_eps = j.at("layernorm_eps");
  return c;
}

std::vector<double> read(const SafetensorsReader& f, const std::string& name) {
  std::vector<double> v(static_cast<size_t>(f.tensor(name).numel()));
  f.read_f64(name, v.data());
  return v;
}

void run_golden(DType dtype, double pred_tol, double grad_tol, const std::string& weight_prefix) {
  const SafetensorsReader f(kGolden);
  const FluxConfig cfg = golden_config(f);
  auto be = make_backend("cpu");
  FluxModel model(cfg, *be, dtype);
  load_weights(model.params(), cfg, kGolden, weight_prefix);
  InputBatch batch(*be, dtype);
  batch.load(f, cfg, "input.");

  const Tensor pred = model.forward(batch.inputs());
  const std::vector<double> got = to_host(*be, pred);
  const std::vector<double> want = read(f, "output.pred");
  ASSERT_EQ(got.size(), want.size());
  const double pred_err = testing::max_rel_error(got, want);
  EXPECT_LT(pred_err, pred_tol) << "pred";

  const std::vector<double> probe = read(f, "input.probe");
  double loss = 0;
  std::vector<double> dpred(probe.size());
  for (size_t i = 0; i < probe.size(); ++i) {
    loss += got[i] * probe[i] / static_cast<double>(probe.size());
    dpred[i] = probe[i] / static_cast<double>(probe.size());
  }
  EXPECT_LT(std::abs(loss - read(f, "output.loss")[0]) / std::abs(read(f, "output.loss")[0]), pred_tol);

  model.params().zero_grads();
  model.backward(batch.make(pred.shape, dpred));
  int checked = 0;
  double worst = 0;
  for (const ParamInfo& p : model.params().layout().params()) {
    const std::vector<double> g = to_host(*be, model.params().grad(p.name));
    const double err = testing::max_rel_error(g, read(f, "grad." + p.name));
    EXPECT_LT(err, grad_tol) << "grad." << p.name;
    worst = std::max(worst, err);
    ++checked;
  }
  EXPECT_EQ(checked, 84);
  std::printf("  %s: pred error %.2e, worst gradient error %.2e\n", dtype_name(dtype).data(), pred_err, worst);
}

TEST(Golden, DiffusersFloat64) { run_golden(DType::f64, 1e-9, 1e-9, "param."); }

TEST(Golden, DiffusersFloat32) { run_golden(DType::f32, 1e-5, 1e-4, "param."); }

TEST(Golden, DiffusersNamedWeightsLoadThroughNameMap) {
  // The same weights stored under diffusers' names must load to identical parameters.
  const SafetensorsReader f(kGolden);
  const FluxConfig cfg = golden_config(f);
  auto be = make_backend("cpu");
  ParamStore ref(cfg, *be, DType::f64), mapped(cfg, *be, DType::f64);
  load_weights(ref, cfg, kGolden, "param.");
  load_weights(mapped, cfg, kGolden, "diffusers.");
  for (const ParamInfo& p : ref.layout().params())
    EXPECT_EQ(to_host(*be, ref.param(p.name)), to_host(*be, mapped.param(p.name))) << p.name;
}

TEST(Golden, DiffusersFloat64ThroughDiffusersNames) { run_golden(DType::f64, 1e-9, 1e-9, "diffusers."); }

}  // namespace
}  // namespace flux8
