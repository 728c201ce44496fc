#pragma once
// Helpers for whole-model tests: small configs with awkward sizes, random parameters and
// inputs, and tensor comparisons.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/step_graph.h"
#include "backend/transfer.h"
#include "core/error.h"
#include "core/rng.h"
#include "fp8/fp8_config.h"
#include "model/flux_model.h"
#include "model/input_batch.h"
#include "train/optimizer.h"
#include "train/train_step.h"

namespace flux8::testing {

// Sizes that are not multiples of 8 anywhere: H=20, D=10, M=47, in 5, context 7, vec 3.
inline FluxConfig odd_config(int64_t doubles, int64_t singles, bool guidance) {
  FluxConfig c;
  c.name = "odd_test";
  c.hidden_size = 20;
  c.num_heads = 2;
  c.num_double_blocks = doubles;
  c.num_single_blocks = singles;
  c.in_channels = 5;
  c.out_channels = 5;
  c.context_dim = 7;
  c.vec_dim = 3;
  c.mlp_ratio = 2.35;  // M = 47
  c.guidance_embed = guidance;
  c.axes_dim = {2, 4, 4};
  return c;
}

// Every parameter N(0, std²) (default 0.3, for the tiny test widths), norm scales
// 1 + N(0, 0.2²): unlike the MLPerf init (zero modulation and final layer), nothing is zero, so
// every gradient path is exercised. Wide models need std ~ 1/√width to stay well conditioned.
inline void randomize_params(ParamStore& store, uint64_t seed, double std = 0.3) {
  for (size_t i = 0; i < store.layout().params().size(); ++i) {
    const ParamInfo& p = store.layout().params()[i];
    const bool is_scale = p.name.size() > 6 && p.name.substr(p.name.size() - 6) == ".scale";
    std::vector<double> v(static_cast<size_t>(p.shape.numel()));
    for (size_t j = 0; j < v.size(); ++j)
      v[j] = (is_scale ? 1.0 : 0.0) + (is_scale ? 0.2 : std) * rng_normal(seed, i, j);
    if (store.masters_sharded()) {  // the masters of the part this rank holds
      const ParamStore::HeldPart h = store.held_part(p);
      if (h.view.defined())
        from_host(store.masters_backend(), h.view,
                  std::vector<double>(v.begin() + h.first, v.begin() + h.first + h.view.numel()));
      continue;
    }
    from_host(store.masters_backend(), store.param(p.name), v);
  }
  store.params_changed();
}

// Random inputs for B samples, Lt text and Li image tokens; image ids on a grid of width 3.
inline void random_inputs(InputBatch& batch, const FluxConfig& c, int64_t B, int64_t Lt, int64_t Li, uint64_t seed,
                          FluxInputs& in) {
  auto randn = [&](Shape s, uint64_t stream, double scale) {
    std::vector<double> v(static_cast<size_t>(s.numel()));
    for (size_t j = 0; j < v.size(); ++j) v[j] = scale * rng_normal(seed, stream, j);
    return batch.make(s, v);
  };
  in.img = randn(Shape{B, Li, c.in_channels}, 1, 1.0);
  in.txt = randn(Shape{B, Lt, c.context_dim}, 2, 1.0);
  in.y = randn(Shape{B, c.vec_dim}, 3, 1.0);
  std::vector<double> ids_img, ids_txt(static_cast<size_t>(B * Lt * 3), 0.0), t, g;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < Li; ++l) ids_img.insert(ids_img.end(), {0.0, double(l / 3), double(l % 3)});
  for (int64_t b = 0; b < B; ++b) {
    t.push_back(rng_uniform(seed, 4, static_cast<uint64_t>(b)));
    g.push_back(1.0 + 4.0 * rng_uniform(seed, 5, static_cast<uint64_t>(b)));
  }
  in.img_ids = batch.make(Shape{B, Li, 3}, ids_img);
  in.txt_ids = batch.make(Shape{B, Lt, 3}, ids_txt);
  in.timesteps = batch.make(Shape{B}, t);
  if (c.guidance_embed) in.guidance = batch.make(Shape{B}, g);
}

// max|a − b| / max|b|: error relative to the tensor's scale.
inline double max_rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return den > 0 ? num / den : num;
}

// A few training-like steps of a model on `be`: random parameters and inputs, forward, a random
// probe as the gradient of pred, backward, optimizer-step bookkeeping (FP8 scale update). The
// result of the last step, for comparing two runs (backends, recomputation, ...).
struct ModelRunOptions {
  DType dtype = DType::f32;
  const Fp8Config* fp8 = nullptr;
  RecomputePolicy recompute = Recompute::none;
  int64_t batch = 2, txt_tokens = 5, img_tokens = 9;
  int steps = 1;
  double weight_std = 0.3;
  // With an optimizer (AdamW, lr 1e-2) after each backward; fused_weight_casts: it writes the
  // FP8 weight casts (FluxModel::weight_casts, delayed recipe) instead of their first use.
  bool optimizer = false, fused_weight_casts = true;
  bool collect_stats = true;  // FP8 telemetry counts on every step (Fp8Runtime::set_collect_stats)
  // > 0: the per-sample Linears' gradients kept as low-rank factors of up to this many rows
  // (ParamStore::keep_low_rank_grads), written out before the gradients are read.
  int64_t low_rank_rows = 0;
  DType moment_dtype = DType::f32;  // the optimizer's moments (adam_moment_precision)
  // The f32 master weights and the moments in host memory (optimizer_offload: cpu), the optimizer
  // streaming them through the backend in chunks of this many elements; 0: on the backend.
  int64_t offload_chunk = 0;
  uint64_t param_seed = 7, input_seed = 11, probe_seed = 3;  // probe of step s: stream s
  // > 0: the model runs on a StepGraph over `be` with segments of this many ops, the forward and
  // the backward each a region (cuda_graph; on the CPU the replay twin).
  int graph_segment_ops = 0;
};

