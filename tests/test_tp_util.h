#pragma once
// Helpers of the tensor-parallel model tests (tests/test_tp_model.cpp over threads,
// tests/mpi/test_tensor_parallel.cpp over MPI ranks): a config that splits over 2 and 4 ranks,
// the whole model's random parameters, and one rank's training steps on its shards of them.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model_test_util.h"

namespace flux8::testing {

using Values = std::vector<std::pair<std::string, std::vector<double>>>;  // (name, values), layout order

struct TpOptions {
  DType dtype = DType::f64;
  const Fp8Config* fp8 = nullptr;
  Recompute recompute = Recompute::none;
  int steps = 1, micro_batches = 1;
  bool optimizer = false;  // AdamW (no clipping) after each step
};

struct RankResult {
  std::vector<double> pred;
  Values grads, params;
};

// H 24, 4 heads of 6, M 60: splits over 2 and 4 ranks; odd input, output, text and vector widths.
inline FluxConfig tp_config(int64_t doubles, int64_t singles) {
  FluxConfig c = odd_config(doubles, singles, true);
  c.name = "tp_test";
  c.hidden_size = 24;
  c.num_heads = 4;
  c.mlp_ratio = 2.5;
  c.axes_dim = {2, 2, 2};
  return c;
}

// Every parameter of the whole model (randomize_params of a one-rank store).
inline Values full_params(const FluxConfig& cfg, DType dtype) {
  auto be = make_backend("cpu");
  ParamStore store(cfg, *be, dtype);
  randomize_params(store, 7);
  Values v;
  for (const ParamInfo& p : store.layout().params()) v.emplace_back(p.name, to_host(*be, store.param(p.name)));
  return v;
}

// One rank's training steps: its shards of `full`, the same inputs and probes on every rank.
inline RankResult run_rank(const FluxConfig& cfg, TensorParallel tp, const TpOptions& o, const Values& full) {
  BackendOptions bo;
  bo.threads = 1;
  auto be = make_backend("cpu", bo);
  FluxModel model(cfg, *be, o.dtype, o.fp8, o.recompute, tp);
  ParamStore& P = model.params();
  for (const auto& [name, values] : full) {
    const ParamShard& s = P.layout().at(name).shard;
    from_host(*be, P.param(name), s.sharded() ? take_shard(s, s.rank, values) : values);
  }
  P.params_changed();
  InputBatch batch(*be, o.dtype);
  FluxInputs in;
  random_inputs(batch, cfg, 2, 3, 5, 11, in);
  std::unique_ptr<AdamWOptimizer> opt;
  if (o.optimizer) opt = std::make_unique<AdamWOptimizer>(P, AdamWConfig{.clip_grad = 0});
  RankResult r;
  Tensor dpred;
  for (int s = 0; s < o.steps; ++s) {
    P.zero_grads();
    for (int m = 0; m < o.micro_batches; ++m) {
      const Tensor pred = model.forward(in);
      r.pred = to_host(*be, pred);
      std::vector<double> probe(r.pred.size());
      for (size_t i = 0; i < probe.size(); ++i) probe[i] = rng_normal(3, static_cast<uint64_t>(s * 16 + m), i);
      if (!dpred.defined())
        dpred = batch.make(pred.shape, probe);
      else
        from_host(*be, dpred, probe);
      model.backward(dpred);
    }
    model.before_optimizer_step();
    if (opt) opt->step(s + 1, 1e-2);
    model.after_optimizer_step(false);
  }
  for (const ParamInfo& p : P.layout().params()) {
    r.grads.emplace_back(p.name, to_host(*be, P.grad(p.name)));
    r.params.emplace_back(p.name, to_host(*be, P.param(p.name)));
  }
  return r;
}

inline void expect_close(const Values& a, const Values& b, double tolerance, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].first, b[i].first);
    EXPECT_LE(max_rel_error(a[i].second, b[i].second), tolerance) << what << " of " << a[i].first;
  }
}

}  // namespace flux8::testing
