// The tensor-parallel parameter layout (model/param_shard.h, ParamLayout::build with a rank):
// which tensors split and how, the shard <-> full tensor helpers, initialisation and weight
// loading of a rank's shards, and the errors for models that do not split.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/tensor_parallel.h"
#include "model/weights_io.h"
#include "test_tp_util.h"
#include "test_util.h"

namespace flux8 {
namespace {

using testing::error_of;
using testing::tp_config;

std::vector<double> iota(int64_t n) {
  std::vector<double> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(i);
  return v;
}

TEST(TpLayout, OneRankIsTheWholeModel) {
  const FluxConfig cfg = tp_config(2, 2);
  const ParamLayout whole = ParamLayout::build(cfg), one = ParamLayout::build(cfg, 0, 1);
  ASSERT_EQ(whole.params().size(), one.params().size());
  EXPECT_EQ(whole.total(), one.total());
  for (size_t i = 0; i < whole.params().size(); ++i) {
    const ParamInfo &a = whole.params()[i], &b = one.params()[i];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.shape, b.shape) << a.name;
    EXPECT_EQ(a.offset, b.offset) << a.name;
    EXPECT_EQ(a.shard.full, a.shape) << a.name;
    EXPECT_FALSE(a.shard.sharded()) << a.name;
  }
}

TEST(TpLayout, BlocksSplitMegatronStyle) {
  const FluxConfig cfg = tp_config(1, 1);
  const int64_t H = 24, M = 60;
  const ParamLayout L = ParamLayout::build(cfg, 1, 2);
  const ParamLayout whole = ParamLayout::build(cfg);
  ASSERT_EQ(L.params().size(), whole.params().size());
  struct Expect {
    ShardSplit split;
    Shape local;
    std::vector<int64_t> segments;
  };
  const std::map<std::string, Expect> split{
      {"double_blocks.0.img_attn.qkv.weight", {ShardSplit::rows, Shape{3 * H / 2, H}, {H, H, H}}},
      {"double_blocks.0.img_attn.qkv.bias", {ShardSplit::rows, Shape{3 * H / 2}, {H, H, H}}},
      {"double_blocks.0.txt_attn.proj.weight", {ShardSplit::cols, Shape{H, H / 2}, {H}}},
      {"double_blocks.0.txt_mlp.0.weight", {ShardSplit::rows, Shape{M / 2, H}, {M}}},
      {"double_blocks.0.txt_mlp.0.bias", {ShardSplit::rows, Shape{M / 2}, {M}}},
      {"double_blocks.0.img_mlp.2.weight", {ShardSplit::cols, Shape{H, M / 2}, {M}}},
      {"single_blocks.0.linear1.weight", {ShardSplit::rows, Shape{(3 * H + M) / 2, H}, {H, H, H, M}}},
      {"single_blocks.0.linear1.bias", {ShardSplit::rows, Shape{(3 * H + M) / 2}, {H, H, H, M}}},
      {"single_blocks.0.linear2.weight", {ShardSplit::cols, Shape{H, (H + M) / 2}, {H, M}}},
  };
  int split_seen = 0, reduced = 0;
  for (size_t i = 0; i < L.params().size(); ++i) {
    const ParamInfo& p = L.params()[i];
    EXPECT_EQ(p.name, whole.params()[i].name);  // the reference names and order at every size
    EXPECT_EQ(p.shard.full, whole.params()[i].shape) << p.name;
    EXPECT_EQ(p.shard.rank, 1);
    EXPECT_EQ(p.shard.size, 2);
    const bool scale = p.name.find("_norm.scale") != std::string::npos;
    EXPECT_EQ(p.shard.reduce_grad, scale) << p.name;
    reduced += scale ? 1 : 0;
    const auto it = split.find(p.name);
    // Every other proj/mlp.2/linear2 tensor mirrors its img/txt twin; the row-parallel biases,
    // the modulation, embedders and final layer are replicated.
    const bool twin = p.name.find("attn.qkv") != std::string::npos || p.name.find("mlp.0") != std::string::npos ||
                      p.name.find("linear1") != std::string::npos ||
                      (p.name.ends_with(".weight") &&
                       (p.name.find("attn.proj") != std::string::npos || p.name.find("mlp.2") != std::string::npos ||
                        p.name.find("linear2") != std::string::npos));
    EXPECT_EQ(p.shard.sharded(), twin) << p.name;
    if (p.shard.sharded()) ++split_seen;
    if (it == split.end()) {
      if (!p.shard.sharded()) EXPECT_EQ(p.shape, p.shard.full) << p.name;
      continue;
    }
    EXPECT_EQ(p.shard.split, it->second.split) << p.name;
    EXPECT_EQ(p.shape, it->second.local) << p.name;
    EXPECT_EQ(p.shard.segments, it->second.segments) << p.name;
  }
  EXPECT_EQ(split_seen, 2 * 6 + 3);  // per stream qkv w+b, proj w, mlp.0 w+b, mlp.2 w; linear1 w+b, linear2 w
  EXPECT_EQ(reduced, 2 * 2 + 2);
}

TEST(TpLayout, ShardsCoverTheModelOnce) {
  // Every element of a split tensor is on exactly one rank; replicated tensors are on all.
  const FluxConfig cfg = tp_config(2, 2);
  for (const int T : {2, 4}) {
    const ParamLayout whole = ParamLayout::build(cfg);
    std::vector<ParamLayout> ranks;
    for (int r = 0; r < T; ++r) ranks.push_back(ParamLayout::build(cfg, r, T));
    int64_t split_total = 0, replicated_total = 0;
    for (size_t i = 0; i < whole.params().size(); ++i) {
      const ParamInfo& p0 = ranks[0].params()[i];
      const std::vector<double> full = iota(p0.shard.full.numel());
      std::vector<std::vector<double>> shards;
      std::vector<double> covered(full.size(), 0.0);
      for (int r = 0; r < T; ++r) {
        const ParamInfo& p = ranks[static_cast<size_t>(r)].params()[i];
        shards.push_back(take_shard(p.shard, r, full));
        ASSERT_EQ(static_cast<int64_t>(shards.back().size()), p.shape.numel()) << p.name;
        for (const double v : shards.back()) covered[static_cast<size_t>(v)] += 1;
      }
      const double expected = p0.shard.sharded() ? 1.0 : T;
      for (size_t j = 0; j < covered.size(); ++j) ASSERT_EQ(covered[j], expected) << p0.name << " element " << j;
      EXPECT_EQ(assemble_full(p0.shard, shards), full) << p0.name;
      (p0.shard.sharded() ? split_total : replicated_total) += p0.shard.full.numel();
    }
    EXPECT_EQ(split_total + replicated_total, whole.total());
    EXPECT_EQ(ranks[1].total(), split_total / T + replicated_total) << T << " ranks";
  }
}

TEST(TpLayout, Flux12bDevPerRank) {
  // flux_12b_dev: 8,608,346,112 parameters in split block tensors, 3,293,062,208 replicated (3.23B
  // of them the blocks' modulation Linears).
  FluxConfig cfg;
  cfg.guidance_embed = true;
  EXPECT_EQ(ParamLayout::build(cfg).total(), 11'901'408'320);
  EXPECT_EQ(ParamLayout::build(cfg, 1, 2).total(), 8'608'346'112 / 2 + 3'293'062'208);
  EXPECT_EQ(ParamLayout::build(cfg, 3, 4).total(), 8'608'346'112 / 4 + 3'293'062'208);
  int64_t modulation = 0;
  const ParamLayout rank0 = ParamLayout::build(cfg, 0, 2);
  for (const ParamInfo& p : rank0.params())
    if (p.name.find("_mod.lin") != std::string::npos || p.name.find("modulation.lin") != std::string::npos) {
      EXPECT_FALSE(p.shard.sharded()) << p.name;
      modulation += p.shape.numel();
    }
  EXPECT_EQ(modulation, 3'228'567'552);
}

TEST(TpLayout, FusedLinear1GivesEachRankWholeHeadsAndItsMlpSlice) {
  // linear1's rows [q | k | v | mlp] = [24 | 24 | 24 | 60]: rank 1 of 2 holds rows 12..23 of each
  // of q, k, v (heads 2 and 3) and rows 30..59 of the MLP, in that order.
  const FluxConfig cfg = tp_config(0, 1);
  const ParamLayout rank0 = ParamLayout::build(cfg, 0, 2), rank1 = ParamLayout::build(cfg, 1, 2);
  const ParamInfo& p = rank1.at("single_blocks.0.linear1.bias");
  const std::vector<double> local = take_shard(p.shard, 1, iota(3 * 24 + 60));
  std::vector<double> expected;
  for (const int64_t begin : {12, 36, 60}) {
    const std::vector<double> rows = iota(begin + 12);
    expected.insert(expected.end(), rows.begin() + begin, rows.end());
  }
  for (int64_t j = 72 + 30; j < 72 + 60; ++j) expected.push_back(static_cast<double>(j));
  EXPECT_EQ(local, expected);
  const std::vector<ShardPiece> pieces = shard_pieces(p.shard, 1);
  ASSERT_EQ(pieces.size(), 4u);
  EXPECT_EQ(pieces[3].full_begin, 72 + 30);
  EXPECT_EQ(pieces[3].local_begin, 36);
  EXPECT_EQ(pieces[3].count, 30);

  // linear2's columns [attention | mlp] = [24 | 60]: rank 0 holds columns 0..11 and 24..53.
  const ParamInfo& w2 = rank0.at("single_blocks.0.linear2.weight");
  const std::vector<double> full2 = iota(24 * 84);
  const std::vector<double> local2 = take_shard(w2.shard, 0, full2);
  ASSERT_EQ(local2.size(), 24u * 42u);
  for (int64_t r = 0; r < 24; ++r)
    for (int64_t c = 0; c < 42; ++c) {
      const int64_t full_col = c < 12 ? c : 24 + (c - 12);
      ASSERT_EQ(local2[static_cast<size_t>(r * 42 + c)], full2[static_cast<size_t>(r * 84 + full_col)])
          << r << "," << c;
    }
}

TEST(TpLayout, ModelsThatDoNotSplitAreRefusedByNumber) {
  const FluxConfig cfg = tp_config(1, 1);  // 4 heads, M = 60
  const std::string heads = error_of([&] { ParamLayout::build(cfg, 0, 3); });
  EXPECT_NE(heads.find("model 'tp_test': num_heads 4 is not divisible by tensor_model_parallel_size 3"),
            std::string::npos)
      << heads;
  FluxConfig odd_mlp = cfg;
  odd_mlp.mlp_ratio = 2.375;  // M = 57
  const std::string mlp = error_of([&] { BlockWidths::of(odd_mlp, 2); });
  EXPECT_NE(mlp.find("the MLP width 57"), std::string::npos) << mlp;
  EXPECT_NE(mlp.find("tensor_model_parallel_size 2"), std::string::npos) << mlp;
  auto be = make_backend("cpu");
  EXPECT_NE(error_of([&] { ParamStore store(odd_mlp, *be, DType::f32, 1, 2); }).find("MLP width 57"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ParamLayout::build(cfg, 2, 2); }).find("rank 2 is outside a group of 2"), std::string::npos);
}

TEST(TpLayout, InitDrawsEachShardAsPartOfTheFullTensor) {
  const FluxConfig cfg = tp_config(1, 1);
  auto be = make_backend("cpu");
  ParamStore whole(cfg, *be, DType::f64);
  whole.init(42);
  for (int r = 0; r < 2; ++r) {
    ParamStore shard(cfg, *be, DType::f64, r, 2);
    shard.init(42);
    for (const ParamInfo& p : shard.layout().params())
      EXPECT_EQ(to_host(*be, shard.param(p.name)), take_shard(p.shard, r, to_host(*be, whole.param(p.name))))
          << p.name << " on rank " << r;
  }
}

TEST(TpLayout, LoadWeightsTakesTheRanksShardOfAFullFile) {
  const FluxConfig cfg = tp_config(1, 1);
  auto be = make_backend("cpu");
  ParamStore whole(cfg, *be, DType::f32);
  testing::randomize_params(whole, 9);
  testing::TempDir tmp;
  for (const WeightNaming naming : {WeightNaming::reference, WeightNaming::diffusers}) {
    const std::string path = tmp.file(naming == WeightNaming::reference ? "ref.safetensors" : "dif.safetensors");
    save_weights(whole, cfg, path, DType::f32, naming);
    for (int r = 0; r < 2; ++r) {
      ParamStore shard(cfg, *be, DType::f32, r, 2);
      be->fill(shard.flat_params(), std::numeric_limits<double>::quiet_NaN());
      load_weights(shard, cfg, path);
      for (const ParamInfo& p : shard.layout().params())
        EXPECT_EQ(to_host(*be, shard.param(p.name)), take_shard(p.shard, r, to_host(*be, whole.param(p.name))))
            << p.name << " on rank " << r << " from " << path;
    }
  }
  // A shard is not a weights file: saving one is refused, naming the tensor and what to do.
  ParamStore shard(cfg, *be, DType::f32, 0, 2);
  const std::string msg =
      error_of([&] { save_weights(shard, cfg, tmp.file("shard.safetensors"), DType::f32, WeightNaming::reference); });
  EXPECT_NE(msg.find("rank 0 of 2 tensor-parallel ranks"), std::string::npos) << msg;
  EXPECT_NE(msg.find("double_blocks.0.img_attn.qkv.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("assemble"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] {
              reference_weights_writer(shard.layout().params(), FlatSource::on_backend(*be, shard.flat_params()),
                                       DType::f32, {});
            }).find("holds a shard of"),
            std::string::npos);
}

}  // namespace
}  // namespace flux8