struct ModelRun {
  std::vector<double> pred;
  std::vector<std::pair<std::string, std::vector<double>>> grads;  // (name, values), layout order
  std::vector<int64_t> cast_elements;             // FP8: elements each (site, operand) cast in the last step
  std::vector<float> scales, history;             // FP8 delayed scaling: the registry's state at the end
  DType moment_dtype = DType::f32;                // with an optimizer: the type its moments were stored in
  StepGraph::Stats graph;                         // with graph_segment_ops: the StepGraph's counts
  size_t scratch_reserved = 0, scratch_peak = 0;  // FluxModel's block scratch, bytes
};

// FP8 delayed scaling, hybrid formats, a 4-step amax history: the whole-model tests' FP8 recipe
// (with FP8 attention when asked).
inline Fp8Config delayed_hybrid_fp8(bool fp8_attention = false) {
  Fp8Config fp8;
  fp8.enabled = true;
  fp8.hybrid = true;
  fp8.recipe = Fp8Recipe::delayed;
  fp8.amax_history_len = 4;
  fp8.dot_product_attention = fp8_attention;
  return fp8;
}

// Two runs equal bit for bit: predictions, every gradient, the FP8 scales, amax histories and cast
// counts (StepGraph's replayed or graphed steps against eager ones).
inline void expect_identical_runs(const ModelRun& a, const ModelRun& b) {
  EXPECT_EQ(a.pred, b.pred);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < b.grads.size(); ++i) EXPECT_EQ(a.grads[i].second, b.grads[i].second) << b.grads[i].first;
  EXPECT_EQ(a.scales, b.scales);
  EXPECT_EQ(a.history, b.history);
  EXPECT_EQ(a.cast_elements, b.cast_elements);
}

inline ModelRun run_model(Backend& device, const FluxConfig& cfg, const ModelRunOptions& o) {
  std::unique_ptr<StepGraph> graph =
      o.graph_segment_ops > 0
          ? std::make_unique<StepGraph>(device, StepGraph::Options{.segment_ops = o.graph_segment_ops})
          : nullptr;
  Backend& be = device;  // the graph, when made, records its ops
  const std::unique_ptr<Backend> host = o.offload_chunk > 0 ? make_backend("cpu") : nullptr;
  FluxModel model(cfg, be, o.dtype, o.fp8, o.recompute, {}, host.get());
  randomize_params(model.params(), o.param_seed, o.weight_std);
  if (o.low_rank_rows > 0 && !model.params().keep_low_rank_grads(o.low_rank_rows))
    fail("run_model: the store refused low-rank gradients of {} rows", o.low_rank_rows);
  InputBatch batch(be, o.dtype);
  FluxInputs in;
  random_inputs(batch, cfg, o.batch, o.txt_tokens, o.img_tokens, o.input_seed, in);
  model.plan(StepShape{o.batch, o.txt_tokens, o.img_tokens});
  if (model.fp8()) model.fp8()->set_collect_stats(o.collect_stats);
  std::unique_ptr<AdamWOptimizer> opt;
  if (o.optimizer)
    opt = std::make_unique<AdamWOptimizer>(model.params(), AdamWConfig{.moment_dtype = o.moment_dtype,
                                                                       .offload = o.offload_chunk > 0,
                                                                       .offload_masters = o.offload_chunk > 0,
                                                                       .offload_chunk = o.offload_chunk});
  ModelRun r;
  if (opt) r.moment_dtype = opt->moment_dtype();
  Tensor dpred;  // the probe of each step, in one buffer
  for (int s = 0; s < o.steps; ++s) {
    model.params().zero_grads();
    StepGraph::Region forward(graph.get());
    const Tensor pred = model.forward(in);
    forward.end();
    r.pred = to_host(be, pred);
    std::vector<double> probe(r.pred.size());
    for (size_t i = 0; i < probe.size(); ++i) probe[i] = rng_normal(o.probe_seed, static_cast<uint64_t>(s), i);
    if (!dpred.defined())
      dpred = batch.make(pred.shape, probe);
    else
      from_host(be, dpred, probe);
    StepGraph::Region backward(graph.get());
    model.backward(dpred);
    backward.end();
    if (opt && o.fused_weight_casts) {
      apply_optimizer_step(model, *opt, s + 1, 1e-2);  // as the trainer
      continue;
    }
    model.before_optimizer_step();  // scales first; the weights' casts at their first use
    if (opt) opt->step(s + 1, 1e-2);
    model.after_optimizer_step(false);
  }
  model.params().materialize_low_rank_grads();  // grad() reads the flat buffer
  for (const ParamInfo& p : model.params().layout().params())
    r.grads.emplace_back(p.name, to_host(be, model.params().grad(p.name)));
  if (model.fp8()) {
    for (const auto& site : model.fp8()->last_step_stats())
      for (const CastStats& c : site.op) r.cast_elements.push_back(c.elements);
    const Fp8MetaRegistry& reg = model.fp8()->current_registry();
    for (int i = 0; i < reg.size(); ++i) r.scales.push_back(reg.scale(i));
    r.history = reg.amax_history();
  }
  if (graph) r.graph = graph->stats();
  r.scratch_reserved = model.scratch_reserved();
  r.scratch_peak = model.scratch_peak();
  return r;
}

}  // namespace flux8::testing
